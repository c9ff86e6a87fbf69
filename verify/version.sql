-- Verify pginbox:version
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT 1 / (inbox.schema_version() >= 3)::integer;
SELECT 1 / (r.version = inbox.schema_version() AND r.breaking_since BETWEEN 1 AND r.version AND r.release <> '')::integer
  FROM inbox.schema_release() r;
SELECT 1 / (pg_catalog.has_function_privilege(r, 'inbox.schema_release()', 'EXECUTE')
            AND pg_catalog.has_function_privilege(r, 'inbox.schema_version()', 'EXECUTE'))::integer
  FROM unnest(ARRAY['inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_dispatcher']) r;
SELECT 1 / (NOT pg_catalog.has_function_privilege('public', 'inbox.schema_release()', 'EXECUTE'))::integer;

ROLLBACK;
