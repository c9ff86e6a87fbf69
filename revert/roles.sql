-- Revert pginbox:roles
-- Roles are cluster-wide. A role that something still depends on (usually pginbox deployed in
-- another database of the cluster) cannot be dropped and is kept, with a notice saying why.
BEGIN;

DO $roles$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['inbox_dispatcher', 'inbox_reader', 'inbox_operator', 'inbox_consumer',
                                          'inbox_owner'] LOOP
        BEGIN
            EXECUTE format('DROP ROLE IF EXISTS %I', role_name);
        EXCEPTION WHEN dependent_objects_still_exist THEN
            RAISE NOTICE 'role % kept: % (pginbox deployed in another database of this cluster?)', role_name, SQLERRM;
        END;
    END LOOP;
END
$roles$;

COMMIT;
