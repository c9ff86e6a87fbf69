-- Revert pginbox:security_tables
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

ALTER TABLE inbox.quarantine DROP COLUMN recorded_by;
DROP TABLE inbox.security_settings;
DROP TABLE inbox.binding_change;
DROP TABLE inbox.consumer_binding;

COMMIT;
