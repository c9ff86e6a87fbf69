-- pgTAP: sql/121_python_repair.sql — repair grants for Python handlers: the operator grants, a login
-- of the consumer's own role redeems in its transaction (the handler runs there), every refusal
-- before anything is written, and the audit trail.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(44);

-- ------------------------------------------------------------------ fixtures
CREATE ROLE tap_pr_operator NOLOGIN;
GRANT inbox_operator TO tap_pr_operator;
CREATE ROLE tap_pr_service NOLOGIN;                 -- the role bound to consumer tap-pr
GRANT inbox_consumer TO tap_pr_service;
CREATE ROLE tap_pr_login LOGIN IN ROLE tap_pr_service;  -- the consumer service's login
CREATE ROLE tap_pr_other LOGIN;                     -- another service: bound to another consumer
GRANT inbox_consumer TO tap_pr_other;
CREATE ROLE tap_pr_both LOGIN;                      -- an operator who also consumes, elsewhere
GRANT inbox_operator, inbox_consumer TO tap_pr_both;
SELECT inbox.bind_consumer('tap-pr', 'tap_pr_service', note => 'pgTAP') \g /dev/null
SELECT inbox.bind_consumer('tap-pr-other', 'tap_pr_other', note => 'pgTAP') \g /dev/null
SELECT inbox.bind_consumer('tap-pr-other', 'tap_pr_both', note => 'pgTAP') \g /dev/null
SELECT inbox.configure_consumer('tap-pr', max_attempts => 1) \g /dev/null
CREATE TEMP TABLE entry (name text PRIMARY KEY, id bigint NOT NULL);
CREATE TEMP TABLE g (name text PRIMARY KEY, id bigint NOT NULL);
CREATE TEMP TABLE redeemed (name text PRIMARY KEY, r inbox.granted_repair);
GRANT ALL ON entry, g, redeemed TO PUBLIC;

-- The consumer's login records failures (max_attempts 1: each is quarantined at once).
SET ROLE tap_pr_login;
INSERT INTO entry SELECT 'ok', quarantine_id
  FROM inbox.record_failure('tap-pr', 'p', 'm1', '{"n": 1}', 'X1', message_type => 'credit', tenant => 'acme');
INSERT INTO entry SELECT 'fails', quarantine_id FROM inbox.record_failure('tap-pr', 'p', 'm2', '{"n": 2}', 'X1');
INSERT INTO entry SELECT 'expires', quarantine_id FROM inbox.record_failure('tap-pr', 'p', 'm3', '{"n": 3}', 'X1');
INSERT INTO entry SELECT 'unbound', quarantine_id FROM inbox.record_failure('tap-pr', 'p', 'm4', '{"n": 4}', 'X1');
SELECT inbox.claim('tap-pr', 'p', 'c1', '{"n": 5}') \g /dev/null
INSERT INTO entry SELECT 'conflict', quarantine_id FROM inbox.claim('tap-pr', 'p', 'c1', '{"n": 6}');
RESET ROLE;
SELECT is((SELECT count(*)::int FROM inbox.quarantine q JOIN entry e ON e.id = q.quarantine_id WHERE q.status = 'open'),
          5, 'five open entries, recorded by the consumer''s login');

-- ------------------------------------------------------------------ granting (operator)
SET ROLE tap_pr_login;
SELECT throws_ok($$SELECT inbox.grant_repair((SELECT id FROM entry WHERE name = 'ok'), 'svc.handlers:credit', 'n')$$,
                 '42501', NULL, 'a consumer cannot grant itself a repair');
RESET ROLE;
SET ROLE tap_pr_operator;
SELECT throws_ok($$SELECT inbox.grant_repair((SELECT id FROM entry WHERE name = 'ok'), 'svc.handlers', 'n')$$,
                 '22023', NULL, 'grant: handler must be module:function');
SELECT throws_ok($$SELECT inbox.grant_repair((SELECT id FROM entry WHERE name = 'ok'), 'svc:credit', 'n', valid_for => '2 days')$$,
                 '22023', NULL, 'grant: valid_for at most 1 day');
SELECT throws_ok($$SELECT inbox.grant_repair((SELECT id FROM entry WHERE name = 'ok'), 'svc:credit', '  ')$$,
                 '22023', NULL, 'grant: a note saying why');
SELECT throws_ok($$SELECT inbox.grant_repair(-1, 'svc:credit', 'n')$$, 'P0002', NULL, 'grant: an unknown entry');
SELECT throws_ok($$SELECT inbox.grant_repair((SELECT id FROM entry WHERE name = 'conflict'), 'svc:credit', 'n')$$,
                 '55000', NULL, 'grant: a conflict entry cannot be repaired');
RESET ROLE;
SELECT inbox.unbind_consumer('tap-pr', 'tap_pr_service') \g /dev/null
SET ROLE tap_pr_operator;
SELECT throws_like($$SELECT inbox.grant_repair((SELECT id FROM entry WHERE name = 'unbound'), 'svc:credit', 'n')$$,
                   '%no live role is bound to consumer ''tap-pr''%',
                   'grant: refused (42501) when no role is bound to the consumer: nobody could run it as the consumer');
RESET ROLE;
SELECT inbox.bind_consumer('tap-pr', 'tap_pr_service', tenants => ARRAY['globex'], note => 'pgTAP') \g /dev/null
SET ROLE tap_pr_operator;
SELECT throws_like($$SELECT inbox.grant_repair((SELECT id FROM entry WHERE name = 'ok'), 'svc:credit', 'n')$$,
                   '%for tenant ''acme''%', 'grant: refused when the consumer''s role is not bound for the entry''s tenant');
RESET ROLE;
SELECT inbox.bind_consumer('tap-pr', 'tap_pr_service', note => 'pgTAP') \g /dev/null
SELECT is((SELECT count(*)::int FROM inbox.repair_grant), 0, 'no grant was written by a refused call');
SET ROLE tap_pr_operator;
INSERT INTO g SELECT 'ok', grant_id FROM inbox.grant_repair((SELECT id FROM entry WHERE name = 'ok'), 'svc.handlers:credit',
                                                           'fixed the rounding bug, OPS-9', handler_version => 'v2');
INSERT INTO g SELECT 'fails', grant_id FROM inbox.grant_repair((SELECT id FROM entry WHERE name = 'fails'), 'svc:credit', 'try');
INSERT INTO g SELECT 'expires', grant_id
  FROM inbox.grant_repair((SELECT id FROM entry WHERE name = 'expires'), 'svc:credit', 'soon', valid_for => '1 second');
RESET ROLE;
SELECT results_eq($$SELECT consumer, tenant, handler, handler_version, granted_by, redeemed_at IS NULL
                      FROM inbox.repair_grant WHERE grant_id = (SELECT id FROM g WHERE name = 'ok')$$,
                  $$VALUES ('tap-pr'::text, 'acme'::text, 'svc.handlers:credit'::text, 'v2'::text, (session_user::text COLLATE "default"), true)$$,
                  'the grant records consumer, tenant, handler, version and the operator (session user)');
SELECT is((SELECT status FROM inbox.quarantine WHERE quarantine_id = (SELECT id FROM entry WHERE name = 'ok')), 'open',
          'granting changes nothing on the entry');

-- ------------------------------------------------------------------ who may redeem
SET ROLE tap_pr_operator;
SELECT throws_ok($$SELECT inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'ok'), 'svc.handlers:credit')$$,
                 '42501', NULL, 'an operator cannot redeem (no consumer rights)');
RESET ROLE;
SET ROLE tap_pr_both;
SELECT throws_like($$SELECT inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'ok'), 'svc.handlers:credit')$$,
                   '%may not run repair grant%only a login of a role bound to consumer ''tap-pr''%',
                   'an operator who consumes for another consumer cannot redeem: the handler would not run as tap-pr');
RESET ROLE;
SET ROLE tap_pr_other;
SELECT throws_ok($$SELECT inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'ok'), 'svc.handlers:credit')$$,
                 '42501', NULL, 'another consumer''s login cannot redeem');
RESET ROLE;
SELECT throws_like($$SELECT inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'ok'), 'svc.handlers:credit')$$,
                   '%may not run repair grant%', 'a superuser cannot redeem either: no superuser exception');
SET ROLE tap_pr_login;
SELECT throws_like($$SELECT inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'ok'), 'evil:handler')$$,
                   '%is for handler ''svc.handlers:credit''%', 'the redeemer runs the handler the operator chose');
SELECT throws_ok($$SELECT inbox.begin_granted_repair(-1, 'svc:credit')$$, 'P0002', NULL, 'an unknown grant');
SELECT throws_ok($$SELECT inbox.begin_granted_repair(NULL, 'svc:credit')$$, '22004', NULL, 'a NULL grant');
RESET ROLE;
SELECT is((SELECT count(*)::int FROM inbox.repair_grant WHERE redeemed_at IS NOT NULL), 0,
          'no refused redemption used a grant');

-- ------------------------------------------------------------------ the handler fails: everything rolls back
SET ROLE tap_pr_login;
SAVEPOINT handler_fails;
INSERT INTO redeemed SELECT 'rolled-back', r FROM inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'ok'),
                                                                               'svc.handlers:credit') r;
SELECT is((SELECT (r).payload FROM redeemed WHERE name = 'rolled-back'), '{"n": 1}'::jsonb,
          'begin_granted_repair returns the stored payload to the consumer''s login');
ROLLBACK TO SAVEPOINT handler_fails;   -- what the client does when the Python handler raises
RESET ROLE;
SELECT results_eq($$SELECT q.status, g.redeemed_at IS NULL, m.status::text
                      FROM inbox.quarantine q JOIN inbox.repair_grant g USING (quarantine_id)
                      JOIN inbox.message m ON (m.consumer, m.tenant, m.producer, m.message_id)
                                            = (q.consumer, q.tenant, q.producer, q.message_id)
                     WHERE g.grant_id = (SELECT id FROM g WHERE name = 'ok')$$,
                  $$VALUES ('open'::text, true, 'quarantined'::text)$$,
                  'a rolled-back redemption leaves the entry open, the grant unused and the identity held');

-- ------------------------------------------------------------------ redeemed
SET ROLE tap_pr_login;
INSERT INTO redeemed SELECT 'ok', r FROM inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'ok'),
                                                                       'svc.handlers:credit') r;
SELECT results_eq($$SELECT (r).consumer, (r).tenant, (r).producer, (r).message_id, (r).message_type, (r).handler_version
                      FROM redeemed WHERE name = 'ok'$$,
                  $$VALUES ('tap-pr'::text, 'acme'::text, 'p'::text, 'm1'::text, 'credit'::text, 'v2'::text)$$,
                  'the message for the handler: identity, type, the granted handler version');
RESET ROLE;
SELECT results_eq($$SELECT m.status::text, m.handler_version FROM inbox.message m
                     WHERE m.consumer = 'tap-pr' AND m.tenant = 'acme' AND m.message_id = 'm1'$$,
                  $$VALUES ('processed'::text, 'v2'::text)$$, 'the identity is processed, by the granted version');
SELECT results_eq($$SELECT status, decided_by FROM inbox.quarantine WHERE quarantine_id = (SELECT id FROM entry WHERE name = 'ok')$$,
                  $$VALUES ('recovered'::text, (session_user::text COLLATE "default"))$$, 'the entry is recovered, decided by the granting operator');
SELECT results_eq($$SELECT decision, result, decided_by, note FROM inbox.quarantine_decision
                     WHERE quarantine_id = (SELECT id FROM entry WHERE name = 'ok')$$,
                  format($$VALUES ('repair'::text, 'recovered'::text, %L::text,
                                   'fixed the rounding bug, OPS-9 [python handler svc.handlers:credit, run by tap_pr_login, grant %s]'::text)$$,
                         session_user, (SELECT id FROM g WHERE name = 'ok')),
                  'audited like inbox.repair: a repair decision, with the handler and the login that ran it in the note');
SELECT results_eq($$SELECT redeemed_by, result FROM inbox.repair_grant WHERE grant_id = (SELECT id FROM g WHERE name = 'ok')$$,
                  $$VALUES ('tap_pr_login'::text, 'recovered'::text)$$, 'the grant is used, by the consumer''s login');
SELECT is((SELECT outcome FROM inbox.claim('tap-pr', 'p', 'm1', '{"n": 1}', tenant => 'acme')), 'duplicate',
          'a redelivery of the repaired message is a duplicate');
SET ROLE tap_pr_login;
SELECT throws_like($$SELECT inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'ok'), 'svc.handlers:credit')$$,
                   '%was already used by tap_pr_login%', 'a grant runs once');
RESET ROLE;

-- ------------------------------------------------------------------ the handler failed: audited, entry stays open
SET ROLE tap_pr_login;
SELECT is((SELECT result FROM inbox.granted_repair_failed((SELECT id FROM g WHERE name = 'fails'), 'svc:credit',
                                                         'ValueError', 'still broken')),
          'repair_failed', 'granted_repair_failed audits the failure');
SELECT throws_like($$SELECT inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'fails'), 'svc:credit')$$,
                   '%already used%', 'a failed grant is used too: the operator grants again');
RESET ROLE;
SELECT results_eq($$SELECT q.status, q.reason_code, q.error_message, d.result, d.reason_code
                      FROM inbox.quarantine q JOIN inbox.quarantine_decision d USING (quarantine_id)
                     WHERE q.quarantine_id = (SELECT id FROM entry WHERE name = 'fails')$$,
                  $$VALUES ('open'::text, 'ValueError'::text, 'still broken'::text, 'repair_failed'::text, 'ValueError'::text)$$,
                  'the entry stays open with the new reason; the decision row says repair_failed');
SET ROLE tap_pr_other;
SELECT throws_ok($$SELECT inbox.granted_repair_failed((SELECT id FROM g WHERE name = 'expires'), 'svc:credit', 'X')$$,
                 '42501', NULL, 'only the consumer''s login may record a granted repair''s failure');
RESET ROLE;

-- ------------------------------------------------------------------ expiry
SELECT pg_sleep(1.1) \g /dev/null
SET ROLE tap_pr_login;
SELECT throws_like($$SELECT inbox.begin_granted_repair((SELECT id FROM g WHERE name = 'expires'), 'svc:credit')$$,
                   '%expired at%', 'an expired grant is refused');
RESET ROLE;
SELECT is((SELECT status FROM inbox.quarantine WHERE quarantine_id = (SELECT id FROM entry WHERE name = 'expires')), 'open',
          'the expired grant''s entry stays open');

-- ------------------------------------------------------------------ the hold is gone
-- The claim is inbox.repair's (inbox._settle_hold), in this function's name. Nothing in pginbox
-- takes the hold away from an open entry; here the row is deleted by hand.
SET ROLE tap_pr_login;
INSERT INTO entry SELECT 'gone', quarantine_id FROM inbox.record_failure('tap-pr', 'p', 'm5', '{"n": 7}', 'X1');
RESET ROLE;
SET ROLE tap_pr_operator;
INSERT INTO g SELECT 'gone', grant_id FROM inbox.grant_repair((SELECT id FROM entry WHERE name = 'gone'), 'svc:credit', 'n');
RESET ROLE;
DELETE FROM inbox.message WHERE consumer = 'tap-pr' AND message_id = 'm5';
SET ROLE tap_pr_login;
SELECT throws_ok(format($$SELECT inbox.begin_granted_repair(%s, 'svc:credit')$$, (SELECT id FROM g WHERE name = 'gone')),
                 '55000',
                 format('inbox.begin_granted_repair: identity of entry %s is no longer held by quarantine',
                        (SELECT id FROM entry WHERE name = 'gone')),
                 'a grant whose entry''s hold is gone is refused (55000), in begin_granted_repair''s name');
RESET ROLE;
SELECT results_eq($$SELECT q.status, g.redeemed_at IS NULL FROM inbox.quarantine q JOIN inbox.repair_grant g USING (quarantine_id)
                     WHERE g.grant_id = (SELECT id FROM g WHERE name = 'gone')$$,
                  $$VALUES ('open'::text, true)$$, 'the refused redemption leaves the entry open and the grant unused');

-- ------------------------------------------------------------------ privileges
SELECT function_privs_are('inbox', 'grant_repair', ARRAY['bigint', 'text', 'text', 'text', 'interval'], r, p,
                          format('%s: EXECUTE on grant_repair is %s', r, p))
  FROM (VALUES ('inbox_operator', ARRAY['EXECUTE']), ('inbox_consumer', ARRAY[]::text[]),
               ('inbox_reader', ARRAY[]::text[])) AS v(r, p);
SELECT function_privs_are('inbox', 'begin_granted_repair', ARRAY['bigint', 'text'], r, p,
                          format('%s: EXECUTE on begin_granted_repair is %s', r, p))
  FROM (VALUES ('inbox_consumer', ARRAY['EXECUTE']), ('inbox_operator', ARRAY[]::text[]),
               ('inbox_reader', ARRAY[]::text[])) AS v(r, p);
SELECT table_privs_are('inbox', 'repair_grant', 'inbox_consumer', ARRAY[]::text[],
                       'inbox_consumer cannot read or write inbox.repair_grant');

SELECT * FROM finish();
ROLLBACK;
