-- Verify pginbox:python_replay
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT 'inbox.create_python_replay_plan(text, text, text, text, text, text)'::regprocedure,
       'inbox.begin_python_replay_item(bigint, text)'::regprocedure,
       'inbox.python_replay_item_failed(bigint, bigint, text, text, text)'::regprocedure,
       'inbox._python_replay_plan(text, bigint, text)'::regprocedure,
       'inbox._check_python_handler(text, text)'::regprocedure;

DO $verify$
BEGIN
    IF pg_catalog.has_function_privilege('public', 'inbox.begin_python_replay_item(bigint, text)', 'EXECUTE')
       OR pg_catalog.has_function_privilege('public', 'inbox.create_python_replay_plan(text, text, text, text, text, text)', 'EXECUTE')
       OR pg_catalog.has_function_privilege('public', 'inbox._python_replay_plan(text, bigint, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'PUBLIC can execute a function of python_replay';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.create_python_replay_plan(text, text, text, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator cannot execute inbox.create_python_replay_plan';
    END IF;
    IF NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.begin_python_replay_item(bigint, text)', 'EXECUTE')
       OR NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.python_replay_item_failed(bigint, bigint, text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_consumer cannot execute inbox.begin_python_replay_item or inbox.python_replay_item_failed';
    END IF;
END
$verify$;

ROLLBACK;
