-- Revert pginbox:retention
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

DROP TABLE inbox.retention_hold;

COMMIT;
