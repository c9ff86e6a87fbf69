-- pgTAP: sql/115_durability.sql — is a commit on the standbys? Without a standby (this test's
-- cluster) no commit is durable by standby: commit_durable is false and wait_durable returns false
-- at its timeout, never true. tests/python/e2e/test_failover.py runs them against a real standby.
-- Not in one transaction, unlike the other files: the functions refuse to run inside a transaction
-- that wrote, and pgTAP writes its results to temporary tables (each SELECT below is a transaction
-- of its own, whose function arguments run before pgTAP records them). Cleans up its roles.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

DROP ROLE IF EXISTS tap_durable_consumer, tap_durable_nobody;
SELECT plan(22);

SELECT has_function('inbox', 'commit_durable', ARRAY['pg_lsn', 'integer', 'text', 'text[]'], 'inbox.commit_durable exists');
SELECT has_function('inbox', 'wait_durable', ARRAY['pg_lsn', 'integer', 'text', 'text[]', 'interval'],
                    'inbox.wait_durable exists');
SELECT function_returns('inbox', 'wait_durable', ARRAY['pg_lsn', 'integer', 'text', 'text[]', 'interval'], 'boolean',
                        'inbox.wait_durable returns boolean');
SELECT ok(pg_catalog.pg_has_role('inbox_monitor', 'pg_read_all_stats', 'USAGE'),
          'inbox_monitor reads the standbys'' positions (pg_read_all_stats, granted by a superuser deploy)');

-- No standby: never durable, whatever the position.
SELECT is(inbox.commit_durable(), false, 'no standby: commit_durable() is false');
SELECT is(inbox.commit_durable('0/0'::pg_lsn), false, 'no standby: even position 0/0 is not on a standby');
SELECT is(inbox.commit_durable(NULL, 1, 'apply'), false, 'no standby: not applied anywhere either');
SELECT is(inbox.wait_durable(timeout => '30 ms'), false, 'no standby: wait_durable returns false at its timeout');
SELECT ok((SELECT pg_catalog.clock_timestamp() - t >= interval '30 ms'
             FROM (SELECT pg_catalog.clock_timestamp() AS t) s, LATERAL inbox.wait_durable(timeout => '30 ms') w),
          'wait_durable waited its whole timeout before it said false');
SELECT is(inbox.wait_durable(timeout => '0'), false, 'a zero timeout checks once');

-- Bad arguments: a stable SQLSTATE and what to fix, before anything is read.
SELECT throws_ok($$SELECT inbox.commit_durable(NULL, 0)$$, '22023',
                 'pginbox: min_standbys must be between 1 and 64, not 0', 'min_standbys 0 refused');
SELECT throws_ok($$SELECT inbox.commit_durable(NULL, NULL)$$, '22023',
                 'pginbox: min_standbys must be between 1 and 64, not NULL', 'min_standbys NULL refused');
SELECT throws_ok($$SELECT inbox.commit_durable(NULL, 65)$$, '22023', NULL, 'min_standbys 65 refused');
SELECT throws_ok($$SELECT inbox.commit_durable(NULL, 1, 'write')$$, '22023',
                 'pginbox: durability mode must be ''flush'' or ''apply'', not ''write''', 'mode write refused');
SELECT throws_ok($$SELECT inbox.commit_durable(NULL, 1, NULL)$$, '22023', NULL, 'mode NULL refused');
SELECT throws_ok($$SELECT inbox.commit_durable(NULL, 1, 'flush', ARRAY[]::text[])$$, '22023', NULL,
                 'an empty standby_names refused (NULL means any)');
SELECT throws_ok($$SELECT inbox.commit_durable(NULL, 1, 'flush', ARRAY['s1', ' '])$$, '22023', NULL,
                 'a blank standby name refused');
SELECT throws_ok($$SELECT inbox.wait_durable(timeout => '-1 s')$$, '22023', NULL, 'a negative timeout refused');
SELECT throws_ok($$SELECT inbox.wait_durable(timeout => '2 hours')$$, '22023', NULL, 'a timeout over 1 hour refused');

-- Asked inside the transaction it would wait for: refused (its commit record is not written yet).
BEGIN;
CREATE TEMP TABLE tap_durable_probe (x integer);
INSERT INTO tap_durable_probe VALUES (1);
SELECT throws_ok($$SELECT inbox.wait_durable(timeout => '0')$$, '25001',
                 'pginbox: the durability of a commit is asked after its COMMIT, not inside a transaction that wrote',
                 'inside a transaction that wrote: refused with 25001');
COMMIT;

-- A consumer may call them; PUBLIC may not.
CREATE ROLE tap_durable_consumer NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_durable_nobody NOLOGIN;
SET ROLE tap_durable_consumer;
SELECT is(inbox.commit_durable(), false, 'a consumer role without monitoring rights calls commit_durable');
RESET ROLE;
SET ROLE tap_durable_nobody;
SELECT throws_ok($$SELECT inbox.commit_durable()$$, '42501', NULL, 'a role without a grant may not call it');
RESET ROLE;

SELECT * FROM finish();
DROP ROLE tap_durable_consumer, tap_durable_nobody;
