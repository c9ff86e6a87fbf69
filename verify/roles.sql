-- Verify pginbox:roles
BEGIN;

DO $verify$
BEGIN
    IF (SELECT count(*) FROM pg_catalog.pg_roles
         WHERE rolname IN ('inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_dispatcher')
           AND NOT rolcanlogin AND NOT rolsuper) <> 5 THEN
        RAISE EXCEPTION 'the five NOLOGIN roles inbox_owner, inbox_consumer, inbox_operator, inbox_reader, inbox_dispatcher are not all there';
    END IF;
END
$verify$;

ROLLBACK;
