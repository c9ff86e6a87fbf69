-- pginbox: metrics' functions (tables in 090_metrics_tables.sql).
BEGIN;

SET LOCAL ROLE inbox_owner;
-- DROP ... IF EXISTS below makes this script rerunnable (sqitch rework): no notices for it.
SET LOCAL client_min_messages = warning;

-- Duplicates: replaces the no-op hook that inbox._claim_core calls on every duplicate
-- (sql/025_hooks.sql; revert/metrics.sql puts the no-op back).
CREATE OR REPLACE FUNCTION inbox._count_duplicate(consumer text, producer text) RETURNS void
    LANGUAGE sql VOLATILE
AS $$
    INSERT INTO inbox.metric_event (metric, consumer, producer)
    SELECT 'duplicate', _count_duplicate.consumer, _count_duplicate.producer
      FROM inbox.metric_config c
     WHERE c.counting;
$$;
COMMENT ON FUNCTION inbox._count_duplicate(text, text) IS 'internal: counts a duplicate delivery (one appended inbox.metric_event row)';

-- Failures by reason code: a row in inbox.attempt gains failures only in record_failure.
CREATE OR REPLACE FUNCTION inbox._count_failure() RETURNS trigger
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    INSERT INTO inbox.metric_event (metric, consumer, producer, label, n)
    SELECT 'failure', NEW.consumer, NEW.producer, coalesce(NEW.reason_code, ''),
           NEW.failed - CASE WHEN TG_OP = 'UPDATE' THEN OLD.failed ELSE 0 END
      FROM inbox.metric_config c
     WHERE c.counting;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION inbox._count_failure() IS 'internal (trigger on inbox.attempt): counts recorded handler failures by reason code';
DROP TRIGGER IF EXISTS attempt_count_failure_insert ON inbox.attempt;
CREATE TRIGGER attempt_count_failure_insert AFTER INSERT ON inbox.attempt
    FOR EACH ROW WHEN (NEW.failed > 0) EXECUTE FUNCTION inbox._count_failure();
DROP TRIGGER IF EXISTS attempt_count_failure_update ON inbox.attempt;
CREATE TRIGGER attempt_count_failure_update AFTER UPDATE OF failed ON inbox.attempt
    FOR EACH ROW WHEN (NEW.failed > OLD.failed) EXECUTE FUNCTION inbox._count_failure();

CREATE OR REPLACE FUNCTION inbox._check_rollup_batch(fn text, max_rows integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF max_rows NOT BETWEEN 1000 AND 100000000 THEN
        RAISE EXCEPTION '%: the rollup batch must be between 1000 and 100000000 rows, got %', fn, max_rows
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'It bounds the work of one call; the rollup lag metric says when it falls behind.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_rollup_batch(text, integer) IS 'internal: validates a rollup batch size (22023)';

-- The rollup: folds first deliveries (processed_at in [cursor, now() - grace)) and counted events
-- into inbox.metric_total, at most max_rows of each per call. One rollup at a time: a second
-- concurrent call returns 0 at once. Returns the inbox rows plus events folded.
CREATE OR REPLACE FUNCTION inbox._metrics_rollup(max_rows integer) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    cfg inbox.metric_config;
    st inbox.metric_rollup_state;
    started_at timestamptz;
    consumers text[];
    horizon timestamptz;
    cut timestamptz;
    upper_bound timestamptz;
    rows_folded bigint := 0::bigint;
    events_folded bigint := 0::bigint;
BEGIN
    -- One rollup at a time, through a transaction-level advisory lock keyed on the state table's
    -- OID: unlike a row lock it takes no transaction id, so an idle call writes nothing at all. A
    -- snapshot older than the lock (REPEATABLE READ, SERIALIZABLE) could count rows twice: skip.
    IF current_setting('transaction_isolation') <> 'read committed'
       OR NOT pg_try_advisory_xact_lock('inbox.metric_rollup_state'::regclass::oid::integer, 0) THEN
        RETURN 0::bigint;
    END IF;
    SELECT c.* INTO STRICT cfg FROM inbox.metric_config c;
    SELECT s.* INTO STRICT st FROM inbox.metric_rollup_state s;
    started_at := st.processed_cursor;
    horizon := now() - cfg.rollup_grace;
    IF horizon > st.processed_cursor THEN
        -- inbox.message is indexed on (consumer, processed_at) (message_purge_idx, 070_retention):
        -- the slice is read consumer by consumer. The consumers come from a loose index scan (one
        -- descent per consumer), so none of it depends on the size of the table.
        WITH RECURSIVE c AS (
            SELECT min(m.consumer) AS consumer FROM inbox.message m
            UNION ALL
            SELECT (SELECT min(m.consumer) FROM inbox.message m WHERE m.consumer > c.consumer)
              FROM c WHERE c.consumer IS NOT NULL)
        SELECT coalesce(array_agg(c.consumer), '{}') INTO consumers FROM c WHERE c.consumer IS NOT NULL;
        -- The (max_rows + 1)-th row bounds this call; rows of one transaction share processed_at,
        -- so the slice ends before it (or just after a single timestamp holding more rows).
        SELECT s.processed_at INTO cut
          FROM unnest(consumers) AS c(consumer)
         CROSS JOIN LATERAL (
                SELECT m.processed_at FROM inbox.message m
                 WHERE m.consumer = c.consumer
                   AND m.processed_at >= st.processed_cursor AND m.processed_at < horizon
                 ORDER BY m.processed_at LIMIT max_rows + 1) s
         ORDER BY s.processed_at
        OFFSET max_rows LIMIT 1;
        upper_bound := CASE WHEN cut IS NULL THEN horizon
                            ELSE greatest(cut, st.processed_cursor + '1 microsecond'::interval) END;
        WITH agg AS (
            SELECT c.consumer, s.producer, count(*) AS n, count(*) FILTER (WHERE s.produced_at IS NULL) AS nu,
                   min(s.processed_at) AS first_at
              FROM unnest(consumers) AS c(consumer)
             CROSS JOIN LATERAL (
                    SELECT m.producer, m.produced_at, m.processed_at FROM inbox.message m
                     WHERE m.consumer = c.consumer
                       AND m.processed_at >= st.processed_cursor AND m.processed_at < upper_bound) s
             GROUP BY c.consumer, s.producer),
        ins AS (
            INSERT INTO inbox.metric_total AS t (metric, consumer, producer, label, value)
            SELECT v.metric, agg.consumer, agg.producer, '', v.n
              FROM agg
             CROSS JOIN LATERAL (VALUES ('first_seen', agg.n), ('unprotected', agg.nu),
                                        ('first_processed', (extract(epoch FROM agg.first_at) * 1000000)::bigint))
                   AS v(metric, n)
            ON CONFLICT ON CONSTRAINT metric_total_pkey DO UPDATE
               SET value = CASE WHEN t.metric = 'first_processed' THEN least(t.value, EXCLUDED.value)
                                ELSE t.value + EXCLUDED.value END)
        SELECT coalesce(sum(agg.n), 0)::bigint INTO rows_folded FROM agg;
        st.processed_cursor := upper_bound;
    END IF;

    WITH gone AS (
        DELETE FROM inbox.metric_event e
         WHERE e.ctid = ANY (ARRAY(SELECT x.ctid FROM inbox.metric_event x LIMIT max_rows))
        RETURNING e.metric, e.consumer, e.producer, e.label, e.n),
    folded AS (
        SELECT g.metric, g.consumer, g.producer, g.label, sum(g.n)::bigint AS n, count(*) AS events
          FROM gone g GROUP BY g.metric, g.consumer, g.producer, g.label),
    ins AS (
        INSERT INTO inbox.metric_total AS t (metric, consumer, producer, label, value)
        SELECT f.metric, f.consumer, f.producer, f.label, f.n FROM folded f
        ON CONFLICT ON CONSTRAINT metric_total_pkey DO UPDATE SET value = t.value + EXCLUDED.value)
    SELECT coalesce(sum(f.events), 0)::bigint INTO events_folded FROM folded f;

    -- An idle call writes nothing (no commit to flush) unless the cursor would move a minute:
    -- rescanning an empty slice of the processed_at index costs less than a write.
    IF rows_folded > 0 OR events_folded > 0 OR st.processed_cursor - started_at >= '1 minute'::interval THEN
        UPDATE inbox.metric_rollup_state s
           SET processed_cursor = st.processed_cursor, last_run_at = clock_timestamp(),
               last_rows = rows_folded, last_events = events_folded
         WHERE s.singleton;
    END IF;
    RETURN rows_folded + events_folded;
END
$$;
COMMENT ON FUNCTION inbox._metrics_rollup(integer) IS 'internal: one bounded rollup step (skipped when another runs)';

CREATE OR REPLACE FUNCTION inbox.metrics_rollup(max_rows integer DEFAULT NULL) RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF max_rows IS NOT NULL THEN
        PERFORM inbox._check_rollup_batch('inbox.metrics_rollup', max_rows);
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'inbox.metrics_rollup: run it at READ COMMITTED, not %', current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'An older snapshot than the rollup''s lock could count rows twice.';
    END IF;
    RETURN inbox._metrics_rollup(coalesce(max_rows, (SELECT c.rollup_batch FROM inbox.metric_config c)));
END
$$;
COMMENT ON FUNCTION inbox.metrics_rollup(integer) IS
    'Fold new first deliveries and counted events into the metric totals (bounded; inbox.metrics() calls it too)';

CREATE OR REPLACE FUNCTION inbox.configure_metrics(
    counting boolean DEFAULT NULL, rollup_grace interval DEFAULT NULL, rollup_batch integer DEFAULT NULL)
    RETURNS inbox.metric_config
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    saved inbox.metric_config;
BEGIN
    IF configure_metrics.rollup_grace IS NOT NULL
       AND configure_metrics.rollup_grace NOT BETWEEN '0'::interval AND '1 day'::interval THEN
        RAISE EXCEPTION 'inbox.configure_metrics: rollup_grace must be between 0 and 1 day, got %',
            configure_metrics.rollup_grace
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Make it longer than your longest transaction that claims messages (default 5 minutes).';
    END IF;
    IF configure_metrics.rollup_batch IS NOT NULL THEN
        PERFORM inbox._check_rollup_batch('inbox.configure_metrics', configure_metrics.rollup_batch);
    END IF;
    UPDATE inbox.metric_config c
       SET counting = coalesce(configure_metrics.counting, c.counting),
           rollup_grace = coalesce(configure_metrics.rollup_grace, c.rollup_grace),
           rollup_batch = coalesce(configure_metrics.rollup_batch, c.rollup_batch),
           updated_at = now(), updated_by = session_user
     WHERE c.singleton
    RETURNING c.* INTO STRICT saved;
    RETURN saved;
END
$$;
COMMENT ON FUNCTION inbox.configure_metrics(boolean, interval, integer) IS
    'Switch event counting (duplicates, failures) on or off and set the rollup grace and batch; NULL keeps a value';

-- The events not folded yet; none on a standby, where unlogged tables cannot be read (a query
-- naming one fails at planning, hence a function of its own).
CREATE OR REPLACE FUNCTION inbox._metric_events()
    RETURNS TABLE (metric text, consumer text, producer text, label text, n bigint)
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF pg_catalog.pg_is_in_recovery() THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT e.metric, e.consumer, e.producer, e.label, e.n FROM inbox.metric_event e;
END
$$;
COMMENT ON FUNCTION inbox._metric_events() IS 'internal: unfolded metric events (none on a standby)';

-- Every metric, one row per series. Runs a bounded rollup first unless the transaction is read-only
-- or the server a standby. Its cost does not depend on the size of inbox.message: totals are
-- folded, the rest comes from small tables, partial indexes and the catalog.
CREATE OR REPLACE FUNCTION inbox.metrics()
    RETURNS TABLE (metric text, type text, help text, labels jsonb, value double precision)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg inbox.metric_config;
    st inbox.metric_rollup_state;
BEGIN
    SELECT c.* INTO STRICT cfg FROM inbox.metric_config c;
    IF NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off' THEN
        PERFORM inbox._metrics_rollup(cfg.rollup_batch);
    END IF;
    SELECT s.* INTO STRICT st FROM inbox.metric_rollup_state s;

    -- Counters by consumer and producer. Every pair seen gets every series (zeros included), so
    -- that "dropped to zero" is a value, not a missing series.
    RETURN QUERY
    WITH counted AS (
        SELECT t.metric AS m, t.consumer, t.producer, t.label, t.value::numeric AS v FROM inbox.metric_total t
         WHERE t.metric <> 'first_processed'
        UNION ALL
        SELECT e.metric, e.consumer, e.producer, e.label, e.n::numeric FROM inbox._metric_events() e
        UNION ALL
        SELECT q.kind, q.consumer, q.producer, '', q.deliveries::numeric
          FROM inbox.quarantine q WHERE q.kind IN ('conflict', 'expired')),
    summed AS (SELECT c.m, c.consumer, c.producer, sum(c.v) AS v FROM counted c WHERE c.m <> 'failure'
                GROUP BY c.m, c.consumer, c.producer),
    pairs AS (SELECT DISTINCT s.consumer, s.producer FROM summed s),
    kinds (m, name, help) AS (VALUES
        ('first_seen', 'pginbox_first_seen_total',
         'Identities first processed (applied, repaired or discarded), counted by processed_at after the rollup grace'),
        ('unprotected', 'pginbox_unprotected_deliveries_total',
         'First deliveries without produced_at: a redelivery after a purge cannot be caught as expired'),
        ('duplicate', 'pginbox_duplicates_total', 'Deliveries answered duplicate (already processed or discarded)'),
        ('conflict', 'pginbox_identity_conflicts_total',
         'Deliveries of a processed identity with a different payload hash (quarantined as conflicts)'),
        ('expired', 'pginbox_expired_deliveries_total',
         'Deliveries produced before the purge watermark: quarantined as expired instead of applied'))
    SELECT k.name, 'counter', k.help, jsonb_build_object('consumer', p.consumer, 'producer', p.producer),
           coalesce(s.v, 0)::double precision
      FROM kinds k CROSS JOIN pairs p
      LEFT JOIN summed s ON s.m = k.m AND s.consumer = p.consumer AND s.producer = p.producer
     ORDER BY 1;

    RETURN QUERY
    SELECT 'pginbox_handler_failures_total', 'counter', 'Handler failures recorded (record_failure), by reason code',
           jsonb_build_object('consumer', f.consumer, 'producer', f.producer, 'reason_code', f.label),
           sum(f.v)::double precision
      FROM (SELECT t.consumer, t.producer, t.label, t.value AS v FROM inbox.metric_total t WHERE t.metric = 'failure'
            UNION ALL
            SELECT e.consumer, e.producer, e.label, e.n FROM inbox._metric_events() e WHERE e.metric = 'failure') f
     GROUP BY f.consumer, f.producer, f.label;

    -- Quarantine. An entry enters once, and again after each release that a later failure reopened.
    RETURN QUERY
    SELECT 'pginbox_quarantined_total', 'counter', 'Messages moved to quarantine, by kind and reason code',
           jsonb_build_object('consumer', q.consumer, 'producer', q.producer, 'kind', q.kind,
                              'reason_code', q.reason_code),
           sum(1 + coalesce(r.releases, 0) - CASE WHEN q.status = 'released' THEN 1 ELSE 0 END)::double precision
      FROM inbox.quarantine q
      LEFT JOIN (SELECT d.quarantine_id, count(*) AS releases FROM inbox.quarantine_decision d
                  WHERE d.decision = 'release' GROUP BY d.quarantine_id) r ON r.quarantine_id = q.quarantine_id
     GROUP BY q.consumer, q.producer, q.kind, q.reason_code;

    RETURN QUERY
    SELECT 'pginbox_quarantine_decisions_total', 'counter',
           'Operator decisions on quarantine entries, by result (recovered = repaired and applied)',
           jsonb_build_object('consumer', q.consumer, 'producer', q.producer, 'kind', q.kind, 'result', d.result),
           count(*)::double precision
      FROM inbox.quarantine_decision d JOIN inbox.quarantine q ON q.quarantine_id = d.quarantine_id
     GROUP BY q.consumer, q.producer, q.kind, d.result;

    RETURN QUERY
    SELECT 'pginbox_quarantine_recovered_total', 'counter', 'Quarantined messages later recovered by a repair',
           jsonb_build_object('consumer', q.consumer, 'producer', q.producer),
           count(*) FILTER (WHERE d.result = 'recovered')::double precision
      FROM inbox.quarantine q LEFT JOIN inbox.quarantine_decision d ON d.quarantine_id = q.quarantine_id
     GROUP BY q.consumer, q.producer;

    RETURN QUERY
    SELECT 'pginbox_quarantine_open', 'gauge', 'Quarantine entries waiting for an operator decision',
           jsonb_build_object('consumer', q.consumer, 'kind', q.kind), count(*)::double precision
      FROM inbox.quarantine q WHERE q.status = 'open'
     GROUP BY q.consumer, q.kind;

    RETURN QUERY
    SELECT 'pginbox_quarantine_oldest_open_age_seconds', 'gauge', 'Age of the oldest open quarantine entry',
           jsonb_build_object('consumer', q.consumer),
           extract(epoch FROM now() - min(q.created_at))::double precision
      FROM inbox.quarantine q WHERE q.status = 'open'
     GROUP BY q.consumer;

    -- Outbox: effects committed and not delivered yet (pending or leased), from the two partial
    -- indexes that hold them (outbox_due_idx; outbox_order_idx for those set aside behind their key).
    RETURN QUERY
    WITH waiting AS (
        SELECT o.destination, o.created_at FROM inbox.outbox o
         WHERE o.status IN ('pending', 'leased') AND NOT o.blocked
        UNION ALL
        SELECT o.destination, o.created_at FROM inbox.outbox o
         WHERE o.ordering_key IS NOT NULL AND o.status IN ('pending', 'leased') AND o.blocked),
    per_destination AS (
        SELECT w.destination, count(*) AS n, min(w.created_at) AS oldest FROM waiting w GROUP BY w.destination)
    SELECT x.metric, 'gauge', x.help, jsonb_build_object('destination', pd.destination), x.value
      FROM per_destination pd
     CROSS JOIN LATERAL (VALUES
        ('pginbox_outbox_pending', 'Outbox effects committed and not delivered yet (pending or leased)',
         pd.n::double precision),
        ('pginbox_outbox_pending_oldest_age_seconds', 'Age of the oldest outbox effect not delivered yet',
         extract(epoch FROM now() - pd.oldest)::double precision)) AS x(metric, help, value)
     ORDER BY 1;

    RETURN QUERY
    SELECT 'pginbox_outbox_dead', 'gauge', 'Outbox effects given up (dead) until an operator redrives them',
           jsonb_build_object('destination', o.destination), count(*)::double precision
      FROM inbox.outbox o WHERE o.status = 'dead'
     GROUP BY o.destination;

    RETURN QUERY
    SELECT 'pginbox_outbox_fenced_reports_total', 'counter',
           'Dispatcher reports refused because their lease was no longer current (late or duplicate dispatchers)',
           jsonb_build_object('report', r.report), count(*)::double precision
      FROM inbox.outbox_fenced_report r
     GROUP BY r.report;

    -- Size of the inbox: the catalog.
    RETURN QUERY
    SELECT 'pginbox_relation_size_bytes', 'gauge', 'On-disk size of an inbox table with its indexes and TOAST',
           jsonb_build_object('relation', c.relname::text), pg_total_relation_size(c.oid)::double precision
      FROM pg_class c
     WHERE c.relnamespace = 'inbox'::regnamespace AND c.relkind = 'r'
       AND c.relname IN ('message', 'attempt', 'quarantine', 'outbox', 'metric_event');

    -- No sample before the table's first ANALYZE or VACUUM (reltuples -1): 0 would read as an empty
    -- inbox. (0.1.0 reported 0.)
    RETURN QUERY
    SELECT 'pginbox_inbox_rows_estimate', 'gauge', 'Rows in inbox.message, as estimated by the last ANALYZE',
           '{}'::jsonb, c.reltuples::double precision
      FROM pg_class c WHERE c.oid = 'inbox.message'::regclass AND c.reltuples >= 0;

    -- Retention (inbox.retention_status, per consumer and policy producer; '' is the consumer's
    -- default policy) and how far back each producer's identities reach: from the first identity
    -- the rollup folded, or from the purge cutoff once a purge ran.
    RETURN QUERY
    WITH rs AS (
        SELECT r.consumer, r.producer, r.retention_window, r.purged_before, r.purge_lag, r.rows_purged,
               r.last_purge_at
          FROM inbox.retention_status r)
    SELECT 'pginbox_inbox_oldest_age_seconds', 'gauge',
           'Age of the oldest identity kept for a producer: how far back a redelivery is still caught as duplicate',
           jsonb_build_object('consumer', t.consumer, 'producer', t.producer),
           extract(epoch FROM now() - greatest(pg_catalog.to_timestamp(t.value / 1000000.0),
                                               coalesce(rp.purged_before, rd.purged_before)))::double precision
      FROM inbox.metric_total t
      LEFT JOIN rs rp ON rp.consumer = t.consumer AND rp.producer = t.producer
      LEFT JOIN rs rd ON rd.consumer = t.consumer AND rd.producer = ''
     WHERE t.metric = 'first_processed'
    UNION ALL
    SELECT x.metric, x.type, x.help, jsonb_build_object('consumer', rs.consumer, 'producer', rs.producer), x.value
      FROM rs
     CROSS JOIN LATERAL (VALUES
        ('pginbox_purge_lag_seconds', 'gauge',
         'How far the purge trails the retention cutoff (NULL until the first purge: no series)',
         extract(epoch FROM rs.purge_lag)::double precision),
        ('pginbox_purged_rows_total', 'counter', 'Inbox rows deleted by the purge', rs.rows_purged::double precision),
        ('pginbox_purge_last_run_timestamp_seconds', 'gauge', 'When the purge last ran (Unix time)',
         extract(epoch FROM rs.last_purge_at)::double precision),
        ('pginbox_retention_window_seconds', 'gauge', 'The retention window derived from the policy''s scenarios',
         extract(epoch FROM rs.retention_window)::double precision)) AS x(metric, type, help, value)
     WHERE x.value IS NOT NULL
     ORDER BY 1;

    RETURN QUERY
    SELECT x.metric, 'gauge', x.help, '{}'::jsonb, x.value
      FROM (VALUES
        ('pginbox_metrics_rollup_lag_seconds',
         'How far behind now() the first-seen rollup is (the rollup grace, plus up to a minute when idle)',
         extract(epoch FROM now() - st.processed_cursor)::double precision),
        ('pginbox_metrics_counting_enabled', 'Whether duplicates and failures are counted (inbox.configure_metrics)',
         CASE WHEN cfg.counting THEN 1 ELSE 0 END::double precision)) AS x(metric, help, value);
END
$$;
COMMENT ON FUNCTION inbox.metrics() IS
    'Every metric as (metric, type, help, labels, value) rows, Prometheus names; readers may call it';

-- For humans: the counters side by side, per consumer and producer.
CREATE OR REPLACE VIEW inbox.metric_summary AS
SELECT m.labels ->> 'consumer' AS consumer, m.labels ->> 'producer' AS producer,
       sum(m.value) FILTER (WHERE m.metric = 'pginbox_first_seen_total')::bigint AS first_seen,
       sum(m.value) FILTER (WHERE m.metric = 'pginbox_duplicates_total')::bigint AS duplicates,
       sum(m.value) FILTER (WHERE m.metric = 'pginbox_identity_conflicts_total')::bigint AS conflicts,
       coalesce(sum(m.value) FILTER (WHERE m.metric = 'pginbox_handler_failures_total'), 0)::bigint AS failures,
       coalesce(sum(m.value) FILTER (WHERE m.metric = 'pginbox_quarantined_total'), 0)::bigint AS quarantined,
       coalesce(sum(m.value) FILTER (WHERE m.metric = 'pginbox_quarantine_recovered_total'), 0)::bigint AS recovered,
       sum(m.value) FILTER (WHERE m.metric = 'pginbox_unprotected_deliveries_total')::bigint AS unprotected
  FROM inbox.metrics() m
 WHERE m.labels ? 'producer'
 GROUP BY 1, 2;
COMMENT ON VIEW inbox.metric_summary IS 'The counters of inbox.metrics() side by side, per consumer and producer';

REVOKE ALL ON FUNCTION inbox.metrics(), inbox.metrics_rollup(integer),
    inbox.configure_metrics(boolean, interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.metrics() TO inbox_reader, inbox_operator;
GRANT EXECUTE ON FUNCTION inbox.metrics_rollup(integer), inbox.configure_metrics(boolean, interval, integer)
    TO inbox_operator;
GRANT SELECT ON inbox.metric_summary TO inbox_reader, inbox_operator;

COMMIT;
