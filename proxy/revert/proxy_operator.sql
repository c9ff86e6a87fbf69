BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION inbox._shard_unreachable(text, text), inbox._raise_routed(text, text, text, text, text, text)
    FROM inbox_reader, inbox_operator;
DROP FUNCTION inbox.repair(text, bigint, text);
DROP FUNCTION inbox.release(text, bigint, text);
DROP FUNCTION inbox.discard(text, bigint, text);
DROP FUNCTION inbox._decide(text, text, bigint, text);
DROP FUNCTION inbox._route_decide(text, text, bigint, text);
DROP FUNCTION inbox.quarantine_entries(text, integer);
DROP FUNCTION inbox.metrics();
DROP FUNCTION inbox._route_metrics();
DROP FUNCTION inbox.shard_status();
COMMIT;
