-- pgTAP: sql/101_retention_watermark_tables.sql and the 0.3.0 watermark (docs/retention.md): the
-- watermark is the announced cutoff and bounds what the purge deletes; no margin, however large or
-- mistyped, pushes it past what was purged; a window shorter than the clock tolerance is refused;
-- a watermark ahead of the clock expires nothing produced now; an operator moves one down, audited,
-- never below what was purged; a released expired entry lets exactly one delivery through.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(28);

\ir write_counter.psql

CREATE SCHEMA taprw;
CREATE TABLE taprw.ledger (message_id text NOT NULL);
CREATE FUNCTION taprw.credit(payload jsonb, ctx inbox.message_context) RETURNS void LANGUAGE sql
    BEGIN ATOMIC INSERT INTO taprw.ledger VALUES (ctx.message_id); END;
SELECT inbox.register_handler('rw', 'credit', 'taprw.credit(jsonb, inbox.message_context)'::regprocedure, 'v1') \g /dev/null
-- Active for 100 days, so that a window of days has a cutoff.
INSERT INTO inbox.consumer_config (consumer, last_active_at) VALUES ('rw', now());
INSERT INTO inbox.activity_gap VALUES ('rw', '-infinity', now() - interval '100 days');

-- ================================================================== the window holds the tolerance
SELECT throws_ok($$SELECT inbox.set_retention_policy('rw', '', '1 minute', '0', '0', '0', '0', '0', '0', '0', 'too short')$$,
                 '22023', 'inbox.set_retention_policy: the window without its safety margin (00:01:00) is shorter than the clock tolerance (00:05:00)',
                 'a window shorter than the 5-minute clock tolerance is refused');
SELECT throws_ok($$SELECT inbox.set_retention_policy('rw', '', '1 day', '0', '0', '0', '0', '0', '0', '30 days', 'margin typo')$$,
                 '22023', NULL, 'a safety margin larger than the redelivery horizons is refused');
SELECT lives_ok($$SELECT inbox.set_retention_policy('rw', '', '7 days', '0', '0', '0', '0', '0', '0', '1 hour', 'sane')$$,
                'a window of 7 days and a margin of 1 hour is accepted');

-- ================================================================== the watermark is the cutoff
-- Rows processed 30 days ago: two produced before (normal), one produced "after" its processing
-- by a producer whose clock ran ahead (produced_at within the margin), one without produced_at.
DO $$ BEGIN PERFORM inbox.claim_and_apply('rw', 'p', m, 'credit', '{}') FROM unnest(ARRAY['old-1', 'old-2', 'ahead', 'no-ts']) m; END $$;
UPDATE inbox.message SET processed_at = now() - interval '30 days', produced_at = now() - interval '31 days'
 WHERE consumer = 'rw' AND message_id IN ('old-1', 'old-2');
UPDATE inbox.message SET processed_at = now() - interval '30 days', produced_at = now() - interval '6 days 23 hours'
 WHERE consumer = 'rw' AND message_id = 'ahead';
UPDATE inbox.message SET processed_at = now() - interval '30 days', produced_at = NULL
 WHERE consumer = 'rw' AND message_id = 'no-ts';
SELECT is((SELECT watermark FROM inbox.announce_purge('rw')), now() - interval '7 days 1 hour',
          'announce: the watermark is the cutoff (window 7 days 1 hour), no margin added, behind the clock');
UPDATE inbox.purge_state SET announce_xid = '2'::xid8 WHERE consumer = 'rw';   -- as if committed, nobody waited for
SELECT is((SELECT (status, rows_deleted)::text FROM inbox.purge_batch('rw')), '(purged,3)',
          'purge: rows produced before the watermark go, and the one without produced_at');
SELECT is((SELECT array_agg(message_id) FROM inbox.message WHERE consumer = 'rw'), ARRAY['ahead'],
          'purge: a row produced after the watermark stays (its redelivery could not be told expired)');
SELECT is((SELECT purged_produced_max FROM inbox.purge_state WHERE consumer = 'rw'), now() - interval '31 days',
          'purge: records the latest produced_at it deleted');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'old-1', 'credit', '{}', '', now() - interval '31 days')),
          'expired', 'a purged message redelivered is expired');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'ahead', 'credit', '{}', '', now() - interval '6 days 23 hours')),
          'duplicate', 'the kept row still catches its redelivery');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'fresh', 'credit', '{}', '', now() - interval '3 minutes')),
          'applied', 'a message produced just now (a producer clock minutes behind) is applied');

-- ================================================================== released: one delivery
SELECT quarantine_id AS q_old1 FROM inbox.quarantine WHERE consumer = 'rw' AND message_id = 'old-1' \gset
SELECT inbox.release(:q_old1, 'the producer resent it on purpose') \g /dev/null
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'old-1', 'credit', '{}', '', now() - interval '31 days')),
          'applied', 'release: the next delivery is applied');
SELECT ok((SELECT release_used_at = now() FROM inbox.quarantine WHERE quarantine_id = :q_old1), 'release: its use is stamped');
-- Purged again later: a redelivery is expired again, the release does not exempt the identity.
DELETE FROM inbox.message WHERE consumer = 'rw' AND message_id = 'old-1';
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'old-1', 'credit', '{}', '', now() - interval '31 days')),
          'expired', 'release: after another purge the identity is expired again (one application per release)');
SELECT is((SELECT count(*)::integer FROM taprw.ledger WHERE message_id = 'old-1'), 2,
          'release: applied once by the first delivery and once by the release, never more');
SELECT is((SELECT (status, release_used_at IS NOT NULL)::text FROM inbox.quarantine WHERE quarantine_id = :q_old1), '(open,t)',
          'release: the entry reopened, its release used');
SELECT inbox.release(:q_old1, 'once more') \g /dev/null
SELECT is((SELECT release_used_at FROM inbox.quarantine WHERE quarantine_id = :q_old1), NULL,
          'release again: a fresh release, not used yet');

-- ================================================================== a watermark ahead of the clock
-- As a mistyped margin left it before 0.3.0: 29 days ahead.
UPDATE inbox.purge_state SET watermark = now() + interval '29 days' WHERE consumer = 'rw';
UPDATE inbox.consumer_config SET purge_watermark = now() + interval '29 days' WHERE consumer = 'rw';
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'now-1', 'credit', '{}', '', now())), 'applied',
          'a watermark ahead of the clock does not expire a message produced now');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'day-1', 'credit', '{}', '', now() - interval '1 day')), 'applied',
          '... nor one produced a day ago: nothing produced after the latest purged produced_at is expired');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'old-3', 'credit', '{}', '', now() - interval '32 days')), 'expired',
          '... one produced before what was purged still expires');

-- ================================================================== correcting a watermark
SELECT throws_ok($$SELECT inbox.correct_watermark('rw', '', now() - interval '40 days', 'too low')$$, '22023', NULL,
                 'correct_watermark: never below the latest produced_at purged');
SELECT throws_ok($$SELECT inbox.correct_watermark('rw', '', now() - interval '31 days', 'equal')$$, '22023',
                 format('inbox.correct_watermark: %s is not later than the latest produced_at the purge deleted (%s)',
                        now() - interval '31 days', now() - interval '31 days'),
                 'correct_watermark: not even down to it (that row''s redelivery would not be before the watermark)');
SELECT throws_ok($$SELECT inbox.correct_watermark('rw', '', now() + interval '40 days', 'up')$$, '22023', NULL,
                 'correct_watermark: never up');
SELECT throws_ok($$SELECT inbox.correct_watermark('rw', '', now(), ' ')$$, '22023', NULL, 'correct_watermark: needs a note');
SELECT throws_ok($$SELECT inbox.correct_watermark('nobody', '', now(), 'x')$$, 'P0002', NULL,
                 'correct_watermark: a consumer without a watermark is P0002');
SELECT is((SELECT watermark FROM inbox.correct_watermark('rw', '', now() - interval '30 days', 'margin typo of 0.2.0')),
          now() - interval '30 days', 'correct_watermark: moves it down to just after what was purged');
SELECT is((SELECT (previous_watermark, watermark, changed_by = session_user, note)::text FROM inbox.watermark_change
            WHERE consumer = 'rw'),
          (now() + interval '29 days', now() - interval '30 days', true, 'margin typo of 0.2.0')::text,
          'correct_watermark: audited');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'day-1b', 'credit', '{}', '', now() - interval '1 day')), 'applied',
          'correct_watermark: a message produced a day ago is applied (nothing that young was purged)');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('rw', 'p', 'old-2', 'credit', '{}', '', now() - interval '31 days')), 'expired',
          'correct_watermark: a redelivery of the latest purged message stays expired');

SELECT * FROM finish();
ROLLBACK;
