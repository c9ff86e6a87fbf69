-- Deploy pginbox:kafka_offset_tables: written from sql/110_kafka_offset_tables.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: Kafka consumption progress in the database (docs/kafka.md). `pginbox consume` stores the
-- next offset of every partition it consumed in the transaction that claims and applies the batch,
-- so that a rollback, a crash or a failover rolls the position back with the data. A partition's
-- row has an owner generation: each assignment advances it (inbox.kafka_acquire), and an offset is
-- stored only under the generation that read it (inbox.kafka_store_offsets): a consumer whose
-- partition was reassigned while its batch ran is fenced, and its whole transaction rolls back.
-- Tables only: the functions are in 111_kafka_offsets.sql.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

CREATE TABLE inbox.kafka_offset (
    consumer text NOT NULL,
    topic text NOT NULL,
    partition_id integer NOT NULL CHECK (partition_id >= 0),
    next_offset bigint CHECK (next_offset >= 0),
    generation bigint NOT NULL DEFAULT 0 CHECK (generation >= 0),
    released boolean NOT NULL DEFAULT true,
    member text,
    acquired_at timestamptz,
    stored_at timestamptz,
    PRIMARY KEY (consumer, topic, partition_id)
);
COMMENT ON TABLE inbox.kafka_offset IS
    'Kafka: per (consumer, topic, partition) the next offset to read, stored with the claims; the owner generation fences a reassigned partition';
COMMENT ON COLUMN inbox.kafka_offset.next_offset IS
    'the offset the next owner starts at (NULL: never stored; the broker''s committed offset or auto.offset.reset decides)';
COMMENT ON COLUMN inbox.kafka_offset.generation IS
    'advanced by every assignment (inbox.kafka_acquire); an offset stored under an older one is refused (SQLSTATE IRK01)';
COMMENT ON COLUMN inbox.kafka_offset.released IS
    'false while an owner holds the partition; an owner that stopped without releasing it crashed: what it had in flight comes back marked redelivered';

GRANT SELECT ON inbox.kafka_offset TO inbox_reader, inbox_operator;

COMMIT;
