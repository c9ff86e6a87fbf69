-- pginbox: metrics that expose the protocol, read through one entry point, inbox.metrics(), that
-- any language can call (docs/metrics.md lists every metric).
-- No counter row is shared by concurrent claims, and the happy path writes nothing for metrics:
--   first-seen, unprotected  not counted on the claim path at all: inbox.message already is the log
--                            of first processing. inbox.metrics_rollup folds rows into
--                            inbox.metric_total incrementally, by processed_at (a cursor), finalizing
--                            only up to now() - rollup_grace: processed_at is the claiming
--                            transaction's start time, so a claim commits after its processed_at;
--                            the grace covers that (a claiming transaction open longer than the
--                            grace is missed: keep transactions shorter, see docs/metrics.md).
--   duplicates               counted on the duplicate path only (inbox._claim_core calls
--                            inbox._count_duplicate, defined below): one appended
--                            row in inbox.metric_event, an unlogged table without indexes that
--                            nothing else updates, so no two transactions ever touch the same row
--                            and the duplicate's commit waits for no WAL flush; the rollup folds
--                            the events into inbox.metric_total.
--   handler failures         counted the same way, by a trigger on inbox.attempt (failures only:
--                            the slow path), labelled with the failure's reason code.
--   conflicts, quarantine    derived from inbox.quarantine and inbox.quarantine_decision (small).
--   outbox, storage, age,    derived at read time from partial indexes, inbox.retention_status and
--   retention                the catalog.
-- inbox.configure_metrics(counting => false) stops the event counting (read on the rare paths).
-- The functions are in 095_metrics.sql.
BEGIN;

SET LOCAL ROLE inbox_owner;

-- One row: the metric settings.
CREATE TABLE inbox.metric_config (
    singleton boolean NOT NULL DEFAULT true CHECK (singleton),
    counting boolean NOT NULL DEFAULT true,
    rollup_grace interval NOT NULL DEFAULT '5 minutes' CHECK (rollup_grace BETWEEN '0' AND '1 day'),
    rollup_batch integer NOT NULL DEFAULT 500000 CHECK (rollup_batch BETWEEN 1000 AND 100000000),
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL DEFAULT session_user,
    CONSTRAINT metric_config_pkey PRIMARY KEY (singleton)
);
COMMENT ON TABLE inbox.metric_config IS
    'Metric settings (one row): event counting on/off, rollup grace (late commits) and rows per rollup call';
INSERT INTO inbox.metric_config DEFAULT VALUES;

-- Events not folded yet: append-only, no index, no shared row. n is 1 per duplicate delivery, or
-- the failures one statement recorded. UNLOGGED: a duplicate's transaction wrote nothing before,
-- and a transaction that writes only unlogged rows commits without waiting for a WAL flush, so
-- counting a duplicate does not add a flush to it. The price: a crash loses the events not folded
-- yet (the seconds since the last read), never the totals.
CREATE UNLOGGED TABLE inbox.metric_event (
    metric text NOT NULL,
    consumer text NOT NULL,
    producer text NOT NULL,
    label text NOT NULL DEFAULT '',
    n bigint NOT NULL DEFAULT 1
);
COMMENT ON TABLE inbox.metric_event IS
    'Counted events (duplicate, failure) not yet folded into inbox.metric_total; appended, never updated';

-- Totals by metric, consumer, producer and label (the failure reason code, else '').
CREATE TABLE inbox.metric_total (
    metric text NOT NULL,
    consumer text NOT NULL,
    producer text NOT NULL,
    label text NOT NULL DEFAULT '',
    value bigint NOT NULL,
    CONSTRAINT metric_total_pkey PRIMARY KEY (metric, consumer, producer, label)
);
COMMENT ON TABLE inbox.metric_total IS
    'Folded totals: first_seen and unprotected (from inbox.message), duplicate and failure (from inbox.metric_event); first_processed is the earliest processed_at folded, in epoch microseconds';

-- One row: where the first-seen rollup stands.
CREATE TABLE inbox.metric_rollup_state (
    singleton boolean NOT NULL DEFAULT true CHECK (singleton),
    processed_cursor timestamptz NOT NULL,
    last_run_at timestamptz,
    last_rows bigint NOT NULL DEFAULT 0,
    last_events bigint NOT NULL DEFAULT 0,
    CONSTRAINT metric_rollup_state_pkey PRIMARY KEY (singleton)
);
COMMENT ON TABLE inbox.metric_rollup_state IS
    'First-seen rollup position: inbox.message rows with processed_at before processed_cursor are counted';
COMMENT ON COLUMN inbox.metric_rollup_state.processed_cursor IS
    'Rows with processed_at < this are in inbox.metric_total; the cursor trails now() by rollup_grace at least';

-- The rows already there when this change is deployed: counted once, now.
INSERT INTO inbox.metric_rollup_state (processed_cursor) VALUES (now() - '5 minutes'::interval);
INSERT INTO inbox.metric_total (metric, consumer, producer, label, value)
SELECT v.metric, a.consumer, a.producer, '', v.n
  FROM (SELECT m.consumer, m.producer, count(*) AS n, count(*) FILTER (WHERE m.produced_at IS NULL) AS nu,
               min(m.processed_at) AS first_at
          FROM inbox.message m
         WHERE m.processed_at < now() - '5 minutes'::interval
         GROUP BY m.consumer, m.producer) a
 CROSS JOIN LATERAL (VALUES ('first_seen', a.n), ('unprotected', a.nu),
                            ('first_processed', (extract(epoch FROM a.first_at) * 1000000)::bigint)) AS v(metric, n);

GRANT SELECT ON inbox.metric_config, inbox.metric_total, inbox.metric_rollup_state TO inbox_reader, inbox_operator;

COMMIT;
