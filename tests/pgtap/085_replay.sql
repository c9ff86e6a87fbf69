-- pgTAP: sql/085_replay.sql — versioned consumers, replay operation ids, replay plans (create, add,
-- run, accept a new version, cancel), the version pin, audit rows, holds, roles and every SQLSTATE.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(184);

-- ------------------------------------------------------------------ fixtures
\ir write_counter.psql

CREATE SCHEMA tapr;
-- No unique key: a second application of one message would show as a second row.
CREATE TABLE tapr.effect (message_id text NOT NULL, version text NOT NULL, consumer text, who text NOT NULL);
CREATE FUNCTION tapr.v1(payload jsonb) RETURNS void LANGUAGE sql
    AS $$INSERT INTO tapr.effect VALUES (payload ->> 'm', 'v1', NULL, current_user)$$;
CREATE FUNCTION tapr.fix(payload jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO tapr.effect VALUES (ctx.message_id, ctx.handler_version, ctx.consumer, current_user);
    IF payload ? 'poison' THEN
        RAISE EXCEPTION 'poisoned %', ctx.message_id USING ERRCODE = 'check_violation';
    END IF;
    IF payload ? 'transient' THEN
        RAISE EXCEPTION 'try again' USING ERRCODE = 'serialization_failure';
    END IF;
END
$$;
CREATE FUNCTION tapr.fix2(payload jsonb) RETURNS void LANGUAGE sql
    AS $$INSERT INTO tapr.effect VALUES (payload ->> 'm', 'fix2', NULL, current_user)$$;

-- The handlers are SECURITY DEFINER functions of the consumer's role, bound to it: a plan runs them
-- with that role's rights (0.3.0: confined, inbox_runner calls them; never with the operator's).
CREATE ROLE tap_r_service NOLOGIN;
GRANT USAGE ON SCHEMA tapr TO tap_r_service, inbox_runner;
GRANT INSERT, SELECT ON tapr.effect TO tap_r_service;
ALTER FUNCTION tapr.v1(jsonb) SECURITY DEFINER SET search_path = tapr, pg_temp;
ALTER FUNCTION tapr.fix(jsonb, inbox.message_context) SECURITY DEFINER SET search_path = tapr, pg_temp;
ALTER FUNCTION tapr.fix2(jsonb) SECURITY DEFINER SET search_path = tapr, pg_temp;
ALTER FUNCTION tapr.v1(jsonb) OWNER TO tap_r_service;
ALTER FUNCTION tapr.fix(jsonb, inbox.message_context) OWNER TO tap_r_service;
ALTER FUNCTION tapr.fix2(jsonb) OWNER TO tap_r_service;
SELECT inbox.bind_consumer('tap-r', 'tap_r_service', note => 'pgTAP') \g /dev/null

-- Consumer tap-r processed m1..m6 with v1 (m5 poisoned, m6 asks for a transient error later);
-- q1 is quarantined.
SELECT inbox.configure_consumer('tap-r', hash_exclude_keys => ARRAY['trace'], max_attempts => 1) \g /dev/null
SELECT inbox.register_handler('tap-r', 'thing', 'tapr.v1(jsonb)', 'v1') \g /dev/null
SELECT inbox.claim_and_apply('tap-r', 'p', 'm' || g, 'thing', jsonb_build_object('m', 'm' || g, 'trace', 't1'))
  FROM generate_series(1, 4) g \g /dev/null
SELECT inbox.claim_and_apply('tap-r', 'p', 'm5', 'thing', '{"m": "m5", "poison": true}') \g /dev/null
SELECT inbox.claim_and_apply('tap-r', 'p', 'm6', 'thing', '{"m": "m6", "transient": true}') \g /dev/null
SELECT inbox.claim_and_apply('tap-r', 'p', 't1', 'thing', '{"m": "t1"}', 'tenant-a') \g /dev/null
SELECT inbox.claim('tap-r', 'p', 'q1', '{"m": "q1"}') \g /dev/null
SELECT inbox.claim('tap-r', 'p', 'q1', '{"m": "q1", "changed": true}') \g /dev/null
SELECT inbox.record_failure('tap-r', 'p', 'f1', '{"m": "f1"}', 'X1', message_type => 'thing') \g /dev/null
CREATE TEMP TABLE original AS SELECT m::text AS row_text FROM inbox.message m WHERE m.consumer = 'tap-r';
SELECT inbox.register_handler('tap-r', 'thing', 'tapr.fix(jsonb,inbox.message_context)', 'fix-1') \g /dev/null
-- m7 is processed by fix-1 itself: a plan pinned to fix-1 must not apply it again.
SELECT inbox.claim_and_apply('tap-r', 'p', 'm7', 'thing', '{"m": "m7"}') \g /dev/null
DELETE FROM tapr.effect;

SELECT session_user AS me \gset

-- ================================================================== versioned_consumer
SELECT is(inbox.versioned_consumer('orders-projection', 'v2'), 'orders-projection@v2',
          'versioned_consumer: base@version');
SELECT is(inbox.versioned_consumer(repeat('b', 124), 'v.2'), repeat('b', 124) || '@v.2',
          'versioned_consumer: exactly 128 bytes is accepted');
SELECT throws_ok($$SELECT inbox.versioned_consumer(NULL, 'v2')$$, '22004',
                 'inbox.versioned_consumer: base must not be NULL', 'versioned_consumer: NULL base is 22004');
SELECT throws_ok($$SELECT inbox.versioned_consumer('b', NULL)$$, '22004',
                 'inbox.versioned_consumer: version must not be NULL', 'versioned_consumer: NULL version is 22004');
SELECT throws_ok(format('SELECT inbox.versioned_consumer(%L, %L)', b, v), '22023', NULL,
                 format('versioned_consumer: base %L, version %L is 22023', b, v))
  FROM (VALUES ('', 'v2'), ('a@b', 'v2'), ('replay:7', 'v2'), ('b', ''), ('b', '-v2'), ('b', 'v 2'), ('b', 'v@2'),
               ('b', repeat('v', 33))) AS x(b, v);
SELECT throws_ok($$SELECT inbox.versioned_consumer(repeat('b', 125), 'v.2')$$, '22001', NULL,
                 'versioned_consumer: a name over 128 bytes is 22001');

-- ================================================================== replay_operation_id
SELECT matches(inbox.replay_operation_id(1, 'c', 'p', 'm'), '^rp_[0-9a-f]{64}$', 'replay_operation_id: rp_ + 64 hex digits');
SELECT is(inbox.replay_operation_id(1, 'c', 'p', 'm', ''), inbox.replay_operation_id(1, 'c', 'p', 'm'),
          'replay_operation_id: stable (tenant defaults to '''')');
SELECT isnt(inbox.replay_operation_id(1, 'c', 'p', 'm'), inbox.replay_operation_id(2, 'c', 'p', 'm'),
            'replay_operation_id: depends on the plan');
SELECT isnt(inbox.replay_operation_id(1, 'c', 'p', 'm'), inbox.replay_operation_id(1, 'c', 'p', 'm', 't'),
            'replay_operation_id: depends on the tenant');
SELECT isnt(inbox.replay_operation_id(1, 'c', 'ab', 'c'), inbox.replay_operation_id(1, 'c', 'a', 'bc'),
            'replay_operation_id: fields are length-prefixed (no collision by concatenation)');
SELECT throws_ok($$SELECT inbox.replay_operation_id(NULL, 'c', 'p', 'm')$$, '22004', NULL,
                 'replay_operation_id: NULL plan_id is 22004');
SELECT throws_ok($$SELECT inbox.replay_operation_id(1, 'c', 'p', 'm', NULL)$$, '22004', NULL,
                 'replay_operation_id: NULL tenant is 22004');

-- ================================================================== create_replay_plan: bad input
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(format($$SELECT inbox.create_replay_plan(%s, %s, %s, %s, %s, %s)$$, a.name, a.consumer, a.type,
                        a.handler, a.version, a.note), a.state, NULL, 'create_replay_plan: ' || a.what || ' is ' || a.state)
  FROM (VALUES
        ('NULL', '''tap-r''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', '22004', 'NULL plan_name'),
        ('''''', '''tap-r''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', '22023', 'empty plan_name'),
        ('repeat(''x'', 129)', '''tap-r''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', '22001', 'a 129-byte plan_name'),
        ('''x''', 'NULL', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', '22004', 'NULL consumer'),
        ('''x''', '''''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', '22023', 'empty consumer'),
        ('''x''', '''replay:1''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', '22023', 'a replay: consumer'),
        ('''x''', '''tap-r''', 'NULL', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', '22004', 'NULL message_type'),
        ('''x''', '''tap-r''', '''thing''', 'NULL', '''fix-1''', '''n''', '22004', 'NULL handler'),
        ('''x''', '''tap-r''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', 'NULL', '''n''', '22004', 'NULL handler_version'),
        ('''x''', '''tap-r''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''''', '''n''', '22023', 'empty handler_version'),
        ('''x''', '''tap-r''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', 'NULL', '22004', 'NULL note'),
        ('''x''', '''tap-r''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', ''' 	''', '22023', 'a blank note'),
        ('''x''', '''tap-r''', '''nothing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', '42704', 'a type without handler'),
        ('''x''', '''tap-r''', '''thing''', '''tapr.fix(jsonb,inbox.message_context)''', '''fix-2''', '''n''', 'IR002', 'another version than the registered one'),
        ('''x''', '''tap-r''', '''thing''', '''tapr.fix2(jsonb)''', '''fix-1''', '''n''', 'IR002', 'another function than the registered one')
       ) AS a(name, consumer, type, handler, version, note, state, what);
SELECT throws_ok($$SELECT inbox.create_replay_plan('x', 'tap-r', 'thing', 'tapr.fix(jsonb,inbox.message_context)', 'fix-2', 'n')$$,
                 'IR002', 'inbox.create_replay_plan: consumer ''tap-r'' and message type ''thing'' have handler tapr.fix(jsonb,inbox.message_context) version ''fix-1'' registered, not tapr.fix(jsonb,inbox.message_context) version ''fix-2''',
                 'create_replay_plan: the IR002 message names both pairs');
-- A registered handler whose function was dropped: 42883.
CREATE FUNCTION tapr.gone(payload jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
SELECT inbox.register_handler('tap-gone', 'thing', 'tapr.gone(jsonb)', 'g1') \g /dev/null
SELECT 'tapr.gone(jsonb)'::regprocedure::oid AS gone_oid \gset
DROP FUNCTION tapr.gone(jsonb);
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(format($$SELECT inbox.create_replay_plan('x', 'tap-gone', 'thing', %s::oid::regprocedure, 'g1', 'n')$$, :gone_oid),
                 '42883', NULL, 'create_replay_plan: a registered handler whose function was dropped is 42883');
SELECT is(public.tap_writes(), :w0::bigint, 'create_replay_plan: none of the rejected calls tried to write');

-- ================================================================== create_replay_plan
SELECT plan_id AS p1 FROM inbox.create_replay_plan('fix-bonus', 'tap-r', 'thing', 'tapr.fix(jsonb,inbox.message_context)',
                                                   'fix-1', 'v1 forgot the bonus') \gset
SELECT is((SELECT (plan_name, consumer, message_type, handler::text, handler_version, takes_context, status, note,
                   created_by = session_user)::text FROM inbox.replay_plan WHERE plan_id = :p1),
          '(fix-bonus,tap-r,thing,"tapr.fix(jsonb,inbox.message_context)",fix-1,t,open,"v1 forgot the bonus",t)',
          'create_replay_plan: pins the registered handler and version; status open');
SELECT results_eq(format($$SELECT decision, decided_by, note, handler, handler_version FROM inbox.replay_decision WHERE plan_id = %s$$, :p1),
                  $$VALUES ('create', session_user::text COLLATE "default", 'v1 forgot the bonus', 'tapr.fix(jsonb,inbox.message_context)', 'fix-1')$$,
                  'create_replay_plan: one audit row (who, note, the pinned pair)');
SELECT throws_ok($$SELECT inbox.create_replay_plan('fix-bonus', 'tap-r', 'thing', 'tapr.fix(jsonb,inbox.message_context)', 'fix-1', 'again')$$,
                 '42710', NULL, 'create_replay_plan: a plan name is never reused (42710)');

-- ================================================================== add_replay_items: bad input
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(format($$SELECT inbox.add_replay_items(%s, %L)$$, a.plan, a.items), a.state, NULL,
                 'add_replay_items: ' || a.what || ' is ' || a.state)
  FROM (VALUES
        ('NULL', '[]', '22004', 'NULL plan_id'),
        ('987654', '[]', 'P0002', 'an unknown plan'),
        (:p1::text, NULL, '22004', 'NULL items'),
        (:p1::text, '{}', '22023', 'an object instead of an array'),
        (:p1::text, '[1]', '22023', 'an element that is not an object'),
        (:p1::text, '[{"producer": 1, "message_id": "m1", "payload": {}}]', '22023', 'a non-string producer'),
        (:p1::text, '[{"producer": "p", "payload": {}}]', '22023', 'a missing message_id'),
        (:p1::text, '[{"producer": "p", "message_id": "m1", "tenant": 3, "payload": {}}]', '22023', 'a non-string tenant'),
        (:p1::text, '[{"producer": "p", "message_id": "m1"}]', '22004', 'a missing payload'),
        (:p1::text, '[{"producer": "p", "message_id": "", "payload": {}}]', '22023', 'an empty message_id'),
        (:p1::text, '[{"producer": "' || repeat('p', 129) || '", "message_id": "m1", "payload": {}}]', '22001', 'a 129-byte producer'),
        (:p1::text, '[{"producer": "p", "message_id": "nope", "payload": {"m": "nope"}}]', 'P0002', 'an identity the consumer never processed'),
        (:p1::text, '[{"producer": "p", "message_id": "m1", "tenant": "tenant-a", "payload": {"m": "m1"}}]', 'P0002', 'the right id in another tenant'),
        (:p1::text, '[{"producer": "p", "message_id": "f1", "payload": {"m": "f1"}}]', '55000', 'an identity held by quarantine'),
        (:p1::text, '[{"producer": "p", "message_id": "m1", "payload": {"m": "m1", "trace": "t1"}}, {"producer": "p", "message_id": "m2", "payload": {"m": "other"}}]',
         'IR003', 'a payload that does not hash to the stored hash')
       ) AS a(plan, items, state, what);
SELECT throws_ok(format($$SELECT inbox.add_replay_items(%s, (SELECT jsonb_agg('{}'::jsonb) FROM generate_series(1, 10001)))$$, :p1),
                 '54000', NULL, 'add_replay_items: more than 10000 items is 54000');
SELECT throws_ok(format($$SELECT inbox.add_replay_items(%s, '[{"producer": "p", "message_id": "m2", "payload": {"m": "other"}}]')$$, :p1),
                 'IR003', 'inbox.add_replay_items: item 1: the payload of message ''m2'' of producer ''p'' is not the payload consumer ''tap-r'' processed',
                 'add_replay_items: the IR003 message names the item and the identity');
SELECT is(public.tap_writes(), :w0::bigint, 'add_replay_items: none of the rejected calls tried to write');

-- ================================================================== add_replay_items
SELECT is(inbox.add_replay_items(:p1, '[]'), 0, 'add_replay_items: an empty array adds nothing');
SELECT is(inbox.add_replay_items(:p1, '[{"producer": "p", "message_id": "m1", "payload": {"m": "m1", "trace": "other trace"}},
                                        {"producer": "p", "message_id": "m2", "payload": {"m": "m2"}},
                                        {"producer": "p", "message_id": "m3", "payload": {"m": "m3"}},
                                        {"producer": "p", "message_id": "m5", "payload": {"m": "m5", "poison": true}},
                                        {"producer": "p", "message_id": "m7", "payload": {"m": "m7"}},
                                        {"producer": "p", "message_id": "t1", "tenant": "tenant-a", "payload": {"m": "t1"}},
                                        {"producer": "p", "message_id": "m4", "payload": {"m": "m4"}}]'),
          7, 'add_replay_items: returns how many were added (hash_exclude_keys apply: another trace is accepted)');
SELECT is(inbox.add_replay_items(:p1, '[{"producer": "p", "message_id": "m2", "payload": {"m": "m2"}}]'), 0,
          'add_replay_items: an item already in the plan is not added again');
SELECT is((SELECT count(*)::integer FROM inbox.replay_item
            WHERE plan_id = :p1 AND operation_id = inbox.replay_operation_id(plan_id, 'tap-r', producer, message_id, tenant)),
          7, 'add_replay_items: each item''s operation id is replay_operation_id(plan, consumer, producer, message_id, tenant)');
SELECT is((SELECT (payload, payload_sha256 = inbox.payload_hash(payload, ARRAY['trace']), status)::text
             FROM inbox.replay_item WHERE plan_id = :p1 AND message_id = 'm1'),
          '("{""m"": ""m1"", ""trace"": ""other trace""}",t,pending)', 'add_replay_items: the item keeps its payload and hash, pending');
SELECT results_eq(format($$SELECT consumer, tenant, producer, message_id FROM inbox.retention_hold WHERE holder = 'replay:%s' ORDER BY tenant, message_id$$, :p1),
                  $$VALUES ('tap-r', '', 'p', 'm1'), ('tap-r', '', 'p', 'm2'), ('tap-r', '', 'p', 'm3'), ('tap-r', '', 'p', 'm4'),
                           ('tap-r', '', 'p', 'm5'), ('tap-r', '', 'p', 'm7'), ('tap-r', 'tenant-a', 'p', 't1')$$,
                  'add_replay_items: one retention hold per item, holder replay:<plan_id>');
SELECT is((SELECT (decision, items, decided_by = session_user)::text FROM inbox.replay_decision WHERE plan_id = :p1 AND decision = 'add_items'),
          '(add_items,7,t)', 'add_replay_items: an audit row with the count (only when something was added)');
SELECT is((SELECT (total, pending, applied, failed, skipped, pin_matches)::text FROM inbox.replay_status WHERE plan_id = :p1),
          '(7,7,0,0,0,t)', 'replay_status: counts and pin_matches');

-- ================================================================== run_replay_plan: bad input
SELECT throws_ok(format($$SELECT inbox.run_replay_plan(%s, %s)$$, a.plan, a.max_items), a.state, NULL,
                 'run_replay_plan: ' || a.what || ' is ' || a.state)
  FROM (VALUES ('NULL', '1', '22004', 'NULL plan_id'), ('987654', '1', 'P0002', 'an unknown plan'),
               (:p1::text, 'NULL', '22004', 'NULL max_items'), (:p1::text, '0', '22023', 'max_items 0'),
               (:p1::text, '10001', '22023', 'max_items 10001')) AS a(plan, max_items, state, what);

-- ================================================================== run_replay_plan
SELECT is((SELECT (r.plan_id = :p1, r.status, r.applied_now, r.failed_now, r.skipped_now, r.pending, r.applied)::text
             FROM inbox.run_replay_plan(:p1, 2) r),
          '(t,open,2,0,0,5,2)', 'run_replay_plan: runs max_items items, returns this call''s counts and the totals');
SELECT results_eq($$SELECT message_id, version, consumer, who FROM tapr.effect ORDER BY message_id$$,
                  $$VALUES ('m1', 'fix-1', 'tap-r', 'tap_r_service'), ('m2', 'fix-1', 'tap-r', 'tap_r_service')$$,
                  'run_replay_plan: the pinned handler ran once per item, with the context (original consumer and id, pinned version) and the rights of the consumer''s role');
SELECT results_eq(format($$SELECT message_id, handler_version, status::text, payload_sha256 FROM inbox.message
                            WHERE consumer = 'replay:%s' ORDER BY message_id$$, :p1),
                  format($$SELECT operation_id, 'fix-1', 'processed', payload_sha256 FROM inbox.replay_item
                            WHERE plan_id = %s AND status = 'applied' ORDER BY operation_id$$, :p1),
                  'run_replay_plan: each applied item''s operation id is claimed in inbox.message under consumer replay:<plan_id>');
SELECT is((SELECT (status, handler_version, finished_by = session_user)::text FROM inbox.replay_item WHERE plan_id = :p1 AND message_id = 'm1'),
          '(applied,fix-1,t)', 'run_replay_plan: the item is applied with the pinned version, by whom');

-- An operation id claimed already (by an earlier run that nobody recorded): skipped, nothing runs.
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version)
SELECT 'replay:' || :p1, tenant, producer, operation_id, payload_sha256, 'fix-1'
  FROM inbox.replay_item WHERE plan_id = :p1 AND message_id = 'm3';
SELECT is((SELECT (r.applied_now, r.failed_now, r.skipped_now)::text FROM inbox.run_replay_plan(:p1, 3) r), '(0,1,2)',
          'run_replay_plan: m3 (operation id taken) and m7 (processed by the pinned version) skipped, m5 failed');
SELECT results_eq(format($$SELECT message_id, status, reason_code, error_message FROM inbox.replay_item
                            WHERE plan_id = %s AND message_id IN ('m3', 'm5', 'm7') ORDER BY message_id$$, :p1),
                  $$VALUES ('m3', 'skipped', 'duplicate', NULL::text), ('m5', 'failed', '23514', 'poisoned m5'),
                           ('m7', 'skipped', 'same_version', NULL)$$,
                  'run_replay_plan: reason codes duplicate, same_version, and the handler''s SQLSTATE with its message');
SELECT is((SELECT count(*)::integer FROM tapr.effect WHERE message_id IN ('m3', 'm5', 'm7')), 0,
          'run_replay_plan: the failed item''s writes rolled back; skipped items ran nothing');
SELECT is((SELECT count(*)::integer FROM inbox.message m JOIN inbox.replay_item i ON i.operation_id = m.message_id
            WHERE i.plan_id = :p1 AND i.message_id = 'm5'), 0, 'run_replay_plan: the failed item''s operation id is not claimed');

-- A transient handler error is re-raised (retry the call): nothing of the call is kept.
SELECT inbox.register_handler('tap-r', 'thing', 'tapr.v1(jsonb)', 'v1') \g /dev/null
SELECT inbox.claim_and_apply('tap-r', 'p', 'm8', 'thing', '{"m": "m8", "transient": true}') \g /dev/null
SELECT inbox.register_handler('tap-r', 'thing', 'tapr.fix(jsonb,inbox.message_context)', 'fix-1') \g /dev/null
DELETE FROM tapr.effect WHERE version = 'v1';
SELECT plan_id AS p3 FROM inbox.create_replay_plan('transient', 'tap-r', 'thing', 'tapr.fix(jsonb,inbox.message_context)', 'fix-1', 'n') \gset
SELECT is((SELECT (r.status, r.applied_now, r.pending, r.applied)::text FROM inbox.run_replay_plan(:p3) r), '(open,0,0,0)',
          'run_replay_plan: a plan without items runs nothing and stays open (items can still be added)');
SELECT is(inbox.add_replay_items(:p3, '[{"producer": "p", "message_id": "m8", "payload": {"m": "m8", "transient": true}}]'), 1,
          'fixture: a plan whose item raises a transient error');
SELECT throws_ok(format($$SELECT inbox.run_replay_plan(%s)$$, :p3), '40001', 'try again',
                 'run_replay_plan: a transient handler error (40001) is re-raised');
SELECT is((SELECT status FROM inbox.replay_item WHERE plan_id = :p3), 'pending', 'run_replay_plan: ... and the item stays pending');

-- ================================================================== the version pin
SELECT inbox.register_handler('tap-r', 'thing', 'tapr.fix(jsonb,inbox.message_context)', 'fix-2') \g /dev/null
SET LOCAL client_min_messages = error;   -- the WARNING of the stop
SELECT is((SELECT (r.status, r.applied_now, r.pending)::text FROM inbox.run_replay_plan(:p1, 10) r),
          '(stopped_version_changed,0,2)', 'version pin: a changed registration stops the plan before the next item');
SET LOCAL client_min_messages = warning;
SELECT is((SELECT count(*)::integer FROM tapr.effect WHERE version = 'fix-2'), 0, 'version pin: nothing applied with fix-2');
SELECT is((SELECT (status, stopped_at IS NOT NULL)::text FROM inbox.replay_plan WHERE plan_id = :p1), '(stopped_version_changed,t)',
          'version pin: the plan is stopped_version_changed');
SELECT is((SELECT (decision, handler_version, previous_version)::text FROM inbox.replay_decision
            WHERE plan_id = :p1 AND decision = 'stopped_version_changed'), '(stopped_version_changed,fix-2,fix-1)',
          'version pin: the stop is in the audit trail with both versions');
SELECT is((SELECT (pin_matches, registered_version)::text FROM inbox.replay_status WHERE plan_id = :p1), '(f,fix-2)',
          'replay_status: pin_matches false, the registered version shown');
SELECT throws_ok(format($$SELECT inbox.run_replay_plan(%s)$$, :p1), 'IR001', NULL, 'version pin: a later run raises IR001');
-- Registering fix-1 again does not resume the plan by itself.
SELECT inbox.register_handler('tap-r', 'thing', 'tapr.fix(jsonb,inbox.message_context)', 'fix-1') \g /dev/null
SELECT throws_ok(format($$SELECT inbox.run_replay_plan(%s)$$, :p1), 'IR001', NULL,
                 'version pin: the plan stays stopped even when the pinned pair is registered again');
SELECT inbox.register_handler('tap-r', 'thing', 'tapr.fix2(jsonb)', 'fix-2') \g /dev/null
SELECT is((SELECT count(*)::integer FROM tapr.effect WHERE version IN ('fix-2', 'fix2')), 0,
          'version pin: still nothing applied with another version');

-- ================================================================== accept_replay_version
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok(format($$SELECT inbox.accept_replay_version(%s, %s, %s, %s)$$, a.plan, a.handler, a.version, a.note),
                 a.state, NULL, 'accept_replay_version: ' || a.what || ' is ' || a.state)
  FROM (VALUES ('NULL', '''tapr.fix2(jsonb)''', '''fix-2''', '''n''', '22004', 'NULL plan_id'),
               ('987654', '''tapr.fix2(jsonb)''', '''fix-2''', '''n''', 'P0002', 'an unknown plan'),
               (:p1::text, 'NULL', '''fix-2''', '''n''', '22004', 'NULL handler'),
               (:p1::text, '''tapr.fix2(jsonb)''', 'NULL', '''n''', '22004', 'NULL handler_version'),
               (:p1::text, '''tapr.fix2(jsonb)''', '''fix-2''', 'NULL', '22004', 'NULL note'),
               (:p1::text, '''tapr.fix2(jsonb)''', '''fix-2''', '''  ''', '22023', 'a blank note'),
               (:p1::text, '''tapr.fix(jsonb,inbox.message_context)''', '''fix-1''', '''n''', 'IR002', 'a pair that is not registered'),
               (:p1::text, '''tapr.fix2(jsonb)''', '''fix-3''', '''n''', 'IR002', 'a version that is not registered')
       ) AS a(plan, handler, version, note, state, what);
SELECT is(public.tap_writes(), :w0::bigint, 'accept_replay_version: none of the rejected calls tried to write');
SELECT is((SELECT (status, handler::text, handler_version, takes_context, stopped_at IS NULL)::text
             FROM inbox.accept_replay_version(:p1, 'tapr.fix2(jsonb)', 'fix-2', 'reviewed fix2')),
          '(open,"tapr.fix2(jsonb)",fix-2,f,t)', 'accept_replay_version: re-pins to the registered pair, status open');
SELECT is((SELECT (decision, note, handler, handler_version, previous_handler, previous_version, decided_by = session_user)::text
             FROM inbox.replay_decision WHERE plan_id = :p1 AND decision = 'accept_version'),
          '(accept_version,"reviewed fix2","tapr.fix2(jsonb)",fix-2,"tapr.fix(jsonb,inbox.message_context)",fix-1,t)',
          'accept_replay_version: an audit row with the new and the previous pair');
SELECT is((SELECT (r.status, r.applied_now, r.pending, r.applied, r.failed, r.skipped)::text FROM inbox.run_replay_plan(:p1) r),
          '(completed,2,0,4,1,2)', 'run_replay_plan: resumes with the accepted version and completes the plan');
SELECT results_eq($$SELECT message_id, version FROM tapr.effect ORDER BY message_id$$,
                  $$VALUES ('m1', 'fix-1'), ('m2', 'fix-1'), ('m4', 'fix2'), ('t1', 'fix2')$$,
                  'each item applied exactly once: before the stop with fix-1, after acceptance with fix2');
SELECT is((SELECT count(*)::integer FROM inbox.retention_hold WHERE holder = 'replay:' || :p1), 0,
          'completion: the plan''s retention holds are removed');
SELECT is((SELECT (status, finished_at IS NOT NULL)::text FROM inbox.replay_plan WHERE plan_id = :p1), '(completed,t)',
          'completion: status completed');
SELECT results_eq(format($$SELECT decision FROM inbox.replay_decision WHERE plan_id = %s ORDER BY decision_id$$, :p1),
                  $$VALUES ('create'), ('add_items'), ('stopped_version_changed'), ('accept_version'), ('completed')$$,
                  'the audit trail of the plan, in order');
SELECT throws_ok(format($$SELECT inbox.run_replay_plan(%s)$$, :p1), '55000', NULL, 'a completed plan does not run (55000)');
SELECT throws_ok(format($$SELECT inbox.add_replay_items(%s, '[]')$$, :p1), '55000', NULL, 'a completed plan takes no items (55000)');
SELECT throws_ok(format($$SELECT inbox.accept_replay_version(%s, 'tapr.fix2(jsonb)', 'fix-2', 'n')$$, :p1), '55000', NULL,
                 'a completed plan takes no new version (55000)');
SELECT throws_ok(format($$SELECT inbox.cancel_replay_plan(%s, 'n')$$, :p1), '55000', NULL, 'a completed plan cannot be cancelled (55000)');
SELECT bag_eq($$SELECT row_text FROM original$$,
              $$SELECT m::text FROM inbox.message m WHERE m.consumer = 'tap-r' AND m.message_id NOT IN ('m7', 'm8')$$,
              'the original inbox rows are byte-identical after the plan (replay deletes and changes none)');

-- ================================================================== cancel_replay_plan
SELECT plan_id AS p2 FROM inbox.create_replay_plan('to-cancel', 'tap-r', 'thing', 'tapr.fix2(jsonb)', 'fix-2', 'n') \gset
SELECT inbox.add_replay_items(:p2, '[{"producer": "p", "message_id": "m1", "payload": {"m": "m1"}},
                                      {"producer": "p", "message_id": "m2", "payload": {"m": "m2"}}]') \g /dev/null
SELECT is((SELECT applied_now FROM inbox.run_replay_plan(:p2, 1)), 1, 'cancel fixture: one of two items applied');
SELECT throws_ok(format($$SELECT inbox.cancel_replay_plan(%s, NULL)$$, :p2), '22004', NULL, 'cancel_replay_plan: NULL note is 22004');
SELECT throws_ok(format($$SELECT inbox.cancel_replay_plan(%s, '')$$, :p2), '22023', NULL, 'cancel_replay_plan: empty note is 22023');
SELECT throws_ok($$SELECT inbox.cancel_replay_plan(NULL, 'n')$$, '22004', NULL, 'cancel_replay_plan: NULL plan_id is 22004');
SELECT throws_ok($$SELECT inbox.cancel_replay_plan(987654, 'n')$$, 'P0002', NULL, 'cancel_replay_plan: an unknown plan is P0002');
SELECT is((SELECT (status, finished_at IS NOT NULL)::text FROM inbox.cancel_replay_plan(:p2, 'wrong selection')), '(cancelled,t)',
          'cancel_replay_plan: status cancelled');
SELECT results_eq(format($$SELECT status, reason_code FROM inbox.replay_item WHERE plan_id = %s ORDER BY item_no$$, :p2),
                  $$VALUES ('applied', NULL::text), ('skipped', 'cancelled')$$,
                  'cancel_replay_plan: pending items become skipped (cancelled); applied items stay applied');
SELECT is((SELECT count(*)::integer FROM inbox.retention_hold WHERE holder = 'replay:' || :p2), 0, 'cancel_replay_plan: holds removed');
SELECT is((SELECT (decision, note, items, decided_by = session_user)::text FROM inbox.replay_decision WHERE plan_id = :p2 AND decision = 'cancel'),
          '(cancel,"wrong selection",1,t)', 'cancel_replay_plan: an audit row with the note and the skipped count');
SELECT throws_ok(format($$SELECT inbox.cancel_replay_plan(%s, 'again')$$, :p2), '55000', NULL, 'cancel_replay_plan: twice is 55000');
SELECT throws_ok(format($$SELECT inbox.run_replay_plan(%s)$$, :p2), '55000', NULL, 'a cancelled plan does not run (55000)');

-- A message that disappeared while pending (only a superuser can do that) is skipped, not applied.
SELECT plan_id AS p4 FROM inbox.create_replay_plan('gone', 'tap-r', 'thing', 'tapr.fix2(jsonb)', 'fix-2', 'n') \gset
SELECT inbox.add_replay_items(:p4, '[{"producer": "p", "message_id": "m4", "payload": {"m": "m4"}}]') \g /dev/null
DELETE FROM inbox.message WHERE consumer = 'tap-r' AND message_id = 'm4';
SELECT is((SELECT (r.status, r.skipped_now)::text FROM inbox.run_replay_plan(:p4) r), '(completed,1)',
          'a pending item whose message is gone is skipped');
SELECT is((SELECT reason_code FROM inbox.replay_item WHERE plan_id = :p4), 'message_missing', '... with reason message_missing');

-- ================================================================== catalog
SELECT is_definer('inbox', f, 'SECURITY DEFINER: inbox.' || f)
  FROM unnest(ARRAY['create_replay_plan', 'add_replay_items', 'accept_replay_version', 'cancel_replay_plan',
                    'run_replay_plan']) f;
SELECT isnt_definer('inbox', f, 'run_replay_plan''s own half (0.3.0): inbox.' || f)
  FROM unnest(ARRAY['_replay_run_start', '_replay_next', '_begin_replay_item', '_replay_item_failed',
                    '_replay_run_finish']) f;
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace
                     AND (p.proname ~ 'replay' OR p.proname = 'versioned_consumer' OR p.proname = '_check_registered_pair'
                          OR p.proname = '_check_plan_active')
                     AND pg_catalog.obj_description(p.oid, 'pg_proc') IS NULL$$,
                'every replay function has a COMMENT');

-- ================================================================== roles
CREATE ROLE tap_rp_operator NOLOGIN IN ROLE inbox_operator;
CREATE ROLE tap_rp_reader NOLOGIN IN ROLE inbox_reader;
CREATE ROLE tap_rp_consumer NOLOGIN IN ROLE inbox_consumer;
GRANT USAGE ON SCHEMA tapr TO tap_rp_operator;
GRANT INSERT, SELECT ON tapr.effect TO tap_rp_operator;

SELECT function_privs_are('inbox', f.name, f.args, r.role,
                          CASE WHEN r.role = ANY (f.roles) THEN ARRAY['EXECUTE'] ELSE ARRAY[]::text[] END,
                          format('%s %s execute inbox.%s', r.role, CASE WHEN r.role = ANY (f.roles) THEN 'may' ELSE 'may not' END, f.name))
  FROM (VALUES
        ('versioned_consumer', ARRAY['text', 'text'], ARRAY['inbox_consumer', 'inbox_operator', 'inbox_reader'], 1),
        ('replay_operation_id', ARRAY['bigint', 'text', 'text', 'text', 'text'], ARRAY['inbox_operator', 'inbox_reader'], 2),
        ('create_replay_plan', ARRAY['text', 'text', 'text', 'regprocedure', 'text', 'text'], ARRAY['inbox_operator'], 3),
        ('add_replay_items', ARRAY['bigint', 'jsonb'], ARRAY['inbox_operator'], 4),
        ('run_replay_plan', ARRAY['bigint', 'integer'], ARRAY['inbox_operator'], 5),
        ('accept_replay_version', ARRAY['bigint', 'regprocedure', 'text', 'text'], ARRAY['inbox_operator'], 6),
        ('cancel_replay_plan', ARRAY['bigint', 'text'], ARRAY['inbox_operator'], 7),
        ('_replay_next', ARRAY['bigint'], ARRAY[]::text[], 8),
        ('_lock_replay_plan', ARRAY['text', 'bigint'], ARRAY[]::text[], 9),
        ('_check_registered_pair', ARRAY['text', 'text', 'text', 'regprocedure', 'text'], ARRAY[]::text[], 10)
       ) AS f(name, args, roles, ord)
 CROSS JOIN (VALUES ('inbox_consumer', 1), ('inbox_operator', 2), ('inbox_reader', 3)) AS r(role, ord)
 ORDER BY f.ord, r.ord;

-- The operator runs a plan; the handler runs with the rights of the consumer's role, never the operator's.
SET ROLE tap_rp_operator;
SELECT plan_id AS p5 FROM inbox.create_replay_plan('as-operator', 'tap-r', 'thing', 'tapr.fix2(jsonb)', 'fix-2', 'by the operator') \gset
SELECT is(inbox.add_replay_items(:p5, '[{"producer": "p", "message_id": "m2", "payload": {"m": "m2"}}]'), 1,
          'operator: adds items');
SELECT is((SELECT status FROM inbox.run_replay_plan(:p5)), 'completed', 'operator: runs the plan');
SELECT is((SELECT payload FROM inbox.replay_item WHERE plan_id = :p5), '{"m": "m2"}'::jsonb, 'operator: reads item payloads');
SELECT throws_ok($$INSERT INTO inbox.replay_decision (plan_id, decision) VALUES (1, 'cancel')$$, '42501', NULL,
                 'operator: cannot forge audit rows');
SELECT throws_ok($$UPDATE inbox.replay_item SET status = 'pending'$$, '42501', NULL, 'operator: cannot reset items behind the API''s back');
RESET ROLE;
SELECT is((SELECT who FROM tapr.effect WHERE version = 'fix2' AND message_id = 'm2' ORDER BY who LIMIT 1), 'tap_r_service',
          'the handler ran with the rights of the consumer''s role, not the operator''s nor the owner''s');
SELECT is((SELECT decided_by FROM inbox.replay_decision WHERE plan_id = :p5 AND decision = 'create'), session_user::text,
          'the audit row names the session user');

SET ROLE tap_rp_reader;
SELECT lives_ok($$SELECT plan_id, status, pending, applied, failed, skipped FROM inbox.replay_status$$, 'reader: reads replay_status');
SELECT lives_ok($$SELECT * FROM inbox.replay_plan; SELECT * FROM inbox.replay_decision$$, 'reader: reads plans and their audit trail');
SELECT lives_ok($$SELECT plan_id, message_id, operation_id, status, reason_code FROM inbox.replay_item$$,
                'reader: reads the non-payload columns of replay_item');
SELECT throws_ok($$SELECT payload FROM inbox.replay_item$$, '42501', NULL, 'reader: cannot read item payloads');
SELECT throws_ok(format($$SELECT inbox.run_replay_plan(%s)$$, :p3), '42501', NULL, 'reader: cannot run a plan');
SELECT throws_ok($$SELECT inbox.create_replay_plan('r', 'tap-r', 'thing', 'tapr.fix2(jsonb)', 'fix-2', 'n')$$, '42501', NULL,
                 'reader: cannot create a plan');
RESET ROLE;

SET ROLE tap_rp_consumer;
SELECT is(inbox.versioned_consumer('proj', 'v3'), 'proj@v3', 'consumer: can compute a versioned consumer name');
SELECT throws_ok(format($$SELECT inbox.run_replay_plan(%s)$$, :p3), '42501', NULL, 'consumer: cannot run a plan');
SELECT throws_ok(format($$SELECT inbox._replay_next(%s)$$, :p3), '42501', NULL, 'consumer: cannot call the runner''s halves');
SELECT throws_ok($$SELECT * FROM inbox.replay_status$$, '42501', NULL, 'consumer: cannot read replay_status');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
