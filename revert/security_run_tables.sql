-- Revert pginbox:security_run_tables
-- The role inbox_runner is cluster-wide: kept, with a notice, when something still depends on it
-- (pginbox deployed in another database of the cluster, or USAGE granted on a handler's schema).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DROP TABLE inbox.lock_salt;
DROP TABLE inbox.operator_run;

RESET ROLE;
DO $role$
BEGIN
    DROP ROLE IF EXISTS inbox_runner;
EXCEPTION WHEN dependent_objects_still_exist THEN
    RAISE NOTICE 'role inbox_runner kept: % (pginbox deployed in another database of this cluster?)', SQLERRM;
END
$role$;

COMMIT;
