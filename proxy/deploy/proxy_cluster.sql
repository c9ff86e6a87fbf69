-- pginbox proxy: PL/Proxy and the cluster it routes to.
--   The shards are the PL/Proxy SQL/MED cluster `inbox_shards` (a foreign server of the plproxy
--   wrapper, options p0 .. pN-1), configured with inbox.configure_shards(dsns). Its partition
--   count is a power of two (PL/Proxy maps a hash to a partition with hash & (count - 1)).
--   The routing key is the tenant; the documented hash is
--       tenant_hash = hashtext(coalesce(tenant, ''))      -- inbox.tenant_hash(tenant)
--   and a tenant's partition is tenant_hash & (count - 1), unless inbox.tenant_placement pins it
--   elsewhere (a tenant moved between shards: docs/scaling.md, "Moving a tenant").
--   The user mapping is PUBLIC with no user and no password: PL/Proxy connects to the shards as
--   the caller's effective role (current_user), so every authorization stays in the shard's SQL
--   (bindings, grants) and nobody gains another role's rights through the proxy. DSNs naming a
--   user, a password, a password file or a service are refused.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE SCHEMA IF NOT EXISTS plproxy;
REVOKE ALL ON SCHEMA plproxy FROM PUBLIC;
CREATE EXTENSION IF NOT EXISTS plproxy SCHEMA plproxy;
-- The language stays untrusted (only superusers create functions in it): a function naming its own
-- connect string could log in to a shard as anyone the shard trusts.
GRANT USAGE ON FOREIGN DATA WRAPPER plproxy TO inbox_owner;

CREATE SCHEMA inbox AUTHORIZATION inbox_owner;
REVOKE ALL ON SCHEMA inbox FROM PUBLIC;
GRANT USAGE ON SCHEMA inbox TO inbox_consumer, inbox_operator, inbox_reader, inbox_dispatcher;
COMMENT ON SCHEMA inbox IS 'pginbox proxy: the one-call delivery API routed by tenant to the shards (PL/Proxy)';
-- No function created by inbox_owner is ever executable by PUBLIC (as in the shards' schema).
ALTER DEFAULT PRIVILEGES FOR ROLE inbox_owner REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

SET LOCAL ROLE inbox_owner;

-- Tenants pinned to a partition other than their hash's (moved), or held while they move.
CREATE TABLE inbox.tenant_placement (
    tenant text PRIMARY KEY,
    partition integer NOT NULL CHECK (partition >= 0),
    moving boolean NOT NULL DEFAULT false,
    placed_at timestamptz NOT NULL DEFAULT now(),
    placed_by text NOT NULL DEFAULT session_user,
    note text NOT NULL
);
COMMENT ON TABLE inbox.tenant_placement IS
    'Tenants routed to another partition than tenant_hash & (count - 1), or held (moving) while an operator moves them';
REVOKE ALL ON inbox.tenant_placement FROM PUBLIC;
GRANT SELECT ON inbox.tenant_placement TO inbox_consumer, inbox_operator, inbox_reader;

CREATE FUNCTION inbox.tenant_hash(tenant text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_catalog.hashtext(coalesce(tenant, ''));
COMMENT ON FUNCTION inbox.tenant_hash(text) IS
    'The routing hash: hashtext(coalesce(tenant, '''')); the partition is tenant_hash & (partition count - 1)';

-- The advisory lock space of tenant routing: a call holds its tenant's key shared until its proxy
-- transaction ends; inbox.begin_tenant_move takes it exclusively, so it waits for calls in flight.
CREATE FUNCTION inbox._route_lock_space() RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 1886680168;  -- 'pxrh'
COMMENT ON FUNCTION inbox._route_lock_space() IS 'internal: the first key of the tenant routing advisory locks';

CREATE FUNCTION inbox.partition_count() RETURNS integer
    LANGUAGE sql STABLE
AS $$
    SELECT count(*)::integer
      FROM pg_catalog.pg_foreign_server s CROSS JOIN LATERAL pg_catalog.unnest(s.srvoptions) o(opt)
     WHERE s.srvname OPERATOR(pg_catalog.=) 'inbox_shards' AND o.opt OPERATOR(pg_catalog.~) '^p[0-9]+='
$$;
COMMENT ON FUNCTION inbox.partition_count() IS 'Partitions of the cluster inbox_shards (0: not configured)';

-- RUN ON inbox.tenant_partition(tenant): the partition a tenant's calls go to. Holds the tenant's
-- routing key shared for the rest of the transaction; refuses a tenant being moved with 55P03
-- (lock_not_available: retryable, the client retries the delivery later). Runs on every routed
-- call: the lock (the IMMUTABLE helpers fold to constants), then one index probe of
-- tenant_placement in a statement of its own, whose snapshot sees a move committed while the lock
-- was awaited. inbox.claim_and_apply_batch does the same for all its tenants in two statements.
CREATE FUNCTION inbox.tenant_partition(tenant text) RETURNS integer
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    hash integer := inbox.tenant_hash(tenant_partition.tenant);
    placed_partition integer;
    placed_moving boolean;
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(inbox._route_lock_space(), hash);
    SELECT p.partition, p.moving INTO placed_partition, placed_moving FROM inbox.tenant_placement p
     WHERE p.tenant OPERATOR(pg_catalog.=) coalesce(tenant_partition.tenant, '');
    IF NOT FOUND THEN
        RETURN hash;
    END IF;
    IF placed_moving THEN
        RAISE EXCEPTION 'tenant % is being moved between shards: retry later',
            pg_catalog.quote_literal(coalesce(tenant_partition.tenant, ''))
            USING ERRCODE = 'lock_not_available',
                  HINT = 'An operator called inbox.begin_tenant_move; inbox.place_tenant ends the move.';
    END IF;
    RETURN placed_partition;
END
$$;
COMMENT ON FUNCTION inbox.tenant_partition(text) IS
    'The partition a tenant is routed to: its tenant_placement, else tenant_hash (masked by PL/Proxy)';

CREATE FUNCTION inbox.shard_of(tenant text) RETURNS integer
    LANGUAGE sql STABLE
AS $$
    SELECT coalesce((SELECT p.partition FROM inbox.tenant_placement p
                      WHERE p.tenant OPERATOR(pg_catalog.=) coalesce(shard_of.tenant, '')),
                    inbox.tenant_hash(shard_of.tenant) OPERATOR(pg_catalog.&)
                        (inbox.partition_count() OPERATOR(pg_catalog.-) 1))
$$;
COMMENT ON FUNCTION inbox.shard_of(text) IS 'The partition number (p0 = 0, ...) a tenant is routed to';

CREATE FUNCTION inbox._check_dsn(fn text, ordinal integer, dsn text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF dsn IS NULL OR dsn OPERATOR(pg_catalog.!~) '\S' THEN
        RAISE EXCEPTION '%: shard % has no connection string', fn, ordinal USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF dsn OPERATOR(pg_catalog.~) '^\s*postgres(ql)?://' THEN
        RAISE EXCEPTION '%: shard %: give a keyword/value connection string (host=... port=... dbname=...), not a URI',
            fn, ordinal USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF dsn OPERATOR(pg_catalog.~*) '(^|\s)(user|password|passfile|service)\s*=' THEN
        RAISE EXCEPTION '%: shard %: the connection string must not name a user, password, passfile or service',
            fn, ordinal
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'The proxy connects to the shards as the caller''s own role (docs/scaling.md, "Who the shards see"); '
                         'give passwords through the proxy server''s ~/.pgpass or certificates.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_dsn(text, integer, text) IS 'internal: a shard connection string configure_shards accepts';

-- The shards, p0 .. pN-1 in order; N a power of two (1 .. 1024). The same string may appear more than
-- once: 8 partitions on 2 databases, spread later by repointing partitions. Returns N.
CREATE FUNCTION inbox.configure_shards(dsns text[]) RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n integer := coalesce(cardinality(dsns), 0);
    i integer;
    old_options text[];
    opts text := '';
    opt text;
BEGIN
    IF dsns IS NULL THEN
        RAISE EXCEPTION 'inbox.configure_shards: dsns must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF n < 1 OR n > 1024 OR (n & (n - 1)) <> 0 THEN
        RAISE EXCEPTION 'inbox.configure_shards: the number of partitions must be a power of two from 1 to 1024, got %', n
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Repeat a connection string to put several partitions on one database.';
    END IF;
    IF array_ndims(dsns) <> 1 THEN
        RAISE EXCEPTION 'inbox.configure_shards: dsns must be a one-dimensional array' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 1 .. n LOOP
        PERFORM inbox._check_dsn('inbox.configure_shards', i - 1, dsns[array_lower(dsns, 1) + i - 1]);
    END LOOP;
    IF EXISTS (SELECT 1 FROM inbox.tenant_placement p WHERE p.partition >= n) THEN
        RAISE EXCEPTION 'inbox.configure_shards: tenants are placed on partitions beyond %', n - 1
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Move them first (inbox.tenant_placement lists them).';
    END IF;

    SELECT s.srvoptions INTO old_options FROM pg_catalog.pg_foreign_server s WHERE s.srvname = 'inbox_shards';
    IF NOT FOUND THEN
        FOR i IN 1 .. n LOOP
            opts := opts || CASE WHEN i > 1 THEN ', ' ELSE '' END
                         || format('%I %L', 'p' || (i - 1), dsns[array_lower(dsns, 1) + i - 1]);
        END LOOP;
        EXECUTE format('CREATE SERVER inbox_shards FOREIGN DATA WRAPPER plproxy OPTIONS (%s)', opts);
        CREATE USER MAPPING FOR PUBLIC SERVER inbox_shards;
        GRANT USAGE ON FOREIGN SERVER inbox_shards TO inbox_consumer, inbox_operator, inbox_reader;
    ELSE
        FOREACH opt IN ARRAY coalesce(old_options, '{}') LOOP
            IF opt ~ '^p[0-9]+=' THEN
                opts := opts || CASE WHEN opts = '' THEN '' ELSE ', ' END
                             || format('DROP %I', split_part(opt, '=', 1));
            END IF;
        END LOOP;
        FOR i IN 1 .. n LOOP
            opts := opts || CASE WHEN opts = '' THEN '' ELSE ', ' END
                         || format('ADD %I %L', 'p' || (i - 1), dsns[array_lower(dsns, 1) + i - 1]);
        END LOOP;
        EXECUTE format('ALTER SERVER inbox_shards OPTIONS (%s)', opts);
    END IF;
    RETURN n;
END
$$;
COMMENT ON FUNCTION inbox.configure_shards(text[]) IS
    'Operator: the shards of cluster inbox_shards, p0 .. pN-1 (N a power of two; no user or password in them)';

-- Moving a tenant (docs/scaling.md): begin holds its calls (55P03, retryable) after waiting for
-- those in flight; place routes it to its new partition and lets its calls through again.
CREATE FUNCTION inbox.begin_tenant_move(tenant text, note text) RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    current_partition integer;
BEGIN
    IF tenant IS NULL THEN
        RAISE EXCEPTION 'inbox.begin_tenant_move: tenant must not be NULL (the default tenant is '''')'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF note IS NULL OR note !~ '\S' THEN
        RAISE EXCEPTION 'inbox.begin_tenant_move: a move needs a note saying why' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF inbox.partition_count() = 0 THEN
        RAISE EXCEPTION 'inbox.begin_tenant_move: no shards configured' USING ERRCODE = 'object_not_in_prerequisite_state',
              HINT = 'Call inbox.configure_shards(ARRAY[...]) first.';
    END IF;
    current_partition := inbox.shard_of(begin_tenant_move.tenant);
    INSERT INTO inbox.tenant_placement AS p (tenant, partition, moving, note)
    VALUES (begin_tenant_move.tenant, current_partition, true, begin_tenant_move.note)
    ON CONFLICT ON CONSTRAINT tenant_placement_pkey DO UPDATE SET moving = true, placed_at = now(), placed_by = session_user, note = EXCLUDED.note;
    -- Calls already routed hold the key shared until their transaction ends: wait for them. The
    -- placement commits with this transaction; calls after it are refused until place_tenant.
    PERFORM pg_advisory_xact_lock(inbox._route_lock_space(), inbox.tenant_hash(begin_tenant_move.tenant));
    RETURN current_partition;
END
$$;
COMMENT ON FUNCTION inbox.begin_tenant_move(text, text) IS
    'Operator: hold a tenant''s calls (retryable 55P03) while its rows move; returns the partition it is on';

CREATE FUNCTION inbox.place_tenant(tenant text, partition integer, note text) RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n integer := inbox.partition_count();
BEGIN
    IF tenant IS NULL OR partition IS NULL THEN
        RAISE EXCEPTION 'inbox.place_tenant: tenant and partition must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF partition < 0 OR partition >= n THEN
        RAISE EXCEPTION 'inbox.place_tenant: partition % does not exist (the cluster has % partitions)', partition, n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF note IS NULL OR note !~ '\S' THEN
        RAISE EXCEPTION 'inbox.place_tenant: a placement needs a note saying why' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO inbox.tenant_placement AS p (tenant, partition, moving, note)
    VALUES (place_tenant.tenant, place_tenant.partition, false, place_tenant.note)
    ON CONFLICT ON CONSTRAINT tenant_placement_pkey DO UPDATE SET partition = EXCLUDED.partition, moving = false, placed_at = now(),
                                       placed_by = session_user, note = EXCLUDED.note;
    RETURN partition;
END
$$;
COMMENT ON FUNCTION inbox.place_tenant(text, integer, text) IS
    'Operator: route a tenant to a partition (ends a move); its inbox rows must be there already';

REVOKE ALL ON FUNCTION inbox.tenant_hash(text), inbox._route_lock_space(), inbox.partition_count(),
    inbox.tenant_partition(text), inbox.shard_of(text), inbox._check_dsn(text, integer, text),
    inbox.configure_shards(text[]), inbox.begin_tenant_move(text, text), inbox.place_tenant(text, integer, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.tenant_hash(text), inbox._route_lock_space(), inbox.partition_count(),
    inbox.tenant_partition(text), inbox.shard_of(text)
    TO inbox_consumer, inbox_operator, inbox_reader;
GRANT EXECUTE ON FUNCTION inbox.configure_shards(text[]), inbox.begin_tenant_move(text, text),
    inbox.place_tenant(text, integer, text) TO inbox_operator;

COMMIT;
