-- Verify pginbox:metrics_tables
BEGIN;

SELECT singleton, counting, rollup_grace, rollup_batch, updated_at, updated_by FROM inbox.metric_config WHERE false;
SELECT metric, consumer, producer, label, n FROM inbox.metric_event WHERE false;
SELECT metric, consumer, producer, label, value FROM inbox.metric_total WHERE false;
SELECT singleton, processed_cursor, last_run_at, last_rows, last_events FROM inbox.metric_rollup_state WHERE false;
-- The one settings row and the rollup position exist.
SELECT 1 / count(*) FROM inbox.metric_config;
SELECT 1 / count(*) FROM inbox.metric_rollup_state;

ROLLBACK;
