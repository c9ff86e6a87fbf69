-- Revert pginbox:schema
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

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
