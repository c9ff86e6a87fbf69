-- Revert pginbox:retention_tables
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

DROP INDEX inbox.message_purge_idx;
DROP TABLE inbox.purge_state;
DROP TABLE inbox.activity_gap;
DROP TABLE inbox.retention_policy_change;
DROP TABLE inbox.retention_policy;
DROP TABLE inbox.retention_hold;

COMMIT;
