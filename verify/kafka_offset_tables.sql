-- Verify pginbox:kafka_offset_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT consumer, topic, partition_id, next_offset, generation, released, member, acquired_at, stored_at
  FROM inbox.kafka_offset WHERE false;

ROLLBACK;
