-- Verify pginbox:quarantine
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

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
    IF pg_catalog.has_function_privilege('public', 'inbox._settle_hold(text, inbox.quarantine, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._settle_hold(text, inbox.quarantine, text)';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_operator', 'inbox._settle_hold(text, inbox.quarantine, text)', 'EXECUTE')
       OR pg_catalog.has_function_privilege('inbox_consumer', 'inbox._settle_hold(text, inbox.quarantine, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'a group role can execute inbox._settle_hold(text, inbox.quarantine, text), the claim of the repairs';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._begin_repair(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._begin_repair(bigint, text)';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_operator', 'inbox._begin_repair(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator can execute inbox._begin_repair(bigint, text), the half of repair that is repair''s own';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._repair_failed(bigint, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._repair_failed(bigint, text, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_operator', 'inbox._repair_failed(bigint, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator can execute inbox._repair_failed(bigint, text, text, text), the half of repair that is repair''s own';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.repair(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.repair(bigint, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.repair(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.repair(bigint, text)';
    END IF;
END
$verify$;

-- repair stays within the rights of a role bound to the consumer (0.2.0), confined and as its own
-- SECURITY DEFINER function (0.3.0).
SELECT 1 / (p.prosecdef AND pg_catalog.strpos(p.prosrc, 'inbox._run_for_operator(') > 0)::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox.repair(bigint, text)'::regprocedure;
SELECT 1 / (p.prosrc LIKE '%inbox._check_operator_run(%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._begin_repair(bigint, text)'::regprocedure;
-- The hold becomes a processed claim by one rule (0.3.0): inbox._settle_hold, invoker, owner only.
SELECT 1 / (p.prosrc LIKE '%inbox._settle_hold(%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._begin_repair(bigint, text)'::regprocedure;
SELECT 1 / (NOT p.prosecdef)::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._settle_hold(text, inbox.quarantine, text)'::regprocedure;

ROLLBACK;
