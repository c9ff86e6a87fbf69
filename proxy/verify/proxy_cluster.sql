BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;
SELECT 1 / (count(*) = 1)::integer FROM pg_catalog.pg_extension WHERE extname = 'plproxy';
SELECT tenant, partition, moving, placed_at, placed_by, note FROM inbox.tenant_placement WHERE false;
SELECT 1 / (inbox.tenant_hash('') = pg_catalog.hashtext(''))::integer;
SELECT has_function_privilege('inbox.configure_shards(text[])', 'EXECUTE');
SELECT 1 / (NOT has_function_privilege('public', 'inbox.configure_shards(text[])', 'EXECUTE'))::integer;
SELECT has_function_privilege('inbox.tenant_partition(text)', 'EXECUTE'),
       has_function_privilege('inbox.shard_of(text)', 'EXECUTE'),
       has_function_privilege('inbox.begin_tenant_move(text, text)', 'EXECUTE'),
       has_function_privilege('inbox.place_tenant(text, integer, text)', 'EXECUTE');
ROLLBACK;
