-- Verify pginbox:outbox_tables
BEGIN;

SELECT NULL::inbox.effect_status;
SELECT 'inbox.outbox_lease_token'::regclass, 'inbox.outbox_order_seq'::regclass;
SELECT effect_id, destination, payload, payload_sha256, headers, ordering_key, order_seq, blocked, status, attempts,
       available_at, created_at, created_xid, lease_token, leased_by, lease_expires_at, last_attempt_at, last_error,
       last_status_code, last_response_excerpt, last_duration_ms, delivered_at, dead_reason, discarded_at
  FROM inbox.outbox WHERE false;
SELECT destination, max_attempts, base_backoff, max_backoff, updated_at, updated_by
  FROM inbox.outbox_destination WHERE false;
SELECT redrive_id, effect_id, redriven_by, redriven_at, note, attempts, dead_reason, last_error
  FROM inbox.outbox_redrive WHERE false;
SELECT discard_id, effect_id, discarded_by, discarded_at, note, attempts, dead_reason, last_error
  FROM inbox.outbox_discard WHERE false;
SELECT report_id, effect_id, lease_token, report, reported_by, application_name, reported_at, current_status,
       current_token
  FROM inbox.outbox_fenced_report WHERE false;
SELECT dispatcher, since FROM inbox.outbox_waiter WHERE false;

ROLLBACK;
