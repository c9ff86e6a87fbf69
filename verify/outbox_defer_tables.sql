-- Verify pginbox:outbox_defer_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT deferred_reason, deferred_at, deferrals FROM inbox.outbox WHERE false;

ROLLBACK;
