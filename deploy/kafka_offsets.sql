-- Deploy pginbox:kafka_offsets: written from sql/111_kafka_offsets.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: the Kafka offset protocol (docs/kafka.md, "The offset protocol").
--   inbox.kafka_acquire        on assignment: advance the owner generation of each partition and
--                              return the stored next offset (the consumer seeks there) and whether
--                              the previous owner released it (no: it crashed with a batch in flight)
--   inbox.kafka_store_offsets  in the batch's transaction, with the claims: the next offsets, each
--                              stored only under the generation that read it; any other generation
--                              raises IRK01 and the whole transaction rolls back (fenced)
--   inbox.kafka_release        a clean stop or revocation: the partition is released
--   inbox.kafka_reset_offsets  an operator moves a consumer's position (a rewind: every message read
--                              again answers duplicate); the owner is fenced and acquires again
-- The consumer functions are authorized as claims are (inbox._authorize: a role bound to the
-- consumer). Rows are locked in (topic, partition) order everywhere: an acquire waits for the batch
-- in flight that stores the same partition, and reads what it stored.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

-- Bad input, before anything is written: 22004 (NULL), 22023 (blank, negative, lengths differ).
CREATE OR REPLACE FUNCTION inbox._check_kafka(fn text, consumer text, topics text[], partitions integer[],
                                              numbers bigint[] DEFAULT NULL, numbers_name text DEFAULT NULL)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF consumer IS NULL OR topics IS NULL OR partitions IS NULL
       OR (numbers_name IS NOT NULL AND numbers IS NULL)
       OR array_position(topics, NULL) IS NOT NULL OR array_position(partitions, NULL) IS NOT NULL
       OR (numbers IS NOT NULL AND array_position(numbers, NULL) IS NOT NULL) THEN
        RAISE EXCEPTION '%: consumer, topics, partitions% must not be NULL nor hold NULLs', fn,
            CASE WHEN numbers_name IS NULL THEN '' ELSE ', ' || numbers_name END
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF btrim(consumer) = '' OR EXISTS (SELECT 1 FROM unnest(topics) t WHERE btrim(t) = '') THEN
        RAISE EXCEPTION '%: blank consumer or topic name', fn
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass the pginbox consumer and the Kafka topic names.';
    END IF;
    IF cardinality(topics) <> cardinality(partitions)
       OR (numbers IS NOT NULL AND cardinality(numbers) <> cardinality(partitions)) THEN
        RAISE EXCEPTION '%: topics, partitions% have different lengths (% / %)', fn,
            CASE WHEN numbers_name IS NULL THEN '' ELSE ', ' || numbers_name END,
            cardinality(topics),
            cardinality(partitions)::text || CASE WHEN numbers IS NULL THEN '' ELSE ' / ' || cardinality(numbers) END
            USING ERRCODE = 'invalid_parameter_value', HINT = 'One element per partition in each array.';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(partitions) p WHERE p < 0)
       OR (numbers IS NOT NULL AND EXISTS (SELECT 1 FROM unnest(numbers) n WHERE n < 0)) THEN
        RAISE EXCEPTION '%: negative partition or %', fn, coalesce(numbers_name, 'number')
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Partitions and offsets start at 0.';
    END IF;
    IF (SELECT count(*) FROM (SELECT DISTINCT t, p FROM unnest(topics, partitions) AS x(t, p)) d) <> cardinality(topics) THEN
        RAISE EXCEPTION '%: a partition is named twice', fn
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Name each (topic, partition) once.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_kafka(text, text, text[], integer[], bigint[], text) IS
    'internal: validates the arguments of the Kafka offset functions (22004, 22023)';

CREATE OR REPLACE FUNCTION inbox.kafka_acquire(consumer text, topics text[], partitions integer[], member text DEFAULT NULL)
    RETURNS TABLE (topic text, partition_id integer, generation bigint, next_offset bigint, was_released boolean)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    w record;
    prev inbox.kafka_offset;
BEGIN
    PERFORM inbox._check_kafka('inbox.kafka_acquire', kafka_acquire.consumer, kafka_acquire.topics, kafka_acquire.partitions);
    PERFORM inbox._authorize('inbox.kafka_acquire', kafka_acquire.consumer, NULL);
    FOR w IN SELECT x.t, x.p FROM unnest(kafka_acquire.topics, kafka_acquire.partitions) AS x(t, p) ORDER BY x.t, x.p LOOP
        INSERT INTO inbox.kafka_offset AS o (consumer, topic, partition_id)
        VALUES (kafka_acquire.consumer, w.t, w.p)
        ON CONFLICT ON CONSTRAINT kafka_offset_pkey DO NOTHING;
        SELECT o.* INTO prev FROM inbox.kafka_offset o
         WHERE o.consumer = kafka_acquire.consumer AND o.topic = w.t AND o.partition_id = w.p
           FOR UPDATE;
        UPDATE inbox.kafka_offset o
           SET generation = o.generation + 1, released = false, member = kafka_acquire.member,
               acquired_at = pg_catalog.clock_timestamp()
         WHERE o.consumer = kafka_acquire.consumer AND o.topic = w.t AND o.partition_id = w.p;
        topic := w.t;
        partition_id := w.p;
        generation := prev.generation + 1;
        next_offset := prev.next_offset;
        was_released := prev.released;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox.kafka_acquire(text, text[], integer[], text) IS
    'Kafka: on assignment, advance the owner generation of each partition; returns the stored next offset and whether the previous owner released it';

CREATE OR REPLACE FUNCTION inbox.kafka_store_offsets(consumer text, topics text[], partitions integer[],
                                                     next_offsets bigint[], generations bigint[])
    RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    w record;
    current bigint;
BEGIN
    PERFORM inbox._check_kafka('inbox.kafka_store_offsets', kafka_store_offsets.consumer, kafka_store_offsets.topics,
                               kafka_store_offsets.partitions, kafka_store_offsets.next_offsets, 'next_offsets');
    PERFORM inbox._check_kafka('inbox.kafka_store_offsets', kafka_store_offsets.consumer, kafka_store_offsets.topics,
                               kafka_store_offsets.partitions, kafka_store_offsets.generations, 'generations');
    PERFORM inbox._authorize('inbox.kafka_store_offsets', kafka_store_offsets.consumer, NULL);
    FOR w IN SELECT x.t, x.p, x.n, x.g
               FROM unnest(kafka_store_offsets.topics, kafka_store_offsets.partitions, kafka_store_offsets.next_offsets,
                           kafka_store_offsets.generations) AS x(t, p, n, g)
              ORDER BY x.t, x.p LOOP
        UPDATE inbox.kafka_offset o SET next_offset = w.n, stored_at = pg_catalog.clock_timestamp()
         WHERE o.consumer = kafka_store_offsets.consumer AND o.topic = w.t AND o.partition_id = w.p
           AND o.generation = w.g;
        IF NOT FOUND THEN
            SELECT o.generation INTO current FROM inbox.kafka_offset o
             WHERE o.consumer = kafka_store_offsets.consumer AND o.topic = w.t AND o.partition_id = w.p;
            RAISE EXCEPTION 'inbox.kafka_store_offsets: consumer % no longer owns partition % of topic % (generation %, now %)',
                pg_catalog.quote_literal(kafka_store_offsets.consumer), w.p, pg_catalog.quote_literal(w.t), w.g,
                coalesce(current::text, 'never acquired')
                USING ERRCODE = 'IRK01',
                      DETAIL = 'The partition was assigned again (a rebalance, or an operator''s inbox.kafka_reset_offsets) while this batch ran: the whole transaction rolls back.',
                      HINT = 'Acquire the partition again (inbox.kafka_acquire) and read from the offset it returns.';
        END IF;
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox.kafka_store_offsets(text, text[], integer[], bigint[], bigint[]) IS
    'Kafka: store next offsets in the batch''s transaction, each under the generation that read it; another generation raises IRK01 (fenced)';

CREATE OR REPLACE FUNCTION inbox.kafka_release(consumer text, topics text[], partitions integer[], generations bigint[])
    RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n integer := 0;
    w record;
BEGIN
    PERFORM inbox._check_kafka('inbox.kafka_release', kafka_release.consumer, kafka_release.topics,
                               kafka_release.partitions, kafka_release.generations, 'generations');
    PERFORM inbox._authorize('inbox.kafka_release', kafka_release.consumer, NULL);
    FOR w IN SELECT x.t, x.p, x.g FROM unnest(kafka_release.topics, kafka_release.partitions, kafka_release.generations) AS x(t, p, g)
              ORDER BY x.t, x.p LOOP
        UPDATE inbox.kafka_offset o SET released = true
         WHERE o.consumer = kafka_release.consumer AND o.topic = w.t AND o.partition_id = w.p AND o.generation = w.g;
        IF FOUND THEN
            n := n + 1;
        END IF;
    END LOOP;
    RETURN n;
END
$$;
COMMENT ON FUNCTION inbox.kafka_release(text, text[], integer[], bigint[]) IS
    'Kafka: release partitions held under these generations (a clean stop); returns how many were still held';

CREATE OR REPLACE FUNCTION inbox.kafka_reset_offsets(consumer text, topic text, next_offset bigint,
                                                     partitions integer[] DEFAULT NULL)
    RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n integer;
BEGIN
    PERFORM inbox._check_kafka('inbox.kafka_reset_offsets', kafka_reset_offsets.consumer, ARRAY[kafka_reset_offsets.topic],
                               ARRAY[0], ARRAY[kafka_reset_offsets.next_offset], 'next_offset');
    IF partitions IS NOT NULL THEN
        PERFORM inbox._check_kafka('inbox.kafka_reset_offsets', kafka_reset_offsets.consumer,
                                   array_fill(kafka_reset_offsets.topic, ARRAY[cardinality(partitions)]), partitions);
    END IF;
    WITH locked AS (
        SELECT o.consumer, o.topic, o.partition_id FROM inbox.kafka_offset o
         WHERE o.consumer = kafka_reset_offsets.consumer AND o.topic = kafka_reset_offsets.topic
           AND (kafka_reset_offsets.partitions IS NULL OR o.partition_id = ANY (kafka_reset_offsets.partitions))
         ORDER BY o.partition_id FOR UPDATE)
    UPDATE inbox.kafka_offset o
       SET next_offset = kafka_reset_offsets.next_offset, generation = o.generation + 1, released = true,
           stored_at = pg_catalog.clock_timestamp()
      FROM locked l
     WHERE o.consumer = l.consumer AND o.topic = l.topic AND o.partition_id = l.partition_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF partitions IS NOT NULL AND n < cardinality(partitions) THEN
        INSERT INTO inbox.kafka_offset AS o (consumer, topic, partition_id, next_offset, stored_at)
        SELECT kafka_reset_offsets.consumer, kafka_reset_offsets.topic, p, kafka_reset_offsets.next_offset, pg_catalog.clock_timestamp()
          FROM unnest(partitions) p
        ON CONFLICT ON CONSTRAINT kafka_offset_pkey DO NOTHING;
        n := cardinality(partitions);
    END IF;
    RETURN n;
END
$$;
COMMENT ON FUNCTION inbox.kafka_reset_offsets(text, text, bigint, integer[]) IS
    'Kafka, operators: move a consumer''s stored position on a topic (all its partitions, or the listed ones); the owner is fenced and acquires again';

REVOKE ALL ON FUNCTION inbox._check_kafka(text, text, text[], integer[], bigint[], text) FROM PUBLIC;
REVOKE ALL ON FUNCTION inbox.kafka_acquire(text, text[], integer[], text) FROM PUBLIC;
REVOKE ALL ON FUNCTION inbox.kafka_store_offsets(text, text[], integer[], bigint[], bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION inbox.kafka_release(text, text[], integer[], bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION inbox.kafka_reset_offsets(text, text, bigint, integer[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.kafka_acquire(text, text[], integer[], text) TO inbox_consumer;
GRANT EXECUTE ON FUNCTION inbox.kafka_store_offsets(text, text[], integer[], bigint[], bigint[]) TO inbox_consumer;
GRANT EXECUTE ON FUNCTION inbox.kafka_release(text, text[], integer[], bigint[]) TO inbox_consumer;
GRANT EXECUTE ON FUNCTION inbox.kafka_reset_offsets(text, text, bigint, integer[]) TO inbox_operator;

COMMIT;
