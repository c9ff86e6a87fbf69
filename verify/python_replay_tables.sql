-- Verify pginbox:python_replay_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT plan_id, handler, python_handler FROM inbox.replay_plan WHERE false;
SELECT 1/count(*) FROM pg_catalog.pg_constraint
 WHERE conrelid = 'inbox.replay_plan'::regclass AND conname = 'replay_plan_one_handler';
SELECT (NULL::inbox.python_replay_step).action;

ROLLBACK;
