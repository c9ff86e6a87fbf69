-- pgTAP: sql/050_quarantine.sql — operator decisions: discard, release, repair, and their audit trail.
-- Runs as the superuser that deployed; privileges are tested in 027_security.sql.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(98);

-- ------------------------------------------------------------------ fixtures
\ir write_counter.psql

CREATE SCHEMA tapq;
CREATE TABLE tapq.effect (message text PRIMARY KEY, version text NOT NULL);
CREATE TABLE tapq.ctx_log (ctx inbox.message_context);
CREATE SEQUENCE tapq.calls;
CREATE FUNCTION tapq.calls() RETURNS bigint LANGUAGE sql AS
    $$SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM tapq.calls$$;
CREATE FUNCTION tapq.broken(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapq.calls');
    INSERT INTO tapq.effect VALUES (payload ->> 'm', 'broken');
    RAISE EXCEPTION 'broken handler for %', payload ->> 'm';
END
$$;
CREATE FUNCTION tapq.fixed(payload jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapq.calls');
    INSERT INTO tapq.effect VALUES (payload ->> 'm', ctx.handler_version);
    INSERT INTO tapq.ctx_log VALUES (ctx);
END
$$;

-- The handlers are SECURITY DEFINER functions of the consumer's own role, bound to it: repair runs
-- a handler only with the rights of a role bound to the consumer (0.3.0: an unbound consumer is
-- refused), called by inbox_runner, which needs USAGE on the handlers' schema.
CREATE ROLE tap_q_service NOLOGIN;
GRANT USAGE ON SCHEMA tapq TO tap_q_service, inbox_runner;
GRANT SELECT, INSERT ON tapq.effect, tapq.ctx_log TO tap_q_service;
GRANT USAGE, UPDATE ON SEQUENCE tapq.calls TO tap_q_service;
ALTER FUNCTION tapq.broken(jsonb) SECURITY DEFINER SET search_path = tapq, pg_temp;
ALTER FUNCTION tapq.fixed(jsonb, inbox.message_context) SECURITY DEFINER SET search_path = tapq, pg_temp;
ALTER FUNCTION tapq.broken(jsonb) OWNER TO tap_q_service;
ALTER FUNCTION tapq.fixed(jsonb, inbox.message_context) OWNER TO tap_q_service;
SELECT inbox.bind_consumer('tap-q', 'tap_q_service', note => 'pgTAP') \g /dev/null

-- Consumer tap-q quarantines at the first failure.
SELECT inbox.configure_consumer('tap-q', max_attempts => 1) \g /dev/null
SELECT inbox.register_handler('tap-q', 'thing', 'tapq.broken(jsonb)', 'v1') \g /dev/null

-- Quarantine entries to decide on.
CREATE TEMP TABLE entry (name text PRIMARY KEY, id bigint NOT NULL);
INSERT INTO entry SELECT 'f-discard', quarantine_id FROM inbox.claim_and_apply('tap-q', 'p', 'm1', 'thing', '{"m": "m1"}');
INSERT INTO entry SELECT 'f-release', quarantine_id FROM inbox.claim_and_apply('tap-q', 'p', 'm2', 'thing', '{"m": "m2"}');
INSERT INTO entry SELECT 'f-repair', quarantine_id FROM inbox.claim_and_apply('tap-q', 'p', 'm3', 'thing', '{"m": "m3"}', 'tn');
INSERT INTO entry SELECT 'f-repair-fails', quarantine_id FROM inbox.claim_and_apply('tap-q', 'p', 'm4', 'thing', '{"m": "m4"}');
SELECT inbox.claim('tap-q', 'p', 'c1', '{"m": "c1"}') \g /dev/null
INSERT INTO entry SELECT 'c-discard', quarantine_id FROM inbox.claim('tap-q', 'p', 'c1', '{"m": "c1", "changed": true}');
SELECT inbox.claim('tap-q', 'p', 'c2', '{"m": "c2"}') \g /dev/null
INSERT INTO entry SELECT 'c-open', quarantine_id FROM inbox.claim('tap-q', 'p', 'c2', '{"m": "c2", "changed": true}');
-- Failure entries a repair cannot run: no payload (store_payloads false), no message type, no handler.
SELECT inbox.configure_consumer('tap-nopayload', max_attempts => 1, store_payloads => false) \g /dev/null
SELECT inbox.register_handler('tap-nopayload', 'thing', 'tapq.broken(jsonb)', 'v1') \g /dev/null
INSERT INTO entry SELECT 'f-no-payload', quarantine_id
  FROM inbox.claim_and_apply('tap-nopayload', 'p', 'm5', 'thing', '{"m": "m5"}');
INSERT INTO entry SELECT 'f-no-type', quarantine_id FROM inbox.record_failure('tap-q', 'p', 'm6', '{"m": "m6"}', 'X1');
INSERT INTO entry SELECT 'f-no-handler', quarantine_id
  FROM inbox.record_failure('tap-q', 'p', 'm7', '{"m": "m7"}', 'X1', message_type => 'unregistered');
INSERT INTO entry SELECT 'f-crash', quarantine_id FROM inbox.record_start('tap-q', 'p', 'm8');
INSERT INTO entry SELECT 'f-blank', quarantine_id FROM inbox.record_failure('tap-q', 'p', 'm9', '{"m": "m9"}', 'X1');

SELECT is((SELECT count(*)::integer FROM entry e JOIN inbox.quarantine q ON q.quarantine_id = e.id WHERE q.status = 'open'), 11,
          'fixtures: eleven open quarantine entries');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine_decision), 0, 'fixtures: no decisions yet');
SELECT session_user AS me \gset
SELECT id AS f_discard FROM entry WHERE name = 'f-discard' \gset
SELECT id AS f_release FROM entry WHERE name = 'f-release' \gset
SELECT id AS f_repair FROM entry WHERE name = 'f-repair' \gset
SELECT id AS f_repair_fails FROM entry WHERE name = 'f-repair-fails' \gset
SELECT id AS c_discard FROM entry WHERE name = 'c-discard' \gset
SELECT id AS c_open FROM entry WHERE name = 'c-open' \gset
SELECT id AS f_no_payload FROM entry WHERE name = 'f-no-payload' \gset
SELECT id AS f_no_type FROM entry WHERE name = 'f-no-type' \gset
SELECT id AS f_no_handler FROM entry WHERE name = 'f-no-handler' \gset
SELECT id AS f_crash FROM entry WHERE name = 'f-crash' \gset
SELECT id AS f_blank FROM entry WHERE name = 'f-blank' \gset

-- ================================================================== discard
SELECT is((SELECT (d.quarantine_id = :f_discard, d.status, d.decided_by = session_user, d.decided_at = now())::text
             FROM inbox.discard(:f_discard, 'customer cancelled the order') d),
          '(t,discarded,t,t)', 'discard: returns the entry, closed as discarded by session_user');
SELECT is((SELECT status FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'm1'), 'discarded',
          'discard: a failure entry''s identity becomes discarded');
SELECT results_eq(format($$SELECT decision, result, note, decided_by, reason_code FROM inbox.quarantine_decision
                            WHERE quarantine_id = %s$$, :f_discard),
                  $$VALUES ('discard', 'discarded', 'customer cancelled the order', session_user::text COLLATE "default", NULL::text)$$,
                  'discard: exactly one audit row with decided_by = session_user and the note');
SELECT tapq.calls() AS calls0 \gset
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tap-q', 'p', 'm1', 'thing', '{"m": "m1"}')), 'duplicate',
          'discard: a later delivery of the discarded identity is a duplicate');
SELECT is((SELECT outcome FROM inbox.claim('tap-q', 'p', 'm1', '{"m": "other"}')), 'duplicate',
          'discard: whatever its payload');
SELECT is(tapq.calls(), :calls0::bigint, 'discard: the handler does not run for a discarded identity');

SELECT is((SELECT status FROM inbox.discard(:c_discard, 'producer bug, fixed upstream')), 'discarded',
          'discard: a conflict entry is closed as discarded');
SELECT is((SELECT status FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'c1'), 'processed',
          'discard: a conflict entry''s identity stays processed (it was applied once)');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine_decision WHERE quarantine_id = :c_discard AND decision = 'discard'
              AND result = 'discarded' AND note = 'producer bug, fixed upstream' AND decided_by = session_user), 1,
          'discard: the conflict decision leaves one audit row');
SELECT is((SELECT outcome FROM inbox.claim('tap-q', 'p', 'c1', '{"m": "c1"}')), 'duplicate',
          'discard: the conflict''s original payload is still a duplicate');
-- Document-by-test: the discarded conflicting payload, delivered again, is still a conflict on the
-- same (closed) entry; it is counted, not reopened.
SELECT is((SELECT (c.outcome, c.quarantine_id = :c_discard)::text
             FROM inbox.claim('tap-q', 'p', 'c1', '{"m": "c1", "changed": true}') c), '(conflict,t)',
          'discard: the discarded conflicting payload redelivered is a conflict on the same entry');
SELECT is((SELECT (status, deliveries)::text FROM inbox.quarantine WHERE quarantine_id = :c_discard), '(discarded,2)',
          'discard: the closed conflict entry counts the delivery and stays discarded');

-- ================================================================== release
SELECT is((SELECT (r.status, r.decided_by = session_user)::text FROM inbox.release(:f_release, 'handler fixed, let it retry') r),
          '(released,t)', 'release: a failure entry is closed as released');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'm2'), 0,
          'release: the placeholder claim row is gone');
SELECT is((SELECT (started, failed, first_failure_at IS NULL, last_failure_at IS NULL)::text
             FROM inbox.attempt WHERE consumer = 'tap-q' AND message_id = 'm2'), '(0,0,t,t)',
          'release: the attempt counters are reset');
SELECT results_eq(format($$SELECT decision, result, note, decided_by FROM inbox.quarantine_decision
                            WHERE quarantine_id = %s$$, :f_release),
                  $$VALUES ('release', 'released', 'handler fixed, let it retry', session_user::text COLLATE "default")$$,
                  'release: exactly one audit row with decided_by = session_user and the note');
SELECT inbox.register_handler('tap-q', 'thing', 'tapq.fixed(jsonb, inbox.message_context)', 'v2') \g /dev/null
SELECT is((SELECT (outcome, handler_version)::text FROM inbox.claim_and_apply('tap-q', 'p', 'm2', 'thing', '{"m": "m2"}')),
          '(applied,v2)', 'release: the next delivery is processed normally (applied)');
SELECT is((SELECT version FROM tapq.effect WHERE message = 'm2'), 'v2', 'release: the next delivery''s change happened');
SELECT is((SELECT status FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'm2'), 'processed',
          'release: the identity is processed now');

SELECT is((SELECT status FROM inbox.release(:f_crash, 'crash fixed')), 'released', 'release: a crash-loop entry is released');
SELECT is((SELECT started FROM inbox.attempt WHERE consumer = 'tap-q' AND message_id = 'm8'), 0,
          'release: the started counter of a crash loop is reset');
SELECT is((SELECT outcome FROM inbox.record_start('tap-q', 'p', 'm8')), 'quarantined',
          'release: with max_attempts 1, a new crash loop quarantines again');
SELECT is((SELECT (status, decided_at IS NULL)::text FROM inbox.quarantine WHERE quarantine_id = :f_crash), '(open,t)',
          'release: quarantined again, the same entry reopens');

-- ================================================================== repair
SELECT tapq.calls() AS calls0 \gset
CREATE TEMP TABLE repaired AS SELECT * FROM inbox.repair(:f_repair, 'replayed with the v2 handler');
SELECT is((SELECT (outcome, handler_version, quarantine_id = :f_repair, processed_at = now(),
                   payload_sha256 = encode(inbox.payload_hash('{"m": "m3"}'), 'hex'))::text FROM repaired),
          '(applied,v2,t,t,t)', 'repair: with the fixed handler registered the outcome is applied, with the new version');
SELECT is((SELECT version FROM tapq.effect WHERE message = 'm3'), 'v2', 'repair: the domain change happened');
SELECT is(tapq.calls() - :calls0, 1::bigint, 'repair: the handler ran once');
SELECT is((SELECT ((ctx).tenant, (ctx).consumer, (ctx).producer, (ctx).message_id, (ctx).message_type, (ctx).handler_version)::text
             FROM tapq.ctx_log WHERE (ctx).message_id = 'm3'), '(tn,tap-q,p,m3,thing,v2)',
          'repair: the handler receives the stored identity as context');
SELECT is((SELECT (status, handler_version, processed_at = now(), payload_sha256 = inbox.payload_hash('{"m": "m3"}'))::text
             FROM inbox.message WHERE consumer = 'tap-q' AND tenant = 'tn' AND message_id = 'm3'),
          '(processed,v2,t,t)', 'repair: the identity is processed with the new handler version');
SELECT is((SELECT (status, decided_by = session_user)::text FROM inbox.quarantine WHERE quarantine_id = :f_repair),
          '(recovered,t)', 'repair: the entry is recovered');
SELECT results_eq(format($$SELECT decision, result, note, decided_by FROM inbox.quarantine_decision
                            WHERE quarantine_id = %s$$, :f_repair),
                  $$VALUES ('repair', 'recovered', 'replayed with the v2 handler', session_user::text COLLATE "default")$$,
                  'repair: exactly one audit row with decided_by = session_user and the note');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tap-q', 'p', 'm3', 'thing', '{"m": "m3"}', 'tn')), 'duplicate',
          'repair: a later delivery of the repaired identity is a duplicate');
SELECT is(tapq.calls() - :calls0, 1::bigint, 'repair: ... and does not run the handler again');

-- A repair whose handler still fails: failed, entry stays open, audit row repair_failed.
SELECT inbox.register_handler('tap-q', 'thing', 'tapq.broken(jsonb)', 'v3') \g /dev/null
CREATE TEMP TABLE repair_failed AS SELECT * FROM inbox.repair(:f_repair_fails, 'trying v3');
SELECT is((SELECT (outcome, reason_code, error_message)::text FROM repair_failed),
          '(failed,P0001,"broken handler for m4")', 'repair: a still-failing handler: failed, with reason and error');
SELECT is((SELECT (status, reason_code, error_message, decided_at IS NULL)::text FROM inbox.quarantine
            WHERE quarantine_id = :f_repair_fails),
          '(open,P0001,"broken handler for m4",t)', 'repair: the entry stays open, with the latest reason');
SELECT is((SELECT status FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'm4'), 'quarantined',
          'repair: the identity stays held by quarantine');
SELECT is((SELECT count(*)::integer FROM tapq.effect WHERE message = 'm4'), 0, 'repair: the failed handler''s writes rolled back');
SELECT results_eq(format($$SELECT decision, result, note, decided_by, reason_code, error_message FROM inbox.quarantine_decision
                            WHERE quarantine_id = %s$$, :f_repair_fails),
                  $$VALUES ('repair', 'repair_failed', 'trying v3', session_user::text COLLATE "default", 'P0001', 'broken handler for m4')$$,
                  'repair: exactly one audit row, repair_failed, with the reason');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tap-q', 'p', 'm4', 'thing', '{"m": "m4"}')), 'quarantined',
          'repair: after a failed repair deliveries are still quarantined');
SELECT inbox.register_handler('tap-q', 'thing', 'tapq.fixed(jsonb, inbox.message_context)', 'v4') \g /dev/null
SELECT is((SELECT outcome FROM inbox.repair(:f_repair_fails, 'v4 fixes it')), 'applied',
          'repair: an entry whose repair failed can be repaired later');
SELECT is((SELECT string_agg(result, ',' ORDER BY decision_id) FROM inbox.quarantine_decision
            WHERE quarantine_id = :f_repair_fails), 'repair_failed,recovered', 'repair: both attempts are in the audit trail');

-- ================================================================== refusals
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(format($$SELECT inbox.release(%s, 'retry')$$, :c_open), '55000',
                 format('inbox.release: entry %s is an identity conflict; its identity was already applied', :c_open),
                 'release: a conflict entry is 55000');
SELECT throws_ok(format($$SELECT inbox.repair(%s, 'retry')$$, :c_open), '55000',
                 format('inbox.repair: entry %s is an identity conflict; its identity was already applied', :c_open),
                 'repair: a conflict entry is 55000');
SELECT throws_ok(format($$SELECT inbox.repair(%s, 'retry')$$, :f_no_payload), '55000',
                 format('inbox.repair: entry %s has no stored payload', :f_no_payload),
                 'repair: an entry without payload (store_payloads false) is 55000');
SELECT throws_ok(format($$SELECT inbox.repair(%s, 'retry')$$, :f_no_type), '55000',
                 format('inbox.repair: entry %s has no message type, so no SQL handler can run it', :f_no_type),
                 'repair: an entry without message type is 55000');
SELECT throws_ok(format($$SELECT inbox.repair(%s, 'retry')$$, :f_no_handler), '42704',
                 'inbox.repair: no handler registered for consumer ''tap-q'' and message type ''unregistered''',
                 'repair: an entry whose message type has no handler is 42704');
SELECT throws_ok(format($$SELECT inbox.discard(%s, 'again')$$, :f_discard), '55000',
                 format('inbox.discard: quarantine entry %s is already discarded', :f_discard),
                 'discard: a second decision on a discarded entry is 55000');
SELECT throws_ok(format($$SELECT inbox.release(%s, 'again')$$, :f_discard), '55000',
                 format('inbox.release: quarantine entry %s is already discarded', :f_discard),
                 'release: a decision on a discarded entry is 55000');
SELECT throws_ok(format($$SELECT inbox.repair(%s, 'again')$$, :f_discard), '55000',
                 format('inbox.repair: quarantine entry %s is already discarded', :f_discard),
                 'repair: a decision on a discarded entry is 55000');
SELECT throws_ok(format($$SELECT inbox.discard(%s, 'again')$$, :f_release), '55000',
                 format('inbox.discard: quarantine entry %s is already released', :f_release),
                 'discard: a decision on a released entry is 55000');
SELECT throws_ok(format($$SELECT inbox.release(%s, 'again')$$, :f_repair), '55000',
                 format('inbox.release: quarantine entry %s is already recovered', :f_repair),
                 'release: a decision on a recovered entry is 55000');
SELECT throws_ok(format($$SELECT inbox.repair(%s, 'again')$$, :f_repair), '55000',
                 format('inbox.repair: quarantine entry %s is already recovered', :f_repair),
                 'repair: a second repair of a recovered entry is 55000');
SELECT throws_ok(format($$SELECT inbox.discard(%s, 'again')$$, :c_discard), '55000',
                 format('inbox.discard: quarantine entry %s is already discarded', :c_discard),
                 'discard: a second decision on a discarded conflict entry is 55000');
SELECT throws_ok($$SELECT inbox.discard(999999999, 'x')$$, 'P0002', 'inbox.discard: no quarantine entry 999999999',
                 'discard: an unknown id is P0002');
SELECT throws_ok($$SELECT inbox.release(999999999, 'x')$$, 'P0002', 'inbox.release: no quarantine entry 999999999',
                 'release: an unknown id is P0002');
SELECT throws_ok($$SELECT inbox.repair(999999999, 'x')$$, 'P0002', 'inbox.repair: no quarantine entry 999999999',
                 'repair: an unknown id is P0002');
SELECT throws_ok($$SELECT inbox.discard(NULL, 'x')$$, '22004', 'inbox.discard: quarantine_id must not be NULL',
                 'discard: NULL id is 22004');
SELECT throws_ok($$SELECT inbox.release(NULL, 'x')$$, '22004', 'inbox.release: quarantine_id must not be NULL',
                 'release: NULL id is 22004');
SELECT throws_ok($$SELECT inbox.repair(NULL, 'x')$$, '22004', 'inbox.repair: quarantine_id must not be NULL',
                 'repair: NULL id is 22004');
SELECT throws_ok(format($$SELECT inbox.discard(%s, NULL)$$, :f_no_type), '22004',
                 'inbox.discard: a decision needs a note saying why', 'discard: NULL note is 22004');
SELECT throws_ok(format($$SELECT inbox.discard(%s, '')$$, :f_no_type), '22023',
                 'inbox.discard: a decision needs a note saying why', 'discard: empty note is 22023');
SELECT throws_ok(format($$SELECT inbox.discard(%s, '   ')$$, :f_no_type), '22023',
                 'inbox.discard: a decision needs a note saying why', 'discard: a note of spaces is 22023');
SELECT throws_ok(format($$SELECT inbox.release(%s, NULL)$$, :f_no_type), '22004',
                 'inbox.release: a decision needs a note saying why', 'release: NULL note is 22004');
SELECT throws_ok(format($$SELECT inbox.release(%s, '')$$, :f_no_type), '22023',
                 'inbox.release: a decision needs a note saying why', 'release: empty note is 22023');
SELECT throws_ok(format($$SELECT inbox.repair(%s, NULL)$$, :f_no_handler), '22004',
                 'inbox.repair: a decision needs a note saying why', 'repair: NULL note is 22004');
SELECT throws_ok(format($$SELECT inbox.repair(%s, '')$$, :f_no_handler), '22023',
                 'inbox.repair: a decision needs a note saying why', 'repair: empty note is 22023');
SELECT throws_ok($$SELECT inbox.discard(999999999, NULL)$$, '22004', 'inbox.discard: a decision needs a note saying why',
                 'discard: the note is checked before the id is looked up');
SELECT is(public.tap_writes(), :w0::bigint, 'refused decisions: none of them tried to write (no audit row, no status change)');

-- The refused entries can still be decided otherwise.
SELECT is((SELECT status FROM inbox.discard(:c_open, 'conflicts can only be discarded')), 'discarded',
          'discard: the conflict entry refused by release and repair can be discarded');
SELECT is((SELECT status FROM inbox.release(:f_no_payload, 'no payload to repair; wait for the redelivery')), 'released',
          'release: the entry without payload can be released');
SELECT is((SELECT status FROM inbox.discard(:f_no_type, 'cannot be run by SQL')), 'discarded',
          'discard: the entry without message type can be discarded');

-- ================================================================== one audit row per decision
SELECT is((SELECT count(*)::integer FROM inbox.quarantine q
            WHERE q.status <> 'open'
              AND (SELECT count(*) FROM inbox.quarantine_decision d
                    WHERE d.quarantine_id = q.quarantine_id AND d.result = q.status) <> 1
              AND q.quarantine_id IN (SELECT id FROM entry) AND q.quarantine_id <> :f_crash),
          0, 'every closed entry has exactly one audit row with its closing result');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine_decision
            WHERE decided_by <> session_user OR note IS NULL OR decided_at IS NULL), 0,
          'every audit row names session_user and has a note and a time');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine_decision), 10,
          'ten decisions were made (one repair twice), ten audit rows exist');

-- A note of white space only (tabs, newlines) says nothing either.
SELECT throws_ok(format($$SELECT inbox.discard(%s, E'\t\n')$$, :f_blank), '22023',
                 'inbox.discard: a decision needs a note saying why', 'discard: a note of tabs and newlines is 22023');

-- ================================================================== the hold is gone
-- inbox._settle_hold, the claim of every repair (inbox.repair, inbox.begin_granted_repair: its test
-- is in 121_python_repair.sql): the entry is open but its identity is no longer held by quarantine.
-- Nothing in pginbox takes the hold away from an open entry; here a hand-made row does.
CREATE FUNCTION pg_temp.error_of(statement text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    state text;
    message text;
    hint text;
BEGIN
    EXECUTE statement;
    RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, message = MESSAGE_TEXT, hint = PG_EXCEPTION_HINT;
    RETURN format('%s: %s (HINT: %s)', state, message, hint);
END
$$;
SELECT quarantine_id AS gone_failure
  FROM inbox.record_failure('tap-q', 'p', 'm10', '{"m": "m10"}', 'X1', message_type => 'thing') \gset
DELETE FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'm10';
-- An expired entry whose identity a delivery processed meanwhile (the pre-0.2.0 entry has no hold row).
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, status, processed_at)
VALUES ('tap-q', '', 'p', 'm11', inbox.payload_hash('{"m": "m11"}'), 'v1', 'processed', now());
INSERT INTO inbox.quarantine (consumer, tenant, producer, message_id, kind, message_type, payload_sha256, payload,
                              reason_code, handler_version, recorded_by)
VALUES ('tap-q', '', 'p', 'm11', 'expired', 'thing', inbox.payload_hash('{"m": "m11"}'), '{"m": "m11"}', 'expired', 'v1',
        session_user)
RETURNING quarantine_id AS gone_expired \gset
SELECT tapq.calls() AS calls0 \gset
SELECT public.tap_writes('quarantine_decision') AS d0 \gset
SELECT is(pg_temp.error_of(format($$SELECT inbox.repair(%s, 'the hold is gone')$$, :gone_failure)),
          format('55000: inbox.repair: identity of entry %s is no longer held by quarantine (HINT: Another delivery or '
                 'decision processed it meanwhile: look at the entry with pginbox quarantine show.)', :gone_failure),
          'repair: a failure entry whose hold is gone is 55000, with its hint');
SELECT is(pg_temp.error_of(format($$SELECT inbox.repair(%s, 'the hold is gone')$$, :gone_expired)),
          format('55000: inbox.repair: identity of entry %s is no longer held by quarantine (HINT: Another delivery or '
                 'decision processed it meanwhile: look at the entry with pginbox quarantine show.)', :gone_expired),
          'repair: an expired entry whose identity was processed meanwhile is 55000, with its hint');
SELECT is((SELECT array_agg(status ORDER BY quarantine_id) FROM inbox.quarantine
            WHERE quarantine_id IN (:gone_failure, :gone_expired)), ARRAY['open', 'open'],
          'repair: the entries whose hold is gone stay open');
SELECT is((SELECT (status, handler_version)::text FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'm11'),
          '(processed,v1)', 'repair: the identity processed meanwhile is left as it was');
SELECT is(tapq.calls() - :calls0, 0::bigint, 'repair: no handler ran for an entry whose hold is gone');
SELECT is(public.tap_writes('quarantine_decision'), :d0::bigint, 'repair: no audit row was even tried');
-- An expired entry recorded before 0.2.0, no hold row and the identity never processed: the repair
-- claims it (the operator vouches that the delivery is new).
INSERT INTO inbox.quarantine (consumer, tenant, producer, message_id, kind, message_type, payload_sha256, payload,
                              reason_code, handler_version, recorded_by)
VALUES ('tap-q', '', 'p', 'm12', 'expired', 'thing', inbox.payload_hash('{"m": "m12"}'), '{"m": "m12"}', 'expired', 'v1',
        session_user)
RETURNING quarantine_id AS unheld_expired \gset
SELECT is((SELECT (outcome, handler_version)::text FROM inbox.repair(:unheld_expired, 'new, never delivered since')),
          '(applied,v4)', 'repair: an expired entry without a hold row is claimed and applied');
SELECT is((SELECT (status, handler_version, payload_sha256 = inbox.payload_hash('{"m": "m12"}'))::text
             FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'm12'),
          '(processed,v4,t)', 'repair: its identity is processed now, with the repairing version and the stored hash');
SELECT is((SELECT status FROM inbox.quarantine WHERE quarantine_id = :unheld_expired), 'recovered',
          'repair: the expired entry without a hold row is recovered');

-- ================================================================== signatures
SELECT is_definer('inbox', f, ARRAY['bigint', 'text'], 'inbox.' || f || ' is SECURITY DEFINER')
  FROM unnest(ARRAY['discard', 'release', 'repair']) f;
SELECT isnt_definer('inbox', '_begin_repair', ARRAY['bigint', 'text'],
                    'inbox._begin_repair is repair''s own half (0.3.0): not SECURITY DEFINER, executable by its owner only');
SELECT isnt_definer('inbox', '_settle_hold', ARRAY['text', 'inbox.quarantine', 'text'],
                    'inbox._settle_hold, the claim of the repairs, is not SECURITY DEFINER: it runs inside its callers');
SELECT ok(NOT has_function_privilege(r, 'inbox._settle_hold(text, inbox.quarantine, text)', 'EXECUTE'),
          format('%s cannot execute inbox._settle_hold', r))
  FROM unnest(ARRAY['public', 'inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_runner']) r;
SELECT function_returns('inbox', 'repair', ARRAY['bigint', 'text'], 'inbox.delivery_result',
                        'inbox.repair returns inbox.delivery_result');
SELECT function_returns('inbox', 'discard', ARRAY['bigint', 'text'], 'inbox.quarantine', 'inbox.discard returns the entry');
SELECT function_returns('inbox', 'release', ARRAY['bigint', 'text'], 'inbox.quarantine', 'inbox.release returns the entry');

SELECT * FROM finish();
ROLLBACK;
