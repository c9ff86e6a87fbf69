-- Deploy pginbox:python_repair: written from sql/121_python_repair.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: repairing a quarantined message with a Python handler (docs/security.md, "Python
-- handlers: repair grants"). The tables: 120_python_repair_tables.sql.
--   inbox.grant_repair            operator: a one-time grant to repair entry N with handler
--                                 module:function, valid for a while (15 minutes by default)
--   inbox.begin_granted_repair    a login of the consumer's own role, in its transaction: redeems
--                                 the grant, turns the hold into a processed claim, closes the
--                                 entry as recovered and returns the message; the login's Python
--                                 handler then runs in the same transaction. All of it commits
--                                 together, or rolls back with the handler.
--   inbox.granted_repair_failed   the same login, after the handler failed and its transaction
--                                 rolled back: the failure is audited, the entry stays open
-- The authorization is here, not in the client: the grant is refused when no live role is bound
-- to the consumer for the entry's tenant, or when the stored payload did not come from such a role
-- (as inbox.repair refuses for SQL handlers); the redeemer must be a member, through real grants,
-- of a bound role the sender belongs to (no superuser exception, no operator run: the handler acts
-- as the consumer, never with the operator's login). A grant is used once (applied or failed),
-- names the handler the redeemer must run, and expires. Every decision is audited in
-- inbox.quarantine_decision like inbox.repair's, decided_by the operator who granted it; the note
-- says which handler ran, as which login, under which grant.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

-- The roles bound to the entry's consumer for its tenant that the stored payload's sender belongs
-- to; refuses with 42501 when there are none (the rule of inbox._check_operator_run).
CREATE OR REPLACE FUNCTION inbox._repair_roles(fn text, entry inbox.quarantine) RETURNS oid[]
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    bound oid[];
    trusted oid[];
BEGIN
    SELECT array_agg(DISTINCT b.role) INTO bound
      FROM inbox.consumer_binding b JOIN pg_roles r ON r.oid = b.role
     WHERE b.consumer = ANY (ARRAY[entry.consumer, inbox._consumer_base(entry.consumer)])
       AND (b.tenants IS NULL OR entry.tenant = ANY (b.tenants));
    IF bound IS NULL THEN
        RAISE EXCEPTION '%: no live role is bound to consumer %', fn, quote_literal(entry.consumer)
            || CASE WHEN entry.tenant = '' THEN '' ELSE ' for tenant ' || quote_literal(entry.tenant) END
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'A repair''s handler acts as the consumer: it runs with the login of a role bound to it.',
                  HINT = pg_catalog.format('Bind the consumer''s role again (SELECT inbox.bind_consumer(%L, ''<role>'', note => ''...'')), or discard or release the entry.',
                                           entry.consumer);
    END IF;
    trusted := ARRAY(SELECT b FROM unnest(bound) b
                      WHERE EXISTS (SELECT 1 FROM pg_roles s WHERE s.rolname = entry.recorded_by)
                        AND (inbox._real_member(entry.recorded_by::name, b)
                             OR ((SELECT s.rolsuper FROM pg_roles s WHERE s.rolname = entry.recorded_by)
                                 AND NOT (SELECT c.strict_consumers FROM inbox.security_settings c))));
    IF cardinality(trusted) = 0 THEN
        RAISE EXCEPTION '%: the stored payload came from %, not from a role bound to consumer %', fn,
            coalesce(quote_ident(entry.recorded_by), 'an unknown role (recorded before 0.2.0)'),
            quote_literal(entry.consumer)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'Running it would apply input the consumer''s role never sent, with the consumer''s handler.',
                  HINT = 'Discard the entry, or release it so that the consumer processes its next delivery itself.';
    END IF;
    RETURN trusted;
END
$$;
COMMENT ON FUNCTION inbox._repair_roles(text, inbox.quarantine) IS
    'internal: the bound roles a repair''s handler may run as (the payload''s sender belongs to them)';

-- A failure or expired entry with a stored JSON payload; else 55000 saying what to do instead.
CREATE OR REPLACE FUNCTION inbox._check_repairable(fn text, entry inbox.quarantine) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF entry.kind = 'conflict' THEN
        RAISE EXCEPTION '%: entry % is an identity conflict; its identity was already applied', fn, entry.quarantine_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Discard it, and have the producer send a new message id if the second payload is a new intent.';
    END IF;
    IF entry.payload IS NULL THEN
        RAISE EXCEPTION '%: entry % has no stored JSON payload', fn, entry.quarantine_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Release it so that the consumer processes its next delivery, or discard it.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_repairable(text, inbox.quarantine) IS 'internal: may this entry be repaired?';

CREATE OR REPLACE FUNCTION inbox.grant_repair(quarantine_id bigint, handler text, note text,
                                              handler_version text DEFAULT NULL,
                                              valid_for interval DEFAULT '15 minutes')
    RETURNS inbox.repair_grant
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    entry inbox.quarantine;
    granted inbox.repair_grant;
    version text := coalesce(grant_repair.handler_version, grant_repair.handler);
BEGIN
    PERFORM inbox._check_text('inbox.grant_repair', 'handler', grant_repair.handler, 200);
    IF grant_repair.handler !~ '^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$' THEN
        RAISE EXCEPTION 'inbox.grant_repair: handler must be module:function (a Python name), got %',
            quote_literal(grant_repair.handler)
            USING ERRCODE = 'invalid_parameter_value', HINT = 'For example: billing.handlers:credit.';
    END IF;
    PERFORM inbox._check_text('inbox.grant_repair', 'handler_version', version, 200);
    IF grant_repair.valid_for IS NULL OR grant_repair.valid_for < '1 second'::interval
       OR grant_repair.valid_for > '1 day'::interval THEN
        RAISE EXCEPTION 'inbox.grant_repair: valid_for must be between 1 second and 1 day, got %',
            coalesce(grant_repair.valid_for::text, 'NULL')
            USING ERRCODE = CASE WHEN grant_repair.valid_for IS NULL THEN 'null_value_not_allowed'
                                 ELSE 'invalid_parameter_value' END;
    END IF;
    entry := inbox._lock_open_entry('inbox.grant_repair', grant_repair.quarantine_id, grant_repair.note);
    PERFORM inbox._check_repairable('inbox.grant_repair', entry);
    PERFORM inbox._repair_roles('inbox.grant_repair', entry);
    INSERT INTO inbox.repair_grant AS g (quarantine_id, consumer, tenant, handler, handler_version, note, expires_at)
    VALUES (entry.quarantine_id, entry.consumer, entry.tenant, grant_repair.handler, version, grant_repair.note,
            clock_timestamp() + grant_repair.valid_for)
    RETURNING g.* INTO granted;
    RETURN granted;
END
$$;
COMMENT ON FUNCTION inbox.grant_repair(bigint, text, text, text, interval) IS
    'Grant a login of the consumer''s role one repair of a quarantine entry with a Python handler (module:function); audited, used once, expires';

-- The checks of a redemption: the grant is live and names this handler, the entry is open and
-- repairable, and the caller is a member (real grants) of a bound role the payload's sender belongs
-- to. Locks the grant and the entry.
CREATE OR REPLACE FUNCTION inbox._redeem_grant(fn text, grant_id bigint, handler text) RETURNS inbox.repair_grant
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g inbox.repair_grant;
    entry inbox.quarantine;
    caller name := inbox._caller();
BEGIN
    IF _redeem_grant.grant_id IS NULL OR _redeem_grant.handler IS NULL THEN
        RAISE EXCEPTION '%: grant_id and handler must not be NULL', fn USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT r.* INTO g FROM inbox.repair_grant r WHERE r.grant_id = _redeem_grant.grant_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: no repair grant %', fn, _redeem_grant.grant_id USING ERRCODE = 'no_data_found';
    END IF;
    IF g.redeemed_at IS NOT NULL THEN
        RAISE EXCEPTION '%: repair grant % was already used by % at % (%)', fn, g.grant_id, g.redeemed_by,
            g.redeemed_at, g.result
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'A grant runs once: an operator grants again with inbox.grant_repair.';
    END IF;
    IF g.expires_at < clock_timestamp() THEN
        RAISE EXCEPTION '%: repair grant % expired at %', fn, g.grant_id, g.expires_at
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'An operator grants again with inbox.grant_repair (valid_for => ...).';
    END IF;
    IF _redeem_grant.handler <> g.handler THEN
        RAISE EXCEPTION '%: repair grant % is for handler %, not %', fn, g.grant_id, quote_literal(g.handler),
            quote_literal(_redeem_grant.handler)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'The operator chose which handler repairs the entry.';
    END IF;
    entry := inbox._lock_open_entry(fn, g.quarantine_id, g.note);
    PERFORM inbox._check_repairable(fn, entry);
    IF NOT EXISTS (SELECT 1 FROM unnest(inbox._repair_roles(fn, entry)) b WHERE inbox._real_member(caller, b)) THEN
        RAISE EXCEPTION '%: role % may not run repair grant %: only a login of a role bound to consumer % does',
            fn, quote_ident(caller), g.grant_id, quote_literal(g.consumer)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'The handler acts as the consumer: it runs with the consumer''s own login (a member of a role bound to it, which sent the payload), never with an operator''s or a superuser''s.',
                  HINT = 'Run it with the consumer service''s credentials: pginbox quarantine redeem <grant> --python <handler> --dsn <the consumer''s DSN>.';
    END IF;
    RETURN g;
END
$$;
COMMENT ON FUNCTION inbox._redeem_grant(text, bigint, text) IS 'internal: the checks of a repair grant''s redemption';

-- The decision row and the entry's closing, in the operator's name (who decided), with the login
-- that ran the handler in the note.
CREATE OR REPLACE FUNCTION inbox._grant_decision(g inbox.repair_grant, result text, reason_code text,
                                                 error_message text) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO inbox.quarantine_decision (quarantine_id, decision, result, decided_by, note, reason_code, error_message)
    VALUES (g.quarantine_id, 'repair', _grant_decision.result, g.granted_by,
            g.note || pg_catalog.format(' [python handler %s, run by %s, grant %s]', g.handler, inbox._caller(), g.grant_id),
            _grant_decision.reason_code, _grant_decision.error_message);
    UPDATE inbox.repair_grant r
       SET redeemed_by = inbox._caller(), redeemed_at = clock_timestamp(), result = _grant_decision.result,
           reason_code = _grant_decision.reason_code, error_message = _grant_decision.error_message
     WHERE r.grant_id = g.grant_id;
END
$$;
COMMENT ON FUNCTION inbox._grant_decision(inbox.repair_grant, text, text, text) IS
    'internal: audits a granted repair (decision row, grant used)';

CREATE OR REPLACE FUNCTION inbox.begin_granted_repair(grant_id bigint, handler text) RETURNS inbox.granted_repair
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g inbox.repair_grant;
    entry inbox.quarantine;
BEGIN
    g := inbox._redeem_grant('inbox.begin_granted_repair', begin_granted_repair.grant_id, begin_granted_repair.handler);
    SELECT q.* INTO entry FROM inbox.quarantine q WHERE q.quarantine_id = g.quarantine_id;
    -- The hold turns into a processed claim, as in inbox.repair (sql/050_quarantine.sql).
    PERFORM inbox._settle_hold('inbox.begin_granted_repair', entry, g.handler_version);
    UPDATE inbox.quarantine q SET status = 'recovered', decided_at = now(), decided_by = g.granted_by
     WHERE q.quarantine_id = entry.quarantine_id;
    PERFORM inbox._grant_decision(g, 'recovered', NULL, NULL);
    RETURN ROW(g.grant_id, entry.quarantine_id, entry.consumer, entry.tenant, entry.producer, entry.message_id,
               entry.message_type, entry.payload, pg_catalog.encode(entry.payload_sha256, 'hex'), g.handler_version,
               entry.attempts)::inbox.granted_repair;
END
$$;
COMMENT ON FUNCTION inbox.begin_granted_repair(bigint, text) IS
    'Redeem a repair grant in this transaction (a login of the consumer''s role): the entry closes as recovered and its message is returned for the handler; all of it rolls back with the handler';

CREATE OR REPLACE FUNCTION inbox.granted_repair_failed(grant_id bigint, handler text, reason_code text,
                                                       error_message text DEFAULT NULL)
    RETURNS inbox.repair_grant
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g inbox.repair_grant;
    code text := left(granted_repair_failed.reason_code, 64);
    text_ text := left(coalesce(granted_repair_failed.error_message, granted_repair_failed.reason_code), 2000);
BEGIN
    PERFORM inbox._check_text('inbox.granted_repair_failed', 'reason_code', granted_repair_failed.reason_code, 1000);
    g := inbox._redeem_grant('inbox.granted_repair_failed', granted_repair_failed.grant_id, granted_repair_failed.handler);
    UPDATE inbox.quarantine q
       SET reason_code = code, error_message = text_, last_failure_at = now()
     WHERE q.quarantine_id = g.quarantine_id;
    PERFORM inbox._grant_decision(g, 'repair_failed', code, text_);
    SELECT r.* INTO g FROM inbox.repair_grant r WHERE r.grant_id = granted_repair_failed.grant_id;
    RETURN g;
END
$$;
COMMENT ON FUNCTION inbox.granted_repair_failed(bigint, text, text, text) IS
    'Audit a granted repair whose handler failed (its transaction rolled back): the entry stays open, the grant is used';

REVOKE ALL ON FUNCTION inbox._repair_roles(text, inbox.quarantine), inbox._check_repairable(text, inbox.quarantine),
    inbox.grant_repair(bigint, text, text, text, interval), inbox._redeem_grant(text, bigint, text),
    inbox._grant_decision(inbox.repair_grant, text, text, text), inbox.begin_granted_repair(bigint, text),
    inbox.granted_repair_failed(bigint, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.grant_repair(bigint, text, text, text, interval) TO inbox_operator;
GRANT EXECUTE ON FUNCTION inbox.begin_granted_repair(bigint, text), inbox.granted_repair_failed(bigint, text, text, text)
    TO inbox_consumer;

COMMIT;
