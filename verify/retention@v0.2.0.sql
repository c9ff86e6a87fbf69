-- Verify pginbox:retention
BEGIN;

SELECT consumer, producer, retention_window, dominating_scenario, watermark, purged_before, announced_before,
       last_purge_at, rows_purged, purge_lag, expired_total, last_active_at
  FROM inbox.retention_status WHERE false;

SELECT 'inbox._retention_window(inbox.retention_policy)'::regprocedure,
       'inbox._policy_for(text, text)'::regprocedure,
       'inbox.retention_window(text, text)'::regprocedure,
       'inbox.set_retention_policy(text, text, interval, interval, interval, interval, interval, interval, interval, interval, text)'::regprocedure,
       'inbox._heartbeat(text)'::regprocedure,
       'inbox._active_cutoff(text, interval)'::regprocedure,
       'inbox._watermark(text, text)'::regprocedure,
       'inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean)'::regprocedure,
       'inbox._purge_lock_held(text)'::regprocedure,
       'inbox.purge_lock(text)'::regprocedure,
       'inbox.purge_unlock(text)'::regprocedure,
       'inbox._check_purge_args(text, text, text, integer)'::regprocedure,
       'inbox.announce_purge(text, text)'::regprocedure,
       'inbox._running_transactions()'::regprocedure,
       'inbox.purge_batch(text, text, integer)'::regprocedure,
       'inbox.purge(text, text, integer, integer, interval, bigint, text, interval)'::regprocedure,
       'inbox._check_purge_call(integer, integer, interval, interval)'::regprocedure, 'inbox._announced(text[])'::regprocedure,
       'inbox._announced_detail(text)'::regprocedure;

DO $$
BEGIN
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.purge(text, text, integer, integer, interval, bigint, text, interval)', 'EXECUTE')
       OR NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.purge_batch(text, text, integer)', 'EXECUTE')
       OR NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.set_retention_policy(text, text, interval, interval, interval, interval, interval, interval, interval, interval, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'inbox_operator must be able to set retention policies and purge';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_consumer', 'inbox.purge_batch(text, text, integer)', 'EXECUTE')
       OR pg_catalog.has_function_privilege('inbox_reader', 'inbox.set_retention_policy(text, text, interval, interval, interval, interval, interval, interval, interval, interval, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'only inbox_operator may purge or set retention policies';
    END IF;
    IF NOT pg_catalog.has_table_privilege('inbox_reader', 'inbox.retention_status', 'SELECT') THEN
        RAISE EXCEPTION 'inbox_reader must read inbox.retention_status';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint WHERE conname = 'quarantine_kind_check'
                      AND conrelid = 'inbox.quarantine'::regclass
                      AND pg_catalog.pg_get_constraintdef(oid) LIKE '%expired%') THEN
        RAISE EXCEPTION 'inbox.quarantine.kind must allow ''expired''';
    END IF;
END
$$;

-- The claim hooks are this change's versions, not the no-ops of sql/025_hooks.sql.
SELECT 1 / (p.prosrc LIKE '%activity_gap%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._heartbeat(text)'::regprocedure;
SELECT 1 / (p.prosrc LIKE '%_watermark%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean)'::regprocedure;

ROLLBACK;
