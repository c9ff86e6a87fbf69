-- pginbox: what readers (inbox_reader: dashboards, metrics) may see. Reason codes and counts, not
-- what a payload holds: no error texts (a handler's error may quote the payload), no payload hashes
-- (a dictionary of guessed payloads would match them). New in 0.2.0; replaces the table-wide grants
-- of 020_schema.sql, 060_outbox_tables.sql and 080_replay_tables.sql with column lists.
BEGIN;

SET LOCAL ROLE inbox_owner;

REVOKE SELECT ON inbox.message, inbox.attempt, inbox.quarantine, inbox.quarantine_decision, inbox.outbox,
    inbox.outbox_redrive, inbox.outbox_discard, inbox.replay_item FROM inbox_reader;
GRANT SELECT (consumer, tenant, producer, message_id, handler_version, status, produced_at, received_at, processed_at)
    ON inbox.message TO inbox_reader;
GRANT SELECT (consumer, tenant, producer, message_id, started, failed, last_started_at, first_failure_at,
              last_failure_at, reason_code, handler_version, message_type)
    ON inbox.attempt TO inbox_reader;
GRANT SELECT (quarantine_id, consumer, tenant, producer, message_id, kind, message_type, payload_ref, reason_code,
              attempts, crashes, deliveries, first_failure_at, last_failure_at, handler_version, status, created_at,
              last_seen_at, decided_at, decided_by)
    ON inbox.quarantine TO inbox_reader;
GRANT SELECT (decision_id, quarantine_id, decision, result, decided_by, decided_at, note, reason_code)
    ON inbox.quarantine_decision TO inbox_reader;
GRANT SELECT (effect_id, consumer, destination, ordering_key, order_seq, blocked, status, attempts, available_at, created_at,
              created_xid, lease_token, lease_role, leased_by, lease_expires_at, last_attempt_at, last_status_code,
              last_duration_ms, delivered_at, dead_reason, discarded_at)
    ON inbox.outbox TO inbox_reader;
GRANT SELECT (redrive_id, effect_id, consumer, redriven_by, redriven_at, note, attempts, dead_reason)
    ON inbox.outbox_redrive TO inbox_reader;
GRANT SELECT (discard_id, effect_id, consumer, discarded_by, discarded_at, note, attempts, dead_reason)
    ON inbox.outbox_discard TO inbox_reader;
GRANT SELECT (plan_id, item_no, tenant, producer, message_id, operation_id, status, handler_version, reason_code,
              added_at, added_by, finished_at, finished_by)
    ON inbox.replay_item TO inbox_reader;

COMMIT;
