-- Revert pginbox:version
BEGIN;

DROP FUNCTION inbox.schema_release();
DROP FUNCTION inbox.schema_version();

COMMIT;
