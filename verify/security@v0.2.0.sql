-- Verify pginbox:security
BEGIN;

SELECT 'inbox._consumer_base(text)'::regprocedure, 'inbox._may_act_as(text, text)'::regprocedure, 'inbox._acting_as(text, text)'::regprocedure,
       'inbox._authorize(text, text, text)'::regprocedure, 'inbox._check_note(text, text)'::regprocedure,
       'inbox._check_operator_run(text, text, regprocedure, text, boolean)'::regprocedure;
SELECT 1 / (pg_catalog.has_function_privilege('inbox_operator', f, 'EXECUTE')
            AND NOT pg_catalog.has_function_privilege('inbox_consumer', f, 'EXECUTE')
            AND NOT pg_catalog.has_function_privilege('public', f, 'EXECUTE'))::integer
  FROM unnest(ARRAY['inbox.bind_consumer(text, regrole, text[], text)', 'inbox.unbind_consumer(text, regrole, text)',
                    'inbox.configure_security(boolean, boolean, interval, text)']) f;

ROLLBACK;
