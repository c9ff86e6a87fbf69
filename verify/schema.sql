-- Verify pginbox:schema
BEGIN;

SELECT pg_catalog.has_schema_privilege('inbox', 'usage');
SELECT NULL::inbox.delivery_result, NULL::inbox.message_context, NULL::inbox._handler_call, NULL::inbox.message_status;
SELECT consumer, hash_exclude_keys, max_attempts, store_payloads, max_payload_bytes, updated_at, updated_by,
       last_active_at, purge_watermark
  FROM inbox.consumer_config WHERE false;
SELECT consumer, message_type, handler, handler_version, takes_context, registered_at, registered_by
  FROM inbox.handler WHERE false;
SELECT registration_id, consumer, message_type, handler, handler_version, registered_at, registered_by
  FROM inbox.handler_registration WHERE false;
SELECT consumer, tenant, producer, message_id, payload_sha256, handler_version, status, produced_at, received_at,
       processed_at
  FROM inbox.message WHERE false;
SELECT consumer, tenant, producer, message_id, started, failed, last_started_at, first_failure_at, last_failure_at,
       reason_code, error_message, handler_version, message_type, payload_sha256
  FROM inbox.attempt WHERE false;
SELECT quarantine_id, consumer, tenant, producer, message_id, kind, message_type, payload_sha256, stored_sha256,
       payload, payload_bytes, payload_ref, reason_code, error_message, attempts, crashes, deliveries,
       first_failure_at, last_failure_at, handler_version, status, created_at, last_seen_at, decided_at, decided_by
  FROM inbox.quarantine WHERE false;
SELECT decision_id, quarantine_id, decision, result, decided_by, decided_at, note, reason_code, error_message
  FROM inbox.quarantine_decision WHERE false;

DO $verify$
BEGIN
    IF pg_catalog.has_table_privilege('inbox_consumer', 'inbox.message', 'SELECT, INSERT, UPDATE, DELETE') THEN
        RAISE EXCEPTION 'inbox_consumer must not touch inbox.message directly';
    END IF;
    IF NOT pg_catalog.has_schema_privilege('inbox_dispatcher', 'inbox', 'USAGE') THEN
        RAISE EXCEPTION 'inbox_dispatcher has no USAGE on schema inbox';
    END IF;
    IF pg_catalog.has_column_privilege('inbox_reader', 'inbox.quarantine', 'payload', 'SELECT') THEN
        RAISE EXCEPTION 'inbox_reader must not read quarantined payloads';
    END IF;
END
$verify$;

ROLLBACK;
