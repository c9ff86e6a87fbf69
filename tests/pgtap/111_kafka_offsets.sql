-- pgTAP: sql/110_kafka_offset_tables.sql and sql/111_kafka_offsets.sql, the Kafka offset protocol
-- (docs/kafka.md): an assignment advances the owner generation and returns the stored offset; an
-- offset is stored only under the generation that read it, and a fenced store (IRK01) rolls back
-- the claims of its transaction with it; a release tells the next owner nothing was in flight; an
-- operator's reset fences the owner; bad input is refused before anything is written; only a role
-- bound to the consumer acquires and stores.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(32);

CREATE SCHEMA tapk;
CREATE TABLE tapk.ledger (message_id text NOT NULL);
CREATE FUNCTION tapk.credit(payload jsonb, ctx inbox.message_context) RETURNS void LANGUAGE sql
    BEGIN ATOMIC INSERT INTO tapk.ledger VALUES (ctx.message_id); END;
SELECT inbox.register_handler('kc', 'credit', 'tapk.credit(jsonb, inbox.message_context)'::regprocedure, 'v1') \g /dev/null

-- ================================================================== acquire, store, fence
SELECT results_eq($$SELECT topic, partition_id, generation, next_offset, was_released
                      FROM inbox.kafka_acquire('kc', ARRAY['orders', 'orders'], ARRAY[1, 0], 'member-a')$$,
                  $$VALUES ('orders', 0, 1::bigint, NULL::bigint, true), ('orders', 1, 1::bigint, NULL::bigint, true)$$,
                  'a first assignment: generation 1, nothing stored, in (topic, partition) order');
SELECT lives_ok($$SELECT inbox.kafka_store_offsets('kc', ARRAY['orders', 'orders'], ARRAY[0, 1], ARRAY[5, 7]::bigint[], ARRAY[1, 1]::bigint[])$$,
                'the owner stores under its generation');
SELECT results_eq($$SELECT partition_id, next_offset, generation, released, member FROM inbox.kafka_offset
                     WHERE consumer = 'kc' ORDER BY partition_id$$,
                  $$VALUES (0, 5::bigint, 1::bigint, false, 'member-a'), (1, 7::bigint, 1::bigint, false, 'member-a')$$,
                  'the offsets are stored, the partitions held');
SELECT results_eq($$SELECT generation, next_offset, was_released FROM inbox.kafka_acquire('kc', ARRAY['orders'], ARRAY[0], 'member-b')$$,
                  $$VALUES (2::bigint, 5::bigint, false)$$,
                  'a reassignment: the next generation, the stored offset, and "not released" (the owner had not stopped)');
SELECT throws_ok($$SELECT inbox.kafka_store_offsets('kc', ARRAY['orders'], ARRAY[0], ARRAY[9]::bigint[], ARRAY[1]::bigint[])$$,
                 'IRK01', NULL, 'the previous owner is fenced: IRK01');
SELECT is((SELECT next_offset FROM inbox.kafka_offset WHERE consumer = 'kc' AND partition_id = 0), 5::bigint,
          'the fenced store wrote nothing');
SELECT throws_ok($$SELECT inbox.kafka_store_offsets('kc', ARRAY['orders', 'orders'], ARRAY[0, 1], ARRAY[9, 9]::bigint[], ARRAY[2, 2]::bigint[])$$,
                 'IRK01', NULL, 'one fenced partition fails the whole call');
SELECT is((SELECT array_agg(next_offset ORDER BY partition_id) FROM inbox.kafka_offset WHERE consumer = 'kc'), ARRAY[5, 7]::bigint[],
          'and nothing of it is stored (partition 0 was updated before partition 1 was refused)');
SELECT throws_ok($$SELECT inbox.kafka_store_offsets('kc', ARRAY['orders'], ARRAY[3], ARRAY[1]::bigint[], ARRAY[1]::bigint[])$$,
                 'IRK01', NULL, 'a partition never acquired cannot be stored');

-- The batch's transaction: claims, the handler's writes and the offsets commit or roll back together.
CREATE FUNCTION tapk.batch(gen bigint) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM inbox.claim_and_apply('kc', 'shop', 'm-' || gen, 'credit', '{}');
    PERFORM inbox.kafka_store_offsets('kc', ARRAY['orders'], ARRAY[0], ARRAY[6]::bigint[], ARRAY[gen]);
END $$;
SELECT throws_ok($$SELECT tapk.batch(1)$$, 'IRK01', NULL, 'a fenced batch fails');
SELECT is((SELECT count(*) FROM inbox.message WHERE consumer = 'kc' AND message_id = 'm-1'), 0::bigint,
          'its claim rolled back with it');
SELECT is((SELECT count(*) FROM tapk.ledger WHERE message_id = 'm-1'), 0::bigint, 'and its handler''s writes');
SELECT lives_ok($$SELECT tapk.batch(2)$$, 'the owner''s batch commits');
SELECT results_eq($$SELECT (SELECT count(*) FROM inbox.message WHERE consumer = 'kc' AND message_id = 'm-2'),
                           (SELECT count(*) FROM tapk.ledger WHERE message_id = 'm-2'),
                           (SELECT next_offset FROM inbox.kafka_offset WHERE consumer = 'kc' AND partition_id = 0)$$,
                  $$VALUES (1::bigint, 1::bigint, 6::bigint)$$, 'claim, write and offset together');

-- ================================================================== release
SELECT is(inbox.kafka_release('kc', ARRAY['orders', 'orders'], ARRAY[0, 1], ARRAY[2, 2]::bigint[]), 1,
          'a release counts the partitions still held under that generation (partition 1 is at generation 1)');
SELECT is((SELECT was_released FROM inbox.kafka_acquire('kc', ARRAY['orders'], ARRAY[0], 'member-c')), true,
          'the next owner learns that nothing was in flight');
SELECT is((SELECT was_released FROM inbox.kafka_acquire('kc', ARRAY['orders'], ARRAY[1], 'member-c')), false,
          'a partition whose owner never released it: something may have been in flight');

-- ================================================================== operators reset
SELECT is(inbox.kafka_reset_offsets('kc', 'orders', 0), 2, 'an operator rewinds both partitions to 0');
SELECT throws_ok($$SELECT inbox.kafka_store_offsets('kc', ARRAY['orders'], ARRAY[0], ARRAY[8]::bigint[], ARRAY[3]::bigint[])$$,
                 'IRK01', NULL, 'the owner is fenced by the reset');
SELECT results_eq($$SELECT next_offset, was_released FROM inbox.kafka_acquire('kc', ARRAY['orders'], ARRAY[0], 'member-c')$$,
                  $$VALUES (0::bigint, true)$$, 'acquired again: the rewound offset, and no crash suspected');
SELECT is(inbox.kafka_reset_offsets('kc', 'fresh', 3, ARRAY[0, 2]), 2, 'a reset may set the start of partitions never consumed');
SELECT results_eq($$SELECT partition_id, next_offset FROM inbox.kafka_acquire('kc', ARRAY['fresh'], ARRAY[2], NULL)$$,
                  $$VALUES (2, 3::bigint)$$, 'and the first owner starts there');

-- ================================================================== bad input
SELECT throws_ok($$SELECT * FROM inbox.kafka_acquire(NULL, ARRAY['orders'], ARRAY[0])$$, '22004', NULL, 'no consumer: 22004');
SELECT throws_ok($$SELECT * FROM inbox.kafka_acquire('kc', ARRAY['orders', NULL], ARRAY[0, 1])$$, '22004', NULL, 'a NULL topic: 22004');
SELECT throws_ok($$SELECT * FROM inbox.kafka_acquire('kc', ARRAY[' '], ARRAY[0])$$, '22023', NULL, 'a blank topic: 22023');
SELECT throws_ok($$SELECT * FROM inbox.kafka_acquire('kc', ARRAY['orders'], ARRAY[0, 1])$$, '22023', NULL, 'lengths differ: 22023');
SELECT throws_ok($$SELECT * FROM inbox.kafka_acquire('kc', ARRAY['orders'], ARRAY[-1])$$, '22023', NULL, 'a negative partition: 22023');
SELECT throws_ok($$SELECT inbox.kafka_store_offsets('kc', ARRAY['orders', 'orders'], ARRAY[0, 0], ARRAY[1, 2]::bigint[], ARRAY[4, 4]::bigint[])$$,
                 '22023', NULL, 'a partition named twice: 22023');
SELECT throws_ok($$SELECT inbox.kafka_store_offsets('kc', ARRAY['orders'], ARRAY[0], ARRAY[-5]::bigint[], ARRAY[4]::bigint[])$$,
                 '22023', NULL, 'a negative offset: 22023');

-- ================================================================== who may
CREATE ROLE tap_k_bound NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_k_other NOLOGIN IN ROLE inbox_consumer;
SELECT inbox.bind_consumer('kc', 'tap_k_bound') \g /dev/null
CREATE TEMP TABLE k_seen (who text, state text);
GRANT INSERT ON k_seen TO tap_k_bound, tap_k_other;
CREATE FUNCTION pg_temp.try(who text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM inbox.kafka_acquire('kc', ARRAY['orders'], ARRAY[5], who);
    INSERT INTO pg_temp.k_seen VALUES (who, 'ok');
EXCEPTION WHEN OTHERS THEN
    INSERT INTO pg_temp.k_seen VALUES (who, SQLSTATE);
END $$;
SET ROLE tap_k_bound;
SELECT pg_temp.try('bound') \g /dev/null
RESET ROLE;
SET ROLE tap_k_other;
SELECT pg_temp.try('other') \g /dev/null
RESET ROLE;
SELECT results_eq($$SELECT who, state FROM k_seen ORDER BY who$$, $$VALUES ('bound', 'ok'), ('other', '42501')$$,
                  'the bound role acquires; another consumer role is refused (42501)');
SELECT table_privs_are('inbox', 'kafka_offset', 'inbox_consumer', ARRAY[]::text[],
                       'inbox_consumer writes offsets only through the functions');
SELECT table_privs_are('inbox', 'kafka_offset', 'inbox_reader', ARRAY['SELECT'], 'inbox_reader reads the offsets (lag)');

SELECT * FROM finish();
ROLLBACK;
