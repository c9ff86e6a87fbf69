-- Revert pginbox:retention_watermark_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DROP TABLE inbox.watermark_change;
ALTER TABLE inbox.purge_state DROP COLUMN purged_produced_max;
ALTER TABLE inbox.quarantine DROP COLUMN release_used_at;

COMMIT;
