-- pgTAP: sql/075_retention.sql — policy, window, heartbeat and active time, watermark and the
-- outcome 'expired', purge steps, status view. Runs as the superuser that deployed, in one
-- transaction: the commits of a real purge (announce, wait, delete) are tested in
-- tests/python/integration/test_retention.py; here the purge state is stepped by hand.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(124);

-- ------------------------------------------------------------------ fixtures
\ir write_counter.psql

CREATE SCHEMA tapr;
CREATE TABLE tapr.ledger (message_id text NOT NULL);
CREATE FUNCTION tapr.credit(payload jsonb) RETURNS void LANGUAGE sql
    BEGIN ATOMIC INSERT INTO tapr.ledger VALUES (payload ->> 'id'); END;
SELECT inbox.register_handler('tr', 'credit', 'tapr.credit(jsonb)'::regprocedure, 'v1') \gset
-- repair runs the handler with the rights of a role bound to the consumer (its SECURITY DEFINER owner).
CREATE ROLE tapr_service NOLOGIN;
GRANT USAGE ON SCHEMA tapr TO tapr_service, inbox_runner;
GRANT INSERT ON tapr.ledger TO tapr_service;
ALTER FUNCTION tapr.credit(jsonb) SECURITY DEFINER SET search_path = tapr, pg_temp;
ALTER FUNCTION tapr.credit(jsonb) OWNER TO tapr_service;
SELECT inbox.bind_consumer('tr', 'tapr_service', note => 'pgTAP') \g /dev/null

-- ------------------------------------------------------------------ objects
SELECT has_table('inbox', 'retention_policy', 'inbox.retention_policy exists');
SELECT has_table('inbox', 'retention_policy_change', 'inbox.retention_policy_change exists');
SELECT has_table('inbox', 'activity_gap', 'inbox.activity_gap exists');
SELECT has_table('inbox', 'purge_state', 'inbox.purge_state exists');
SELECT has_table('inbox', 'retention_hold', 'inbox.retention_hold exists');
SELECT has_view('inbox', 'retention_status', 'inbox.retention_status exists');
SELECT has_index('inbox', 'message', 'message_purge_idx', ARRAY['consumer', 'processed_at'], 'the purge''s index on inbox.message (consumer, processed_at)');
SELECT col_is_pk('inbox', 'retention_hold', ARRAY['consumer', 'tenant', 'producer', 'message_id', 'holder'],
                 'retention_hold keeps its shape (replay inserts into it)');
SELECT columns_are('inbox', 'retention_status',
    ARRAY['consumer', 'producer', 'retention_window', 'dominating_scenario', 'watermark', 'purged_before',
          'announced_before', 'last_purge_at', 'rows_purged', 'purge_lag', 'expired_total', 'last_active_at'],
    'inbox.retention_status columns (the metrics read them by name)');
SELECT col_type_is('inbox', 'retention_status', 'purge_lag', 'interval', 'purge_lag is an interval');
SELECT col_type_is('inbox', 'retention_status', 'expired_total', 'bigint', 'expired_total is a bigint');
SELECT col_type_is('inbox', 'retention_status', 'rows_purged', 'bigint', 'rows_purged is a bigint');
SELECT has_column('inbox', 'consumer_config', 'last_active_at', 'consumer_config.last_active_at (heartbeat)');
SELECT has_column('inbox', 'consumer_config', 'purge_watermark', 'consumer_config.purge_watermark');
SELECT lives_ok($$INSERT INTO inbox.quarantine (consumer, tenant, producer, message_id, kind, reason_code, handler_version)
                  VALUES ('tap-kind', '', 'p', 'm', 'expired', 'expired', 'v1')$$,
                'inbox.quarantine accepts kind ''expired''');
DELETE FROM inbox.quarantine WHERE consumer = 'tap-kind';
SELECT is(inbox._default_settings('x'), ROW('x', '{}'::text[], 5, true, 1048576, NULL, NULL, NULL, NULL)::inbox.consumer_config,
          '_default_settings has the retention columns, NULL');
SELECT is((SELECT (s.last_active_at, s.purge_watermark)::text FROM inbox._settings('nobody') s), '(,)',
          '_settings of an unconfigured consumer: no heartbeat, no watermark');

-- ------------------------------------------------------------------ set_retention_policy: input
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($$SELECT inbox.set_retention_policy(NULL, '', '1 day', '0', '0', '0', '0', '0', '0', '1 hour', 'n')$$,
                 '22004', 'inbox.set_retention_policy: consumer must not be NULL', 'policy: NULL consumer');
SELECT throws_ok($$SELECT inbox.set_retention_policy('', '', '1 day', '0', '0', '0', '0', '0', '0', '1 hour', 'n')$$,
                 '22023', NULL, 'policy: empty consumer');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', NULL, '1 day', '0', '0', '0', '0', '0', '0', '1 hour', 'n')$$,
                 '22004', 'inbox.set_retention_policy: producer must not be NULL', 'policy: NULL producer');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', repeat('p', 129), '1 day', '0', '0', '0', '0', '0', '0', '1 hour', 'n')$$,
                 '22001', 'inbox.set_retention_policy: producer is longer than 128 bytes', 'policy: long producer');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', broker_retention => '1 day', note => 'n')$$,
                 '22004', 'inbox.set_retention_policy: max_offset_rewind must be given',
                 'policy: every scenario must be stated (a missing one is named)');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', '', NULL, '0', '0', '0', '0', '0', '0', '1 hour', 'n')$$,
                 '22004', 'inbox.set_retention_policy: broker_retention must be given', 'policy: NULL broker_retention');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', '', '1 day', '0', '0', '0', '0', '0', '0', NULL, 'n')$$,
                 '22004', 'inbox.set_retention_policy: safety_margin must be given', 'policy: NULL safety_margin');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', '', '1 day', '0', '0', '-1 day', '0', '0', '0', '1 hour', 'n')$$,
                 '22023', 'inbox.set_retention_policy: producer_retry_horizon must not be negative, got -1 days',
                 'policy: a negative scenario');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', '', '0', '0', '0', '0', '0', '0', '0', '0', 'n')$$,
                 '22023', 'inbox.set_retention_policy: every scenario is 0, so the window would be 0',
                 'policy: a zero window');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', '', '1 day', '0', '0', '0', '0', '0', '0', '1 hour', NULL)$$,
                 '22004', 'inbox.set_retention_policy: a policy change needs a note saying why', 'policy: NULL note');
SELECT throws_ok($$SELECT inbox.set_retention_policy('c', '', '1 day', '0', '0', '0', '0', '0', '0', '1 hour', '  ')$$,
                 '22023', 'inbox.set_retention_policy: a policy change needs a note saying why', 'policy: blank note');
SELECT is(public.tap_writes() - :w0, 0::bigint, 'policy: bad input writes nothing');

-- ------------------------------------------------------------------ the window formula
SELECT is((SELECT (w.retention_window, w.dominating_scenario)::text
             FROM inbox.set_retention_policy('tr', '', broker_retention => '7 days', max_offset_rewind => '3 days',
                  dead_letter_redrive_horizon => '14 days', producer_retry_horizon => '1 day',
                  outage_allowance => '2 days', backup_restore_window => '1 day', planned_replay_horizon => '0',
                  safety_margin => '1 hour', note => 'sized from the broker config') w),
          '("17 days 01:00:00",dead_letter_redrive_horizon)',
          'window = greatest(horizons) + outage + restore + margin; the largest horizon dominates');
SELECT is((SELECT count(*)::integer FROM inbox.retention_policy_change WHERE consumer = 'tr'), 1,
          'policy: the change is audited');
SELECT is((SELECT (note, changed_by = session_user, retention_window)::text FROM inbox.retention_policy_change
            WHERE consumer = 'tr'), '("sized from the broker config",t,"17 days 01:00:00")',
          'policy: the audit row has the note, who, and the window');
SELECT is((SELECT (w.retention_window, w.dominating_scenario)::text FROM inbox.retention_window('tr') w),
          '("17 days 01:00:00",dead_letter_redrive_horizon)', 'retention_window returns window and dominating scenario');
SELECT is((SELECT (w.retention_window, w.dominating_scenario)::text FROM inbox.retention_window('tr', 'any-producer') w),
          '("17 days 01:00:00",dead_letter_redrive_horizon)', 'retention_window: a producer without its own policy gets the default');
SELECT is((SELECT (w.retention_window, w.dominating_scenario)::text
             FROM inbox.set_retention_policy('tr2', '', '0', '0', '0', '0', '3 days', '0', '0', '0', 'outage only') w),
          '("3 days",outage_allowance)', 'with no redelivery horizon the largest additive scenario dominates');
SELECT is((SELECT (w.retention_window, w.dominating_scenario)::text
             FROM inbox.set_retention_policy('tr2', '', '2 days', '5 days', '0', '0', '1 day', '0', '30 days', '2 hours',
                                             'replays a month back') w),
          '("31 days 02:00:00",planned_replay_horizon)', 'a policy change replaces the row (planned replay dominates)');
SELECT is((SELECT count(*)::integer FROM inbox.retention_policy WHERE consumer = 'tr2'), 1, 'one policy row per consumer/producer');
SELECT is((SELECT count(*)::integer FROM inbox.retention_policy_change WHERE consumer = 'tr2'), 2, 'each change audited');
SELECT throws_ok($$SELECT * FROM inbox.retention_window('no-policy')$$, 'P0002',
                 'inbox.retention_window: consumer ''no-policy'' has no retention policy',
                 'retention_window: a consumer without a policy (never purged)');
SELECT throws_ok($$SELECT * FROM inbox.retention_window('tr', NULL)$$, '22004', NULL, 'retention_window: NULL producer');

-- ------------------------------------------------------------------ heartbeat and gaps
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tr', 'p', 'h1', 'credit', '{"id": "h1"}')), 'applied',
          'a first claim of a new consumer');
SELECT ok((SELECT last_active_at = now() FROM inbox.consumer_config WHERE consumer = 'tr'),
          'the first claim sets last_active_at (heartbeat)');
SELECT is((SELECT (gap_from, gap_to = now())::text FROM inbox.activity_gap WHERE consumer = 'tr'), '(-infinity,t)',
          'before its first heartbeat a consumer counts as inactive');
SELECT is((SELECT outcome FROM inbox.claim('tr-new', 'p', 'h1', '{}')), 'claimed', 'claim of an unconfigured consumer');
SELECT ok((SELECT last_active_at = now() FROM inbox.consumer_config WHERE consumer = 'tr-new'),
          'its heartbeat creates its consumer_config row');
SELECT is((SELECT (c.hash_exclude_keys, c.max_attempts, c.store_payloads, c.max_payload_bytes)::text
             FROM inbox.consumer_config c WHERE c.consumer = 'tr-new'), '({},5,t,1048576)',
          'the row the heartbeat creates has the default settings');
UPDATE inbox.consumer_config SET last_active_at = now() - interval '30 seconds' WHERE consumer = 'tr';
SELECT public.tap_writes('consumer_config') AS cw0 \gset
SELECT is((SELECT outcome FROM inbox.claim('tr', 'p', 'h2', '{}')), 'claimed', 'a claim 30 s after the heartbeat');
SELECT is(public.tap_writes('consumer_config') - :cw0, 0::bigint, 'a heartbeat younger than 60 s is not refreshed');
UPDATE inbox.consumer_config SET last_active_at = now() - interval '2 minutes' WHERE consumer = 'tr';
SELECT is((SELECT outcome FROM inbox.claim('tr', 'p', 'h3', '{}')), 'claimed', 'a claim 2 min after the heartbeat');
SELECT ok((SELECT last_active_at = now() FROM inbox.consumer_config WHERE consumer = 'tr'), 'refreshes the heartbeat');
SELECT is((SELECT count(*)::integer FROM inbox.activity_gap WHERE consumer = 'tr'), 1, 'a 2-minute pause is no gap');
UPDATE inbox.consumer_config SET last_active_at = now() - interval '3 days' WHERE consumer = 'tr';
SELECT is((SELECT outcome FROM inbox.claim_bytea('tr', 'p', 'h4', '\x01')), 'claimed', 'claim_bytea after 3 days down');
SELECT ok((SELECT gap_to = now() AND gap_from = now() - interval '3 days' FROM inbox.activity_gap
            WHERE consumer = 'tr' AND gap_from > '-infinity'), 'a 3-day pause is recorded as a gap');
SELECT is((SELECT count(*)::integer FROM inbox.claim_and_apply_batch('tr', '[]')), 0, 'the batch runs through the same path');

-- ------------------------------------------------------------------ active time
DELETE FROM inbox.activity_gap WHERE consumer = 'tr';
INSERT INTO inbox.activity_gap VALUES ('tr', '-infinity', now() - interval '100 days');
UPDATE inbox.consumer_config SET last_active_at = now() WHERE consumer = 'tr';
SELECT is(inbox._active_cutoff('tr', '10 days'), now() - interval '10 days', 'active all along: cutoff = now - span');
INSERT INTO inbox.activity_gap VALUES ('tr', now() - interval '8 days', now() - interval '5 days');
SELECT is(inbox._active_cutoff('tr', '10 days'), now() - interval '13 days', 'a 3-day gap moves the cutoff back 3 days');
SELECT is(inbox._active_cutoff('tr', '4 days'), now() - interval '4 days', 'a gap before the cutoff changes nothing');
SELECT is(inbox._active_cutoff('tr', '6 days'), now() - interval '9 days', 'a cutoff past a gap skips the gap');
UPDATE inbox.consumer_config SET last_active_at = now() - interval '2 days' WHERE consumer = 'tr';
SELECT is(inbox._active_cutoff('tr', '10 days'), now() - interval '15 days', 'down now: the current gap does not count');
SELECT is(inbox._active_cutoff('tr', '200 days'), NULL, 'not active that long since the first heartbeat: NULL');
SELECT is(inbox._active_cutoff('nobody', '1 day'), NULL, 'never active: NULL');
UPDATE inbox.consumer_config SET last_active_at = now() WHERE consumer = 'tr';
DELETE FROM inbox.activity_gap WHERE consumer = 'tr' AND gap_from > '-infinity';

-- ------------------------------------------------------------------ announce_purge
SELECT throws_ok($$SELECT * FROM inbox.announce_purge(NULL)$$, '22004', NULL, 'announce_purge: NULL consumer');
SELECT throws_ok($$SELECT * FROM inbox.purge_batch('tr', NULL, 0)$$, '22023',
                 'inbox.purge_batch: batch_size must be between 1 and 100000, got 0', 'purge_batch: batch_size 0');
SELECT throws_ok($$SELECT * FROM inbox.purge_batch('tr', NULL, NULL)$$, '22004', NULL, 'purge_batch: NULL batch_size');
SELECT throws_ok($$SELECT * FROM inbox.purge_batch('tr', repeat('p', 129))$$, '22001', NULL, 'purge_batch: long producer');
SELECT is((SELECT status FROM inbox.announce_purge('no-policy')), 'no_policy', 'announce_purge: no policy, never purged');
SELECT is((SELECT status FROM inbox.purge_batch('no-policy')), 'no_policy', 'purge_batch: no policy, never purged');
-- Messages processed 30 days ago (the window is 17 days 1 hour).
DO $$ BEGIN PERFORM inbox.claim_and_apply('tr', 'p', 'old-' || g, 'credit', jsonb_build_object('id', 'old-' || g))
                  FROM generate_series(1, 5) g; END $$;
UPDATE inbox.message SET processed_at = now() - interval '30 days', produced_at = now() - interval '30 days'
 WHERE consumer = 'tr' AND message_id LIKE 'old-%';
SELECT is((SELECT (status, watermark = now() - interval '17 days 1 hour')::text FROM inbox.announce_purge('tr')), '(announced,t)',
          'announce_purge: watermark = the cutoff (0.3.0: no margin added; the purge deletes only rows produced before it)');
SELECT is((SELECT (announced_before = now() - interval '17 days 1 hour', purged_before IS NULL,
                   announce_xid = pg_current_xact_id())::text
             FROM inbox.purge_state WHERE consumer = 'tr' AND producer = ''), '(t,t,t)',
          'the announcement is recorded, nothing settled yet');
SELECT ok((SELECT purge_watermark = now() - interval '17 days 1 hour' FROM inbox.consumer_config WHERE consumer = 'tr'),
          'the consumer''s watermark is published in consumer_config');
SELECT is((SELECT status FROM inbox.announce_purge('tr')), 'unchanged', 'announce_purge again: unchanged');
SELECT is((SELECT (status, rows_deleted)::text FROM inbox.purge_batch('tr')), '(uncommitted,0)',
          'purge_batch deletes nothing before the announcement is committed');
-- Step the state by hand as if the announcement committed and the wait ended.
UPDATE inbox.purge_state SET announce_xid = '2'::xid8, waiting_for = ARRAY['999/999999'] WHERE consumer = 'tr';
INSERT INTO inbox.retention_hold (consumer, tenant, producer, message_id, holder) VALUES ('tr', '', 'p', 'old-1', 'replay:1');
SELECT is((SELECT (status, rows_deleted)::text FROM inbox.purge_batch('tr', NULL, 2)), '(purged,2)',
          'once the transactions it waited for ended, purge_batch deletes at most batch_size rows');
SELECT ok((SELECT purged_before = announced_before AND waiting_for IS NULL FROM inbox.purge_state WHERE consumer = 'tr'),
          'the cutoff is settled');
SELECT is((SELECT (status, rows_deleted)::text FROM inbox.purge_batch('tr', NULL, 100)), '(purged,2)', 'the next batch');
SELECT is((SELECT (status, rows_deleted)::text FROM inbox.purge_batch('tr', NULL, 100)), '(done,0)', 'then done');
SELECT is((SELECT array_agg(message_id ORDER BY message_id) FROM inbox.message WHERE consumer = 'tr' AND message_id LIKE 'old-%'),
          ARRAY['old-1'], 'a row with a retention_hold is kept');
SELECT is((SELECT rows_purged FROM inbox.purge_state WHERE consumer = 'tr'), 4::bigint, 'rows_purged counts them');
SELECT ok(NOT EXISTS (SELECT 1 FROM inbox.message WHERE consumer = 'tr' AND message_id LIKE 'h%'
                      AND processed_at >= now() - interval '1 day') IS FALSE, 'recent rows are kept');

-- ------------------------------------------------------------------ expired
SELECT public.tap_writes('message') AS mw0 \gset
SELECT is((SELECT (outcome, reason_code, quarantine_id IS NOT NULL)::text
             FROM inbox.claim_and_apply('tr', 'p', 'old-3', 'credit', '{"id": "old-3"}', '', now() - interval '30 days')),
          '(expired,expired,t)', 'claim_and_apply: a purged message redelivered is expired');
SELECT is((SELECT count(*)::integer FROM tapr.ledger WHERE message_id = 'old-3'), 1, 'expired: the handler did not run again');
SELECT is((SELECT status::text FROM inbox.message WHERE consumer = 'tr' AND message_id = 'old-3'), 'quarantined',
          'expired: the claim row became a hold (0.2.0): every later delivery meets it');
SELECT is((SELECT (kind, status, reason_code, message_type, payload, deliveries)::text FROM inbox.quarantine
            WHERE consumer = 'tr' AND message_id = 'old-3'), '(expired,open,expired,credit,"{""id"": ""old-3""}",1)',
          'expired: a quarantine entry of kind expired with the payload');
SELECT is((SELECT outcome FROM inbox.claim('tr', 'p', 'old-3', '{"id": "old-3"}', 'v1', '', now() - interval '30 days')),
          'expired', 'claim: expired too');
SELECT is((SELECT deliveries FROM inbox.quarantine WHERE consumer = 'tr' AND message_id = 'old-3'), 2,
          'expired again: counted on the same entry');
SELECT is((SELECT outcome FROM inbox.claim_bytea('tr', 'p', 'old-4', '\x01', 'v1', '', now() - interval '30 days')),
          'expired', 'claim_bytea: expired too');
SELECT is((SELECT outcome FROM inbox.claim_and_apply_batch('tr',
              jsonb_build_array(jsonb_build_object('producer', 'p', 'message_id', 'old-5', 'message_type', 'credit',
                                                   'payload', '{"id": "old-5"}', 'produced_at', now() - interval '30 days')))),
          'expired', 'claim_and_apply_batch: expired too, handler not run');
SELECT is((SELECT count(*)::integer FROM tapr.ledger WHERE message_id = 'old-5'), 1, 'batch: applied once');
SELECT is((SELECT outcome FROM inbox.claim('tr', 'p', 'old-1', '{"id": "old-1"}', 'v1', '', now() - interval '30 days')),
          'duplicate', 'a held row is still there: duplicate, not expired');
SELECT is((SELECT outcome FROM inbox.claim('tr', 'p', 'fresh', '{}', 'v1', '', now() - interval '16 days')), 'claimed',
          'produced after the watermark: claimed');
SELECT is((SELECT outcome FROM inbox.claim('tr', 'p', 'no-ts', '{}')), 'claimed',
          'without produced_at: claimed (unprotected)');
SELECT is((SELECT outcome FROM inbox.claim('tr', 'other', 'x', '{}', 'v1', '', now() - interval '30 days')), 'expired',
          'the default policy''s watermark covers every producer without its own');
-- A producer with its own policy inherits the default's watermark.
DO $$ BEGIN PERFORM inbox.set_retention_policy('tr', 'special', '60 days', '0', '0', '0', '0', '0', '0', '1 hour',
                                              'longer for special'); END $$;
SELECT ok((SELECT s.watermark = d.watermark FROM inbox.purge_state s, inbox.purge_state d
            WHERE s.consumer = 'tr' AND s.producer = 'special' AND d.consumer = 'tr' AND d.producer = ''),
          'a new producer policy starts from the default''s watermark');
SELECT is((SELECT outcome FROM inbox.claim('tr', 'special', 'y', '{}', 'v1', '', now() - interval '30 days')), 'expired',
          'so its purged messages stay expired');
SELECT is(inbox._watermark('tr', 'special'), (SELECT watermark FROM inbox.purge_state WHERE consumer = 'tr' AND producer = 'special'),
          '_watermark picks the producer''s own state');
SELECT is(inbox._watermark('nobody', 'p'), NULL, '_watermark: NULL without a purge');

-- released: the next delivery is processed normally.
DO $$ BEGIN PERFORM inbox.release((SELECT quarantine_id FROM inbox.quarantine WHERE consumer = 'tr' AND message_id = 'old-3'),
                                 'it is new'); END $$;
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tr', 'p', 'old-3', 'credit', '{"id": "old-3"}', '', now() - interval '30 days')),
          'applied', 'release: the next delivery of an expired identity is applied');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tr', 'p', 'old-3', 'credit', '{"id": "old-3"}', '', now() - interval '30 days')),
          'duplicate', 'release: and the one after is a duplicate');
-- discarded: the entry closes and the identity is discarded (0.2.0, as for failure entries):
-- redeliveries are duplicates.
DO $$ BEGIN PERFORM inbox.discard((SELECT quarantine_id FROM inbox.quarantine WHERE consumer = 'tr' AND message_id = 'old-4'),
                                 'already applied'); END $$;
SELECT is((SELECT (outcome, quarantine_id IS NOT NULL)::text FROM inbox.claim_bytea('tr', 'p', 'old-4', '\x01', 'v1', '', now() - interval '30 days')),
          '(duplicate,f)', 'discard: redeliveries are duplicates');
SELECT is((SELECT status FROM inbox.quarantine WHERE consumer = 'tr' AND message_id = 'old-4'), 'discarded',
          'discard: the entry stays closed');
-- repaired: a never-seen message produced before the watermark is expired too; the operator
-- vouches it is new and repair claims and applies it now.
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tr', 'p', 'new-5', 'credit', '{"id": "new-5"}', '', now() - interval '30 days')),
          'expired', 'repair: a never-seen message produced before the watermark is expired as well');
SELECT is((SELECT outcome FROM inbox.repair((SELECT quarantine_id FROM inbox.quarantine WHERE consumer = 'tr' AND message_id = 'new-5'), 'it is new')),
          'applied', 'repair: an expired entry is claimed and applied now');
SELECT is((SELECT status FROM inbox.quarantine WHERE consumer = 'tr' AND message_id = 'new-5'), 'recovered',
          'repair: the expired entry closes as recovered');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tr', 'p', 'new-5', 'credit', '{"id": "new-5"}', '', now() - interval '30 days')),
          'duplicate', 'repair: redeliveries of the repaired identity are duplicates');
SELECT is((SELECT count(*)::integer FROM tapr.ledger WHERE message_id = 'new-5'), 1, 'repair: applied once');

-- ------------------------------------------------------------------ what else the purge keeps
UPDATE inbox.purge_state SET announced_before = NULL, purged_before = NULL, watermark = NULL WHERE consumer = 'tr';
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, status, processed_at)
VALUES ('tr', '', 'p', 'q-held', '\x00', 'v1', 'quarantined', now() - interval '40 days'),
       ('tr', '', 'p', 'q-disc', '\x00', 'v1', 'discarded', now() - interval '40 days'),
       ('tr', '', 'p', 'q-conf', '\x00', 'v1', 'processed', now() - interval '40 days'),
       ('tr', '', 'p', 'q-outbox', '\x00', 'v1', 'processed', now() - interval '25 days'),
       ('tr', '', 'p', 'q-gone', '\x00', 'v1', 'processed', now() - interval '40 days'),
       ('tr', '', 'special', 'q-special', '\x00', 'v1', 'processed', now() - interval '40 days');
INSERT INTO inbox.quarantine (consumer, tenant, producer, message_id, kind, reason_code, handler_version)
VALUES ('tr', '', 'p', 'q-conf', 'conflict', 'identity_conflict', 'v1');
DO $$ BEGIN PERFORM inbox.enqueue_effect('tap-effect', 'hook', '{}'); END $$;
UPDATE inbox.outbox SET created_at = now() - interval '26 days' WHERE effect_id = 'tap-effect';
SELECT is((SELECT status FROM inbox.announce_purge('tr', '')), 'announced', 'announce for producer '''' only');
UPDATE inbox.purge_state SET announce_xid = '2'::xid8 WHERE consumer = 'tr';
SELECT is((SELECT rows_deleted FROM inbox.purge_batch('tr', '', 1000)), 1::bigint, 'purge_batch for the default policy');
SELECT is((SELECT array_agg(message_id ORDER BY message_id) FROM inbox.message WHERE consumer = 'tr' AND message_id LIKE 'q-%'),
          ARRAY['q-conf', 'q-disc', 'q-held', 'q-outbox', 'q-special'],
          'kept: quarantined, discarded, open conflict, processed after a pending outbox effect, other policy''s producer');
SELECT is((SELECT count(*)::integer FROM inbox.purge_batch('tr')), 2, 'purge_batch(consumer): one row per policy');

-- ------------------------------------------------------------------ locks
SELECT ok(inbox.purge_lock('tr'), 'purge_lock: this session becomes the purger');
SELECT ok(inbox.purge_lock('tr'), 'purge_lock: again (re-entrant, not stacked)');
SELECT ok(inbox.purge_unlock('tr'), 'purge_unlock: released');
SELECT ok(NOT inbox._purge_lock_held('tr'), 'purge_unlock released every hold');
SELECT ok(NOT inbox.purge_unlock('tr'), 'purge_unlock when not the purger: false');
SELECT throws_ok($$SELECT inbox.purge_lock('')$$, '22023', NULL, 'purge_lock: empty consumer');
SELECT throws_ok($$CALL inbox.purge('tr', batch_size => 0)$$, '22023', NULL, 'purge: bad batch_size, before anything');
SELECT throws_ok($$CALL inbox.purge('tr', max_batches => 0)$$, '22023', NULL, 'purge: bad max_batches');
SELECT throws_ok($$CALL inbox.purge('tr')$$, '2D000', NULL, 'purge inside a transaction block: invalid transaction termination');

-- ------------------------------------------------------------------ status view
SELECT is((SELECT (retention_window, dominating_scenario, rows_purged >= 5, expired_total >= 5)::text
             FROM inbox.retention_status WHERE consumer = 'tr' AND producer = ''),
          '("17 days 01:00:00",dead_letter_redrive_horizon,t,t)', 'retention_status: window, scenario, counts');
SELECT ok((SELECT purge_lag >= '0'::interval FROM inbox.retention_status WHERE consumer = 'tr' AND producer = ''),
          'retention_status: purge_lag in active time');
SELECT is((SELECT count(*)::integer FROM inbox.retention_status WHERE consumer = 'tr2'), 1, 'one row per policy');

-- ------------------------------------------------------------------ signatures
SELECT function_returns('inbox', 'purge_batch', ARRAY['text', 'text', 'integer'], 'setof record', 'purge_batch returns rows');
SELECT ok(pg_catalog.has_function_privilege('inbox_reader', 'inbox.retention_window(text, text)', 'EXECUTE'),
          'readers may compute a window');
SELECT ok(NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.purge(text, text, integer, integer, interval, bigint, text, interval)', 'EXECUTE'),
          'consumers may not purge');

SELECT * FROM finish();
ROLLBACK;
