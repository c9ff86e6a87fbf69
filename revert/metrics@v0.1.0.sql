-- Revert pginbox:metrics
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

-- inbox._claim_core calls this hook on every duplicate: put the no-op of sql/025_hooks.sql back.
CREATE OR REPLACE FUNCTION inbox._count_duplicate(consumer text, producer text) RETURNS void
    LANGUAGE sql VOLATILE
    RETURN NULL;
COMMENT ON FUNCTION inbox._count_duplicate(text, text) IS 'internal: counts a duplicate delivery (a no-op until sql/095_metrics.sql replaces it)';

DROP VIEW inbox.metric_summary;
DROP FUNCTION inbox.metrics();
DROP FUNCTION inbox.configure_metrics(boolean, interval, integer);
DROP FUNCTION inbox._metric_events();
DROP FUNCTION inbox.metrics_rollup(integer);
DROP FUNCTION inbox._metrics_rollup(integer);
DROP FUNCTION inbox._check_rollup_batch(text, integer);
DROP TRIGGER attempt_count_failure_update ON inbox.attempt;
DROP TRIGGER attempt_count_failure_insert ON inbox.attempt;
DROP FUNCTION inbox._count_failure();

COMMIT;
