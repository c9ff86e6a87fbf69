-- Deploy pginbox:version: written from sql/999_version.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: the schema version clients check before they run. This change is reworked at every
-- release (docs/releasing.md): version goes up by one, and breaking_since names the version of the
-- last release that broke clients of earlier ones. A client knows the versions up to its own:
--   database version known to the client                          -> run
--   database newer, breaking_since <= the newest version it knows -> run, with a warning
--   database newer, breaking_since newer than what it knows       -> refuse: upgrade the client
--   database older, and the client marks a version in between as
--   breaking (it needs what that release added)                   -> refuse: deploy the schema
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

CREATE OR REPLACE FUNCTION inbox.schema_version() RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 3;
COMMENT ON FUNCTION inbox.schema_version() IS 'Version of the inbox SQL API (one per release; see inbox.schema_release())';

CREATE OR REPLACE FUNCTION inbox.schema_release(OUT version integer, OUT release text, OUT breaking_since integer)
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT inbox.schema_version(), '0.3.0'::text, 1 $$;
COMMENT ON FUNCTION inbox.schema_release() IS
    'The deployed release: API version, release name, and the version of the last release that broke earlier clients';

REVOKE ALL ON FUNCTION inbox.schema_version(), inbox.schema_release() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.schema_version(), inbox.schema_release()
    TO inbox_consumer, inbox_operator, inbox_reader, inbox_dispatcher;

COMMIT;
