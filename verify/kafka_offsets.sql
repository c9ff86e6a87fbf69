-- Verify pginbox:kafka_offsets
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT 'inbox._check_kafka(text, text, text[], integer[], bigint[], text)'::regprocedure;
SELECT 'inbox.kafka_acquire(text, text[], integer[], text)'::regprocedure;
SELECT 'inbox.kafka_store_offsets(text, text[], integer[], bigint[], bigint[])'::regprocedure;
SELECT 'inbox.kafka_release(text, text[], integer[], bigint[])'::regprocedure;
SELECT 'inbox.kafka_reset_offsets(text, text, bigint, integer[])'::regprocedure;

ROLLBACK;
