-- Deploy pginbox:quarantine: written from sql/050_quarantine.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: operator decisions on quarantine. Quarantine is a change of ownership, not success:
-- each entry stays open until an operator repairs, discards or releases it, and every decision
-- leaves an audit row in inbox.quarantine_decision (who, when, note, result).
--   repair   run the stored payload through the current handler now; on success the identity is
--            processed and the entry closes as recovered (failure and expired entries)
--   discard  close without effect. A failure entry's identity becomes 'discarded': its redeliveries
--            are 'duplicate'. A conflict entry just closes: the identity was applied with the first
--            payload, and redeliveries of the conflicting one stay 'conflict' (counted on the entry)
--   release  forget the hold: the next delivery is processed normally (failure entries only)
-- A conflict entry can only be discarded: its identity was already applied once.
-- repair never runs a handler with more rights than a role bound to the consumer, nor on a payload
-- such a role did not send (inbox._check_operator_run, sql/027_security.sql): the handler must be
-- SECURITY DEFINER owned by the consumer's role. repair is SECURITY DEFINER itself: it
-- runs the handler through inbox._run_for_operator (confined, its code acting with its owner's
-- rights for the call), and nobody can call its halves outside it.
-- Expired entries hold their identity like failure entries (a placeholder row in inbox.message);
-- releasing one lets exactly one delivery through (release_used_at).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;
-- DROP ... IF EXISTS below makes this script rerunnable (sqitch rework): no notices for it.
SET LOCAL client_min_messages = warning;

-- Locks an open entry for a decision; rejects a missing note, an unknown id or a closed entry.
CREATE OR REPLACE FUNCTION inbox._lock_open_entry(fn text, quarantine_id bigint, note text) RETURNS inbox.quarantine
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    entry inbox.quarantine;
BEGIN
    IF _lock_open_entry.quarantine_id IS NULL THEN
        RAISE EXCEPTION '%: quarantine_id must not be NULL', fn USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF note IS NULL OR note !~ '\S' THEN
        RAISE EXCEPTION '%: a decision needs a note saying why', fn
            USING ERRCODE = CASE WHEN note IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'The note goes into the audit trail (inbox.quarantine_decision).';
    END IF;
    SELECT q.* INTO entry FROM inbox.quarantine q WHERE q.quarantine_id = _lock_open_entry.quarantine_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: no quarantine entry %', fn, _lock_open_entry.quarantine_id USING ERRCODE = 'no_data_found';
    END IF;
    IF entry.status <> 'open' THEN
        RAISE EXCEPTION '%: quarantine entry % is already %', fn, entry.quarantine_id, entry.status
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Its decisions are in inbox.quarantine_decision.';
    END IF;
    RETURN entry;
END
$$;
COMMENT ON FUNCTION inbox._lock_open_entry(text, bigint, text) IS 'internal: locks an open quarantine entry for a decision';

CREATE OR REPLACE FUNCTION inbox._close_entry(entry inbox.quarantine, decision text, result text, note text) RETURNS void
    LANGUAGE sql VOLATILE
    BEGIN ATOMIC
        UPDATE inbox.quarantine q
           SET status = _close_entry.result, decided_at = now(), decided_by = session_user
         WHERE q.quarantine_id = (_close_entry.entry).quarantine_id;
        INSERT INTO inbox.quarantine_decision (quarantine_id, decision, result, note)
        VALUES ((_close_entry.entry).quarantine_id, _close_entry.decision, _close_entry.result, _close_entry.note);
    END;
COMMENT ON FUNCTION inbox._close_entry(inbox.quarantine, text, text, text) IS 'internal: closes an entry and writes its audit row';

CREATE OR REPLACE FUNCTION inbox.discard(quarantine_id bigint, note text) RETURNS inbox.quarantine
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    entry inbox.quarantine;
BEGIN
    entry := inbox._lock_open_entry('inbox.discard', discard.quarantine_id, discard.note);
    IF entry.kind IN ('failure', 'expired') THEN
        UPDATE inbox.message m
           SET status = 'discarded', processed_at = now()
         WHERE m.consumer = entry.consumer AND m.tenant = entry.tenant AND m.producer = entry.producer
           AND m.message_id = entry.message_id AND m.status = 'quarantined';
    END IF;
    PERFORM inbox._close_entry(entry, 'discard', 'discarded', discard.note);
    SELECT q.* INTO entry FROM inbox.quarantine q WHERE q.quarantine_id = discard.quarantine_id;
    RETURN entry;
END
$$;
COMMENT ON FUNCTION inbox.discard(bigint, text) IS 'Close a quarantine entry without effect: redeliveries become duplicate';

CREATE OR REPLACE FUNCTION inbox.release(quarantine_id bigint, note text) RETURNS inbox.quarantine
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    entry inbox.quarantine;
BEGIN
    entry := inbox._lock_open_entry('inbox.release', release.quarantine_id, release.note);
    IF entry.kind = 'conflict' THEN
        RAISE EXCEPTION 'inbox.release: entry % is an identity conflict; its identity was already applied', entry.quarantine_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Discard it, and have the producer send a new message id if the second payload is a new intent.';
    END IF;
    DELETE FROM inbox.message m
     WHERE m.consumer = entry.consumer AND m.tenant = entry.tenant AND m.producer = entry.producer
       AND m.message_id = entry.message_id AND m.status = 'quarantined';
    -- An expired entry's release allows one delivery (inbox._expire_check stamps its use).
    UPDATE inbox.quarantine q SET release_used_at = NULL WHERE q.quarantine_id = entry.quarantine_id;
    -- A fresh start: the next delivery gets the full max_attempts again.
    UPDATE inbox.attempt a
       SET started = 0, failed = 0, first_failure_at = NULL, last_failure_at = NULL, last_started_at = NULL
     WHERE a.consumer = entry.consumer AND a.tenant = entry.tenant AND a.producer = entry.producer
       AND a.message_id = entry.message_id;
    PERFORM inbox._close_entry(entry, 'release', 'released', release.note);
    SELECT q.* INTO entry FROM inbox.quarantine q WHERE q.quarantine_id = release.quarantine_id;
    RETURN entry;
END
$$;
COMMENT ON FUNCTION inbox.release(bigint, text) IS 'Lift the hold on a failed or expired message: its next delivery is processed normally (an expired one: that one only)';

-- A repair's claim, the same for inbox.repair and inbox.begin_granted_repair: the quarantine hold
-- (the entry's identity in inbox.message, status 'quarantined') turns into a processed claim with
-- the version of the handler that repairs it. An expired entry recorded before 0.2.0 has no hold
-- row: the operator vouches that the delivery is new, and the repair claims it now (unless a
-- released delivery claimed it meanwhile). 55000 when the identity is no longer held (another
-- delivery or decision processed it), in the name of fn, the function the caller reports. Runs
-- inside its callers' SECURITY DEFINER functions; executable by its owner only.
CREATE OR REPLACE FUNCTION inbox._settle_hold(fn text, entry inbox.quarantine, handler_version text) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE inbox.message m
       SET status = 'processed', payload_sha256 = coalesce(entry.payload_sha256, m.payload_sha256),
           handler_version = _settle_hold.handler_version, processed_at = now()
     WHERE m.consumer = entry.consumer AND m.tenant = entry.tenant AND m.producer = entry.producer
       AND m.message_id = entry.message_id AND m.status = 'quarantined';
    IF NOT FOUND AND entry.kind = 'expired' THEN
        INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,
                                   processed_at)
        VALUES (entry.consumer, entry.tenant, entry.producer, entry.message_id, entry.payload_sha256,
                _settle_hold.handler_version, now())
        ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: identity of entry % is no longer held by quarantine', fn, entry.quarantine_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Another delivery or decision processed it meanwhile: look at the entry with pginbox quarantine show.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._settle_hold(text, inbox.quarantine, text) IS
    'internal: a repair''s claim: the quarantine hold becomes a processed claim (55000 if it is gone)';

-- The first half of repair: checks the entry can be repaired, turns the quarantine hold into a
-- processed claim with the current handler version, closes the entry as recovered and returns the
-- handler call and the rights it runs with (its owner's). All of it rolls back with the handler if
-- the handler fails. Called by inbox.repair only (not granted to operators).
DROP FUNCTION IF EXISTS inbox._begin_repair(bigint, text);
DROP TYPE IF EXISTS inbox._repair_call;
CREATE TYPE inbox._repair_call AS (
    plan inbox._handler_call,
    handler_owner oid
);
COMMENT ON TYPE inbox._repair_call IS 'internal: the handler call of a repair and the role whose rights it runs with';
CREATE OR REPLACE FUNCTION inbox._begin_repair(quarantine_id bigint, note text) RETURNS inbox._repair_call
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    entry inbox.quarantine;
    version text;
    plan inbox._handler_call;
    handler_owner oid;
BEGIN
    entry := inbox._lock_open_entry('inbox.repair', _begin_repair.quarantine_id, _begin_repair.note);
    IF entry.kind = 'conflict' THEN
        RAISE EXCEPTION 'inbox.repair: entry % is an identity conflict; its identity was already applied', entry.quarantine_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Discard it, and have the producer send a new message id if the second payload is a new intent.';
    END IF;
    IF entry.payload IS NULL THEN
        RAISE EXCEPTION 'inbox.repair: entry % has no stored payload', entry.quarantine_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Release it so that the consumer processes its next delivery, or discard it.';
    END IF;
    IF entry.message_type IS NULL THEN
        RAISE EXCEPTION 'inbox.repair: entry % has no message type, so no SQL handler can run it', entry.quarantine_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Release it so that the consumer processes its next delivery, or discard it.';
    END IF;
    SELECT h.handler_version, h.takes_context, h.handler
      INTO version, plan.takes_context, plan.handler
      FROM inbox.handler h
     WHERE h.consumer = entry.consumer AND h.message_type = entry.message_type
       AND pg_catalog.pg_get_function_result(h.handler) IS NOT NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox.repair: no handler registered for consumer % and message type %',
            pg_catalog.quote_literal(entry.consumer), pg_catalog.quote_literal(entry.message_type)
            USING ERRCODE = 'undefined_object', HINT = 'Register the fixed handler with inbox.register_handler first.';
    END IF;
    PERFORM inbox._check_handler('inbox.repair', plan.handler, entry.consumer, entry.message_type);
    handler_owner := inbox._check_operator_run('inbox.repair', entry.consumer, entry.tenant, plan.handler,
                                               entry.recorded_by, false);

    PERFORM inbox._settle_hold('inbox.repair', entry, version);
    PERFORM inbox._close_entry(entry, 'repair', 'recovered', _begin_repair.note);

    plan.claim := ROW('claimed', pg_catalog.encode(entry.payload_sha256, 'hex'), NULL, version, now(),
                      entry.quarantine_id, entry.attempts, NULL, NULL)::inbox.delivery_result;
    plan.payload := entry.payload;
    plan.context := ROW(entry.tenant, entry.consumer, entry.producer, entry.message_id, entry.message_type, NULL,
                        version)::inbox.message_context;
    RETURN ROW(plan, handler_owner)::inbox._repair_call;
END
$$;
COMMENT ON FUNCTION inbox._begin_repair(bigint, text) IS 'internal: the checks and the claim of repair, and the handler call to make';

CREATE OR REPLACE FUNCTION inbox._repair_failed(quarantine_id bigint, note text, reason_code text, error_message text)
    RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    entry inbox.quarantine;
BEGIN
    entry := inbox._lock_open_entry('inbox.repair', _repair_failed.quarantine_id, _repair_failed.note);
    UPDATE inbox.quarantine q
       SET reason_code = _repair_failed.reason_code, error_message = _repair_failed.error_message,
           last_failure_at = now()
     WHERE q.quarantine_id = entry.quarantine_id;
    INSERT INTO inbox.quarantine_decision (quarantine_id, decision, result, note, reason_code, error_message)
    VALUES (entry.quarantine_id, 'repair', 'repair_failed', _repair_failed.note, _repair_failed.reason_code,
            _repair_failed.error_message);
END
$$;
COMMENT ON FUNCTION inbox._repair_failed(bigint, text, text, text) IS 'internal: audits a failed repair';

-- Runs the stored payload through the consumer's current handler, in the caller's transaction.
-- SECURITY DEFINER: the checks, the claim and the audit happen here and nowhere else an operator
-- could call. The handler runs through inbox._run_for_operator: confined (inbox_runner), with its
-- owner's rights (SECURITY DEFINER, owned by a role bound to the consumer), its code acting as that
-- role for the call; nothing it does can act with the operator's rights.
CREATE OR REPLACE FUNCTION inbox.repair(quarantine_id bigint, note text) RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    prepared inbox._repair_call;
    result inbox.delivery_result;
    handler_running boolean := false;
    err_state text;
    err_message text;
    err_constraint text;
BEGIN
    BEGIN
        prepared := inbox._begin_repair(repair.quarantine_id, repair.note);
        result := (prepared.plan).claim;
        handler_running := true;
        PERFORM inbox._run_for_operator('repair', ((prepared.plan).context).consumer, ((prepared.plan).context).tenant,
                                        prepared.handler_owner, (prepared.plan).handler, (prepared.plan).takes_context,
                                        (prepared.plan).payload, (prepared.plan).context);
        result.outcome := 'applied';
        RETURN result;
    EXCEPTION WHEN OTHERS OR assert_failure THEN
        GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT,
                                err_constraint = CONSTRAINT_NAME;
        IF NOT handler_running OR inbox._is_transient(err_state) THEN
            RAISE;
        END IF;
    END;
    result.outcome := 'failed';
    result.processed_at := NULL;
    result.reason_code := inbox._reason_code(err_state, err_constraint);
    result.error_message := left(err_message, 2000);
    PERFORM inbox._repair_failed(repair.quarantine_id, repair.note, result.reason_code, result.error_message);
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox.repair(bigint, text) IS
    'Run a quarantined message through the current handler now: applied (entry recovered) | failed (entry stays open)';

REVOKE ALL ON FUNCTION inbox.discard(bigint, text), inbox.release(bigint, text), inbox.repair(bigint, text),
    inbox._settle_hold(text, inbox.quarantine, text), inbox._begin_repair(bigint, text),
    inbox._repair_failed(bigint, text, text, text) FROM PUBLIC;
-- The halves of repair are repair's alone: a database upgraded from 0.2.0 granted them to operators.
REVOKE ALL ON FUNCTION inbox._begin_repair(bigint, text), inbox._repair_failed(bigint, text, text, text)
    FROM inbox_operator;
GRANT EXECUTE ON FUNCTION inbox.discard(bigint, text), inbox.release(bigint, text), inbox.repair(bigint, text)
    TO inbox_operator;

COMMIT;
