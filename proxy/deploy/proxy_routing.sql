-- pginbox proxy: the one-call delivery API, routed by tenant. Same names, arguments, outcomes and
-- SQLSTATEs as the shards' functions (sql/030_claim.sql, sql/040_apply.sql); each call runs in a
-- transaction of the shard that owns the tenant (PL/Proxy sends it in autocommit: the claim, the
-- handler's writes and a recorded failure commit together there, before the proxy call returns).
--   inbox._route_*   LANGUAGE plproxy: CLUSTER 'inbox_shards'; RUN ON inbox.tenant_partition(tenant).
--                    The remote SELECT passes arguments by position (named arguments inside a
--                    proxied SELECT are not substituted by PL/Proxy).
--   inbox.<name>     plpgsql wrappers, SECURITY INVOKER (the shard sees the caller's role): a
--                    shard's error comes back with its SQLSTATE, message, detail and hint; a shard
--                    that cannot be reached is 08006 (connection_failure: retryable) naming the
--                    tenant; an unconfigured cluster is 55000.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE TYPE inbox.delivery_result AS (
    outcome text,
    payload_sha256 text,
    stored_sha256 text,
    handler_version text,
    processed_at timestamptz,
    quarantine_id bigint,
    attempts integer,
    reason_code text,
    error_message text
);
ALTER TYPE inbox.delivery_result OWNER TO inbox_owner;
COMMENT ON TYPE inbox.delivery_result IS 'What one delivery came to (the shards'' type, column for column)';

-- The release whose API this proxy routes: clients check it as they check a shard's. Every shard
-- must run it (inbox.shard_status() lists theirs).
CREATE FUNCTION inbox.schema_version() RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 3;
CREATE FUNCTION inbox.schema_release(OUT version integer, OUT release text, OUT breaking_since integer)
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT inbox.schema_version(), '0.3.0'::text, 1 $$;
ALTER FUNCTION inbox.schema_version() OWNER TO inbox_owner;
ALTER FUNCTION inbox.schema_release() OWNER TO inbox_owner;
COMMENT ON FUNCTION inbox.schema_release() IS 'The release of the SQL API this proxy routes (the shards run it)';

-- Is this error PL/Proxy failing to reach or talk to a shard (not an error the shard raised)? A
-- shard shutting down ends its sessions with a FATAL (57P01 admin_shutdown, 57P02, 57P03): the
-- shard is going away, the same for the caller.
CREATE FUNCTION inbox._shard_unreachable(state text, message text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN (state OPERATOR(pg_catalog.=) 'XX000'
            AND message OPERATOR(pg_catalog.!~) 'REMOTE ERROR'
            AND message OPERATOR(pg_catalog.~*)
                '(PQ[a-z]+|connection|could not connect|server closed|stale conn|timeout|terminating|no response)')
        OR message OPERATOR(pg_catalog.~) '\] REMOTE FATAL: '
        OR state OPERATOR(pg_catalog.=) ANY (ARRAY['57P01', '57P02', '57P03']);
ALTER FUNCTION inbox._shard_unreachable(text, text) OWNER TO inbox_owner;
COMMENT ON FUNCTION inbox._shard_unreachable(text, text) IS 'internal: a PL/Proxy error that means the shard could not be reached';

-- Raises what a routed call failed with: 08006 for an unreachable shard, 55000 for no cluster,
-- else the shard's own error without PL/Proxy's prefix (same SQLSTATE, detail and hint).
CREATE FUNCTION inbox._raise_routed(fn text, tenant text, state text, message text, detail text, hint text)
    RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF inbox._shard_unreachable(state, message) THEN
        RAISE EXCEPTION '%: the shard of tenant % cannot be reached; retry later (the other shards'' tenants are unaffected)',
            fn, coalesce(pg_catalog.quote_literal(tenant), 'NULL')
            USING ERRCODE = 'connection_failure', DETAIL = message,
                  HINT = 'Nothing was applied on that shard unless the connection broke after its commit; a retry answers duplicate then.';
    END IF;
    IF state OPERATOR(pg_catalog.=) 'XX000' AND message OPERATOR(pg_catalog.~) 'inbox_shards' THEN
        RAISE EXCEPTION '%: no shards configured: %', fn, message
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'An operator calls inbox.configure_shards(ARRAY[''host=... dbname=...'', ...]) on the proxy database.';
    END IF;
    message := pg_catalog.regexp_replace(message, '^.*?REMOTE ERROR: ', '');
    detail := NULLIF(pg_catalog.regexp_replace(detail, '^Remote detail: ', ''), '');
    hint := NULLIF(pg_catalog.regexp_replace(hint, '^Remote hint: ', ''), '');
    IF detail IS NOT NULL AND hint IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = state, MESSAGE = message, DETAIL = detail, HINT = hint;
    ELSIF detail IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = state, MESSAGE = message, DETAIL = detail;
    ELSIF hint IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = state, MESSAGE = message, HINT = hint;
    END IF;
    RAISE EXCEPTION USING ERRCODE = state, MESSAGE = message;
END
$$;
ALTER FUNCTION inbox._raise_routed(text, text, text, text, text, text) OWNER TO inbox_owner;
COMMENT ON FUNCTION inbox._raise_routed(text, text, text, text, text, text) IS 'internal: the error a routed call ends with';

CREATE FUNCTION inbox._route_claim_and_apply(consumer text, producer text, message_id text, message_type text,
                                             payload jsonb, tenant text, produced_at timestamptz)
    RETURNS inbox.delivery_result
    LANGUAGE plproxy
AS $$
    CLUSTER 'inbox_shards';
    RUN ON inbox.tenant_partition(tenant);
    SELECT r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at, r.quarantine_id,
           r.attempts, r.reason_code, r.error_message
      FROM inbox.claim_and_apply($1, $2, $3, $4, $5, $6, $7) r;
$$;

CREATE FUNCTION inbox._route_record_start(consumer text, producer text, message_id text, tenant text,
                                          message_type text, payload jsonb, handler_version text, payload_ref text)
    RETURNS inbox.delivery_result
    LANGUAGE plproxy
AS $$
    CLUSTER 'inbox_shards';
    RUN ON inbox.tenant_partition(tenant);
    SELECT r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at, r.quarantine_id,
           r.attempts, r.reason_code, r.error_message
      FROM inbox.record_start($1, $2, $3, $4, $5, $6, $7, $8) r;
$$;

CREATE FUNCTION inbox._route_record_failure(consumer text, producer text, message_id text, payload jsonb,
                                            reason_code text, error_message text, handler_version text, tenant text,
                                            message_type text, payload_ref text)
    RETURNS inbox.delivery_result
    LANGUAGE plproxy
AS $$
    CLUSTER 'inbox_shards';
    RUN ON inbox.tenant_partition(tenant);
    SELECT r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at, r.quarantine_id,
           r.attempts, r.reason_code, r.error_message
      FROM inbox.record_failure($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) r;
$$;

-- One call per partition with that partition's elements (SPLIT): each shard runs its part of the
-- batch in one transaction; ordinals are the caller's, carried through (the shard's row n is the
-- n-th element of its part: ($3)[n], the arrays SPLIT builds start at 1). The caller computes each
-- element's partition (as inbox.tenant_partition does, for all its tenants at once): RUN ON an
-- argument takes them as they are, without a query per element.
CREATE FUNCTION inbox._route_claim_and_apply_batch(consumer text, partitions integer[], ordinals integer[],
                                                   messages jsonb[])
    RETURNS TABLE (ordinal integer, tenant text, producer text, message_id text, outcome text,
                   payload_sha256 text, stored_sha256 text, handler_version text, processed_at timestamptz,
                   quarantine_id bigint, attempts integer, reason_code text, error_message text)
    LANGUAGE plproxy
AS $$
    CLUSTER 'inbox_shards';
    SPLIT partitions, ordinals, messages;
    RUN ON partitions;
    SELECT ($3)[r.ordinal] AS ordinal, r.tenant, r.producer, r.message_id, r.outcome, r.payload_sha256,
           r.stored_sha256, r.handler_version, r.processed_at, r.quarantine_id, r.attempts, r.reason_code,
           r.error_message
      FROM inbox.claim_and_apply_batch($1, pg_catalog.to_jsonb($4)) r;
$$;

ALTER FUNCTION inbox._route_claim_and_apply(text, text, text, text, jsonb, text, timestamptz) OWNER TO inbox_owner;
ALTER FUNCTION inbox._route_record_start(text, text, text, text, text, jsonb, text, text) OWNER TO inbox_owner;
ALTER FUNCTION inbox._route_record_failure(text, text, text, jsonb, text, text, text, text, text, text) OWNER TO inbox_owner;
ALTER FUNCTION inbox._route_claim_and_apply_batch(text, integer[], integer[], jsonb[]) OWNER TO inbox_owner;

SET LOCAL ROLE inbox_owner;

CREATE FUNCTION inbox.claim_and_apply(
    consumer text, producer text, message_id text, message_type text, payload jsonb, tenant text DEFAULT '',
    produced_at timestamptz DEFAULT NULL)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $$
DECLARE
    err_state text;
    err_message text;
    err_detail text;
    err_hint text;
BEGIN
    RETURN inbox._route_claim_and_apply(consumer, producer, message_id, message_type, payload, tenant, produced_at);
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                            err_detail = PG_EXCEPTION_DETAIL, err_hint = PG_EXCEPTION_HINT;
    PERFORM inbox._raise_routed('inbox.claim_and_apply', tenant, err_state, err_message, err_detail, err_hint);
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz) IS
    'Routed to the tenant''s shard: claim and run the registered handler there in one transaction';

CREATE FUNCTION inbox.record_start(
    consumer text, producer text, message_id text, tenant text DEFAULT '', message_type text DEFAULT NULL,
    payload jsonb DEFAULT NULL, handler_version text DEFAULT 'unversioned', payload_ref text DEFAULT NULL)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $$
DECLARE
    err_state text;
    err_message text;
    err_detail text;
    err_hint text;
BEGIN
    RETURN inbox._route_record_start(consumer, producer, message_id, tenant, message_type, payload, handler_version,
                                     payload_ref);
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                            err_detail = PG_EXCEPTION_DETAIL, err_hint = PG_EXCEPTION_HINT;
    PERFORM inbox._raise_routed('inbox.record_start', tenant, err_state, err_message, err_detail, err_hint);
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION inbox.record_start(text, text, text, text, text, jsonb, text, text) IS
    'Routed to the tenant''s shard: announce a redelivered attempt (proceed | quarantined)';

CREATE FUNCTION inbox.record_failure(
    consumer text, producer text, message_id text, payload jsonb, reason_code text,
    error_message text DEFAULT NULL, handler_version text DEFAULT 'unversioned', tenant text DEFAULT '',
    message_type text DEFAULT NULL, payload_ref text DEFAULT NULL)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $$
DECLARE
    err_state text;
    err_message text;
    err_detail text;
    err_hint text;
BEGIN
    RETURN inbox._route_record_failure(consumer, producer, message_id, payload, reason_code, error_message,
                                       handler_version, tenant, message_type, payload_ref);
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                            err_detail = PG_EXCEPTION_DETAIL, err_hint = PG_EXCEPTION_HINT;
    PERFORM inbox._raise_routed('inbox.record_failure', tenant, err_state, err_message, err_detail, err_hint);
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text) IS
    'Routed to the tenant''s shard: record a permanent failure (failed | quarantined)';

-- Up to 64 messages over any tenants: the elements are grouped by partition and each shard gets
-- one call with its own (in parallel); the rows come back in the caller's order. A shard applies
-- its part in one transaction, so a batch whose part on one shard fails may have committed on the
-- others: retried, those answer duplicate. Shape and size are checked here, before any shard is
-- called; everything else by each shard, before it claims anything.
CREATE FUNCTION inbox.claim_and_apply_batch(consumer text, messages jsonb)
    RETURNS TABLE (ordinal integer, tenant text, producer text, message_id text, outcome text,
                   payload_sha256 text, stored_sha256 text, handler_version text, processed_at timestamptz,
                   quarantine_id bigint, attempts integer, reason_code text, error_message text)
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $$
DECLARE
    tenants text[];
    partitions integer[];
    ordinals integer[];
    elements jsonb[];
    moving text;
    err_state text;
    err_message text;
    err_detail text;
    err_hint text;
BEGIN
    IF messages IS NULL THEN
        RAISE EXCEPTION 'inbox.claim_and_apply_batch: messages must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.jsonb_typeof(messages) OPERATOR(pg_catalog.<>) 'array'
       OR EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements(messages) e(v)
                   WHERE pg_catalog.jsonb_typeof(e.v) OPERATOR(pg_catalog.<>) 'object'
                      OR pg_catalog.jsonb_typeof(e.v OPERATOR(pg_catalog.->) 'tenant')
                         NOT IN ('string', 'null')) THEN
        RAISE EXCEPTION 'inbox.claim_and_apply_batch: messages must be a JSON array of message objects'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each element: {"producer": ..., "message_id": ..., "message_type": ..., "payload": ..., "tenant"?: ..., "produced_at"?: ...}';
    END IF;
    IF pg_catalog.jsonb_array_length(messages) OPERATOR(pg_catalog.>) 64 THEN
        RAISE EXCEPTION 'inbox.claim_and_apply_batch: a batch holds at most 64 messages, got %',
            pg_catalog.jsonb_array_length(messages) USING ERRCODE = 'program_limit_exceeded', HINT = 'Split the batch.';
    END IF;
    IF pg_catalog.jsonb_array_length(messages) OPERATOR(pg_catalog.=) 0 THEN
        RETURN;
    END IF;
    -- inbox.tenant_partition for every tenant of the batch, in two statements instead of a call
    -- per tenant: the tenants' routing keys held shared first, then their placements read by a
    -- statement whose snapshot follows the locks (a move committed meanwhile is seen). 55P03 names
    -- the first of its tenants being moved.
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(inbox._route_lock_space(), inbox.tenant_hash(d.tenant))
       FROM (SELECT DISTINCT coalesce(e.v OPERATOR(pg_catalog.->>) 'tenant', '') AS tenant
               FROM pg_catalog.jsonb_array_elements(messages) e(v)) d;
    SELECT pg_catalog.array_agg(DISTINCT x.tenant),
           pg_catalog.array_agg(coalesce(p.partition, inbox.tenant_hash(x.tenant)) ORDER BY x.n),
           pg_catalog.array_agg(x.n ORDER BY x.n), pg_catalog.array_agg(x.v ORDER BY x.n),
           pg_catalog.min(x.tenant) FILTER (WHERE p.moving)
      INTO tenants, partitions, ordinals, elements, moving
      FROM (SELECT e.v, e.n::integer AS n, coalesce(e.v OPERATOR(pg_catalog.->>) 'tenant', '') AS tenant
              FROM pg_catalog.jsonb_array_elements(messages) WITH ORDINALITY e(v, n)) x
      LEFT JOIN inbox.tenant_placement p ON p.tenant OPERATOR(pg_catalog.=) x.tenant;
    IF moving IS NOT NULL THEN
        RAISE EXCEPTION 'tenant % is being moved between shards: retry later', pg_catalog.quote_literal(moving)
            USING ERRCODE = 'lock_not_available',
                  HINT = 'An operator called inbox.begin_tenant_move; inbox.place_tenant ends the move.';
    END IF;
    BEGIN
        RETURN QUERY
        SELECT r.ordinal, r.tenant, r.producer, r.message_id, r.outcome, r.payload_sha256, r.stored_sha256,
               r.handler_version, r.processed_at, r.quarantine_id, r.attempts, r.reason_code, r.error_message
          FROM inbox._route_claim_and_apply_batch(consumer, partitions, ordinals, elements) r
         ORDER BY r.ordinal;
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                                err_detail = PG_EXCEPTION_DETAIL, err_hint = PG_EXCEPTION_HINT;
        PERFORM inbox._raise_routed('inbox.claim_and_apply_batch',
                                    CASE WHEN pg_catalog.array_length(tenants, 1) OPERATOR(pg_catalog.=) 1
                                         THEN tenants[1] END,
                                    err_state, err_message, err_detail, err_hint);
    END;
END
$$;
COMMENT ON FUNCTION inbox.claim_and_apply_batch(text, jsonb) IS
    'Routed per shard: each shard claims and applies its elements in one call; rows in the caller''s order';

REVOKE ALL ON FUNCTION inbox.schema_version(), inbox.schema_release(), inbox._shard_unreachable(text, text),
    inbox._raise_routed(text, text, text, text, text, text),
    inbox._route_claim_and_apply(text, text, text, text, jsonb, text, timestamptz),
    inbox._route_record_start(text, text, text, text, text, jsonb, text, text),
    inbox._route_record_failure(text, text, text, jsonb, text, text, text, text, text, text),
    inbox._route_claim_and_apply_batch(text, integer[], integer[], jsonb[]),
    inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz),
    inbox.record_start(text, text, text, text, text, jsonb, text, text),
    inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text),
    inbox.claim_and_apply_batch(text, jsonb)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.schema_version(), inbox.schema_release()
    TO inbox_consumer, inbox_operator, inbox_reader, inbox_dispatcher;
GRANT EXECUTE ON FUNCTION inbox._shard_unreachable(text, text), inbox._raise_routed(text, text, text, text, text, text),
    inbox._route_claim_and_apply(text, text, text, text, jsonb, text, timestamptz),
    inbox._route_record_start(text, text, text, text, text, jsonb, text, text),
    inbox._route_record_failure(text, text, text, jsonb, text, text, text, text, text, text),
    inbox._route_claim_and_apply_batch(text, integer[], integer[], jsonb[]),
    inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz),
    inbox.record_start(text, text, text, text, text, jsonb, text, text),
    inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text),
    inbox.claim_and_apply_batch(text, jsonb)
    TO inbox_consumer;

COMMIT;
