-- The roles are cluster-wide and shared with the main schema (and other databases): kept.
BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;
COMMIT;
