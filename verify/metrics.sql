-- Verify pginbox:metrics
BEGIN;

SELECT consumer, producer, first_seen, duplicates, conflicts, failures, quarantined, recovered, unprotected
  FROM inbox.metric_summary WHERE false;
-- The claim's duplicate hook is this change's version, not the no-ops of sql/025_hooks.sql.
SELECT 1 / (p.prosrc LIKE '%metric_event%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._count_duplicate(text, text)'::regprocedure;
SELECT 'inbox._count_failure()'::regprocedure,
       'inbox._check_rollup_batch(text, integer)'::regprocedure,
       'inbox._metrics_rollup(integer)'::regprocedure,
       'inbox.metrics_rollup(integer)'::regprocedure,
       'inbox.configure_metrics(boolean, interval, integer)'::regprocedure,
       'inbox._metric_events()'::regprocedure,
       'inbox.metrics()'::regprocedure;
SELECT 1 / count(*) FROM pg_catalog.pg_trigger
 WHERE tgrelid = 'inbox.attempt'::regclass AND tgname = 'attempt_count_failure_insert';
SELECT 1 / count(*) FROM pg_catalog.pg_trigger
 WHERE tgrelid = 'inbox.attempt'::regclass AND tgname = 'attempt_count_failure_update';
-- 0.2.0: no rows estimate before the first ANALYZE.
SELECT 1 / (pg_catalog.pg_get_functiondef('inbox.metrics()'::regprocedure) LIKE '%c.reltuples >= 0%')::integer;
-- Grants: readers read metrics, operators also configure and roll up, consumers do neither.
SELECT 1 / (pg_catalog.has_function_privilege('inbox_reader', 'inbox.metrics()', 'EXECUTE')
            AND pg_catalog.has_function_privilege('inbox_operator', 'inbox.metrics()', 'EXECUTE')
            AND pg_catalog.has_function_privilege('inbox_operator', 'inbox.metrics_rollup(integer)', 'EXECUTE')
            AND pg_catalog.has_function_privilege('inbox_operator',
                                                  'inbox.configure_metrics(boolean, interval, integer)', 'EXECUTE')
            AND pg_catalog.has_table_privilege('inbox_reader', 'inbox.metric_summary', 'SELECT')
            AND NOT pg_catalog.has_function_privilege('inbox_consumer', 'inbox.metrics()', 'EXECUTE')
            AND NOT pg_catalog.has_function_privilege('inbox_reader', 'inbox.metrics_rollup(integer)', 'EXECUTE')
            AND NOT pg_catalog.has_table_privilege('inbox_consumer', 'inbox.metric_event', 'INSERT'))::integer;

ROLLBACK;
