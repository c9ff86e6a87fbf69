-- Revert pginbox:kafka_offset_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DROP TABLE inbox.kafka_offset;

COMMIT;
