-- Verify pginbox:retention
BEGIN;

SELECT consumer, tenant, producer, message_id, holder, created_at FROM inbox.retention_hold WHERE false;
SELECT consumer, producer, broker_retention, max_offset_rewind, dead_letter_redrive_horizon, producer_retry_horizon,
       outage_allowance, backup_restore_window, planned_replay_horizon, safety_margin, note, updated_at, updated_by
  FROM inbox.retention_policy WHERE false;
SELECT change_id, consumer, producer, broker_retention, max_offset_rewind, dead_letter_redrive_horizon,
       producer_retry_horizon, outage_allowance, backup_restore_window, planned_replay_horizon, safety_margin,
       retention_window, dominating_scenario, note, changed_at, changed_by
  FROM inbox.retention_policy_change WHERE false;
SELECT consumer, gap_from, gap_to FROM inbox.activity_gap WHERE false;
SELECT consumer, producer, announced_before, watermark, announced_at, announce_xid, waiting_for, purged_before,
       settled_at, last_purge_at, rows_purged, resume_at
  FROM inbox.purge_state WHERE false;
SELECT last_active_at, purge_watermark FROM inbox.consumer_config WHERE false;
SELECT consumer, producer, retention_window, dominating_scenario, watermark, purged_before, announced_before,
       last_purge_at, rows_purged, purge_lag, expired_total, last_active_at
  FROM inbox.retention_status WHERE false;
SELECT 'inbox.message_purge_idx'::regclass;

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
       'inbox.purge(text, text, integer, integer, interval, bigint, text)'::regprocedure;

DO $$
BEGIN
    IF NOT pg_catalog.has_function_privilege('inbox_operator', 'inbox.purge(text, text, integer, integer, interval, bigint, text)', 'EXECUTE')
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

-- The claim hooks are this change's versions, not the no-ops of deploy/claim.sql.
SELECT 1 / (p.prosrc LIKE '%activity_gap%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._heartbeat(text)'::regprocedure;
SELECT 1 / (p.prosrc LIKE '%_watermark%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean)'::regprocedure;

ROLLBACK;
