-- pgTAP: sql/040_apply.sql — register_handler, claim_and_apply, claim_and_apply_batch.
-- Runs as the superuser that deployed; privileges and caller's rights are tested in 027_security.sql.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(157);

-- ------------------------------------------------------------------ fixtures
\ir write_counter.psql

-- The domain: accounts with a named CHECK constraint, and handlers that change them.
CREATE SCHEMA tapdom;
CREATE TABLE tapdom.account (
    id text PRIMARY KEY,
    balance integer NOT NULL,
    CONSTRAINT account_balance_nonnegative CHECK (balance >= 0)
);
CREATE TABLE tapdom.ctx_log (payload jsonb, ctx inbox.message_context);
-- Handler runs are counted by a sequence: a failed run's own writes roll back, nextval does not.
CREATE SEQUENCE tapdom.calls;
CREATE FUNCTION tapdom.calls() RETURNS bigint LANGUAGE sql AS
    $$SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM tapdom.calls$$;

CREATE FUNCTION tapdom.credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapdom.calls');
    UPDATE tapdom.account a SET balance = a.balance + (payload ->> 'amount')::integer WHERE a.id = payload ->> 'account';
    IF NOT FOUND THEN
        INSERT INTO tapdom.account (id, balance) VALUES (payload ->> 'account', (payload ->> 'amount')::integer);
    END IF;
END
$$;
CREATE FUNCTION tapdom.credit_v2(payload jsonb) RETURNS integer LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapdom.calls');
    INSERT INTO tapdom.account AS a (id, balance) VALUES (payload ->> 'account', 2 * (payload ->> 'amount')::integer)
    ON CONFLICT (id) DO UPDATE SET balance = a.balance + EXCLUDED.balance;
    RETURN 42;   -- the result is ignored
END
$$;
CREATE FUNCTION tapdom.fail(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapdom.calls');
    INSERT INTO tapdom.account (id, balance) VALUES ('written-by-fail-' || (payload ->> 'n'), 1);
    RAISE EXCEPTION 'boom %', payload ->> 'n';
END
$$;
CREATE FUNCTION tapdom.fail_code(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapdom.calls');
    RAISE EXCEPTION 'account % does not exist', payload ->> 'account' USING CONSTRAINT = 'invalid_account';
END
$$;
CREATE FUNCTION tapdom.with_ctx(payload jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapdom.calls');
    INSERT INTO tapdom.ctx_log VALUES (payload, ctx);
END
$$;
CREATE FUNCTION tapdom.transient(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapdom.calls');
    INSERT INTO tapdom.account (id, balance) VALUES ('written-by-transient', 1);
    RAISE EXCEPTION 'transient %', payload ->> 'code' USING ERRCODE = payload ->> 'code';
END
$$;
CREATE FUNCTION tapdom.asserting(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('tapdom.calls');
    ASSERT payload ? 'account', 'payload has no account';
END
$$;
CREATE FUNCTION tapdom.long_code(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rejected' USING CONSTRAINT = 'a_very_long_handler_reason_code_' || repeat('x', 48);
END
$$;
-- Handlers that must be refused.
CREATE PROCEDURE tapdom.proc(payload jsonb) LANGUAGE sql AS $$SELECT 1$$;
CREATE FUNCTION tapdom.srf(payload jsonb) RETURNS SETOF integer LANGUAGE sql AS $$SELECT 1$$;
CREATE FUNCTION tapdom.json_arg(payload json) RETURNS void LANGUAGE sql AS $$SELECT$$;
CREATE FUNCTION tapdom.text_arg(payload text) RETURNS void LANGUAGE sql AS $$SELECT$$;
CREATE FUNCTION tapdom.two_args(payload jsonb, extra integer) RETURNS void LANGUAGE sql AS $$SELECT$$;
CREATE FUNCTION tapdom.swapped(ctx inbox.message_context, payload jsonb) RETURNS void LANGUAGE sql AS $$SELECT$$;
CREATE FUNCTION tapdom.no_args() RETURNS void LANGUAGE sql AS $$SELECT$$;
CREATE FUNCTION tapdom.three_args(payload jsonb, ctx inbox.message_context, x integer) RETURNS void LANGUAGE sql AS $$SELECT$$;
CREATE FUNCTION tapdom.definer(payload jsonb) RETURNS void LANGUAGE sql SECURITY DEFINER AS $$SELECT$$;
CREATE FUNCTION tapdom.agg_step(state jsonb, payload jsonb) RETURNS jsonb LANGUAGE sql AS $$SELECT payload$$;
CREATE AGGREGATE tapdom.agg(jsonb) (SFUNC = tapdom.agg_step, STYPE = jsonb);
CREATE FUNCTION tapdom.dropped(payload jsonb) RETURNS void LANGUAGE sql AS $$SELECT$$;

CREATE TEMP TABLE res (step text PRIMARY KEY, LIKE inbox.delivery_result);

-- Runs a query returning one text value; reports an error as 'error SQLSTATE: message' instead of
-- raising, including ASSERT failures, which EXCEPTION WHEN OTHERS (and so throws_ok) does not catch.
CREATE FUNCTION pg_temp.try(sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    value text;
BEGIN
    EXECUTE sql INTO value;
    RETURN value;
EXCEPTION WHEN OTHERS OR assert_failure THEN
    RETURN 'error ' || SQLSTATE || ': ' || SQLERRM;
END
$$;

-- ================================================================== register_handler
SELECT is((SELECT (h.consumer, h.message_type, h.handler::text, h.handler_version, h.takes_context,
                   h.registered_by = session_user, h.registered_at = now())::text
             FROM inbox.register_handler('tap-a', 'credit', 'tapdom.credit(jsonb)', 'v1') h),
          '(tap-a,credit,"tapdom.credit(jsonb)",v1,f,t,t)',
          'register_handler: returns the saved row (takes_context false for f(jsonb))');
SELECT is((SELECT (r.consumer, r.message_type, r.handler, r.handler_version, r.registered_by = session_user)::text
             FROM inbox.handler_registration r WHERE r.consumer = 'tap-a' AND r.message_type = 'credit'),
          '(tap-a,credit,"tapdom.credit(jsonb)",v1,t)', 'register_handler: writes an audit row in inbox.handler_registration');
SELECT is((SELECT takes_context FROM inbox.register_handler('tap-a', 'ctx', 'tapdom.with_ctx(jsonb, inbox.message_context)', 'c1')),
          true, 'register_handler: f(jsonb, inbox.message_context) takes the context');
SELECT lives_ok($$SELECT inbox.register_handler('tap-a', 'fail', 'tapdom.fail(jsonb)', 'f1');
                  SELECT inbox.register_handler('tap-a', 'fail_code', 'tapdom.fail_code(jsonb)', 'f1');
                  SELECT inbox.register_handler('tap-a', 'transient', 'tapdom.transient(jsonb)', 't1');
                  SELECT inbox.register_handler('tap-a', 'assert', 'tapdom.asserting(jsonb)', 'a1');
                  SELECT inbox.register_handler('tap-a', 'long_code', 'tapdom.long_code(jsonb)', 'l1');
                  SELECT inbox.register_handler('tap-a', 'dropped', 'tapdom.dropped(jsonb)', 'd1')$$,
                'register_handler: registers plain handlers');

-- Re-registration replaces the handler and the version, and is audited again.
SELECT inbox.register_handler('tap-re', 'credit', 'tapdom.credit(jsonb)', 'v1') \g /dev/null
SELECT is((SELECT (h.handler::text, h.handler_version)::text
             FROM inbox.register_handler('tap-re', 'credit', 'tapdom.credit_v2(jsonb)', 'v2') h),
          '("tapdom.credit_v2(jsonb)",v2)', 'register_handler: re-registration replaces handler and version');
SELECT is((SELECT count(*)::integer FROM inbox.handler WHERE consumer = 'tap-re'), 1,
          'register_handler: still one handler per (consumer, message_type)');
SELECT results_eq($$SELECT handler, handler_version FROM inbox.handler_registration WHERE consumer = 'tap-re'
                     ORDER BY registration_id$$,
                  $$VALUES ('tapdom.credit(jsonb)', 'v1'), ('tapdom.credit_v2(jsonb)', 'v2')$$,
                  'register_handler: every registration leaves its own audit row');

SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.proc(jsonb)', 'v1')$$, '42809',
                 'inbox.register_handler: tapdom.proc(jsonb) is a procedure, a handler must be a plain function',
                 'register_handler: a procedure is refused (42809)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.agg(jsonb)', 'v1')$$, '42809',
                 'inbox.register_handler: tapdom.agg(jsonb) is an aggregate, a handler must be a plain function',
                 'register_handler: an aggregate is refused (42809)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.srf(jsonb)', 'v1')$$, '42809',
                 'inbox.register_handler: tapdom.srf(jsonb) returns a set, a handler returns one value (or void)',
                 'register_handler: a set-returning function is refused (42809)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.json_arg(json)', 'v1')$$, '42804',
                 'inbox.register_handler: tapdom.json_arg(json) has the wrong arguments',
                 'register_handler: f(json) is refused (42804)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.text_arg(text)', 'v1')$$, '42804',
                 'inbox.register_handler: tapdom.text_arg(text) has the wrong arguments',
                 'register_handler: f(text) is refused (42804)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.two_args(jsonb, integer)', 'v1')$$, '42804',
                 'inbox.register_handler: tapdom.two_args(jsonb,integer) has the wrong arguments',
                 'register_handler: f(jsonb, integer) is refused (42804)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.swapped(inbox.message_context, jsonb)', 'v1')$$,
                 '42804', 'inbox.register_handler: tapdom.swapped(inbox.message_context,jsonb) has the wrong arguments',
                 'register_handler: f(ctx, payload) in the wrong order is refused (42804)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.no_args()', 'v1')$$, '42804',
                 'inbox.register_handler: tapdom.no_args() has the wrong arguments',
                 'register_handler: f() is refused (42804)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.three_args(jsonb, inbox.message_context, integer)', 'v1')$$,
                 '42804', 'inbox.register_handler: tapdom.three_args(jsonb,inbox.message_context,integer) has the wrong arguments',
                 'register_handler: three arguments are refused (42804)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'inbox.payload_hash(jsonb, text[])', 'v1')$$, '42501',
                 'inbox.register_handler: inbox.payload_hash(jsonb,text[]) lives in schema inbox, handlers must be your own functions',
                 'register_handler: a function in schema inbox is refused (42501)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'pg_catalog.jsonb_typeof(jsonb)', 'v1')$$, '42501',
                 'inbox.register_handler: jsonb_typeof(jsonb) lives in schema pg_catalog, handlers must be your own functions',
                 'register_handler: a function in pg_catalog is refused (42501)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.definer(jsonb)', 'v1')$$, '42501',
                 format('inbox.register_handler: tapdom.definer(jsonb) is SECURITY DEFINER owned by %s', current_user),
                 'register_handler: a SECURITY DEFINER function owned by a superuser is refused (42501)');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', NULL, 'v1')$$, '22004',
                 'inbox.register_handler: handler must not be NULL', 'register_handler: NULL handler is 22004');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 4294967000::oid::regprocedure, 'v1')$$, '42883',
                 'inbox.register_handler: no function has OID 4294967000',
                 'register_handler: an OID that names no function is 42883');
SELECT throws_ok($$SELECT inbox.register_handler(NULL, 'x', 'tapdom.credit(jsonb)', 'v1')$$, '22004',
                 'inbox.register_handler: consumer must not be NULL', 'register_handler: NULL consumer is 22004');
SELECT throws_ok($$SELECT inbox.register_handler('', 'x', 'tapdom.credit(jsonb)', 'v1')$$, '22023',
                 'inbox.register_handler: consumer must not be empty', 'register_handler: empty consumer is 22023');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', NULL, 'tapdom.credit(jsonb)', 'v1')$$, '22004',
                 'inbox.register_handler: message_type must be a name of 1 to 128 bytes, got NULL',
                 'register_handler: NULL message_type is 22004');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', '', 'tapdom.credit(jsonb)', 'v1')$$, '22023',
                 'inbox.register_handler: message_type must be a name of 1 to 128 bytes, got ''''',
                 'register_handler: empty message_type is 22023');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', repeat('t', 129), 'tapdom.credit(jsonb)', 'v1')$$, '22001',
                 format('inbox.register_handler: message_type must be a name of 1 to 128 bytes, got %L', repeat('t', 40)),
                 'register_handler: a message_type of 129 bytes is 22001');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.credit(jsonb)', NULL)$$, '22004',
                 'inbox.register_handler: handler_version must not be NULL or empty',
                 'register_handler: NULL handler_version is 22004');
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.credit(jsonb)', '')$$, '22023',
                 'inbox.register_handler: handler_version must not be NULL or empty',
                 'register_handler: empty handler_version is 22023');
SELECT is(public.tap_writes(), :w0::bigint, 'register_handler: none of the refused registrations tried to write');

-- A SECURITY DEFINER handler owned by an unprivileged role runs with that role's rights: allowed.
CREATE ROLE tap_apply_plain NOLOGIN;
CREATE FUNCTION tapdom.plain_definer(payload jsonb) RETURNS void LANGUAGE sql SECURITY DEFINER AS $$SELECT$$;
ALTER FUNCTION tapdom.plain_definer(jsonb) OWNER TO tap_apply_plain;
SELECT lives_ok($$SELECT inbox.register_handler('tap-a', 'plain_definer', 'tapdom.plain_definer(jsonb)', 'v1')$$,
                'register_handler: a SECURITY DEFINER function owned by an unprivileged role is accepted');
-- ... but one owned by the package owner would run with the owner's rights: refused.
CREATE FUNCTION tapdom.owner_definer(payload jsonb) RETURNS void LANGUAGE sql SECURITY DEFINER AS $$SELECT$$;
ALTER FUNCTION tapdom.owner_definer(jsonb) OWNER TO inbox_owner;
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.owner_definer(jsonb)', 'v1')$$, '42501',
                 'inbox.register_handler: tapdom.owner_definer(jsonb) is SECURITY DEFINER owned by inbox_owner',
                 'register_handler: a SECURITY DEFINER function owned by inbox_owner is refused (42501)');
-- A role that is a member of inbox_owner has all its rights: its definer handlers are refused too.
CREATE ROLE tap_apply_owner_member NOLOGIN IN ROLE inbox_owner;
CREATE FUNCTION tapdom.member_definer(payload jsonb) RETURNS void LANGUAGE sql SECURITY DEFINER AS $$SELECT$$;
ALTER FUNCTION tapdom.member_definer(jsonb) OWNER TO tap_apply_owner_member;
SELECT throws_ok($$SELECT inbox.register_handler('tap-a', 'x', 'tapdom.member_definer(jsonb)', 'v1')$$, '42501', NULL,
                 'register_handler: a SECURITY DEFINER function owned by a member of inbox_owner is refused (42501)');

-- ================================================================== claim_and_apply: applied, duplicate, conflict
INSERT INTO res SELECT 'applied', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'a1', 'credit', '{"account": "acc1", "amount": 10}') c;
SELECT is((SELECT (outcome, handler_version, processed_at = now(), stored_sha256 IS NULL,
                   payload_sha256 = encode(inbox.payload_hash('{"account": "acc1", "amount": 10}'), 'hex'))::text
             FROM res WHERE step = 'applied'), '(applied,v1,t,t,t)',
          'claim_and_apply: a new message is applied with the registered handler version');
SELECT is((SELECT balance FROM tapdom.account WHERE id = 'acc1'), 10,
          'claim_and_apply: the domain change is visible in the same transaction');
SELECT is(tapdom.calls(), 1::bigint, 'claim_and_apply: the handler ran once');
SELECT is((SELECT (status, handler_version, payload_sha256 = inbox.payload_hash('{"account": "acc1", "amount": 10}'))::text
             FROM inbox.message WHERE consumer = 'tap-a' AND producer = 'p' AND message_id = 'a1'),
          '(processed,v1,t)', 'claim_and_apply: the claim row is processed with the handler version');

INSERT INTO res SELECT 'duplicate', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'a1', 'credit', '{"amount": 10, "account": "acc1"}') c;
SELECT is((SELECT (outcome, stored_sha256 = payload_sha256, handler_version)::text FROM res WHERE step = 'duplicate'),
          '(duplicate,t,v1)', 'claim_and_apply: a redelivery is a duplicate');
SELECT is(tapdom.calls(), 1::bigint, 'claim_and_apply: the handler did not run for the duplicate');
SELECT is((SELECT balance FROM tapdom.account WHERE id = 'acc1'), 10, 'claim_and_apply: the duplicate changed nothing');

INSERT INTO res SELECT 'conflict', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'a1', 'credit', '{"account": "acc1", "amount": 99}') c;
SELECT is((SELECT (outcome, reason_code, quarantine_id IS NOT NULL)::text FROM res WHERE step = 'conflict'),
          '(conflict,identity_conflict,t)', 'claim_and_apply: another payload under the same identity is a conflict');
SELECT is(tapdom.calls(), 1::bigint, 'claim_and_apply: the handler did not run for the conflict');
SELECT is((SELECT (q.kind, q.payload ->> 'amount')::text FROM inbox.quarantine q JOIN res r USING (quarantine_id)
            WHERE r.step = 'conflict'), '(conflict,99)', 'claim_and_apply: the conflict is quarantined with its payload');
SELECT is((SELECT balance FROM tapdom.account WHERE id = 'acc1'), 10, 'claim_and_apply: the conflict changed nothing');

INSERT INTO res SELECT 'tenant', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'a1', 'credit', '{"account": "acc1", "amount": 5}',
                                                               tenant => 't1') c;
SELECT is((SELECT outcome FROM res WHERE step = 'tenant'), 'applied', 'claim_and_apply: tenant is part of the identity');
SELECT is((SELECT balance FROM tapdom.account WHERE id = 'acc1'), 15, 'claim_and_apply: the other tenant''s change applied');

-- Re-registration: a new handler version applies new messages; old claims keep their version.
INSERT INTO res SELECT 're-v2', c.* FROM inbox.claim_and_apply('tap-re', 'p', 'r1', 'credit', '{"account": "acc-re", "amount": 4}') c;
SELECT is((SELECT (outcome, handler_version)::text FROM res WHERE step = 're-v2'), '(applied,v2)',
          'claim_and_apply: uses the handler registered last, with its version');
SELECT is((SELECT balance FROM tapdom.account WHERE id = 'acc-re'), 8,
          'claim_and_apply: the re-registered handler did the work (its result value is ignored)');

-- ================================================================== context argument
INSERT INTO res SELECT 'ctx', c.* FROM inbox.claim_and_apply('tap-a', 'prod-x', 'ctx-1', 'ctx', '{"k": "v"}', 'tenant-x',
                                                            '2024-05-06 07:08:09+00') c;
SELECT is((SELECT outcome FROM res WHERE step = 'ctx'), 'applied', 'context handler: applied');
SELECT is((SELECT ((ctx).tenant, (ctx).consumer, (ctx).producer, (ctx).message_id, (ctx).message_type,
                   (ctx).produced_at = '2024-05-06 07:08:09+00', (ctx).handler_version, payload = '{"k": "v"}')::text
             FROM tapdom.ctx_log),
          '(tenant-x,tap-a,prod-x,ctx-1,ctx,t,c1,t)',
          'context handler: receives the payload and the identity, message type, produced_at and version');

-- ================================================================== failed
INSERT INTO res SELECT 'fail1', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'f1', 'fail', '{"n": 1}') c;
SELECT is((SELECT (outcome, reason_code, error_message, attempts, handler_version, quarantine_id IS NULL)::text
             FROM res WHERE step = 'fail1'), '(failed,P0001,"boom 1",1,f1,t)',
          'claim_and_apply: a raising handler: failed, reason = SQLSTATE, the error message, attempts 1');
SELECT is((SELECT count(*)::integer FROM tapdom.account WHERE id LIKE 'written-by-fail-%'), 0,
          'claim_and_apply: the failed handler''s writes rolled back');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'tap-a' AND message_id = 'f1'), 0,
          'claim_and_apply: the failed attempt''s claim rolled back (no claim row)');
SELECT is((SELECT (failed, reason_code, error_message, handler_version, message_type,
                   payload_sha256 = inbox.payload_hash('{"n": 1}'))::text
             FROM inbox.attempt WHERE consumer = 'tap-a' AND message_id = 'f1'),
          '(1,P0001,"boom 1",f1,fail,t)', 'claim_and_apply: the failure is recorded in inbox.attempt');
INSERT INTO res SELECT 'fail2', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'f1', 'fail', '{"n": 1}') c;
SELECT is((SELECT (outcome, attempts)::text FROM res WHERE step = 'fail2'), '(failed,2)',
          'claim_and_apply: the next failure counts attempts up');

INSERT INTO res SELECT 'constraint', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'f2', 'credit', '{"account": "acc-neg", "amount": -5}') c;
SELECT is((SELECT (outcome, reason_code)::text FROM res WHERE step = 'constraint'), '(failed,account_balance_nonnegative)',
          'claim_and_apply: a violated named constraint becomes the reason code');
SELECT is((SELECT error_message FROM res WHERE step = 'constraint'),
          'new row for relation "account" violates check constraint "account_balance_nonnegative"',
          'claim_and_apply: the error message is the handler''s');
INSERT INTO res SELECT 'own-code', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'f3', 'fail_code', '{"account": "nope"}') c;
SELECT is((SELECT (outcome, reason_code, error_message)::text FROM res WHERE step = 'own-code'),
          '(failed,invalid_account,"account nope does not exist")',
          'claim_and_apply: RAISE ... USING CONSTRAINT = ''invalid_account'' becomes the reason code');
INSERT INTO res SELECT 'not-null', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'f4', 'credit', '{"amount": 1}') c;
SELECT is((SELECT (outcome, reason_code)::text FROM res WHERE step = 'not-null'), '(failed,23502)',
          'claim_and_apply: a NOT NULL violation (no constraint name) records the SQLSTATE');

-- A handler that fails, then succeeds on redelivery once the cause is fixed.
INSERT INTO res SELECT 'retry1', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'f5', 'credit', '{"account": "acc-late", "amount": -1}') c;
INSERT INTO tapdom.account VALUES ('acc-late', 10);
INSERT INTO res SELECT 'retry2', c.* FROM inbox.claim_and_apply('tap-a', 'p', 'f5', 'credit', '{"account": "acc-late", "amount": -1}') c;
SELECT is((SELECT string_agg(outcome, ',' ORDER BY step) FROM res WHERE step IN ('retry1', 'retry2')), 'failed,applied',
          'claim_and_apply: failed, then applied on redelivery');
SELECT is((SELECT balance FROM tapdom.account WHERE id = 'acc-late'), 9, 'claim_and_apply: the retry applied once');
-- attempts is reported on failed and quarantined outcomes only (the first-claim path reads no
-- attempt row); the recorded failure is in inbox.attempt.
SELECT is((SELECT attempts FROM res WHERE step = 'retry2'), NULL,
          'claim_and_apply: an applied result leaves attempts NULL (not looked up)');

-- A handler's own code longer than 64 bytes falls back to the SQLSTATE, so the failure is recorded.
SELECT is(pg_temp.try($$SELECT outcome FROM inbox.claim_and_apply('tap-a', 'p', 'f6', 'long_code', '{}')$$), 'failed',
          'claim_and_apply: a handler reason code longer than 64 bytes still records the failure');
-- ASSERT failures (P0004) are not part of WHEN OTHERS: claim_and_apply catches them explicitly.
SELECT is(pg_temp.try($$SELECT outcome FROM inbox.claim_and_apply('tap-a', 'p', 'f7', 'assert', '{}')$$), 'failed',
          'claim_and_apply: a handler failing an ASSERT is recorded as failed');

-- ================================================================== quarantined after max_attempts
SELECT inbox.configure_consumer('tap-q', max_attempts => 2) \g /dev/null
SELECT inbox.register_handler('tap-q', 'fail', 'tapdom.fail(jsonb)', 'q1') \g /dev/null
SELECT tapdom.calls() AS calls0 \gset
INSERT INTO res SELECT 'q1', c.* FROM inbox.claim_and_apply('tap-q', 'p', 'q1', 'fail', '{"n": 7}') c;
INSERT INTO res SELECT 'q2', c.* FROM inbox.claim_and_apply('tap-q', 'p', 'q1', 'fail', '{"n": 7}') c;
SELECT is((SELECT (outcome, attempts)::text FROM res WHERE step = 'q1'), '(failed,1)', 'max_attempts 2: the first failure');
SELECT is((SELECT (outcome, attempts, reason_code, error_message, quarantine_id IS NOT NULL)::text FROM res WHERE step = 'q2'),
          '(quarantined,2,P0001,"boom 7",t)', 'max_attempts 2: the second failure quarantines');
SELECT is((SELECT (q.kind, q.status, q.message_type, q.payload, q.attempts, q.crashes, q.handler_version)::text
             FROM inbox.quarantine q JOIN res r USING (quarantine_id) WHERE r.step = 'q2'),
          '(failure,open,fail,"{""n"": 7}",2,0,q1)', 'max_attempts 2: the entry keeps type, payload, attempts and version');
SELECT is((SELECT status FROM inbox.message WHERE consumer = 'tap-q' AND message_id = 'q1'), 'quarantined',
          'max_attempts 2: the identity is held by a quarantined placeholder');
SELECT is(tapdom.calls() - :calls0, 2::bigint, 'max_attempts 2: the handler ran twice');
INSERT INTO res SELECT 'q3', c.* FROM inbox.claim_and_apply('tap-q', 'p', 'q1', 'fail', '{"n": 7}') c;
SELECT is((SELECT (outcome, quarantine_id = (SELECT quarantine_id FROM res WHERE step = 'q2'), reason_code)::text
             FROM res WHERE step = 'q3'), '(quarantined,t,P0001)',
          'claim_and_apply: a later delivery of the quarantined identity is quarantined');
SELECT is(tapdom.calls() - :calls0, 2::bigint, 'claim_and_apply: the handler did not run for the quarantined identity');
SELECT is((SELECT q.deliveries FROM inbox.quarantine q JOIN res r USING (quarantine_id) WHERE r.step = 'q2'), 2,
          'claim_and_apply: the quarantined delivery is counted on the entry');
SELECT is((SELECT failed FROM inbox.attempt WHERE consumer = 'tap-q' AND message_id = 'q1'), 2,
          'claim_and_apply: a quarantined delivery is not a failed attempt');

-- ================================================================== errors: unknown type, dropped handler, transient
SELECT public.tap_writes() AS w0 \gset
SELECT tapdom.calls() AS calls0 \gset
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 'u1', 'nope', '{}')$$, '42704',
                 'inbox.claim_and_apply: no handler registered for consumer ''tap-a'' and message type ''nope''',
                 'claim_and_apply: an unknown message type is 42704');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-unknown', 'p', 'u1', 'credit', '{}')$$, '42704',
                 'inbox.claim_and_apply: no handler registered for consumer ''tap-unknown'' and message type ''credit''',
                 'claim_and_apply: a consumer without handlers is 42704');
SELECT 'tapdom.dropped(jsonb)'::regprocedure::oid AS dropped_oid \gset
DROP FUNCTION tapdom.dropped(jsonb);
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 'u2', 'dropped', '{}')$$, '42883',
                 format('inbox.claim_and_apply: the handler function (OID %s) registered for consumer ''tap-a'' and message type ''dropped'' no longer exists',
                        :dropped_oid),
                 'claim_and_apply: a handler dropped after registration is 42883');
SELECT throws_ok($$SELECT inbox.claim_and_apply(NULL, 'p', 'u3', 'credit', '{}')$$, '22004',
                 'inbox.claim_and_apply: consumer must not be NULL', 'claim_and_apply: NULL consumer is 22004');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', NULL, 'credit', '{}')$$, '22004',
                 'inbox.claim_and_apply: message_id must not be NULL', 'claim_and_apply: NULL message_id is 22004');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 'u3', 'credit', '{}', NULL)$$, '22004',
                 'inbox.claim_and_apply: tenant must not be NULL', 'claim_and_apply: NULL tenant is 22004');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', '', 'u3', 'credit', '{}')$$, '22023',
                 'inbox.claim_and_apply: producer must not be empty', 'claim_and_apply: empty producer is 22023');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', repeat('m', 257), 'credit', '{}')$$, '22001',
                 'inbox.claim_and_apply: message_id is 257 bytes long, the limit is 256',
                 'claim_and_apply: a message_id of 257 bytes is 22001');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 'u3', NULL, '{}')$$, '22004',
                 'inbox.claim_and_apply: message_type must be a name of 1 to 128 bytes, got NULL',
                 'claim_and_apply: NULL message_type is 22004');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 'u3', 'credit', NULL)$$, '22004',
                 'inbox.claim_and_apply: payload must not be NULL', 'claim_and_apply: NULL payload is 22004');
SELECT inbox.configure_consumer('tap-small', max_payload_bytes => 100) \g /dev/null
SELECT inbox.register_handler('tap-small', 'credit', 'tapdom.credit(jsonb)', 'v1') \g /dev/null
SELECT public.tap_writes() AS w0 \gset
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-small', 'p', 'u4', 'credit', jsonb_build_object('k', repeat('x', 200)))$$,
                 '54000', format('inbox.claim_and_apply: payload is %s bytes, the consumer''s limit is 100 bytes',
                                 octet_length((jsonb_build_object('k', repeat('x', 200)))::text)),
                 'claim_and_apply: a payload over the consumer''s limit is 54000');
SELECT is(public.tap_writes(), :w0::bigint, 'claim_and_apply: none of the rejected calls above tried to write');
SELECT is(tapdom.calls(), :calls0::bigint, 'claim_and_apply: no handler ran for the rejected calls');

-- Transient errors are the caller's to retry with the whole transaction: re-raised, not recorded.
SELECT public.tap_writes('attempt') AS attempt_writes0, public.tap_writes('quarantine') AS quarantine_writes0 \gset
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 't1', 'transient', '{"code": "40001"}')$$, '40001',
                 'transient 40001', 'claim_and_apply: a serialization failure (40001) in the handler is re-raised');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 't2', 'transient', '{"code": "55P03"}')$$, '55P03',
                 'transient 55P03', 'claim_and_apply: lock_not_available (55P03) in the handler is re-raised');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 't3', 'transient', '{"code": "40P01"}')$$, '40P01',
                 'transient 40P01', 'claim_and_apply: a deadlock (40P01) in the handler is re-raised');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-a', 'p', 't4', 'transient', '{"code": "53200"}')$$, '53200',
                 'transient 53200', 'claim_and_apply: out of memory (class 53) in the handler is re-raised');
SELECT is(public.tap_writes('attempt'), :attempt_writes0::bigint,
          'claim_and_apply: transient errors are not recorded as failures (no write to inbox.attempt was tried)');
SELECT is(public.tap_writes('quarantine'), :quarantine_writes0::bigint,
          'claim_and_apply: transient errors never quarantine (no write to inbox.quarantine was tried)');

SELECT isnt_definer('inbox', 'claim_and_apply', ARRAY['text', 'text', 'text', 'text', 'jsonb', 'text', 'timestamp with time zone'],
                    'claim_and_apply is SECURITY INVOKER (handlers run with the caller''s rights)');
SELECT isnt_definer('inbox', 'claim_and_apply_batch', ARRAY['text', 'jsonb'], 'claim_and_apply_batch is SECURITY INVOKER');
SELECT is_definer('inbox', 'register_handler', ARRAY['text', 'text', 'regprocedure', 'text'], 'register_handler is SECURITY DEFINER');
SELECT is_definer('inbox', '_begin_apply', ARRAY['text', 'text', 'text', 'text', 'jsonb', 'text', 'timestamp with time zone'],
                  '_begin_apply (the privileged half) is SECURITY DEFINER');

-- ================================================================== claim_and_apply_batch
SELECT inbox.register_handler('tap-b', 'credit', 'tapdom.credit(jsonb)', 'b1') \g /dev/null
SELECT inbox.register_handler('tap-b', 'fail', 'tapdom.fail(jsonb)', 'b1') \g /dev/null
SELECT inbox.register_handler('tap-b', 'ctx', 'tapdom.with_ctx(jsonb, inbox.message_context)', 'b1') \g /dev/null
CREATE TEMP TABLE batch AS
SELECT * FROM inbox.claim_and_apply_batch('tap-b', $$[
    {"producer": "p", "message_id": "b1", "message_type": "credit", "payload": {"account": "acc-b1", "amount": 5}},
    {"producer": "p", "message_id": "b2", "message_type": "fail", "payload": {"n": 2}},
    {"producer": "p", "message_id": "b3", "message_type": "credit", "payload": {"account": "acc-b3", "amount": 7}, "tenant": "t9"},
    {"producer": "p", "message_id": "b1", "message_type": "credit", "payload": {"amount": 5, "account": "acc-b1"}},
    {"producer": "p", "message_id": "b1", "message_type": "credit", "payload": {"account": "acc-b1", "amount": 6}},
    {"producer": "q", "message_id": "b4", "message_type": "ctx", "payload": {}, "tenant": "t9", "produced_at": "2024-01-01T00:00:00Z"}
]$$);
SELECT results_eq($$SELECT ordinal, tenant, producer, message_id, outcome FROM batch ORDER BY ordinal$$,
                  $$VALUES (1, '', 'p', 'b1', 'applied'), (2, '', 'p', 'b2', 'failed'), (3, 't9', 'p', 'b3', 'applied'),
                           (4, '', 'p', 'b1', 'duplicate'), (5, '', 'p', 'b1', 'conflict'), (6, 't9', 'q', 'b4', 'applied')$$,
                  'batch: one row per message in input order (ordinal 1..n), with its identity and outcome');
SELECT is((SELECT (reason_code, error_message, attempts, handler_version)::text FROM batch WHERE ordinal = 2),
          '(P0001,"boom 2",1,b1)', 'batch: the failed message reports its reason, error and attempts');
SELECT is((SELECT string_agg(id || '=' || balance, ',' ORDER BY id) FROM tapdom.account WHERE id LIKE 'acc-b%'),
          'acc-b1=5,acc-b3=7', 'batch: the failing message did not affect the others; the duplicate applied nothing');
SELECT is((SELECT count(*)::integer FROM tapdom.account WHERE id = 'written-by-fail-2'), 0,
          'batch: the failing message''s writes rolled back');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'tap-b'), 3,
          'batch: three identities claimed (b1, b3 in tenant t9, b4), none for the failure');
SELECT is((SELECT failed FROM inbox.attempt WHERE consumer = 'tap-b' AND message_id = 'b2'), 1,
          'batch: the failure is recorded');
SELECT is((SELECT ((ctx).tenant, (ctx).producer, (ctx).message_id, (ctx).produced_at = '2024-01-01T00:00:00Z')::text
             FROM tapdom.ctx_log WHERE (ctx).consumer = 'tap-b'), '(t9,q,b4,t)',
          'batch: tenant and produced_at reach the handler');
SELECT is((SELECT (stored_sha256 = payload_sha256, quarantine_id IS NULL)::text FROM batch WHERE ordinal = 4), '(t,t)',
          'batch: the in-batch duplicate reports the stored hash');
SELECT is((SELECT quarantine_id IS NOT NULL FROM batch WHERE ordinal = 5), true, 'batch: the in-batch conflict is quarantined');

SELECT is((SELECT count(*)::integer FROM inbox.claim_and_apply_batch('tap-b',
              (SELECT jsonb_agg(jsonb_build_object('producer', 'p64', 'message_id', 'm' || i, 'message_type', 'credit',
                                                   'payload', jsonb_build_object('account', 'acc-64', 'amount', 1)))
                 FROM generate_series(1, 64) i)) WHERE outcome = 'applied'),
          64, 'batch: 64 messages are accepted');
-- The handlers of a batch run in one subtransaction; when one fails, that subtransaction rolls back
-- and every handler runs again in its own. Runs are counted by the sequence, subtransactions by the
-- xmin of the rows the handlers wrote.
SELECT tapdom.calls() AS calls_a \gset
CREATE TEMP TABLE batch_ok AS SELECT * FROM inbox.claim_and_apply_batch('tap-b', $$[
    {"producer": "p", "message_id": "s1", "message_type": "credit", "payload": {"account": "acc-s1", "amount": 1}},
    {"producer": "p", "message_id": "s2", "message_type": "credit", "payload": {"account": "acc-s2", "amount": 2}},
    {"producer": "p", "message_id": "s3", "message_type": "credit", "payload": {"account": "acc-s3", "amount": 3}}
]$$);
SELECT is((SELECT count(DISTINCT xmin::text)::integer FROM tapdom.account WHERE id IN ('acc-s1', 'acc-s2', 'acc-s3')), 1,
          'batch without a failure: the three handlers wrote in one subtransaction');
SELECT is(tapdom.calls() - :calls_a, 3::bigint, 'batch without a failure: each handler ran once');
SELECT tapdom.calls() AS calls_b \gset
CREATE TEMP TABLE batch_fail AS SELECT * FROM inbox.claim_and_apply_batch('tap-b', $$[
    {"producer": "p", "message_id": "f1", "message_type": "credit", "payload": {"account": "acc-f1", "amount": 1}},
    {"producer": "p", "message_id": "f2", "message_type": "fail", "payload": {"n": 9}},
    {"producer": "p", "message_id": "f3", "message_type": "credit", "payload": {"account": "acc-f3", "amount": 3}},
    {"producer": "p", "message_id": "f1", "message_type": "credit", "payload": {"account": "acc-f1", "amount": 1}}
]$$);
SELECT is((SELECT array_agg(outcome ORDER BY ordinal) FROM batch_fail), ARRAY['applied', 'failed', 'applied', 'duplicate'],
          'batch with a failure: every outcome as in single claims');
SELECT is((SELECT string_agg(id || '=' || balance, ',' ORDER BY id) FROM tapdom.account
            WHERE id IN ('acc-f1', 'acc-f3', 'written-by-fail-9')),
          'acc-f1=1,acc-f3=3', 'batch with a failure: the others applied once each (their first run rolled back), the failed one''s writes gone');
SELECT is(tapdom.calls() - :calls_b, 5::bigint,
          'batch with a failure: the handlers up to the failing one ran twice (f1, f2), then f3 once');
SELECT is((SELECT count(DISTINCT xmin::text)::integer FROM tapdom.account WHERE id IN ('acc-f1', 'acc-f3')), 2,
          'batch with a failure: the second pass ran each handler in its own subtransaction');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'tap-b' AND message_id IN ('f1', 'f2', 'f3')), 2,
          'batch with a failure: f1 and f3 claimed once each, f2 not claimed');

-- The whole batch delivered again (a consumer that crashed before its ack): nothing is claimed,
-- every element is a duplicate, no handler runs. (0.2.0 candidate: an empty set of inserted rows
-- read as NULL once, and NULL as claimed: every message was applied twice.)
SELECT tapdom.calls() AS calls_c \gset
SELECT is((SELECT array_agg(outcome ORDER BY ordinal) FROM inbox.claim_and_apply_batch('tap-b', $$[
    {"producer": "p", "message_id": "s1", "message_type": "credit", "payload": {"account": "acc-s1", "amount": 1}},
    {"producer": "p", "message_id": "s2", "message_type": "credit", "payload": {"account": "acc-s2", "amount": 2}},
    {"producer": "p", "message_id": "s3", "message_type": "credit", "payload": {"account": "acc-s3", "amount": 3}}
]$$)), ARRAY['duplicate', 'duplicate', 'duplicate'], 'a batch delivered again: every element a duplicate');
SELECT is(tapdom.calls() - :calls_c, 0::bigint, 'a batch delivered again: no handler ran');
SELECT is((SELECT string_agg(id || '=' || balance, ',' ORDER BY id) FROM tapdom.account WHERE id IN ('acc-s1', 'acc-s2', 'acc-s3')),
          'acc-s1=1,acc-s2=2,acc-s3=3', 'a batch delivered again: every balance as after the first delivery');
SELECT is((SELECT array_agg(outcome ORDER BY ordinal) FROM inbox.claim_batch('tap-b', $$[
    {"producer": "p", "message_id": "s1", "payload": {"account": "acc-s1", "amount": 1}},
    {"producer": "p", "message_id": "s2", "payload": {"account": "acc-s2", "amount": 9}}
]$$, 'b1')), ARRAY['duplicate', 'conflict'], 'claim_batch of identities all claimed before: duplicate, conflict, nothing claimed');

-- Which elements a partly claimed batch inserted is decided on the identity's columns, not on a
-- string made of them: (producer 'p', id 'q n1') and (producer 'p q', id 'n1') join to the same
-- text with a space between the parts (0.2.0 candidate: a newline, refused in ids since 0.3.0).
-- The first was claimed before; the second is new.
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tap-b', 'p', 'q n1', 'credit', '{"account": "acc-n1", "amount": 1}')),
          'applied', 'batch identities: the first of two look-alike identities applied alone');
SELECT tapdom.calls() AS calls_n \gset
SELECT is((SELECT array_agg(outcome ORDER BY ordinal) FROM inbox.claim_and_apply_batch('tap-b', $$[
    {"producer": "p q", "message_id": "n1", "message_type": "credit", "payload": {"account": "acc-n2", "amount": 2}},
    {"producer": "p", "message_id": "q n1", "message_type": "credit", "payload": {"account": "acc-n1", "amount": 1}},
    {"producer": "p", "message_id": "n3", "message_type": "credit", "payload": {"account": "acc-n3", "amount": 3}},
    {"producer": "p", "message_id": "n3", "message_type": "credit", "payload": {"account": "acc-n3", "amount": 3}}
]$$)), ARRAY['applied', 'duplicate', 'applied', 'duplicate'],
          'batch identities: a look-alike claimed before is a duplicate, the new one and a repeat within the batch as usual');
SELECT is(tapdom.calls() - :calls_n, 2::bigint, 'batch identities: only the two new messages ran their handler');
SELECT is((SELECT string_agg(id || '=' || balance, ',' ORDER BY id) FROM tapdom.account WHERE id IN ('acc-n1', 'acc-n2', 'acc-n3')),
          'acc-n1=1,acc-n2=2,acc-n3=3', 'batch identities: every balance applied once');

-- Document-by-test: the contract says 1..64 elements; an empty array is accepted and returns no rows.
SELECT is((SELECT count(*)::integer FROM inbox.claim_and_apply_batch('tap-b', '[]')), 0,
          'batch: an empty array returns no rows');

SELECT public.tap_writes() AS w0 \gset
SELECT tapdom.calls() AS calls0 \gset
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b',
                     (SELECT jsonb_agg(jsonb_build_object('producer', 'p65', 'message_id', 'm' || i, 'message_type', 'credit',
                                                          'payload', jsonb_build_object('account', 'acc-65', 'amount', 1)))
                        FROM generate_series(1, 65) i))$$,
                 '54000', 'inbox.claim_and_apply_batch: a batch holds at most 64 messages, got 65',
                 'batch: 65 messages are 54000');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '{"producer": "p"}')$$, '22023',
                 'inbox.claim_and_apply_batch: messages must be a JSON array of message objects',
                 'batch: an object instead of an array is 22023');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', NULL)$$, '22004',
                 'inbox.claim_and_apply_batch: messages must not be NULL', 'batch: NULL messages is 22004');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {"account": "acc-v", "amount": 1}},
                     {"producer": "p", "message_id": "v2", "message_type": "credit"}]')$$,
                 '22004', 'inbox.claim_and_apply_batch: messages[1] has no payload',
                 'batch: an element without payload is 22004');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {"account": "acc-v", "amount": 1}},
                     42]')$$,
                 '22023', 'inbox.claim_and_apply_batch: messages[1] must be an object', 'batch: a non-object element is 22023');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {"account": "acc-v", "amount": 1}},
                     {"message_id": "v2", "message_type": "credit", "payload": {}}]')$$,
                 '22023', 'inbox.claim_and_apply_batch: messages[1] needs string fields producer, message_id and message_type (and tenant, if given)',
                 'batch: an element without producer is 22023');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": 7, "message_type": "credit", "payload": {}}]')$$,
                 '22023', 'inbox.claim_and_apply_batch: messages[0] needs string fields producer, message_id and message_type (and tenant, if given)',
                 'batch: a numeric message_id is 22023');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {}, "tenant": null}]')$$,
                 '22023', 'inbox.claim_and_apply_batch: messages[0] needs string fields producer, message_id and message_type (and tenant, if given)',
                 'batch: a null tenant is 22023');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {"account": "acc-v", "amount": 1}},
                     {"producer": "p", "message_id": "", "message_type": "credit", "payload": {}}]')$$,
                 '22023', 'inbox.claim_and_apply_batch: messages[1]: message_id must not be empty',
                 'batch: an element with an empty message_id is 22023');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {"account": "acc-v", "amount": 1}},
                     {"producer": "p", "message_id": "v2", "message_type": "", "payload": {}}]')$$,
                 '22023', 'inbox.claim_and_apply_batch: messages[1]: message_type must be a name of 1 to 128 bytes, got ''''',
                 'batch: an element with an empty message_type is 22023');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {"account": "acc-v", "amount": 1}},
                     {"producer": "p", "message_id": "v2", "message_type": "credit", "payload": {}, "produced_at": 5}]')$$,
                 '22023', 'inbox.claim_and_apply_batch: messages[1].produced_at must be a timestamp string',
                 'batch: a numeric produced_at is 22023');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {"account": "acc-v", "amount": 1}},
                     {"producer": "p", "message_id": "v2", "message_type": "credit", "payload": {}, "produced_at": "yesterday-ish"}]')$$,
                 '22007', 'invalid input syntax for type timestamp with time zone: "yesterday-ish"',
                 'batch: an unparsable produced_at is 22007');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch(NULL, '[
                     {"producer": "p", "message_id": "v1", "message_type": "credit", "payload": {}}]')$$,
                 '22004', 'inbox.claim_and_apply_batch: consumer must not be NULL',
                 'batch: NULL consumer is 22004');
SELECT is(public.tap_writes(), :w0::bigint,
          'batch: a bad element anywhere: nothing written for any element, not even the valid ones before it');
SELECT is(tapdom.calls(), :calls0::bigint, 'batch: a bad element anywhere: no handler ran');

-- An unknown message type or an oversize payload anywhere refuses the whole batch before anything
-- is written.
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('tap-b', '[
                     {"producer": "p", "message_id": "w1", "message_type": "credit", "payload": {"account": "acc-w", "amount": 1}},
                     {"producer": "p", "message_id": "w2", "message_type": "nope", "payload": {}}]')$$,
                 '42704', 'inbox.claim_and_apply_batch: no handler registered for consumer ''tap-b'' and message type ''nope''',
                 'batch: an element with an unknown message type is 42704');
SELECT inbox.register_handler('tap-small', 'credit', 'tapdom.credit(jsonb)', 'v1') \g /dev/null
SELECT throws_ok(format($$SELECT * FROM inbox.claim_and_apply_batch('tap-small', %L)$$,
                        jsonb_build_array(
                            '{"producer": "p", "message_id": "z1", "message_type": "credit", "payload": {"account": "acc-z", "amount": 1}}'::jsonb,
                            jsonb_build_object('producer', 'p', 'message_id', 'z2', 'message_type', 'credit',
                                               'payload', jsonb_build_object('k', repeat('x', 200))))),
                 '54000', format('inbox.claim_and_apply_batch: payload is %s bytes, the consumer''s limit is 100 bytes',
                                 octet_length((jsonb_build_object('k', repeat('x', 200)))::text)),
                 'batch: an element over the consumer''s payload limit is 54000');

-- A batch with several bad elements: the error is the first rule's in the single path's order
-- (fields, authorize, produced_at, handler, delivery), and within a rule the first element's.
SELECT throws_ok(format($$SELECT * FROM inbox.claim_and_apply_batch('tap-small', %L)$$,
                        jsonb_build_array(
                            jsonb_build_object('producer', 'p', 'message_id', 'o1', 'message_type', 'nope',
                                               'payload', jsonb_build_object('k', repeat('x', 200))),
                            '{"producer": "p", "message_id": "o2", "message_type": "credit", "payload": {},
                              "produced_at": "2999-01-01T00:00:00Z"}'::jsonb)),
                 '22008', format('inbox.claim_and_apply_batch: produced_at %s is ahead of the database clock (%s) by more than %s',
                                 '2999-01-01T00:00:00Z'::timestamptz, now(), '5 minutes'::interval),
                 'batch order: a produced_at ahead (element 2) before an unknown handler and a size (element 1)');
SELECT throws_ok(format($$SELECT * FROM inbox.claim_and_apply_batch('tap-small', %L)$$,
                        jsonb_build_array(
                            jsonb_build_object('producer', 'p', 'message_id', 'o1', 'message_type', 'credit',
                                               'payload', jsonb_build_object('k', repeat('x', 200))),
                            '{"producer": "p", "message_id": "o2", "message_type": "nope", "payload": {}}'::jsonb,
                            '{"producer": "p", "message_id": "o3", "message_type": "nope2", "payload": {}}'::jsonb)),
                 '42704', 'inbox.claim_and_apply_batch: no handler registered for consumer ''tap-small'' and message type ''nope''',
                 'batch order: the first unknown message type (element 2) before a size (element 1)');
SELECT throws_ok(format($$SELECT * FROM inbox.claim_and_apply_batch('tap-small', %L)$$,
                        jsonb_build_array(
                            '{"producer": "p", "message_id": "o1", "message_type": "credit", "payload": {}}'::jsonb,
                            jsonb_build_object('producer', 'p', 'message_id', 'o2', 'message_type', 'credit',
                                               'payload', jsonb_build_object('k', repeat('x', 300))),
                            jsonb_build_object('producer', 'p', 'message_id', 'o3', 'message_type', 'credit',
                                               'payload', jsonb_build_object('k', repeat('x', 200))))),
                 '54000', format('inbox.claim_and_apply_batch: payload is %s bytes, the consumer''s limit is 100 bytes',
                                 octet_length((jsonb_build_object('k', repeat('x', 300)))::text)),
                 'batch order: of two payloads over the limit, the first element''s');
SELECT throws_ok($$SELECT * FROM inbox.claim_batch('tap-b', '[
                     {"producer": "p", "message_id": "o1", "payload": {}, "produced_at": "yesterday-ish"},
                     {"producer": "p", "message_id": "", "payload": {}}]', 'v1')$$,
                 '22007', 'invalid input syntax for type timestamp with time zone: "yesterday-ish"',
                 'batch order: an unreadable produced_at (element 1) before an empty message_id (element 2)');
SELECT throws_ok($$SELECT * FROM inbox.claim_batch('tap-b', '[
                     {"producer": "p", "message_id": "", "payload": {}},
                     {"producer": "p", "message_id": "o2", "payload": {}, "produced_at": "yesterday-ish"}]', 'v1')$$,
                 '22023', 'inbox.claim_batch: messages[0]: message_id must not be empty',
                 'batch order: an empty message_id (element 1) before an unreadable produced_at (element 2)');
SELECT throws_ok($$SELECT * FROM inbox.claim_batch('tap-b', '[
                     {"producer": "p", "message_id": "o1", "payload": {}, "produced_at": "2999-01-01T00:00:00Z"},
                     {"producer": "p", "message_id": "o2", "payload": {}}]', ' ')$$,
                 '22008', format('inbox.claim_batch: produced_at %s is ahead of the database clock (%s) by more than %s',
                                 '2999-01-01T00:00:00Z'::timestamptz, now(), '5 minutes'::interval),
                 'batch order: a produced_at ahead before a blank version (claim_batch)');
-- The fields rule: its accept test (inlined into the batch's query) accepts exactly the elements
-- inbox._check_batch raises nothing for, over elements that reach each of its branches.
CREATE FUNCTION pg_temp.batch_element_refused(item jsonb, types_required boolean) RETURNS boolean
    LANGUAGE plpgsql AS $f$
BEGIN
    PERFORM inbox._check_batch('f', 'c', jsonb_build_array(item), types_required);
    RETURN false;
EXCEPTION WHEN OTHERS THEN
    RETURN true;
END
$f$;
SELECT is((SELECT count(*)::integer
             FROM (VALUES ('{"producer": "p", "message_id": "m", "message_type": "t", "payload": {}}'::jsonb),
                          ('{"producer": "p", "message_id": "m", "payload": null, "tenant": "t", "produced_at": null}'),
                          ('{"producer": "p", "message_id": "m", "message_type": null, "payload": 1, "produced_at": "2020-01-01"}'),
                          ('[]'), ('"p"'), ('{"message_id": "m", "payload": {}}'), ('{"producer": 1, "message_id": "m", "payload": {}}'),
                          ('{"producer": "p", "message_id": 2, "payload": {}}'), ('{"producer": "p", "message_id": "m"}'),
                          ('{"producer": "p", "message_id": "m", "message_type": 3, "payload": {}}'),
                          ('{"producer": "p", "message_id": "m", "tenant": null, "payload": {}}'),
                          ('{"producer": "p", "message_id": "m", "tenant": 4, "payload": {}}'),
                          ('{"producer": "p", "message_id": "m", "payload": {}, "produced_at": 5}'),
                          ('{"producer": "", "message_id": "m", "payload": {}}'), ('{"producer": "p", "message_id": " ", "payload": {}}'),
                          ('{"producer": "p", "message_id": "m", "tenant": " ", "payload": {}}'),
                          ('{"producer": "p\u001b", "message_id": "m", "payload": {}}'),
                          ('{"producer": "p", "message_id": "m", "message_type": "", "payload": {}}'),
                          ('{"producer": "p", "message_id": "m", "message_type": " ", "payload": {}}'),
                          (jsonb_build_object('producer', 'p', 'message_id', repeat('m', 257), 'payload', '{}'::jsonb)),
                          (jsonb_build_object('producer', 'p', 'message_id', 'm', 'message_type', repeat('t', 129),
                                              'payload', '{}'::jsonb))) v(item),
                  (VALUES (true), (false)) r(types_required)
            WHERE inbox._batch_fields_ok(v.item, 'c', r.types_required)
                  = pg_temp.batch_element_refused(v.item, r.types_required)),
          0, 'batch: _batch_fields_ok accepts exactly the elements _check_batch raises nothing for');
\ir plan_text.psql
CREATE TEMP TABLE batch_items (x jsonb, b boolean);
SELECT unalike(pg_temp.plan_text($$SELECT inbox._batch_fields_ok(x, 'c', b) FROM batch_items$$),
               '%\_ok(%', 'batch: the fields rule''s accept test is inlined (the plan shows its expression, no call)');
CREATE ROLE tap_apply_tenant_a NOLOGIN IN ROLE inbox_consumer;
SELECT inbox.bind_consumer('tap-b', 'tap_apply_tenant_a', ARRAY['a'], 'pgTAP') \g /dev/null
SET LOCAL ROLE tap_apply_tenant_a;
SELECT throws_ok($$SELECT * FROM inbox.claim_batch('tap-b', '[
                     {"producer": "p", "message_id": "o1", "payload": {}, "tenant": "a"},
                     {"producer": "p", "message_id": "o2", "payload": {}, "tenant": "z"},
                     {"producer": "p", "message_id": "o3", "payload": {}, "tenant": "y"}]', 'v1')$$,
                 '42501', 'inbox.claim_batch: role tap_apply_tenant_a may not act as consumer ''tap-b'' for tenant ''z''',
                 'batch order: of two tenants refused, the first element''s');
RESET ROLE;

-- ------------------------------------------------------------------ static dispatch
-- register_handler writes inbox._run_handler with a static, schema-qualified call per registered
-- handler (plan cached per session); an unregistered handler still runs, through EXECUTE.
SELECT ok((SELECT prosrc FROM pg_proc WHERE oid = 'inbox._run_handler(regprocedure, boolean, jsonb, inbox.message_context)'::regprocedure)
          LIKE '%PERFORM tapdom.credit(payload);%', 'static dispatch: a call to tapdom.credit(jsonb)');
SELECT ok((SELECT prosrc FROM pg_proc WHERE oid = 'inbox._run_handler(regprocedure, boolean, jsonb, inbox.message_context)'::regprocedure)
          LIKE '%PERFORM tapdom.with_ctx(payload, context);%', 'static dispatch: a handler with context gets it');
SELECT is((SELECT count(*)::integer FROM regexp_matches(
              (SELECT prosrc FROM pg_proc WHERE oid = 'inbox._run_handler(regprocedure, boolean, jsonb, inbox.message_context)'::regprocedure),
              'PERFORM tapdom\.credit\(payload\)', 'g')), 1,
          'static dispatch: one branch per handler, however many consumers registered it');
CREATE FUNCTION tapdom.unregistered(p jsonb) RETURNS void LANGUAGE sql
    AS $$ INSERT INTO tapdom.ctx_log (payload) VALUES ('{"unregistered": true}') $$;
SELECT lives_ok($$SELECT inbox._run_handler('tapdom.unregistered(jsonb)', false, '{}', NULL)$$,
                'static dispatch: a handler nobody registered falls back to EXECUTE');
SELECT is((SELECT count(*)::integer FROM tapdom.ctx_log WHERE payload ? 'unregistered'), 1, 'and it ran once');

-- The batch's common case (every element claimed, one handler): inbox._run_handler_batch calls it
-- for every payload in one statement, generated the same way.
SELECT ok((SELECT prosrc FROM pg_proc WHERE oid = 'inbox._run_handler_batch(regprocedure, boolean, jsonb[], inbox.message_context[])'::regprocedure)
          LIKE '%PERFORM tapdom.credit(payloads[i]) FROM pg_catalog.generate_subscripts(payloads, 1) AS i ORDER BY i;%',
          'static batch dispatch: one statement calls tapdom.credit(jsonb) for every payload');
DELETE FROM tapdom.ctx_log;
SELECT is((SELECT array_agg(outcome ORDER BY ordinal) FROM inbox.claim_and_apply_batch('tap-b', $$[
    {"producer": "q", "message_id": "k1", "message_type": "ctx", "payload": {"k": 1}, "tenant": "t9"},
    {"producer": "q", "message_id": "k2", "message_type": "ctx", "payload": {"k": 2}},
    {"producer": "r", "message_id": "k3", "message_type": "ctx", "payload": {"k": 3}, "produced_at": "2024-01-01T00:00:00Z"}
]$$)), ARRAY['applied', 'applied', 'applied'], 'static batch dispatch: a one-handler batch is applied');
SELECT is((SELECT string_agg(format('%s/%s/%s/%s/%s', payload ->> 'k', (ctx).tenant, (ctx).producer, (ctx).message_id,
                                    (ctx).produced_at IS NOT NULL), ',' ORDER BY payload ->> 'k')
             FROM tapdom.ctx_log),
          '1/t9/q/k1/f,2//q/k2/f,3//r/k3/t',
          'static batch dispatch: each handler call gets its own payload and context, once');
SELECT lives_ok($$SELECT inbox._run_handler_batch('tapdom.unregistered(jsonb)', false, ARRAY['{}', '{}']::jsonb[], NULL)$$,
                'static batch dispatch: a handler nobody registered falls back to a call per payload');
SELECT is((SELECT count(*)::integer FROM tapdom.ctx_log WHERE payload ? 'unregistered'), 2, 'and it ran once per payload');

SELECT * FROM finish();
ROLLBACK;
