-- Verify pginbox:security_run_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT xact, consumer, tenant, handler, handler_owner, decision, started_by, started_at FROM inbox.operator_run WHERE false;
SELECT 1 / count(*)::integer FROM inbox.lock_salt WHERE octet_length(salt) >= 16;
-- inbox_runner holds no rights: no login, no membership, nobody but the owner reads these tables.
SELECT 1 / (NOT r.rolcanlogin AND NOT r.rolsuper)::integer FROM pg_catalog.pg_roles r WHERE r.rolname = 'inbox_runner';
SELECT 1 / (NOT EXISTS (SELECT FROM pg_catalog.pg_auth_members m
                         WHERE m.member = 'inbox_runner'::regrole OR m.roleid = 'inbox_runner'::regrole))::integer;
SELECT 1 / (NOT has_table_privilege(r, 'inbox.operator_run', 'SELECT, INSERT, UPDATE, DELETE')
            AND NOT has_table_privilege(r, 'inbox.lock_salt', 'SELECT'))::integer
  FROM unnest(ARRAY['inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_dispatcher', 'inbox_runner', 'public']) r;

ROLLBACK;
