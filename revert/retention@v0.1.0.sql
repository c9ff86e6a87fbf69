-- Revert pginbox:retention
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

DROP VIEW inbox.retention_status;
DROP PROCEDURE inbox.purge(text, text, integer, integer, interval, bigint, text);
DROP FUNCTION inbox.purge_batch(text, text, integer);
DROP FUNCTION inbox._running_transactions();
DROP FUNCTION inbox.announce_purge(text, text);
DROP FUNCTION inbox._check_purge_args(text, text, text, integer);
DROP FUNCTION inbox.purge_unlock(text);
DROP FUNCTION inbox.purge_lock(text);
DROP FUNCTION inbox._purge_lock_held(text);
-- The claim paths call these hooks: put the no-ops of sql/025_hooks.sql back instead of dropping them.
CREATE OR REPLACE FUNCTION inbox._expire_check(
    consumer text, tenant text, producer text, message_id text, payload_hash bytea, handler_version text,
    produced_at timestamptz, message_type text, payload jsonb, payload_bytes bytea, store_payload boolean)
    RETURNS inbox.delivery_result
    LANGUAGE sql VOLATILE
    RETURN NULL::inbox.delivery_result;
COMMENT ON FUNCTION inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean) IS 'internal: retention''s watermark check (a no-op until sql/075_retention.sql replaces it)';
DROP FUNCTION inbox._watermark(text, text);
DROP FUNCTION inbox._active_cutoff(text, interval);
CREATE OR REPLACE FUNCTION inbox._heartbeat(consumer text) RETURNS void
    LANGUAGE sql VOLATILE
    RETURN NULL;
COMMENT ON FUNCTION inbox._heartbeat(text) IS 'internal: retention''s heartbeat (a no-op until sql/075_retention.sql replaces it)';
DROP FUNCTION inbox.set_retention_policy(text, text, interval, interval, interval, interval, interval, interval,
                                         interval, interval, text);
DROP FUNCTION inbox.retention_window(text, text);
DROP FUNCTION inbox._policy_for(text, text);
DROP FUNCTION inbox._retention_window(inbox.retention_policy);

COMMIT;
