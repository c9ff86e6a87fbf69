-- pgTAP: sql/065_outbox.sql — the transactional outbox: effect ids, enqueue, commit order, claims
-- under leases with fencing tokens, results, backoff, dead effects and redrive, purge, the
-- wake-up signal's waiter table, and privileges tried as an attacker.
-- Runs as the superuser that deployed. Time stands still inside the test transaction (now()), so
-- leases are expired and backoffs elapsed by moving available_at / delivered_at by hand.
-- Out-of-order commits need two sessions: tests/python/integration/test_outbox_order.py; real NOTIFY delivery
-- needs a commit: tests/python/integration/test_outbox_signal.py.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(458);

-- ------------------------------------------------------------------ fixtures
\ir write_counter.psql

-- The current lease token of an effect.
CREATE FUNCTION pg_temp.token(id text) RETURNS bigint LANGUAGE sql AS
    $$SELECT o.lease_token FROM inbox.outbox o WHERE o.effect_id = id$$;
-- Leases expire and backoffs elapse by hand (now() does not move inside the test transaction).
CREATE FUNCTION pg_temp.make_due(id text) RETURNS void LANGUAGE sql AS $$
    UPDATE inbox.outbox o SET available_at = now() - interval '1 second',
                              lease_expires_at = CASE WHEN o.status = 'leased' THEN now() - interval '1 second' END
     WHERE o.effect_id = id
$$;
CREATE FUNCTION pg_temp.claimed(dispatcher text, n integer DEFAULT 10) RETURNS text[] LANGUAGE sql AS
    $$SELECT coalesce(array_agg(c.effect_id ORDER BY c.effect_id), '{}') FROM inbox.claim_effects(dispatcher, n, key_aware => true) c$$;

-- Self-test: the counter sees a write even when it is rolled back.
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($q$DO $d$ BEGIN PERFORM inbox.enqueue_effect('tap-self', 'd', '{}'); RAISE EXCEPTION 'undo'; END $d$ $q$,
                 'P0001', 'undo', 'self-test: an enqueue followed by an error');
SELECT cmp_ok(public.tap_writes(), '>', :w0::bigint, 'self-test: the write counter saw the rolled-back enqueue');

-- ================================================================== catalog
SELECT has_table('inbox', t, 'table inbox.' || t || ' exists')
  FROM unnest(ARRAY['outbox', 'outbox_destination', 'outbox_redrive', 'outbox_discard', 'outbox_fenced_report',
                    'outbox_waiter']) t;
SELECT enum_has_labels('inbox', 'effect_status', ARRAY['pending', 'leased', 'delivered', 'dead', 'discarded'],
                       'inbox.effect_status is pending, leased, delivered, dead, discarded');
SELECT is((SELECT (rolcanlogin, rolsuper, rolinherit)::text FROM pg_catalog.pg_roles WHERE rolname = 'inbox_dispatcher'),
          '(f,f,t)', 'role inbox_dispatcher exists, NOLOGIN, not a superuser');
SELECT ok(pg_catalog.has_schema_privilege('inbox_dispatcher', 'inbox', 'USAGE'), 'inbox_dispatcher may use schema inbox');
SELECT is((SELECT (t.tgdeferrable, t.tginitdeferred, t.tgfoid::regprocedure::text, c.contype)::text
             FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_constraint c ON c.oid = t.tgconstraint
            WHERE t.tgrelid = 'inbox.outbox'::regclass AND t.tgname = 'outbox_order_at_commit'),
          '(t,t,"inbox._order_at_commit()",t)',
          'outbox_order_at_commit is a constraint trigger, DEFERRABLE INITIALLY DEFERRED');
SELECT is((SELECT count(*)::integer FROM pg_catalog.pg_trigger t
            WHERE t.tgrelid = 'inbox.outbox'::regclass AND t.tgname = 'outbox_signal_at_commit'), 0,
          'no wake-up trigger per inserted effect (0.2.0): enqueue_effect checks for idle dispatchers itself');
SELECT is((SELECT pg_catalog.pg_get_indexdef(i.indexrelid) FROM pg_catalog.pg_index i
            WHERE i.indexrelid = 'inbox.outbox_due_idx'::regclass),
          'CREATE INDEX outbox_due_idx ON inbox.outbox USING btree (available_at) WHERE ((status = ANY (ARRAY[''pending''::inbox.effect_status, ''leased''::inbox.effect_status])) AND (NOT blocked))',
          'the claim index: available_at of pending and leased effects not set aside behind their key');
SELECT is((SELECT pg_catalog.pg_get_indexdef(i.indexrelid) FROM pg_catalog.pg_index i
            WHERE i.indexrelid = 'inbox.outbox_order_idx'::regclass),
          'CREATE INDEX outbox_order_idx ON inbox.outbox USING btree (consumer, tenant, ordering_key, order_seq) WHERE ((ordering_key IS NOT NULL) AND (status = ANY (ARRAY[''pending''::inbox.effect_status, ''leased''::inbox.effect_status, ''dead''::inbox.effect_status])))',
          'the head-of-key index: (consumer, tenant, ordering_key, order_seq) of undelivered effects');
SELECT is((SELECT pg_catalog.pg_get_indexdef(i.indexrelid) FROM pg_catalog.pg_index i
            WHERE i.indexrelid = 'inbox.outbox_closed_idx'::regclass),
          'CREATE INDEX outbox_closed_idx ON inbox.outbox USING btree (COALESCE(delivered_at, discarded_at)) WHERE (status = ANY (ARRAY[''delivered''::inbox.effect_status, ''discarded''::inbox.effect_status]))',
          'the purge index: one partial index for delivered and discarded effects (0.2.0)');
SELECT is((SELECT (d.destination, d.max_attempts, d.base_backoff, d.max_backoff, d.updated_at, d.updated_by)::text
             FROM inbox._default_destination('x') d), '(x,10,00:00:01,01:00:00,,)',
          '_default_destination: 10 attempts, backoff from 1 second up to 1 hour');
SELECT is((SELECT string_agg(a.attname || '=' || pg_get_expr(d.adbin, d.adrelid), ' ' ORDER BY a.attnum)
             FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
            WHERE d.adrelid = 'inbox.outbox_destination'::regclass
              AND a.attname IN ('max_attempts', 'base_backoff', 'max_backoff')),
          'max_attempts=10 base_backoff=''00:00:01''::interval max_backoff=''01:00:00''::interval',
          'the column defaults of inbox.outbox_destination are the ones _default_destination returns');

-- ================================================================== effect_id
SELECT is(inbox.effect_id('billing', 'orders', 'm-1', 'email'),
          'fx_' || encode(sha256(convert_to('pginbox.effect_id.v1', 'UTF8')
                                 || int4send(0)
                                 || int4send(7) || convert_to('billing', 'UTF8')
                                 || int4send(6) || convert_to('orders', 'UTF8')
                                 || int4send(3) || convert_to('m-1', 'UTF8')
                                 || int4send(5) || convert_to('email', 'UTF8')), 'hex'),
          'effect_id: fx_ + hex SHA-256 of the length-prefixed tenant, consumer, producer, message_id, effect name');
SELECT is(inbox.effect_id('c', 'p', 'm', 'email'), 'fx_53b930c4edac6ed5121f83049b4edc6f746b65b23f77acea2d403e2136686f2a',
          'effect_id: pinned value (the derivation never changes: a re-run handler must find its effects)');
SELECT is(inbox.effect_id('c', 'p', 'm', 'email'), inbox.effect_id('c', 'p', 'm', 'email', ''),
          'effect_id: tenant defaults to ''''');
SELECT isnt(inbox.effect_id('c', 'p', 'm', 'email', 't1'), inbox.effect_id('c', 'p', 'm', 'email'),
            'effect_id: the tenant is part of the id');
SELECT isnt(inbox.effect_id('c', 'p', 'm', 'email'), inbox.effect_id('c', 'p', 'm', 'sms'),
            'effect_id: the effect name is part of the id');
SELECT is((SELECT count(DISTINCT id)::integer FROM (VALUES
              (inbox.effect_id('ab', 'c', 'm', 'e')), (inbox.effect_id('a', 'bc', 'm', 'e')),
              (inbox.effect_id('c', 'ab', 'm', 'e')), (inbox.effect_id('c', 'a', 'bm', 'e')),
              (inbox.effect_id('c', 'm', 'a', 'be')), (inbox.effect_id('c', 'm', 'ab', 'e')),
              (inbox.effect_id('c', 'm', 'e', 'x', 'a')), (inbox.effect_id('ac', 'm', 'e', 'x'))) v(id)), 8,
          'effect_id: parts are length-prefixed, so shifting characters between neighbours changes the id');
SELECT is(inbox.effect_id('c', 'p', 'm', 'ü'), inbox.effect_id('c', 'p', 'm', 'ü'), 'effect_id: stable for non-ASCII names');
SELECT is(length(inbox.effect_id(repeat('c', 128), repeat('p', 128), repeat('m', 256), repeat('e', 128), repeat('t', 128))),
          67, 'effect_id: always 67 characters, short enough for any effect_id column (256 bytes)');
SELECT is((SELECT provolatile FROM pg_proc WHERE oid = 'inbox.effect_id(text, text, text, text, text)'::regprocedure),
          'i', 'effect_id is IMMUTABLE');
SELECT throws_ok($$SELECT inbox.effect_id(NULL, 'p', 'm', 'e')$$, '22004', 'inbox.effect_id: consumer must not be NULL',
                 'effect_id: NULL consumer is 22004');
SELECT throws_ok($$SELECT inbox.effect_id('c', '', 'm', 'e')$$, '22023', 'inbox.effect_id: producer must not be empty',
                 'effect_id: empty producer is 22023');
SELECT throws_ok($$SELECT inbox.effect_id('c', 'p', repeat('m', 257), 'e')$$, '22001',
                 'inbox.effect_id: message_id is 257 bytes long, the limit is 256', 'effect_id: a 257-byte message_id is 22001');
SELECT throws_ok($$SELECT inbox.effect_id('c', 'p', 'm', 'e', NULL)$$, '22004', 'inbox.effect_id: tenant must not be NULL',
                 'effect_id: NULL tenant is 22004');
SELECT throws_ok($$SELECT inbox.effect_id('c', 'p', 'm', NULL)$$, '22004', 'inbox.effect_id: effect_name must not be NULL',
                 'effect_id: NULL effect_name is 22004');
SELECT throws_ok($$SELECT inbox.effect_id('c', 'p', 'm', '')$$, '22023', 'inbox.effect_id: effect_name must not be empty',
                 'effect_id: empty effect_name is 22023');
SELECT throws_ok($$SELECT inbox.effect_id('c', 'p', 'm', repeat('é', 65))$$, '22001',
                 'inbox.effect_id: effect_name is 130 bytes long, the limit is 128',
                 'effect_id: the effect_name limit counts bytes (65 two-byte characters)');

-- ================================================================== enqueue_effect
SELECT is(inbox.enqueue_effect('fx-1', 'hook', '{"b": 2, "a": 1}', '{"X-Trace": "t1"}'), true,
          'enqueue_effect: a new effect is enqueued (true)');
SELECT is((SELECT (destination, payload, payload_sha256 IS NULL, headers, ordering_key,
                   order_seq, status, attempts, available_at = now(), created_at = now(),
                   created_xid = pg_current_xact_id(), lease_token, leased_by, lease_expires_at, delivered_at,
                   dead_reason)::text
             FROM inbox.outbox WHERE effect_id = 'fx-1'),
          '(hook,"{""a"": 1, ""b"": 2}",t,"{""X-Trace"": ""t1""}",,,pending,0,t,t,t,,,,,)',
          'enqueue_effect: the row: payload, no hash (0.2.0), headers, pending, 0 attempts, due now, this transaction''s xid');
SELECT public.tap_writes('outbox') AS w0 \gset
SELECT is(inbox.enqueue_effect('fx-1', 'hook', '{"a":1,  "b":2}', '{"X-Trace": "t2"}', 'late-key', now() + interval '1 day'),
          false, 'enqueue_effect: the same id, destination and payload (other spelling) again is a no-op (false)');
SELECT is((SELECT (headers, ordering_key, available_at = now())::text FROM inbox.outbox WHERE effect_id = 'fx-1'),
          '("{""X-Trace"": ""t1""}",,t)', 'enqueue_effect: a repeat''s headers, ordering_key and available_at are ignored');
SELECT is((SELECT count(*)::integer FROM inbox.outbox WHERE effect_id = 'fx-1'), 1, 'enqueue_effect: still one row');
SELECT is(public.tap_writes('outbox') - :w0, 1::bigint,
          'enqueue_effect: a repeat only tried the insert (the BEFORE trigger fires before ON CONFLICT), nothing else');
SELECT throws_ok($$SELECT inbox.enqueue_effect('fx-1', 'hook', '{"a": 1, "b": 3}')$$, '23505',
                 format('inbox.enqueue_effect: effect ''fx-1'' was enqueued for destination ''hook'' with payload hash %s; this call has destination ''hook'' and payload hash %s',
                        encode(inbox.payload_hash('{"a": 1, "b": 2}'), 'hex'), encode(inbox.payload_hash('{"a": 1, "b": 3}'), 'hex')),
                 'enqueue_effect: the same id with another payload is 23505, naming the id and both hashes');
SELECT throws_ok($$SELECT inbox.enqueue_effect('fx-1', 'other-hook', '{"a": 1, "b": 2}')$$, '23505',
                 format('inbox.enqueue_effect: effect ''fx-1'' was enqueued for destination ''hook'' with payload hash %s; this call has destination ''other-hook'' and payload hash %s',
                        encode(inbox.payload_hash('{"a": 1, "b": 2}'), 'hex'), encode(inbox.payload_hash('{"a": 1, "b": 2}'), 'hex')),
                 'enqueue_effect: the same id for another destination is 23505 too');
CREATE TEMP TABLE conflict_diag (constraint_name text, hint text);
DO $$
DECLARE
    c text;
    h text;
BEGIN
    PERFORM inbox.enqueue_effect('fx-1', 'hook', '[]');
EXCEPTION WHEN unique_violation THEN
    GET STACKED DIAGNOSTICS c = CONSTRAINT_NAME, h = PG_EXCEPTION_HINT;
    INSERT INTO conflict_diag VALUES (c, h);
END
$$;
SELECT is((SELECT (constraint_name, hint)::text FROM conflict_diag),
          '(effect_id_conflict,"One effect id per intended effect: derive ids with inbox.effect_id(consumer, producer, message_id, effect_name).")',
          'enqueue_effect: the conflict names CONSTRAINT effect_id_conflict and hints at inbox.effect_id');
SELECT is((SELECT payload FROM inbox.outbox WHERE effect_id = 'fx-1'), '{"a": 1, "b": 2}'::jsonb,
          'enqueue_effect: the conflicts changed nothing');
SELECT is(inbox.enqueue_effect('fx-later', 'hook', '{}', available_at => now() + interval '1 hour'), true,
          'enqueue_effect: an effect can be due later');
SELECT is((SELECT available_at - now() FROM inbox.outbox WHERE effect_id = 'fx-later'), interval '1 hour',
          'enqueue_effect: available_at is stored');
SELECT is(inbox.enqueue_effect(repeat('i', 256), repeat('d', 128), jsonb_build_object('k', repeat('x', 1000000)),
                               (SELECT jsonb_object_agg('H' || g, repeat('v', 100)) FROM generate_series(1, 100) g),
                               repeat('k', 256)),
          true, 'enqueue_effect: ids, destinations, keys, payloads and headers at their limits are accepted');

-- A handler enqueues in the caller's transaction: a rolled-back handler leaves no effect, and a
-- conflicting enqueue is a failure with reason code effect_id_conflict.
CREATE SCHEMA tapob;
CREATE FUNCTION tapob.notify_shipped(payload jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM inbox.enqueue_effect(inbox.effect_id(ctx.consumer, ctx.producer, ctx.message_id, 'email', ctx.tenant),
                                 'mailer', jsonb_build_object('to', payload ->> 'to'));
    IF payload ? 'fail' THEN
        RAISE EXCEPTION 'handler failed after enqueueing';
    END IF;
END
$$;
SELECT inbox.register_handler('tap-ob', 'shipped', 'tapob.notify_shipped(jsonb, inbox.message_context)', 'v1') \g /dev/null
SELECT is((SELECT (outcome, reason_code)::text FROM inbox.claim_and_apply('tap-ob', 'p', 'm-fail', 'shipped',
                                                                         '{"to": "a@x", "fail": true}')),
          '(failed,P0001)', 'handler: a handler that enqueues then fails is failed');
SELECT is((SELECT count(*)::integer FROM inbox.outbox WHERE effect_id = inbox.effect_id('tap-ob', 'p', 'm-fail', 'email')), 0,
          'handler: its effect was rolled back with it');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tap-ob', 'p', 'm-ok', 'shipped', '{"to": "a@x"}')), 'applied',
          'handler: a handler that enqueues is applied');
SELECT is((SELECT (destination, payload)::text FROM inbox.outbox
            WHERE effect_id = inbox.effect_id('tap-ob', 'p', 'm-ok', 'email')), '(mailer,"{""to"": ""a@x""}")',
          'handler: its effect is enqueued under the derived id');
SELECT inbox.enqueue_effect(inbox.effect_id('tap-ob', 'p', 'm-clash', 'email'), 'mailer', '{"to": "someone-else"}') \g /dev/null
SELECT is((SELECT (outcome, reason_code)::text FROM inbox.claim_and_apply('tap-ob', 'p', 'm-clash', 'shipped', '{"to": "a@x"}')),
          '(failed,effect_id_conflict)', 'handler: a conflicting enqueue fails the delivery with reason code effect_id_conflict');

-- Validation: a clear error and nothing written.
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, 'enqueue_effect: ' || c.what)
  FROM (VALUES
        (1, $$SELECT inbox.enqueue_effect(NULL, 'd', '{}')$$, '22004', 'inbox.enqueue_effect: effect_id must not be NULL', 'NULL effect_id is 22004'),
        (2, $$SELECT inbox.enqueue_effect('', 'd', '{}')$$, '22023', 'inbox.enqueue_effect: effect_id must not be empty', 'empty effect_id is 22023'),
        (3, $$SELECT inbox.enqueue_effect(repeat('i', 257), 'd', '{}')$$, '22001',
            'inbox.enqueue_effect: effect_id is 257 bytes long, the limit is 256', 'a 257-byte effect_id is 22001'),
        (4, $$SELECT inbox.enqueue_effect('e', NULL, '{}')$$, '22004', 'inbox.enqueue_effect: destination must not be NULL', 'NULL destination is 22004'),
        (5, $$SELECT inbox.enqueue_effect('e', '', '{}')$$, '22023', 'inbox.enqueue_effect: destination must not be empty', 'empty destination is 22023'),
        (6, $$SELECT inbox.enqueue_effect('e', repeat('d', 129), '{}')$$, '22001',
            'inbox.enqueue_effect: destination is 129 bytes long, the limit is 128', 'a 129-byte destination is 22001'),
        (7, $$SELECT inbox.enqueue_effect('e', 'd', NULL)$$, '22004', 'inbox.enqueue_effect: payload must not be NULL', 'NULL payload is 22004'),
        (8, $$SELECT inbox.enqueue_effect('e', 'd', '{}', NULL)$$, '22004', 'inbox.enqueue_effect: headers must not be NULL', 'NULL headers is 22004'),
        (9, $$SELECT inbox.enqueue_effect('e', 'd', '{}', '["X-A"]')$$, '22023',
            'inbox.enqueue_effect: headers must be a JSON object of strings, got a JSON array', 'headers that are not an object are 22023'),
        (10, $$SELECT inbox.enqueue_effect('e', 'd', '{}', '{"X-A": "a", "X-N": 1}')$$, '22023',
             'inbox.enqueue_effect: header ''X-N'' must be a string', 'a header that is not a string is 22023'),
        (11, $$SELECT inbox.enqueue_effect('e', 'd', '{}', '{"X-A": null}')$$, '22023',
             'inbox.enqueue_effect: header ''X-A'' must be a string', 'a null header value is 22023'),
        (12, $$SELECT inbox.enqueue_effect('e', 'd', '{}', ordering_key => '')$$, '22023',
             'inbox.enqueue_effect: ordering_key must not be empty', 'an empty ordering_key is 22023'),
        (13, $$SELECT inbox.enqueue_effect('e', 'd', '{}', ordering_key => repeat('k', 257))$$, '22001',
             'inbox.enqueue_effect: ordering_key is 257 bytes long, the limit is 256', 'a 257-byte ordering_key is 22001'),
        (14, $$SELECT inbox.enqueue_effect('e', 'd', '{}', available_at => NULL)$$, '22004',
             'inbox.enqueue_effect: available_at must not be NULL', 'NULL available_at is 22004'),
        (15, $$SELECT inbox.enqueue_effect('e', 'd', '{}', available_at => 'infinity')$$, '22023',
             'inbox.enqueue_effect: available_at must be a finite time, got infinity', 'an infinite available_at is 22023')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT throws_ok(format($$SELECT inbox.enqueue_effect('e', 'd', %L::jsonb)$$, jsonb_build_object('k', repeat('x', 1048576))),
                 '54000', format('inbox.enqueue_effect: payload is %s bytes, the limit is 1048576 bytes',
                                 octet_length(jsonb_build_object('k', repeat('x', 1048576))::text)),
                 'enqueue_effect: a payload over 1 MiB is 54000');
SELECT throws_ok(format($$SELECT inbox.enqueue_effect('e', 'd', '{}', %L::jsonb)$$, jsonb_build_object('X-Big', repeat('x', 65536))),
                 '54000', format('inbox.enqueue_effect: headers are %s bytes, the limit is 65536 bytes',
                                 octet_length(jsonb_build_object('X-Big', repeat('x', 65536))::text)),
                 'enqueue_effect: headers over 64 KiB are 54000');
SELECT is(public.tap_writes(), :w0::bigint, 'enqueue_effect: invalid input wrote nothing');

-- Clean slate for the dispatch tests: only the effects created below are due.
DELETE FROM inbox.outbox;

-- ================================================================== commit order
-- order_seq is assigned at commit. Inside this one transaction, keyed effects stay unnumbered
-- (and unclaimable) until SET CONSTRAINTS ... IMMEDIATE fires the deferred trigger.
SELECT inbox.enqueue_effect('a1', 'hook', '{"n": 1}', ordering_key => 'K-a') \g /dev/null
SELECT inbox.enqueue_effect('b1', 'hook', '{"n": 1}', ordering_key => 'K-b') \g /dev/null
SELECT inbox.enqueue_effect('a2', 'hook', '{"n": 2}', ordering_key => 'K-a') \g /dev/null
SELECT inbox.enqueue_effect('b2', 'hook', '{"n": 2}', ordering_key => 'K-b') \g /dev/null
SELECT inbox.enqueue_effect('a3', 'hook', '{"n": 3}', ordering_key => 'K-a') \g /dev/null
SELECT is((SELECT count(*)::integer FROM inbox.outbox WHERE ordering_key IS NOT NULL AND order_seq IS NULL), 5,
          'order: keyed effects have no order_seq before commit');
SELECT is((SELECT count(*)::integer FROM inbox.outbox_order_lock l WHERE l.xmax = pg_current_xact_id()::xid), 0,
          'order: no ordering-key bucket is locked before commit');
SELECT is(pg_temp.claimed('tap-d'), '{}'::text[], 'order: unnumbered (uncommitted) keyed effects are not claimed');
SET CONSTRAINTS inbox.outbox_order_at_commit IMMEDIATE;
SELECT is((SELECT array_agg(effect_id ORDER BY order_seq) FROM inbox.outbox WHERE ordering_key IS NOT NULL),
          ARRAY['a1', 'b1', 'a2', 'b2', 'a3'], 'order: numbered at commit time, in insertion order within a transaction');
SELECT ok((SELECT array_agg(l.bucket ORDER BY l.bucket) FROM inbox.outbox_order_lock l WHERE l.xmax = pg_current_xact_id()::xid)
          @> (SELECT array_agg(DISTINCT inbox._order_bucket(o.consumer, o.tenant, o.ordering_key)) FROM inbox.outbox o
               WHERE o.ordering_key IN ('K-a', 'K-b')),
          'order: numbering holds the row lock of each ordering key''s bucket (inbox.outbox_order_lock) until the end');
SELECT is((SELECT count(*)::integer FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
              AND classid = 1886282358), 0, 'order: no advisory lock (any session could take its key first)');
SELECT is((SELECT count(*)::integer FROM inbox.outbox WHERE ordering_key IS NULL AND order_seq IS NOT NULL), 0,
          'order: keyless effects get no order_seq');

-- ================================================================== claim: head of key, one per key
SELECT inbox.enqueue_effect('n1', 'hook', '{}') \g /dev/null
SELECT inbox.enqueue_effect('n2', 'hook', '{}') \g /dev/null
SELECT inbox.enqueue_effect('n-later', 'hook', '{}', available_at => now() + interval '1 minute') \g /dev/null
CREATE TEMP TABLE claim1 AS SELECT * FROM inbox.claim_effects('tap-d1', 10, '45 seconds', key_aware => true);
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM claim1), ARRAY['a1', 'b1', 'n1', 'n2'],
          'claim: the head of each key and every due keyless effect; nothing due later, no second effect of a key');
SELECT is((SELECT array_agg(DISTINCT (attempts, lease_expires_at = now() + interval '45 seconds')::text) FROM claim1),
          ARRAY['(1,t)'], 'claim: attempts 1, lease_expires_at = now() + lease');
SELECT is((SELECT count(DISTINCT lease_token)::integer FROM claim1), 4, 'claim: every claimed effect has its own fencing token');
SELECT is((SELECT (c.destination, c.payload, c.headers, c.ordering_key, c.created_at = now())::text FROM claim1 c
            WHERE c.effect_id = 'a1'), '(hook,"{""n"": 1}",{},K-a,t)',
          'claim: returns destination, payload, headers, ordering_key and created_at');
SELECT is((SELECT array_agg(DISTINCT (o.status, o.leased_by, o.lease_token = c.lease_token, o.available_at = o.lease_expires_at,
                                      o.last_attempt_at = now())::text)
             FROM inbox.outbox o JOIN claim1 c USING (effect_id)),
          ARRAY['(leased,tap-d1,t,t,t)'], 'claim: the rows are leased to the dispatcher under the returned token');
SELECT is(pg_temp.claimed('tap-d2'), '{}'::text[],
          'claim: nothing else is claimable (leased heads block their keys, leases still valid)');
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.outbox WHERE blocked), ARRAY['a2', 'a3', 'b2'],
          'claim: the effects found behind their key''s head were set aside (blocked), so scans skip them');

SELECT is(inbox.complete_effect('a1', pg_temp.token('a1')), true, 'claim: the head of K-a is delivered');
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.outbox WHERE blocked), ARRAY['a3', 'b2'],
          'claim: delivering a head unblocks the next effect of its key (a2), only that one');
SELECT is(pg_temp.claimed('tap-d2'), ARRAY['a2'], 'claim: then the next effect of K-a is the head');
SELECT is(inbox.fail_effect('b1', pg_temp.token('b1'), 'HTTP 400', retryable => false), 'dead', 'claim: the head of K-b dies');
SELECT is(pg_temp.claimed('tap-d2'), '{}'::text[], 'claim: a dead head holds its key (b2 is not claimed)');
SELECT is(inbox.fail_effect('a2', pg_temp.token('a2'), 'timeout'), 'pending', 'claim: a2 failed, retry later');
SELECT is(pg_temp.claimed('tap-d2'), '{}'::text[], 'claim: a head in backoff holds its key (a3 is not claimed)');
SELECT pg_temp.make_due('a2');
SELECT is(pg_temp.claimed('tap-d2'), ARRAY['a2'], 'claim: once due, the same head is claimed again');
SELECT is((SELECT (attempts, lease_token > 0)::text FROM inbox.outbox WHERE effect_id = 'a2'), '(2,t)',
          'claim: a retry is attempt 2');
SELECT is((SELECT status FROM inbox.redrive_effect('b1', 'fixed the template')), 'pending', 'claim: b1 redriven');
SELECT is(pg_temp.claimed('tap-d3'), ARRAY['b1'], 'claim: a redriven head keeps its place: b1 again, not b2');
SELECT is((SELECT blocked FROM inbox.outbox WHERE effect_id = 'b2'), true, 'claim: b2 stays set aside behind b1');
SELECT is(inbox.complete_effect('b1', pg_temp.token('b1')), true, 'claim: b1 delivered');
SELECT is(pg_temp.claimed('tap-d3'), ARRAY['b2'], 'claim: now b2');

-- A long queue on one key: set aside in rounds, never claimed out of order.
DELETE FROM inbox.outbox;
SELECT inbox.enqueue_effect('q' || lpad(g::text, 2, '0'), 'hook', '{}', ordering_key => 'K-q') FROM generate_series(1, 30) g \g /dev/null
SELECT inbox.enqueue_effect('q-free', 'hook', '{}') \g /dev/null
-- Due a while ago (an enqueue's available_at in the past is stored as now: set by hand).
UPDATE inbox.outbox SET available_at = now() - CASE WHEN effect_id = 'q-free' THEN interval '1 second' ELSE interval '1 minute' END
 WHERE effect_id ~ '^q';
SELECT is(pg_temp.claimed('tap-q', 1), ARRAY['q01'], 'queue: the head of the key first (it is due first)');
SELECT is(pg_temp.claimed('tap-q', 10), ARRAY['q-free'],
          'queue: the next claim wades through the rest of the queue (in rounds) to the keyless effect');
SELECT is((SELECT count(*)::integer FROM inbox.outbox WHERE blocked), 29, 'queue: the 29 effects behind q01 are set aside');
SELECT is(pg_temp.claimed('tap-q', 10), '{}'::text[], 'queue: nothing more to claim');
SELECT is(inbox.complete_effect('q01', pg_temp.token('q01')), true, 'queue: q01 delivered');
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.outbox WHERE NOT blocked AND status = 'pending'),
          ARRAY['q02'], 'queue: only q02 is unblocked');
SELECT is(pg_temp.claimed('tap-q', 10), ARRAY['q02'], 'queue: and claimed');

-- max_effects and due order
DELETE FROM inbox.outbox;
SELECT inbox.enqueue_effect('due-' || g, 'hook', '{}', available_at => now() - g * interval '1 minute') FROM generate_series(1, 5) g \g /dev/null
SELECT is((SELECT array_agg(DISTINCT available_at) FROM inbox.outbox WHERE effect_id ~ '^due-'), ARRAY[now()],
          'enqueue_effect: an available_at in the past is stored as now (it cannot jump the queue)');
UPDATE inbox.outbox SET available_at = now() - substr(effect_id, 5)::integer * interval '1 minute' WHERE effect_id ~ '^due-';
SELECT is((SELECT array_agg(effect_id) FROM inbox.claim_effects('tap-d4', 2, key_aware => true)), ARRAY['due-5', 'due-4'],
          'claim: at most max_effects, the longest due first');
SELECT is((SELECT array_agg(effect_id) FROM inbox.claim_effects('tap-d4', 1000, key_aware => true)), ARRAY['due-3', 'due-2', 'due-1'],
          'claim: the rest on the next call');

-- ================================================================== leases and fencing
DELETE FROM inbox.outbox;
SELECT inbox.enqueue_effect('f1', 'hook', '{}') \g /dev/null
SELECT lease_token AS t1 FROM inbox.claim_effects('tap-old', 1, key_aware => true) \gset
SELECT is(inbox.complete_effect('f1', :t1 + 1000), false, 'fencing: complete with a wrong token is refused (false)');
SELECT is((SELECT (status, lease_token)::text FROM inbox.outbox WHERE effect_id = 'f1'), format('(leased,%s)', :t1),
          'fencing: the refused report changed nothing');
SELECT is((SELECT (effect_id, lease_token, report, reported_by, reported_at IS NOT NULL, current_status, current_token)::text
             FROM inbox.outbox_fenced_report ORDER BY report_id DESC LIMIT 1),
          format('(f1,%s,complete,%s,t,leased,%s)', :t1 + 1000, session_user, :t1),
          'fencing: the refusal is recorded (effect, stale token, report, session user, current status and token)');
-- The lease expires and another dispatcher reclaims the effect under a new token.
SELECT pg_temp.make_due('f1');
SELECT lease_token AS t2 FROM inbox.claim_effects('tap-new', 1, key_aware => true) \gset
SELECT isnt(:t2::bigint, :t1::bigint, 'fencing: an expired lease is reclaimed with a new token');
SELECT is((SELECT (leased_by, attempts)::text FROM inbox.outbox WHERE effect_id = 'f1'), '(tap-new,2)',
          'fencing: the reclaimed effect belongs to the new dispatcher, attempt 2');
SELECT public.tap_writes('outbox_fenced_report') AS f0 \gset
SELECT is(inbox.complete_effect('f1', :t1), false, 'fencing: the old holder cannot complete');
SELECT is(inbox.fail_effect('f1', :t1, 'late failure'), 'fenced', 'fencing: the old holder cannot fail it');
SELECT is(inbox.extend_lease('f1', :t1, '1 minute'), NULL, 'fencing: the old holder cannot extend it');
SELECT is(public.tap_writes('outbox_fenced_report') - :f0, 3::bigint, 'fencing: each refused report is recorded');
SELECT results_eq($$SELECT report, current_status::text, current_token FROM inbox.outbox_fenced_report
                     WHERE effect_id = 'f1' AND lease_token = $$ || :t1 || $$ ORDER BY report_id$$,
                  format($$VALUES ('complete', 'leased', %1$s::bigint), ('fail', 'leased', %1$s), ('extend', 'leased', %1$s)$$, :t2),
                  'fencing: the records name the report and the lease that is current');
SELECT is((SELECT (status, leased_by, last_error)::text FROM inbox.outbox WHERE effect_id = 'f1'), '(leased,tap-new,)',
          'fencing: the late reports changed nothing');
SELECT is(inbox.extend_lease('f1', :t2, '2 minutes'), now() + interval '2 minutes', 'extend_lease: the holder extends (new expiry)');
SELECT is((SELECT (lease_expires_at, available_at)::text FROM inbox.outbox WHERE effect_id = 'f1'),
          (now() + interval '2 minutes', now() + interval '2 minutes')::text,
          'extend_lease: lease_expires_at and available_at move together');
SELECT is(inbox.complete_effect('f1', :t2, 201, repeat('r', 3000), 42), true, 'complete_effect: the holder completes (true)');
SELECT is((SELECT (status, delivered_at = now(), last_status_code, length(last_response_excerpt), last_duration_ms,
                   lease_expires_at, lease_token = :t2)::text FROM inbox.outbox WHERE effect_id = 'f1'),
          '(delivered,t,201,2000,42,,t)',
          'complete_effect: delivered, with status code, response excerpt (cut to 2000 characters) and duration');
SELECT is(inbox.complete_effect('f1', :t2), false, 'fencing: a second report of the same lease is refused');
SELECT is((SELECT (current_status, current_token = :t2)::text FROM inbox.outbox_fenced_report ORDER BY report_id DESC LIMIT 1),
          '(delivered,t)', 'fencing: recorded with current status delivered');
SELECT is(inbox.complete_effect('no-such-effect', 1), false, 'fencing: a report for an unknown (or purged) effect is refused');
SELECT is((SELECT (effect_id, current_status, current_token)::text FROM inbox.outbox_fenced_report ORDER BY report_id DESC LIMIT 1),
          '(no-such-effect,,)', 'fencing: recorded with no current status');
-- An expired lease that nobody reclaimed yet is still current: its holder may complete.
SELECT inbox.enqueue_effect('f2', 'hook', '{}') \g /dev/null
SELECT lease_token AS t3 FROM inbox.claim_effects('tap-slow', 1, key_aware => true) \gset
SELECT pg_temp.make_due('f2');
SELECT is(inbox.complete_effect('f2', :t3), true, 'fencing: an expired lease nobody reclaimed may still complete');
SELECT is(pg_temp.claimed('tap-other'), '{}'::text[], 'fencing: and then there is nothing left to reclaim');

-- ================================================================== results: backoff and dead
DELETE FROM inbox.outbox;
SELECT is((SELECT (destination, max_attempts, base_backoff, max_backoff, updated_by)::text
             FROM inbox.configure_destination('tap-slow', 3, '10 seconds', '25 seconds')),
          format('(tap-slow,3,00:00:10,00:00:25,%s)', session_user), 'configure_destination: returns the saved policy');
SELECT inbox.configure_destination('tap-capped', 10, '10 seconds', '25 seconds') \g /dev/null
SELECT inbox.enqueue_effect('r1', 'tap-slow', '{}') \g /dev/null
SELECT inbox.enqueue_effect('r2', 'tap-capped', '{}') \g /dev/null
SELECT inbox.enqueue_effect('r3', 'unconfigured', '{}') \g /dev/null
SELECT inbox.enqueue_effect('r4', 'tap-capped', '{}') \g /dev/null
SELECT is(pg_temp.claimed('tap-d'), ARRAY['r1', 'r2', 'r3', 'r4'], 'backoff: four effects claimed');
SELECT is(inbox.fail_effect('r1', pg_temp.token('r1'), 'HTTP 503', true, 503, 'busy', 17), 'pending',
          'fail_effect: a retryable failure below max_attempts is pending again');
SELECT is((SELECT (status, attempts, lease_expires_at, last_error, last_status_code, last_response_excerpt, last_duration_ms,
                   dead_reason, available_at - now() BETWEEN interval '5 seconds' AND interval '10 seconds')::text
             FROM inbox.outbox WHERE effect_id = 'r1'),
          '(pending,1,,"HTTP 503",503,busy,17,,t)',
          'fail_effect: records the error and result; after attempt 1 the backoff is 50..100% of base_backoff (10 s)');
SELECT is(inbox.fail_effect('r3', pg_temp.token('r3'), repeat('e', 2500)), 'pending', 'fail_effect: unconfigured destination');
SELECT is((SELECT (length(last_error), available_at - now() BETWEEN interval '0.5 seconds' AND interval '1 second')::text
             FROM inbox.outbox WHERE effect_id = 'r3'), '(2000,t)',
          'fail_effect: the default policy backs off 0.5..1 s after attempt 1; the error is cut to 2000 characters');
SELECT pg_temp.make_due('r1');
SELECT is(pg_temp.claimed('tap-d'), ARRAY['r1'], 'backoff: r1 due again');
SELECT is(inbox.fail_effect('r1', pg_temp.token('r1'), 'HTTP 503'), 'pending', 'fail_effect: attempt 2 failed');
SELECT ok((SELECT available_at - now() BETWEEN interval '10 seconds' AND interval '20 seconds' FROM inbox.outbox
            WHERE effect_id = 'r1'), 'backoff: after attempt 2 it is 50..100% of 2 x base_backoff');
SELECT pg_temp.make_due('r1');
SELECT is(pg_temp.claimed('tap-d'), ARRAY['r1'], 'backoff: r1 due a third time');
SELECT is(inbox.fail_effect('r1', pg_temp.token('r1'), 'HTTP 503'), 'dead', 'fail_effect: attempt 3 of max_attempts 3 is dead');
SELECT is((SELECT (status, attempts, dead_reason, last_error)::text FROM inbox.outbox WHERE effect_id = 'r1'),
          '(dead,3,max_attempts,"HTTP 503")', 'fail_effect: dead with reason max_attempts');
UPDATE inbox.outbox SET attempts = 3 WHERE effect_id = 'r2';
SELECT is(inbox.fail_effect('r2', pg_temp.token('r2'), 'HTTP 503'), 'pending', 'backoff: tap-capped after attempt 3');
SELECT ok((SELECT available_at - now() BETWEEN interval '12.5 seconds' AND interval '25 seconds' FROM inbox.outbox
            WHERE effect_id = 'r2'), 'backoff: 4 x 10 s is capped at max_backoff 25 s (then jittered to 50..100%)');
SELECT is(inbox.fail_effect('r4', pg_temp.token('r4'), 'HTTP 422', retryable => false, status_code => 422), 'dead',
          'fail_effect: a permanent failure is dead at once');
SELECT is((SELECT (status, attempts, dead_reason, last_status_code)::text FROM inbox.outbox WHERE effect_id = 'r4'),
          '(dead,1,permanent_failure,422)', 'fail_effect: dead with reason permanent_failure');
SELECT is(inbox.fail_effect('r4', 1, 'again'), 'fenced', 'fail_effect: a dead effect takes no more reports');
SELECT ok((SELECT min(b) >= interval '5 seconds' AND max(b) <= interval '10 seconds' AND count(DISTINCT b) > 1
             FROM (SELECT inbox._backoff(ROW('x', 10, '10 seconds', '25 seconds', NULL, NULL)::inbox.outbox_destination, 1) b
                     FROM generate_series(1, 50)) s),
          'backoff: jittered (50 draws differ) and within 50..100% of the delay');
SELECT is(inbox._backoff(inbox._default_destination('x'), 1000) <= interval '1 hour', true,
          'backoff: a huge attempt count stays capped (no overflow)');
-- A dispatcher that dies on an effect every time: the expired lease at max_attempts is not
-- reclaimed but turned dead.
SELECT inbox.enqueue_effect('crash', 'tap-slow', '{}') \g /dev/null
SELECT is(pg_temp.claimed('tap-d'), ARRAY['crash'], 'lease expiry: claimed');
UPDATE inbox.outbox SET attempts = 3 WHERE effect_id = 'crash';
SELECT pg_temp.make_due('crash');
SELECT is(pg_temp.claimed('tap-d2'), '{}'::text[], 'lease expiry: an expired lease at max_attempts is not reclaimed');
SELECT is((SELECT (status, attempts, dead_reason, last_error)::text FROM inbox.outbox WHERE effect_id = 'crash'),
          '(dead,3,lease_expired,"the lease of attempt 3 (dispatcher tap-d) expired without a report")',
          'lease expiry: it is dead with reason lease_expired');

-- Validation of the reports: a clear error and nothing written.
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, c.what)
  FROM (VALUES
        (1, $$SELECT inbox.complete_effect(NULL, 1)$$, '22004', 'inbox.complete_effect: effect_id must not be NULL',
            'complete_effect: NULL effect_id is 22004'),
        (2, $$SELECT inbox.complete_effect('', 1)$$, '22023', 'inbox.complete_effect: effect_id must not be empty',
            'complete_effect: empty effect_id is 22023'),
        (3, $$SELECT inbox.complete_effect(repeat('i', 257), 1)$$, '22001',
            'inbox.complete_effect: effect_id is 257 bytes long, the limit is 256', 'complete_effect: a 257-byte effect_id is 22001'),
        (4, $$SELECT inbox.complete_effect('r2', NULL)$$, '22004', 'inbox.complete_effect: lease_token must not be NULL',
            'complete_effect: NULL lease_token is 22004'),
        (5, $$SELECT inbox.complete_effect('r2', 1, 99)$$, '22023',
            'inbox.complete_effect: status_code must be NULL or an HTTP status between 100 and 599, got 99',
            'complete_effect: status_code 99 is 22023'),
        (6, $$SELECT inbox.complete_effect('r2', 1, 600)$$, '22023',
            'inbox.complete_effect: status_code must be NULL or an HTTP status between 100 and 599, got 600',
            'complete_effect: status_code 600 is 22023'),
        (7, $$SELECT inbox.complete_effect('r2', 1, duration_ms => -1)$$, '22023',
            'inbox.complete_effect: duration_ms must not be negative, got -1', 'complete_effect: a negative duration is 22023'),
        (8, $$SELECT inbox.fail_effect(NULL, 1, 'e')$$, '22004', 'inbox.fail_effect: effect_id must not be NULL',
            'fail_effect: NULL effect_id is 22004'),
        (9, $$SELECT inbox.fail_effect('r2', NULL, 'e')$$, '22004', 'inbox.fail_effect: lease_token must not be NULL',
            'fail_effect: NULL lease_token is 22004'),
        (10, $$SELECT inbox.fail_effect('r2', 1, NULL)$$, '22004', 'inbox.fail_effect: error must say what went wrong',
             'fail_effect: NULL error is 22004'),
        (11, $$SELECT inbox.fail_effect('r2', 1, '  ')$$, '22023', 'inbox.fail_effect: error must say what went wrong',
             'fail_effect: a blank error is 22023'),
        (12, $$SELECT inbox.fail_effect('r2', 1, 'e', NULL)$$, '22004', 'inbox.fail_effect: retryable must not be NULL',
             'fail_effect: NULL retryable is 22004'),
        (13, $$SELECT inbox.fail_effect('r2', 1, 'e', true, 1000)$$, '22023',
             'inbox.fail_effect: status_code must be NULL or an HTTP status between 100 and 599, got 1000',
             'fail_effect: status_code 1000 is 22023'),
        (14, $$SELECT inbox.fail_effect('r2', 1, 'e', duration_ms => -5)$$, '22023',
             'inbox.fail_effect: duration_ms must not be negative, got -5', 'fail_effect: a negative duration is 22023'),
        (15, $$SELECT inbox.extend_lease(NULL, 1, '1 minute')$$, '22004', 'inbox.extend_lease: effect_id must not be NULL',
             'extend_lease: NULL effect_id is 22004'),
        (16, $$SELECT inbox.extend_lease('r2', NULL, '1 minute')$$, '22004', 'inbox.extend_lease: lease_token must not be NULL',
             'extend_lease: NULL lease_token is 22004'),
        (17, $$SELECT inbox.extend_lease('r2', 1, NULL)$$, '22004', 'inbox.extend_lease: lease must not be NULL',
             'extend_lease: NULL lease is 22004'),
        (18, $$SELECT inbox.extend_lease('r2', 1, '0 seconds')$$, '22023',
             'inbox.extend_lease: lease must be longer than 0 and at most 1 day, got 00:00:00', 'extend_lease: a zero lease is 22023'),
        (19, $$SELECT inbox.extend_lease('r2', 1, '25 hours')$$, '22023',
             'inbox.extend_lease: lease must be longer than 0 and at most 1 day, got 25:00:00', 'extend_lease: a 25-hour lease is 22023'),
        (20, $$SELECT * FROM inbox.claim_effects(NULL, key_aware => true)$$, '22004', 'inbox.claim_effects: dispatcher must not be NULL',
             'claim_effects: NULL dispatcher is 22004'),
        (21, $$SELECT * FROM inbox.claim_effects('', key_aware => true)$$, '22023', 'inbox.claim_effects: dispatcher must not be empty',
             'claim_effects: empty dispatcher is 22023'),
        (22, $$SELECT * FROM inbox.claim_effects(repeat('d', 129), key_aware => true)$$, '22001',
             'inbox.claim_effects: dispatcher is 129 bytes long, the limit is 128', 'claim_effects: a 129-byte dispatcher is 22001'),
        (23, $$SELECT * FROM inbox.claim_effects('d', NULL, key_aware => true)$$, '22004', 'inbox.claim_effects: max_effects must not be NULL',
             'claim_effects: NULL max_effects is 22004'),
        (24, $$SELECT * FROM inbox.claim_effects('d', 0, key_aware => true)$$, '22023', 'inbox.claim_effects: max_effects must be between 1 and 1000, got 0',
             'claim_effects: max_effects 0 is 22023'),
        (25, $$SELECT * FROM inbox.claim_effects('d', 1001, key_aware => true)$$, '22023',
             'inbox.claim_effects: max_effects must be between 1 and 1000, got 1001', 'claim_effects: max_effects 1001 is 22023'),
        (26, $$SELECT * FROM inbox.claim_effects('d', 1, NULL, key_aware => true)$$, '22004', 'inbox.claim_effects: lease must not be NULL',
             'claim_effects: NULL lease is 22004'),
        (27, $$SELECT * FROM inbox.claim_effects('d', 1, '-1 second', key_aware => true)$$, '22023',
             'inbox.claim_effects: lease must be longer than 0 and at most 1 day, got -00:00:01', 'claim_effects: a negative lease is 22023')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT is(public.tap_writes(), :w0::bigint, 'reports and claims with invalid input wrote nothing (not even a fenced record)');

-- ================================================================== configure_destination
SELECT is((SELECT (max_attempts, base_backoff, max_backoff)::text FROM inbox.configure_destination('tap-default')),
          '(10,00:00:01,01:00:00)', 'configure_destination: defaults 10 attempts, 1 s, 1 h');
SELECT is((SELECT (max_attempts, base_backoff, max_backoff)::text FROM inbox.configure_destination('tap-default', 4, '2 s', '1 min')),
          '(4,00:00:02,00:01:00)', 'configure_destination: a second call updates the policy');
SELECT is((SELECT (max_attempts, base_backoff, max_backoff)::text FROM inbox.configure_destination('tap-default', 6)),
          '(6,00:00:02,00:01:00)', 'configure_destination: omitted settings keep their current values');
SELECT is((SELECT (max_attempts, base_backoff, max_backoff)::text
             FROM inbox.configure_destination('tap-default', NULL, NULL, NULL)),
          '(6,00:00:02,00:01:00)', 'configure_destination: NULL settings keep their current values');
SELECT is((SELECT count(*)::integer FROM inbox.outbox_destination WHERE destination = 'tap-default'), 1,
          'configure_destination: one row per destination');
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, 'configure_destination: ' || c.what)
  FROM (VALUES
        (1, $$SELECT inbox.configure_destination(NULL)$$, '22004', 'inbox.configure_destination: destination must not be NULL', 'NULL destination is 22004'),
        (2, $$SELECT inbox.configure_destination('')$$, '22023', 'inbox.configure_destination: destination must not be empty', 'empty destination is 22023'),
        (3, $$SELECT inbox.configure_destination(repeat('d', 129))$$, '22001',
            'inbox.configure_destination: destination is 129 bytes long, the limit is 128', 'a 129-byte destination is 22001'),
        (6, $$SELECT inbox.configure_destination('d', 0)$$, '22023', 'inbox.configure_destination: max_attempts must be between 1 and 1000, got 0', 'max_attempts 0 is 22023'),
        (7, $$SELECT inbox.configure_destination('d', 1001)$$, '22023', 'inbox.configure_destination: max_attempts must be between 1 and 1000, got 1001', 'max_attempts 1001 is 22023'),
        (8, $$SELECT inbox.configure_destination('d', base_backoff => '0 s')$$, '22023', 'inbox.configure_destination: base_backoff must be positive, got 00:00:00', 'base_backoff 0 is 22023'),
        (9, $$SELECT inbox.configure_destination('d', base_backoff => '2 min', max_backoff => '1 min')$$, '22023',
            'inbox.configure_destination: max_backoff must be between base_backoff (00:02:00) and 30 days, got 00:01:00', 'max_backoff below base_backoff is 22023'),
        (10, $$SELECT inbox.configure_destination('d', max_backoff => '31 days')$$, '22023',
             'inbox.configure_destination: max_backoff must be between base_backoff (00:00:01) and 30 days, got 31 days', 'max_backoff over 30 days is 22023')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT is(public.tap_writes(), :w0::bigint, 'configure_destination: invalid input wrote nothing');

-- ================================================================== redrive_effect
SELECT is((SELECT (r.effect_id, r.status, r.attempts, r.available_at = now(), r.dead_reason, r.last_error)::text
             FROM inbox.redrive_effect('r1', 'upstream fixed') r),
          '(r1,pending,0,t,,"HTTP 503")', 'redrive: dead -> pending, attempts reset, due now; last_error kept for the record');
SELECT results_eq($$SELECT effect_id, redriven_by, redriven_at IS NOT NULL, note, attempts, dead_reason, last_error
                      FROM inbox.outbox_redrive WHERE effect_id = 'r1'$$,
                  $$VALUES ('r1'::text, session_user::text COLLATE "default", true, 'upstream fixed'::text, 3, 'max_attempts'::text, 'HTTP 503'::text)$$,
                  'redrive: one audit row: who (session user), note, and the failure it overrode');
SELECT is(pg_temp.claimed('tap-d', 1), ARRAY['r1'], 'redrive: the effect is claimed again');
SELECT is((SELECT attempts FROM inbox.outbox WHERE effect_id = 'r1'), 1, 'redrive: counting attempts from 1 again');
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, 'redrive: ' || c.what)
  FROM (VALUES
        (1, $$SELECT inbox.redrive_effect(NULL, 'n')$$, '22004', 'inbox.redrive_effect: effect_id must not be NULL', 'NULL effect_id is 22004'),
        (2, $$SELECT inbox.redrive_effect('r4', NULL)$$, '22004', 'inbox.redrive_effect: a redrive needs a note saying why', 'NULL note is 22004'),
        (3, $$SELECT inbox.redrive_effect('r4', ' ')$$, '22023', 'inbox.redrive_effect: a redrive needs a note saying why', 'a blank note is 22023'),
        (4, $$SELECT inbox.redrive_effect('nope', 'n')$$, 'P0002', 'inbox.redrive_effect: no effect ''nope''', 'an unknown effect is P0002'),
        (5, $$SELECT inbox.redrive_effect('r1', 'n')$$, '55000', 'inbox.redrive_effect: effect ''r1'' is leased, not dead', 'a leased effect is 55000'),
        (6, $$SELECT inbox.redrive_effect('r2', 'n')$$, '55000', 'inbox.redrive_effect: effect ''r2'' is pending, not dead', 'a pending effect is 55000')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT is(public.tap_writes(), :w0::bigint, 'redrive: refused redrives wrote nothing');

-- ================================================================== discard_effect
-- A dead head blocks its key until it is redriven or discarded; a discard closes it without
-- delivery, audited, and the key moves on.
DELETE FROM inbox.outbox WHERE status <> 'leased';   -- leased: r1, under a lease that does not expire here
SELECT inbox.enqueue_effect('x' || g, 'tap-x', jsonb_build_object('n', g), ordering_key => 'K-x') FROM generate_series(1, 3) g \g /dev/null
SET CONSTRAINTS inbox.outbox_order_at_commit IMMEDIATE;
SET CONSTRAINTS inbox.outbox_order_at_commit DEFERRED;
SELECT is(pg_temp.claimed('tap-dx'), ARRAY['x1'], 'discard: x1 is the head of K-x');
SELECT is(inbox.fail_effect('x1', pg_temp.token('x1'), 'HTTP 410', retryable => false, status_code => 410), 'dead',
          'discard: the head x1 dies');
SELECT is(pg_temp.claimed('tap-dx'), '{}'::text[], 'discard: a dead head blocks its key (x2 is not claimed)');
SELECT is((SELECT blocked FROM inbox.outbox WHERE effect_id = 'x2'), true, 'discard: x2 was set aside behind the dead head');
SELECT inbox.dispatcher_idle('tap-dx', true) \g /dev/null
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, 'discard: ' || c.what)
  FROM (VALUES
        (1, $$SELECT inbox.discard_effect(NULL, 'n')$$, '22004', 'inbox.discard_effect: effect_id must not be NULL', 'NULL effect_id is 22004'),
        (2, $$SELECT inbox.discard_effect('', 'n')$$, '22023', 'inbox.discard_effect: effect_id must not be empty', 'an empty effect_id is 22023'),
        (3, $$SELECT inbox.discard_effect(repeat('x', 257), 'n')$$, '22001', 'inbox.discard_effect: effect_id is 257 bytes long, the limit is 256', 'an over-long effect_id is 22001'),
        (4, $$SELECT inbox.discard_effect('x1', NULL)$$, '22004', 'inbox.discard_effect: a discard needs a note saying why', 'NULL note is 22004'),
        (5, $$SELECT inbox.discard_effect('x1', E' \t')$$, '22023', 'inbox.discard_effect: a discard needs a note saying why', 'a blank note is 22023'),
        (6, $$SELECT inbox.discard_effect('nope', 'n')$$, 'P0002', 'inbox.discard_effect: no effect ''nope''', 'an unknown effect is P0002'),
        (7, $$SELECT inbox.discard_effect('x2', 'n')$$, '55000', 'inbox.discard_effect: effect ''x2'' is pending, not dead', 'a pending effect is 55000'),
        (8, $$SELECT inbox.discard_effect('r1', 'n')$$, '55000', 'inbox.discard_effect: effect ''r1'' is leased, not dead', 'a leased effect is 55000')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT is(public.tap_writes(), :w0::bigint, 'discard: refused discards wrote nothing');
SELECT is((SELECT (d.effect_id, d.status, d.attempts, d.dead_reason, d.last_error, d.discarded_at = now(), d.blocked)::text
             FROM inbox.discard_effect('x1', 'customer deleted, OPS-9') d),
          '(x1,discarded,1,permanent_failure,"HTTP 410",t,f)',
          'discard: dead -> discarded, now; attempts, dead_reason and last_error kept for the record');
SELECT results_eq($$SELECT effect_id, discarded_by, discarded_at IS NOT NULL, note, attempts, dead_reason, last_error
                      FROM inbox.outbox_discard$$,
                  $$VALUES ('x1'::text, session_user::text COLLATE "default", true, 'customer deleted, OPS-9'::text, 1,
                            'permanent_failure'::text, 'HTTP 410'::text)$$,
                  'discard: one audit row: who (session user), note, and the failure it closed');
SELECT is((SELECT blocked FROM inbox.outbox WHERE effect_id = 'x2'), false, 'discard: the next effect of the key is unblocked');
SELECT is((SELECT count(*)::integer FROM inbox.outbox_waiter), 0, 'discard: idle dispatchers are woken (registrations deleted)');
SELECT is(pg_temp.claimed('tap-dx'), ARRAY['x2'], 'discard: x2 is now the head of K-x and is claimed');
SELECT throws_ok($$SELECT inbox.discard_effect('x1', 'again')$$, '55000', 'inbox.discard_effect: effect ''x1'' is discarded, not dead',
                 'discard: a discarded effect cannot be discarded again');
SELECT throws_ok($$SELECT inbox.redrive_effect('x1', 'undo')$$, '55000', 'inbox.redrive_effect: effect ''x1'' is discarded, not dead',
                 'discard: a discarded effect cannot be redriven');
SELECT is(inbox.complete_effect('x1', pg_temp.token('x1')), false, 'discard: a late report of its last lease is fenced');
SELECT is(inbox.enqueue_effect('x1', 'tap-x', '{"n": 1}'), false,
          'discard: a re-run handler enqueuing the same effect is a no-op (it is not sent again)');
SELECT is(inbox.complete_effect('x2', pg_temp.token('x2')), true, 'discard: x2 delivered');
SELECT is(pg_temp.claimed('tap-dx'), ARRAY['x3'], 'discard: then x3, in order');
SELECT is(inbox.complete_effect('x3', pg_temp.token('x3')), true, 'discard: x3 delivered');

-- ================================================================== purge_delivered_effects
DELETE FROM inbox.outbox;
SELECT inbox.enqueue_effect('p' || g, 'hook', '{}') FROM generate_series(1, 6) g \g /dev/null
SELECT inbox.enqueue_effect('p-pending', 'hook', '{}', available_at => now() + interval '1 day') \g /dev/null
SELECT count(*) FROM inbox.claim_effects('tap-d', 100, key_aware => true) \g /dev/null
SELECT count(inbox.complete_effect(effect_id, lease_token)) FROM inbox.outbox WHERE status = 'leased' \g /dev/null
-- p1..p5 were delivered 5..1 hours ago; p6 just now.
UPDATE inbox.outbox SET delivered_at = now() - (6 - substr(effect_id, 2)::integer) * interval '1 hour'
 WHERE effect_id IN ('p1', 'p2', 'p3', 'p4', 'p5');
SELECT is(inbox.purge_delivered_effects('90 minutes', 2), 2, 'purge: one batch of at most batch_size');
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.outbox), ARRAY['p-pending', 'p3', 'p4', 'p5', 'p6'],
          'purge: the oldest delivered first');
SELECT is(inbox.purge_delivered_effects('90 minutes', 2), 2, 'purge: the next batch');
SELECT is(inbox.purge_delivered_effects('90 minutes', 2), 0, 'purge: then nothing is older than the interval (loop ends)');
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.outbox), ARRAY['p-pending', 'p5', 'p6'],
          'purge: effects delivered within the interval and undelivered effects stay');
SELECT is(inbox.purge_delivered_effects('0 seconds'), 1, 'purge: older_than 0 purges what was delivered before now');
SELECT is(inbox.enqueue_effect('p1', 'hook', '{"other": true}'), true,
          'purge: a purged effect id is forgotten (an enqueue of it is new): keep delivered effects long enough');
-- Discarded effects and refused-report records go too, within the same batch bound; audit trails stay.
DELETE FROM inbox.outbox;
SELECT inbox.enqueue_effect('q' || g, 'hook', '{}') FROM generate_series(1, 3) g \g /dev/null
SELECT count(*) FROM inbox.claim_effects('tap-d', 100, key_aware => true) \g /dev/null
SELECT count(inbox.fail_effect(effect_id, lease_token, 'gone', retryable => false)) FROM inbox.outbox WHERE status = 'leased' \g /dev/null
SELECT count(inbox.discard_effect(effect_id, 'test data')) FROM inbox.outbox WHERE effect_id IN ('q1', 'q2') \g /dev/null
UPDATE inbox.outbox SET discarded_at = now() - interval '2 hours' WHERE effect_id = 'q1';
DELETE FROM inbox.outbox_fenced_report;
SELECT inbox.complete_effect('q' || g, 1) FROM generate_series(1, 4) g \g /dev/null
UPDATE inbox.outbox_fenced_report SET reported_at = now() - interval '3 hours' WHERE effect_id IN ('q1', 'q2', 'q3');
SELECT public.tap_writes('outbox_redrive') + public.tap_writes('outbox_discard') AS a0 \gset
SELECT is(inbox.purge_delivered_effects('90 minutes', 2), 2, 'purge: a batch of discarded effects and fenced reports is bounded too');
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.outbox), ARRAY['q2', 'q3'],
          'purge: the first batch took the old discarded effect (q1) and one old fenced report');
SELECT is(inbox.purge_delivered_effects('90 minutes', 2), 2, 'purge: the next batch: the remaining old fenced reports');
SELECT is(inbox.purge_delivered_effects('90 minutes', 2), 0, 'purge: then nothing is older (loop ends)');
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.outbox_fenced_report), ARRAY['q4'],
          'purge: fenced reports within the interval stay');
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.outbox), ARRAY['q2', 'q3'],
          'purge: the old discarded effect is gone; a recent discarded one and the dead one stay');
SELECT is((SELECT count(*)::integer FROM inbox.outbox_discard WHERE effect_id IN ('q1', 'q2')), 2,
          'purge: the discard audit trail is kept (also for the purged effect)');
SELECT is(public.tap_writes('outbox_redrive') + public.tap_writes('outbox_discard'), :a0::bigint,
          'purge: never touches the audit trails');
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, 'purge: ' || c.what)
  FROM (VALUES
        (1, $$SELECT inbox.purge_delivered_effects(NULL)$$, '22004', 'inbox.purge_delivered_effects: older_than must not be NULL', 'NULL older_than is 22004'),
        (2, $$SELECT inbox.purge_delivered_effects('1 day', NULL)$$, '22004', 'inbox.purge_delivered_effects: batch_size must not be NULL', 'NULL batch_size is 22004'),
        (3, $$SELECT inbox.purge_delivered_effects('-1 day')$$, '22023', 'inbox.purge_delivered_effects: older_than must not be negative, got -1 days', 'a negative older_than is 22023'),
        (4, $$SELECT inbox.purge_delivered_effects('1 day', 0)$$, '22023', 'inbox.purge_delivered_effects: batch_size must be between 1 and 100000, got 0', 'batch_size 0 is 22023'),
        (5, $$SELECT inbox.purge_delivered_effects('1 day', 100001)$$, '22023', 'inbox.purge_delivered_effects: batch_size must be between 1 and 100000, got 100001', 'batch_size 100001 is 22023')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT is(public.tap_writes(), :w0::bigint, 'purge: invalid input wrote nothing');

-- ================================================================== wake-up signal (waiter table)
-- An enqueue looks at the waiter table itself (0.2.0; a deferred trigger per effect in 0.1.0): it
-- deletes the idle dispatchers' registrations and calls pg_notify('inbox_outbox', ''), both taking
-- effect with its transaction's commit (tests/python/integration/test_outbox_signal.py: the NOTIFY, the race
-- of a dispatcher registering after the enqueue and before its commit).
DELETE FROM inbox.outbox;
SELECT lives_ok($$SELECT inbox.dispatcher_idle('tap-w1', true)$$, 'dispatcher_idle: registers an idle dispatcher');
SELECT is((SELECT (dispatcher, since = now())::text FROM inbox.outbox_waiter), '(tap-w1,t)', 'dispatcher_idle: one waiter row, since now');
SELECT public.tap_writes('outbox_waiter') AS w0 \gset
SELECT inbox.dispatcher_idle('tap-w1', true) \g /dev/null
SELECT is(public.tap_writes('outbox_waiter') - :w0, 0::bigint, 'dispatcher_idle: registering again writes nothing');
SELECT inbox.dispatcher_idle('tap-w1', false) \g /dev/null
SELECT is((SELECT count(*)::integer FROM inbox.outbox_waiter), 0, 'dispatcher_idle: false unregisters');
SELECT lives_ok($$SELECT inbox.dispatcher_idle('tap-w1', false)$$, 'dispatcher_idle: unregistering twice is fine');

SELECT public.tap_writes('outbox_waiter') AS w0 \gset
SELECT inbox.enqueue_effect('s1', 'hook', '{}', available_at => now() - interval '3 minutes') \g /dev/null
SELECT is(public.tap_writes('outbox_waiter') - :w0, 0::bigint,
          'signal: with no dispatcher idle, an enqueue touches no waiter row (no NOTIFY)');
SELECT inbox.dispatcher_idle('tap-w1', true) \g /dev/null
SELECT inbox.dispatcher_idle('tap-w2', true) \g /dev/null
SELECT public.tap_writes('outbox_waiter') AS w0 \gset
SELECT inbox.enqueue_effect('s2', 'hook', '{}', available_at => now() - interval '2 minutes') \g /dev/null
SELECT is((SELECT count(*)::integer FROM inbox.outbox_waiter), 0,
          'signal: the enqueue wakes every dispatcher idle then (their rows go with its commit)');
SELECT is(public.tap_writes('outbox_waiter') - :w0, 2::bigint, 'signal: two registrations deleted, by one statement');
SELECT public.tap_writes('outbox_waiter') AS w0 \gset
SELECT inbox.enqueue_effect('s3', 'hook', '{}', available_at => now() - interval '1 minute') \g /dev/null
SELECT is(public.tap_writes('outbox_waiter') - :w0, 0::bigint,
          'signal: the next enqueue finds nobody idle: one notifying enqueue per idle period');
SELECT inbox.dispatcher_idle('tap-w6', true) \g /dev/null
SELECT inbox.enqueue_effect('s1', 'hook', '{}', available_at => now() - interval '3 minutes') \g /dev/null
SELECT inbox.enqueue_effect('s-later', 'hook', '{}', available_at => now() + interval '1 hour') \g /dev/null
SELECT is((SELECT array_agg(dispatcher) FROM inbox.outbox_waiter), ARRAY['tap-w6'],
          'signal: a no-op enqueue and an effect due later wake nobody (the dispatcher''s poll finds the latter)');
SELECT inbox.dispatcher_idle('tap-w6', false) \g /dev/null
UPDATE inbox.outbox SET available_at = now() - (4 - substr(effect_id, 2)::integer) * interval '1 minute'
 WHERE effect_id IN ('s1', 's2', 's3');  -- due a while ago, s1 first (set by hand: an enqueue stores the past as now)
SELECT inbox.dispatcher_idle('tap-w3', true) \g /dev/null
SELECT inbox.dispatcher_idle('tap-w4', true) \g /dev/null
SELECT is((SELECT array_agg(effect_id ORDER BY effect_id) FROM inbox.claim_effects('tap-w4', 1, key_aware => true)), ARRAY['s1'],
          'signal: a waiter that claims something ...');
SELECT is((SELECT array_agg(dispatcher ORDER BY dispatcher) FROM inbox.outbox_waiter), ARRAY['tap-w3'],
          'signal: ... is no longer idle (claim_effects unregistered it), the others stay');
SELECT is(pg_temp.claimed('tap-w3', 1), ARRAY['s2'], 'signal: tap-w3 claims too');
SELECT is(inbox.fail_effect('s2', pg_temp.token('s2'), 'boom', retryable => false), 'dead', 'signal: s2 is dead');
SELECT is(pg_temp.claimed('tap-w5', 1), ARRAY['s3'], 'signal: tap-w5 claims s3');
SELECT inbox.dispatcher_idle('tap-w5', true) \g /dev/null
SELECT is(pg_temp.claimed('tap-w5', 1), '{}'::text[], 'signal: a claim that finds nothing ...');
SELECT ok(EXISTS (SELECT FROM inbox.outbox_waiter WHERE dispatcher = 'tap-w5'), 'signal: ... leaves the registration alone');
SELECT inbox.redrive_effect('s2', 'retry') \g /dev/null
SELECT is((SELECT count(*)::integer FROM inbox.outbox_waiter), 0, 'signal: a redrive wakes the idle dispatchers too');
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, 'dispatcher_idle: ' || c.what)
  FROM (VALUES
        (1, $$SELECT inbox.dispatcher_idle(NULL, true)$$, '22004', 'inbox.dispatcher_idle: dispatcher must not be NULL', 'NULL dispatcher is 22004'),
        (2, $$SELECT inbox.dispatcher_idle('', true)$$, '22023', 'inbox.dispatcher_idle: dispatcher must not be empty', 'empty dispatcher is 22023'),
        (3, $$SELECT inbox.dispatcher_idle(repeat('d', 129), true)$$, '22001',
            'inbox.dispatcher_idle: dispatcher is 129 bytes long, the limit is 128', 'a 129-byte dispatcher is 22001'),
        (4, $$SELECT inbox.dispatcher_idle('d', NULL)$$, '22004', 'inbox.dispatcher_idle: idle must not be NULL', 'NULL idle is 22004')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT is(public.tap_writes(), :w0::bigint, 'dispatcher_idle: invalid input wrote nothing');

-- ================================================================== privileges, tried as an attacker
DELETE FROM inbox.outbox;
CREATE ROLE tap_ob_consumer NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_ob_dispatcher NOLOGIN IN ROLE inbox_dispatcher;
CREATE ROLE tap_ob_operator NOLOGIN IN ROLE inbox_operator;
CREATE ROLE tap_ob_reader NOLOGIN IN ROLE inbox_reader;
CREATE ROLE tap_ob_stranger NOLOGIN;
-- The consumer role acts as 'tap-ob' (0.3.0: the effective role is the caller, SET ROLE included).
SELECT inbox.bind_consumer('tap-ob', 'tap_ob_consumer', note => 'tap') \g /dev/null
SELECT inbox.bind_destination('hook', 'tap-ob', 'tap') \g /dev/null
GRANT USAGE ON SCHEMA inbox TO tap_ob_stranger;   -- may see the schema, has no other grant
CREATE TEMP TABLE ob_res (step text PRIMARY KEY, val text);
GRANT ALL ON ob_res TO PUBLIC;

SET ROLE tap_ob_stranger;
SELECT throws_ok(c.sql, '42501', 'permission denied for function ' || c.fn, 'a role without grants cannot call inbox.' || c.fn)
  FROM (VALUES
        (1, 'enqueue_effect', $$SELECT inbox.enqueue_effect('e', 'd', '{}')$$),
        (2, 'effect_id', $$SELECT inbox.effect_id('c', 'p', 'm', 'e')$$),
        (3, 'claim_effects', $$SELECT * FROM inbox.claim_effects('d', key_aware => true)$$),
        (4, 'complete_effect', $$SELECT inbox.complete_effect('e', 1)$$),
        (5, 'fail_effect', $$SELECT inbox.fail_effect('e', 1, 'x')$$),
        (6, 'extend_lease', $$SELECT inbox.extend_lease('e', 1, '1 minute')$$),
        (7, 'dispatcher_idle', $$SELECT inbox.dispatcher_idle('d', true)$$),
        (8, 'configure_destination', $$SELECT inbox.configure_destination('d')$$),
        (9, 'redrive_effect', $$SELECT inbox.redrive_effect('e', 'n')$$),
        (10, 'purge_delivered_effects', $$SELECT inbox.purge_delivered_effects('1 day')$$),
        (11, '_wake_dispatchers', $$SELECT inbox._wake_dispatchers()$$),
        (12, '_report_outcomes', $$SELECT * FROM inbox._report_outcomes('complete', '{e}', '{1}', '{}', '{}')$$),
        (13, 'discard_effect', $$SELECT inbox.discard_effect('e', 'n')$$),
        (14, '_unblock_successors', $$SELECT inbox._unblock_successors('{c}', '{t}', '{k}', '{1}')$$),
        (15, 'complete_effects', $$SELECT * FROM inbox.complete_effects('{e}', '{1}')$$),
        (16, 'fail_effects', $$SELECT * FROM inbox.fail_effects('{e}', '{1}', '{x}', '{t}')$$),
        (17, '_complete_reports', $$SELECT * FROM inbox._complete_reports('{e}', '{1}', NULL, NULL, NULL)$$),
        (18, '_fail_reports', $$SELECT * FROM inbox._fail_reports('{e}', '{1}', '{x}', '{t}', NULL, NULL, NULL)$$)
       ) AS c(ord, fn, sql)
 ORDER BY c.ord;
SELECT throws_ok($$SELECT * FROM inbox.outbox$$, '42501', 'permission denied for table outbox',
                 'a role without grants cannot read inbox.outbox');
RESET ROLE;

-- The consumer enqueues (a keyed effect too: the commit-time trigger runs as the owner).
SET ROLE tap_ob_consumer;
INSERT INTO ob_res VALUES ('consumer-enqueue', inbox.enqueue_effect(inbox.effect_id('tap-ob', 'p', 'c1', 'email'), 'hook',
                                                                    '{"secret": "s"}', '{"X-Api-Key": "t"}', 'K-c')::text);
SELECT lives_ok($$SET CONSTRAINTS inbox.outbox_order_at_commit IMMEDIATE$$,
                'consumer: the commit-time numbering runs for a consumer (the trigger function is SECURITY DEFINER)');
INSERT INTO ob_res VALUES ('consumer-keyless', inbox.enqueue_effect('tap-k1', 'hook', '{}')::text);
SELECT throws_ok(c.sql, '42501', c.msg, 'consumer: ' || c.what)
  FROM (VALUES
        (1, $$SELECT * FROM inbox.outbox$$, 'permission denied for table outbox', 'cannot read inbox.outbox'),
        (2, $$UPDATE inbox.outbox SET status = 'delivered'$$, 'permission denied for table outbox', 'cannot mark effects delivered'),
        (3, $$INSERT INTO inbox.outbox (effect_id, destination, payload, payload_sha256) VALUES ('x', 'd', '{}', '\x00')$$,
            'permission denied for table outbox', 'cannot insert behind enqueue_effect''s back'),
        (4, $$DELETE FROM inbox.outbox_waiter$$, 'permission denied for table outbox_waiter', 'cannot touch the waiter table'),
        (5, $$SELECT * FROM inbox.claim_effects('d', key_aware => true)$$, 'permission denied for function claim_effects', 'is not a dispatcher'),
        (6, $$SELECT inbox.complete_effect('e', 1)$$, 'permission denied for function complete_effect', 'cannot complete'),
        (7, $$SELECT inbox.redrive_effect('e', 'n')$$, 'permission denied for function redrive_effect', 'cannot redrive'),
        (8, $$SELECT inbox.purge_delivered_effects('0 s')$$, 'permission denied for function purge_delivered_effects', 'cannot purge'),
        (9, $$SELECT pg_catalog.nextval('inbox.outbox_lease_token')$$, 'permission denied for sequence outbox_lease_token',
            'cannot take fencing tokens')
       ) AS c(ord, sql, msg, what)
 ORDER BY c.ord;
RESET ROLE;
SELECT is((SELECT val FROM ob_res WHERE step = 'consumer-enqueue'), 'true', 'consumer: can enqueue_effect and effect_id');
SELECT ok((SELECT order_seq IS NOT NULL FROM inbox.outbox WHERE ordering_key = 'K-c'), 'consumer: its keyed effect was numbered');

-- The dispatcher claims and reports, and sees nothing else.
SET ROLE tap_ob_dispatcher;
INSERT INTO ob_res SELECT 'dispatcher-claim', string_agg(c.effect_id || ':' || c.lease_token, ',' ORDER BY c.effect_id)
  FROM inbox.claim_effects('tap-ob-d', 10, key_aware => true) c;
INSERT INTO ob_res VALUES ('dispatcher-complete', inbox.complete_effect('tap-k1', (SELECT split_part(x, ':', 2)::bigint
    FROM ob_res, unnest(string_to_array(val, ',')) x WHERE step = 'dispatcher-claim' AND x LIKE 'tap-k1:%'))::text);
INSERT INTO ob_res VALUES ('dispatcher-fenced', inbox.complete_effect('tap-k1', 1)::text);
INSERT INTO ob_res VALUES ('dispatcher-extend', (inbox.extend_lease((SELECT split_part(x, ':', 1) FROM ob_res,
    unnest(string_to_array(val, ',')) x WHERE step = 'dispatcher-claim' AND x LIKE 'fx_%'),
    (SELECT split_part(x, ':', 2)::bigint FROM ob_res, unnest(string_to_array(val, ',')) x
      WHERE step = 'dispatcher-claim' AND x LIKE 'fx_%'), '1 minute') IS NOT NULL)::text);
INSERT INTO ob_res SELECT 'dispatcher-idle', 'ok' FROM (SELECT inbox.dispatcher_idle('tap-ob-d', true)) x;
INSERT INTO ob_res VALUES ('dispatcher-purge', inbox.purge_delivered_effects('1 day')::text);
SELECT throws_ok(c.sql, '42501', c.msg, 'dispatcher: ' || c.what)
  FROM (VALUES
        (1, $$SELECT * FROM inbox.outbox$$, 'permission denied for table outbox', 'cannot read inbox.outbox'),
        (2, $$SELECT effect_id FROM inbox.outbox_fenced_report$$, 'permission denied for table outbox_fenced_report',
            'cannot read the fenced reports'),
        (3, $$UPDATE inbox.outbox SET lease_token = 1$$, 'permission denied for table outbox', 'cannot forge a lease'),
        (4, $$DELETE FROM inbox.outbox_fenced_report$$, 'permission denied for table outbox_fenced_report',
            'cannot erase its fenced reports'),
        (5, $$SELECT inbox.enqueue_effect('e', 'd', '{}')$$, 'permission denied for function enqueue_effect', 'cannot enqueue'),
        (6, $$SELECT inbox.redrive_effect('e', 'n')$$, 'permission denied for function redrive_effect', 'cannot redrive'),
        (7, $$SELECT inbox.configure_destination('d', 1000)$$, 'permission denied for function configure_destination',
            'cannot change the retry policy'),
        (8, $$SELECT inbox.claim('c', 'p', 'm', '{}')$$, 'permission denied for function claim', 'is not a consumer'),
        (9, $$SELECT pg_catalog.setval('inbox.outbox_lease_token', 1)$$, 'permission denied for sequence outbox_lease_token',
            'cannot rewind the fencing tokens'),
        (10, $$SELECT inbox.discard_effect('e', 'n')$$, 'permission denied for function discard_effect', 'cannot discard')
       ) AS c(ord, sql, msg, what)
 ORDER BY c.ord;
RESET ROLE;
SELECT is((SELECT val LIKE '%tap-k1:%' AND val LIKE '%fx_%' FROM ob_res WHERE step = 'dispatcher-claim'), true,
          'dispatcher: can claim_effects');
SELECT is((SELECT array_agg(val ORDER BY step) FROM ob_res WHERE step IN ('dispatcher-complete', 'dispatcher-fenced',
                                                                          'dispatcher-extend', 'dispatcher-idle', 'dispatcher-purge')),
          ARRAY['true', 'true', 'false', 'ok', '0'],
          'dispatcher: can complete, is fenced, can extend, dispatcher_idle and purge');
SELECT is((SELECT (reported_by, report)::text FROM inbox.outbox_fenced_report ORDER BY report_id DESC LIMIT 1),
          format('(%s,complete)', session_user), 'dispatcher: its refused report is recorded under the session user');

-- The reader sees state, not payloads, headers or response bodies.
SET ROLE tap_ob_reader;
SELECT lives_ok($$SELECT effect_id, destination, ordering_key, order_seq, status, attempts, available_at,
                         created_at, created_xid, lease_token, leased_by, lease_expires_at, last_attempt_at,
                         last_status_code, last_duration_ms, delivered_at, dead_reason FROM inbox.outbox$$,
                'reader: can read the state columns of inbox.outbox');
SELECT lives_ok($$SELECT * FROM inbox.outbox_destination; SELECT effect_id, note FROM inbox.outbox_redrive;
                  SELECT effect_id, note FROM inbox.outbox_discard; SELECT * FROM inbox.outbox_fenced_report;
                  SELECT * FROM inbox.outbox_waiter$$,
                'reader: can read destinations, redrives, discards, fenced reports and waiters');
SELECT throws_ok(format('SELECT %I FROM inbox.outbox', c), '42501', 'permission denied for table outbox',
                 'reader: cannot read inbox.outbox.' || c)
  FROM unnest(ARRAY['payload', 'headers', 'last_response_excerpt']) c;
SELECT throws_ok($$SELECT * FROM inbox.outbox$$, '42501', 'permission denied for table outbox', 'reader: cannot SELECT *');
SELECT throws_ok($$SELECT * FROM inbox.claim_effects('d', key_aware => true)$$, '42501', 'permission denied for function claim_effects',
                 'reader: cannot claim');
RESET ROLE;

-- The operator reads everything, decides through the API, and cannot write behind it.
SET ROLE tap_ob_operator;
SELECT is((SELECT headers ->> 'X-Api-Key' FROM inbox.outbox WHERE ordering_key = 'K-c'), 't',
          'operator: can read payloads and headers');
SELECT lives_ok($$SELECT inbox.configure_destination('tap-op', 2)$$, 'operator: can configure_destination');
SELECT lives_ok($$SELECT inbox.purge_delivered_effects('1 day')$$, 'operator: can purge');
SELECT throws_ok($$SELECT inbox.discard_effect('no-such', 'n')$$, 'P0002', NULL,
                 'operator: may call discard_effect (it gets as far as looking the effect up)');
SELECT lives_ok($$SELECT * FROM inbox.outbox_discard$$, 'operator: can read the discard audit trail');
SELECT throws_ok(c.sql, '42501', c.msg, 'operator: ' || c.what)
  FROM (VALUES
        (1, $$UPDATE inbox.outbox SET status = 'pending'$$, 'permission denied for table outbox', 'cannot redrive behind the API'),
        (2, $$DELETE FROM inbox.outbox_redrive$$, 'permission denied for table outbox_redrive', 'cannot delete the audit trail'),
        (5, $$DELETE FROM inbox.outbox_discard$$, 'permission denied for table outbox_discard', 'cannot delete the discard audit trail'),
        (3, $$SELECT * FROM inbox.claim_effects('d', key_aware => true)$$, 'permission denied for function claim_effects', 'is not a dispatcher'),
        (4, $$SELECT inbox.enqueue_effect('e', 'd', '{}')$$, 'permission denied for function enqueue_effect', 'is not a consumer')
       ) AS c(ord, sql, msg, what)
 ORDER BY c.ord;
RESET ROLE;

-- A hostile search_path: look-alikes in pg_temp and a schema ahead of pg_catalog change nothing.
CREATE SCHEMA tap_ob_shadow AUTHORIZATION tap_ob_consumer;
SET ROLE tap_ob_consumer;
GRANT USAGE ON SCHEMA tap_ob_shadow TO PUBLIC;
CREATE FUNCTION tap_ob_shadow.always(bytea, bytea) RETURNS boolean LANGUAGE sql AS $$SELECT true$$;
CREATE OPERATOR tap_ob_shadow.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = tap_ob_shadow.always);
CREATE FUNCTION tap_ob_shadow.now() RETURNS timestamptz LANGUAGE sql AS $$SELECT '2000-01-01 00:00:00+00'::timestamptz$$;
CREATE TEMP TABLE outbox (effect_id text, destination text, payload jsonb, payload_sha256 bytea, headers jsonb,
                          ordering_key text, available_at timestamptz);
CREATE FUNCTION pg_temp.payload_hash(jsonb, text[]) RETURNS bytea LANGUAGE sql AS $$SELECT '\x00'::bytea$$;
SET search_path = tap_ob_shadow, pg_temp, pg_catalog, public;
DO $$
BEGIN
    PERFORM inbox.enqueue_effect('tap-shadow', 'hook', '{"a": 1}');
    PERFORM inbox.enqueue_effect('tap-shadow', 'hook', '{"a": 2}');
    INSERT INTO pg_temp.ob_res VALUES ('shadow', 'no error');
EXCEPTION WHEN OTHERS THEN
    INSERT INTO pg_temp.ob_res VALUES ('shadow', SQLSTATE);
END
$$;
RESET search_path;
RESET ROLE;
SELECT is((SELECT val FROM ob_res WHERE step = 'shadow'), '23505',
          'shadowing: a changed payload still conflicts (a planted bytea "=" did not make it a repeat)');
SELECT is((SELECT count(*)::integer FROM pg_temp.outbox), 0, 'shadowing: nothing went to the planted temp table');

-- ================================================================== set-based reports: complete_effects, fail_effects
-- The same rules as complete_effect / fail_effect, several reports per call; one result row per report.
DELETE FROM inbox.outbox;
DELETE FROM inbox.outbox_fenced_report;
SELECT inbox.configure_destination('tap-batch', 2, '10 seconds', '20 seconds') \g /dev/null
SELECT inbox.enqueue_effect('s' || g, 'tap-batch', '{}') FROM generate_series(1, 6) g \g /dev/null
SELECT inbox.enqueue_effect('sk1', 'tap-batch', '{}', ordering_key => 'K-s') \g /dev/null
SELECT inbox.enqueue_effect('sk2', 'tap-batch', '{}', ordering_key => 'K-s') \g /dev/null
SET CONSTRAINTS inbox.outbox_order_at_commit IMMEDIATE;
SET CONSTRAINTS inbox.outbox_order_at_commit DEFERRED;
SELECT is(pg_temp.claimed('tap-b', 10), ARRAY['s1', 's2', 's3', 's4', 's5', 's6', 'sk1'], 'batch: claimed (sk2 waits behind sk1)');
SELECT is((SELECT blocked FROM inbox.outbox WHERE effect_id = 'sk2'), true, 'batch: sk2 set aside behind its key');
-- s1 expires but nobody reclaims it: still current. s2 is reclaimed: its old token is superseded.
SELECT pg_temp.make_due('s1');
SELECT pg_temp.token('s2') AS s2_old \gset
UPDATE inbox.outbox SET available_at = now() + interval '1 hour' WHERE effect_id <> 's2' AND status = 'leased';
SELECT pg_temp.make_due('s2');
SELECT is(pg_temp.claimed('tap-b2', 10), ARRAY['s2'], 'batch: s2 reclaimed under a new token');
SELECT public.tap_writes('outbox_fenced_report') AS fb0 \gset
SELECT results_eq(
    format($$SELECT ord, effect_id, result, fenced_reason
               FROM inbox.complete_effects(ARRAY['s1', 's2', 'sk1', 'nope', 's1', 's3'],
                                           ARRAY[%s, %s, %s, 7, %s, %s]::bigint[],
                                           ARRAY[200, 201, 202, 200, 200, NULL], ARRAY['ok', NULL, 'k', NULL, NULL, NULL],
                                           ARRAY[5, 6, 7, NULL, NULL, 0])$$,
           pg_temp.token('s1'), :s2_old, pg_temp.token('sk1'), pg_temp.token('s1'), pg_temp.token('s3') + 1000),
    $$VALUES (1, 's1', 'delivered', NULL::text), (2, 's2', 'fenced', 'superseded'), (3, 'sk1', 'delivered', NULL),
             (4, 'nope', 'fenced', 'unknown_effect'), (5, 's1', 'fenced', 'not_leased'), (6, 's3', 'fenced', 'superseded')$$,
    'complete_effects: a mixed batch: one row per report in input order; an expired lease nobody reclaimed completes; '
    'a reclaimed lease, an unknown effect, a second report of the same lease and a wrong token are fenced, with the reason');
SELECT is(public.tap_writes('outbox_fenced_report') - :fb0, 4::bigint, 'complete_effects: each refused report is recorded');
SELECT results_eq($$SELECT effect_id, report, current_status::text FROM inbox.outbox_fenced_report ORDER BY report_id$$,
                  $$VALUES ('s2', 'complete', 'leased'), ('nope', 'complete', NULL), ('s1', 'complete', 'delivered'),
                           ('s3', 'complete', 'leased')$$,
                  'complete_effects: the refusals are recorded like _record_fenced did (report, current status)');
SELECT is((SELECT (status, last_status_code, last_response_excerpt, last_duration_ms, delivered_at = now())::text
             FROM inbox.outbox WHERE effect_id = 's1'), '(delivered,200,ok,5,t)',
          'complete_effects: delivered with its own status code, excerpt and duration');
SELECT is((SELECT (status, leased_by)::text FROM inbox.outbox WHERE effect_id = 's2'), '(leased,tap-b2)',
          'complete_effects: the fenced report changed nothing');
SELECT is((SELECT blocked FROM inbox.outbox WHERE effect_id = 'sk2'), false,
          'complete_effects: delivering the head of K-s unblocks its successor');
SELECT is(pg_temp.claimed('tap-b', 10), ARRAY['sk2'], 'complete_effects: the successor is then claimed');
-- Failures: retryable below max_attempts -> pending after the backoff; not retryable -> dead; retryable at
-- max_attempts (2) -> dead; fenced.
SELECT pg_temp.make_due('s4');
SELECT is(pg_temp.claimed('tap-b3', 10), ARRAY['s4'], 'fail_effects: s4 reclaimed, attempt 2 of max_attempts 2');
SELECT results_eq(
    format($$SELECT ord, effect_id, result, fenced_reason
               FROM inbox.fail_effects(ARRAY['s3', 's5', 's4', 's6', 'sk2'], ARRAY[%s, %s, %s, %s, 1]::bigint[],
                                       ARRAY['HTTP 503', 'HTTP 422', 'timeout', 'x', 'late'],
                                       ARRAY[true, false, true, true, true], ARRAY[503, 422, NULL, NULL, NULL],
                                       ARRAY['busy', repeat('r', 2500), NULL, NULL, NULL], ARRAY[11, 12, 13, NULL, NULL])$$,
           pg_temp.token('s3'), pg_temp.token('s5'), pg_temp.token('s4'), pg_temp.token('s6') - 1),
    $$VALUES (1, 's3', 'pending', NULL::text), (2, 's5', 'dead', NULL), (3, 's4', 'dead', NULL),
             (4, 's6', 'fenced', 'superseded'), (5, 'sk2', 'fenced', 'superseded')$$,
    'fail_effects: retryable -> pending, permanent -> dead, at max_attempts -> dead, wrong tokens fenced');
SELECT is((SELECT (status, attempts, dead_reason, last_error, last_status_code, last_duration_ms, lease_expires_at,
                   available_at - now() BETWEEN interval '5 seconds' AND interval '10 seconds')::text
             FROM inbox.outbox WHERE effect_id = 's3'), '(pending,1,,"HTTP 503",503,11,,t)',
          'fail_effects: pending again after the destination''s backoff (50..100% of 10 s after attempt 1)');
SELECT is((SELECT (status, dead_reason, length(last_response_excerpt))::text FROM inbox.outbox WHERE effect_id = 's5'),
          '(dead,permanent_failure,2000)', 'fail_effects: permanent failure, excerpt cut to 2000 characters');
SELECT is((SELECT (status, attempts, dead_reason)::text FROM inbox.outbox WHERE effect_id = 's4'), '(dead,2,max_attempts)',
          'fail_effects: dead after max_attempts');
SELECT is((SELECT count(*)::integer FROM inbox.outbox_fenced_report WHERE report = 'fail'), 2,
          'fail_effects: the refused reports are recorded with report = fail');
SELECT is((SELECT status::text FROM inbox.outbox WHERE effect_id = 'sk2'), 'leased', 'fail_effects: a fenced report changed nothing');
SELECT is((SELECT r.result FROM inbox.fail_effects(ARRAY['sk2'], ARRAY[pg_temp.token('sk2')], ARRAY['HTTP 500'],
                                                   ARRAY[false]) r), 'dead', 'fail_effects: a keyed head dies');
SELECT is((SELECT count(*)::integer FROM inbox.outbox WHERE blocked), 0, 'fail_effects: a failed head unblocks nothing');
SELECT is((SELECT count(*)::integer FROM inbox.complete_effects('{}', '{}')), 0, 'complete_effects: no reports, no rows');
-- The same effect twice in one call, a stale token first: the current one is accepted wherever it stands.
SELECT inbox.enqueue_effect('s7', 'tap-batch', '{}') \g /dev/null
SELECT is(pg_temp.claimed('tap-b', 10), ARRAY['s7'], 'batch: s7 claimed');
SELECT results_eq(format($$SELECT ord, result, fenced_reason FROM inbox.complete_effects('{s7,s7}', ARRAY[%s, %s]::bigint[])$$,
                         pg_temp.token('s7') - 1, pg_temp.token('s7')),
                  $$VALUES (1, 'fenced', 'not_leased'), (2, 'delivered', NULL::text)$$,
                  'complete_effects: a stale report of an effect does not hide the current one later in the call '
                  '(the reason describes the effect after the call: delivered)');
-- Bad input: a stable SQLSTATE, raised before anything is written.
SELECT public.tap_writes() AS wb0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, c.description)
  FROM (VALUES
        (1, $$SELECT * FROM inbox.complete_effects(NULL, '{1}')$$, '22004', 'inbox.complete_effects: effect_ids must not be NULL',
            'complete_effects: NULL effect_ids is 22004'),
        (2, $$SELECT * FROM inbox.complete_effects('{s6}', NULL)$$, '22004', 'inbox.complete_effects: lease_tokens must not be NULL',
            'complete_effects: NULL lease_tokens is 22004'),
        (3, $$SELECT * FROM inbox.complete_effects('{s6,s1}', '{1}')$$, '22023',
            'inbox.complete_effects: lease_tokens has 1 elements, effect_ids has 2', 'complete_effects: arrays of different lengths are 22023'),
        (4, $$SELECT * FROM inbox.complete_effects('{s6}', '{1}', '{200,200}')$$, '22023',
            'inbox.complete_effects: status_codes has 2 elements, effect_ids has 1', 'complete_effects: an optional array of another length is 22023'),
        (5, $$SELECT * FROM inbox.complete_effects('{{s6}}', '{{1}}')$$, '22023',
            'inbox.complete_effects: effect_ids must be a one-dimensional array, got 2 dimensions', 'complete_effects: a 2-D array is 22023'),
        (6, $$SELECT * FROM inbox.complete_effects(array_fill('s6'::text, '{1001}'), array_fill(1::bigint, '{1001}'))$$, '54000',
            'inbox.complete_effects: 1001 reports in one call, the limit is 1000', 'complete_effects: over 1000 reports is 54000'),
        (7, $$SELECT * FROM inbox.complete_effects('{s6,NULL}', '{1,1}')$$, '22004',
            'inbox.complete_effects: report 2: effect_id must not be NULL', 'complete_effects: a NULL effect_id is 22004, naming the report'),
        (8, $$SELECT * FROM inbox.complete_effects(ARRAY['s6', repeat('i', 257)], '{1,1}')$$, '22001',
            'inbox.complete_effects: report 2: effect_id is 257 bytes long, the limit is 256', 'complete_effects: a 257-byte effect_id is 22001'),
        (9, $$SELECT * FROM inbox.complete_effects('{s6}', '{NULL}')$$, '22004',
            'inbox.complete_effects: report 1: lease_token must not be NULL', 'complete_effects: a NULL lease_token is 22004'),
        (10, $$SELECT * FROM inbox.complete_effects('{s6}', '{1}', '{99}')$$, '22023',
            'inbox.complete_effects: report 1: status_code must be NULL or an HTTP status between 100 and 599, got 99',
            'complete_effects: status_code 99 is 22023'),
        (11, $$SELECT * FROM inbox.complete_effects('{s6}', '{1}', durations_ms => '{-1}')$$, '22023',
            'inbox.complete_effects: report 1: duration_ms must not be negative, got -1', 'complete_effects: a negative duration is 22023'),
        (12, $$SELECT * FROM inbox.fail_effects('{s6}', '{1}', NULL, '{t}')$$, '22004', 'inbox.fail_effects: errors must not be NULL',
            'fail_effects: NULL errors is 22004'),
        (13, $$SELECT * FROM inbox.fail_effects('{s6}', '{1}', '{e}', NULL)$$, '22004', 'inbox.fail_effects: retryables must not be NULL',
            'fail_effects: NULL retryables is 22004'),
        (14, $$SELECT * FROM inbox.fail_effects('{s6,s1}', '{1,1}', '{e,"  "}', '{t,t}')$$, '22023',
            'inbox.fail_effects: report 2: error must say what went wrong', 'fail_effects: a blank error is 22023'),
        (15, $$SELECT * FROM inbox.fail_effects('{s6}', '{1}', '{NULL}', '{t}')$$, '22004',
            'inbox.fail_effects: report 1: error must say what went wrong', 'fail_effects: a NULL error is 22004'),
        (16, $$SELECT * FROM inbox.fail_effects('{s6}', '{1}', '{e}', '{NULL}')$$, '22004',
            'inbox.fail_effects: report 1: retryable must not be NULL', 'fail_effects: a NULL retryable is 22004'),
        (17, $$SELECT * FROM inbox.fail_effects('{s6}', '{1}', '{e}', '{t}', '{1000}')$$, '22023',
            'inbox.fail_effects: report 1: status_code must be NULL or an HTTP status between 100 and 599, got 1000',
            'fail_effects: status_code 1000 is 22023'),
        (18, $$SELECT * FROM inbox.fail_effects(array_fill('s6'::text, '{1001}'), array_fill(1::bigint, '{1001}'),
                                                array_fill('e'::text, '{1001}'), array_fill(true, '{1001}'))$$, '54000',
            'inbox.fail_effects: 1001 reports in one call, the limit is 1000', 'fail_effects: over 1000 reports is 54000')
       ) AS c(ord, sql, state, msg, description)
 ORDER BY c.ord;
SELECT is(public.tap_writes() - :wb0, 0::bigint, 'complete_effects, fail_effects: bad input writes nothing (not even a fenced report)');


-- ================================================================== trust boundaries (0.2.0)
-- The caller is session_user (SET ROLE keeps it): SET SESSION AUTHORIZATION makes these roles the
-- session's, as a login of theirs would be.
DELETE FROM inbox.outbox;
SELECT is((SELECT pg_catalog.pg_get_constraintdef(c.oid) FROM pg_catalog.pg_constraint c
            WHERE c.conrelid = 'inbox.outbox'::regclass AND c.conname = 'outbox_pkey'),
          'PRIMARY KEY (effect_id, consumer, tenant)', 'effect ids are unique per consumer and tenant: primary key (effect_id, consumer, tenant)');
SELECT is((SELECT pg_catalog.pg_get_indexdef('inbox.outbox_consumer_undelivered_idx'::regclass)),
          'CREATE INDEX outbox_consumer_undelivered_idx ON inbox.outbox USING btree (consumer, created_at) WHERE (status = ANY (ARRAY[''pending''::inbox.effect_status, ''leased''::inbox.effect_status, ''dead''::inbox.effect_status]))',
          'the per-consumer purge floor index: (consumer, created_at) of undelivered effects');
-- The fast check stays inlined (a helper that is not would be planned again in every transaction).
SET LOCAL plan_cache_mode = force_generic_plan;
PREPARE tap_effect_ok(text, jsonb, timestamptz) AS SELECT inbox._effect_ok($1, 'd', 10, $2, NULL, $3);
\ir plan_text.psql
SELECT unalike(pg_temp.plan_text($$EXECUTE tap_effect_ok('e', '{"X-A": "b"}', now())$$), '%\_effect\_ok%',
              '_effect_ok is inlined by the planner');
SELECT unalike(pg_temp.plan_text($$EXECUTE tap_effect_ok('e', '{"X-A": "b"}', now())$$), '%\_headers\_ok%',
              '_headers_ok is inlined by the planner');
DEALLOCATE tap_effect_ok;
RESET plan_cache_mode;
SELECT is((SELECT (count(DISTINCT t), min(t) > 0, max(t) > 4611686018427387904)::text
             FROM (SELECT inbox._new_lease_token() AS t FROM generate_series(1, 2000)) x),
          '(2000,t,t)', 'lease tokens: random, positive, spread over 63 bits');

-- Headers: refused at enqueue with 22023, nothing written.
SELECT public.tap_writes() AS wh0 \gset
SELECT throws_ok(format('SELECT inbox.enqueue_effect(%L, %L, %L, %L::jsonb)', 'h-' || c.ord, 'd', '{}', c.headers),
                 '22023', c.msg, 'headers: ' || c.what)
  FROM (VALUES
        (1, '{"Bad Name": "x"}', 'inbox.enqueue_effect: header name ''Bad Name'' is not an HTTP token', 'a name with a space'),
        (2, '{"X-A:": "x"}', 'inbox.enqueue_effect: header name ''X-A:'' is not an HTTP token', 'a name with a colon'),
        (3, '{"": "x"}', 'inbox.enqueue_effect: header name '''' is not an HTTP token', 'an empty name'),
        (4, '{"X-\u00e9": "x"}', 'inbox.enqueue_effect: header name ''X-é'' is not an HTTP token', 'a non-ASCII name'),
        (5, '{"X-A": "a\r\nX-Injected: 1"}', 'inbox.enqueue_effect: the value of header ''X-A'' contains a control character (CR, LF, ...)',
            'a value with CR LF'),
        (6, '{"X-A": "a\nb"}', 'inbox.enqueue_effect: the value of header ''X-A'' contains a control character (CR, LF, ...)',
            'a value with LF'),
        (7, '{"X-A": "a\rb"}', 'inbox.enqueue_effect: the value of header ''X-A'' contains a control character (CR, LF, ...)',
            'a value with CR'),
        (8, '{"X-A": "a\u0001b"}', 'inbox.enqueue_effect: the value of header ''X-A'' contains a control character (CR, LF, ...)',
            'a value with another control character'),
        (9, '{"X-A": {"b": "c"}}', 'inbox.enqueue_effect: header ''X-A'' must be a string', 'an object value'),
        (10, '{"Host": "evil.example"}', 'inbox.enqueue_effect: header ''Host'' belongs to the dispatcher', 'Host'),
        (11, '{"authorization": "Bearer x"}', 'inbox.enqueue_effect: header ''authorization'' belongs to the dispatcher',
             'Authorization (any case)'),
        (12, '{"Proxy-Authorization": "x"}', 'inbox.enqueue_effect: header ''Proxy-Authorization'' belongs to the dispatcher',
             'Proxy-Authorization'),
        (13, '{"COOKIE": "s=1"}', 'inbox.enqueue_effect: header ''COOKIE'' belongs to the dispatcher', 'Cookie'),
        (14, '{"Content-Length": "0"}', 'inbox.enqueue_effect: header ''Content-Length'' belongs to the dispatcher',
             'Content-Length'),
        (15, '{"Transfer-Encoding": "chunked"}', 'inbox.enqueue_effect: header ''Transfer-Encoding'' belongs to the dispatcher',
             'Transfer-Encoding'),
        (16, '{"Connection": "close"}', 'inbox.enqueue_effect: header ''Connection'' belongs to the dispatcher', 'Connection'),
        (17, '{"Keep-Alive": "1"}', 'inbox.enqueue_effect: header ''Keep-Alive'' belongs to the dispatcher', 'Keep-Alive'),
        (18, '{"te": "trailers"}', 'inbox.enqueue_effect: header ''te'' belongs to the dispatcher', 'TE'),
        (19, '{"Trailer": "X"}', 'inbox.enqueue_effect: header ''Trailer'' belongs to the dispatcher', 'Trailer'),
        (20, '{"Upgrade": "h2c"}', 'inbox.enqueue_effect: header ''Upgrade'' belongs to the dispatcher', 'Upgrade'),
        (21, '{"Idempotency-Key": "other"}', 'inbox.enqueue_effect: header ''Idempotency-Key'' belongs to the dispatcher',
             'Idempotency-Key'),
        (22, '{"Proxy-Connection": "x"}', 'inbox.enqueue_effect: header ''Proxy-Connection'' belongs to the dispatcher',
             'Proxy-Connection')
       ) AS c(ord, headers, msg, what)
 ORDER BY c.ord;
SELECT throws_ok($$SELECT inbox.enqueue_effect('h-nul', 'd', '{}', '{"X-A": "a\u0000b"}')$$, '22P05', NULL,
                 'headers: a NUL cannot even be written as jsonb (22P05)');
SELECT is(public.tap_writes(), :wh0::bigint, 'headers: refused headers wrote nothing');
SELECT ok(inbox.enqueue_effect('h-ok', 'd', '{}', E'{"X-Request-Host": "a\\tb", "X-Name": "Zoë", "Content-Type": "text/plain"}'),
          'headers: other names, a tab and non-ASCII text in values are accepted');

-- available_at: at most max_effect_delay ahead (30 days by default).
SELECT public.tap_writes() AS wa0 \gset
SELECT throws_ok($$SELECT inbox.enqueue_effect('a-far', 'd', '{}', available_at => '9999-01-01')$$, '22023',
                 format('inbox.enqueue_effect: available_at %s is further ahead than max_effect_delay (30 days)',
                        '9999-01-01'::timestamptz),
                 'available_at: year 9999 is refused (22023)');
SELECT throws_ok($$SELECT inbox.enqueue_effect('a-far', 'd', '{}', available_at => now() + interval '30 days 1 second')$$,
                 '22023', NULL, 'available_at: a second past max_effect_delay is refused');
SELECT is(public.tap_writes(), :wa0::bigint, 'available_at: refused effects wrote nothing');
SELECT ok(inbox.enqueue_effect('a-30d', 'd', '{}', available_at => now() + interval '30 days'),
          'available_at: exactly max_effect_delay ahead is accepted');
SELECT inbox.configure_security(max_effect_delay => '1 hour', note => 'tap') \g /dev/null
SELECT throws_ok($$SELECT inbox.enqueue_effect('a-2h', 'd', '{}', available_at => now() + interval '2 hours')$$, '22023',
                 NULL, 'available_at: the limit follows security_settings.max_effect_delay');
SELECT inbox.configure_security(max_effect_delay => '30 days', note => 'tap') \g /dev/null

-- Effect ids per consumer (the superuser passes every binding check unless strict_consumers).
SELECT is(ARRAY[inbox.enqueue_effect('same', 'd', '{"v": 1}', consumer => 'tx-one'),
                inbox.enqueue_effect('same', 'd', '{"v": 2}', consumer => 'tx-two'),
                inbox.enqueue_effect('same', 'd', '{"v": 1}', consumer => 'tx-one')],
          ARRAY[true, true, false], 'ids per consumer: two consumers enqueue one id; a repeat is a no-op');
SELECT throws_ok($$SELECT inbox.enqueue_effect('same', 'd', '{"v": 2}', consumer => 'tx-one')$$, '23505', NULL,
                 'ids per consumer: another payload under the same consumer is still effect_id_conflict');
SELECT is((SELECT array_agg((consumer, payload ->> 'v')::text ORDER BY consumer) FROM inbox.outbox WHERE effect_id = 'same'),
          ARRAY['(tx-one,1)', '(tx-two,2)'], 'ids per consumer: each consumer has its own effect');
SELECT set_config('inbox.consumer', 'tx-claimed', true) \g /dev/null
SELECT ok(inbox.enqueue_effect('from-claim', 'd', '{}'), 'consumer: the claimed consumer is the default');
SELECT is((SELECT consumer FROM inbox.outbox WHERE effect_id = 'from-claim'), 'tx-claimed',
          'consumer: the effect belongs to the consumer claimed in the transaction (setting inbox.consumer)');
SELECT set_config('inbox.consumer', '', true) \g /dev/null
SELECT ok(inbox.enqueue_effect('anon', 'd', '{}'), 'consumer: none claimed, none given: anonymous (the superuser may)');
SELECT is((SELECT consumer FROM inbox.outbox WHERE effect_id = 'anon'), '', 'consumer: an anonymous effect has consumer ''''');
SELECT throws_ok($$SELECT inbox.enqueue_effect('e', 'd', '{}', consumer => '')$$, '22023',
                 'inbox.enqueue_effect: consumer must not be empty', 'consumer: an empty consumer is 22023');

-- Who may enqueue what, as the service roles.
CREATE ROLE tap_tx_billing NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_tx_mallory NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_tx_disp1 NOLOGIN IN ROLE inbox_dispatcher;
CREATE ROLE tap_tx_disp2 NOLOGIN IN ROLE inbox_dispatcher;
SELECT inbox.bind_consumer('tx-billing', 'tap_tx_billing', note => 'tap') \g /dev/null
SELECT inbox.bind_consumer('tx-mallory', 'tap_tx_mallory', note => 'tap') \g /dev/null
SELECT is((SELECT (destination, consumer, bound_by, note)::text FROM inbox.bind_destination('tx-pay', 'tx-billing', 'billing pays')),
          format('(tx-pay,tx-billing,%s,"billing pays")', session_user), 'bind_destination: returns the binding');
SELECT inbox.bind_destination('tx-mall', 'tx-mallory', 'tap') \g /dev/null
SELECT inbox.bind_destination('tx-open', '*', 'tap') \g /dev/null
SELECT is((SELECT (action, consumer, destination, changed_by, note)::text FROM inbox.binding_change
            WHERE action = 'bind_destination' AND destination = 'tx-pay'),
          format('(bind_destination,tx-billing,tx-pay,%s,"billing pays")', session_user), 'bind_destination: audited');
SELECT is(inbox.unbind_destination('tx-pay', 'tx-nobody', 'tap'), false, 'unbind_destination: false when not bound');
SELECT throws_ok($$SELECT inbox.bind_destination('tx-pay', 'tx-billing', ' ')$$, '22023', NULL,
                 'bind_destination: a blank note is refused');

SET SESSION AUTHORIZATION tap_tx_mallory;
SELECT public.tap_writes() AS wz0 \gset
SELECT throws_ok(c.sql, c.state, c.msg, 'mallory: ' || c.what)
  FROM (VALUES
        (1, $$SELECT inbox.enqueue_effect('x', 'tx-pay', '{}', consumer => 'tx-mallory')$$, '42501',
            'inbox.enqueue_effect: consumer ''tx-mallory'' may not enqueue effects to destination ''tx-pay''',
            'cannot enqueue to a destination bound to another consumer'),
        (2, $$SELECT set_config('inbox.consumer', '', true), inbox.enqueue_effect('x', 'tx-open', '{}')$$, '22004',
            'inbox.enqueue_effect: no consumer: the effect must belong to one', 'no consumer, anonymous enqueue off: 22004'),
        (3, $$SELECT inbox.enqueue_effect('x', 'tx-nowhere', '{}', consumer => 'tx-mallory')$$, '42501',
            'inbox.enqueue_effect: consumer ''tx-mallory'' may not enqueue effects to destination ''tx-nowhere''',
            'cannot enqueue to a destination nobody is bound to'),
        (4, $$SELECT inbox.bind_destination('tx-pay', 'tx-mallory', 'mine now')$$, '42501',
            'permission denied for function bind_destination', 'cannot bind a destination')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT is(public.tap_writes(), :wz0::bigint, 'mallory: the refused enqueues wrote nothing');
-- inbox._may_act_as (sql/027_security.sql) compares b.consumer with itself: in a SQL function a
-- column shadows a parameter of the same name, so a role bound to any consumer may act as every
-- consumer. Fixed there by qualifying the parameters (_may_act_as.consumer, _may_act_as.tenant).
SELECT throws_ok(c.sql, c.state, c.msg, 'mallory: ' || c.what)
  FROM (VALUES
        (1, $$SELECT inbox.enqueue_effect('x', 'tx-pay', '{}', consumer => 'tx-billing')$$, '42501',
            'inbox.enqueue_effect: role tap_tx_mallory may not act as consumer ''tx-billing'' for tenant ''''', 'cannot enqueue as billing'),
        (2, $$SELECT set_config('inbox.consumer', 'tx-billing', true), inbox.enqueue_effect('x', 'tx-pay', '{}')$$, '42501',
            'inbox.enqueue_effect: role tap_tx_mallory may not act as consumer ''tx-billing'' for tenant ''''',
            'a forged inbox.consumer setting gets nothing')
       ) AS c(ord, sql, state, msg, what)
 ORDER BY c.ord;
SELECT is(public.tap_writes(), :wz0::bigint, 'mallory: acting as billing wrote nothing');
SELECT set_config('inbox.consumer', '', true) \g /dev/null
SELECT ok(inbox.enqueue_effect(inbox.effect_id('tx-billing', 'p', 'm-1', 'pay'), 'tx-mall', '{"to": "mallory"}',
                               consumer => 'tx-mallory'),
          'mallory: squats billing''s next effect id in its own destination');
SELECT ok(inbox.enqueue_effect('m-open', 'tx-open', '{}', consumer => 'tx-mallory'),
          'mallory: a destination bound to ''*'' takes every consumer');
RESET SESSION AUTHORIZATION;

SET SESSION AUTHORIZATION tap_tx_billing;
SELECT ok(inbox.enqueue_effect(inbox.effect_id('tx-billing', 'p', 'm-1', 'pay'), 'tx-pay', '{"to": "billing"}',
                               consumer => 'tx-billing'),
          'billing: its effect is enqueued although mallory holds the same id');
SELECT ok(inbox.enqueue_effect('b-v2', 'tx-pay', '{}', consumer => 'tx-billing@v2'),
          'billing: a destination bound to a consumer takes its versioned names');
RESET SESSION AUTHORIZATION;
SELECT is((SELECT array_agg((consumer, destination, payload ->> 'to')::text ORDER BY consumer) FROM inbox.outbox
            WHERE effect_id = inbox.effect_id('tx-billing', 'p', 'm-1', 'pay')),
          ARRAY['(tx-billing,tx-pay,billing)', '(tx-mallory,tx-mall,mallory)'],
          'the squatted id: billing''s effect goes to its destination, mallory''s to mallory''s');
SELECT inbox.configure_security(anonymous_enqueue => true, note => 'tap') \g /dev/null
SET SESSION AUTHORIZATION tap_tx_mallory;
SELECT ok(inbox.enqueue_effect('anon-open', 'tx-open', '{}'), 'anonymous_enqueue on: an enqueue without a consumer to a ''*'' destination');
SELECT throws_ok($$SELECT inbox.enqueue_effect('anon-pay', 'tx-pay', '{}')$$, '42501',
                 'inbox.enqueue_effect: an enqueue without a consumer may not enqueue effects to destination ''tx-pay''',
                 'anonymous_enqueue on: only to destinations bound to ''*''');
RESET SESSION AUTHORIZATION;
SELECT inbox.configure_security(anonymous_enqueue => false, strict_consumers => true, note => 'tap') \g /dev/null
SELECT throws_ok($$SELECT inbox.enqueue_effect('su', 'tx-nowhere', '{}', consumer => 'tx-billing')$$, '42501', NULL,
                 'strict_consumers: a superuser too needs the destination bound');
SELECT inbox.configure_security(strict_consumers => false, note => 'tap') \g /dev/null
SELECT is(inbox.unbind_destination('tx-pay', 'tx-billing', 'tap'), true, 'unbind_destination: true when it was bound');
SET SESSION AUTHORIZATION tap_tx_billing;
SELECT throws_ok($$SELECT inbox.enqueue_effect('b-after', 'tx-pay', '{}', consumer => 'tx-billing')$$, '42501', NULL,
                 'unbind_destination: the consumer can no longer enqueue to it');
RESET SESSION AUTHORIZATION;

-- Leases belong to the role that claimed them.
DELETE FROM inbox.outbox;
SELECT inbox.enqueue_effect('l1', 'd', '{}') \g /dev/null
SELECT inbox.enqueue_effect('l1', 'd', '{}', consumer => 'tx-other') \g /dev/null
SET SESSION AUTHORIZATION tap_tx_disp1;
CREATE TEMP TABLE tx_lease AS SELECT effect_id, consumer, lease_token FROM inbox.claim_effects('disp1', 10, key_aware => true);
RESET SESSION AUTHORIZATION;
SELECT is((SELECT array_agg(consumer ORDER BY consumer) FROM tx_lease), ARRAY['', 'tx-other'],
          'claim_effects: returns each effect''s consumer');
SELECT is((SELECT count(*)::integer FROM inbox.outbox WHERE lease_role = 'tap_tx_disp1'::regrole), 2,
          'claim_effects: the lease belongs to the claiming role');
SELECT lease_token AS lt FROM tx_lease WHERE consumer = '' \gset
SELECT lease_token AS lt_other FROM tx_lease WHERE consumer = 'tx-other' \gset
SELECT public.tap_writes('outbox') AS wl0 \gset
SET SESSION AUTHORIZATION tap_tx_disp2;
SELECT is(ARRAY[inbox.complete_effect('l1', :lt)::text, inbox.fail_effect('l1', :lt, 'x'),
                coalesce(inbox.extend_lease('l1', :lt, '1 hour')::text, 'NULL'),
                inbox.complete_effect('l1', :lt + 1)::text, inbox.complete_effect('l1', :lt - 1)::text],
          ARRAY['false', 'fenced', 'NULL', 'false', 'false'],
          'another dispatcher role cannot complete, fail or extend a lease, with its token or a neighbour');
SELECT is((SELECT array_agg(r.fenced_reason ORDER BY r.ord) FROM inbox.complete_effects('{l1,l1}', ARRAY[:lt, :lt_other]::bigint[]) r),
          ARRAY['not_lease_holder', 'not_lease_holder'], 'complete_effects: the reason is not_lease_holder');
RESET SESSION AUTHORIZATION;
SELECT is(public.tap_writes('outbox'), :wl0::bigint, 'the refused reports changed no effect');
SELECT is((SELECT array_agg(DISTINCT reported_by) FROM inbox.outbox_fenced_report WHERE effect_id = 'l1'),
          ARRAY['tap_tx_disp2'], 'the refused reports are recorded under the other role');
SET SESSION AUTHORIZATION tap_tx_disp1;
SELECT is(ARRAY[inbox.complete_effect('l1', :lt), inbox.complete_effect('l1', :lt_other)], ARRAY[true, true],
          'the holder completes both effects of the id, each by its token');
RESET SESSION AUTHORIZATION;
-- A lease taken before 0.2.0 (no lease_role) is accepted from any dispatcher until it ends.
SELECT inbox.enqueue_effect('l2', 'd', '{}') \g /dev/null
SET SESSION AUTHORIZATION tap_tx_disp1;
SELECT lease_token AS lt2 FROM inbox.claim_effects('disp1', 1, key_aware => true) \gset
RESET SESSION AUTHORIZATION;
UPDATE inbox.outbox SET lease_role = NULL WHERE effect_id = 'l2';
SET SESSION AUTHORIZATION tap_tx_disp2;
SELECT is(inbox.complete_effect('l2', :lt2), true, 'a lease from before 0.2.0 (no lease_role) is accepted with its token');
RESET SESSION AUTHORIZATION;

-- Operators name the consumer when several hold an id; the purge deletes the right row.
DELETE FROM inbox.outbox;
SELECT inbox.enqueue_effect('dup', 'd', '{}', consumer => c) FROM unnest(ARRAY['tx-a', 'tx-b']) c \g /dev/null
UPDATE inbox.outbox SET status = 'dead', dead_reason = 'permanent_failure' WHERE effect_id = 'dup';
SELECT throws_ok($$SELECT inbox.redrive_effect('dup', 'n')$$, 'P0003', 'inbox.redrive_effect: effect ''dup'' is held by 2 consumers or tenants',
                 'redrive_effect: an id several consumers hold needs the consumer (P0003)');
SELECT throws_ok($$SELECT inbox.discard_effect('dup', 'n', consumer => 'tx-c')$$, 'P0002',
                 'inbox.discard_effect: no effect ''dup'' of consumer ''tx-c''', 'discard_effect: no such effect of that consumer');
SELECT is((SELECT (status, consumer)::text FROM inbox.redrive_effect('dup', 'again', consumer => 'tx-a')), '(pending,tx-a)',
          'redrive_effect: with the consumer, that consumer''s effect');
SELECT is((SELECT (status, consumer)::text FROM inbox.discard_effect('dup', 'drop', 'tx-b')), '(discarded,tx-b)',
          'discard_effect: with the consumer, that consumer''s effect');
SELECT is((SELECT array_agg(x ORDER BY x) FROM (SELECT 'redrive ' || consumer AS x FROM inbox.outbox_redrive WHERE effect_id = 'dup'
                                                UNION ALL
                                                SELECT 'discard ' || consumer FROM inbox.outbox_discard WHERE effect_id = 'dup') a),
          ARRAY['discard tx-b', 'redrive tx-a'], 'the audit rows name the consumer');
UPDATE inbox.outbox SET discarded_at = now() - interval '2 days' WHERE effect_id = 'dup' AND consumer = 'tx-b';
SELECT is(inbox.purge_delivered_effects('1 day'), 1, 'purge: deletes the discarded effect');
SELECT is((SELECT array_agg((consumer, status)::text) FROM inbox.outbox WHERE effect_id = 'dup'), ARRAY['(tx-a,pending)'],
          'purge: another consumer''s effect under the same id stays');

-- enqueue_effect plans its statements once per session: with custom plans its authorization query
-- was planned again at every call (4x the CPU of an enqueue once the outbox held rows).
SELECT ok((SELECT 'plan_cache_mode=force_generic_plan' = ANY (p.proconfig) FROM pg_proc p
            WHERE p.oid = 'inbox.enqueue_effect(text, text, jsonb, jsonb, text, timestamptz, text, text)'::regprocedure),
          'enqueue_effect: generic plans only (SET plan_cache_mode = force_generic_plan)');

SELECT * FROM finish();
ROLLBACK;
