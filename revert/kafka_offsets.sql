-- Revert pginbox:kafka_offsets
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DROP FUNCTION inbox.kafka_reset_offsets(text, text, bigint, integer[]);
DROP FUNCTION inbox.kafka_release(text, text[], integer[], bigint[]);
DROP FUNCTION inbox.kafka_store_offsets(text, text[], integer[], bigint[], bigint[]);
DROP FUNCTION inbox.kafka_acquire(text, text[], integer[], text);
DROP FUNCTION inbox._check_kafka(text, text, text[], integer[], bigint[], text);

COMMIT;
