-- pginbox proxy: operator reads over every shard (RUN ON ALL) and quarantine decisions routed to
-- the shard that owns the entry's tenant. Every row read from a shard names it: `shard` is
-- host:port/database as the shard sees itself (the metrics carry it as a label). A read over all
-- shards fails while one cannot be reached (08006, like the routed calls): that shard is the alert.
-- Consumer settings, handler registrations and bindings are made on each shard directly.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE FUNCTION inbox.shard_status()
    RETURNS TABLE (shard text, schema_version integer, release text, processed bigint, quarantined bigint,
                   discarded bigint, open_quarantine bigint)
    LANGUAGE plproxy
AS $$
    CLUSTER 'inbox_shards';
    RUN ON ALL;
    SELECT pg_catalog.format('%s:%s/%s', coalesce(pg_catalog.host(pg_catalog.inet_server_addr()), 'local'),
                             pg_catalog.inet_server_port(), pg_catalog.current_database()) AS shard,
           v.version AS schema_version, v.release,
           (SELECT pg_catalog.count(*) FROM inbox.message m WHERE m.status = 'processed') AS processed,
           (SELECT pg_catalog.count(*) FROM inbox.message m WHERE m.status = 'quarantined') AS quarantined,
           (SELECT pg_catalog.count(*) FROM inbox.message m WHERE m.status = 'discarded') AS discarded,
           (SELECT pg_catalog.count(*) FROM inbox.quarantine q WHERE q.status = 'open') AS open_quarantine
      FROM inbox.schema_release() v;
$$;
COMMENT ON FUNCTION inbox.shard_status() IS 'Every shard: its release and its messages and open quarantine entries';

CREATE FUNCTION inbox._route_metrics()
    RETURNS TABLE (metric text, type text, help text, labels jsonb, value double precision)
    LANGUAGE plproxy
AS $$
    CLUSTER 'inbox_shards';
    RUN ON ALL;
    SELECT m.metric, m.type, m.help,
           m.labels OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object('shard', pg_catalog.format('%s:%s/%s',
               coalesce(pg_catalog.host(pg_catalog.inet_server_addr()), 'local'), pg_catalog.inet_server_port(),
               pg_catalog.current_database())) AS labels,
           m.value
      FROM inbox.metrics() m;
$$;

CREATE FUNCTION inbox.quarantine_entries(consumer text DEFAULT NULL, max_rows integer DEFAULT 100)
    RETURNS TABLE (shard text, quarantine_id bigint, consumer text, tenant text, producer text, message_id text,
                   kind text, message_type text, reason_code text, error_message text, attempts integer,
                   created_at timestamptz, last_seen_at timestamptz)
    LANGUAGE plproxy
AS $$
    CLUSTER 'inbox_shards';
    RUN ON ALL;
    SELECT pg_catalog.format('%s:%s/%s', coalesce(pg_catalog.host(pg_catalog.inet_server_addr()), 'local'),
                             pg_catalog.inet_server_port(), pg_catalog.current_database()) AS shard,
           q.quarantine_id, q.consumer, q.tenant, q.producer, q.message_id, q.kind, q.message_type, q.reason_code,
           q.error_message, q.attempts, q.created_at, q.last_seen_at
      FROM inbox.quarantine q
     WHERE q.status = 'open' AND ($1 IS NULL OR q.consumer = $1)
     ORDER BY q.created_at, q.quarantine_id
     LIMIT $2;
$$;
COMMENT ON FUNCTION inbox.quarantine_entries(text, integer) IS
    'Open quarantine entries of every shard (at most max_rows per shard, oldest first); decide with tenant and id';

-- Decisions: the entry is named by its tenant (which shard) and its id there; an id of another
-- tenant on the same shard is not found. The row: the entry's identity and what the decision came to
-- (status of the entry after it; a repair's outcome).
CREATE FUNCTION inbox._route_decide(decision text, tenant text, quarantine_id bigint, note text)
    RETURNS TABLE (consumer text, producer text, message_id text, status text, outcome text, reason_code text,
                   error_message text, decided_at timestamptz, decided_by text)
    LANGUAGE plproxy
AS $$
    CLUSTER 'inbox_shards';
    RUN ON inbox.tenant_partition(tenant);
    SELECT q.consumer, q.producer, q.message_id, d.status, d.outcome, d.reason_code,
           d.error_message, d.decided_at, d.decided_by
      FROM inbox.quarantine q
     CROSS JOIN LATERAL (
           SELECT x.status, NULL::text AS outcome, x.reason_code, NULL::text AS error_message, x.decided_at, x.decided_by
             FROM inbox.discard(q.quarantine_id, $4) x WHERE $1 = 'discard'
           UNION ALL
           SELECT x.status, NULL::text, x.reason_code, NULL::text, x.decided_at, x.decided_by
             FROM inbox.release(q.quarantine_id, $4) x WHERE $1 = 'release'
           UNION ALL
           SELECT CASE WHEN x.outcome = 'applied' THEN 'recovered' ELSE 'open' END, x.outcome, x.reason_code,
                  x.error_message, pg_catalog.clock_timestamp(), session_user::text
             FROM inbox.repair(q.quarantine_id, $4) x WHERE $1 = 'repair') d
     WHERE q.quarantine_id = $3 AND q.tenant = $2;
$$;

ALTER FUNCTION inbox.shard_status() OWNER TO inbox_owner;
ALTER FUNCTION inbox._route_metrics() OWNER TO inbox_owner;
ALTER FUNCTION inbox.quarantine_entries(text, integer) OWNER TO inbox_owner;
ALTER FUNCTION inbox._route_decide(text, text, bigint, text) OWNER TO inbox_owner;

SET LOCAL ROLE inbox_owner;

-- The shards' metrics, each series labelled with its shard (sum without (shard) for the totals).
CREATE FUNCTION inbox.metrics()
    RETURNS TABLE (metric text, type text, help text, labels jsonb, value double precision)
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $$
DECLARE
    err_state text;
    err_message text;
    err_detail text;
    err_hint text;
BEGIN
    RETURN QUERY SELECT m.metric, m.type, m.help, m.labels, m.value FROM inbox._route_metrics() m;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                            err_detail = PG_EXCEPTION_DETAIL, err_hint = PG_EXCEPTION_HINT;
    PERFORM inbox._raise_routed('inbox.metrics', NULL, err_state, err_message, err_detail, err_hint);
END
$$;
COMMENT ON FUNCTION inbox.metrics() IS 'Every shard''s metrics, labelled shard';

CREATE FUNCTION inbox._decide(decision text, tenant text, quarantine_id bigint, note text)
    RETURNS TABLE (consumer text, producer text, message_id text, status text, outcome text, reason_code text,
                   error_message text, decided_at timestamptz, decided_by text)
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $$
DECLARE
    found_one boolean := false;
    err_state text;
    err_message text;
    err_detail text;
    err_hint text;
BEGIN
    IF _decide.tenant IS NULL OR _decide.quarantine_id IS NULL THEN
        RAISE EXCEPTION 'inbox.%: tenant and quarantine_id must not be NULL (the default tenant is '''')', decision
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    BEGIN
        RETURN QUERY SELECT r.* FROM inbox._route_decide(decision, _decide.tenant, _decide.quarantine_id, note) r;
        GET DIAGNOSTICS found_one = ROW_COUNT;
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                                err_detail = PG_EXCEPTION_DETAIL, err_hint = PG_EXCEPTION_HINT;
        PERFORM inbox._raise_routed('inbox.' || decision, _decide.tenant, err_state, err_message, err_detail, err_hint);
    END;
    IF NOT found_one THEN
        RAISE EXCEPTION 'inbox.%: no quarantine entry % of tenant % on its shard', decision, _decide.quarantine_id,
            pg_catalog.quote_literal(_decide.tenant)
            USING ERRCODE = 'no_data_found', HINT = 'inbox.quarantine_entries() lists the open entries with their tenants.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._decide(text, text, bigint, text) IS 'internal: a quarantine decision on the tenant''s shard';

CREATE FUNCTION inbox.discard(tenant text, quarantine_id bigint, note text)
    RETURNS TABLE (consumer text, producer text, message_id text, status text, outcome text, reason_code text,
                   error_message text, decided_at timestamptz, decided_by text)
    LANGUAGE sql VOLATILE SECURITY INVOKER
    BEGIN ATOMIC
        SELECT * FROM inbox._decide('discard', discard.tenant, discard.quarantine_id, discard.note);
    END;
COMMENT ON FUNCTION inbox.discard(text, bigint, text) IS 'Discard a quarantine entry on the tenant''s shard (inbox.discard there)';

CREATE FUNCTION inbox.release(tenant text, quarantine_id bigint, note text)
    RETURNS TABLE (consumer text, producer text, message_id text, status text, outcome text, reason_code text,
                   error_message text, decided_at timestamptz, decided_by text)
    LANGUAGE sql VOLATILE SECURITY INVOKER
    BEGIN ATOMIC
        SELECT * FROM inbox._decide('release', release.tenant, release.quarantine_id, release.note);
    END;
COMMENT ON FUNCTION inbox.release(text, bigint, text) IS 'Release a quarantine entry on the tenant''s shard (inbox.release there)';

CREATE FUNCTION inbox.repair(tenant text, quarantine_id bigint, note text)
    RETURNS TABLE (consumer text, producer text, message_id text, status text, outcome text, reason_code text,
                   error_message text, decided_at timestamptz, decided_by text)
    LANGUAGE sql VOLATILE SECURITY INVOKER
    BEGIN ATOMIC
        SELECT * FROM inbox._decide('repair', repair.tenant, repair.quarantine_id, repair.note);
    END;
COMMENT ON FUNCTION inbox.repair(text, bigint, text) IS 'Repair a quarantine entry on the tenant''s shard (inbox.repair there)';

REVOKE ALL ON FUNCTION inbox.shard_status(), inbox._route_metrics(), inbox.metrics(),
    inbox.quarantine_entries(text, integer), inbox._route_decide(text, text, bigint, text),
    inbox._decide(text, text, bigint, text), inbox.discard(text, bigint, text), inbox.release(text, bigint, text),
    inbox.repair(text, bigint, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.shard_status(), inbox._route_metrics(), inbox.metrics(),
    inbox._shard_unreachable(text, text), inbox._raise_routed(text, text, text, text, text, text)
    TO inbox_reader, inbox_operator;
GRANT EXECUTE ON FUNCTION inbox.quarantine_entries(text, integer), inbox._route_decide(text, text, bigint, text),
    inbox._decide(text, text, bigint, text), inbox.discard(text, bigint, text), inbox.release(text, bigint, text),
    inbox.repair(text, bigint, text)
    TO inbox_operator;

COMMIT;
