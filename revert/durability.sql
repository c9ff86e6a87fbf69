-- Revert pginbox:durability: drop the durability functions, then the role inbox_monitor that owned
-- them. The role is cluster-wide: kept, with a notice, when pginbox in another database of the
-- cluster still uses it.
BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;

DROP FUNCTION IF EXISTS inbox.wait_durable(pg_lsn, integer, text, text[], interval);
DROP FUNCTION IF EXISTS inbox.commit_durable(pg_lsn, integer, text, text[]);
DROP FUNCTION IF EXISTS inbox._durable_count(pg_lsn, text, text[]);
DROP FUNCTION IF EXISTS inbox._durable_target(pg_lsn, integer, text, text[]);
REVOKE USAGE ON SCHEMA inbox FROM inbox_monitor;

DO $role$
BEGIN
    DROP ROLE IF EXISTS inbox_monitor;
EXCEPTION WHEN dependent_objects_still_exist THEN
    RAISE NOTICE 'role inbox_monitor kept: % (pginbox deployed in another database of this cluster?)', SQLERRM;
END
$role$;

COMMIT;
