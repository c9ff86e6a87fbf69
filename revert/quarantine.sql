-- Revert pginbox:quarantine to @v0.2.0: the released functions again (deploy/quarantine@v0.2.0.sql) (repair SECURITY INVOKER again, its halves granted to operators).
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
-- repair never runs a handler with more rights than the consumer's role, nor on a payload that role
-- did not send (inbox._check_operator_run, sql/027_security.sql): the handler must be SECURITY
-- DEFINER owned by the consumer's role. Its two privileged halves (_begin_repair, _repair_failed)
-- are executable by operators: the audit trail is as trustworthy as the operators.
-- Expired entries hold their identity like failure entries (a placeholder row in inbox.message,
-- since 0.2.0). Reworked in 0.2.0 (docs/releasing.md).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;
-- This version's _begin_repair returns (plan, handler_owner): dropped so that the released one can be created.
DROP FUNCTION inbox._begin_repair(bigint, text);
DROP TYPE inbox._repair_call;
-- New in this version: the repair's claim, also called by python_repair (reverted before this change).
DROP FUNCTION inbox._settle_hold(text, inbox.quarantine, text);

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
COMMENT ON FUNCTION inbox.release(bigint, text) IS 'Lift the hold on a failed message: its next delivery is processed normally';

-- The definer half of repair: checks the entry can be repaired, turns the quarantine hold into a
-- processed claim with the current handler version, closes the entry as recovered and returns the
-- handler call. All of it rolls back with the handler if the handler fails.
CREATE OR REPLACE FUNCTION inbox._begin_repair(
    quarantine_id bigint, note text)
    RETURNS inbox._handler_call
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    entry inbox.quarantine;
    version text;
    plan inbox._handler_call;
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
    PERFORM inbox._check_operator_run('inbox.repair', entry.consumer, plan.handler, entry.recorded_by, false);

    -- The hold turns into a processed claim. An expired entry recorded before 0.2.0 has no hold
    -- row: the operator vouches that the delivery is new, and repair claims it now (unless a
    -- released delivery claimed it meanwhile).
    UPDATE inbox.message m
       SET status = 'processed', payload_sha256 = coalesce(entry.payload_sha256, m.payload_sha256),
           handler_version = version, processed_at = now()
     WHERE m.consumer = entry.consumer AND m.tenant = entry.tenant AND m.producer = entry.producer
       AND m.message_id = entry.message_id AND m.status = 'quarantined';
    IF NOT FOUND AND entry.kind = 'expired' THEN
        INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,
                                   processed_at)
        VALUES (entry.consumer, entry.tenant, entry.producer, entry.message_id, entry.payload_sha256, version, now())
        ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox.repair: identity of entry % is no longer held by quarantine', entry.quarantine_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Another delivery or decision processed it meanwhile: look at the entry with pginbox quarantine show.';
    END IF;
    PERFORM inbox._close_entry(entry, 'repair', 'recovered', _begin_repair.note);

    plan.claim := ROW('claimed', pg_catalog.encode(entry.payload_sha256, 'hex'), NULL, version, now(),
                      entry.quarantine_id, entry.attempts, NULL, NULL)::inbox.delivery_result;
    plan.payload := entry.payload;
    plan.context := ROW(entry.tenant, entry.consumer, entry.producer, entry.message_id, entry.message_type, NULL,
                        version)::inbox.message_context;
    RETURN plan;
END
$$;
COMMENT ON FUNCTION inbox._begin_repair(bigint, text) IS 'internal (granted to operators): the privileged half of repair';

CREATE OR REPLACE FUNCTION inbox._repair_failed(quarantine_id bigint, note text, reason_code text, error_message text)
    RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
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
COMMENT ON FUNCTION inbox._repair_failed(bigint, text, text, text) IS 'internal (granted to operators): audits a failed repair';

-- SECURITY INVOKER like claim_and_apply; the handler it may run is SECURITY DEFINER owned by the
-- consumer's role (inbox._check_operator_run). Operators are schema-qualified: the search_path is
-- the caller's.
CREATE OR REPLACE FUNCTION inbox.repair(quarantine_id bigint, note text) RETURNS inbox.delivery_result
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
        prepared := inbox._begin_repair(repair.quarantine_id, repair.note);
        result := prepared.claim;
        handler_running := true;
        -- The handler acts as the consumer (an effect it enqueues is the consumer's): see inbox._authorize.
        PERFORM pg_catalog.set_config('inbox.consumer', (prepared.context).consumer, true);
        PERFORM pg_catalog.set_config('inbox.operator_run', (prepared.context).consumer, true);
        PERFORM inbox._run_handler(prepared.handler, prepared.takes_context, prepared.payload, prepared.context);
        PERFORM pg_catalog.set_config('inbox.operator_run', '', true);
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
    result.error_message := pg_catalog.left(err_message, 2000);
    PERFORM inbox._repair_failed(repair.quarantine_id, repair.note, result.reason_code, result.error_message);
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox.repair(bigint, text) IS
    'Run a quarantined message through the current handler now: applied (entry recovered) | failed (entry stays open)';

REVOKE ALL ON FUNCTION inbox.discard(bigint, text), inbox.release(bigint, text), inbox.repair(bigint, text),
    inbox._begin_repair(bigint, text), inbox._repair_failed(bigint, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.discard(bigint, text), inbox.release(bigint, text), inbox.repair(bigint, text),
    inbox._begin_repair(bigint, text), inbox._repair_failed(bigint, text, text, text) TO inbox_operator;

COMMIT;
