-- pginbox: NOLOGIN group roles. Roles are cluster-wide, so they are created only when missing:
-- a second database in the same cluster deploys cleanly.
--   inbox_owner     owns schema inbox and every object in it; nobody logs in as it.
--   inbox_consumer  delivers messages: claim, claim_and_apply, record_start, record_failure.
--   inbox_operator  registers handlers, configures consumers, decides on quarantine, reads payloads.
--   inbox_reader    reads inbox state and metrics, never payloads.
--   inbox_dispatcher  claims outbox effects and reports their delivery (pginbox dispatch).
BEGIN;

DO $roles$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader',
                                          'inbox_dispatcher'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = role_name) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
        END IF;
    END LOOP;
END
$roles$;

COMMIT;
