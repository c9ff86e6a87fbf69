-- Revert pginbox:reader_grants: the table-wide grants of 0.1.0 again.
BEGIN;

SET LOCAL ROLE inbox_owner;

-- Both roles again, in 0.1.0's order, so that the privileges read back exactly as 0.1.0 made them.
REVOKE SELECT ON inbox.message, inbox.attempt, inbox.quarantine_decision FROM inbox_reader, inbox_operator;
GRANT SELECT ON inbox.message, inbox.attempt, inbox.quarantine_decision TO inbox_reader, inbox_operator;
REVOKE SELECT ON inbox.outbox_redrive, inbox.outbox_discard FROM inbox_reader;
GRANT SELECT ON inbox.outbox_redrive, inbox.outbox_discard TO inbox_reader;
REVOKE SELECT ON inbox.quarantine, inbox.outbox, inbox.replay_item FROM inbox_reader;
GRANT SELECT (quarantine_id, consumer, tenant, producer, message_id, kind, message_type, payload_sha256,
    stored_sha256, payload_ref, reason_code, error_message, attempts, crashes, deliveries, first_failure_at,
    last_failure_at, handler_version, status, created_at, last_seen_at, decided_at, decided_by)
    ON inbox.quarantine TO inbox_reader;
GRANT SELECT (effect_id, destination, payload_sha256, ordering_key, order_seq, blocked, status, attempts, available_at,
    created_at, created_xid, lease_token, leased_by, lease_expires_at, last_attempt_at, last_error, last_status_code,
    last_duration_ms, delivered_at, dead_reason, discarded_at)
    ON inbox.outbox TO inbox_reader;
GRANT SELECT (plan_id, item_no, tenant, producer, message_id, operation_id, payload_sha256, status, handler_version,
              reason_code, error_message, added_at, added_by, finished_at, finished_by)
    ON inbox.replay_item TO inbox_reader;

COMMIT;
