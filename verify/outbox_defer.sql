-- Verify pginbox:outbox_defer
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT 'inbox.defer_effects(text[], bigint[], text[], text[], interval)'::regprocedure;
SELECT 1 / (NOT pg_catalog.has_function_privilege('public',
        'inbox.defer_effects(text[], bigint[], text[], text[], interval)', 'EXECUTE'))::integer;

ROLLBACK;
