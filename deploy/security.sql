-- Deploy pginbox:security: written from sql/027_security.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: the authorization of consumers (docs/security.md). Every function that acts under a
-- consumer name (claim, claim_bytea, claim_and_apply[_batch], record_failure, record_start,
-- enqueue_effect) asks inbox._acting_as first: one index probe of inbox.consumer_binding and the
-- backend's cached role memberships. Only when it says no does inbox._authorize run, to let the
-- handler of an operator's decision act with its owner's rights (inbox.operator_run), to let a
-- superuser through (unless strict_consumers), or to name what is wrong.
-- The caller is the session's effective role (inbox._caller): session_user, or the role a SET ROLE
-- chose. PostgreSQL lets a session SET ROLE only to a role its login is a member of, and never
-- inside a SECURITY DEFINER function, so the effective role has at most the login's rights and no
-- handler can change it; a pooled login that switches role per request (SET LOCAL ROLE) is held to
-- that role's bindings. Nothing else a caller can set (a setting, a table it can write) decides.
-- An operator's repair or replay runs the consumer's handler through inbox._run_for_operator: the
-- handler's code acts with its owner's rights, recorded for the call in inbox.operator_run, and
-- runs confined (inbox._run_confined, owned by inbox_runner, which holds no rights).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;
-- DROP ... IF EXISTS below makes this script rerunnable (sqitch rework): no notices for it.
SET LOCAL client_min_messages = warning;

-- The base name of a versioned consumer ('<base>@<version>', inbox.versioned_consumer): bindings of
-- the base cover every version of it.
CREATE OR REPLACE FUNCTION inbox._consumer_base(consumer text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_catalog.split_part(consumer, '@', 1);
COMMENT ON FUNCTION inbox._consumer_base(text) IS 'internal: the name a versioned consumer is bound under';

-- Who is calling: the session's effective role. 'role' is the setting SET ROLE writes; PostgreSQL
-- checks the login's membership when it is set, and refuses to set it inside a SECURITY DEFINER
-- function (or anything such a function calls). Inlined by the planner.
CREATE OR REPLACE FUNCTION inbox._caller() RETURNS name
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN CASE pg_catalog.current_setting('role')
                WHEN 'none' THEN session_user
                ELSE pg_catalog.current_setting('role')::name END;
COMMENT ON FUNCTION inbox._caller() IS 'internal: the effective role of the session (session_user, or the SET ROLE one)';

-- Is `member` a member of `role` through real grants? pg_has_role says yes for a superuser and any
-- role; strict_consumers holds superusers to their grants.
CREATE OR REPLACE FUNCTION inbox._real_member(member name, role oid) RETURNS boolean
    LANGUAGE sql STABLE
BEGIN ATOMIC
    WITH RECURSIVE up(r) AS (
        SELECT a.oid FROM pg_catalog.pg_roles a WHERE a.rolname OPERATOR(pg_catalog.=) _real_member.member
        UNION
        SELECT m.roleid FROM pg_catalog.pg_auth_members m JOIN up ON m.member OPERATOR(pg_catalog.=) up.r)
    SELECT EXISTS (SELECT 1 FROM up WHERE up.r OPERATOR(pg_catalog.=) _real_member.role);
END;
COMMENT ON FUNCTION inbox._real_member(name, oid) IS 'internal: membership through grants (a superuser is not a member of everything here)';

-- The rule: may the caller act as the consumer (or its base name) for the tenant (NULL tenant: any
-- binding)? It must hold the rights of a live role bound to it (pg_has_role USAGE: a member that
-- inherits them, or the role itself; a NOINHERIT member only after SET ROLE to it); under
-- strict_consumers a superuser only through real grants. A one-row SQL function with a standard body: the planner inlines it into the
-- query that calls it (claim_and_apply's handler lookup asks in the same query), and its names were
-- resolved when it was created. pg_has_role(caller, inbox_runner) is true only for superusers
-- (nobody is a member of inbox_runner): only they pay for the strict check.
CREATE OR REPLACE FUNCTION inbox._acting_as(consumer text, tenant text) RETURNS TABLE (allowed boolean)
    LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT EXISTS (
        SELECT 1 FROM inbox.consumer_binding b
         WHERE b.consumer OPERATOR(pg_catalog.=) ANY (ARRAY[_acting_as.consumer, inbox._consumer_base(_acting_as.consumer)])
           AND (b.tenants IS NULL OR _acting_as.tenant IS NULL OR _acting_as.tenant OPERATOR(pg_catalog.=) ANY (b.tenants))
           AND pg_catalog.pg_has_role(inbox._caller(), b.role, 'USAGE')
           -- A dropped role matches nobody (a superuser is a member of any OID). pg_get_userbyid
           -- looks the OID up in the role cache and names a missing one 'unknown (OID=n)'; a role
           -- that calls itself so only locks itself out. (A subplan on pg_roles costs every claim
           -- time, docs/performance.md; as a join, the planner calls pg_has_role for every role of the cluster.)
           AND pg_catalog.pg_get_userbyid(b.role) OPERATOR(pg_catalog.<>)
               ('unknown (OID=' OPERATOR(pg_catalog.||) b.role::pg_catalog.text OPERATOR(pg_catalog.||) ')')
           AND (NOT pg_catalog.pg_has_role(inbox._caller(), 'inbox_runner'::pg_catalog.name, 'MEMBER')
                OR NOT (SELECT s.strict_consumers FROM inbox.security_settings s)
                OR inbox._real_member(inbox._caller(), b.role)));
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
COMMENT ON FUNCTION inbox._may_act_as(text, text) IS 'internal: may the caller act as the consumer (for the tenant)?';

-- The rule for a given role (the owner of a handler an operator's decision runs): the same
-- bindings, no superuser exception (a superuser-owned handler is never run: inbox._check_handler).
CREATE OR REPLACE FUNCTION inbox._role_may_act_as(role oid, consumer text, tenant text) RETURNS boolean
    LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT EXISTS (
        SELECT 1 FROM inbox.consumer_binding b
         WHERE b.consumer OPERATOR(pg_catalog.=) ANY (ARRAY[_role_may_act_as.consumer,
                                                            inbox._consumer_base(_role_may_act_as.consumer)])
           AND (b.tenants IS NULL OR _role_may_act_as.tenant IS NULL
                OR _role_may_act_as.tenant OPERATOR(pg_catalog.=) ANY (b.tenants))
           AND pg_catalog.pg_get_userbyid(b.role) OPERATOR(pg_catalog.<>)
               ('unknown (OID=' OPERATOR(pg_catalog.||) b.role::pg_catalog.text OPERATOR(pg_catalog.||) ')')
           AND pg_catalog.pg_get_userbyid(_role_may_act_as.role) OPERATOR(pg_catalog.<>)
               ('unknown (OID=' OPERATOR(pg_catalog.||) _role_may_act_as.role::pg_catalog.text OPERATOR(pg_catalog.||) ')')
           AND inbox._real_member(pg_catalog.pg_get_userbyid(_role_may_act_as.role), b.role));
END;
COMMENT ON FUNCTION inbox._role_may_act_as(oid, text, text) IS
    'internal: may this role act as the consumer (for the tenant)? The rights an operator-run handler acts with';

-- The slow path of the check. In order: the caller's own bindings; the handler of an operator's
-- decision running now in this transaction (inbox.operator_run: its owner's bindings); a superuser
-- (unless strict_consumers); else an error that says what is wrong: 42501 (reserved name, or not
-- bound to this role or tenant), 42704 (nobody is bound to the consumer: a typo, or a consumer no
-- operator has bound yet).
CREATE OR REPLACE FUNCTION inbox._authorize(fn text, consumer text, tenant text) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    caller name := inbox._caller();
    is_superuser boolean;
    strict_mode boolean;
BEGIN
    IF inbox._may_act_as(_authorize.consumer, _authorize.tenant) THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM inbox.operator_run r
                WHERE r.xact = pg_current_xact_id_if_assigned()
                  AND inbox._role_may_act_as(r.handler_owner, _authorize.consumer, _authorize.tenant)) THEN
        RETURN;
    END IF;
    IF starts_with(_authorize.consumer, 'replay:') THEN
        RAISE EXCEPTION '%: consumer names starting with ''replay:'' belong to replay plans', fn
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Replay plans claim their operation ids themselves (inbox.run_replay_plan).';
    END IF;
    SELECT r.rolsuper INTO is_superuser FROM pg_roles r WHERE r.rolname = caller;
    SELECT s.strict_consumers INTO strict_mode FROM inbox.security_settings s;
    IF NOT EXISTS (SELECT 1 FROM inbox.consumer_binding b
                    WHERE b.consumer = ANY (ARRAY[_authorize.consumer, inbox._consumer_base(_authorize.consumer)])) THEN
        IF is_superuser AND NOT strict_mode THEN
            RETURN;
        END IF;
        RAISE EXCEPTION '%: consumer % is not known: no role is bound to it', fn, quote_literal(_authorize.consumer)
            USING ERRCODE = 'undefined_object',
                  DETAIL = 'A consumer that nobody is bound to would start a fresh identity space, applying every message again.',
                  HINT = pg_catalog.format('Check the name for a typo. An operator binds a consumer to the roles that act as it: SELECT inbox.bind_consumer(%L, %L);',
                                           _authorize.consumer, caller);
    END IF;
    IF is_superuser AND NOT strict_mode THEN
        -- A superuser is a member of every role, so it passes the rule for every bound consumer and
        -- tenant. Without strict_consumers it may act as any consumer and tenant; with it, only
        -- through real grants (inbox._acting_as).
        RETURN;
    END IF;

    RAISE EXCEPTION '%: role % may not act as consumer %', fn, quote_ident(caller),
        quote_literal(_authorize.consumer)
        || CASE WHEN _authorize.tenant IS NULL THEN '' ELSE ' for tenant ' || quote_literal(_authorize.tenant) END
        USING ERRCODE = 'insufficient_privilege',
              DETAIL = CASE WHEN is_superuser
                            THEN 'strict_consumers holds superusers to the bindings of the roles they are granted.'
                            ELSE 'The consumer is bound to other roles or tenants (inbox.consumer_binding).' END,
              HINT = pg_catalog.format('An operator binds it: SELECT inbox.bind_consumer(%L, %L%s);',
                                       _authorize.consumer, caller,
                                       CASE WHEN coalesce(_authorize.tenant, '') = '' THEN ''
                                            ELSE pg_catalog.format(', tenants => ARRAY[%L]', _authorize.tenant) END);
END
$$;
COMMENT ON FUNCTION inbox._authorize(text, text, text) IS
    'internal: returns when the caller may act as the consumer for the tenant, else raises 42501 / 42704';

-- An operator's repair or replay runs a consumer's handler, and must never do so with more rights
-- than a role bound to the consumer, nor with a payload such a role did not send (an operator's
-- action never runs with more rights than the role that supplied its input). Both hold when
--   a live role is bound to the consumer for the tenant (an unbound consumer, or one whose bound
--   roles were dropped, is refused: nobody's rights are left to run it with),
--   the payload came from a member of such a role (sender, recorded_by; or sender_checked: replay
--   items whose payloads match the hashes the consumer stored), and
--   the handler is SECURITY DEFINER, owned by a member of such a role: it runs with no more than
--   the consumer's rights, and no SET ROLE / RESET ROLE inside it can escape (PostgreSQL forbids
--   both within a security-definer function). A SECURITY INVOKER handler would run with the
--   rights of whoever calls it: refused, with what to do.
-- inbox_runner calls it (inbox._run_confined): it needs USAGE on the handler's schema and EXECUTE.
-- Returns the handler's owner: the rights its code acts with (inbox.operator_run).
DROP FUNCTION IF EXISTS inbox._check_operator_run(text, text, regprocedure, text, boolean);
CREATE OR REPLACE FUNCTION inbox._check_operator_run(fn text, consumer text, tenant text, handler regprocedure,
                                                     sender text, sender_checked boolean)
    RETURNS oid
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    bound oid[];
    trusted oid[];
    proc record;
BEGIN
    SELECT array_agg(DISTINCT b.role) INTO bound
      FROM inbox.consumer_binding b JOIN pg_roles r ON r.oid = b.role
     WHERE b.consumer = ANY (ARRAY[_check_operator_run.consumer, inbox._consumer_base(_check_operator_run.consumer)])
       AND (b.tenants IS NULL OR _check_operator_run.tenant = ANY (b.tenants));
    IF bound IS NULL THEN
        RAISE EXCEPTION '%: no live role is bound to consumer %', fn, quote_literal(_check_operator_run.consumer)
            || CASE WHEN coalesce(_check_operator_run.tenant, '') = '' THEN ''
                    ELSE ' for tenant ' || quote_literal(_check_operator_run.tenant) END
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'Its handler runs with the rights of a role bound to the consumer; it was unbound, or its role was dropped.',
                  HINT = pg_catalog.format('Bind the consumer''s role again (SELECT inbox.bind_consumer(%L, ''<role>'', note => ''...'')), or discard or release the entry.',
                                           _check_operator_run.consumer);
    END IF;
    IF _check_operator_run.sender_checked THEN
        trusted := bound;
    ELSE
        -- The bound roles the payload's sender belongs to (a dropped sender belongs to none); a
        -- superuser sender, to all of them unless strict_consumers (it may act as any consumer).
        trusted := ARRAY(SELECT b FROM unnest(bound) b
                          WHERE EXISTS (SELECT 1 FROM pg_roles s WHERE s.rolname = _check_operator_run.sender)
                            AND (inbox._real_member(_check_operator_run.sender::name, b)
                                 OR ((SELECT s.rolsuper FROM pg_roles s WHERE s.rolname = _check_operator_run.sender)
                                     AND NOT (SELECT c.strict_consumers FROM inbox.security_settings c))));
        IF cardinality(trusted) = 0 THEN
            RAISE EXCEPTION '%: the stored payload came from %, not from a role bound to consumer %', fn,
                coalesce(quote_ident(_check_operator_run.sender), 'an unknown role (recorded before 0.2.0)'),
                quote_literal(_check_operator_run.consumer)
                USING ERRCODE = 'insufficient_privilege',
                      DETAIL = 'Running it would apply input the consumer''s role never sent, with the consumer''s handler.',
                      HINT = 'Discard the entry, or release it so that the consumer processes its next delivery itself.';
        END IF;
    END IF;
    SELECT p.proowner, p.prosecdef, n.nspname INTO proc
      FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE p.oid = _check_operator_run.handler;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: the handler function (OID %) no longer exists', fn, _check_operator_run.handler::oid
            USING ERRCODE = 'undefined_function', HINT = 'Register the handler again with inbox.register_handler.';
    END IF;
    IF NOT proc.prosecdef
       OR NOT EXISTS (SELECT 1 FROM unnest(trusted) b WHERE inbox._real_member(pg_get_userbyid(proc.proowner), b)) THEN
        RAISE EXCEPTION '%: handler % would run with more rights than consumer % has', fn, _check_operator_run.handler,
            quote_literal(_check_operator_run.consumer)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = CASE WHEN NOT proc.prosecdef
                                THEN 'It is SECURITY INVOKER: it would run with the rights of whoever calls it.'
                                ELSE pg_catalog.format('It is SECURITY DEFINER owned by %s, which is not a member of a role bound to the consumer.',
                                                       quote_ident(pg_get_userbyid(proc.proowner))) END,
                  HINT = pg_catalog.format('Have the consumer''s role own it as SECURITY DEFINER: ALTER FUNCTION %s SECURITY DEFINER SET search_path = <its schemas>, pg_temp; ALTER FUNCTION %s OWNER TO %I;',
                                           _check_operator_run.handler, _check_operator_run.handler, pg_get_userbyid(trusted[1]));
    END IF;
    IF NOT has_schema_privilege('inbox_runner', proc.nspname, 'USAGE')
       OR NOT has_function_privilege('inbox_runner', _check_operator_run.handler, 'EXECUTE') THEN
        RAISE EXCEPTION '%: role inbox_runner, which calls the handlers of operator decisions, may not call %', fn,
            _check_operator_run.handler
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'inbox_runner holds no rights of its own: it needs USAGE on the handler''s schema and EXECUTE on it.',
                  HINT = pg_catalog.format('As the handler''s owner: GRANT USAGE ON SCHEMA %I TO inbox_runner; GRANT EXECUTE ON FUNCTION %s TO inbox_runner;',
                                           proc.nspname, _check_operator_run.handler);
    END IF;
    RETURN proc.proowner;
END
$$;
COMMENT ON FUNCTION inbox._check_operator_run(text, text, text, regprocedure, text, boolean) IS
    'internal: may an operator run this consumer''s handler on this payload without exceeding the rights of a role bound to it? Returns the handler''s owner';

-- Calls the handler of an operator's decision, confined: owned by inbox_runner, which holds no
-- rights (not even USAGE on schema inbox, so it cannot name this function to alter it). A SECURITY
-- DEFINER handler runs with its owner's rights; one altered into SECURITY INVOKER after the checks
-- runs with none. Nothing the handler leaves behind may act with the operator's rights later:
--   * deferred triggers it queued fire here, confined (SET CONSTRAINTS ALL IMMEDIATE), not at the
--     operator's COMMIT;
--   * a setting it changed for the session (search_path above all: the operator's next statement
--     would resolve names through it) fails the call, which rolls the change back.
-- No name of schema inbox appears in the body: inbox_runner could not resolve it.
-- Owned by inbox_runner: to replace it, the owner takes it back first (as the deployer).
RESET ROLE;
DO $own$
BEGIN
    IF pg_catalog.to_regprocedure('inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context)') IS NOT NULL THEN
        ALTER FUNCTION inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context) OWNER TO inbox_owner;
    END IF;
END
$own$;
SET LOCAL ROLE inbox_owner;
CREATE OR REPLACE FUNCTION inbox._run_confined(handler regprocedure, takes_context boolean, payload jsonb,
                                               context inbox.message_context)
    RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    before text[];
    after text[];
    changed text;
BEGIN
    before := ARRAY(SELECT s.name || '=' || coalesce(s.setting, '') FROM pg_settings s ORDER BY s.name);
    IF takes_context THEN
        EXECUTE format('SELECT %s($1, $2)', handler::regproc) USING payload, context;
    ELSE
        EXECUTE format('SELECT %s($1)', handler::regproc) USING payload;
    END IF;
    SET CONSTRAINTS ALL IMMEDIATE;
    after := ARRAY(SELECT s.name || '=' || coalesce(s.setting, '') FROM pg_settings s ORDER BY s.name);
    IF after IS DISTINCT FROM before THEN
        SELECT string_agg(DISTINCT split_part(d.x, '=', 1), ', ') INTO changed
          FROM ((SELECT unnest(before) EXCEPT SELECT unnest(after))
                UNION ALL (SELECT unnest(after) EXCEPT SELECT unnest(before))) d(x);
        RAISE EXCEPTION 'handler % changed settings of the session that runs it: %', handler, changed
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'An operator''s decision runs it in the operator''s session: a changed setting would outlive the handler.',
                  HINT = 'Change settings only with SET LOCAL inside a function that has a SET clause for them (ALTER FUNCTION ... SET name = value).';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context) IS
    'internal: calls the handler of an operator decision as inbox_runner (no rights), firing its deferred triggers and refusing changed settings';
REVOKE ALL ON FUNCTION inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context) FROM PUBLIC;
RESET ROLE;
ALTER FUNCTION inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context) OWNER TO inbox_runner;
GRANT EXECUTE ON FUNCTION inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context) TO inbox_owner;
SET LOCAL ROLE inbox_owner;

-- Runs the handler of an operator's decision (inbox.repair, inbox.run_replay_plan) for the length of
-- the call as the consumer: inbox.operator_run says whose rights its code acts with. Callers hold a
-- subtransaction around it: an error rolls the row back with the handler's work.
CREATE OR REPLACE FUNCTION inbox._run_for_operator(decision text, consumer text, tenant text, handler_owner oid,
                                                   handler regprocedure, takes_context boolean, payload jsonb,
                                                   context inbox.message_context)
    RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO inbox.operator_run (xact, consumer, tenant, handler, handler_owner, decision)
    VALUES (pg_current_xact_id(), _run_for_operator.consumer, _run_for_operator.tenant, _run_for_operator.handler,
            _run_for_operator.handler_owner, _run_for_operator.decision);
    PERFORM set_config('inbox.consumer', _run_for_operator.consumer, true);
    PERFORM set_config('inbox.tenant', _run_for_operator.tenant, true);
    PERFORM inbox._run_confined(_run_for_operator.handler, _run_for_operator.takes_context, _run_for_operator.payload,
                                _run_for_operator.context);
    DELETE FROM inbox.operator_run r WHERE r.xact = pg_current_xact_id();
END
$$;
COMMENT ON FUNCTION inbox._run_for_operator(text, text, text, oid, regprocedure, boolean, jsonb, inbox.message_context) IS
    'internal: runs an operator decision''s handler confined, its code acting with its owner''s rights for the call';

-- An advisory lock key nobody outside the package can compute in advance: the purge's and the first
-- heartbeat's. (Another session can still see a key in pg_locks while it is held: docs/security.md.)
CREATE OR REPLACE FUNCTION inbox._lock_key(space text, name text) RETURNS integer
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT ('x' || left(encode(sha256(s.salt || convert_to(_lock_key.space, 'UTF8') || '\x00'::bytea
                                              || convert_to(_lock_key.name, 'UTF8')), 'hex'), 8))::bit(32)::integer
              FROM inbox.lock_salt s);
END
$$;
COMMENT ON FUNCTION inbox._lock_key(text, text) IS 'internal: a salted advisory lock key (the salt is readable by the owner only)';

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
