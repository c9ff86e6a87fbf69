-- Revert pginbox:outbox_scope_tables to @v0.2.0: a verify-only rework (docs/releasing.md), nothing
-- to undo; revert/outbox_scope_tables@v0.2.0.sql reverts the tables.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

COMMIT;
