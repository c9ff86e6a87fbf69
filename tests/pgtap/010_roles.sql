-- pgTAP: sql/010_roles.sql — the four NOLOGIN group roles.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(26);

SELECT has_role(r, 'role ' || r || ' exists')
  FROM unnest(ARRAY['inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader']) r;

SELECT isnt_superuser(r, 'role ' || r || ' is not a superuser')
  FROM unnest(ARRAY['inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader']) r;

SELECT is((SELECT rolcanlogin FROM pg_catalog.pg_roles WHERE rolname = r), false, 'role ' || r || ' is NOLOGIN')
  FROM unnest(ARRAY['inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader']) r;

SELECT is((SELECT rolcreaterole OR rolcreatedb OR rolreplication OR rolbypassrls
             FROM pg_catalog.pg_roles WHERE rolname = r),
          false, 'role ' || r || ' has no CREATEROLE, CREATEDB, REPLICATION or BYPASSRLS')
  FROM unnest(ARRAY['inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader']) r;

-- The roles are separate: no group role is a member of another (the contract says the operator
-- is NOT a consumer), so no role inherits another's rights.
SELECT is((SELECT count(*)::integer FROM pg_catalog.pg_auth_members m
             JOIN pg_catalog.pg_roles g ON g.oid = m.roleid
            WHERE m.member = (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = r)
              AND g.rolname LIKE 'inbox\_%'),
          0, 'role ' || r || ' is a member of no other inbox role')
  FROM unnest(ARRAY['inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader']) r;

SELECT isnt_member_of('inbox_consumer', ARRAY['inbox_operator'], 'inbox_operator is not a member of inbox_consumer');
SELECT isnt_member_of('inbox_owner', ARRAY['inbox_consumer', 'inbox_operator', 'inbox_reader'],
                      'no working role is a member of inbox_owner');

-- No password: nobody is meant to log in as these roles.
SELECT is((SELECT count(*)::integer FROM pg_catalog.pg_authid
            WHERE rolname IN ('inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader')
              AND rolpassword IS NOT NULL),
          0, 'no inbox role has a password');

-- The schema is owned by inbox_owner and only the three working roles may use it.
SELECT schema_owner_is('inbox', 'inbox_owner', 'schema inbox is owned by inbox_owner');
SELECT is(pg_catalog.has_schema_privilege('public', 'inbox', 'USAGE'), false, 'PUBLIC has no USAGE on schema inbox');
SELECT ok(pg_catalog.has_schema_privilege('inbox_consumer', 'inbox', 'USAGE')
          AND pg_catalog.has_schema_privilege('inbox_operator', 'inbox', 'USAGE')
          AND pg_catalog.has_schema_privilege('inbox_reader', 'inbox', 'USAGE')
          AND NOT pg_catalog.has_schema_privilege('inbox_consumer', 'inbox', 'CREATE')
          AND NOT pg_catalog.has_schema_privilege('inbox_operator', 'inbox', 'CREATE')
          AND NOT pg_catalog.has_schema_privilege('inbox_reader', 'inbox', 'CREATE'),
          'consumer, operator and reader may use schema inbox but not create in it');

SELECT * FROM finish();
ROLLBACK;
