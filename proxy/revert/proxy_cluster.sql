BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;
DROP SERVER IF EXISTS inbox_shards CASCADE;
DROP SCHEMA inbox CASCADE;
REVOKE USAGE ON FOREIGN DATA WRAPPER plproxy FROM inbox_owner;
DROP EXTENSION plproxy;
DROP SCHEMA plproxy;
COMMIT;
