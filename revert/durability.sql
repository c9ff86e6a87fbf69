-- Revert pginbox:durability: drop the durability functions. inbox_owner keeps pg_read_all_stats:
-- roles are shared by every database of the cluster, and pginbox in another database may wait on
-- its standbys (revoke it by hand when no database needs it: REVOKE pg_read_all_stats FROM inbox_owner).
BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;

DROP FUNCTION IF EXISTS inbox.wait_durable(pg_lsn, integer, text, text[], interval);
DROP FUNCTION IF EXISTS inbox.commit_durable(pg_lsn, integer, text, text[]);
DROP FUNCTION IF EXISTS inbox._durable_count(pg_lsn, text, text[]);
DROP FUNCTION IF EXISTS inbox._durable_target(pg_lsn, integer, text, text[]);

COMMIT;
