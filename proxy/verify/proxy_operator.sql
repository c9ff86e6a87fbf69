BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;
SELECT has_function_privilege('inbox.shard_status()', 'EXECUTE'),
       has_function_privilege('inbox.metrics()', 'EXECUTE'),
       has_function_privilege('inbox.quarantine_entries(text, integer)', 'EXECUTE'),
       has_function_privilege('inbox.discard(text, bigint, text)', 'EXECUTE'),
       has_function_privilege('inbox.release(text, bigint, text)', 'EXECUTE'),
       has_function_privilege('inbox.repair(text, bigint, text)', 'EXECUTE');
SELECT 1 / (NOT has_function_privilege('inbox_reader', 'inbox.discard(text, bigint, text)', 'EXECUTE'))::integer;
SELECT 1 / (NOT has_function_privilege('public', 'inbox.metrics()', 'EXECUTE'))::integer;
ROLLBACK;
