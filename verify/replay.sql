-- Verify pginbox:replay
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT plan_id, plan_name, consumer, message_type, handler, handler_version, status, total, pending, applied, failed,
       skipped, registered_handler, registered_version, pin_matches, created_at, created_by, stopped_at, finished_at
  FROM inbox.replay_status WHERE false;

DO $verify$
BEGIN
    IF pg_catalog.has_function_privilege('public', 'inbox.versioned_consumer(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.versioned_consumer(text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.versioned_consumer(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox.versioned_consumer(text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.versioned_consumer(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.versioned_consumer(text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_reader', 'inbox.versioned_consumer(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_reader cannot execute inbox.versioned_consumer(text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.replay_operation_id(bigint, text, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.replay_operation_id(bigint, text, text, text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.replay_operation_id(bigint, text, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.replay_operation_id(bigint, text, text, text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_reader', 'inbox.replay_operation_id(bigint, text, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_reader cannot execute inbox.replay_operation_id(bigint, text, text, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._check_replay_note(text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._check_replay_note(text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._lock_replay_plan(text, bigint)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._lock_replay_plan(text, bigint)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._check_plan_active(text, inbox.replay_plan)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._check_plan_active(text, inbox.replay_plan)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._check_sql_plan(text, inbox.replay_plan)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._check_sql_plan(text, inbox.replay_plan)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._check_registered_pair(text, text, text, regprocedure, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._check_registered_pair(text, text, text, regprocedure, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.create_replay_plan(text, text, text, regprocedure, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.create_replay_plan(text, text, text, regprocedure, text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.create_replay_plan(text, text, text, regprocedure, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.create_replay_plan(text, text, text, regprocedure, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.add_replay_items(bigint, jsonb)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.add_replay_items(bigint, jsonb)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.add_replay_items(bigint, jsonb)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.add_replay_items(bigint, jsonb)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.accept_replay_version(bigint, regprocedure, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.accept_replay_version(bigint, regprocedure, text, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.accept_replay_version(bigint, regprocedure, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.accept_replay_version(bigint, regprocedure, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.cancel_replay_plan(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.cancel_replay_plan(bigint, text)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.cancel_replay_plan(bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.cancel_replay_plan(bigint, text)';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._replay_run_start(bigint, integer)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._replay_run_start(bigint, integer)';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_operator', 'inbox._replay_run_start(bigint, integer)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator can execute inbox._replay_run_start(bigint, integer), a half of run_replay_plan that is its own';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._replay_next(bigint)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._replay_next(bigint)';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_operator', 'inbox._replay_next(bigint)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator can execute inbox._replay_next(bigint), a half of run_replay_plan that is its own';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._begin_replay_item(bigint, bigint)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._begin_replay_item(bigint, bigint)';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_operator', 'inbox._begin_replay_item(bigint, bigint)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator can execute inbox._begin_replay_item(bigint, bigint), a half of run_replay_plan that is its own';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._replay_item_failed(bigint, bigint, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._replay_item_failed(bigint, bigint, text, text)';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_operator', 'inbox._replay_item_failed(bigint, bigint, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator can execute inbox._replay_item_failed(bigint, bigint, text, text), a half of run_replay_plan that is its own';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox._replay_run_finish(bigint)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox._replay_run_finish(bigint)';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_operator', 'inbox._replay_run_finish(bigint)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator can execute inbox._replay_run_finish(bigint), a half of run_replay_plan that is its own';
    END IF;
    IF pg_catalog.has_function_privilege('public', 'inbox.run_replay_plan(bigint, integer)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute inbox.run_replay_plan(bigint, integer)';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.run_replay_plan(bigint, integer)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.run_replay_plan(bigint, integer)';
    END IF;
    IF NOT pg_catalog.has_table_privilege('inbox_reader', 'inbox.replay_status', 'SELECT') THEN
        RAISE EXCEPTION 'inbox_reader cannot read inbox.replay_status';
    END IF;
    IF pg_catalog.has_column_privilege('inbox_reader', 'inbox.replay_item', 'payload', 'SELECT') THEN
        RAISE EXCEPTION 'inbox_reader can read inbox.replay_item.payload';
    END IF;
    IF NOT pg_catalog.has_column_privilege('inbox_operator', 'inbox.replay_item', 'payload', 'SELECT') THEN
        RAISE EXCEPTION 'inbox_operator cannot read inbox.replay_item.payload';
    END IF;
END
$verify$;

-- A plan stays within the rights of a role bound to the consumer (0.2.0), confined and as its own
-- SECURITY DEFINER function (0.3.0).
SELECT 1 / (p.prosecdef AND pg_catalog.strpos(p.prosrc, 'inbox._run_for_operator(') > 0)::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox.run_replay_plan(bigint, integer)'::regprocedure;
SELECT 1 / (p.prosrc LIKE '%inbox._check_operator_run(%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._replay_run_start(bigint, integer)'::regprocedure;

ROLLBACK;
