-- Verify pginbox:claim
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT inbox.payload_hash('{}'::jsonb);
-- 0.3.0: control characters in names and ids are refused.
SELECT 1 / (inbox._has_control(E'a\nb') AND NOT inbox._has_control('ab'))::integer;
SELECT 'inbox._delivery_ok(integer, integer, text)'::regprocedure, 'inbox._check_optional(text, text, text)'::regprocedure,
       'inbox._held_by(inbox.delivery_result)'::regprocedure, 'inbox._check_identity(text, text, text, text, text)'::regprocedure,
       'inbox._settings(text)'::regprocedure, 'inbox._default_settings(text)'::regprocedure,
       'inbox._identity_ok(text, text, text, text)'::regprocedure, 'inbox._blank(text)'::regprocedure,
       'inbox._payload_size(jsonb)'::regprocedure, 'inbox._default_clock_tolerance()'::regprocedure,
       'inbox._check_produced_at(text, text, text, timestamptz)'::regprocedure;
-- 0.3.0: each rule an accept test and its faults, raised by one function.
SELECT 'inbox._identity_problem(text, text, text, text)'::regprocedure,
       'inbox._delivery_problem(integer, integer, text)'::regprocedure,
       'inbox._raise_problem(text, text[])'::regprocedure;
SELECT 1 / (inbox._identity_problem('c', 'p', 'm', '') IS NULL
            AND (inbox._identity_problem('c', 'p', '', ''))[1] = '22023')::integer;
-- 0.2.0: claims are authorized (the claim asks inbox._acting_as), readers get no hash function.
SELECT 1 / (p.prosrc LIKE '%inbox._acting_as(%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox.claim(text, text, text, jsonb, text, text, timestamptz)'::regprocedure;
SELECT 1 / (NOT pg_catalog.has_function_privilege('inbox_reader', 'inbox.payload_hash(jsonb, text[])', 'EXECUTE'))::integer;

DO $verify$
BEGIN
    IF pg_catalog.has_function_privilege('public', 'inbox._check_delivery(text, integer, integer, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._check_delivery(text, integer, integer, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._claim_core(text, text, text, text, bytea, text, timestamptz, jsonb, bytea, boolean, text, timestamptz, boolean)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._claim_core(text, text, text, text, bytea, text, timestamptz, jsonb, bytea, boolean, text, timestamptz, boolean)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.claim(text, text, text, jsonb, text, text, timestamptz)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.claim(text, text, text, jsonb, text, text, timestamptz)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.claim(text, text, text, jsonb, text, text, timestamptz)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox.claim(text, text, text, jsonb, text, text, timestamptz)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.claim_bytea(text, text, text, bytea, text, text, timestamptz)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.claim_bytea(text, text, text, bytea, text, text, timestamptz)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.claim_bytea(text, text, text, bytea, text, text, timestamptz)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox.claim_bytea(text, text, text, bytea, text, text, timestamptz)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._quarantine_failure(inbox.attempt, text, text, integer, jsonb, text, boolean)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._quarantine_failure(inbox.attempt, text, text, integer, jsonb, text, boolean)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._record_failure_core(inbox.consumer_config, text, text, text, text, jsonb, bytea, text, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._record_failure_core(inbox.consumer_config, text, text, text, text, jsonb, bytea, text, text, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._check_reason(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._check_reason(text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.record_start(text, text, text, text, text, jsonb, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.record_start(text, text, text, text, text, jsonb, text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.record_start(text, text, text, text, text, jsonb, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox.record_start(text, text, text, text, text, jsonb, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.configure_consumer(text, text[], integer, boolean, integer, boolean)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.configure_consumer(text, text[], integer, boolean, integer, boolean)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.configure_consumer(text, text[], integer, boolean, integer, boolean)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.configure_consumer(text, text[], integer, boolean, integer, boolean)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox._reason_code(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox._reason_code(text, text)';
    END IF;
END
$verify$;

ROLLBACK;
