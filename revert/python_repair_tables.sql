-- Revert pginbox:python_repair_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DROP TYPE inbox.granted_repair;
DROP TABLE inbox.repair_grant;

COMMIT;
