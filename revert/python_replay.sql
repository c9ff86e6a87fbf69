-- Revert pginbox:python_replay
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DROP FUNCTION inbox.python_replay_item_failed(bigint, bigint, text, text, text);
DROP FUNCTION inbox.begin_python_replay_item(bigint, text);
DROP FUNCTION inbox._python_replay_plan(text, bigint, text);
DROP FUNCTION inbox.create_python_replay_plan(text, text, text, text, text, text);
DROP FUNCTION inbox._check_python_handler(text, text);

COMMIT;
