-- Revert pginbox:replay
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

DROP FUNCTION inbox.run_replay_plan(bigint, integer);
DROP FUNCTION inbox._replay_run_finish(bigint);
DROP FUNCTION inbox._replay_item_failed(bigint, bigint, text, text);
DROP FUNCTION inbox._begin_replay_item(bigint, bigint);
DROP FUNCTION inbox._replay_next(bigint);
DROP FUNCTION inbox._replay_run_start(bigint, integer);
DROP FUNCTION inbox.cancel_replay_plan(bigint, text);
DROP FUNCTION inbox.accept_replay_version(bigint, regprocedure, text, text);
DROP FUNCTION inbox.add_replay_items(bigint, jsonb);
DROP FUNCTION inbox.create_replay_plan(text, text, text, regprocedure, text, text);
DROP FUNCTION inbox._check_registered_pair(text, text, text, regprocedure, text);
DROP FUNCTION inbox._check_plan_active(text, inbox.replay_plan);
DROP FUNCTION inbox._lock_replay_plan(text, bigint);
DROP FUNCTION inbox._check_replay_note(text, text);
DROP FUNCTION inbox.replay_operation_id(bigint, text, text, text, text);
DROP FUNCTION inbox.versioned_consumer(text, text);
DROP VIEW inbox.replay_status;

COMMIT;
