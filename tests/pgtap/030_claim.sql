-- pgTAP: sql/030_claim.sql — claim, claim_bytea, configure_consumer, record_failure, record_start.
-- Runs as the superuser that deployed; privileges are tested in 027_security.sql.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(179);

-- ------------------------------------------------------------------ fixtures
\ir write_counter.psql

-- Self-test: the counter sees a write even when it is rolled back.
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($q$DO $d$ BEGIN PERFORM inbox.claim('tap-self', 'p', 'm', '{}'); RAISE EXCEPTION 'undo'; END $d$ $q$,
                 'P0001', 'undo', 'self-test: a claim followed by an error');
SELECT cmp_ok(public.tap_writes(), '>', :w0::bigint, 'self-test: the write counter saw the rolled-back claim');

-- Results of the calls under test, one row per step.
CREATE TEMP TABLE res (step text PRIMARY KEY, LIKE inbox.delivery_result);

CREATE FUNCTION pg_temp.hex(payload jsonb, exclude text[] DEFAULT '{}') RETURNS text LANGUAGE sql
    AS $$SELECT encode(inbox.payload_hash(payload, exclude), 'hex')$$;

-- ================================================================== claim: the four outcomes
INSERT INTO res SELECT 'first', c.* FROM inbox.claim('tap-c', 'p', 'm1', '{"a": 1, "b": "x"}', 'v1',
                                                     produced_at => '2024-01-02 03:04:05+00') c;
SELECT is((SELECT outcome FROM res WHERE step = 'first'), 'claimed', 'claim: a new identity is claimed');
SELECT is((SELECT payload_sha256 FROM res WHERE step = 'first'), pg_temp.hex('{"a": 1, "b": "x"}'),
          'claim: payload_sha256 is the hex semantic hash');
SELECT is((SELECT (stored_sha256 IS NULL, quarantine_id IS NULL, reason_code IS NULL, error_message IS NULL)::text
             FROM res WHERE step = 'first'), '(t,t,t,t)',
          'claim: a claimed result has no stored hash, quarantine id, reason or error');
SELECT is((SELECT (handler_version, processed_at = now())::text FROM res WHERE step = 'first'),
          '(v1,t)', 'claim: claimed carries the handler version and processed_at = now()');
-- attempts is reported on failed and quarantined outcomes only: the first-claim path reads no
-- attempt row (documented in docs/sql-api.md).
SELECT is((SELECT attempts FROM res WHERE step = 'first'), NULL, 'claim: a claimed result leaves attempts NULL (not looked up)');
SELECT is((SELECT (status, payload_sha256 = inbox.payload_hash('{"a": 1, "b": "x"}'), handler_version,
                   produced_at = '2024-01-02 03:04:05+00', processed_at = now())::text
             FROM inbox.message WHERE consumer = 'tap-c' AND tenant = '' AND producer = 'p' AND message_id = 'm1'),
          '(processed,t,v1,t,t)', 'claim: the claim row is processed, with hash, version, produced_at and processed_at');

INSERT INTO res SELECT 'dup', c.* FROM inbox.claim('tap-c', 'p', 'm1', E'{ "b" : "x",\n "a" : 1 }', 'v2') c;
SELECT is((SELECT outcome FROM res WHERE step = 'dup'), 'duplicate',
          'claim: the same identity with the same payload (other key order and whitespace) is a duplicate');
SELECT is((SELECT (stored_sha256 = payload_sha256, handler_version, processed_at = now(), quarantine_id IS NULL)::text
             FROM res WHERE step = 'dup'), '(t,v1,t,t)',
          'claim: a duplicate reports the stored hash and the stored handler version, not its own');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'tap-c'), 1, 'claim: a duplicate writes no row');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine WHERE consumer = 'tap-c'), 0,
          'claim: a duplicate is not quarantined');

INSERT INTO res SELECT 'conflict', c.* FROM inbox.claim('tap-c', 'p', 'm1', '{"a": 2, "b": "x"}', 'v2') c;
SELECT is((SELECT outcome FROM res WHERE step = 'conflict'), 'conflict',
          'claim: the same identity with a different payload is a conflict');
SELECT is((SELECT (payload_sha256, stored_sha256, reason_code, handler_version)::text FROM res WHERE step = 'conflict'),
          (pg_temp.hex('{"a": 2, "b": "x"}'), pg_temp.hex('{"a": 1, "b": "x"}'), 'identity_conflict', 'v1')::text,
          'claim: a conflict reports both hashes, reason identity_conflict and the stored handler version');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id
            WHERE r.step = 'conflict'), 1, 'claim: the conflict''s quarantine_id names an entry');
SELECT is((SELECT (q.consumer, q.tenant, q.producer, q.message_id, q.kind, q.status, q.deliveries, q.reason_code)::text
             FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id WHERE r.step = 'conflict'),
          '(tap-c,"",p,m1,conflict,open,1,identity_conflict)',
          'claim: the conflict entry is an open entry of kind conflict for the identity');
SELECT is((SELECT (q.payload_sha256 = inbox.payload_hash('{"a": 2, "b": "x"}'),
                   q.stored_sha256 = inbox.payload_hash('{"a": 1, "b": "x"}'), q.payload = '{"a": 2, "b": "x"}',
                   q.payload_bytes IS NULL, q.handler_version)::text
             FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id WHERE r.step = 'conflict'),
          '(t,t,t,t,v1)', 'claim: the conflict entry keeps both hashes and the conflicting payload');
SELECT is((SELECT q.error_message FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id
            WHERE r.step = 'conflict'),
          format('message id was processed with payload hash %s; this delivery has %s',
                 pg_temp.hex('{"a": 1, "b": "x"}'), pg_temp.hex('{"a": 2, "b": "x"}')),
          'claim: the conflict entry explains itself');
SELECT is((SELECT (status, payload_sha256 = inbox.payload_hash('{"a": 1, "b": "x"}'), handler_version)::text
             FROM inbox.message WHERE consumer = 'tap-c' AND message_id = 'm1'),
          '(processed,t,v1)', 'claim: a conflict leaves the processed claim row untouched');

INSERT INTO res SELECT 'conflict2', c.* FROM inbox.claim('tap-c', 'p', 'm1', '{"b": "x", "a": 2}', 'v2') c;
SELECT is((SELECT (outcome, quarantine_id = (SELECT quarantine_id FROM res WHERE step = 'conflict'))::text
             FROM res WHERE step = 'conflict2'), '(conflict,t)',
          'claim: a second delivery of the same conflicting payload names the same entry');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine WHERE consumer = 'tap-c'), 1,
          'claim: a second conflicting delivery adds no entry');
SELECT is((SELECT q.deliveries FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id
            WHERE r.step = 'conflict'), 2, 'claim: a second conflicting delivery increments deliveries');

INSERT INTO res SELECT 'conflict3', c.* FROM inbox.claim('tap-c', 'p', 'm1', '{"a": 3, "b": "x"}') c;
SELECT is((SELECT (outcome, quarantine_id <> (SELECT quarantine_id FROM res WHERE step = 'conflict'))::text
             FROM res WHERE step = 'conflict3'), '(conflict,t)',
          'claim: a conflict with yet another payload gets an entry of its own');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine WHERE consumer = 'tap-c'), 2,
          'claim: two different conflicting payloads, two entries');

-- The identity is (consumer, tenant, producer, message_id).
INSERT INTO res SELECT 'tenant', c.* FROM inbox.claim('tap-c', 'p', 'm1', '{"a": 9}', tenant => 't1') c;
SELECT is((SELECT outcome FROM res WHERE step = 'tenant'), 'claimed',
          'claim: tenant is part of the identity (same ids, other tenant: claimed)');
INSERT INTO res SELECT 'tenant-dup', c.* FROM inbox.claim('tap-c', 'p', 'm1', '{"a": 9}', tenant => 't1') c;
SELECT is((SELECT outcome FROM res WHERE step = 'tenant-dup'), 'duplicate', 'claim: tenant t1 sees its own duplicate');
INSERT INTO res SELECT 'consumer2', c.* FROM inbox.claim('tap-c2', 'p', 'm1', '{"a": 2, "b": "x"}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'consumer2'), 'claimed',
          'claim: two consumers are independent (the payload that conflicts for tap-c is new for tap-c2)');
INSERT INTO res SELECT 'producer2', c.* FROM inbox.claim('tap-c', 'p2', 'm1', '{"a": 2, "b": "x"}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'producer2'), 'claimed', 'claim: producer is part of the identity');
SELECT is((SELECT handler_version FROM res WHERE step = 'producer2'), 'unversioned',
          'claim: handler_version defaults to ''unversioned''');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE message_id = 'm1'), 4,
          'claim: four distinct identities share message_id m1');

-- Ids are compared byte for byte: case and trailing space make other identities.
INSERT INTO res SELECT 'case', c.* FROM inbox.claim('tap-c', 'p', 'M1', '{"a": 1, "b": "x"}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'case'), 'claimed', 'claim: message ids are case sensitive');

-- ================================================================== claim_bytea
INSERT INTO res SELECT 'bytea', c.* FROM inbox.claim_bytea('tap-c', 'p', 'b1', '\x00ff10'::bytea, 'v1') c;
SELECT is((SELECT (outcome, payload_sha256)::text FROM res WHERE step = 'bytea'),
          ('claimed', encode(sha256('\x00ff10'::bytea), 'hex'))::text,
          'claim_bytea: claimed, the hash is SHA-256 of the raw bytes');
INSERT INTO res SELECT 'bytea-dup', c.* FROM inbox.claim_bytea('tap-c', 'p', 'b1', '\x00ff10'::bytea, 'v1') c;
SELECT is((SELECT outcome FROM res WHERE step = 'bytea-dup'), 'duplicate', 'claim_bytea: the same bytes are a duplicate');
INSERT INTO res SELECT 'bytea-conflict', c.* FROM inbox.claim_bytea('tap-c', 'p', 'b1', '\x00ff11'::bytea, 'v1') c;
SELECT is((SELECT outcome FROM res WHERE step = 'bytea-conflict'), 'conflict', 'claim_bytea: other bytes are a conflict');
SELECT is((SELECT (q.kind, q.payload IS NULL, q.payload_bytes = '\x00ff11'::bytea, q.stored_sha256 = sha256('\x00ff10'::bytea))::text
             FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id WHERE r.step = 'bytea-conflict'),
          '(conflict,t,t,t)', 'claim_bytea: the conflict entry keeps the conflicting bytes in payload_bytes');
-- Raw bytes are not canonicalised: the same JSON with other whitespace conflicts.
INSERT INTO res SELECT 'bytea-json1', c.* FROM inbox.claim_bytea('tap-c', 'p', 'b2', convert_to('{"a":1}', 'UTF8')) c;
INSERT INTO res SELECT 'bytea-json2', c.* FROM inbox.claim_bytea('tap-c', 'p', 'b2', convert_to('{"a": 1}', 'UTF8')) c;
SELECT is((SELECT outcome FROM res WHERE step = 'bytea-json2'), 'conflict',
          'claim_bytea: bytes are hashed as they are, whitespace included');

-- ================================================================== claim: validation, nothing written
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($$SELECT inbox.claim(NULL, 'p', 'mv', '{}')$$, '22004', 'inbox.claim: consumer must not be NULL',
                 'claim: NULL consumer is 22004');
SELECT throws_ok($$SELECT inbox.claim('tap-v', NULL, 'mv', '{}')$$, '22004', 'inbox.claim: producer must not be NULL',
                 'claim: NULL producer is 22004');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', NULL, '{}')$$, '22004', 'inbox.claim: message_id must not be NULL',
                 'claim: NULL message_id is 22004');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', 'mv', '{}', 'v1', NULL)$$, '22004',
                 'inbox.claim: tenant must not be NULL', 'claim: NULL tenant is 22004');
SELECT throws_ok($$SELECT inbox.claim('', 'p', 'mv', '{}')$$, '22023', 'inbox.claim: consumer must not be empty',
                 'claim: empty consumer is 22023');
SELECT throws_ok($$SELECT inbox.claim('tap-v', '', 'mv', '{}')$$, '22023', 'inbox.claim: producer must not be empty',
                 'claim: empty producer is 22023');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', '', '{}')$$, '22023', 'inbox.claim: message_id must not be empty',
                 'claim: empty message_id is 22023');
SELECT throws_ok($$SELECT inbox.claim(repeat('c', 129), 'p', 'mv', '{}')$$, '22001',
                 'inbox.claim: consumer is longer than 128 bytes', 'claim: a consumer of 129 bytes is 22001');
SELECT throws_ok($$SELECT inbox.claim('tap-v', repeat('p', 129), 'mv', '{}')$$, '22001',
                 'inbox.claim: producer is longer than 128 bytes', 'claim: a producer of 129 bytes is 22001');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', 'mv', '{}', tenant => repeat('t', 129))$$, '22001',
                 'inbox.claim: tenant is longer than 128 bytes', 'claim: a tenant of 129 bytes is 22001');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', repeat('m', 257), '{}')$$, '22001',
                 'inbox.claim: message_id is 257 bytes long, the limit is 256', 'claim: a message_id of 257 bytes is 22001');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', repeat('ü', 129), '{}')$$, '22001',
                 'inbox.claim: message_id is 258 bytes long, the limit is 256',
                 'claim: the message_id limit counts bytes (129 two-byte characters)');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', 'mv', NULL)$$, '22004', 'inbox.claim: payload must not be NULL',
                 'claim: NULL payload is 22004');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', 'mv', '{}', NULL)$$, '22004',
                 'inbox.claim: handler_version must not be NULL or empty', 'claim: NULL handler_version is 22004');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', 'mv', '{}', '')$$, '22023',
                 'inbox.claim: handler_version must not be NULL or empty', 'claim: empty handler_version is 22023');
SELECT throws_ok($$SELECT inbox.claim('tap-v', 'p', 'mv', '{}', repeat('v', 129))$$, '22001',
                 'inbox.claim: handler_version is longer than 128 bytes', 'claim: a handler_version of 129 bytes is 22001');
SELECT throws_ok(format($$SELECT inbox.claim('tap-v', 'p', 'mv', %L::jsonb)$$, jsonb_build_object('k', repeat('x', 1048576))),
                 '54000',
                 format('inbox.claim: payload is %s bytes, the consumer''s limit is 1048576 bytes',
                        octet_length((jsonb_build_object('k', repeat('x', 1048576)))::text)),
                 'claim: a payload over the default 1 MiB limit is 54000');
SELECT throws_ok($$SELECT inbox.claim_bytea(NULL, 'p', 'mv', '\x00')$$, '22004',
                 'inbox.claim_bytea: consumer must not be NULL', 'claim_bytea: NULL consumer is 22004');
SELECT throws_ok($$SELECT inbox.claim_bytea('tap-v', 'p', '', '\x00')$$, '22023',
                 'inbox.claim_bytea: message_id must not be empty', 'claim_bytea: empty message_id is 22023');
SELECT throws_ok($$SELECT inbox.claim_bytea('tap-v', 'p', 'mv', NULL)$$, '22004',
                 'inbox.claim_bytea: payload must not be NULL', 'claim_bytea: NULL payload is 22004');
SELECT throws_ok($$SELECT inbox.claim_bytea('tap-v', 'p', 'mv', '\x00', '')$$, '22023',
                 'inbox.claim_bytea: handler_version must not be NULL or empty', 'claim_bytea: empty handler_version is 22023');
SELECT throws_ok($$SELECT inbox.claim_bytea('tap-v', 'p', 'mv', decode(repeat('00', 1048577), 'hex'))$$, '54000',
                 'inbox.claim_bytea: payload is 1048577 bytes, the consumer''s limit is 1048576 bytes',
                 'claim_bytea: 1 MiB + 1 byte is 54000');
SELECT is(public.tap_writes(), :w0::bigint, 'claim, claim_bytea: none of the rejected calls above tried to write anything');

SELECT lives_ok($$SELECT inbox.claim(repeat('c', 128), repeat('p', 128), repeat('m', 256), '{}', repeat('v', 128),
                                     repeat('t', 128))$$,
                'claim: names of exactly 128 bytes and a message_id of exactly 256 bytes are accepted');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE message_id = repeat('m', 256)), 1,
          'claim: the 256-byte message_id was claimed');
SELECT lives_ok($$SELECT inbox.claim_bytea('tap-v', 'p', 'mbig', decode(repeat('00', 1048576), 'hex'))$$,
                'claim_bytea: exactly 1 MiB is accepted');
INSERT INTO res SELECT 'json-null', c.* FROM inbox.claim('tap-v', 'p', 'mnull', 'null') c;
SELECT is((SELECT outcome FROM res WHERE step = 'json-null'), 'claimed', 'claim: a JSON null payload is a payload');

-- ================================================================== configure_consumer
SELECT has_function('inbox', 'configure_consumer', ARRAY['text', 'text[]', 'integer', 'boolean', 'integer', 'boolean'],
                    'inbox.configure_consumer(text, text[], integer, boolean, integer, boolean) exists');
SELECT is((SELECT (c.consumer, c.hash_exclude_keys, c.max_attempts, c.store_payloads, c.max_payload_bytes,
                   c.updated_by = session_user, c.updated_at = now())::text
             FROM inbox.configure_consumer('tap-defaults') c),
          '(tap-defaults,{},5,t,1048576,t,t)', 'configure_consumer: returns the saved row, stamped with session_user');
INSERT INTO inbox.consumer_config (consumer) VALUES ('tap-coldefaults');
SELECT is((SELECT (hash_exclude_keys, max_attempts, store_payloads, max_payload_bytes)::text
             FROM inbox.consumer_config WHERE consumer = 'tap-defaults'),
          (SELECT (hash_exclude_keys, max_attempts, store_payloads, max_payload_bytes)::text
             FROM inbox.consumer_config WHERE consumer = 'tap-coldefaults'),
          'configure_consumer: its argument defaults equal the column defaults');

SELECT is((SELECT (c.hash_exclude_keys, c.max_attempts, c.store_payloads, c.max_payload_bytes)::text
             FROM inbox.configure_consumer('tap-cfg', '{trace_id,sent_at}', 3, false, 200) c),
          '("{sent_at,trace_id}",3,f,200)', 'configure_consumer: stores the settings (keys as a sorted set)');
SELECT is((SELECT count(*)::integer FROM inbox.consumer_config WHERE consumer = 'tap-cfg'), 1,
          'configure_consumer: one row per consumer');

INSERT INTO res SELECT 'x1', c.* FROM inbox.claim('tap-cfg', 'p', 'x1', '{"a": 1, "trace_id": "t-1", "sent_at": 1}') c;
INSERT INTO res SELECT 'x2', c.* FROM inbox.claim('tap-cfg', 'p', 'x1', '{"a": 1, "trace_id": "t-2"}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'x2'), 'duplicate',
          'hash_exclude_keys: a redelivery with another trace id (and no sent_at) is a duplicate');
SELECT is((SELECT payload_sha256 FROM res WHERE step = 'x1'), pg_temp.hex('{"a": 1}'),
          'hash_exclude_keys: the hash leaves the excluded keys out');
INSERT INTO res SELECT 'x3', c.* FROM inbox.claim('tap-cfg', 'p', 'x1', '{"a": 2, "trace_id": "t-1"}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'x3'), 'conflict', 'hash_exclude_keys: a changed kept key is a conflict');
SELECT is((SELECT q.payload IS NULL FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id
            WHERE r.step = 'x3'), true, 'store_payloads false: the conflict entry keeps no payload');
SELECT is((SELECT q.payload_sha256 = inbox.payload_hash('{"a": 2}') FROM inbox.quarantine q
             JOIN res r ON r.quarantine_id = q.quarantine_id WHERE r.step = 'x3'), true,
          'store_payloads false: the conflict entry still keeps the hash');

SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($$SELECT inbox.claim('tap-cfg', 'p', 'x-big', jsonb_build_object('k', repeat('x', 300)))$$, '54000',
                 format('inbox.claim: payload is %s bytes, the consumer''s limit is 200 bytes',
                        octet_length((jsonb_build_object('k', repeat('x', 300)))::text)),
                 'max_payload_bytes: a payload over the consumer''s limit is 54000');
SELECT throws_ok($$SELECT inbox.claim_bytea('tap-cfg', 'p', 'x-big', decode(repeat('00', 201), 'hex'))$$, '54000',
                 'inbox.claim_bytea: payload is 201 bytes, the consumer''s limit is 200 bytes',
                 'max_payload_bytes: claim_bytea over the consumer''s limit is 54000');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-cfg', '{trace_id}', 3, false, 200)$$, '55000',
                 'inbox.configure_consumer: consumer tap-cfg already processed messages under other hash_exclude_keys',
                 'configure_consumer: changing hash_exclude_keys once messages exist is 55000');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-cfg', '{}')$$, '55000',
                 'inbox.configure_consumer: consumer tap-cfg already processed messages under other hash_exclude_keys',
                 'configure_consumer: dropping all hash_exclude_keys once messages exist is 55000');
SELECT throws_ok($$SELECT inbox.configure_consumer(NULL)$$, '22004', 'inbox.configure_consumer: consumer must not be NULL',
                 'configure_consumer: NULL consumer is 22004');
SELECT throws_ok($$SELECT inbox.configure_consumer('')$$, '22023', 'inbox.configure_consumer: consumer must not be empty',
                 'configure_consumer: empty consumer is 22023');
SELECT throws_ok($$SELECT inbox.configure_consumer(repeat('c', 129))$$, '22001',
                 'inbox.configure_consumer: consumer is longer than 128 bytes', 'configure_consumer: a consumer of 129 bytes is 22001');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-new', allow_hash_change => NULL)$$, '22004',
                 'inbox.configure_consumer: allow_hash_change must not be NULL',
                 'configure_consumer: NULL allow_hash_change is 22004');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-new', ARRAY['a', NULL])$$, '22023',
                 'inbox.configure_consumer: hash_exclude_keys must not contain NULL or empty keys',
                 'configure_consumer: a NULL key in hash_exclude_keys is 22023');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-new', ARRAY['a', ''])$$, '22023',
                 'inbox.configure_consumer: hash_exclude_keys must not contain NULL or empty keys',
                 'configure_consumer: an empty key in hash_exclude_keys is 22023');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-new', max_attempts => 0)$$, '22023',
                 'inbox.configure_consumer: max_attempts must be between 1 and 1000, got 0',
                 'configure_consumer: max_attempts 0 is 22023');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-new', max_attempts => 1001)$$, '22023',
                 'inbox.configure_consumer: max_attempts must be between 1 and 1000, got 1001',
                 'configure_consumer: max_attempts 1001 is 22023');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-new', max_payload_bytes => 0)$$, '22023',
                 'inbox.configure_consumer: max_payload_bytes must be between 1 and 104857600, got 0',
                 'configure_consumer: max_payload_bytes 0 is 22023');
SELECT throws_ok($$SELECT inbox.configure_consumer('tap-new', max_payload_bytes => 104857601)$$, '22023',
                 'inbox.configure_consumer: max_payload_bytes must be between 1 and 104857600, got 104857601',
                 'configure_consumer: max_payload_bytes 100 MiB + 1 is 22023');
SELECT is(public.tap_writes(), :w0::bigint, 'configure_consumer, claim: none of the rejected calls above tried to write');

SELECT lives_ok($$SELECT inbox.configure_consumer('tap-cfg', '{sent_at,trace_id}', 4, false, 200)$$,
                'configure_consumer: the same hash_exclude_keys in another order is no change');
SELECT is((SELECT max_attempts FROM inbox.consumer_config WHERE consumer = 'tap-cfg'), 4,
          'configure_consumer: other settings change while messages exist');
-- An argument left out keeps the current value: configuring one setting touches no other.
SELECT is((SELECT (hash_exclude_keys, max_attempts, store_payloads, max_payload_bytes)::text
             FROM inbox.configure_consumer('tap-cfg', max_attempts => 7)),
          '("{sent_at,trace_id}",7,f,200)', 'configure_consumer: omitted settings keep their current values');
SELECT is((SELECT (hash_exclude_keys, max_attempts, store_payloads, max_payload_bytes)::text
             FROM inbox.configure_consumer('tap-brand-new', store_payloads => false)),
          '({},5,f,1048576)', 'configure_consumer: a new consumer gets the defaults for omitted settings');
SELECT lives_ok($$SELECT inbox.configure_consumer('tap-cfg', '{trace_id}', 4, false, 200, allow_hash_change => true)$$,
                'configure_consumer: allow_hash_change => true permits the change');
SELECT is((SELECT hash_exclude_keys FROM inbox.consumer_config WHERE consumer = 'tap-cfg'), '{trace_id}'::text[],
          'configure_consumer: the new hash_exclude_keys are stored');
INSERT INTO res SELECT 'x4', c.* FROM inbox.claim('tap-cfg', 'p', 'x1', '{"a": 1, "trace_id": "t-3", "sent_at": 2}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'x4'), 'conflict',
          'configure_consumer: after an allowed hash change, an old redelivery hashes differently (conflict), as warned');
SELECT lives_ok($$SELECT inbox.configure_consumer('tap-fresh', '{a}'); SELECT inbox.configure_consumer('tap-fresh', '{b}')$$,
                'configure_consumer: hash_exclude_keys change freely while the consumer has no messages');
SELECT lives_ok($$SELECT inbox.configure_consumer('tap-bounds', max_attempts => 1000, max_payload_bytes => 104857600);
                  SELECT inbox.configure_consumer('tap-bounds', max_attempts => 1, max_payload_bytes => 1)$$,
                'configure_consumer: the bounds 1..1000 and 1..104857600 are inclusive');

-- The limit is on the length of the payload's JSON text (documented; since 0.2.0: pg_column_size
-- was the stored size, compressed for a value read from a table). Exactly max_payload_bytes passes.
SELECT inbox.configure_consumer('tap-size', max_payload_bytes => octet_length('{"k": "aaaaaaaaaaaaaaaaaaaaaa"}'::jsonb::text)) \g /dev/null
SELECT lives_ok($$SELECT inbox.claim('tap-size', 'p', 's1', '{"k": "aaaaaaaaaaaaaaaaaaaaaa"}')$$,
                'max_payload_bytes: a payload of exactly the limit (its JSON text) is accepted');
SELECT throws_ok($$SELECT inbox.claim('tap-size', 'p', 's2', '{"k": "aaaaaaaaaaaaaaaaaaaaaaa"}')$$, '54000', NULL,
                 'max_payload_bytes: one byte over the limit is 54000');

-- ================================================================== record_failure
SELECT inbox.configure_consumer('tap-rf', max_attempts => 3) \g /dev/null
INSERT INTO res SELECT 'rf1', c.* FROM inbox.record_failure('tap-rf', 'p', 'f1', '{"n": 1}', 'P0001', 'boom 1', 'v1',
                                                           message_type => 'order') c;
SELECT is((SELECT (outcome, attempts, reason_code, error_message, handler_version, payload_sha256 = pg_temp.hex('{"n": 1}'),
                   quarantine_id IS NULL)::text FROM res WHERE step = 'rf1'),
          '(failed,1,P0001,"boom 1",v1,t,t)', 'record_failure: first failure: failed, attempts 1');
SELECT is((SELECT (started, failed, reason_code, error_message, handler_version, message_type,
                   payload_sha256 = inbox.payload_hash('{"n": 1}'), first_failure_at = now(), last_failure_at = now())::text
             FROM inbox.attempt WHERE consumer = 'tap-rf' AND message_id = 'f1'),
          '(0,1,P0001,"boom 1",v1,order,t,t,t)', 'record_failure: the attempt row records the failure');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'tap-rf'), 0,
          'record_failure: a failure below the limit writes no claim row');
INSERT INTO res SELECT 'rf2', c.* FROM inbox.record_failure('tap-rf', 'p', 'f1', '{"n": 1}', 'my_code', 'boom 2', 'v2') c;
SELECT is((SELECT (outcome, attempts, reason_code)::text FROM res WHERE step = 'rf2'), '(failed,2,my_code)',
          'record_failure: second failure: attempts 2, the reason is the latest');
SELECT is((SELECT (failed, reason_code, error_message, handler_version, message_type)::text
             FROM inbox.attempt WHERE consumer = 'tap-rf' AND message_id = 'f1'),
          '(2,my_code,"boom 2",v2,order)', 'record_failure: the attempt row keeps the latest failure and the message type');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine WHERE consumer = 'tap-rf'), 0,
          'record_failure: nothing is quarantined below max_attempts');
INSERT INTO res SELECT 'rf3', c.* FROM inbox.record_failure('tap-rf', 'p', 'f1', '{"n": 1}', 'my_code', 'boom 3', 'v2') c;
SELECT is((SELECT (outcome, attempts, reason_code, quarantine_id IS NOT NULL)::text FROM res WHERE step = 'rf3'),
          '(quarantined,3,my_code,t)', 'record_failure: at max_attempts the outcome is quarantined');
SELECT is((SELECT (q.kind, q.status, q.reason_code, q.error_message, q.attempts, q.crashes, q.deliveries, q.message_type,
                   q.payload, q.handler_version, q.payload_sha256 = inbox.payload_hash('{"n": 1}'))::text
             FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id WHERE r.step = 'rf3'),
          '(failure,open,my_code,"boom 3",3,0,1,order,"{""n"": 1}",v2,t)',
          'record_failure: the failure entry holds reason, attempts, message type and payload');
SELECT is((SELECT (status, payload_sha256 = inbox.payload_hash('{"n": 1}'), handler_version)::text
             FROM inbox.message WHERE consumer = 'tap-rf' AND message_id = 'f1'),
          '(quarantined,t,v2)', 'record_failure: a placeholder claim row with status quarantined holds the identity');
INSERT INTO res SELECT 'rf-claim', c.* FROM inbox.claim('tap-rf', 'p', 'f1', '{"n": 1}') c;
SELECT is((SELECT (outcome, quarantine_id = (SELECT quarantine_id FROM res WHERE step = 'rf3'), attempts, reason_code)::text
             FROM res WHERE step = 'rf-claim'), '(quarantined,t,3,my_code)',
          'record_failure: a later claim of a quarantined identity is quarantined, naming the entry');
SELECT is((SELECT q.deliveries FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id WHERE r.step = 'rf3'),
          2, 'record_failure: the later claim increments deliveries');
INSERT INTO res SELECT 'rf-claim2', c.* FROM inbox.claim('tap-rf', 'p', 'f1', '{"n": 2}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'rf-claim2'), 'quarantined',
          'record_failure: a quarantined identity stays quarantined whatever the payload');
INSERT INTO res SELECT 'rf4', c.* FROM inbox.record_failure('tap-rf', 'p', 'f1', '{"n": 1}', 'my_code', 'boom 4', 'v2') c;
SELECT is((SELECT (outcome, attempts, quarantine_id = (SELECT quarantine_id FROM res WHERE step = 'rf3'))::text
             FROM res WHERE step = 'rf4'), '(quarantined,4,t)',
          'record_failure: a failure recorded after quarantine stays on the same entry');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine WHERE consumer = 'tap-rf'), 1,
          'record_failure: still one quarantine entry');

-- A payload that cannot be represented as jsonb is allowed (NULL): the entry has no payload.
INSERT INTO res SELECT 'rf-null', c.* FROM inbox.record_failure('tap-rf', 'p', 'f2', NULL, 'X1', NULL,
                                                               payload_ref => 's3://bucket/f2') c;
SELECT is((SELECT (outcome, attempts, payload_sha256 IS NULL)::text FROM res WHERE step = 'rf-null'), '(failed,1,t)',
          'record_failure: a NULL payload is accepted and has no hash');
INSERT INTO res SELECT 'rf-long', c.* FROM inbox.record_failure('tap-rf', 'p', 'f3', '{}', 'X1', repeat('e', 5000)) c;
SELECT is((SELECT length(error_message) FROM res WHERE step = 'rf-long'), 2000,
          'record_failure: error_message is cut to 2000 characters');

-- A failure recorded for an identity that was processed meanwhile never quarantines it.
SELECT inbox.claim('tap-rf', 'p', 'f4', '{}') \g /dev/null
SELECT inbox.record_failure('tap-rf', 'p', 'f4', '{}', 'X1') \g /dev/null
SELECT inbox.record_failure('tap-rf', 'p', 'f4', '{}', 'X1') \g /dev/null
INSERT INTO res SELECT 'rf-processed', c.* FROM inbox.record_failure('tap-rf', 'p', 'f4', '{}', 'X1') c;
SELECT is((SELECT (outcome, attempts, quarantine_id IS NULL)::text FROM res WHERE step = 'rf-processed'), '(failed,3,t)',
          'record_failure: at max_attempts on a processed identity: failed, not quarantined');
SELECT is((SELECT status FROM inbox.message WHERE consumer = 'tap-rf' AND message_id = 'f4'), 'processed',
          'record_failure: the processed identity stays processed');

SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', 'f9', '{}', NULL)$$, '22004',
                 'inbox.record_failure: reason_code must be a stable code of 1 to 64 bytes, got NULL',
                 'record_failure: NULL reason_code is 22004');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', 'f9', '{}', '')$$, '22023',
                 'inbox.record_failure: reason_code must be a stable code of 1 to 64 bytes, got ''''',
                 'record_failure: empty reason_code is 22023');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', 'f9', '{}', repeat('r', 65))$$, '22023',
                 format('inbox.record_failure: reason_code must be a stable code of 1 to 64 bytes, got %L', repeat('r', 65)),
                 'record_failure: a reason_code of 65 bytes is 22023');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', 'f9', '{}', 'X1', message_type => '')$$, '22023',
                 'inbox.record_failure: message_type must be NULL or a name of 1 to 128 bytes, not only whitespace, without control characters',
                 'record_failure: an empty message_type is 22023');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', 'f9', '{}', 'X1', message_type => repeat('t', 129))$$,
                 '22001', 'inbox.record_failure: message_type must be NULL or a name of 1 to 128 bytes, not only whitespace, without control characters',
                 'record_failure: a message_type of 129 bytes is 22001');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', 'f9', '{}', 'X1', payload_ref => repeat('r', 1025))$$,
                 '22001', 'inbox.record_failure: payload_ref is longer than 1024 bytes',
                 'record_failure: a payload_ref of 1025 bytes is 22001');
SELECT throws_ok($$SELECT inbox.record_start('tap-rf', 'p', 'f9', message_type => '')$$, '22023',
                 'inbox.record_start: message_type must be NULL or a name of 1 to 128 bytes, not only whitespace, without control characters',
                 'record_start: an empty message_type is 22023');
SELECT throws_ok($$SELECT inbox.record_start('tap-rf', 'p', 'f9', payload_ref => repeat('r', 1025))$$, '22001',
                 'inbox.record_start: payload_ref is longer than 1024 bytes',
                 'record_start: a payload_ref of 1025 bytes is 22001');
SELECT throws_ok($$SELECT inbox.record_failure(NULL, 'p', 'f9', '{}', 'X1')$$, '22004',
                 'inbox.record_failure: consumer must not be NULL', 'record_failure: NULL consumer is 22004');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', '', '{}', 'X1')$$, '22023',
                 'inbox.record_failure: message_id must not be empty', 'record_failure: empty message_id is 22023');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', repeat('m', 257), '{}', 'X1')$$, '22001',
                 'inbox.record_failure: message_id is 257 bytes long, the limit is 256',
                 'record_failure: a message_id of 257 bytes is 22001');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', 'f9', '{}', 'X1', 'e', NULL)$$, '22004',
                 'inbox.record_failure: handler_version must not be NULL or empty',
                 'record_failure: NULL handler_version is 22004');
SELECT throws_ok($$SELECT inbox.record_failure('tap-rf', 'p', 'f9', '{}', 'X1', 'e', '')$$, '22023',
                 'inbox.record_failure: handler_version must not be NULL or empty',
                 'record_failure: empty handler_version is 22023');
SELECT throws_ok($$SELECT inbox.record_failure('tap-cfg', 'p', 'f9', jsonb_build_object('k', repeat('x', 300)), 'X1')$$,
                 '54000', format('inbox.record_failure: payload is %s bytes, the consumer''s limit is 200 bytes',
                                 octet_length((jsonb_build_object('k', repeat('x', 300)))::text)),
                 'record_failure: a payload over the consumer''s limit is 54000');
SELECT is(public.tap_writes(), :w0::bigint, 'record_failure: none of the rejected calls above tried to write');

-- ================================================================== record_start: crash loops
SELECT inbox.configure_consumer('tap-rs', max_attempts => 3) \g /dev/null
INSERT INTO res SELECT 'rs1', c.* FROM inbox.record_start('tap-rs', 'p', 'r1', message_type => 'order',
                                                         payload => '{"r": 1}', handler_version => 'v1') c;
SELECT is((SELECT (outcome, attempts, quarantine_id IS NULL, reason_code IS NULL, payload_sha256 = pg_temp.hex('{"r": 1}'))::text
             FROM res WHERE step = 'rs1'), '(proceed,1,t,t,t)',
          'record_start: first redelivery: proceed, 1 attempt so far (the first delivery)');
SELECT is((SELECT (started, failed, last_started_at = now(), message_type)::text
             FROM inbox.attempt WHERE consumer = 'tap-rs' AND message_id = 'r1'),
          '(1,0,t,order)', 'record_start: counts a started attempt');
INSERT INTO res SELECT 'rs2', c.* FROM inbox.record_start('tap-rs', 'p', 'r1', payload => '{"r": 1}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'rs2'), 'proceed',
          'record_start: second redelivery (started 2 < max_attempts 3): proceed');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine WHERE consumer = 'tap-rs'), 0,
          'record_start: nothing quarantined below the limit');
INSERT INTO res SELECT 'rs3', c.* FROM inbox.record_start('tap-rs', 'p', 'r1', payload => '{"r": 1}') c;
SELECT is((SELECT (outcome, reason_code, attempts, quarantine_id IS NOT NULL)::text FROM res WHERE step = 'rs3'),
          '(quarantined,crash_loop,3,t)',
          'record_start: once started reaches max_attempts without failures: quarantined, reason crash_loop, 3 attempts so far');
SELECT is((SELECT error_message FROM res WHERE step = 'rs3'),
          '3 attempts so far, 0 recorded a failure: the others ended without a word (the consumer probably crashed)',
          'record_start: the crash loop explains itself');
SELECT is((SELECT (q.kind, q.status, q.reason_code, q.attempts, q.crashes, q.message_type, q.payload)::text
             FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id WHERE r.step = 'rs3'),
          '(failure,open,crash_loop,0,3,order,"{""r"": 1}")', 'record_start: the crash-loop entry counts 3 crashes');
SELECT is((SELECT status FROM inbox.message WHERE consumer = 'tap-rs' AND message_id = 'r1'), 'quarantined',
          'record_start: the crash-looping identity is held by a placeholder claim row');
INSERT INTO res SELECT 'rs-claim', c.* FROM inbox.claim('tap-rs', 'p', 'r1', '{"r": 1}') c;
SELECT is((SELECT (outcome, reason_code)::text FROM res WHERE step = 'rs-claim'), '(quarantined,crash_loop)',
          'record_start: a later claim of the crash-looping identity is quarantined');
INSERT INTO res SELECT 'rs4', c.* FROM inbox.record_start('tap-rs', 'p', 'r1', payload => '{"r": 1}') c;
SELECT is((SELECT (outcome, quarantine_id = (SELECT quarantine_id FROM res WHERE step = 'rs3'))::text
             FROM res WHERE step = 'rs4'), '(quarantined,t)', 'record_start: further redeliveries stay quarantined');

-- An identity held by quarantine keeps ONE open failure entry, whatever later redeliveries carry
-- (two open entries once made every claim of it fail with P0003).
SELECT inbox.configure_consumer('tap-2q', max_attempts => 1) \g /dev/null
SELECT inbox.record_failure('tap-2q', 'p', 'q1', '{"v": 1}', 'X1') \g /dev/null
SELECT inbox.record_start('tap-2q', 'p', 'q1', payload => '{"v": 2}') \g /dev/null
SELECT inbox.record_failure('tap-2q', 'p', 'q1', '{"v": 3}', 'X2') \g /dev/null
SELECT is((SELECT count(*)::integer FROM inbox.quarantine WHERE consumer = 'tap-2q' AND status = 'open'), 1,
          'quarantine: one open failure entry per identity, whatever later redeliveries carry');
SELECT is((SELECT (outcome, reason_code)::text FROM inbox.claim('tap-2q', 'p', 'q1', '{"v": 2}')), '(quarantined,X1)',
          'quarantine: a held identity claims as quarantined, with the reason it was held for');

-- Mixed: first delivery failed (recorded), second crashed, third failed (recorded): 3 attempts, 1 crash.
SELECT inbox.record_failure('tap-rs', 'p', 'r2', '{}', 'X1') \g /dev/null
SELECT inbox.record_start('tap-rs', 'p', 'r2') \g /dev/null
INSERT INTO res SELECT 'mix-start2', c.* FROM inbox.record_start('tap-rs', 'p', 'r2') c;
SELECT is((SELECT (outcome, attempts)::text FROM res WHERE step = 'mix-start2'), '(proceed,2)',
          'record_start: reports the attempts so far (first delivery + announced redeliveries)');
INSERT INTO res SELECT 'mix-fail', c.* FROM inbox.record_failure('tap-rs', 'p', 'r2', '{}', 'X1') c;
SELECT is((SELECT (outcome, attempts)::text FROM res WHERE step = 'mix-fail'), '(failed,2)',
          'record_start: started attempts do not count as failures');
INSERT INTO res SELECT 'mix-start3', c.* FROM inbox.record_start('tap-rs', 'p', 'r2') c;
SELECT is((SELECT (outcome, reason_code, attempts)::text FROM res WHERE step = 'mix-start3'), '(quarantined,crash_loop,3)',
          'record_start: 3 attempts (2 failed, 1 crashed) reach max_attempts 3');
SELECT is((SELECT (q.attempts, q.crashes)::text FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id
            WHERE r.step = 'mix-start3'), '(2,1)', 'record_start: the entry counts 2 failures and 1 crash');

-- A processed identity is never quarantined by record_start, however often it is announced.
SELECT inbox.claim('tap-rs', 'p', 'r3', '{}') \g /dev/null
SELECT inbox.record_start('tap-rs', 'p', 'r3') FROM generate_series(1, 4) \g /dev/null
INSERT INTO res SELECT 'rs-processed', c.* FROM inbox.record_start('tap-rs', 'p', 'r3') c;
SELECT is((SELECT (outcome, quarantine_id IS NULL)::text FROM res WHERE step = 'rs-processed'), '(proceed,t)',
          'record_start: on a processed identity (started 5 >= 3) the outcome stays proceed');
SELECT is((SELECT count(*)::integer FROM inbox.quarantine WHERE consumer = 'tap-rs' AND message_id = 'r3'), 0,
          'record_start: no quarantine entry for a processed identity');
SELECT is((SELECT status FROM inbox.message WHERE consumer = 'tap-rs' AND message_id = 'r3'), 'processed',
          'record_start: the processed identity stays processed');
INSERT INTO res SELECT 'rs-processed-claim', c.* FROM inbox.claim('tap-rs', 'p', 'r3', '{}') c;
SELECT is((SELECT outcome FROM res WHERE step = 'rs-processed-claim'), 'duplicate',
          'record_start: the processed identity''s redelivery is still a duplicate');

-- max_attempts 1: the first announced redelivery already means one crashed attempt.
SELECT inbox.configure_consumer('tap-rs1', max_attempts => 1) \g /dev/null
INSERT INTO res SELECT 'rs-max1', c.* FROM inbox.record_start('tap-rs1', 'p', 'r1') c;
SELECT is((SELECT outcome FROM res WHERE step = 'rs-max1'), 'quarantined',
          'record_start: with max_attempts 1 the first redelivery is quarantined');
SELECT is((SELECT q.payload_sha256 IS NULL FROM inbox.quarantine q JOIN res r ON r.quarantine_id = q.quarantine_id
            WHERE r.step = 'rs-max1'), true, 'record_start: without a payload the entry has no hash');

SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($$SELECT inbox.record_start(NULL, 'p', 'r9')$$, '22004', 'inbox.record_start: consumer must not be NULL',
                 'record_start: NULL consumer is 22004');
SELECT throws_ok($$SELECT inbox.record_start('tap-rs', NULL, 'r9')$$, '22004', 'inbox.record_start: producer must not be NULL',
                 'record_start: NULL producer is 22004');
SELECT throws_ok($$SELECT inbox.record_start('tap-rs', 'p', NULL)$$, '22004', 'inbox.record_start: message_id must not be NULL',
                 'record_start: NULL message_id is 22004');
SELECT throws_ok($$SELECT inbox.record_start('tap-rs', 'p', 'r9', NULL)$$, '22004', 'inbox.record_start: tenant must not be NULL',
                 'record_start: NULL tenant is 22004');
SELECT throws_ok($$SELECT inbox.record_start('tap-rs', 'p', '')$$, '22023', 'inbox.record_start: message_id must not be empty',
                 'record_start: empty message_id is 22023');
SELECT throws_ok($$SELECT inbox.record_start('tap-rs', repeat('p', 129), 'r9')$$, '22001',
                 'inbox.record_start: producer is longer than 128 bytes', 'record_start: a producer of 129 bytes is 22001');
SELECT throws_ok($$SELECT inbox.record_start('tap-rs', 'p', 'r9', handler_version => NULL)$$, '22004',
                 'inbox.record_start: handler_version must not be NULL or empty', 'record_start: NULL handler_version is 22004');
SELECT throws_ok($$SELECT inbox.record_start('tap-rs', 'p', 'r9', handler_version => '')$$, '22023',
                 'inbox.record_start: handler_version must not be NULL or empty', 'record_start: empty handler_version is 22023');
SELECT throws_ok($$SELECT inbox.record_start('tap-cfg', 'p', 'r9', payload => jsonb_build_object('k', repeat('x', 300)))$$,
                 '54000', format('inbox.record_start: payload is %s bytes, the consumer''s limit is 200 bytes',
                                 octet_length((jsonb_build_object('k', repeat('x', 300)))::text)),
                 'record_start: a payload over the consumer''s limit is 54000');
SELECT is(public.tap_writes(), :w0::bigint, 'record_start: none of the rejected calls above tried to write');

-- ================================================================== the consumer setting
-- The single paths set inbox.consumer and inbox.tenant in the query that authorizes; a check after
-- it that refuses raises, and the raise takes them back with the (sub)transaction.
SELECT is((SELECT current_setting('inbox.consumer') || '/' || current_setting('inbox.tenant')
             FROM inbox.claim('tap-guc', 'p', 'g1', '{}', tenant => 't1')),
          'tap-guc/t1', 'claim: sets inbox.consumer and inbox.tenant to the consumer and tenant claimed for');
DO $$
BEGIN
    PERFORM inbox.claim('tap-guc-2', 'p', 'g2', '{}', tenant => 't2', produced_at => now() + interval '1 day');
EXCEPTION WHEN datetime_field_overflow THEN
    NULL;
END
$$;
SELECT is(current_setting('inbox.consumer') || '/' || current_setting('inbox.tenant'), 'tap-guc/t1',
          'claim: refused after its authorizing query (produced_at), it leaves the settings as they were');
DO $$
BEGIN
    PERFORM inbox.claim_bytea('tap-guc-2', 'p', 'g3', '\x00', handler_version => ' ', tenant => 't2');
EXCEPTION WHEN invalid_parameter_value THEN
    NULL;
END
$$;
SELECT is(current_setting('inbox.consumer') || '/' || current_setting('inbox.tenant'), 'tap-guc/t1',
          'claim_bytea: refused after its authorizing query (handler_version), it leaves the settings as they were');

-- ================================================================== signatures and definers
SELECT is_definer('inbox', f, 'inbox.' || f || ' is SECURITY DEFINER (it writes owner-only tables)')
  FROM unnest(ARRAY['claim', 'claim_bytea', 'record_failure', 'record_start', 'configure_consumer']) f;
SELECT function_returns('inbox', 'claim', ARRAY['text', 'text', 'text', 'jsonb', 'text', 'text', 'timestamp with time zone'],
                        'inbox.delivery_result', 'inbox.claim returns inbox.delivery_result');
SELECT function_returns('inbox', 'claim_bytea', ARRAY['text', 'text', 'text', 'bytea', 'text', 'text', 'timestamp with time zone'],
                        'inbox.delivery_result', 'inbox.claim_bytea returns inbox.delivery_result');
SELECT isnt_definer('inbox', f, 'inbox.' || f || ' is not SECURITY DEFINER (internal, called by definers)')
  FROM unnest(ARRAY['_check_delivery', '_claim_core', '_quarantine_failure', '_record_failure_core', '_check_reason']) f;

SELECT * FROM finish();
ROLLBACK;
