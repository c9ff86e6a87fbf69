-- Verify pginbox:quarantine
BEGIN;

DO $verify$
BEGIN
    IF pg_catalog.has_function_privilege('public', 'inbox._lock_open_entry(text, bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._lock_open_entry(text, bigint, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._close_entry(inbox.quarantine, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._close_entry(inbox.quarantine, text, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.discard(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.discard(bigint, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.discard(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.discard(bigint, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.release(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.release(bigint, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.release(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.release(bigint, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._begin_repair(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._begin_repair(bigint, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox._begin_repair(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox._begin_repair(bigint, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._repair_failed(bigint, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._repair_failed(bigint, text, text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox._repair_failed(bigint, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox._repair_failed(bigint, text, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.repair(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.repair(bigint, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.repair(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.repair(bigint, text)';
    END IF;
END
$verify$;

-- 0.2.0: repair stays within the consumer's rights.
SELECT 1 / (p.prosrc LIKE '%inbox._check_operator_run(%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._begin_repair(bigint, text)'::regprocedure;

ROLLBACK;
