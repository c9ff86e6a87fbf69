-- Revert pginbox:schema
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

DROP FUNCTION inbox._settings(text);
DROP FUNCTION inbox._default_settings(text);
DROP FUNCTION inbox._identity_ok(text, text, text, text);
DROP FUNCTION inbox._check_identity(text, text, text, text, text);
DROP FUNCTION inbox.payload_hash(jsonb, text[]);
DROP FUNCTION inbox.schema_version();
DROP TABLE inbox.quarantine_decision;
DROP TABLE inbox.quarantine;
DROP TABLE inbox.attempt;
DROP TABLE inbox.message;
DROP TABLE inbox.handler_registration;
DROP TABLE inbox.handler;
DROP TABLE inbox.consumer_config;
DROP TYPE inbox._handler_call;
DROP TYPE inbox.message_status;
DROP TYPE inbox.message_context;
DROP TYPE inbox.delivery_result;
DROP SCHEMA inbox;
-- Back to PostgreSQL's default, which removes the pg_default_acl entry that depends on inbox_owner.
ALTER DEFAULT PRIVILEGES FOR ROLE inbox_owner GRANT EXECUTE ON FUNCTIONS TO PUBLIC;

COMMIT;
