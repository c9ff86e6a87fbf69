-- pgTAP: sql/122_python_replay.sql — replay plans with a Python handler: the operator approves a
-- plan for one handler, a login of the consumer's own role takes its items one transaction each
-- (the handler runs there), every refusal before anything is written, and the audit trail. The
-- consumer's login is a session (SET SESSION AUTHORIZATION): items record session_user.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(41);

-- ------------------------------------------------------------------ fixtures
CREATE ROLE tap_py_operator NOLOGIN;
GRANT inbox_operator TO tap_py_operator;
CREATE ROLE tap_py_service NOLOGIN;                 -- the role bound to consumer tap-py
GRANT inbox_consumer TO tap_py_service;
CREATE ROLE tap_py_login LOGIN IN ROLE tap_py_service;  -- the consumer service's login
CREATE ROLE tap_py_other LOGIN;                     -- another service: bound to another consumer
GRANT inbox_consumer TO tap_py_other;
CREATE ROLE tap_py_both LOGIN;                      -- an operator who also consumes, elsewhere
GRANT inbox_operator, inbox_consumer TO tap_py_both;
CREATE ROLE tap_py_globex LOGIN;                    -- bound to tap-py for tenant globex only
GRANT inbox_consumer TO tap_py_globex;
SELECT inbox.bind_consumer('tap-py', 'tap_py_service', note => 'pgTAP') \g /dev/null
SELECT inbox.bind_consumer('tap-py-other', 'tap_py_other', note => 'pgTAP') \g /dev/null
SELECT inbox.bind_consumer('tap-py-other', 'tap_py_both', note => 'pgTAP') \g /dev/null
SELECT inbox.bind_consumer('tap-py', 'tap_py_globex', tenants => ARRAY['globex'], note => 'pgTAP') \g /dev/null
CREATE TEMP TABLE p (name text PRIMARY KEY, id bigint NOT NULL);
CREATE TEMP TABLE taken (n serial PRIMARY KEY, s inbox.python_replay_step);
GRANT ALL ON p, taken TO PUBLIC;
GRANT ALL ON SEQUENCE taken_n_seq TO PUBLIC;

-- The consumer's login processed four messages with its Python handler, version v1 (m4: v2).
SET SESSION AUTHORIZATION tap_py_login;
SELECT inbox.claim('tap-py', 'p', 'm1', '{"n": 1}', handler_version => 'v1') \g /dev/null
SELECT inbox.claim('tap-py', 'p', 'm2', '{"n": 2}', handler_version => 'v1') \g /dev/null
SELECT inbox.claim('tap-py', 'p', 'm3', '{"n": 3}', handler_version => 'v1') \g /dev/null
SELECT inbox.claim('tap-py', 'p', 'm4', '{"n": 4}', handler_version => 'v2') \g /dev/null
SELECT inbox.claim('tap-py', 'p', 'a1', '{"n": 5}', handler_version => 'v1', tenant => 'acme') \g /dev/null
RESET SESSION AUTHORIZATION;

-- ------------------------------------------------------------------ approving a plan (operator)
SET SESSION AUTHORIZATION tap_py_login;
SELECT throws_ok($$SELECT inbox.create_python_replay_plan('tap-py-1', 'tap-py', 'credit', 'svc.handlers:credit', 'v2', 'n')$$,
                 '42501', NULL, 'a consumer cannot approve a plan for itself');
RESET SESSION AUTHORIZATION;
SET ROLE tap_py_operator;
SELECT throws_ok($$SELECT inbox.create_python_replay_plan('tap-py-1', 'tap-py', 'credit', 'svc.handlers', 'v2', 'n')$$,
                 '22023', NULL, 'create: handler must be module:function');
SELECT throws_ok($$SELECT inbox.create_python_replay_plan('tap-py-1', 'tap-py', 'credit', 'svc:credit', 'v2', ' ')$$,
                 '22023', NULL, 'create: a note saying why');
SELECT throws_ok($$SELECT inbox.create_python_replay_plan('tap-py-1', 'tap-py', 'credit', 'svc:credit', NULL, 'n')$$,
                 '22004', NULL, 'create: a handler version');
SELECT throws_like($$SELECT inbox.create_python_replay_plan('tap-py-1', 'tap-nobody', 'credit', 'svc:credit', 'v2', 'n')$$,
                   '%no live role is bound to consumer ''tap-nobody''%',
                   'create: refused (42501) when no role is bound to the consumer: the operator cannot act for it');
SELECT throws_ok($$SELECT inbox.create_python_replay_plan('tap-py-1', 'replay:9', 'credit', 'svc:credit', 'v2', 'n')$$,
                 '22023', NULL, 'create: replay: consumer names are reserved');
INSERT INTO p SELECT 'py', plan_id FROM inbox.create_python_replay_plan('tap-py-1', 'tap-py', 'credit', 'svc.handlers:credit',
                                                                         'v2', 'credit fix, OPS-12');
SELECT is((SELECT inbox.add_replay_items((SELECT id FROM p WHERE name = 'py'),
          '[{"producer": "p", "message_id": "m1", "payload": {"n": 1}},
            {"producer": "p", "message_id": "m2", "payload": {"n": 2}},
            {"producer": "p", "message_id": "m3", "payload": {"n": 3}},
            {"producer": "p", "message_id": "m4", "payload": {"n": 4}}]')), 4, 'items are added as to any plan');
INSERT INTO p SELECT 'acme', plan_id FROM inbox.create_python_replay_plan('tap-py-2', 'tap-py', 'credit', 'svc.handlers:credit',
                                                                           'v2', 'acme too');
SELECT is((SELECT inbox.add_replay_items((SELECT id FROM p WHERE name = 'acme'),
          '[{"producer": "p", "message_id": "a1", "tenant": "acme", "payload": {"n": 5}}]')), 1, 'an acme item');
SELECT throws_like($$SELECT inbox.create_python_replay_plan('tap-py-1', 'tap-py', 'credit', 'svc:credit', 'v2', 'n')$$,
                   '%already exists%', 'create: plan names are never reused');
RESET ROLE;
SELECT results_eq($$SELECT handler IS NULL, python_handler, handler_version, takes_context, status, created_by
                      FROM inbox.replay_plan WHERE plan_id = (SELECT id FROM p WHERE name = 'py')$$,
                  $$VALUES (true, 'svc.handlers:credit'::text, 'v2'::text, false, 'open'::text, (session_user::text COLLATE "default"))$$,
                  'the plan names the Python handler, no SQL handler');
SELECT results_eq($$SELECT decision, handler, handler_version, note FROM inbox.replay_decision
                     WHERE plan_id = (SELECT id FROM p WHERE name = 'py') ORDER BY decision_id$$,
                  $$VALUES ('create'::text, 'svc.handlers:credit'::text, 'v2'::text, 'credit fix, OPS-12'::text),
                           ('add_items', 'svc.handlers:credit', 'v2', NULL)$$,
                  'audited: the approval names the Python handler and version');
SELECT results_eq($$SELECT handler, pin_matches, pending FROM inbox.replay_status WHERE plan_id = (SELECT id FROM p WHERE name = 'py')$$,
                  $$VALUES ('svc.handlers:credit'::text, true, 4::bigint)$$,
                  'replay_status shows the Python handler; its pin is its own');
SELECT throws_ok($$INSERT INTO inbox.replay_plan (plan_name, consumer, message_type, handler, python_handler, handler_version,
                                                  takes_context, note)
                   VALUES ('both', 'tap-py', 'credit', 'pg_catalog.jsonb_typeof(jsonb)', 'svc:credit', 'v1', false, 'n')$$,
                 '23514', NULL, 'a plan names a SQL handler or a Python one, not both');
-- A plan of the SQL kind (inserted directly: no SQL handler is registered here).
INSERT INTO inbox.replay_plan (plan_name, consumer, message_type, handler, handler_version, takes_context, note)
VALUES ('tap-py-sql', 'tap-py', 'credit', 'pg_catalog.jsonb_typeof(jsonb)', 'v2', false, 'n');
INSERT INTO p SELECT 'sql', plan_id FROM inbox.replay_plan WHERE plan_name = 'tap-py-sql';

-- ------------------------------------------------------------------ the SQL runner refuses a Python plan
SET ROLE tap_py_operator;
SELECT throws_like($$SELECT inbox.run_replay_plan((SELECT id FROM p WHERE name = 'py'))$$,
                   '%runs the Python handler ''svc.handlers:credit''%', 'run_replay_plan refuses a Python plan (55000)');
SELECT throws_ok($$SELECT inbox.accept_replay_version((SELECT id FROM p WHERE name = 'py'), 'pg_catalog.jsonb_typeof(jsonb)', 'v3', 'n')$$,
                 '55000', NULL, 'a Python plan keeps the handler it was approved for');
RESET ROLE;

-- ------------------------------------------------------------------ who may run it
SET ROLE tap_py_operator;
SELECT throws_ok($$SELECT inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit')$$,
                 '42501', NULL, 'an operator cannot run it (no consumer rights)');
RESET ROLE;
SET ROLE tap_py_both;
SELECT throws_like($$SELECT inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit')$$,
                   '%may not run replay plan%only a login of a role bound to consumer ''tap-py''%',
                   'an operator who consumes for another consumer cannot run it: the handler would not run as tap-py');
RESET ROLE;
SET ROLE tap_py_other;
SELECT throws_ok($$SELECT inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit')$$,
                 '42501', NULL, 'another consumer''s login cannot run it');
RESET ROLE;
SELECT throws_like($$SELECT inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit')$$,
                   '%may not run replay plan%', 'a superuser cannot run it either: no superuser exception');
SET SESSION AUTHORIZATION tap_py_login;
SELECT throws_like($$SELECT inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'evil:handler')$$,
                   '%is approved for handler ''svc.handlers:credit'', not ''evil:handler''%',
                   'the login runs the handler the operator approved');
SELECT throws_like($$SELECT inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'sql'), 'svc.handlers:credit')$$,
                   '%is not approved for a Python handler%', 'a plan of a SQL handler is not approved for Python (42501)');
SELECT throws_ok($$SELECT inbox.begin_python_replay_item(-1, 'svc:credit')$$, 'P0002', NULL, 'an unknown plan');
RESET SESSION AUTHORIZATION;
SELECT is((SELECT count(*)::int FROM inbox.replay_item WHERE plan_id = (SELECT id FROM p WHERE name = 'py') AND status <> 'pending'),
          0, 'no refused run touched an item');

-- ------------------------------------------------------------------ the handler fails: its transaction rolls back
INSERT INTO p SELECT 'm1', item_no FROM inbox.replay_item WHERE plan_id = (SELECT id FROM p WHERE name = 'py') AND message_id = 'm1';
SET SESSION AUTHORIZATION tap_py_login;
SAVEPOINT handler_fails;
INSERT INTO taken (s) SELECT s FROM inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit') s;
SELECT results_eq($$SELECT (s).action, (s).consumer, (s).producer, (s).message_id, (s).message_type, (s).payload, (s).handler_version
                      FROM taken ORDER BY n DESC LIMIT 1$$,
                  $$VALUES ('run'::text, 'tap-py'::text, 'p'::text, 'm1'::text, 'credit'::text, '{"n": 1}'::jsonb, 'v2'::text)$$,
                  'begin_python_replay_item hands the first item to the consumer''s login');
ROLLBACK TO SAVEPOINT handler_fails;   -- what the client does when the Python handler raises
SELECT is(inbox.python_replay_item_failed((SELECT id FROM p WHERE name = 'py'),
                                          (SELECT id FROM p WHERE name = 'm1'),
                                          'svc.handlers:credit', 'LookupError', 'no account 1'),
          true, 'python_replay_item_failed records the failure');
SELECT is(inbox.python_replay_item_failed((SELECT id FROM p WHERE name = 'py'),
                                          (SELECT id FROM p WHERE name = 'm1'),
                                          'svc.handlers:credit', 'LookupError', 'again'),
          false, 'an item no longer pending keeps its outcome');
RESET SESSION AUTHORIZATION;
SELECT results_eq($$SELECT status, reason_code, error_message, finished_by FROM inbox.replay_item
                     WHERE plan_id = (SELECT id FROM p WHERE name = 'py') AND message_id = 'm1'$$,
                  $$VALUES ('failed'::text, 'LookupError'::text, 'no account 1'::text, 'tap_py_login'::text)$$,
                  'the failed item: reason, message, the login that ran it');
SELECT is((SELECT count(*)::int FROM inbox.message WHERE consumer = 'replay:' || (SELECT id FROM p WHERE name = 'py')), 0,
          'the failed item''s operation id was rolled back with the handler');

-- ------------------------------------------------------------------ applied, skipped, completed
SET SESSION AUTHORIZATION tap_py_login;
INSERT INTO taken (s) SELECT s FROM inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit') s;
INSERT INTO taken (s) SELECT s FROM inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit') s;
INSERT INTO taken (s) SELECT s FROM inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit') s;
SELECT results_eq($$SELECT (s).action, (s).message_id, (s).status, (s).skipped_now FROM taken ORDER BY n$$,
                  $$VALUES ('run'::text, 'm2'::text, 'open'::text, 0), ('run', 'm3', 'open', 0),
                           ('done', NULL, 'completed', 1)$$,
                  'm2 and m3 run; m4 (processed by v2 already) is skipped; then the plan completes');
SELECT throws_like($$SELECT inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'py'), 'svc.handlers:credit')$$,
                   '%is already completed%', 'a completed plan is refused (55000)');
RESET SESSION AUTHORIZATION;
SELECT results_eq($$SELECT message_id, status, coalesce(reason_code, ''), finished_by FROM inbox.replay_item
                     WHERE plan_id = (SELECT id FROM p WHERE name = 'py') ORDER BY item_no$$,
                  $$VALUES ('m1'::text, 'failed'::text, 'LookupError'::text, 'tap_py_login'::text),
                           ('m2', 'applied', '', 'tap_py_login'), ('m3', 'applied', '', 'tap_py_login'),
                           ('m4', 'skipped', 'same_version', 'tap_py_login')$$,
                  'each item''s outcome, finished by the consumer''s login');
SELECT is((SELECT count(*)::int FROM inbox.message WHERE consumer = 'replay:' || (SELECT id FROM p WHERE name = 'py')), 2,
          'one claimed operation id per applied item');
SELECT results_eq($$SELECT status, (SELECT count(*)::int FROM inbox.retention_hold WHERE holder = 'replay:' || plan_id)
                      FROM inbox.replay_plan WHERE plan_id = (SELECT id FROM p WHERE name = 'py')$$,
                  $$VALUES ('completed'::text, 0)$$, 'the plan is completed and its retention holds are gone');
SELECT results_eq($$SELECT decision, handler, items FROM inbox.replay_decision
                     WHERE plan_id = (SELECT id FROM p WHERE name = 'py') ORDER BY decision_id DESC LIMIT 1$$,
                  $$VALUES ('completed'::text, 'svc.handlers:credit'::text, 4)$$, 'the completion is audited');

-- ------------------------------------------------------------------ tenants
SET SESSION AUTHORIZATION tap_py_globex;
INSERT INTO taken (s) SELECT s FROM inbox.begin_python_replay_item((SELECT id FROM p WHERE name = 'acme'), 'svc.handlers:credit') s;
SELECT results_eq($$SELECT (s).action, (s).failed_now FROM taken ORDER BY n DESC LIMIT 1$$, $$VALUES ('done'::text, 1)$$,
                  'a login bound for another tenant runs nothing of tenant acme');
RESET SESSION AUTHORIZATION;
SELECT results_eq($$SELECT status, reason_code FROM inbox.replay_item WHERE plan_id = (SELECT id FROM p WHERE name = 'acme')$$,
                  $$VALUES ('failed'::text, '42501'::text)$$, 'its acme item is recorded failed (42501)');

-- ------------------------------------------------------------------ privileges
SELECT function_privs_are('inbox', 'create_python_replay_plan', ARRAY['text', 'text', 'text', 'text', 'text', 'text'], r, pr,
                          format('%s: EXECUTE on create_python_replay_plan is %s', r, pr))
  FROM (VALUES ('inbox_operator', ARRAY['EXECUTE']), ('inbox_consumer', ARRAY[]::text[])) AS v(r, pr);
SELECT function_privs_are('inbox', 'begin_python_replay_item', ARRAY['bigint', 'text'], r, pr,
                          format('%s: EXECUTE on begin_python_replay_item is %s', r, pr))
  FROM (VALUES ('inbox_consumer', ARRAY['EXECUTE']), ('inbox_operator', ARRAY[]::text[])) AS v(r, pr);
SELECT is_definer('inbox', 'python_replay_item_failed', ARRAY['bigint', 'bigint', 'text', 'text', 'text'],
                  'python_replay_item_failed is SECURITY DEFINER');

SELECT * FROM finish();
ROLLBACK;
