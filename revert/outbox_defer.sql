-- Revert pginbox:outbox_defer
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DROP FUNCTION inbox.defer_effects(text[], bigint[], text[], text[], interval);

COMMIT;
