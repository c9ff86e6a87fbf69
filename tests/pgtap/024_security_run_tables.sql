-- pgTAP: trust boundaries, second pass (0.3.0; docs/security.md). Nothing a caller can set decides
-- who acts as whom: the catalog is scanned for session settings, a forged marker gets nothing,
-- the handler of an operator's decision acts with its owner's bindings for the call only, an
-- unbound consumer is not repaired, strict_consumers holds superusers, a SET ROLE restricts.
-- Python tests (tests/python/integration/test_trust_second_pass.py) make the same attacks with real logins.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(34);

\ir write_counter.psql

-- ================================================================== no setting decides
-- Every read or write of a setting in schema inbox, by function and name. The only setting read on
-- the way to an authorization decision is 'role' (inbox._caller: PostgreSQL checks the login's
-- membership when SET ROLE sets it, and forbids setting it inside a SECURITY DEFINER function);
-- the others choose defaults or carry caches that authorize nothing. A new function that reads
-- a setting (inbox.operator_run was one: any code of the transaction could set it) fails here.
CREATE TEMP TABLE setting_use AS
SELECT p.proname::text AS fn, lower(m[1]) AS call, m[2] AS setting
  FROM pg_catalog.pg_proc p
 CROSS JOIN LATERAL regexp_matches(p.prosrc, '(current_setting|set_config)\s*\(\s*(''[^'']*''|[^'',)\s]+)', 'gi') m
 WHERE p.pronamespace = 'inbox'::regnamespace;
SELECT is_empty($$SELECT fn, call, setting FROM setting_use
                   EXCEPT
                   SELECT * FROM (VALUES
                       ('_caller', 'current_setting', '''role'''),
                       ('enqueue_effect', 'current_setting', '''inbox.consumer'''),
                       ('enqueue_effect', 'current_setting', '''inbox.tenant'''),
                       ('claim', 'set_config', '''inbox.consumer'''), ('claim', 'set_config', '''inbox.tenant'''),
                       ('claim_bytea', 'set_config', '''inbox.consumer'''), ('claim_bytea', 'set_config', '''inbox.tenant'''),
                       ('_begin_apply', 'set_config', '''inbox.consumer'''), ('_begin_apply', 'set_config', '''inbox.tenant'''),
                       ('_begin_apply_batch', 'set_config', '''inbox.consumer'''),
                       ('_begin_apply_batch', 'set_config', '''inbox.tenant'''),
                       ('claim_and_apply_batch', 'set_config', '''inbox.tenant'''),
                       ('_run_for_operator', 'set_config', '''inbox.consumer'''),
                       ('_run_for_operator', 'set_config', '''inbox.tenant'''),
                       ('_order_at_commit', 'current_setting', '''inbox.ordering_keys_locked'''),
                       ('_order_at_commit', 'set_config', '''inbox.ordering_keys_locked'''),
                       ('_report_outcomes', 'current_setting', '''application_name'''),
                       ('_count_duplicate', 'current_setting', '''transaction_isolation'''),
                       ('_metrics_rollup', 'current_setting', '''transaction_isolation'''),
                       ('metrics_rollup', 'current_setting', '''transaction_isolation'''),
                       ('metrics', 'current_setting', '''transaction_read_only'''),
                       -- which WAL position a commit reached: a caller who changes these fools only its
                       -- own durability wait (inbox.wait_durable), and authorizes nothing
                       ('_durable_target', 'current_setting', '''synchronous_commit'''),
                       ('_durable_target', 'current_setting', '''wal_block_size'''),
                       ('_durable_target', 'current_setting', '''wal_segment_size''')
                   ) AS allowed(fn, call, setting)$$,
                'no function of schema inbox reads or writes a session setting outside the reviewed list');
SELECT is_empty($$SELECT fn FROM setting_use WHERE setting ILIKE '%operator_run%'$$,
                'nothing reads or writes an inbox.operator_run setting any more');
SELECT is_empty($$SELECT p.proname FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace
                     AND p.proname IN ('_authorize', '_acting_as', '_may_act_as', '_role_may_act_as', '_authorize_enqueue',
                                       '_check_operator_run', '_real_member')
                     AND p.prosrc ~* '(current_setting|set_config)'$$,
                'the authorization functions read no setting (the caller comes from inbox._caller)');

-- ================================================================== roles and a domain
CREATE ROLE tap_run_billing NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_run_mallory NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_run_operator NOLOGIN IN ROLE inbox_operator;
CREATE SCHEMA taprun;
CREATE TABLE taprun.log (who text, what text);
GRANT USAGE ON SCHEMA taprun TO tap_run_billing, tap_run_mallory, inbox_runner;
GRANT INSERT, SELECT ON taprun.log TO tap_run_billing, tap_run_mallory;
SELECT inbox.bind_consumer('run-billing', 'tap_run_billing', note => 'tap') \g /dev/null
SELECT inbox.bind_consumer('run-mallory', 'tap_run_mallory', note => 'tap') \g /dev/null
SELECT inbox.configure_consumer(c, max_attempts => 1) FROM unnest(ARRAY['run-billing', 'run-mallory']) c \g /dev/null
CREATE TEMP TABLE res (step text PRIMARY KEY, outcome text, sqlstate text);
GRANT ALL ON res TO PUBLIC;
CREATE FUNCTION pg_temp.try(step text, sql text) RETURNS void LANGUAGE plpgsql AS $f$
DECLARE
    got text;
BEGIN
    EXECUTE sql INTO got;
    INSERT INTO pg_temp.res VALUES (step, got, NULL);
EXCEPTION WHEN OTHERS THEN
    INSERT INTO pg_temp.res VALUES (step, NULL, SQLSTATE);
END
$f$;

-- ================================================================== a forged marker
SET ROLE tap_run_mallory;
SELECT set_config('inbox.operator_run', 'run-billing', true) \g /dev/null
SELECT pg_temp.try('forged-claim', $$SELECT outcome FROM inbox.claim('run-billing', 'p', 'b1', '{}')$$);
SELECT pg_temp.try('forged-failure', $$SELECT outcome FROM inbox.record_failure('run-billing', 'p', 'b1', '{}', 'X1')$$);
RESET ROLE;
SELECT is((SELECT sqlstate FROM res WHERE step = 'forged-claim'), '42501', 'a forged inbox.operator_run setting: claim refused');
SELECT is((SELECT sqlstate FROM res WHERE step = 'forged-failure'), '42501', 'a forged inbox.operator_run setting: record_failure refused');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'run-billing'), 0, '... nothing was claimed');

-- ================================================================== an operator's repair of mallory's entry
-- Mallory's handler, SECURITY DEFINER and owned by mallory as repair requires, tries everything the
-- forged marker used to allow while the operator repairs mallory's own entry.
CREATE FUNCTION taprun.hostile(payload jsonb) RETURNS void LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = taprun, pg_temp AS $$
BEGIN
    INSERT INTO taprun.log VALUES (current_user, 'ran');
    IF payload ? 'fail' THEN
        RAISE EXCEPTION 'first delivery fails';
    END IF;
    PERFORM set_config('inbox.operator_run', 'run-billing', true);
    BEGIN
        PERFORM inbox.claim('run-billing', 'p', 'b2', '{}');
        INSERT INTO taprun.log VALUES (current_user, 'claimed billing');
    EXCEPTION WHEN insufficient_privilege THEN
        INSERT INTO taprun.log VALUES (current_user, 'claim refused');
    END;
    PERFORM inbox.enqueue_effect('mine', 'run-hook', '{"ok": 1}');   -- its own consumer: allowed
    INSERT INTO taprun.log VALUES (current_user, 'enqueued as itself');
    BEGIN
        PERFORM inbox.enqueue_effect('steal', 'run-hook', '{"transfer": 999999}', consumer => 'run-billing');
        INSERT INTO taprun.log VALUES (current_user, 'enqueued as billing');
    EXCEPTION WHEN insufficient_privilege THEN
        INSERT INTO taprun.log VALUES (current_user, 'enqueue as billing refused');
    END;
END
$$;
ALTER FUNCTION taprun.hostile(jsonb) OWNER TO tap_run_mallory;
SELECT inbox.register_handler('run-mallory', 'thing', 'taprun.hostile(jsonb)', 'v1') \g /dev/null
SELECT inbox.bind_destination('run-hook', 'run-mallory', 'tap') \g /dev/null
SELECT inbox.bind_destination('run-hook', 'run-billing', 'tap') \g /dev/null
SET ROLE tap_run_mallory;
SELECT inbox.claim_and_apply('run-mallory', 'p', 'm1', 'thing', '{"fail": true}') \g /dev/null
RESET ROLE;
SELECT quarantine_id AS m1 FROM inbox.quarantine WHERE consumer = 'run-mallory' AND message_id = 'm1' \gset
UPDATE inbox.quarantine SET payload = '{}' WHERE quarantine_id = :m1;   -- the "fixed" payload
SET ROLE tap_run_operator;
SELECT is((SELECT outcome FROM inbox.repair(:m1, 'routine repair')), 'applied', 'operator: repairs mallory''s entry');
RESET ROLE;
SELECT results_eq($$SELECT who, what FROM taprun.log ORDER BY ctid$$,
                  $$VALUES ('tap_run_mallory', 'ran'), ('tap_run_mallory', 'claim refused'),
                           ('tap_run_mallory', 'enqueued as itself'), ('tap_run_mallory', 'enqueue as billing refused')$$,
                  'repair: the handler ran with mallory''s rights, acted as mallory, and could not act as billing');
SELECT is((SELECT array_agg(consumer ORDER BY effect_id) FROM inbox.outbox WHERE destination = 'run-hook'), ARRAY['run-mallory'],
          'repair: the handler''s effect belongs to its consumer; nothing was enqueued as billing');
SELECT is((SELECT count(*)::integer FROM inbox.operator_run), 0, 'repair: its operator run is over (nothing left for later code)');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'run-billing'), 0, 'repair: billing''s messages untouched');
-- Outside a handler call, an operator cannot act as a consumer: there is no marker to set.
SET ROLE tap_run_operator;
SELECT pg_temp.try('operator-halves', $$SELECT (inbox._begin_repair(1, 'n')).handler_owner::text$$);
SELECT pg_temp.try('operator-run-confined', $$SELECT inbox._run_confined('taprun.hostile(jsonb)', false, '{}', NULL)::text$$);
RESET ROLE;
SELECT is((SELECT sqlstate FROM res WHERE step = 'operator-halves'), '42501', 'operator: cannot call repair''s half');
SELECT is((SELECT sqlstate FROM res WHERE step = 'operator-run-confined'), '42501', 'operator: cannot call the confined runner');

-- ================================================================== confinement
-- A handler that leaves a session setting behind (search_path: the operator's next statement would
-- resolve names through it) fails the repair, and the setting is rolled back.
CREATE FUNCTION taprun.sticky(payload jsonb) RETURNS void LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    PERFORM set_config('search_path', 'taprun, pg_catalog', false);
END
$$;
ALTER FUNCTION taprun.sticky(jsonb) OWNER TO tap_run_mallory;
SELECT inbox.register_handler('run-mallory', 'thing', 'taprun.sticky(jsonb)', 'v2') \g /dev/null
SET ROLE tap_run_mallory;
SELECT inbox.record_failure('run-mallory', 'p', 'm2', '{}', 'X1', message_type => 'thing') \g /dev/null
RESET ROLE;
SELECT current_setting('search_path') AS path_before \gset
SET ROLE tap_run_operator;
SELECT is((SELECT (outcome, reason_code)::text FROM inbox.repair(
              (SELECT quarantine_id FROM inbox.quarantine WHERE consumer = 'run-mallory' AND message_id = 'm2'), 'try')),
          '(failed,42501)', 'confinement: a handler that changes a session setting fails the repair');
RESET ROLE;
SELECT is(current_setting('search_path'), :'path_before', 'confinement: ... and the operator''s search_path is unchanged');
-- A handler altered into SECURITY INVOKER once the checks passed (a race the repair cannot close)
-- runs as inbox_runner, which can do nothing with it.
SELECT ok(NOT has_table_privilege('inbox_runner', 'taprun.log', 'INSERT')
          AND NOT has_schema_privilege('inbox_runner', 'inbox', 'USAGE')
          AND NOT pg_has_role('inbox_runner', 'inbox_consumer', 'MEMBER')
          AND NOT pg_has_role('inbox_runner', 'inbox_operator', 'MEMBER'),
          'confinement: inbox_runner holds no rights (no domain table, no inbox schema, no group role)');

-- ================================================================== unbound consumers are not repaired
SET ROLE tap_run_mallory;
SELECT inbox.record_failure('run-mallory', 'p', 'm3', '{}', 'X1', message_type => 'thing') \g /dev/null
RESET ROLE;
SELECT inbox.register_handler('run-mallory', 'thing', 'taprun.hostile(jsonb)', 'v3') \g /dev/null
SELECT inbox.unbind_consumer('run-mallory', 'tap_run_mallory', 'retired') \g /dev/null
SELECT throws_ok(format($$SELECT inbox.repair(%s, 'after unbinding')$$,
                        (SELECT quarantine_id FROM inbox.quarantine WHERE consumer = 'run-mallory' AND message_id = 'm3')),
                 '42501', 'inbox.repair: no live role is bound to consumer ''run-mallory''',
                 'unbound: repair refuses (nobody''s rights are left to run the handler with)');
SELECT is((SELECT status FROM inbox.quarantine WHERE consumer = 'run-mallory' AND message_id = 'm3'), 'open',
          'unbound: the entry stays open');

-- ================================================================== strict_consumers holds superusers
SELECT inbox.configure_security(strict_consumers => true, note => 'tap') \g /dev/null
SELECT throws_ok($$SELECT inbox.claim('run-billing', 'p', 'su-1', '{}')$$, '42501', NULL,
                 'strict: a superuser without a grant of the bound role is refused a bound consumer');
SELECT throws_ok($$SELECT inbox.claim('run-nobody', 'p', 'su-2', '{}')$$, '42704', NULL,
                 'strict: ... and an unbound one');
GRANT tap_run_billing TO CURRENT_USER;
SELECT is((SELECT outcome FROM inbox.claim('run-billing', 'p', 'su-3', '{}')), 'claimed',
          'strict: a superuser granted the bound role acts as the consumer');
REVOKE tap_run_billing FROM CURRENT_USER;
SELECT inbox.configure_security(strict_consumers => false, note => 'tap') \g /dev/null
SELECT is((SELECT outcome FROM inbox.claim('run-billing', 'p', 'su-4', '{}')), 'claimed',
          'not strict: a superuser acts as any consumer');

-- ================================================================== the effective role (SET ROLE)
-- A pooled login that switches role per request (PostgREST's authenticator): a NOINHERIT member of
-- two tenant roles, bound to nothing itself. A session acts with the rights its effective role has.
CREATE ROLE tap_run_tenant_a NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_run_tenant_b NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_run_pool NOLOGIN NOINHERIT IN ROLE tap_run_tenant_a, tap_run_tenant_b;
SELECT inbox.bind_consumer('run-tenants', 'tap_run_tenant_a', tenants => ARRAY['a'], note => 'tap') \g /dev/null
SELECT inbox.bind_consumer('run-tenants', 'tap_run_tenant_b', tenants => ARRAY['b'], note => 'tap') \g /dev/null
SET SESSION AUTHORIZATION tap_run_pool;
SET ROLE tap_run_tenant_a;
SELECT pg_temp.try('pool-a-a', $$SELECT outcome FROM inbox.claim('run-tenants', 'p', 'a1', '{}', tenant => 'a')$$);
SELECT pg_temp.try('pool-a-b', $$SELECT outcome FROM inbox.claim('run-tenants', 'p', 'b1', '{}', tenant => 'b')$$);
SELECT pg_temp.try('pool-a-enqueue-b', $$SELECT inbox.enqueue_effect('x', 'run-hook', '{}', consumer => 'run-tenants', tenant => 'b')::text$$);
RESET ROLE;
SELECT pg_temp.try('pool-none', $$SELECT outcome FROM inbox.claim('run-tenants', 'p', 'n1', '{}', tenant => 'a')$$);
RESET SESSION AUTHORIZATION;
SELECT is((SELECT outcome FROM res WHERE step = 'pool-a-a'), 'claimed', 'SET ROLE a: claims for tenant a');
SELECT is((SELECT sqlstate FROM res WHERE step = 'pool-a-b'), '42501', 'SET ROLE a: refused tenant b (its login is a member of b too)');
SELECT is((SELECT sqlstate FROM res WHERE step = 'pool-a-enqueue-b'), '42501', 'SET ROLE a: cannot enqueue under tenant b');
SELECT is((SELECT sqlstate FROM res WHERE step = 'pool-none'), '42501',
          'without SET ROLE the pooled (NOINHERIT) login has no tenant role''s rights: refused');

-- ================================================================== names with control characters
SELECT throws_ok($$SELECT inbox.claim('run-billing', 'p', E'm\x1b[31m', '{}')$$, '22023',
                 'inbox.claim: message_id must not contain control characters', 'a message id with an escape sequence is 22023');
SELECT throws_ok($$SELECT inbox.claim(E'run-billing\n', 'p', 'm', '{}')$$, '22023',
                 'inbox.claim: consumer must not contain control characters', 'a consumer with a line break is 22023');
SELECT throws_ok($$SELECT inbox.enqueue_effect(E'fx\u009b1', 'run-hook', '{}', consumer => 'run-billing')$$, '22023',
                 'inbox.enqueue_effect: effect_id must not contain control characters', 'an effect id with a C1 control is 22023');
SELECT throws_ok($$SELECT inbox.enqueue_effect('   ', 'run-hook', '{}', consumer => 'run-billing')$$, '22023',
                 'inbox.enqueue_effect: effect_id must not be only whitespace', 'an effect id of spaces is 22023');
SELECT throws_ok($$SELECT inbox.enqueue_effect('fx', 'run-hook', '{}', ordering_key => E'k\t', consumer => 'run-billing')$$,
                 '22023', 'inbox.enqueue_effect: ordering_key must not contain control characters',
                 'an ordering key with a tab is 22023');

-- ================================================================== a handler's name cannot inject
CREATE FUNCTION taprun."h$fn$;GRANT SELECT ON inbox.quarantine TO PUBLIC;SELECT $fn$"(payload jsonb) RETURNS void
    LANGUAGE sql AS $$SELECT NULL$$;
SET check_function_bodies = off;
SELECT lives_ok($$SELECT inbox.register_handler('run-billing', 'inject',
                   'taprun."h$fn$;GRANT SELECT ON inbox.quarantine TO PUBLIC;SELECT $fn$"(jsonb)', 'v1')$$,
                'injection: a handler named to end the generated body registers (with check_function_bodies off)');
RESET check_function_bodies;
SELECT ok(NOT has_table_privilege('public', 'inbox.quarantine', 'SELECT'), 'injection: ... and granted nothing');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('run-billing', 'p', 'inj-1', 'inject', '{}')), 'applied',
          'injection: the dispatcher calls it like any other handler');

SELECT * FROM finish();
ROLLBACK;
