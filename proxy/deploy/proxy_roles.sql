-- pginbox proxy: the NOLOGIN group roles of the main schema (sql/010_roles.sql), created when
-- missing (roles are cluster-wide: a proxy database next to a shard shares them). Callers log in
-- as their own roles, members of these; the proxy connects to the shards as that same role
-- (docs/scaling.md, "Who the shards see").
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

DO $roles$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader',
                                          'inbox_dispatcher'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = role_name) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
        END IF;
    END LOOP;
END
$roles$;

COMMIT;
