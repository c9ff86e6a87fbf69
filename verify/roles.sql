-- Verify pginbox:roles
BEGIN;

DO $verify$
BEGIN
    IF (SELECT count(*) FROM pg_catalog.pg_roles
         WHERE rolname IN ('inbox_owner', 'inbox_consumer', 'inbox_operator', 'inbox_reader')
           AND NOT rolcanlogin AND NOT rolsuper) <> 4 THEN
        RAISE EXCEPTION 'the four NOLOGIN roles inbox_owner, inbox_consumer, inbox_operator, inbox_reader are not all there';
    END IF;
END
$verify$;

ROLLBACK;
