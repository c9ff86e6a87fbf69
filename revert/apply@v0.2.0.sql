-- Revert pginbox:apply to @v0.1.0: the released functions again (deploy/apply@v0.1.0.sql),
-- then the functions this version added.
-- Deploy pginbox:apply. Generated from sql/040_apply.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: claim_and_apply. One round trip per message: claim the identity, run the registered SQL
-- handler with the caller's rights, and let both commit with the caller's transaction. A handler's
-- permanent error rolls back its writes and the claim (a subtransaction) and is recorded; a
-- transient error is re-raised so that the caller retries the whole transaction.
BEGIN;

SET LOCAL ROLE inbox_owner;

CREATE OR REPLACE FUNCTION inbox._check_message_type(fn text, message_type text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF message_type IS NULL OR message_type = '' OR pg_catalog.octet_length(message_type) > 128 THEN
        RAISE EXCEPTION '%: message_type must be a name of 1 to 128 bytes, got %', fn,
            coalesce(pg_catalog.quote_literal(pg_catalog.left(message_type, 40)), 'NULL')
            USING ERRCODE = CASE WHEN message_type IS NULL THEN 'null_value_not_allowed'
                                 WHEN message_type = '' THEN 'invalid_parameter_value'
                                 ELSE 'string_data_right_truncation' END,
                  HINT = 'message_type selects the handler registered with inbox.register_handler.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_message_type(text, text) IS 'internal: validates a message type name';

-- Binds a SQL function to (consumer, message_type). The function takes (payload jsonb) or
-- (payload jsonb, ctx inbox.message_context); its result is ignored. It runs with the rights of
-- whoever calls inbox.claim_and_apply, so a SECURITY DEFINER function owned by a role with the
-- inbox owner's rights (inbox_owner, its members, superusers) is refused: it would run with rights
-- no consumer has.
CREATE OR REPLACE FUNCTION inbox.register_handler(consumer text, message_type text, handler regprocedure, handler_version text)
    RETURNS inbox.handler
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn record;
    with_context boolean;
    saved inbox.handler;
BEGIN
    PERFORM inbox._check_identity('inbox.register_handler', register_handler.consumer, '-', '-', '');
    PERFORM inbox._check_message_type('inbox.register_handler', register_handler.message_type);
    PERFORM inbox._check_delivery('inbox.register_handler', 0, 1, register_handler.handler_version);
    IF register_handler.handler IS NULL THEN
        RAISE EXCEPTION 'inbox.register_handler: handler must not be NULL'
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Pass it as ''schema.function(jsonb)''::regprocedure.';
    END IF;

    SELECT p.oid, p.proname, n.nspname, p.prokind, p.proretset, p.pronargs, p.proargtypes, p.prosecdef,
           r.rolname AS owner_name,
           pg_catalog.pg_has_role(p.proowner, 'inbox_owner', 'MEMBER') AS owner_has_inbox_rights
      INTO fn
      FROM pg_catalog.pg_proc p
      JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
      JOIN pg_catalog.pg_roles r ON r.oid = p.proowner
     WHERE p.oid = register_handler.handler;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox.register_handler: no function has OID %', register_handler.handler::oid
            USING ERRCODE = 'undefined_function';
    END IF;
    IF fn.prokind <> 'f' THEN
        RAISE EXCEPTION 'inbox.register_handler: % is %, a handler must be a plain function', register_handler.handler,
            CASE fn.prokind WHEN 'p' THEN 'a procedure' WHEN 'a' THEN 'an aggregate' ELSE 'a window function' END
            USING ERRCODE = 'wrong_object_type';
    END IF;
    IF fn.proretset THEN
        RAISE EXCEPTION 'inbox.register_handler: % returns a set, a handler returns one value (or void)',
            register_handler.handler USING ERRCODE = 'wrong_object_type';
    END IF;
    IF fn.nspname IN ('inbox', 'pg_catalog', 'information_schema') THEN
        RAISE EXCEPTION 'inbox.register_handler: % lives in schema %, handlers must be your own functions',
            register_handler.handler, fn.nspname USING ERRCODE = 'insufficient_privilege';
    END IF;
    with_context := CASE
        WHEN fn.pronargs = 1 AND fn.proargtypes[0] = 'jsonb'::regtype::oid THEN false
        WHEN fn.pronargs = 2 AND fn.proargtypes[0] = 'jsonb'::regtype::oid
             AND fn.proargtypes[1] = 'inbox.message_context'::regtype::oid THEN true
    END;
    IF with_context IS NULL THEN
        RAISE EXCEPTION 'inbox.register_handler: % has the wrong arguments', register_handler.handler
            USING ERRCODE = 'datatype_mismatch',
                  HINT = 'A handler takes (payload jsonb) or (payload jsonb, ctx inbox.message_context).';
    END IF;
    IF fn.prosecdef AND fn.owner_has_inbox_rights THEN
        RAISE EXCEPTION 'inbox.register_handler: % is SECURITY DEFINER owned by %', register_handler.handler, fn.owner_name
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'It would run with its owner''s rights instead of the consumer''s.',
                  HINT = 'Make it SECURITY INVOKER, or have an unprivileged role own it.';
    END IF;

    INSERT INTO inbox.handler AS h (consumer, message_type, handler, handler_version, takes_context)
    VALUES (register_handler.consumer, register_handler.message_type, register_handler.handler,
            register_handler.handler_version, with_context)
    ON CONFLICT ON CONSTRAINT handler_pkey DO UPDATE
       SET handler = EXCLUDED.handler, handler_version = EXCLUDED.handler_version,
           takes_context = EXCLUDED.takes_context, registered_at = now(), registered_by = session_user
    RETURNING h.* INTO saved;
    INSERT INTO inbox.handler_registration (consumer, message_type, handler, handler_version)
    VALUES (register_handler.consumer, register_handler.message_type, register_handler.handler::text,
            register_handler.handler_version);
    RETURN saved;
END
$$;
COMMENT ON FUNCTION inbox.register_handler(text, text, regprocedure, text) IS
    'Bind a SQL handler function (payload jsonb[, ctx inbox.message_context]) to a consumer and message type';

-- The definer half of claim_and_apply: validate, find the handler, hash, claim. Returns the handler
-- to call; the caller's (invoker) half calls it, so the handler never runs with the owner's rights.
CREATE OR REPLACE FUNCTION inbox._begin_apply(
    consumer text, producer text, message_id text, message_type text, payload jsonb, tenant text,
    produced_at timestamptz)
    RETURNS inbox._handler_call
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    settings inbox.consumer_config;
    version text;
    hash bytea;
    plan inbox._handler_call;
BEGIN
    IF inbox._identity_ok(_begin_apply.consumer, _begin_apply.producer, _begin_apply.message_id,
                          _begin_apply.tenant) IS NOT TRUE THEN
        PERFORM inbox._check_identity('inbox.claim_and_apply', _begin_apply.consumer, _begin_apply.producer,
                                      _begin_apply.message_id, _begin_apply.tenant);
    END IF;
    IF _begin_apply.message_type IS NULL OR _begin_apply.message_type = ''
       OR pg_catalog.octet_length(_begin_apply.message_type) > 128 THEN
        PERFORM inbox._check_message_type('inbox.claim_and_apply', _begin_apply.message_type);
    END IF;
    -- One query for the handler and the consumer's settings (NULL when unconfigured).
    SELECT h.handler, h.handler_version, h.takes_context,
           c.consumer, c.hash_exclude_keys, c.max_payload_bytes, c.store_payloads, c.last_active_at, c.purge_watermark
      INTO plan.handler, version, plan.takes_context,
           settings.consumer, settings.hash_exclude_keys, settings.max_payload_bytes, settings.store_payloads,
           settings.last_active_at, settings.purge_watermark
      FROM inbox.handler h
      LEFT JOIN inbox.consumer_config c ON c.consumer = h.consumer
     WHERE h.consumer = _begin_apply.consumer AND h.message_type = _begin_apply.message_type;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox.claim_and_apply: no handler registered for consumer % and message type %',
            pg_catalog.quote_literal(_begin_apply.consumer), pg_catalog.quote_literal(_begin_apply.message_type)
            USING ERRCODE = 'undefined_object',
                  HINT = 'An operator registers one: SELECT inbox.register_handler(consumer, message_type, ''f(jsonb)''::regprocedure, version).';
    END IF;
    -- A syscache probe, NULL when the function was dropped after registration.
    IF pg_catalog.pg_get_function_result(plan.handler) IS NULL THEN
        RAISE EXCEPTION 'inbox.claim_and_apply: the handler function (OID %) registered for consumer % and message type % no longer exists',
            plan.handler::oid, pg_catalog.quote_literal(_begin_apply.consumer),
            pg_catalog.quote_literal(_begin_apply.message_type)
            USING ERRCODE = 'undefined_function', HINT = 'Register the handler again with inbox.register_handler.';
    END IF;
    IF settings.consumer IS NULL THEN
        settings := inbox._default_settings(_begin_apply.consumer);
    END IF;
    IF inbox._delivery_ok(pg_column_size(_begin_apply.payload), settings.max_payload_bytes, version) IS NOT TRUE THEN
        PERFORM inbox._check_delivery('inbox.claim_and_apply', pg_column_size(_begin_apply.payload),
                                      settings.max_payload_bytes, version);
    END IF;
    hash := inbox.payload_hash(_begin_apply.payload, settings.hash_exclude_keys);
    -- Retention's heartbeat (sql/075_retention.sql), at most once a minute per consumer.
    IF settings.last_active_at IS NULL OR settings.last_active_at < now() - '60 seconds'::interval THEN
        PERFORM inbox._heartbeat(_begin_apply.consumer);
    END IF;
    -- The first delivery, inline: it is the path every message takes once.
    INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,
                               produced_at, processed_at)
    VALUES (_begin_apply.consumer, _begin_apply.tenant, _begin_apply.producer, _begin_apply.message_id, hash,
            version, _begin_apply.produced_at, now())
    ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;
    IF FOUND THEN
        -- Produced before the purge watermark: maybe purged already, so expired, not new.
        IF _begin_apply.produced_at < settings.purge_watermark THEN
            plan.claim := inbox._expire_check(_begin_apply.consumer, _begin_apply.tenant, _begin_apply.producer,
                                              _begin_apply.message_id, hash, version, _begin_apply.produced_at,
                                              _begin_apply.message_type, _begin_apply.payload, NULL,
                                              settings.store_payloads);
            IF (plan.claim).outcome IS NOT NULL THEN
                RETURN plan;
            END IF;
        END IF;
        plan.claim := ROW('claimed', pg_catalog.encode(hash, 'hex'), NULL, version, now(), NULL, NULL, NULL,
                          NULL)::inbox.delivery_result;
    ELSE
        plan.claim := inbox._claim_core(_begin_apply.consumer, _begin_apply.tenant, _begin_apply.producer,
                                        _begin_apply.message_id, hash, version, _begin_apply.produced_at,
                                        _begin_apply.payload, NULL, settings.store_payloads);
    END IF;
    RETURN plan;
END
$$;
COMMENT ON FUNCTION inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz) IS
    'internal (granted to consumers): the privileged half of claim_and_apply';

CREATE OR REPLACE FUNCTION inbox.claim_and_apply(
    consumer text, producer text, message_id text, message_type text, payload jsonb, tenant text DEFAULT '',
    produced_at timestamptz DEFAULT NULL)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $$
DECLARE
    prepared inbox._handler_call;
    result inbox.delivery_result;
    handler_running boolean := false;
    err_state text;
    err_message text;
    err_constraint text;
BEGIN
    BEGIN
        prepared := inbox._begin_apply(claim_and_apply.consumer, claim_and_apply.producer, claim_and_apply.message_id,
                                       claim_and_apply.message_type, claim_and_apply.payload, claim_and_apply.tenant,
                                       claim_and_apply.produced_at);
        result := prepared.claim;
        IF result.outcome <> 'claimed' THEN
            RETURN result;
        END IF;
        handler_running := true;
        IF prepared.takes_context THEN
            EXECUTE pg_catalog.format('SELECT %s($1, $2)', prepared.handler::regproc)
              USING claim_and_apply.payload,
                    ROW(claim_and_apply.tenant, claim_and_apply.consumer, claim_and_apply.producer, claim_and_apply.message_id,
                        claim_and_apply.message_type, claim_and_apply.produced_at,
                        result.handler_version)::inbox.message_context;
        ELSE
            EXECUTE pg_catalog.format('SELECT %s($1)', prepared.handler::regproc)
              USING claim_and_apply.payload;
        END IF;
        result.outcome := 'applied';
        RETURN result;
    EXCEPTION WHEN OTHERS OR assert_failure THEN
        GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                                err_constraint = CONSTRAINT_NAME;
        -- Bad input fails before the handler: the caller gets the error. Transient errors
        -- (serialization, deadlock, lock timeout, cancel, shutdown, resources, connection) are the
        -- caller's to retry with the whole transaction: they are not the message's fault.
        IF NOT handler_running OR pg_catalog.left(err_state, 2) IN ('40', '08', '53', '57') OR err_state = '55P03' THEN
            RAISE;
        END IF;
    END;
    -- The subtransaction rolled back the handler's writes and the claim; the attempt is recorded
    -- in the caller's transaction, which goes on.
    RETURN inbox.record_failure(claim_and_apply.consumer, claim_and_apply.producer, claim_and_apply.message_id,
                                claim_and_apply.payload, inbox._reason_code(err_state, err_constraint),
                                err_message, result.handler_version, claim_and_apply.tenant,
                                claim_and_apply.message_type);
END
$$;
COMMENT ON FUNCTION inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz) IS
    'Claim and run the registered handler in one call: applied | duplicate | conflict | failed | quarantined';

-- Up to 64 messages in one transaction, each in its own subtransaction (more would overflow the
-- per-backend subtransaction cache and slow every snapshot). The shape and identity of every
-- element are validated before the first is applied; an unknown message type or an oversize
-- payload raises when its element's turn comes. Either way the call fails as a whole, so the
-- caller's transaction keeps nothing of it. An empty array returns no rows.
CREATE OR REPLACE FUNCTION inbox.claim_and_apply_batch(consumer text, messages jsonb)
    RETURNS TABLE (ordinal integer, tenant text, producer text, message_id text, outcome text,
                   payload_sha256 text, stored_sha256 text, handler_version text, processed_at timestamptz,
                   quarantine_id bigint, attempts integer, reason_code text, error_message text)
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $$
DECLARE
    n integer;
    item jsonb;
    what text;
    result inbox.delivery_result;
BEGIN
    IF claim_and_apply_batch.messages IS NULL THEN
        RAISE EXCEPTION 'inbox.claim_and_apply_batch: messages must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.jsonb_typeof(claim_and_apply_batch.messages) <> 'array' THEN
        RAISE EXCEPTION 'inbox.claim_and_apply_batch: messages must be a JSON array of message objects'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each element: {"producer": ..., "message_id": ..., "message_type": ..., "payload": ..., "tenant"?: ..., "produced_at"?: ...}';
    END IF;
    PERFORM inbox._check_identity('inbox.claim_and_apply_batch', claim_and_apply_batch.consumer, '-', '-', '');
    n := pg_catalog.jsonb_array_length(claim_and_apply_batch.messages);
    IF n > 64 THEN
        RAISE EXCEPTION 'inbox.claim_and_apply_batch: a batch holds at most 64 messages, got %', n
            USING ERRCODE = 'program_limit_exceeded', HINT = 'Split the batch.';
    END IF;

    FOR i IN 0 .. n - 1 LOOP
        item := claim_and_apply_batch.messages -> i;
        what := pg_catalog.format('inbox.claim_and_apply_batch: messages[%s]', i);
        IF pg_catalog.jsonb_typeof(item) IS DISTINCT FROM 'object' THEN
            RAISE EXCEPTION '% must be an object', what USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF pg_catalog.jsonb_typeof(item -> 'producer') IS DISTINCT FROM 'string'
           OR pg_catalog.jsonb_typeof(item -> 'message_id') IS DISTINCT FROM 'string'
           OR pg_catalog.jsonb_typeof(item -> 'message_type') IS DISTINCT FROM 'string'
           OR pg_catalog.jsonb_typeof(coalesce(item -> 'tenant', '""')) IS DISTINCT FROM 'string' THEN
            RAISE EXCEPTION '% needs string fields producer, message_id and message_type (and tenant, if given)', what
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF NOT item ? 'payload' THEN
            RAISE EXCEPTION '% has no payload', what USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF item ? 'produced_at' AND pg_catalog.jsonb_typeof(item -> 'produced_at') NOT IN ('string', 'null') THEN
            RAISE EXCEPTION '%.produced_at must be a timestamp string', what USING ERRCODE = 'invalid_parameter_value';
        END IF;
        PERFORM (item ->> 'produced_at')::timestamptz;
        PERFORM inbox._check_identity(what, claim_and_apply_batch.consumer, item ->> 'producer', item ->> 'message_id',
                                      coalesce(item ->> 'tenant', ''));
        PERFORM inbox._check_message_type(what, item ->> 'message_type');
    END LOOP;

    FOR i IN 0 .. n - 1 LOOP
        item := claim_and_apply_batch.messages -> i;
        result := inbox.claim_and_apply(claim_and_apply_batch.consumer, item ->> 'producer', item ->> 'message_id',
                                        item ->> 'message_type', item -> 'payload', coalesce(item ->> 'tenant', ''),
                                        (item ->> 'produced_at')::timestamptz);
        ordinal := i + 1;
        tenant := coalesce(item ->> 'tenant', '');
        producer := item ->> 'producer';
        message_id := item ->> 'message_id';
        outcome := result.outcome;
        payload_sha256 := result.payload_sha256;
        stored_sha256 := result.stored_sha256;
        handler_version := result.handler_version;
        processed_at := result.processed_at;
        quarantine_id := result.quarantine_id;
        attempts := result.attempts;
        reason_code := result.reason_code;
        error_message := result.error_message;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox.claim_and_apply_batch(text, jsonb) IS
    'claim_and_apply for up to 64 messages (a JSON array), each isolated from the others'' failures';

REVOKE ALL ON FUNCTION inbox.register_handler(text, text, regprocedure, text),
    inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz),
    inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz),
    inbox.claim_and_apply_batch(text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.register_handler(text, text, regprocedure, text) TO inbox_operator;
GRANT EXECUTE ON FUNCTION inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz),
    inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz),
    inbox.claim_and_apply_batch(text, jsonb),
    inbox._check_identity(text, text, text, text, text),
    inbox._check_message_type(text, text) TO inbox_consumer;

DROP FUNCTION inbox.claim_batch(text, jsonb, text);
DROP FUNCTION inbox._begin_apply_batch(text, jsonb, text);
DROP TYPE inbox._batch_step;
DROP FUNCTION inbox._unclaim(text, text, text, text);
DROP FUNCTION inbox._generate_dispatcher();
DROP FUNCTION inbox._run_handler_batch(regprocedure, boolean, jsonb[], inbox.message_context[]);
DROP FUNCTION inbox._run_handler(regprocedure, boolean, jsonb, inbox.message_context);
DROP FUNCTION inbox._batch_messages(text, text, jsonb, boolean);
DROP FUNCTION inbox._check_handler(text, regprocedure, text, text);
DROP FUNCTION inbox._privileged_definer(boolean, oid);
DROP FUNCTION inbox._is_transient(text);

COMMIT;
