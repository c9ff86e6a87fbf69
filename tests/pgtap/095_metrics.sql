-- pgTAP: sql/095_metrics.sql — counts after real claims (first-seen after the rollup, duplicates,
-- conflicts, failures by reason code, quarantine in and recovered), the bounded rollup, counting
-- switched off, a long transaction holding a duplicate event that blocks nobody, and grants.
-- The section "two backends" uses dblink: its sessions commit, and clean up after themselves.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(58);

CREATE EXTENSION IF NOT EXISTS dblink;
CREATE FUNCTION pg_temp.metric(name text, want jsonb DEFAULT '{}') RETURNS double precision LANGUAGE sql AS $$
    SELECT coalesce(sum(m.value), 0) FROM inbox.metrics() m WHERE m.metric = name AND m.labels @> want
$$;

-- ================================================================== two backends (dblink, committed)
-- A duplicate's event row is held by a transaction left open; another backend's duplicate claim of
-- the same identity, and a rollup, go on without waiting for it.
SELECT format('dbname=%s port=%s host=127.0.0.1 user=%s', current_database(), current_setting('port'), session_user)
    AS conninfo \gset
SELECT dblink_connect('tap_metrics_a', :'conninfo') \g /dev/null
SELECT dblink_connect('tap_metrics_b', :'conninfo') \g /dev/null
SELECT is((SELECT outcome FROM dblink('tap_metrics_a',
             $$SELECT outcome FROM inbox.claim('tap-metrics-long', 'p', 'x', '{}')$$) AS t(outcome text)),
          'claimed', 'two backends: the identity is claimed and committed');
SELECT dblink_exec('tap_metrics_a', 'BEGIN') \g /dev/null
SELECT is((SELECT outcome FROM dblink('tap_metrics_a',
             $$SELECT outcome FROM inbox.claim('tap-metrics-long', 'p', 'x', '{}')$$) AS t(outcome text)),
          'duplicate', 'two backends: A counts a duplicate and keeps its transaction open');
SELECT dblink_exec('tap_metrics_b', $$SET statement_timeout = '5s'$$) \g /dev/null
SELECT is((SELECT outcome FROM dblink('tap_metrics_b',
             $$SELECT outcome FROM inbox.claim('tap-metrics-long', 'p', 'x', '{}')$$) AS t(outcome text)),
          'duplicate', 'two backends: B''s duplicate claim of the same identity returns at once (no wait on A)');
SELECT lives_ok($$SELECT * FROM dblink('tap_metrics_b', 'SELECT inbox.metrics_rollup()') AS t(n bigint)$$,
                'two backends: B''s rollup does not wait for A either');
SELECT is((SELECT v FROM dblink('tap_metrics_b',
             $$SELECT value FROM inbox.metrics() WHERE metric = 'pginbox_duplicates_total'
                  AND labels ->> 'consumer' = 'tap-metrics-long'$$) AS t(v double precision)),
          1::double precision, 'two backends: B sees its own duplicate, not A''s uncommitted one');
SELECT dblink_exec('tap_metrics_a', 'COMMIT') \g /dev/null
SELECT is((SELECT v FROM dblink('tap_metrics_b',
             $$SELECT value FROM inbox.metrics() WHERE metric = 'pginbox_duplicates_total'
                  AND labels ->> 'consumer' = 'tap-metrics-long'$$) AS t(v double precision)),
          2::double precision, 'two backends: after A commits, both duplicates are counted');
SELECT dblink_exec('tap_metrics_b', $$
    DELETE FROM inbox.message WHERE consumer = 'tap-metrics-long';
    DELETE FROM inbox.metric_event WHERE consumer = 'tap-metrics-long';
    DELETE FROM inbox.metric_total WHERE consumer = 'tap-metrics-long'$$) \g /dev/null
SELECT dblink_disconnect('tap_metrics_a') \g /dev/null
SELECT dblink_disconnect('tap_metrics_b') \g /dev/null

-- ================================================================== fixtures
CREATE SCHEMA tapm;
CREATE TABLE tapm.effect (m text PRIMARY KEY);
CREATE FUNCTION tapm.apply(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF payload ? 'bad' THEN
        RAISE EXCEPTION 'bad account' USING CONSTRAINT = 'bad_account';
    END IF;
    INSERT INTO tapm.effect VALUES (payload ->> 'm');
END
$$;
-- repair runs it with the rights of a role bound to the consumer (its SECURITY DEFINER owner).
CREATE ROLE tapm_service NOLOGIN;
GRANT USAGE ON SCHEMA tapm TO tapm_service, inbox_runner;
GRANT INSERT ON tapm.effect TO tapm_service;
ALTER FUNCTION tapm.apply(jsonb) SECURITY DEFINER SET search_path = tapm, pg_temp;
ALTER FUNCTION tapm.apply(jsonb) OWNER TO tapm_service;
SELECT inbox.bind_consumer('tap-m', 'tapm_service', note => 'pgTAP') \g /dev/null
SELECT inbox.register_handler('tap-m', 'thing', 'tapm.apply(jsonb)', 'v1') \g /dev/null
SELECT inbox.configure_consumer('tap-m', max_attempts => 2) \g /dev/null
-- Only rows claimed from here on: the rollup starts at an hour ago.
UPDATE inbox.metric_rollup_state SET processed_cursor = now() - interval '1 hour';
DELETE FROM inbox.metric_total;
DELETE FROM inbox.metric_event;

-- ================================================================== real claims
SELECT is(array_agg(outcome ORDER BY ord), ARRAY['applied', 'applied', 'applied', 'duplicate', 'duplicate', 'duplicate',
                                                 'conflict', 'conflict', 'failed', 'failed', 'quarantined'],
          'claims: three applied, three duplicates, two conflicts, two failures, one quarantined')
  FROM (SELECT 1 AS ord, outcome FROM inbox.claim_and_apply('tap-m', 'shop', 'm1', 'thing', '{"m": "m1"}')
        UNION ALL SELECT 2, outcome FROM inbox.claim_and_apply('tap-m', 'shop', 'm2', 'thing', '{"m": "m2"}', '', now())
        UNION ALL SELECT 3, outcome FROM inbox.claim_and_apply('tap-m', 'crm', 'm1', 'thing', '{"m": "c1"}')
        UNION ALL SELECT 4, outcome FROM inbox.claim_and_apply('tap-m', 'shop', 'm1', 'thing', '{"m": "m1"}')
        UNION ALL SELECT 5, outcome FROM inbox.claim('tap-m', 'shop', 'm1', '{"m": "m1"}')
        UNION ALL SELECT 6, outcome FROM inbox.claim('tap-m', 'crm', 'm1', '{"m": "c1"}')
        UNION ALL SELECT 7, outcome FROM inbox.claim('tap-m', 'shop', 'm2', '{"m": "m2", "changed": 1}')
        UNION ALL SELECT 8, outcome FROM inbox.claim('tap-m', 'shop', 'm2', '{"m": "m2", "changed": 1}')
        UNION ALL SELECT 9, outcome FROM inbox.claim_and_apply('tap-m', 'shop', 'm3', 'thing', '{"m": "m3", "bad": 1}')
        UNION ALL SELECT 10, outcome FROM inbox.record_failure('tap-m', 'crm', 'm9', '{"m": "m9"}', 'timeout')
        UNION ALL SELECT 11, outcome FROM inbox.claim_and_apply('tap-m', 'shop', 'm3', 'thing', '{"m": "m3", "bad": 1}')
       ) o;
-- The same batch path counts its duplicates too.
SELECT is((SELECT array_agg(outcome ORDER BY ordinal) FROM inbox.claim_and_apply_batch('tap-m',
             '[{"producer": "shop", "message_id": "m1", "message_type": "thing", "payload": {"m": "m1"}},
               {"producer": "shop", "message_id": "m4", "message_type": "thing", "payload": {"m": "m4"}}]')),
          ARRAY['duplicate', 'applied'], 'batch: one duplicate, one applied');

-- ================================================================== first-seen: the rollup and its grace
SELECT is(pg_temp.metric('pginbox_first_seen_total', '{"consumer": "tap-m"}'), 0::double precision,
          'first-seen: nothing counted before the grace has passed (the claims'' transaction is still open)');
-- Ten minutes pass: the claims and the rollup cursor move ten minutes into the past.
UPDATE inbox.message SET processed_at = processed_at - interval '10 minutes' WHERE consumer = 'tap-m';
UPDATE inbox.metric_rollup_state SET processed_cursor = processed_cursor - interval '10 minutes';
SELECT is(pg_temp.metric('pginbox_first_seen_total', '{"consumer": "tap-m", "producer": "shop"}'), 3::double precision,
          'first-seen: shop m1, m2 and m4 after the rollup (repeated deliveries are not first-seen)');
SELECT is(pg_temp.metric('pginbox_first_seen_total', '{"consumer": "tap-m", "producer": "crm"}'), 1::double precision,
          'first-seen: crm m1, counted apart from shop m1');
SELECT is(pg_temp.metric('pginbox_unprotected_deliveries_total', '{"consumer": "tap-m", "producer": "shop"}'),
          2::double precision, 'unprotected: shop m1 and m4 came without produced_at (m2 had one)');
SELECT is(pg_temp.metric('pginbox_first_seen_total', '{"consumer": "tap-m"}'), 4::double precision,
          'first-seen: reading again counts nothing twice');
SELECT ok((SELECT processed_cursor <= now() - interval '5 minutes' FROM inbox.metric_rollup_state),
          'first-seen: the cursor trails now() by the grace');

-- ================================================================== duplicates, conflicts, failures, quarantine
SELECT is(pg_temp.metric('pginbox_duplicates_total', '{"consumer": "tap-m", "producer": "shop"}'), 3::double precision,
          'duplicates: shop has three (claim_and_apply, claim, batch)');
SELECT is(pg_temp.metric('pginbox_duplicates_total', '{"consumer": "tap-m", "producer": "crm"}'), 1::double precision,
          'duplicates: crm has one');
SELECT is((SELECT count(*)::integer FROM inbox.metric_event), 0, 'duplicates: the events were folded by the read');
SELECT is(pg_temp.metric('pginbox_identity_conflicts_total', '{"consumer": "tap-m", "producer": "shop"}'),
          2::double precision, 'conflicts: both conflicting deliveries of shop m2');
SELECT is(pg_temp.metric('pginbox_identity_conflicts_total', '{"consumer": "tap-m", "producer": "crm"}'),
          0::double precision, 'conflicts: crm has a zero series (a value, not a missing series)');
SELECT is(pg_temp.metric('pginbox_handler_failures_total', '{"consumer": "tap-m", "producer": "shop", "reason_code": "bad_account"}'),
          2::double precision, 'failures: the handler''s two bad_account failures (reason from its constraint name)');
SELECT is(pg_temp.metric('pginbox_handler_failures_total', '{"consumer": "tap-m", "producer": "crm", "reason_code": "timeout"}'),
          1::double precision, 'failures: record_failure''s reason code');
SELECT is(pg_temp.metric('pginbox_quarantined_total', '{"consumer": "tap-m", "kind": "failure", "reason_code": "bad_account"}'),
          1::double precision, 'quarantine: shop m3 moved in after max_attempts');
SELECT is(pg_temp.metric('pginbox_quarantined_total', '{"consumer": "tap-m", "kind": "conflict"}'), 1::double precision,
          'quarantine: one conflict entry');
SELECT is(pg_temp.metric('pginbox_quarantine_open', '{"consumer": "tap-m"}'), 2::double precision,
          'quarantine: two entries open');

-- Recovered: fix the handler's input rule, repair the entry.
CREATE OR REPLACE FUNCTION tapm.apply(payload jsonb) RETURNS void LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = tapm, pg_temp AS $$
BEGIN
    INSERT INTO tapm.effect VALUES (payload ->> 'm');
END
$$;
SELECT quarantine_id AS q_m3 FROM inbox.quarantine WHERE consumer = 'tap-m' AND message_id = 'm3' \gset
SELECT is((SELECT outcome FROM inbox.repair(:q_m3, 'bad_account rule fixed')), 'applied', 'repair: the entry is applied');
SELECT is(pg_temp.metric('pginbox_quarantine_recovered_total', '{"consumer": "tap-m", "producer": "shop"}'),
          1::double precision, 'quarantine: recovered counts the repair');
SELECT is(pg_temp.metric('pginbox_quarantine_decisions_total', '{"consumer": "tap-m", "result": "recovered"}'),
          1::double precision, 'quarantine: the decision is counted by result');
SELECT is(pg_temp.metric('pginbox_quarantine_open', '{"consumer": "tap-m", "kind": "failure"}'), 0::double precision,
          'quarantine: no failure entry open any more');
-- Moved in again: released, then failing again reopens the same entry; that is a second move in.
SELECT quarantine_id AS q_m9 FROM inbox.record_failure('tap-m', 'crm', 'm9', '{"m": "m9"}', 'timeout') \gset
SELECT inbox.release(:q_m9, 'try again') \g /dev/null
SELECT is(pg_temp.metric('pginbox_quarantined_total', '{"consumer": "tap-m", "producer": "crm"}'), 1::double precision,
          'quarantine: a released entry counts its one move in');
SELECT inbox.record_failure('tap-m', 'crm', 'm9', '{"m": "m9"}', 'timeout') \g /dev/null
SELECT inbox.record_failure('tap-m', 'crm', 'm9', '{"m": "m9"}', 'timeout') \g /dev/null
SELECT is(pg_temp.metric('pginbox_quarantined_total', '{"consumer": "tap-m", "producer": "crm"}'), 2::double precision,
          'quarantine: reopened after the release, it has moved in twice');
SELECT is(pg_temp.metric('pginbox_handler_failures_total', '{"consumer": "tap-m", "producer": "crm"}'), 4::double precision,
          'failures: the counter does not go back when a release resets the attempts');

-- The summary view agrees with inbox.metrics().
SELECT is((SELECT (first_seen, duplicates, conflicts, failures, quarantined, recovered, unprotected)::text
             FROM inbox.metric_summary WHERE consumer = 'tap-m' AND producer = 'shop'),
          '(3,3,2,2,2,1,2)', 'metric_summary: shop side by side (m3, repaired just now, is still in the grace)');

-- ================================================================== retention, expired, inbox age
SELECT cmp_ok(pg_temp.metric('pginbox_inbox_oldest_age_seconds', '{"consumer": "tap-m", "producer": "shop"}'), '>=',
              600::double precision, 'inbox age: shop''s oldest identity is ten minutes old');
SELECT cmp_ok(pg_temp.metric('pginbox_inbox_oldest_age_seconds', '{"consumer": "tap-m", "producer": "shop"}'), '<',
              660::double precision, 'inbox age: and not older');
SELECT inbox.set_retention_policy('tap-m', '', '7 days', '1 day', '0', '0', '0', '0', '0', '1 day', 'metrics test') \g /dev/null
SELECT is(pg_temp.metric('pginbox_retention_window_seconds', '{"consumer": "tap-m", "producer": ""}'),
          (SELECT extract(epoch FROM retention_window)::double precision FROM inbox.retention_status
            WHERE consumer = 'tap-m' AND producer = ''),
          'retention: the window of the consumer''s default policy is exported');
SELECT is((SELECT count(*)::integer FROM inbox.metrics() WHERE metric = 'pginbox_purge_lag_seconds'
              AND labels ->> 'consumer' = 'tap-m'), 0, 'retention: no purge lag series before the first purge');
-- A purge that kept identities from two minutes ago on: the age now counts from its cutoff.
INSERT INTO inbox.purge_state (consumer, producer, purged_before, last_purge_at, rows_purged)
VALUES ('tap-m', '', now() - interval '2 minutes', now(), 42);
SELECT is(pg_temp.metric('pginbox_inbox_oldest_age_seconds', '{"consumer": "tap-m", "producer": "shop"}'),
          120::double precision, 'inbox age: after a purge, from the purge cutoff');
SELECT is(pg_temp.metric('pginbox_purged_rows_total', '{"consumer": "tap-m", "producer": ""}'), 42::double precision,
          'retention: rows purged are exported');
SELECT is((SELECT count(*)::integer FROM inbox.metrics() WHERE metric = 'pginbox_purge_lag_seconds'
              AND labels @> '{"consumer": "tap-m", "producer": ""}'), 1, 'retention: the purge lag is exported once purged');
INSERT INTO inbox.quarantine (consumer, tenant, producer, message_id, kind, reason_code, handler_version, deliveries)
VALUES ('tap-m', '', 'shop', 'old-1', 'expired', 'expired', 'v1', 3);
SELECT is(pg_temp.metric('pginbox_expired_deliveries_total', '{"consumer": "tap-m", "producer": "shop"}'),
          3::double precision, 'expired: every delivery of an expired identity');
SELECT is(pg_temp.metric('pginbox_expired_deliveries_total', '{"consumer": "tap-m", "producer": "crm"}'),
          0::double precision, 'expired: a zero series for the other producers');

-- ================================================================== bounded rollup
-- 2500 rows a microsecond apart, then 1500 rows of one transaction (one processed_at); the cursor
-- goes back an hour, so the four tap-m rows of ten minutes ago are folded (again) at the end.
UPDATE inbox.metric_rollup_state SET processed_cursor = now() - interval '1 hour';
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, processed_at)
SELECT 'tap-bulk', '', 'p', 'a' || g, '\x00', 'v1', now() - interval '50 minutes' + g * interval '1 microsecond'
  FROM generate_series(1, 2500) g;
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, processed_at)
SELECT 'tap-bulk', '', 'p', 'b' || g, '\x00', 'v1', now() - interval '40 minutes' FROM generate_series(1, 1500) g;
SELECT is(ARRAY[inbox.metrics_rollup(1000), inbox.metrics_rollup(1000), inbox.metrics_rollup(1000),
                inbox.metrics_rollup(1000), inbox.metrics_rollup(1000), inbox.metrics_rollup(1000)],
          ARRAY[1000, 1000, 500, 1500, 4, 0]::bigint[],
          'rollup: at most max_rows per call, never splitting a processed_at; one larger than max_rows is folded whole');
SELECT is((SELECT value FROM inbox.metric_total WHERE metric = 'first_seen' AND consumer = 'tap-bulk'), 4000::bigint,
          'rollup: every bulk row counted once');
SELECT throws_ok($$SELECT inbox.metrics_rollup(10)$$, '22023', NULL, 'rollup: a batch below 1000 rows is refused');

-- ================================================================== the rollup reads through an index
-- Its two queries on inbox.message must have an index path (whatever the table's size): the list of
-- consumers (a loose index scan) and the slice of one consumer in processed_at order.
CREATE FUNCTION pg_temp.plan(q text) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    line record;
BEGIN
    FOR line IN EXECUTE 'EXPLAIN ' || q LOOP
        RETURN NEXT line."QUERY PLAN";
    END LOOP;
END
$$;
SET LOCAL enable_seqscan = off;
SELECT is((SELECT count(*)::integer FROM pg_temp.plan($$SELECT min(m.consumer) FROM inbox.message m WHERE m.consumer > 'a'$$) l
            WHERE l ~ 'Seq Scan|Sort'), 0, 'rollup: the next consumer is one index descent');
SELECT is((SELECT count(*)::integer FROM pg_temp.plan($$SELECT m.processed_at FROM inbox.message m
                 WHERE m.consumer = 'tap-m' AND m.processed_at >= now() - interval '1 hour' AND m.processed_at < now()
                 ORDER BY m.processed_at LIMIT 1001$$) l
            WHERE l ~ 'Seq Scan|Sort|Bitmap'), 0, 'rollup: a consumer''s slice is an ordered index range scan');
RESET enable_seqscan;

-- ================================================================== counting off
SELECT is((SELECT counting FROM inbox.configure_metrics(counting => false)), false, 'configure: counting off');
SELECT inbox.claim('tap-m', 'shop', 'm1', '{"m": "m1"}') \g /dev/null
SELECT inbox.record_failure('tap-m', 'shop', 'm5', '{}', 'nope') \g /dev/null
SELECT is((SELECT count(*)::integer FROM inbox.metric_event), 0, 'counting off: no event row for a duplicate or a failure');
SELECT is(pg_temp.metric('pginbox_metrics_counting_enabled'), 0::double precision, 'counting off: exported as 0');
SELECT is((SELECT counting FROM inbox.configure_metrics(counting => true)), true, 'configure: counting on again');
SELECT throws_ok($$SELECT inbox.configure_metrics(rollup_grace => '-1 minute')$$, '22023', NULL,
                 'configure: a negative grace is refused');

SELECT is((SELECT relpersistence::text FROM pg_catalog.pg_class WHERE oid = 'inbox.metric_event'::regclass), 'u',
          'events are unlogged: a duplicate''s transaction does not wait for a WAL flush');

-- ================================================================== grants
SET LOCAL ROLE inbox_reader;
SELECT lives_ok($$SELECT count(*) FROM inbox.metrics()$$, 'grants: inbox_reader reads inbox.metrics()');
SELECT lives_ok($$SELECT count(*) FROM inbox.metric_summary$$, 'grants: inbox_reader reads inbox.metric_summary');
SELECT throws_ok($$SELECT inbox.metrics_rollup()$$, '42501', NULL, 'grants: inbox_reader cannot run the rollup itself');
RESET ROLE;
SET LOCAL ROLE inbox_consumer;
SELECT throws_ok($$SELECT count(*) FROM inbox.metrics()$$, '42501', NULL, 'grants: inbox_consumer cannot read metrics');
SELECT throws_ok($$INSERT INTO inbox.metric_event (metric, consumer, producer) VALUES ('duplicate', 'x', 'y')$$, '42501',
                 NULL, 'grants: inbox_consumer cannot write events directly');
SELECT throws_ok($$UPDATE inbox.metric_total SET value = 0$$, '42501', NULL,
                 'grants: inbox_consumer cannot touch the totals');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
