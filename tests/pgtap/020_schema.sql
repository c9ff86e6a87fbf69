-- pgTAP: sql/020_schema.sql — schema, types, tables, keys; and the shared helpers of sql/030_claim.sql
-- (the semantic hash, identity checks, settings).
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(94);

-- ------------------------------------------------------------------ schema, tables, types
SELECT has_schema('inbox', 'schema inbox exists');
SELECT tables_are('inbox', ARRAY['consumer_config', 'handler', 'handler_registration', 'message', 'attempt',
                                 'quarantine', 'quarantine_decision', 'outbox', 'outbox_destination', 'outbox_redrive',
                                 'outbox_discard', 'outbox_fenced_report', 'outbox_waiter', 'retention_hold',
                                 'retention_policy', 'retention_policy_change', 'activity_gap', 'purge_state',
                                 'replay_plan', 'replay_item', 'replay_decision',
                                 'metric_config', 'metric_event', 'metric_total', 'metric_rollup_state',
                                 'consumer_binding', 'binding_change', 'security_settings', 'destination_binding',
                                 'operator_run', 'lock_salt', 'outbox_order_lock', 'watermark_change', 'repair_grant',
                                 'kafka_offset'],
                  'schema inbox has exactly the documented tables');
SELECT has_composite('inbox', 'delivery_result', 'type inbox.delivery_result exists');
SELECT has_composite('inbox', 'message_context', 'type inbox.message_context exists');
SELECT has_composite('inbox', '_handler_call', 'type inbox._handler_call exists');

SELECT results_eq(
    $$SELECT a.attname::text COLLATE "default", pg_catalog.format_type(a.atttypid, a.atttypmod)
        FROM pg_catalog.pg_attribute a
       WHERE a.attrelid = 'inbox.delivery_result'::regclass AND a.attnum > 0 AND NOT a.attisdropped
       ORDER BY a.attnum$$,
    $$VALUES ('outcome', 'text'), ('payload_sha256', 'text'), ('stored_sha256', 'text'), ('handler_version', 'text'),
             ('processed_at', 'timestamp with time zone'), ('quarantine_id', 'bigint'), ('attempts', 'integer'),
             ('reason_code', 'text'), ('error_message', 'text')$$,
    'inbox.delivery_result has the contract''s columns, in order, with their types');
SELECT results_eq(
    $$SELECT a.attname::text COLLATE "default", pg_catalog.format_type(a.atttypid, a.atttypmod)
        FROM pg_catalog.pg_attribute a
       WHERE a.attrelid = 'inbox.message_context'::regclass AND a.attnum > 0 AND NOT a.attisdropped
       ORDER BY a.attnum$$,
    $$VALUES ('tenant', 'text'), ('consumer', 'text'), ('producer', 'text'), ('message_id', 'text'),
             ('message_type', 'text'), ('produced_at', 'timestamp with time zone'), ('handler_version', 'text')$$,
    'inbox.message_context carries the identity, message type, produced_at and handler version');

SELECT columns_are('inbox', 'consumer_config',
    ARRAY['consumer', 'hash_exclude_keys', 'max_attempts', 'store_payloads', 'max_payload_bytes', 'updated_at',
          'updated_by', 'last_active_at', 'purge_watermark'], 'inbox.consumer_config columns');
SELECT columns_are('inbox', 'handler',
    ARRAY['consumer', 'message_type', 'handler', 'handler_version', 'takes_context', 'registered_at', 'registered_by'],
    'inbox.handler columns');
SELECT columns_are('inbox', 'handler_registration',
    ARRAY['registration_id', 'consumer', 'message_type', 'handler', 'handler_version', 'registered_at', 'registered_by'],
    'inbox.handler_registration columns');
SELECT columns_are('inbox', 'message',
    ARRAY['consumer', 'tenant', 'producer', 'message_id', 'payload_sha256', 'handler_version', 'status', 'produced_at',
          'received_at', 'processed_at'], 'inbox.message columns');
SELECT columns_are('inbox', 'attempt',
    ARRAY['consumer', 'tenant', 'producer', 'message_id', 'started', 'failed', 'last_started_at', 'first_failure_at',
          'last_failure_at', 'reason_code', 'error_message', 'handler_version', 'message_type', 'payload_sha256'],
    'inbox.attempt columns');
SELECT columns_are('inbox', 'quarantine',
    ARRAY['quarantine_id', 'consumer', 'tenant', 'producer', 'message_id', 'kind', 'message_type', 'payload_sha256',
          'stored_sha256', 'payload', 'payload_bytes', 'payload_ref', 'reason_code', 'error_message', 'attempts',
          'crashes', 'deliveries', 'first_failure_at', 'last_failure_at', 'handler_version', 'status', 'created_at',
          'last_seen_at', 'decided_at', 'decided_by', 'recorded_by', 'release_used_at'], 'inbox.quarantine columns');
SELECT columns_are('inbox', 'quarantine_decision',
    ARRAY['decision_id', 'quarantine_id', 'decision', 'result', 'decided_by', 'decided_at', 'note', 'reason_code',
          'error_message'], 'inbox.quarantine_decision columns');

SELECT col_type_is('inbox', 'message', 'payload_sha256', 'bytea', 'inbox.message.payload_sha256 is bytea');
SELECT col_type_is('inbox', 'handler', 'handler', 'regprocedure', 'handlers are stored as regprocedure');
SELECT col_type_is('inbox', 'quarantine', 'payload', 'jsonb', 'inbox.quarantine.payload is jsonb');
SELECT col_type_is('inbox', 'quarantine', 'payload_bytes', 'bytea', 'inbox.quarantine.payload_bytes is bytea');
SELECT col_not_null('inbox', 'message', c, 'inbox.message.' || c || ' is NOT NULL')
  FROM unnest(ARRAY['consumer', 'tenant', 'producer', 'message_id', 'payload_sha256', 'handler_version', 'status']) c;
SELECT col_default_is('inbox', 'message', 'status', 'processed', 'a claim row is processed by default');
SELECT col_not_null('inbox', 'quarantine_decision', 'note', 'every decision has a note');

-- ------------------------------------------------------------------ keys
-- The claim key is the concurrency control: INSERT ... ON CONFLICT ON CONSTRAINT message_pkey.
SELECT col_is_pk('inbox', 'message', ARRAY['message_id', 'consumer', 'tenant', 'producer'],
                 'the claim key is (message_id, consumer, tenant, producer): led by the column that tells identities apart');
SELECT ok(to_regclass('inbox.message_key_building') IS NULL, 'no half-built claim key is left behind');
SELECT index_is_primary('inbox', 'message', 'message_pkey', 'the claim key is the constraint message_pkey');
SELECT col_is_pk('inbox', 'attempt', ARRAY['consumer', 'tenant', 'producer', 'message_id'],
                 'inbox.attempt is keyed by the identity');
SELECT index_is_primary('inbox', 'attempt', 'attempt_pkey', 'inbox.attempt key is attempt_pkey');
SELECT col_is_pk('inbox', 'handler', ARRAY['consumer', 'message_type'], 'one handler per (consumer, message_type)');
SELECT index_is_primary('inbox', 'handler', 'handler_pkey', 'inbox.handler key is handler_pkey');
SELECT col_is_pk('inbox', 'consumer_config', 'consumer', 'one configuration row per consumer');
SELECT index_is_primary('inbox', 'consumer_config', 'consumer_config_pkey', 'inbox.consumer_config key is consumer_config_pkey');
SELECT col_is_pk('inbox', 'quarantine', 'quarantine_id', 'quarantine entries are keyed by quarantine_id');
SELECT col_is_pk('inbox', 'quarantine_decision', 'decision_id', 'decisions are keyed by decision_id');
SELECT col_is_pk('inbox', 'handler_registration', 'registration_id', 'registrations are keyed by registration_id');
SELECT col_is_unique('inbox', 'quarantine',
                     ARRAY['consumer', 'tenant', 'producer', 'message_id', 'kind', 'payload_sha256'],
                     'one quarantine entry per (identity, kind, payload hash)');
SELECT is((SELECT indnullsnotdistinct FROM pg_catalog.pg_index WHERE indexrelid = 'inbox.quarantine_entry_key'::regclass),
          true, 'quarantine_entry_key treats NULL payload hashes as equal (NULLS NOT DISTINCT)');
SELECT fk_ok('inbox', 'quarantine_decision', 'quarantine_id', 'inbox', 'quarantine', 'quarantine_id',
             'every decision refers to a quarantine entry');

-- CHECK constraints keep the status vocabularies closed (as superuser: the tables are owner-only).
-- (status may be a CHECK constraint or an enum: either way 'applied' is no status.)
SELECT throws_matching($$INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, status)
                         VALUES ('c', '', 'p', 'm', '\x00', 'v', 'applied')$$,
                       'violates check constraint|invalid input value for enum',
                       'inbox.message.status accepts only processed | quarantined | discarded');
SELECT lives_ok($$INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, status)
                  VALUES ('c', '', 'p', 'm1', '\x00', 'v', 'processed'), ('c', '', 'p', 'm2', '\x00', 'v', 'quarantined'),
                         ('c', '', 'p', 'm3', '\x00', 'v', 'discarded')$$,
                'inbox.message.status accepts processed, quarantined and discarded');
SELECT throws_ok($$INSERT INTO inbox.quarantine (consumer, tenant, producer, message_id, kind, reason_code, handler_version)
                   VALUES ('c', '', 'p', 'm', 'other', 'x', 'v')$$,
                 '23514', NULL, 'inbox.quarantine.kind accepts only conflict | failure');
SELECT throws_ok($$INSERT INTO inbox.consumer_config (consumer, max_attempts) VALUES ('c', 0)$$,
                 '23514', NULL, 'inbox.consumer_config.max_attempts must be at least 1');
SELECT throws_ok($$INSERT INTO inbox.consumer_config (consumer, max_payload_bytes) VALUES ('c', 0)$$,
                 '23514', NULL, 'inbox.consumer_config.max_payload_bytes must be at least 1');

-- ------------------------------------------------------------------ payload_hash
SELECT has_function('inbox', 'payload_hash', ARRAY['jsonb', 'text[]'], 'inbox.payload_hash(jsonb, text[]) exists');
-- STABLE and not STRICT on purpose (sql/020_schema.sql: so that the planner inlines it); NULL in, NULL out.
SELECT isnt((SELECT provolatile FROM pg_catalog.pg_proc WHERE oid = 'inbox.payload_hash(jsonb, text[])'::regprocedure),
            'v', 'payload_hash is not VOLATILE');
SELECT is(inbox.payload_hash(NULL), NULL, 'payload_hash(NULL) is NULL');
SELECT is(inbox.payload_hash(NULL, '{a}'), NULL, 'payload_hash(NULL, keys) is NULL');
SELECT is(inbox.payload_hash('{"a": 1}', NULL), inbox.payload_hash('{"a": 1}'),
          'payload_hash(payload, NULL) excludes nothing');

SELECT is(inbox.payload_hash('{"a": 1, "b": [1, 2, {"c": "x"}]}'),
          pg_catalog.sha256(pg_catalog.convert_to('{"a": 1, "b": [1, 2, {"c": "x"}]}', 'UTF8')),
          'payload_hash is SHA-256 of jsonb''s canonical text');
SELECT is(inbox.payload_hash('{"a":1,"b":2}'), inbox.payload_hash('{"b": 2, "a": 1}'),
          'key order does not change the hash');
SELECT is(inbox.payload_hash('{"a":1,"b":{"x":true,"y":null}}'),
          inbox.payload_hash(E'{\n  "b" : { "y" : null ,\t"x" : true },\n  "a" : 1\n}'),
          'whitespace and nested key order do not change the hash');
SELECT is(inbox.payload_hash('{"a": 1, "a": 2}'), inbox.payload_hash('{"a": 2}'),
          'a duplicated key hashes like its last value (jsonb keeps the last)');
SELECT isnt(inbox.payload_hash('{"a": 1}'), inbox.payload_hash('{"a": 2}'), 'a changed value changes the hash');
SELECT isnt(inbox.payload_hash('{"a": 1}'), inbox.payload_hash('{"a": "1"}'), 'a number and a string hash differently');
SELECT isnt(inbox.payload_hash('[1, 2]'), inbox.payload_hash('[2, 1]'), 'array order is significant');
SELECT isnt(inbox.payload_hash('{"a": 1}'), inbox.payload_hash('{"a": 1, "b": null}'),
            'an added key (even null) changes the hash');
-- Document-by-test: jsonb does not normalise number scale.
SELECT isnt(inbox.payload_hash('{"amount": 1.0}'), inbox.payload_hash('{"amount": 1.00}'),
            'number scale is not normalised: 1.0 and 1.00 hash differently');
SELECT isnt(inbox.payload_hash('{"amount": 1}'), inbox.payload_hash('{"amount": 1.0}'),
            'number scale is not normalised: 1 and 1.0 hash differently');
SELECT is(inbox.payload_hash('{"amount": 1e2}'), inbox.payload_hash('{"amount": 100}'),
          'exponent notation is normalised by numeric input: 1e2 hashes like 100');

SELECT is(inbox.payload_hash('{"a": 1, "trace_id": "t-1", "sent_at": "2020-01-01"}', '{trace_id,sent_at}'),
          inbox.payload_hash('{"a": 1}'), 'excluded top-level keys are left out of the hash');
SELECT is(inbox.payload_hash('{"a": 1, "trace_id": "t-1"}', '{trace_id}'),
          inbox.payload_hash('{"a": 1, "trace_id": "t-2"}', '{trace_id}'),
          'a different value under an excluded key does not change the hash');
SELECT isnt(inbox.payload_hash('{"a": 1, "trace_id": "t-1"}', '{trace_id}'),
            inbox.payload_hash('{"a": 2, "trace_id": "t-1"}', '{trace_id}'),
            'a different value under a kept key still changes the hash');
SELECT isnt(inbox.payload_hash('{"a": {"trace_id": 1}}', '{trace_id}'),
            inbox.payload_hash('{"a": {"trace_id": 2}}', '{trace_id}'),
            'exclusion applies to top-level keys only, not to nested ones');
SELECT is(inbox.payload_hash('{"a": 1}', '{}'), inbox.payload_hash('{"a": 1}'),
          'an empty exclusion list is the same as none');
SELECT is(inbox.payload_hash('["trace_id", "x"]', '{trace_id}'), inbox.payload_hash('["trace_id", "x"]'),
          'exclusion does not touch an array payload (jsonb - text[] would drop its string elements)');
SELECT is(inbox.payload_hash('"trace_id"', '{trace_id}'), inbox.payload_hash('"trace_id"'),
          'exclusion does not touch a string payload');
SELECT is(inbox.payload_hash('42', '{trace_id}'), inbox.payload_hash('42'),
          'exclusion does not touch a number payload');
SELECT is(inbox.payload_hash('{"a": "ü€"}'),
          pg_catalog.sha256(pg_catalog.convert_to('{"a": "ü€"}', 'UTF8')),
          'non-ASCII text is hashed as UTF-8');

-- ------------------------------------------------------------------ _settings and the column defaults
-- inbox._settings duplicates the column defaults of inbox.consumer_config for unconfigured consumers;
-- these tests keep the two in step.
INSERT INTO inbox.consumer_config (consumer) VALUES ('pgtap-defaults');
SELECT is((SELECT (s.hash_exclude_keys, s.max_attempts, s.store_payloads, s.max_payload_bytes)::text
             FROM inbox._settings('pgtap-unknown') s),
          (SELECT (c.hash_exclude_keys, c.max_attempts, c.store_payloads, c.max_payload_bytes)::text
             FROM inbox.consumer_config c WHERE c.consumer = 'pgtap-defaults'),
          '_settings of an unconfigured consumer equals the column defaults of inbox.consumer_config');
SELECT is((inbox._settings('pgtap-unknown')).consumer, 'pgtap-unknown', '_settings names the consumer it was asked for');
SELECT is((SELECT column_default::text FROM information_schema.columns
            WHERE table_schema = 'inbox' AND table_name = 'consumer_config' AND column_name = 'max_attempts'),
          (inbox._settings('pgtap-unknown')).max_attempts::text,
          '_settings max_attempts equals the column default in information_schema');
SELECT is((SELECT column_default::text FROM information_schema.columns
            WHERE table_schema = 'inbox' AND table_name = 'consumer_config' AND column_name = 'max_payload_bytes'),
          (inbox._settings('pgtap-unknown')).max_payload_bytes::text,
          '_settings max_payload_bytes equals the column default in information_schema');
SELECT is((SELECT column_default::text FROM information_schema.columns
            WHERE table_schema = 'inbox' AND table_name = 'consumer_config' AND column_name = 'store_payloads'),
          (inbox._settings('pgtap-unknown')).store_payloads::text,
          '_settings store_payloads equals the column default in information_schema');
SELECT is((SELECT column_default::text FROM information_schema.columns
            WHERE table_schema = 'inbox' AND table_name = 'consumer_config' AND column_name = 'hash_exclude_keys'),
          pg_catalog.quote_literal((inbox._settings('pgtap-unknown')).hash_exclude_keys) || '::text[]',
          '_settings hash_exclude_keys equals the column default in information_schema');
INSERT INTO inbox.consumer_config (consumer, max_attempts, max_payload_bytes, store_payloads, hash_exclude_keys)
VALUES ('pgtap-configured', 7, 4096, false, '{trace_id}');
SELECT is((SELECT (s.hash_exclude_keys, s.max_attempts, s.store_payloads, s.max_payload_bytes)::text
             FROM inbox._settings('pgtap-configured') s),
          '({trace_id},7,f,4096)', '_settings of a configured consumer returns its row');

-- ------------------------------------------------------------------ _check_identity
SELECT lives_ok($$SELECT inbox._check_identity('f', 'c', 'p', 'm', '')$$, '_check_identity accepts tenant ''''');
SELECT lives_ok($$SELECT inbox._check_identity('f', repeat('c', 128), repeat('p', 128), repeat('m', 256), repeat('t', 128))$$,
                '_check_identity accepts names of 128 bytes and a message_id of 256 bytes');
SELECT throws_ok($$SELECT inbox._check_identity('f', NULL, 'p', 'm', '')$$, '22004', 'f: consumer must not be NULL',
                 '_check_identity: NULL consumer');
SELECT throws_ok($$SELECT inbox._check_identity('f', 'c', 'p', 'm', NULL)$$, '22004', 'f: tenant must not be NULL',
                 '_check_identity: NULL tenant');
SELECT throws_ok($$SELECT inbox._check_identity('f', 'c', '', 'm', '')$$, '22023', 'f: producer must not be empty',
                 '_check_identity: empty producer');
SELECT throws_ok($$SELECT inbox._check_identity('f', 'c', 'p', repeat('é', 129), '')$$, '22001',
                 'f: message_id is 258 bytes long, the limit is 256', '_check_identity counts bytes, not characters');

-- ------------------------------------------------------------------ the rules: accept test and faults agree
-- Each rule is an inlined accept test (_x_ok) and its faults (_x_problem): over inputs that hit
-- every branch, the test accepts exactly when there is no fault, and a fault is a SQLSTATE, a
-- message and a hint or none.
-- The inputs, also against the rule stated independently of the accept test (_problem starts from
-- the accept test, so agreeing with it cannot catch a test that accepts too much).
CREATE TEMP TABLE pgtap_identities (c text, p text, m text, t text);
INSERT INTO pgtap_identities VALUES ('c', 'p', 'm', ''), ('c', 'p', 'm', 't'), (NULL, 'p', 'm', ''),
    ('c', NULL, 'm', ''), ('c', 'p', NULL, ''), ('c', 'p', 'm', NULL),
    ('', 'p', 'm', ''), ('c', '', 'm', ''), ('c', 'p', '', ''),
    (' ', 'p', 'm', ''), ('c', E'\t', 'm', ''), ('c', 'p', ' ', ''),
    ('c', 'p', 'm', ' '), (E'c\n', 'p', 'm', ''), ('c', E'p\x1b', 'm', ''),
    ('c', 'p', E'm\r', ''), ('c', 'p', 'm', E't\x7f'),
    (repeat('c', 129), 'p', 'm', ''), ('c', repeat('p', 129), 'm', ''),
    ('c', 'p', 'm', repeat('t', 129)), ('c', 'p', repeat('m', 257), ''),
    (repeat('c', 128), repeat('p', 128), repeat('m', 256), repeat('t', 128)),
    -- the shapes of _name_ok's expression: spaces around and inside,
    -- blanks made of several whitespace characters, C1 controls and a
    -- no-break space (printable), bytes against characters
    (' c ', 'p q', 'm', ' t'), ('   ', 'p', 'm', ''), ('c', E' \t ', 'm', ''),
    ('c', 'p', E'\x0b', ''), ('c', 'p', 'm', E'\t'), (E'c\u0085', 'p', 'm', ''),
    ('c', E'p\u009f', 'm', ''), (E'\u00a0', 'p', 'm', E'\u00a0'),
    (repeat('é', 64), 'p', 'm', ''), (repeat('é', 65), 'p', 'm', ''),
    ('c', 'p', 'm', repeat('é', 65)), ('c', 'p', 'm', E't\u0080');
SELECT is((SELECT count(*)::integer FROM pgtap_identities v
            WHERE (inbox._identity_ok(v.c, v.p, v.m, v.t) IS TRUE) <> (inbox._identity_problem(v.c, v.p, v.m, v.t) IS NULL)
               OR cardinality(inbox._identity_problem(v.c, v.p, v.m, v.t)) NOT IN (3)),
          0, '_identity_ok accepts exactly what _identity_problem finds no fault in');
SELECT is((SELECT count(*)::integer FROM pgtap_identities v
            WHERE (inbox._identity_ok(v.c, v.p, v.m, v.t) IS TRUE)
                  <> ((NOT inbox._blank(v.c) AND NOT inbox._blank(v.p) AND NOT inbox._blank(v.m)
                       AND (v.t = '' OR NOT inbox._blank(v.t)) AND NOT inbox._has_control(v.c || v.p || v.m || v.t)
                       AND octet_length(v.c) <= 128 AND octet_length(v.p) <= 128 AND octet_length(v.t) <= 128
                       AND octet_length(v.m) <= 256) IS TRUE)),
          0, '_identity_ok is the identity rule: names not blank, no control characters, within their lengths');
SELECT is((SELECT count(*)::integer FROM (VALUES (1, 'v'), (NULL, 'v'), (11, 'v'), (1, NULL), (1, ''), (1, ' '),
                                                 (1, repeat('v', 129)), (1, E'v\n'), (10, repeat('v', 128)), (1, E' \t'),
                                                 (1, 'v 2'), (1, E'v\u0085'), (1, E'\u00a0'), (1, repeat('é', 65))) v(size, version)
            WHERE (inbox._delivery_ok(v.size, 10, v.version) IS TRUE) <> (inbox._delivery_problem(v.size, 10, v.version) IS NULL)
               OR cardinality(inbox._delivery_problem(v.size, 10, v.version)) NOT IN (2, 3)
               OR (inbox._delivery_ok(v.size, 10, v.version) IS TRUE)
                  <> ((v.size <= 10 AND NOT inbox._blank(v.version) AND NOT inbox._has_control(v.version)
                       AND octet_length(v.version) <= 128) IS TRUE)),
          0, '_delivery_ok accepts exactly what _delivery_problem finds no fault in, and is the delivery rule');
SELECT is((SELECT count(*)::integer FROM (VALUES ('t'), (NULL), (''), (' '), (E't\n'), (repeat('t', 129)), (repeat('t', 128)),
                                                 ('  '), (E'\r '), ('t t'), (E't\u009f'), (repeat('é', 65))) v(t)
            WHERE (inbox._message_type_ok(v.t) IS TRUE) <> (inbox._message_type_problem(v.t) IS NULL)
               OR cardinality(inbox._message_type_problem(v.t)) NOT IN (3)
               OR (inbox._message_type_ok(v.t) IS TRUE)
                  <> ((NOT inbox._blank(v.t) AND NOT inbox._has_control(v.t) AND octet_length(v.t) <= 128) IS TRUE)),
          0, '_message_type_ok accepts exactly what _message_type_problem finds no fault in, and is the rule');
SELECT throws_ok($$SELECT inbox._check_delivery('f', 11, 10, 'v')$$, '54000',
                 'f: payload is 11 bytes, the consumer''s limit is 10 bytes', '_check_delivery raises the size fault');
SELECT throws_ok($$SELECT inbox._check_message_type('f', NULL)$$, '22004',
                 'f: message_type must be a name of 1 to 128 bytes, got NULL', '_check_message_type raises the NULL fault');
-- The accept tests are inlined where the hot paths and the batch use them: the plan shows the
-- expression, not a call.
CREATE TEMP TABLE pgtap_rule_args (c text, p text, m text, t text, n integer);
\ir plan_text.psql
SELECT unalike(pg_temp.plan_text($$SELECT inbox._identity_ok(c, p, m, t), inbox._delivery_ok(n, n, t),
                                          inbox._message_type_ok(t) FROM pgtap_rule_args$$),
               '%\_ok(%', 'the accept tests are inlined (the plan shows their expressions, no call)');

-- ------------------------------------------------------------------ ownership
SELECT is((SELECT count(*)::integer FROM pg_catalog.pg_class c
            WHERE c.relnamespace = 'inbox'::regnamespace AND c.relowner <> 'inbox_owner'::regrole),
          0, 'every relation in schema inbox is owned by inbox_owner');
SELECT is((SELECT count(*)::integer FROM pg_catalog.pg_class c
            WHERE c.relnamespace = 'inbox'::regnamespace AND c.relrowsecurity), 0,
          'no row level security in schema inbox (privileges are by function, not by row)');

SELECT * FROM finish();
ROLLBACK;
