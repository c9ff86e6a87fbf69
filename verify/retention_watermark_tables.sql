-- Verify pginbox:retention_watermark_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT release_used_at FROM inbox.quarantine WHERE false;
SELECT purged_produced_max FROM inbox.purge_state WHERE false;
SELECT change_id, consumer, producer, previous_watermark, watermark, purged_produced_max, changed_by, changed_at, note
  FROM inbox.watermark_change WHERE false;

ROLLBACK;
