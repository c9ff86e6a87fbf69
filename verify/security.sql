-- Verify pginbox:security
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT 'inbox._consumer_base(text)'::regprocedure, 'inbox._may_act_as(text, text)'::regprocedure, 'inbox._acting_as(text, text)'::regprocedure,
       'inbox._authorize(text, text, text)'::regprocedure, 'inbox._check_note(text, text)'::regprocedure,
       'inbox._check_operator_run(text, text, text, regprocedure, text, boolean)'::regprocedure,
       'inbox._caller()'::regprocedure, 'inbox._real_member(name, oid)'::regprocedure,
       'inbox._role_may_act_as(oid, text, text)'::regprocedure, 'inbox._lock_key(text, text)'::regprocedure,
       'inbox._run_for_operator(text, text, text, oid, regprocedure, boolean, jsonb, inbox.message_context)'::regprocedure;
-- 0.3.0: no session setting decides who acts as whom; operator decisions run handlers confined, as
-- inbox_runner, which holds no rights and nobody can execute it but the owner.
SELECT 1 / (pg_catalog.strpos(p.prosrc, 'operator_run''') = 0 AND pg_catalog.strpos(p.prosrc, 'inbox.operator_run r') > 0)::integer
  FROM pg_catalog.pg_proc p WHERE p.oid = 'inbox._authorize(text, text, text)'::regprocedure;
SELECT 1 / (p.prosecdef AND p.proowner = 'inbox_runner'::regrole)::integer
  FROM pg_catalog.pg_proc p WHERE p.oid = 'inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context)'::regprocedure;
SELECT 1 / (NOT pg_catalog.has_schema_privilege('inbox_runner', 'inbox', 'USAGE'))::integer;
SELECT 1 / (NOT pg_catalog.has_function_privilege(r, 'inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context)', 'EXECUTE')
            AND NOT pg_catalog.has_function_privilege(r, 'inbox._run_for_operator(text, text, text, oid, regprocedure, boolean, jsonb, inbox.message_context)', 'EXECUTE'))::integer
  FROM unnest(ARRAY['inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_dispatcher', 'public']) r;
SELECT 1 / (pg_catalog.has_function_privilege('inbox_operator', f, 'EXECUTE')
            AND NOT pg_catalog.has_function_privilege('inbox_consumer', f, 'EXECUTE')
            AND NOT pg_catalog.has_function_privilege('public', f, 'EXECUTE'))::integer
  FROM unnest(ARRAY['inbox.bind_consumer(text, regrole, text[], text)', 'inbox.unbind_consumer(text, regrole, text)',
                    'inbox.configure_security(boolean, boolean, interval, text)']) f;

ROLLBACK;
