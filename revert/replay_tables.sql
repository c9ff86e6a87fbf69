-- Revert pginbox:replay_tables
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

-- The retention holds replay plans took (holder replay:<plan_id>) go with the plans.
DELETE FROM inbox.retention_hold WHERE holder LIKE 'replay:%';
DROP TYPE inbox.replay_run;
DROP TYPE inbox._replay_step;
DROP TABLE inbox.replay_decision;
DROP TABLE inbox.replay_item;
DROP TABLE inbox.replay_plan;

COMMIT;
