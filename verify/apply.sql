-- Verify pginbox:apply
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

-- 0.3.0: the message type rule, an accept test and its faults.
SELECT 1 / (inbox._message_type_ok('t') AND (inbox._message_type_problem(' '))[1] = '22023')::integer;

DO $verify$
BEGIN
    IF pg_catalog.has_function_privilege('public', 'inbox._check_message_type(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._check_message_type(text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox._check_message_type(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox._check_message_type(text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.register_handler(text, text, regprocedure, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.register_handler(text, text, regprocedure, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.register_handler(text, text, regprocedure, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.register_handler(text, text, regprocedure, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.claim_and_apply_batch(text, jsonb)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.claim_and_apply_batch(text, jsonb)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.claim_and_apply_batch(text, jsonb)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox.claim_and_apply_batch(text, jsonb)';
    END IF;
END
$verify$;

SELECT 'inbox._is_transient(text)'::regprocedure, 'inbox._check_batch(text, text, jsonb, boolean)'::regprocedure,
       'inbox._batch_fields_ok(jsonb, text, boolean)'::regprocedure,
       'inbox._check_handler(text, regprocedure, text, text)'::regprocedure,
       'inbox._run_handler(regprocedure, boolean, jsonb, inbox.message_context)'::regprocedure,
       'inbox._run_handler_batch(regprocedure, boolean, jsonb[], inbox.message_context[])'::regprocedure,
       'inbox._generate_dispatcher()'::regprocedure, 'inbox._begin_apply_batch(text, jsonb, text)'::regprocedure,
       'inbox._privileged_definer(boolean, oid)'::regprocedure, 'inbox._batch_step'::regtype, 'inbox._batch_element'::regtype,
       'inbox.claim_batch(text, jsonb, text)'::regprocedure,
       'inbox._unclaim(text, text, text, text)'::regprocedure;
SELECT 1 / (p.prosrc LIKE '%inbox._acting_as(%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz)'::regprocedure;

-- 0.3.0: the generated dispatcher's bodies are quoted literals, its names format('%I.%I').
SELECT 1 / (pg_catalog.strpos(p.prosrc, 'AS %L') > 0 AND pg_catalog.strpos(p.prosrc, 'LOCK TABLE inbox.handler') > 0)::integer
  FROM pg_catalog.pg_proc p WHERE p.oid = 'inbox._generate_dispatcher()'::regprocedure;

ROLLBACK;
