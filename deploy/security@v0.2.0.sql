-- Deploy pginbox:security. Generated from sql/027_security.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: the authorization of consumers (docs/security.md). Every function that acts under a
-- consumer name (claim, claim_bytea, claim_and_apply[_batch], record_failure, record_start,
-- enqueue_effect) asks inbox._may_act_as first: one index probe of inbox.consumer_binding and the
-- backend's cached role memberships. Only when it says no does inbox._authorize run, to let a
-- superuser through (unless strict_consumers) or to name what is wrong. inbox._check_operator_run
-- keeps an operator's repair or replay within the consumer's rights.
-- The caller is session_user: inside a SECURITY DEFINER function current_user is the owner, and
-- a session may act as a consumer exactly when its login role is a member of a bound role (which
-- is also when it could SET ROLE to it).
BEGIN;

SET LOCAL ROLE inbox_owner;

-- The base name of a versioned consumer ('<base>@<version>', inbox.versioned_consumer): bindings of
-- the base cover every version of it.
CREATE OR REPLACE FUNCTION inbox._consumer_base(consumer text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_catalog.split_part(consumer, '@', 1);
COMMENT ON FUNCTION inbox._consumer_base(text) IS 'internal: the name a versioned consumer is bound under';

-- The rule: may session_user act as the consumer (or its base name) for the tenant (NULL tenant:
-- any binding)? It must be a member of a role bound to it. A one-row SQL function with a
-- standard body: the planner inlines it into the query that calls it (claim_and_apply's handler
-- lookup asks in the same query), and its names were resolved when it was created.
CREATE OR REPLACE FUNCTION inbox._acting_as(consumer text, tenant text) RETURNS TABLE (allowed boolean)
    LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT EXISTS (
        SELECT 1 FROM inbox.consumer_binding b
         WHERE b.consumer OPERATOR(pg_catalog.=) ANY (ARRAY[_acting_as.consumer, inbox._consumer_base(_acting_as.consumer)])
           AND (b.tenants IS NULL OR _acting_as.tenant IS NULL OR _acting_as.tenant OPERATOR(pg_catalog.=) ANY (b.tenants))
           AND pg_catalog.pg_has_role(session_user, b.role, 'MEMBER')
           -- A dropped role matches nobody (a superuser is a member of any OID). pg_get_userbyid
           -- looks the OID up in the role cache and names a missing one 'unknown (OID=n)'; a role
           -- that calls itself so only locks itself out. (A subplan on pg_roles cost 2 us of every
           -- claim; as a join, the planner called pg_has_role for every role of the cluster.)
           AND pg_catalog.pg_get_userbyid(b.role) OPERATOR(pg_catalog.<>)
               ('unknown (OID=' OPERATOR(pg_catalog.||) b.role::pg_catalog.text OPERATOR(pg_catalog.||) ')'));
END;
COMMENT ON FUNCTION inbox._acting_as(text, text) IS 'internal: the authorization rule, inlined into the queries that ask it';

-- The rule as a boolean, for the callers that ask it alone. PL/pgSQL, so that its one query is
-- planned once per session.
CREATE OR REPLACE FUNCTION inbox._may_act_as(consumer text, tenant text) RETURNS boolean
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT a.allowed FROM inbox._acting_as(_may_act_as.consumer, _may_act_as.tenant) a);
END
$$;
COMMENT ON FUNCTION inbox._may_act_as(text, text) IS 'internal: may session_user act as the consumer (for the tenant)?';

-- The slow path of the check: a superuser passes (unless strict_consumers), everyone else gets an
-- error that says what is wrong: 42501 (reserved name, or not bound to this role or tenant), 42704
-- (nobody is bound to the consumer: a typo, or a consumer no operator has bound yet).
CREATE OR REPLACE FUNCTION inbox._authorize(fn text, consumer text, tenant text) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    is_superuser boolean;
BEGIN
    IF inbox._may_act_as(_authorize.consumer, _authorize.tenant) THEN
        RETURN;
    END IF;
    IF current_setting('inbox.operator_run', true) = _authorize.consumer
       AND pg_has_role(session_user, 'inbox_operator', 'MEMBER') THEN
        -- An operator's repair or replay runs the consumer's handler (SECURITY DEFINER, owned by
        -- the consumer's role: inbox._check_operator_run), whose enqueue_effect acts as the
        -- consumer. inbox.repair and inbox.run_replay_plan set the marker around the handler call;
        -- an operator who set it by hand could as well bind itself to the consumer (audited).
        RETURN;
    END IF;
    IF starts_with(_authorize.consumer, 'replay:') THEN
        RAISE EXCEPTION '%: consumer names starting with ''replay:'' belong to replay plans', fn
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Replay plans claim their operation ids themselves (inbox.run_replay_plan).';
    END IF;
    SELECT r.rolsuper INTO is_superuser FROM pg_roles r WHERE r.rolname = session_user;
    IF NOT EXISTS (SELECT 1 FROM inbox.consumer_binding b
                    WHERE b.consumer = ANY (ARRAY[_authorize.consumer, inbox._consumer_base(_authorize.consumer)])) THEN
        IF is_superuser AND NOT (SELECT s.strict_consumers FROM inbox.security_settings s) THEN
            RETURN;
        END IF;
        RAISE EXCEPTION '%: consumer % is not known: no role is bound to it', fn, quote_literal(_authorize.consumer)
            USING ERRCODE = 'undefined_object',
                  DETAIL = 'A consumer that nobody is bound to would start a fresh identity space, applying every message again.',
                  HINT = pg_catalog.format('Check the name for a typo. An operator binds a consumer to the roles that act as it: SELECT inbox.bind_consumer(%L, %L);',
                                           _authorize.consumer, session_user);
    END IF;
    IF is_superuser THEN
        -- A superuser is a member of every role, so it passes inbox._may_act_as for every bound
        -- consumer and tenant. Without strict_consumers it may act as any consumer and tenant; with
        -- it, a tenant outside every binding (or an unbound consumer, above) stops it too.
        IF NOT (SELECT s.strict_consumers FROM inbox.security_settings s) THEN
            RETURN;
        END IF;
    END IF;

    RAISE EXCEPTION '%: role % may not act as consumer %', fn, quote_ident(session_user),
        quote_literal(_authorize.consumer)
        || CASE WHEN _authorize.tenant IS NULL THEN '' ELSE ' for tenant ' || quote_literal(_authorize.tenant) END
        USING ERRCODE = 'insufficient_privilege',
              DETAIL = 'The consumer is bound to other roles (inbox.consumer_binding).',
              HINT = pg_catalog.format('An operator binds it: SELECT inbox.bind_consumer(%L, %L);',
                                       _authorize.consumer, session_user);
END
$$;
COMMENT ON FUNCTION inbox._authorize(text, text, text) IS
    'internal: returns when session_user may act as the consumer for the tenant, else raises 42501 / 42704';

-- An operator's repair or replay runs a consumer's handler, and must never do so with more rights
-- than the consumer's own role, nor with a payload the consumer's role did not send (an operator's
-- action never runs with more rights than the role that supplied its input). Both hold when
--   the payload came from a member of a role bound to the consumer (recorded_by, or a replay item
--   whose payload matches the hash the consumer stored), and
--   the handler is SECURITY DEFINER, owned by a role that bound role is a member of: it then runs
--   with no more than the consumer's rights, and no SET ROLE / RESET ROLE inside it can escape
--   (PostgreSQL forbids both within a security-definer function).
-- A SECURITY INVOKER handler would run with the operator's rights: refused, with what to do.
-- Allowed as in 0.1.0 (the operator's rights): a consumer bound only by the upgrade from 0.1.0
-- (legacy, with a notice, until an operator binds its real role), or one bound to nobody (only a
-- superuser can have delivered its messages).
CREATE OR REPLACE FUNCTION inbox._check_operator_run(fn text, consumer text, handler regprocedure, sender text,
                                                     sender_checked boolean)
    RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    bound oid[];
    any_legacy boolean;
    trusted oid[];
    handler_owner oid;
    handler_definer boolean;
BEGIN
    SELECT array_agg(b.role) FILTER (WHERE NOT b.legacy), coalesce(bool_or(b.legacy), false)
      INTO bound, any_legacy
      FROM inbox.consumer_binding b JOIN pg_roles r ON r.oid = b.role
     WHERE b.consumer = ANY (ARRAY[_check_operator_run.consumer, inbox._consumer_base(_check_operator_run.consumer)]);
    IF bound IS NULL THEN
        IF any_legacy THEN
            RAISE NOTICE '%: consumer % is bound only by the upgrade from 0.1.0: the handler runs with your rights', fn,
                quote_literal(_check_operator_run.consumer)
                USING HINT = 'Bind the consumer to its own role (docs/security.md#repair-and-replay).';
        END IF;
        RETURN;
    END IF;
    IF _check_operator_run.sender_checked THEN
        trusted := bound;
    ELSE
        -- The bound roles the payload's sender belongs to (a dropped sender belongs to none).
        trusted := ARRAY(SELECT b FROM unnest(bound) b
                          WHERE EXISTS (SELECT 1 FROM pg_roles s WHERE s.rolname = _check_operator_run.sender)
                            AND pg_has_role(_check_operator_run.sender, b, 'MEMBER'));
        IF cardinality(trusted) = 0 THEN
            RAISE EXCEPTION '%: the stored payload came from %, not from a role bound to consumer %', fn,
                coalesce(quote_ident(_check_operator_run.sender), 'an unknown role (recorded before 0.2.0)'),
                quote_literal(_check_operator_run.consumer)
                USING ERRCODE = 'insufficient_privilege',
                      DETAIL = 'Running it would apply input the consumer''s role never sent, with the consumer''s handler.',
                      HINT = 'Discard the entry, or release it so that the consumer processes its next delivery itself.';
        END IF;
    END IF;
    SELECT p.proowner, p.prosecdef INTO handler_owner, handler_definer FROM pg_proc p WHERE p.oid = _check_operator_run.handler;
    IF NOT handler_definer OR NOT EXISTS (SELECT 1 FROM unnest(trusted) b WHERE pg_has_role(b, handler_owner, 'MEMBER')) THEN
        RAISE EXCEPTION '%: handler % would run with more rights than consumer % has', fn, _check_operator_run.handler,
            quote_literal(_check_operator_run.consumer)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = CASE WHEN NOT handler_definer
                                THEN 'It is SECURITY INVOKER: it would run with your rights, and its owner can change its body.'
                                ELSE pg_catalog.format('It is SECURITY DEFINER owned by %s, which the consumer''s roles are not members of.',
                                                       pg_get_userbyid(handler_owner)) END,
                  HINT = pg_catalog.format('Have the consumer''s role own it as SECURITY DEFINER: ALTER FUNCTION %s SECURITY DEFINER SET search_path = <its schemas>, pg_temp; ALTER FUNCTION %s OWNER TO %I;',
                                           _check_operator_run.handler, _check_operator_run.handler, pg_get_userbyid(trusted[1]));
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_operator_run(text, text, regprocedure, text, boolean) IS
    'internal: may an operator run this consumer''s handler on this payload without exceeding the consumer''s rights?';

CREATE OR REPLACE FUNCTION inbox._check_note(fn text, note text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF note IS NULL OR note !~ '\S' OR octet_length(note) > 2000 THEN
        RAISE EXCEPTION '%: a note of 1 to 2000 bytes must say why', fn
            USING ERRCODE = CASE WHEN note IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'The note goes into the audit trail (inbox.binding_change).';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_note(text, text) IS 'internal: an audit note is required, 1 to 2000 bytes';

-- Binds a role to a consumer (and to every versioned name of it): members of the role may act as
-- the consumer, for the given tenants (NULL: all). Binding again replaces the tenant list.
CREATE OR REPLACE FUNCTION inbox.bind_consumer(consumer text, role regrole, tenants text[] DEFAULT NULL,
                                               note text DEFAULT 'bound')
    RETURNS inbox.consumer_binding
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    wanted text[];
    saved inbox.consumer_binding;
BEGIN
    PERFORM inbox._check_identity('inbox.bind_consumer', bind_consumer.consumer, '-', '-', '');
    PERFORM inbox._check_note('inbox.bind_consumer', bind_consumer.note);
    IF starts_with(bind_consumer.consumer, 'replay:') THEN
        RAISE EXCEPTION 'inbox.bind_consumer: consumer names starting with ''replay:'' belong to replay plans'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF bind_consumer.role IS NULL THEN
        RAISE EXCEPTION 'inbox.bind_consumer: role must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'Name the role of the service that consumes, e.g. ''billing_service''::regrole.';
    END IF;
    IF bind_consumer.tenants IS NOT NULL THEN
        IF cardinality(bind_consumer.tenants) = 0 OR array_position(bind_consumer.tenants, NULL) IS NOT NULL
           OR EXISTS (SELECT 1 FROM unnest(bind_consumer.tenants) t WHERE octet_length(t) > 128) THEN
            RAISE EXCEPTION 'inbox.bind_consumer: tenants must be NULL (every tenant) or a non-empty list of names of at most 128 bytes'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        wanted := (SELECT array_agg(DISTINCT t ORDER BY t) FROM unnest(bind_consumer.tenants) t);
    END IF;
    INSERT INTO inbox.consumer_binding AS b (consumer, role, tenants, note)
    VALUES (bind_consumer.consumer, bind_consumer.role::oid, wanted, bind_consumer.note)
    ON CONFLICT ON CONSTRAINT consumer_binding_pkey DO UPDATE
       SET tenants = EXCLUDED.tenants, legacy = false, bound_at = now(), bound_by = session_user, note = EXCLUDED.note
    RETURNING b.* INTO saved;
    INSERT INTO inbox.binding_change (action, consumer, role_name, tenants, note)
    VALUES ('bind_consumer', bind_consumer.consumer, bind_consumer.role::text, wanted, bind_consumer.note);
    RETURN saved;
END
$$;
COMMENT ON FUNCTION inbox.bind_consumer(text, regrole, text[], text) IS
    'Allow members of a role to act as a consumer (and its versioned names), for some tenants or all; audited';

CREATE OR REPLACE FUNCTION inbox.unbind_consumer(consumer text, role regrole, note text DEFAULT 'unbound')
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_note('inbox.unbind_consumer', unbind_consumer.note);
    DELETE FROM inbox.consumer_binding b
     WHERE b.consumer = unbind_consumer.consumer AND b.role = unbind_consumer.role::oid;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO inbox.binding_change (action, consumer, role_name, note)
    VALUES ('unbind_consumer', unbind_consumer.consumer, unbind_consumer.role::text, unbind_consumer.note);
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox.unbind_consumer(text, regrole, text) IS 'Remove a role''s binding to a consumer (false: there was none); audited';

-- Deployment-wide settings; an argument left out keeps its value.
CREATE OR REPLACE FUNCTION inbox.configure_security(strict_consumers boolean DEFAULT NULL,
                                                    anonymous_enqueue boolean DEFAULT NULL,
                                                    max_effect_delay interval DEFAULT NULL,
                                                    note text DEFAULT 'configured')
    RETURNS inbox.security_settings
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    saved inbox.security_settings;
BEGIN
    PERFORM inbox._check_note('inbox.configure_security', configure_security.note);
    IF configure_security.max_effect_delay NOT BETWEEN '1 second'::interval AND '365 days'::interval THEN
        RAISE EXCEPTION 'inbox.configure_security: max_effect_delay must be between 1 second and 365 days, got %',
            configure_security.max_effect_delay USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE inbox.security_settings s
       SET strict_consumers = coalesce(configure_security.strict_consumers, s.strict_consumers),
           anonymous_enqueue = coalesce(configure_security.anonymous_enqueue, s.anonymous_enqueue),
           max_effect_delay = coalesce(configure_security.max_effect_delay, s.max_effect_delay),
           updated_at = now(), updated_by = session_user
    RETURNING s.* INTO saved;
    INSERT INTO inbox.binding_change (action, detail, note)
    VALUES ('configure_security', jsonb_build_object('strict_consumers', saved.strict_consumers,
                                                     'anonymous_enqueue', saved.anonymous_enqueue,
                                                     'max_effect_delay', saved.max_effect_delay),
            configure_security.note);
    RETURN saved;
END
$$;
COMMENT ON FUNCTION inbox.configure_security(boolean, boolean, interval, text) IS
    'Deployment-wide security settings: strict_consumers, anonymous_enqueue, max_effect_delay; audited';

REVOKE ALL ON FUNCTION inbox.bind_consumer(text, regrole, text[], text), inbox.unbind_consumer(text, regrole, text),
    inbox.configure_security(boolean, boolean, interval, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.bind_consumer(text, regrole, text[], text), inbox.unbind_consumer(text, regrole, text),
    inbox.configure_security(boolean, boolean, interval, text) TO inbox_operator;

COMMIT;
