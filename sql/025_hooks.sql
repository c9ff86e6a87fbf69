-- pginbox: hooks that later modules put on the claim paths, as no-ops.
BEGIN;

SET LOCAL ROLE inbox_owner;

-- Hooks of later modules on the claim paths. They start as no-ops here and are replaced by
-- sql/075_retention.sql (_heartbeat, _expire_check) and sql/095_metrics.sql (_count_duplicate),
-- whose revert scripts put these no-ops back: reverting one of those modules alone
-- (sqitch revert --to ...) leaves claims that work, instead of claims that call dropped objects.
CREATE FUNCTION inbox._heartbeat(consumer text) RETURNS void
    LANGUAGE sql VOLATILE
    RETURN NULL;
COMMENT ON FUNCTION inbox._heartbeat(text) IS 'internal: retention''s heartbeat (a no-op until sql/075_retention.sql replaces it)';

CREATE FUNCTION inbox._expire_check(
    consumer text, tenant text, producer text, message_id text, payload_hash bytea, handler_version text,
    produced_at timestamptz, message_type text, payload jsonb, payload_bytes bytea, store_payload boolean)
    RETURNS inbox.delivery_result
    LANGUAGE sql VOLATILE
    RETURN NULL::inbox.delivery_result;
COMMENT ON FUNCTION inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean) IS 'internal: retention''s watermark check (a no-op until sql/075_retention.sql replaces it)';

CREATE FUNCTION inbox._count_duplicate(consumer text, producer text) RETURNS void
    LANGUAGE sql VOLATILE
    RETURN NULL;
COMMENT ON FUNCTION inbox._count_duplicate(text, text) IS 'internal: counts a duplicate delivery (a no-op until sql/095_metrics.sql replaces it)';

COMMIT;
