-- Verify pginbox:retention_tables
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
SELECT 'inbox.message_purge_idx'::regclass;

ROLLBACK;
