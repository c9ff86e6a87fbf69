BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;
SELECT 1 / (r.version = 3)::integer FROM inbox.schema_release() r;
SELECT 1 / (inbox._shard_unreachable('XX000', 'PL/Proxy function x(1): [db] PQconnectPoll: connection refused'))::integer;
SELECT 1 / (inbox._shard_unreachable('57P01', 'x(1): [db] REMOTE FATAL: terminating connection due to administrator command'))::integer;
SELECT 1 / (NOT inbox._shard_unreachable('XX000', 'x(1): [db] REMOTE ERROR: connection to x'))::integer;
SELECT has_function_privilege('inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz)', 'EXECUTE'),
       has_function_privilege('inbox.record_start(text, text, text, text, text, jsonb, text, text)', 'EXECUTE'),
       has_function_privilege('inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text)', 'EXECUTE'),
       has_function_privilege('inbox.claim_and_apply_batch(text, jsonb)', 'EXECUTE');
SELECT 1 / (NOT has_function_privilege('public', 'inbox.claim_and_apply_batch(text, jsonb)', 'EXECUTE'))::integer;
-- the routed calls connect as their caller: none is SECURITY DEFINER
SELECT 1 / (count(*) = 0)::integer FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang
 WHERE l.lanname = 'plproxy' AND p.prosecdef;
ROLLBACK;
