-- Revert pginbox:outbox_defer_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

ALTER TABLE inbox.outbox DROP COLUMN deferrals, DROP COLUMN deferred_at, DROP COLUMN deferred_reason;

COMMIT;
