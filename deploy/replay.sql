-- Deploy pginbox:replay: written from sql/085_replay.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: replay's functions (tables in 080_replay_tables.sql). A plan runs its handler only within
-- the rights of a role bound to the consumer (inbox._check_operator_run: SECURITY DEFINER, owned by
-- the consumer's role; the items' payloads match the hashes the consumer stored), and since 0.3.0
-- confined (inbox._run_for_operator): run_replay_plan is SECURITY DEFINER, and its halves are its
-- own. A plan approved for a Python handler (082_python_replay_tables.sql) runs in the consumer's own
-- login (122_python_replay.sql), never here. Reworked in 0.3.0 (docs/releasing.md).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;
-- DROP ... IF EXISTS below makes this script rerunnable (sqitch rework): no notices for it.
SET LOCAL client_min_messages = warning;

-- Progress per plan, and whether the pin still equals what is registered (a Python plan's handler,
-- module:function, is its own pin: 082_python_replay_tables.sql). No payloads.
CREATE OR REPLACE VIEW inbox.replay_status AS
SELECT p.plan_id, p.plan_name, p.consumer, p.message_type, coalesce(p.handler::text, p.python_handler) AS handler,
       p.handler_version, p.status,
       count(i.item_no) AS total,
       count(i.item_no) FILTER (WHERE i.status = 'pending') AS pending,
       count(i.item_no) FILTER (WHERE i.status = 'applied') AS applied,
       count(i.item_no) FILTER (WHERE i.status = 'failed') AS failed,
       count(i.item_no) FILTER (WHERE i.status = 'skipped') AS skipped,
       h.handler::text AS registered_handler, h.handler_version AS registered_version,
       p.python_handler IS NOT NULL
       OR coalesce(h.handler::oid = p.handler::oid AND h.handler_version = p.handler_version, false) AS pin_matches,
       p.created_at, p.created_by, p.stopped_at, p.finished_at
  FROM inbox.replay_plan p
  LEFT JOIN inbox.replay_item i ON i.plan_id = p.plan_id
  LEFT JOIN inbox.handler h ON h.consumer = p.consumer AND h.message_type = p.message_type
 GROUP BY p.plan_id, h.handler, h.handler_version;
COMMENT ON VIEW inbox.replay_status IS
    'Replay plans with item counts (pending, applied, failed, skipped) and the registered handler; no payloads';

GRANT SELECT ON inbox.replay_status TO inbox_reader, inbox_operator;

-- ------------------------------------------------------------------ identities

-- Versioned projection: '<base>@<version>'. base has no '@' (so the name splits back at the last
-- '@') and does not start with 'replay:' (reserved for replay plans); version is 1 to 32 letters,
-- digits, '.', '_' or '-', starting with a letter or digit; the result is at most 128 bytes.
CREATE OR REPLACE FUNCTION inbox.versioned_consumer(base text, version text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF base IS NULL OR version IS NULL THEN
        RAISE EXCEPTION 'inbox.versioned_consumer: % must not be NULL', CASE WHEN base IS NULL THEN 'base' ELSE 'version' END
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF base = '' OR pg_catalog.strpos(base, '@') > 0 OR pg_catalog.starts_with(base, 'replay:') THEN
        RAISE EXCEPTION 'inbox.versioned_consumer: base % must be a non-empty consumer name without ''@'', not starting with ''replay:''',
            pg_catalog.quote_literal(pg_catalog.left(base, 40))
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Name the projection, e.g. inbox.versioned_consumer(''orders-projection'', ''v2'') = ''orders-projection@v2''.';
    END IF;
    IF version !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,31}$' THEN
        RAISE EXCEPTION 'inbox.versioned_consumer: version % must be 1 to 32 letters, digits, ''.'', ''_'' or ''-'', starting with a letter or digit',
            pg_catalog.quote_literal(pg_catalog.left(version, 40))
            USING ERRCODE = 'invalid_parameter_value', HINT = 'For example ''v2'' or ''2026.12''.';
    END IF;
    IF pg_catalog.octet_length(base) + 1 + pg_catalog.octet_length(version) > 128 THEN
        RAISE EXCEPTION 'inbox.versioned_consumer: the consumer name would be % bytes long, the limit is 128',
            pg_catalog.octet_length(base) + 1 + pg_catalog.octet_length(version)
            USING ERRCODE = 'string_data_right_truncation', HINT = 'Use a shorter base name.';
    END IF;
    RETURN base OPERATOR(pg_catalog.||) '@' OPERATOR(pg_catalog.||) version;
END
$$;
COMMENT ON FUNCTION inbox.versioned_consumer(text, text) IS
    'Consumer identity of a versioned projection: base@version (validated; 22004, 22023, 22001)';

-- The operation id of one replay item: rp_ + 64 hex digits, derived from the plan and the original
-- identity (length-prefixed fields, so no two inputs collide by concatenation).
CREATE OR REPLACE FUNCTION inbox.replay_operation_id(plan_id bigint, consumer text, producer text, message_id text,
                                          tenant text DEFAULT '')
    RETURNS text
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF replay_operation_id.plan_id IS NULL OR replay_operation_id.consumer IS NULL OR replay_operation_id.producer IS NULL
       OR replay_operation_id.message_id IS NULL OR replay_operation_id.tenant IS NULL THEN
        RAISE EXCEPTION 'inbox.replay_operation_id: plan_id, consumer, producer, message_id and tenant must not be NULL'
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Use tenant '''' when message ids are global.';
    END IF;
    RETURN 'rp_' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.sha256(
        pg_catalog.convert_to('pginbox.replay_operation_id.v1', 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int8send(replay_operation_id.plan_id)
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(replay_operation_id.tenant))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(replay_operation_id.tenant, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(replay_operation_id.consumer))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(replay_operation_id.consumer, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(replay_operation_id.producer))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(replay_operation_id.producer, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(replay_operation_id.message_id))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(replay_operation_id.message_id, 'UTF8')), 'hex');
END
$$;
COMMENT ON FUNCTION inbox.replay_operation_id(bigint, text, text, text, text) IS
    'Stable operation id (rp_ + 64 hex digits) of a replay item, derived from the plan and the original identity';

-- ------------------------------------------------------------------ internal helpers

CREATE OR REPLACE FUNCTION inbox._check_replay_note(fn text, note text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF note IS NULL OR note !~ '\S' THEN
        RAISE EXCEPTION '%: a decision needs a note saying why', fn
            USING ERRCODE = CASE WHEN note IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'The note goes into the audit trail (inbox.replay_decision).';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_replay_note(text, text) IS 'internal: a replay decision needs a non-blank note (22004, 22023)';

-- Locks a plan for a decision or a run; rejects a NULL or unknown id.
CREATE OR REPLACE FUNCTION inbox._lock_replay_plan(fn text, plan_id bigint) RETURNS inbox.replay_plan
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    plan inbox.replay_plan;
BEGIN
    IF _lock_replay_plan.plan_id IS NULL THEN
        RAISE EXCEPTION '%: plan_id must not be NULL', fn USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT p.* INTO plan FROM inbox.replay_plan p WHERE p.plan_id = _lock_replay_plan.plan_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: no replay plan %', fn, _lock_replay_plan.plan_id
            USING ERRCODE = 'no_data_found', HINT = 'inbox.replay_status lists the plans.';
    END IF;
    RETURN plan;
END
$$;
COMMENT ON FUNCTION inbox._lock_replay_plan(text, bigint) IS 'internal: locks a replay plan (22004, P0002)';

-- A closed plan (completed, cancelled) takes no decision and no run.
CREATE OR REPLACE FUNCTION inbox._check_plan_active(fn text, plan inbox.replay_plan) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF plan.status IN ('completed', 'cancelled') THEN
        RAISE EXCEPTION '%: replay plan % (%) is already %', fn, plan.plan_id, pg_catalog.quote_literal(plan.plan_name),
            plan.status
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Its decisions are in inbox.replay_decision; create a new plan for more work.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_plan_active(text, inbox.replay_plan) IS 'internal: rejects a completed or cancelled plan (55000)';

-- A plan approved for a Python handler runs in the consumer's own login (122_python_replay.sql),
-- never here, and keeps the handler it was approved for.
CREATE OR REPLACE FUNCTION inbox._check_sql_plan(fn text, plan inbox.replay_plan) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF plan.python_handler IS NOT NULL THEN
        RAISE EXCEPTION '%: replay plan % (%) runs the Python handler %, with a login of consumer %', fn, plan.plan_id,
            pg_catalog.quote_literal(plan.plan_name), pg_catalog.quote_literal(plan.python_handler),
            pg_catalog.quote_literal(plan.consumer)
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = pg_catalog.format('The consumer''s own login runs it: pginbox replay run %s --python %s --dsn <the consumer''s DSN>. For another handler or version, cancel it and create a new plan.',
                                           plan.plan_id, plan.python_handler);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_sql_plan(text, inbox.replay_plan) IS
    'internal: rejects a plan approved for a Python handler where a SQL handler runs (55000)';

-- The handler registered for (consumer, message_type) must be exactly the pair the operator names.
CREATE OR REPLACE FUNCTION inbox._check_registered_pair(fn text, consumer text, message_type text, handler regprocedure,
                                             handler_version text)
    RETURNS inbox.handler
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    registered inbox.handler;
BEGIN
    SELECT h.* INTO registered FROM inbox.handler h
     WHERE h.consumer = _check_registered_pair.consumer AND h.message_type = _check_registered_pair.message_type;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: no handler registered for consumer % and message type %', fn,
            pg_catalog.quote_literal(_check_registered_pair.consumer),
            pg_catalog.quote_literal(_check_registered_pair.message_type)
            USING ERRCODE = 'undefined_object',
                  HINT = 'Register the handler the replay should run with inbox.register_handler first.';
    END IF;
    IF registered.handler::oid <> _check_registered_pair.handler::oid
       OR registered.handler_version <> _check_registered_pair.handler_version THEN
        RAISE EXCEPTION '%: consumer % and message type % have handler % version % registered, not % version %', fn,
            pg_catalog.quote_literal(_check_registered_pair.consumer),
            pg_catalog.quote_literal(_check_registered_pair.message_type),
            registered.handler, pg_catalog.quote_literal(registered.handler_version),
            _check_registered_pair.handler, pg_catalog.quote_literal(_check_registered_pair.handler_version)
            USING ERRCODE = 'IR002',
                  HINT = 'A plan pins exactly the registered handler and version: name them, or register yours first.';
    END IF;
    IF pg_catalog.pg_get_function_result(registered.handler) IS NULL THEN
        RAISE EXCEPTION '%: the registered handler function (OID %) no longer exists', fn, registered.handler::oid
            USING ERRCODE = 'undefined_function', HINT = 'Register the handler again with inbox.register_handler.';
    END IF;
    RETURN registered;
END
$$;
COMMENT ON FUNCTION inbox._check_registered_pair(text, text, text, regprocedure, text) IS
    'internal: the registered handler, when it equals the named (handler, version) pair (42704, IR002, 42883)';

-- ------------------------------------------------------------------ operator decisions

CREATE OR REPLACE FUNCTION inbox.create_replay_plan(plan_name text, consumer text, message_type text, handler regprocedure,
                                         handler_version text, note text)
    RETURNS inbox.replay_plan
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.create_replay_plan';
    registered inbox.handler;
    existing inbox.replay_plan;
    plan inbox.replay_plan;
BEGIN
    PERFORM inbox._check_text(fn, 'plan_name', create_replay_plan.plan_name, 128);
    PERFORM inbox._check_identity(fn, create_replay_plan.consumer, '-', '-', '');
    IF pg_catalog.starts_with(create_replay_plan.consumer, 'replay:') THEN
        RAISE EXCEPTION '%: consumer names starting with ''replay:'' belong to replay plans themselves', fn
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Name the consumer whose messages are replayed.';
    END IF;
    PERFORM inbox._check_message_type(fn, create_replay_plan.message_type);
    IF create_replay_plan.handler IS NULL THEN
        RAISE EXCEPTION '%: handler must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Pass it as ''schema.function(jsonb)''::regprocedure.';
    END IF;
    PERFORM inbox._check_delivery(fn, 0, 1, create_replay_plan.handler_version);
    PERFORM inbox._check_replay_note(fn, create_replay_plan.note);
    SELECT p.* INTO existing FROM inbox.replay_plan p WHERE p.plan_name = create_replay_plan.plan_name;
    IF FOUND THEN
        RAISE EXCEPTION '%: a replay plan named % already exists (plan %, %)', fn,
            pg_catalog.quote_literal(create_replay_plan.plan_name), existing.plan_id, existing.status
            USING ERRCODE = 'duplicate_object', HINT = 'Plan names are never reused: choose another name.';
    END IF;
    registered := inbox._check_registered_pair(fn, create_replay_plan.consumer, create_replay_plan.message_type,
                                               create_replay_plan.handler, create_replay_plan.handler_version);

    INSERT INTO inbox.replay_plan AS p (plan_name, consumer, message_type, handler, handler_version, takes_context, note)
    VALUES (create_replay_plan.plan_name, create_replay_plan.consumer, create_replay_plan.message_type,
            registered.handler, registered.handler_version, registered.takes_context, create_replay_plan.note)
    RETURNING p.* INTO plan;
    INSERT INTO inbox.replay_decision (plan_id, decision, note, handler, handler_version)
    VALUES (plan.plan_id, 'create', create_replay_plan.note, plan.handler::text, plan.handler_version);
    RETURN plan;
END
$$;
COMMENT ON FUNCTION inbox.create_replay_plan(text, text, text, regprocedure, text, text) IS
    'Create a replay plan pinned to the handler and version registered for (consumer, message_type) (audited)';

-- Adds messages the consumer processed: a JSON array of {producer, message_id, tenant?, payload}.
-- Every element is checked before anything is written: its identity must be processed by the
-- consumer and its payload must hash (with the consumer's hash_exclude_keys) to the stored hash.
-- Items already in the plan are ignored. Returns how many were added.
CREATE OR REPLACE FUNCTION inbox.add_replay_items(plan_id bigint, items jsonb) RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.add_replay_items';
    plan inbox.replay_plan;
    settings inbox.consumer_config;
    n integer;
    item jsonb;
    what text;
    item_tenant text;
    hash bytea;
    stored inbox.message;
    added integer := 0;
BEGIN
    plan := inbox._lock_replay_plan(fn, add_replay_items.plan_id);
    PERFORM inbox._check_plan_active(fn, plan);
    IF add_replay_items.items IS NULL THEN
        RAISE EXCEPTION '%: items must not be NULL', fn USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.jsonb_typeof(add_replay_items.items) <> 'array' THEN
        RAISE EXCEPTION '%: items must be a JSON array of objects', fn
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each element: {"producer": ..., "message_id": ..., "tenant"?: ..., "payload": ...}';
    END IF;
    n := pg_catalog.jsonb_array_length(add_replay_items.items);
    IF n > 10000 THEN
        RAISE EXCEPTION '%: % items in one call, the limit is 10000', fn, n
            USING ERRCODE = 'program_limit_exceeded', HINT = 'Add them in several calls.';
    END IF;
    settings := inbox._settings(plan.consumer);

    FOR i IN 0 .. n - 1 LOOP
        item := add_replay_items.items -> i;
        what := pg_catalog.format('%s: item %s', fn, i + 1);
        IF pg_catalog.jsonb_typeof(item) <> 'object' THEN
            RAISE EXCEPTION '%: must be a JSON object', what USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF pg_catalog.jsonb_typeof(item -> 'producer') IS DISTINCT FROM 'string'
           OR pg_catalog.jsonb_typeof(item -> 'message_id') IS DISTINCT FROM 'string' THEN
            RAISE EXCEPTION '%: producer and message_id must be JSON strings', what USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF coalesce(pg_catalog.jsonb_typeof(item -> 'tenant'), 'null') NOT IN ('string', 'null') THEN
            RAISE EXCEPTION '%: tenant must be a JSON string (or absent for tenant '''')', what
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF NOT item ? 'payload' THEN
            RAISE EXCEPTION '%: payload is missing', what
                USING ERRCODE = 'null_value_not_allowed',
                      HINT = 'Pass the payload the consumer processed: it is checked against the stored hash.';
        END IF;
        item_tenant := coalesce(item ->> 'tenant', '');
        PERFORM inbox._check_identity(what, plan.consumer, item ->> 'producer', item ->> 'message_id', item_tenant);
        -- FOR KEY SHARE: a purge cannot delete the row until this call commits its hold.
        SELECT m.* INTO stored FROM inbox.message m
         WHERE m.consumer = plan.consumer AND m.tenant = item_tenant AND m.producer = item ->> 'producer'
           AND m.message_id = item ->> 'message_id'
           FOR KEY SHARE;
        IF NOT FOUND THEN
            RAISE EXCEPTION '%: consumer % has not processed message % of producer % (tenant %)', what,
                pg_catalog.quote_literal(plan.consumer), pg_catalog.quote_literal(item ->> 'message_id'),
                pg_catalog.quote_literal(item ->> 'producer'), pg_catalog.quote_literal(item_tenant)
                USING ERRCODE = 'no_data_found',
                      HINT = 'A replay plan replays messages its consumer processed; deliver new messages normally.';
        END IF;
        IF stored.status <> 'processed' THEN
            RAISE EXCEPTION '%: message % of producer % is %, not processed', what,
                pg_catalog.quote_literal(item ->> 'message_id'), pg_catalog.quote_literal(item ->> 'producer'), stored.status
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'Quarantined messages are repaired, discarded or released (inbox.repair), not replayed.';
        END IF;
        hash := inbox.payload_hash(item -> 'payload', settings.hash_exclude_keys);
        IF hash <> stored.payload_sha256 THEN
            RAISE EXCEPTION '%: the payload of message % of producer % is not the payload consumer % processed', what,
                pg_catalog.quote_literal(item ->> 'message_id'), pg_catalog.quote_literal(item ->> 'producer'),
                pg_catalog.quote_literal(plan.consumer)
                USING ERRCODE = 'IR003',
                      DETAIL = pg_catalog.format('payload hash %s, stored hash %s', pg_catalog.encode(hash, 'hex'),
                                                 pg_catalog.encode(stored.payload_sha256, 'hex')),
                      HINT = 'A replay replays the message that was processed: take the payload from the same source (event store, broker archive).';
        END IF;
    END LOOP;

    FOR i IN 0 .. n - 1 LOOP
        item := add_replay_items.items -> i;
        item_tenant := coalesce(item ->> 'tenant', '');
        INSERT INTO inbox.replay_item (plan_id, tenant, producer, message_id, operation_id, payload, payload_sha256)
        VALUES (plan.plan_id, item_tenant, item ->> 'producer', item ->> 'message_id',
                inbox.replay_operation_id(plan.plan_id, plan.consumer, item ->> 'producer', item ->> 'message_id',
                                          item_tenant),
                item -> 'payload', inbox.payload_hash(item -> 'payload', settings.hash_exclude_keys))
        ON CONFLICT ON CONSTRAINT replay_item_pkey DO NOTHING;
        IF FOUND THEN
            added := added + 1;
            INSERT INTO inbox.retention_hold (consumer, tenant, producer, message_id, holder)
            VALUES (plan.consumer, item_tenant, item ->> 'producer', item ->> 'message_id',
                    'replay:' OPERATOR(pg_catalog.||) plan.plan_id)
            ON CONFLICT ON CONSTRAINT retention_hold_pkey DO NOTHING;
        END IF;
    END LOOP;
    IF added > 0 THEN
        INSERT INTO inbox.replay_decision (plan_id, decision, handler, handler_version, items)
        VALUES (plan.plan_id, 'add_items', coalesce(plan.handler::text, plan.python_handler), plan.handler_version, added);
    END IF;
    RETURN added;
END
$$;
COMMENT ON FUNCTION inbox.add_replay_items(bigint, jsonb) IS
    'Add processed messages to a replay plan (payload checked against the stored hash; holds against the purge)';

CREATE OR REPLACE FUNCTION inbox.accept_replay_version(plan_id bigint, handler regprocedure, handler_version text, note text)
    RETURNS inbox.replay_plan
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.accept_replay_version';
    plan inbox.replay_plan;
    registered inbox.handler;
BEGIN
    plan := inbox._lock_replay_plan(fn, accept_replay_version.plan_id);
    PERFORM inbox._check_plan_active(fn, plan);
    PERFORM inbox._check_sql_plan(fn, plan);
    IF accept_replay_version.handler IS NULL THEN
        RAISE EXCEPTION '%: handler must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Pass it as ''schema.function(jsonb)''::regprocedure.';
    END IF;
    PERFORM inbox._check_delivery(fn, 0, 1, accept_replay_version.handler_version);
    PERFORM inbox._check_replay_note(fn, accept_replay_version.note);
    registered := inbox._check_registered_pair(fn, plan.consumer, plan.message_type, accept_replay_version.handler,
                                               accept_replay_version.handler_version);
    UPDATE inbox.replay_plan p
       SET handler = registered.handler, handler_version = registered.handler_version,
           takes_context = registered.takes_context, status = 'open', stopped_at = NULL
     WHERE p.plan_id = plan.plan_id;
    INSERT INTO inbox.replay_decision (plan_id, decision, note, handler, handler_version, previous_handler, previous_version)
    VALUES (plan.plan_id, 'accept_version', accept_replay_version.note, registered.handler::text,
            registered.handler_version, plan.handler::text, plan.handler_version);
    SELECT p.* INTO plan FROM inbox.replay_plan p WHERE p.plan_id = accept_replay_version.plan_id;
    RETURN plan;
END
$$;
COMMENT ON FUNCTION inbox.accept_replay_version(bigint, regprocedure, text, text) IS
    'Re-pin a replay plan to the handler and version now registered, and let it run again (audited)';

CREATE OR REPLACE FUNCTION inbox.cancel_replay_plan(plan_id bigint, note text) RETURNS inbox.replay_plan
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.cancel_replay_plan';
    plan inbox.replay_plan;
    skipped integer;
BEGIN
    plan := inbox._lock_replay_plan(fn, cancel_replay_plan.plan_id);
    PERFORM inbox._check_replay_note(fn, cancel_replay_plan.note);
    PERFORM inbox._check_plan_active(fn, plan);
    UPDATE inbox.replay_item i
       SET status = 'skipped', reason_code = 'cancelled', finished_at = now(), finished_by = session_user
     WHERE i.plan_id = plan.plan_id AND i.status = 'pending';
    GET DIAGNOSTICS skipped = ROW_COUNT;
    DELETE FROM inbox.retention_hold r WHERE r.holder = 'replay:' OPERATOR(pg_catalog.||) plan.plan_id;
    UPDATE inbox.replay_plan p SET status = 'cancelled', finished_at = now() WHERE p.plan_id = plan.plan_id;
    INSERT INTO inbox.replay_decision (plan_id, decision, note, handler, handler_version, items)
    VALUES (plan.plan_id, 'cancel', cancel_replay_plan.note, coalesce(plan.handler::text, plan.python_handler),
            plan.handler_version, skipped);
    SELECT p.* INTO plan FROM inbox.replay_plan p WHERE p.plan_id = cancel_replay_plan.plan_id;
    RETURN plan;
END
$$;
COMMENT ON FUNCTION inbox.cancel_replay_plan(bigint, text) IS
    'Cancel a replay plan: pending items become skipped, holds are removed; applied items stay applied (audited)';

-- ------------------------------------------------------------------ the runner

-- The halves of run_replay_plan (called by it alone since 0.3.0).

-- Locks the plan for this run (a second runner of the same plan waits), checks it may run, and
-- returns it with the rights its handler runs with (its owner's).
DROP FUNCTION IF EXISTS inbox._replay_run_start(bigint, integer);
DROP TYPE IF EXISTS inbox._replay_start;
CREATE TYPE inbox._replay_start AS (
    plan inbox.replay_plan,
    handler_owner oid
);
COMMENT ON TYPE inbox._replay_start IS 'internal: a replay plan locked for a run and the role whose rights its handler runs with';
CREATE OR REPLACE FUNCTION inbox._replay_run_start(plan_id bigint, max_items integer) RETURNS inbox._replay_start
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.run_replay_plan';
    plan inbox.replay_plan;
    handler_owner oid;
    registered inbox.handler;
BEGIN
    IF _replay_run_start.max_items IS NULL OR _replay_run_start.max_items NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION '%: max_items must be 1 to 10000, got %', fn, coalesce(_replay_run_start.max_items::text, 'NULL')
            USING ERRCODE = CASE WHEN _replay_run_start.max_items IS NULL THEN 'null_value_not_allowed'
                                 ELSE 'invalid_parameter_value' END,
                  HINT = 'Each call runs up to max_items items in the caller''s transaction; call again for more.';
    END IF;
    plan := inbox._lock_replay_plan(fn, _replay_run_start.plan_id);
    PERFORM inbox._check_plan_active(fn, plan);
    PERFORM inbox._check_sql_plan(fn, plan);
    -- The pinned handler is checked again at every run, as claim_and_apply and repair do: it may have
    -- been dropped, or altered into a privileged SECURITY DEFINER function, since the plan was made.
    PERFORM inbox._check_handler(fn, plan.handler, plan.consumer, plan.message_type);
    -- The payloads are the consumer's own (add_replay_items checked them against the stored hashes).
    handler_owner := inbox._check_operator_run(fn, plan.consumer, NULL, plan.handler, NULL, true);
    IF plan.status = 'stopped_version_changed' THEN
        SELECT h.* INTO registered FROM inbox.handler h
         WHERE h.consumer = plan.consumer AND h.message_type = plan.message_type;
        RAISE EXCEPTION '%: replay plan % (%) is stopped: the handler registered for consumer % and message type % changed', fn,
            plan.plan_id, pg_catalog.quote_literal(plan.plan_name), pg_catalog.quote_literal(plan.consumer),
            pg_catalog.quote_literal(plan.message_type)
            USING ERRCODE = 'IR001',
                  DETAIL = pg_catalog.format('pinned: %s version %s; registered: %s version %s', plan.handler,
                                             pg_catalog.quote_literal(plan.handler_version),
                                             coalesce(registered.handler::text, 'none'),
                                             coalesce(pg_catalog.quote_literal(registered.handler_version), 'none')),
                  HINT = 'Review the new handler, then inbox.accept_replay_version(plan_id, handler, version, note) resumes the plan with it; or inbox.cancel_replay_plan.';
    END IF;
    RETURN ROW(plan, handler_owner)::inbox._replay_start;
END
$$;
COMMENT ON FUNCTION inbox._replay_run_start(bigint, integer) IS
    'internal: locks a replay plan for a run and returns the rights its handler runs with; IR001 when it is stopped';

-- The next step: checks the pin against the registration (a change stops the plan, committed with
-- the caller), then takes the next pending item. An item whose message was processed with the
-- pinned version already has that version's effect: it is skipped (same_version).
CREATE OR REPLACE FUNCTION inbox._replay_next(plan_id bigint) RETURNS inbox._replay_step
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    plan inbox.replay_plan;
    registered inbox.handler;
    item inbox.replay_item;
    original inbox.message;
    step inbox._replay_step;
BEGIN
    SELECT p.* INTO STRICT plan FROM inbox.replay_plan p WHERE p.plan_id = _replay_next.plan_id;
    IF plan.status <> 'open' THEN
        step.action := 'stop';
        RETURN step;
    END IF;
    SELECT h.* INTO registered FROM inbox.handler h
     WHERE h.consumer = plan.consumer AND h.message_type = plan.message_type;
    IF plan.handler IS NOT NULL AND (registered.handler IS NULL OR registered.handler::oid <> plan.handler::oid
                                     OR registered.handler_version <> plan.handler_version) THEN
        UPDATE inbox.replay_plan p SET status = 'stopped_version_changed', stopped_at = now()
         WHERE p.plan_id = plan.plan_id;
        INSERT INTO inbox.replay_decision (plan_id, decision, note, handler, handler_version, previous_handler,
                                           previous_version)
        VALUES (plan.plan_id, 'stopped_version_changed', 'the registered handler changed during the plan',
                registered.handler::text, registered.handler_version, plan.handler::text, plan.handler_version);
        step.action := 'stop';
        RETURN step;
    END IF;

    SELECT i.* INTO item FROM inbox.replay_item i
     WHERE i.plan_id = plan.plan_id AND i.status = 'pending'
     ORDER BY i.item_no
     LIMIT 1
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        step.action := 'done';
        RETURN step;
    END IF;
    step.item_no := item.item_no;
    SELECT m.* INTO original FROM inbox.message m
     WHERE m.consumer = plan.consumer AND m.tenant = item.tenant AND m.producer = item.producer
       AND m.message_id = item.message_id;
    IF NOT FOUND OR original.status <> 'processed' OR original.handler_version = plan.handler_version THEN
        UPDATE inbox.replay_item i
           SET status = 'skipped', finished_at = now(), finished_by = session_user,
               reason_code = CASE WHEN original.status IS NULL THEN 'message_missing'
                                  WHEN original.status <> 'processed' THEN 'not_processed'
                                  ELSE 'same_version' END
         WHERE i.plan_id = item.plan_id AND i.item_no = item.item_no;
        step.action := 'skipped';
        RETURN step;
    END IF;
    step.action := 'run';
    step.handler := plan.handler;
    step.takes_context := plan.takes_context;
    step.payload := item.payload;
    step.context := ROW(item.tenant, plan.consumer, item.producer, item.message_id, plan.message_type,
                        original.produced_at, plan.handler_version)::inbox.message_context;
    RETURN step;
END
$$;
COMMENT ON FUNCTION inbox._replay_next(bigint) IS
    'internal: checks the pinned handler version and takes the next pending replay item';

-- Claims the item's operation id in inbox.message (consumer 'replay:<plan_id>') and marks the item
-- applied; runs inside the runner's subtransaction, so a handler error rolls both back. Returns
-- false when the operation id was already claimed (the item is then skipped, nothing runs).
CREATE OR REPLACE FUNCTION inbox._begin_replay_item(plan_id bigint, item_no bigint) RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    plan inbox.replay_plan;
    item inbox.replay_item;
BEGIN
    SELECT p.* INTO STRICT plan FROM inbox.replay_plan p WHERE p.plan_id = _begin_replay_item.plan_id;
    SELECT i.* INTO STRICT item FROM inbox.replay_item i
     WHERE i.plan_id = _begin_replay_item.plan_id AND i.item_no = _begin_replay_item.item_no AND i.status = 'pending'
       FOR UPDATE;
    INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, processed_at)
    VALUES ('replay:' OPERATOR(pg_catalog.||) plan.plan_id, item.tenant, item.producer, item.operation_id,
            item.payload_sha256, plan.handler_version, now())
    ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;
    IF NOT FOUND THEN
        UPDATE inbox.replay_item i
           SET status = 'skipped', reason_code = 'duplicate', finished_at = now(), finished_by = session_user
         WHERE i.plan_id = item.plan_id AND i.item_no = item.item_no;
        RETURN false;
    END IF;
    UPDATE inbox.replay_item i
       SET status = 'applied', handler_version = plan.handler_version, reason_code = NULL, error_message = NULL,
           finished_at = now(), finished_by = session_user
     WHERE i.plan_id = item.plan_id AND i.item_no = item.item_no;
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox._begin_replay_item(bigint, bigint) IS
    'internal: claims a replay item''s operation id and marks it applied';

CREATE OR REPLACE FUNCTION inbox._replay_item_failed(plan_id bigint, item_no bigint, reason_code text, error_message text)
    RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    version text;
BEGIN
    SELECT p.handler_version INTO STRICT version FROM inbox.replay_plan p WHERE p.plan_id = _replay_item_failed.plan_id;
    UPDATE inbox.replay_item i
       SET status = 'failed', handler_version = version, reason_code = _replay_item_failed.reason_code,
           error_message = pg_catalog.left(_replay_item_failed.error_message, 2000),
           finished_at = now(), finished_by = session_user
     WHERE i.plan_id = _replay_item_failed.plan_id AND i.item_no = _replay_item_failed.item_no AND i.status = 'pending';
END
$$;
COMMENT ON FUNCTION inbox._replay_item_failed(bigint, bigint, text, text) IS
    'internal: records a replay item whose handler raised';

-- Ends a run: an open plan without pending items (and with at least one item) completes, and
-- its retention holds go. Returns the plan's totals.
CREATE OR REPLACE FUNCTION inbox._replay_run_finish(plan_id bigint) RETURNS inbox.replay_run
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    plan inbox.replay_plan;
    result inbox.replay_run;
BEGIN
    SELECT p.* INTO STRICT plan FROM inbox.replay_plan p WHERE p.plan_id = _replay_run_finish.plan_id;
    SELECT count(*) FILTER (WHERE i.status = 'pending'), count(*) FILTER (WHERE i.status = 'applied'),
           count(*) FILTER (WHERE i.status = 'failed'), count(*) FILTER (WHERE i.status = 'skipped')
      INTO result.pending, result.applied, result.failed, result.skipped
      FROM inbox.replay_item i WHERE i.plan_id = plan.plan_id;
    IF plan.status = 'open' AND result.pending = 0 AND result.applied + result.failed + result.skipped > 0 THEN
        UPDATE inbox.replay_plan p SET status = 'completed', finished_at = now() WHERE p.plan_id = plan.plan_id;
        DELETE FROM inbox.retention_hold r WHERE r.holder = 'replay:' OPERATOR(pg_catalog.||) plan.plan_id;
        INSERT INTO inbox.replay_decision (plan_id, decision, handler, handler_version, items)
        VALUES (plan.plan_id, 'completed', coalesce(plan.handler::text, plan.python_handler), plan.handler_version,
                (result.applied + result.failed + result.skipped)::integer);
        plan.status := 'completed';
    END IF;
    result.plan_id := plan.plan_id;
    result.status := plan.status;
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox._replay_run_finish(bigint) IS
    'internal: completes a replay plan without pending items and returns its totals';

-- Runs up to max_items pending items of a plan, each in a subtransaction. The handler runs through
-- inbox._run_for_operator: confined, with its owner's rights (a role bound to the consumer), its
-- code acting as that role for the call; an item of a tenant that role is not bound for fails
-- (42501) without running. The rule on handler errors: the item's writes and its operation id roll
-- back, the item is recorded failed with its reason code, and the plan goes on with the next item
-- (a failed item is not retried by this plan; put it in a new plan once the cause is fixed).
-- Transient errors (classes 40, 08, 53, 57, and 55P03) are re-raised: retry the call. When the
-- registered handler changed, the plan stops: this call returns status stopped_version_changed
-- (with a WARNING, SQLSTATE IR001) and later calls raise IR001 until inbox.accept_replay_version.
CREATE OR REPLACE FUNCTION inbox.run_replay_plan(plan_id bigint, max_items integer DEFAULT 100) RETURNS inbox.replay_run
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    started inbox._replay_start;
    plan inbox.replay_plan;
    step inbox._replay_step;
    result inbox.replay_run;
    applied_now integer := 0;
    failed_now integer := 0;
    skipped_now integer := 0;
    handler_running boolean;
    err_state text;
    err_message text;
    err_constraint text;
BEGIN
    started := inbox._replay_run_start(run_replay_plan.plan_id, run_replay_plan.max_items);
    plan := started.plan;
    FOR i IN 1 .. run_replay_plan.max_items LOOP
        step := inbox._replay_next(plan.plan_id);
        EXIT WHEN step.action = ANY (ARRAY['stop', 'done']);
        IF step.action = 'skipped' THEN
            skipped_now := skipped_now + 1;
            CONTINUE;
        END IF;
        IF NOT inbox._role_may_act_as(started.handler_owner, plan.consumer, (step.context).tenant) THEN
            PERFORM inbox._replay_item_failed(plan.plan_id, step.item_no, '42501',
                format('the handler''s owner %s is not bound to consumer %s for tenant %s',
                       quote_ident(pg_get_userbyid(started.handler_owner)), quote_literal(plan.consumer),
                       quote_literal((step.context).tenant)));
            failed_now := failed_now + 1;
            CONTINUE;
        END IF;
        handler_running := false;
        BEGIN
            IF inbox._begin_replay_item(plan.plan_id, step.item_no) THEN
                handler_running := true;
                PERFORM inbox._run_for_operator('replay', plan.consumer, (step.context).tenant, started.handler_owner,
                                                step.handler, step.takes_context, step.payload, step.context);
                applied_now := applied_now + 1;
            ELSE
                skipped_now := skipped_now + 1;
            END IF;
        EXCEPTION WHEN OTHERS OR assert_failure THEN
            GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                                    err_constraint = CONSTRAINT_NAME;
            IF NOT handler_running OR inbox._is_transient(err_state) THEN
                RAISE;
            END IF;
            PERFORM inbox._replay_item_failed(plan.plan_id, step.item_no, inbox._reason_code(err_state, err_constraint),
                                              err_message);
            failed_now := failed_now + 1;
        END;
    END LOOP;
    result := inbox._replay_run_finish(plan.plan_id);
    result.applied_now := applied_now;
    result.failed_now := failed_now;
    result.skipped_now := skipped_now;
    IF result.status = 'stopped_version_changed' THEN
        RAISE WARNING 'inbox.run_replay_plan: replay plan % stopped: the handler registered for consumer % and message type % is no longer the pinned % version %',
            plan.plan_id, quote_literal(plan.consumer), quote_literal(plan.message_type),
            plan.handler, quote_literal(plan.handler_version)
            USING ERRCODE = 'IR001',
                  HINT = 'Nothing more is applied until an operator calls inbox.accept_replay_version (or cancels the plan).';
    END IF;
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox.run_replay_plan(bigint, integer) IS
    'Run up to max_items pending items of a replay plan, each exactly once, confined to the rights of a role bound to the consumer';

REVOKE ALL ON FUNCTION inbox.versioned_consumer(text, text),
    inbox.replay_operation_id(bigint, text, text, text, text),
    inbox._check_replay_note(text, text),
    inbox._lock_replay_plan(text, bigint),
    inbox._check_plan_active(text, inbox.replay_plan),
    inbox._check_sql_plan(text, inbox.replay_plan),
    inbox._check_registered_pair(text, text, text, regprocedure, text),
    inbox.create_replay_plan(text, text, text, regprocedure, text, text),
    inbox.add_replay_items(bigint, jsonb),
    inbox.accept_replay_version(bigint, regprocedure, text, text),
    inbox.cancel_replay_plan(bigint, text),
    inbox._replay_run_start(bigint, integer),
    inbox._replay_next(bigint),
    inbox._begin_replay_item(bigint, bigint),
    inbox._replay_item_failed(bigint, bigint, text, text),
    inbox._replay_run_finish(bigint),
    inbox.run_replay_plan(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.versioned_consumer(text, text) TO inbox_consumer, inbox_operator, inbox_reader;
GRANT EXECUTE ON FUNCTION inbox.replay_operation_id(bigint, text, text, text, text) TO inbox_operator, inbox_reader;
GRANT EXECUTE ON FUNCTION inbox.create_replay_plan(text, text, text, regprocedure, text, text),
    inbox.add_replay_items(bigint, jsonb),
    inbox.accept_replay_version(bigint, regprocedure, text, text),
    inbox.cancel_replay_plan(bigint, text),
    inbox.run_replay_plan(bigint, integer) TO inbox_operator;
-- 0.2.0 granted run_replay_plan's halves to operators: they are its own now.
REVOKE ALL ON FUNCTION inbox._replay_next(bigint), inbox._begin_replay_item(bigint, bigint),
    inbox._replay_item_failed(bigint, bigint, text, text), inbox._replay_run_finish(bigint) FROM inbox_operator;

COMMIT;
