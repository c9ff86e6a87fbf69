-- Verify pginbox:durability: the functions exist, SECURITY DEFINER, owned by inbox_monitor.
BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;

SELECT 1 / count(*) FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox.commit_durable(pg_lsn, integer, text, text[])'::regprocedure AND p.prosecdef
   AND p.proowner = 'inbox_monitor'::regrole;
SELECT 1 / count(*) FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox.wait_durable(pg_lsn, integer, text, text[], interval)'::regprocedure AND p.prosecdef
   AND p.proowner = 'inbox_monitor'::regrole;
SELECT 'inbox._durable_target(pg_lsn, integer, text, text[])'::regprocedure;
SELECT 'inbox._durable_count(pg_lsn, text, text[])'::regprocedure;
SELECT 1 / (NOT pg_catalog.has_function_privilege('public', 'inbox.wait_durable(pg_lsn, integer, text, text[], interval)',
                                                   'EXECUTE'))::integer;

ROLLBACK;
