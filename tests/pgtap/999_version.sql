-- pgTAP: sql/999_version.sql — the schema version clients check.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(9);

SELECT has_function('inbox', 'schema_version', ARRAY[]::name[], 'inbox.schema_version() exists');
SELECT function_returns('inbox', 'schema_version', ARRAY[]::name[], 'integer', 'inbox.schema_version() returns integer');
SELECT is(inbox.schema_version(), 3, 'schema_version() is 3 (release 0.3.0)');
SELECT has_function('inbox', 'schema_release', ARRAY[]::name[], 'inbox.schema_release() exists');
SELECT is((SELECT r.version FROM inbox.schema_release() r), inbox.schema_version(),
          'schema_release().version is schema_version()');
SELECT is((SELECT r.release FROM inbox.schema_release() r), '0.3.0', 'schema_release().release names the release');
SELECT ok((SELECT r.breaking_since BETWEEN 1 AND r.version FROM inbox.schema_release() r),
          'breaking_since is a released version, not a future one');
SELECT is((SELECT provolatile FROM pg_catalog.pg_proc WHERE oid = 'inbox.schema_release()'::regprocedure), 'i'::"char",
          'schema_release() is immutable: a client may cache it for a connection');
SELECT ok(NOT pg_catalog.has_function_privilege('public', 'inbox.schema_release()', 'EXECUTE'),
          'PUBLIC cannot execute inbox.schema_release()');

SELECT * FROM finish();
ROLLBACK;
