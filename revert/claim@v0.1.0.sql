-- Revert pginbox:claim
BEGIN;

DROP FUNCTION inbox.configure_consumer(text, text[], integer, boolean, integer, boolean);
DROP FUNCTION inbox.record_start(text, text, text, text, text, jsonb, text, text);
DROP FUNCTION inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text);
DROP FUNCTION inbox._check_reason(text, text);
DROP FUNCTION inbox._check_optional(text, text, text);
DROP FUNCTION inbox._reason_code(text, text);
DROP FUNCTION inbox._record_failure_core(inbox.consumer_config, text, text, text, text, jsonb, bytea, text, text, text, text);
DROP FUNCTION inbox._held_by(inbox.delivery_result);
DROP FUNCTION inbox._quarantine_failure(inbox.attempt, text, text, integer, jsonb, text, boolean);
DROP FUNCTION inbox.claim_bytea(text, text, text, bytea, text, text, timestamptz);
DROP FUNCTION inbox.claim(text, text, text, jsonb, text, text, timestamptz);
DROP FUNCTION inbox._claim_core(text, text, text, text, bytea, text, timestamptz, jsonb, bytea, boolean);
DROP FUNCTION inbox._check_delivery(text, integer, integer, text);
DROP FUNCTION inbox._delivery_ok(integer, integer, text);
DROP FUNCTION inbox._settings(text);
DROP FUNCTION inbox._default_settings(text);
DROP FUNCTION inbox._identity_ok(text, text, text, text);
DROP FUNCTION inbox._check_identity(text, text, text, text, text);
DROP FUNCTION inbox.payload_hash(jsonb, text[]);

COMMIT;
