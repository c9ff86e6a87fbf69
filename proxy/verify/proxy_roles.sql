BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;
SELECT 1 / (count(*) = 5)::integer
  FROM pg_catalog.pg_roles
 WHERE rolname IN ('inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_dispatcher')
   AND NOT rolcanlogin;
ROLLBACK;
