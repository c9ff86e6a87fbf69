-- Revert pginbox:metrics_tables
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

DROP TABLE inbox.metric_rollup_state;
DROP TABLE inbox.metric_total;
DROP TABLE inbox.metric_event;
DROP TABLE inbox.metric_config;

COMMIT;
