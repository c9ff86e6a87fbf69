-- Deploy pginbox:retention: written from sql/075_retention.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: retention's functions (tables in 070_retention_tables.sql and
-- 071_retention_watermark_tables.sql). The watermark never moves back; since 0.3.0 it is the
-- announced cutoff itself, and the purge deletes only rows produced before it, so that no margin
-- (nor a mistyped one) can push it past what was purged, and it is never ahead of the clock. A
-- released expired entry lets one delivery through. An expired delivery holds its identity; the
-- purge procedure pauses, says 'inactive' and reports each batch (and what holds rows back).
-- Reworked in 0.3.0 (docs/releasing.md).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;
-- DROP ... IF EXISTS below makes this script rerunnable (sqitch rework): no notices for it.
SET LOCAL client_min_messages = warning;

-- ------------------------------------------------------------------ the window
CREATE OR REPLACE FUNCTION inbox._retention_window(policy inbox.retention_policy,
                                        OUT retention_window interval, OUT dominating_scenario text)
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_catalog.justify_hours(
               greatest(policy.broker_retention, policy.max_offset_rewind, policy.dead_letter_redrive_horizon,
                        policy.producer_retry_horizon, policy.planned_replay_horizon)
               + policy.outage_allowance + policy.backup_restore_window + policy.safety_margin),
           (SELECT s.name FROM (VALUES ('broker_retention', policy.broker_retention, 1, 0),
                                       ('max_offset_rewind', policy.max_offset_rewind, 2, 0),
                                       ('dead_letter_redrive_horizon', policy.dead_letter_redrive_horizon, 3, 0),
                                       ('producer_retry_horizon', policy.producer_retry_horizon, 4, 0),
                                       ('planned_replay_horizon', policy.planned_replay_horizon, 5, 0),
                                       ('outage_allowance', policy.outage_allowance, 6, 1),
                                       ('backup_restore_window', policy.backup_restore_window, 7, 1),
                                       ('safety_margin', policy.safety_margin, 8, 1)) s(name, span, ord, additive)
             WHERE s.span > '0'::interval
             ORDER BY s.additive, s.span DESC, s.ord
             LIMIT 1)
$$;
COMMENT ON FUNCTION inbox._retention_window(inbox.retention_policy) IS
    'internal: greatest(redelivery horizons) + outage_allowance + backup_restore_window + safety_margin, and the dominating scenario';

-- The policy that applies to (consumer, producer): the producer's own, else the consumer's ''.
CREATE OR REPLACE FUNCTION inbox._policy_for(consumer text, producer text) RETURNS inbox.retention_policy
    LANGUAGE sql STABLE
AS $$
    SELECT p.* FROM inbox.retention_policy p
     WHERE p.consumer = _policy_for.consumer AND p.producer IN (_policy_for.producer, '')
     ORDER BY p.producer DESC
     LIMIT 1
$$;
COMMENT ON FUNCTION inbox._policy_for(text, text) IS 'internal: the retention policy of a producer of a consumer (its own, else the consumer''s default)';

CREATE OR REPLACE FUNCTION inbox.retention_window(consumer text, producer text DEFAULT '',
                                       OUT retention_window interval, OUT dominating_scenario text)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    wanted_consumer ALIAS FOR $1;
    wanted_producer ALIAS FOR $2;
    policy inbox.retention_policy;
BEGIN
    PERFORM inbox._check_identity('inbox.retention_window', wanted_consumer, '-', '-', '');
    IF wanted_producer IS NULL THEN
        RAISE EXCEPTION 'inbox.retention_window: producer must not be NULL'
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Use producer '''' for the consumer''s default policy.';
    END IF;
    policy := inbox._policy_for(wanted_consumer, wanted_producer);
    IF policy.consumer IS NULL THEN
        RAISE EXCEPTION 'inbox.retention_window: consumer % has no retention policy', pg_catalog.quote_literal(wanted_consumer)
            USING ERRCODE = 'no_data_found',
                  HINT = 'Its rows are never purged. An operator sets one with inbox.set_retention_policy (pginbox retention set).';
    END IF;
    SELECT w.retention_window, w.dominating_scenario INTO retention_window, dominating_scenario
      FROM inbox._retention_window(policy) w;
END
$$;
COMMENT ON FUNCTION inbox.retention_window(text, text) IS
    'The retention window of a consumer (and producer) and the scenario that dominates it (P0002 without a policy)';

-- ------------------------------------------------------------------ the policy
CREATE OR REPLACE FUNCTION inbox.set_retention_policy(
    consumer text, producer text DEFAULT '', broker_retention interval DEFAULT NULL,
    max_offset_rewind interval DEFAULT NULL, dead_letter_redrive_horizon interval DEFAULT NULL,
    producer_retry_horizon interval DEFAULT NULL, outage_allowance interval DEFAULT NULL,
    backup_restore_window interval DEFAULT NULL, planned_replay_horizon interval DEFAULT NULL,
    safety_margin interval DEFAULT NULL, note text DEFAULT NULL,
    OUT retention_window interval, OUT dominating_scenario text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.set_retention_policy';
    policy inbox.retention_policy;
    scenario record;
BEGIN
    PERFORM inbox._check_identity(fn, set_retention_policy.consumer, '-', '-', '');
    IF set_retention_policy.producer IS NULL THEN
        RAISE EXCEPTION '%: producer must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Use producer '''' for every producer of the consumer.';
    END IF;
    IF pg_catalog.octet_length(set_retention_policy.producer) > 128 THEN
        RAISE EXCEPTION '%: producer is longer than 128 bytes', fn USING ERRCODE = 'string_data_right_truncation';
    END IF;
    FOR scenario IN
        SELECT s.name, s.span FROM (VALUES
            ('broker_retention', set_retention_policy.broker_retention, 1),
            ('max_offset_rewind', set_retention_policy.max_offset_rewind, 2),
            ('dead_letter_redrive_horizon', set_retention_policy.dead_letter_redrive_horizon, 3),
            ('producer_retry_horizon', set_retention_policy.producer_retry_horizon, 4),
            ('outage_allowance', set_retention_policy.outage_allowance, 5),
            ('backup_restore_window', set_retention_policy.backup_restore_window, 6),
            ('planned_replay_horizon', set_retention_policy.planned_replay_horizon, 7),
            ('safety_margin', set_retention_policy.safety_margin, 8)) s(name, span, ord)
         ORDER BY s.ord
    LOOP
        IF scenario.span IS NULL THEN
            RAISE EXCEPTION '%: % must be given', fn, scenario.name
                USING ERRCODE = 'null_value_not_allowed',
                      HINT = 'Every scenario is stated explicitly; pass ''0'' when it does not apply to this consumer.';
        END IF;
        IF scenario.span < '0'::interval THEN
            RAISE EXCEPTION '%: % must not be negative, got %', fn, scenario.name, scenario.span
                USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass ''0'' when the scenario does not apply.';
        END IF;
    END LOOP;
    IF set_retention_policy.note IS NULL OR set_retention_policy.note !~ '\S' THEN
        RAISE EXCEPTION '%: a policy change needs a note saying why', fn
            USING ERRCODE = CASE WHEN set_retention_policy.note IS NULL THEN 'null_value_not_allowed'
                                 ELSE 'invalid_parameter_value' END,
                  HINT = 'The note goes into the audit trail (inbox.retention_policy_change).';
    END IF;
    policy := ROW(set_retention_policy.consumer, set_retention_policy.producer, set_retention_policy.broker_retention,
                  set_retention_policy.max_offset_rewind, set_retention_policy.dead_letter_redrive_horizon,
                  set_retention_policy.producer_retry_horizon, set_retention_policy.outage_allowance,
                  set_retention_policy.backup_restore_window, set_retention_policy.planned_replay_horizon,
                  set_retention_policy.safety_margin, set_retention_policy.note, now(),
                  session_user::text)::inbox.retention_policy;
    SELECT w.retention_window, w.dominating_scenario INTO retention_window, dominating_scenario
      FROM inbox._retention_window(policy) w;
    IF retention_window <= '0'::interval THEN
        RAISE EXCEPTION '%: every scenario is 0, so the window would be 0', fn
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A message can always come back for some time: state at least the broker retention and a safety margin.';
    END IF;
    -- What the window holds besides the margin must cover the clock tolerance (the safety margin, at
    -- least 5 minutes): otherwise a message produced now by a producer whose clock is behind by
    -- less than the tolerance would be older than the watermark of the next purge, and expire.
    IF retention_window - policy.safety_margin < greatest(policy.safety_margin, inbox._default_clock_tolerance()) THEN
        RAISE EXCEPTION '%: the window without its safety margin (%) is shorter than the clock tolerance (%)', fn,
            pg_catalog.justify_hours(retention_window - policy.safety_margin),
            greatest(policy.safety_margin, inbox._default_clock_tolerance())
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = 'Fresh messages from a producer whose clock is behind by less than the tolerance would be older than the next purge''s watermark, and expire.',
                  HINT = 'State the broker retention (and the other scenarios) as they are: the redelivery horizons must be at least the safety margin and at least 5 minutes.';
    END IF;

    INSERT INTO inbox.retention_policy AS p (consumer, producer, broker_retention, max_offset_rewind,
                                             dead_letter_redrive_horizon, producer_retry_horizon, outage_allowance,
                                             backup_restore_window, planned_replay_horizon, safety_margin, note)
    VALUES (policy.consumer, policy.producer, policy.broker_retention, policy.max_offset_rewind,
            policy.dead_letter_redrive_horizon, policy.producer_retry_horizon, policy.outage_allowance,
            policy.backup_restore_window, policy.planned_replay_horizon, policy.safety_margin, policy.note)
    ON CONFLICT ON CONSTRAINT retention_policy_pkey DO UPDATE
       SET broker_retention = EXCLUDED.broker_retention, max_offset_rewind = EXCLUDED.max_offset_rewind,
           dead_letter_redrive_horizon = EXCLUDED.dead_letter_redrive_horizon,
           producer_retry_horizon = EXCLUDED.producer_retry_horizon, outage_allowance = EXCLUDED.outage_allowance,
           backup_restore_window = EXCLUDED.backup_restore_window,
           planned_replay_horizon = EXCLUDED.planned_replay_horizon, safety_margin = EXCLUDED.safety_margin,
           note = EXCLUDED.note, updated_at = now(), updated_by = session_user;
    INSERT INTO inbox.retention_policy_change (consumer, producer, broker_retention, max_offset_rewind,
                                               dead_letter_redrive_horizon, producer_retry_horizon, outage_allowance,
                                               backup_restore_window, planned_replay_horizon, safety_margin,
                                               retention_window, dominating_scenario, note)
    VALUES (policy.consumer, policy.producer, policy.broker_retention, policy.max_offset_rewind,
            policy.dead_letter_redrive_horizon, policy.producer_retry_horizon, policy.outage_allowance,
            policy.backup_restore_window, policy.planned_replay_horizon, policy.safety_margin,
            retention_window, dominating_scenario, policy.note);
    -- A producer that gets its own policy keeps what the consumer's default purge did to its rows:
    -- it starts from the default's watermark.
    IF policy.producer <> '' THEN
        INSERT INTO inbox.purge_state (consumer, producer, announced_before, watermark, announced_at, announce_xid,
                                       purged_before, settled_at, purged_produced_max)
        SELECT s.consumer, policy.producer, s.announced_before, s.watermark, s.announced_at, s.announce_xid,
               s.purged_before, s.settled_at, s.purged_produced_max
          FROM inbox.purge_state s
         WHERE s.consumer = policy.consumer AND s.producer = ''
        ON CONFLICT ON CONSTRAINT purge_state_pkey DO NOTHING;
    END IF;
END
$$;
COMMENT ON FUNCTION inbox.set_retention_policy(text, text, interval, interval, interval, interval, interval, interval,
                                               interval, interval, text) IS
    'Set the retention policy of a consumer (producer '''' = all its producers): every scenario explicit, audited';

-- ------------------------------------------------------------------ activity
-- The claims' heartbeat: called by the claim paths when the consumer's last_active_at is older
-- than a minute (or unknown). Never waits: a row another claim is refreshing is skipped, a
-- concurrent refresh seen at REPEATABLE READ is ignored.
-- Replaces the no-op hook of sql/025_hooks.sql (revert/retention.sql puts the no-op back).
CREATE OR REPLACE FUNCTION inbox._heartbeat(consumer text) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    row_id tid;
    previous timestamptz;
BEGIN
    BEGIN
        SELECT c.ctid, c.last_active_at INTO row_id, previous
          FROM inbox.consumer_config c
         WHERE c.consumer = _heartbeat.consumer
           FOR NO KEY UPDATE SKIP LOCKED;
        IF FOUND THEN
            IF previous IS NULL OR previous < now() - '60 seconds'::interval THEN
                UPDATE inbox.consumer_config c SET last_active_at = now() WHERE c.ctid = row_id;
                IF previous IS NULL OR previous < now() - '5 minutes'::interval THEN
                    INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to)
                    VALUES (_heartbeat.consumer, coalesce(previous, '-infinity'), now())
                    ON CONFLICT ON CONSTRAINT activity_gap_pkey DO NOTHING;
                END IF;
            END IF;
        ELSIF pg_catalog.pg_try_advisory_xact_lock(1886940771, inbox._lock_key('heartbeat', _heartbeat.consumer)) THEN
            -- No row yet (or one being refreshed, then the insert does nothing).
            INSERT INTO inbox.consumer_config (consumer, last_active_at) VALUES (_heartbeat.consumer, now())
            ON CONFLICT ON CONSTRAINT consumer_config_pkey DO NOTHING;
            IF FOUND THEN
                INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to)
                VALUES (_heartbeat.consumer, '-infinity', now())
                ON CONFLICT ON CONSTRAINT activity_gap_pkey DO NOTHING;
            END IF;
        END IF;
    EXCEPTION WHEN serialization_failure OR lock_not_available THEN
        NULL;  -- another claim refreshed it meanwhile
    END;
END
$$;
COMMENT ON FUNCTION inbox._heartbeat(text) IS 'internal: refreshes a consumer''s last_active_at (at most once a minute), records gaps over 5 minutes';

-- The cutoff: the instant T such that the consumer's active time between T and now equals span
-- (wall time minus the recorded gaps, minus the current gap when the consumer is down now).
-- NULL when the consumer has not been active that long since its first heartbeat.
CREATE OR REPLACE FUNCTION inbox._active_cutoff(consumer text, span interval) RETURNS timestamptz
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    last_active timestamptz;
    cursor_at timestamptz := now();
    remaining numeric := extract(epoch FROM span);
    segment numeric;
    gap record;
BEGIN
    SELECT c.last_active_at INTO last_active FROM inbox.consumer_config c WHERE c.consumer = _active_cutoff.consumer;
    IF last_active IS NULL THEN
        RETURN NULL;
    END IF;
    IF last_active < now() - '5 minutes'::interval THEN
        cursor_at := last_active;  -- down now: the current gap does not count
    END IF;
    FOR gap IN
        SELECT g.gap_from, g.gap_to FROM inbox.activity_gap g
         WHERE g.consumer = _active_cutoff.consumer AND g.gap_from < cursor_at
         ORDER BY g.gap_to DESC
    LOOP
        IF gap.gap_to < cursor_at THEN
            segment := extract(epoch FROM cursor_at - gap.gap_to);
            IF segment >= remaining THEN
                RETURN cursor_at - pg_catalog.make_interval(secs => remaining::double precision);
            END IF;
            remaining := remaining - segment;
        END IF;
        cursor_at := least(cursor_at, gap.gap_from);
        IF NOT pg_catalog.isfinite(cursor_at) THEN
            RETURN NULL;
        END IF;
    END LOOP;
    RETURN cursor_at - pg_catalog.make_interval(secs => remaining::double precision);
END
$$;
COMMENT ON FUNCTION inbox._active_cutoff(text, interval) IS 'internal: the instant whose distance to now in the consumer''s active time is span';

-- ------------------------------------------------------------------ the watermark on the claim path
-- The precise watermark of a producer of a consumer (the consumer_config column is the maximum).
CREATE OR REPLACE FUNCTION inbox._watermark(consumer text, producer text) RETURNS timestamptz
    LANGUAGE sql STABLE
AS $$
    SELECT s.watermark FROM inbox.purge_state s
     WHERE s.consumer = _watermark.consumer
       AND s.producer = (SELECT p.producer FROM inbox.retention_policy p
                          WHERE p.consumer = _watermark.consumer AND p.producer IN (_watermark.producer, '')
                          ORDER BY p.producer DESC LIMIT 1)
$$;
COMMENT ON FUNCTION inbox._watermark(text, text) IS 'internal: the purge watermark that applies to a producer of a consumer';

-- Called right after a first delivery's claim row was inserted, when its produced_at is older
-- than the consumer's highest watermark. Returns NULL when the delivery may proceed; else it
-- turns the claim row (this transaction inserted it) into a hold, quarantines the delivery as
-- 'expired' and returns that result. An entry an operator released lets its next delivery through.
-- Replaces the no-op hook of sql/025_hooks.sql (revert/retention.sql puts the no-op back).
CREATE OR REPLACE FUNCTION inbox._expire_check(
    consumer text, tenant text, producer text, message_id text, payload_hash bytea, handler_version text,
    produced_at timestamptz, message_type text, payload jsonb, payload_bytes bytea, store_payload boolean)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    mark timestamptz;
    purged_max timestamptz;
    entry_id bigint;
BEGIN
    mark := inbox._watermark(_expire_check.consumer, _expire_check.producer);
    IF _expire_check.produced_at IS NULL OR mark IS NULL OR _expire_check.produced_at >= mark THEN
        RETURN NULL;
    END IF;
    -- Nothing produced after the latest produced_at a purge deleted can be a copy of a purged
    -- message, whatever the watermark says: a watermark a mistyped margin pushed ahead (before
    -- 0.3.0) does not expire traffic produced since. Rows of the producer purged under the
    -- consumer's default policy count too.
    SELECT max(s.purged_produced_max) INTO purged_max FROM inbox.purge_state s
     WHERE s.consumer = _expire_check.consumer AND s.producer IN (_expire_check.producer, '');
    IF purged_max IS NULL OR _expire_check.produced_at > purged_max THEN
        RETURN NULL;
    END IF;
    -- An operator released an expired entry of this identity: exactly one delivery goes through.
    UPDATE inbox.quarantine q SET release_used_at = now()
     WHERE q.quarantine_id = (SELECT max(r.quarantine_id) FROM inbox.quarantine r
                               WHERE r.consumer = _expire_check.consumer AND r.tenant = _expire_check.tenant
                                 AND r.producer = _expire_check.producer AND r.message_id = _expire_check.message_id
                                 AND r.kind = 'expired' AND r.status = 'released' AND r.release_used_at IS NULL);
    IF FOUND THEN
        RETURN NULL;
    END IF;
    -- The claim row this transaction just inserted becomes the hold: every later delivery of the
    -- identity meets it on the unique key and is held, whatever produced_at it carries.
    UPDATE inbox.message m
       SET status = 'quarantined', processed_at = NULL
     WHERE m.consumer = _expire_check.consumer AND m.tenant = _expire_check.tenant
       AND m.producer = _expire_check.producer AND m.message_id = _expire_check.message_id;
    INSERT INTO inbox.quarantine AS q (consumer, tenant, producer, message_id, kind, message_type, payload_sha256,
                                       payload, payload_bytes, reason_code, error_message, handler_version,
                                       recorded_by)
    VALUES (_expire_check.consumer, _expire_check.tenant, _expire_check.producer, _expire_check.message_id, 'expired',
            _expire_check.message_type, _expire_check.payload_hash,
            CASE WHEN _expire_check.store_payload THEN _expire_check.payload END,
            CASE WHEN _expire_check.store_payload THEN _expire_check.payload_bytes END,
            'expired',
            pg_catalog.format('produced at %s, before the purge watermark %s: it cannot be told apart from a purged message',
                              _expire_check.produced_at, mark),
            _expire_check.handler_version, session_user)
    ON CONFLICT ON CONSTRAINT quarantine_entry_key
    DO UPDATE SET deliveries = q.deliveries + 1, last_seen_at = now(), status = 'open', decided_at = NULL,
                  decided_by = NULL, message_type = coalesce(q.message_type, EXCLUDED.message_type),
                  recorded_by = CASE WHEN q.payload IS NULL THEN EXCLUDED.recorded_by ELSE q.recorded_by END,
                  payload = coalesce(q.payload, EXCLUDED.payload)
    RETURNING q.quarantine_id INTO entry_id;
    RETURN ROW('expired', pg_catalog.encode(_expire_check.payload_hash, 'hex'), NULL, _expire_check.handler_version,
               NULL, entry_id, NULL, 'expired',
               pg_catalog.format('produced at %s, before the purge watermark %s', _expire_check.produced_at, mark)
               )::inbox.delivery_result;
END
$$;
COMMENT ON FUNCTION inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean) IS
    'internal: quarantines a first delivery produced before its purge watermark (outcome expired), else NULL; a released entry lets one through';

-- ------------------------------------------------------------------ the purge
-- One purger per consumer: a session-level advisory lock (class 1886940770), its key derived from
-- the consumer with the database's secret (inbox._lock_key): no other session can compute it in
-- advance (one that sees it in pg_locks while a purge holds it can take it later: the purge then
-- answers 'busy', never deletes too much; docs/security.md).
CREATE OR REPLACE FUNCTION inbox._purge_lock_held(consumer text) RETURNS boolean
    LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks l
                    WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
                      AND l.classid = 1886940770::oid AND l.objid = inbox._lock_key('purge', _purge_lock_held.consumer)::oid
                      AND l.objsubid = 2 AND l.mode = 'ExclusiveLock')
$$;
COMMENT ON FUNCTION inbox._purge_lock_held(text) IS 'internal: true when this session is the purger of the consumer';

CREATE OR REPLACE FUNCTION inbox.purge_lock(consumer text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_identity('inbox.purge_lock', purge_lock.consumer, '-', '-', '');
    RETURN inbox._purge_lock_held(purge_lock.consumer)
        OR pg_catalog.pg_try_advisory_lock(1886940770, inbox._lock_key('purge', purge_lock.consumer));
END
$$;
COMMENT ON FUNCTION inbox.purge_lock(text) IS 'Become the purger of a consumer for this session: false when another session is';

CREATE OR REPLACE FUNCTION inbox.purge_unlock(consumer text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    released boolean := false;
BEGIN
    PERFORM inbox._check_identity('inbox.purge_unlock', purge_unlock.consumer, '-', '-', '');
    WHILE inbox._purge_lock_held(purge_unlock.consumer) LOOP
        released := pg_catalog.pg_advisory_unlock(1886940770, inbox._lock_key('purge', purge_unlock.consumer)) OR released;
    END LOOP;
    RETURN released;
END
$$;
COMMENT ON FUNCTION inbox.purge_unlock(text) IS 'Stop being the purger of a consumer (true when this session was)';

CREATE OR REPLACE FUNCTION inbox._check_purge_args(fn text, consumer text, producer text, batch_size integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    PERFORM inbox._check_identity(fn, consumer, '-', '-', '');
    IF pg_catalog.octet_length(producer) > 128 THEN
        RAISE EXCEPTION '%: producer is longer than 128 bytes', fn USING ERRCODE = 'string_data_right_truncation';
    END IF;
    IF batch_size IS NULL OR batch_size NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION '%: batch_size must be between 1 and 100000, got %', fn, coalesce(batch_size::text, 'NULL')
            USING ERRCODE = CASE WHEN batch_size IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'Batches of a few thousand rows keep each transaction short.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_purge_args(text, text, text, integer) IS 'internal: validates the arguments of the purge functions';

-- Step 1 of a purge: announce the new cutoff of each policy of the consumer (producer NULL: all).
-- The caller must COMMIT before purge_batch can use it. status per policy:
--   announced  the watermark moved: commit, then call purge_batch
--   unchanged  the cutoff did not move past the announced one
--   inactive   the consumer has not been active for a whole window (or is down): nothing to purge
--   no_policy  no retention policy: never purged
--   busy       another session is the consumer's purger
CREATE OR REPLACE FUNCTION inbox.announce_purge(consumer text, producer text DEFAULT NULL)
    RETURNS TABLE (policy_producer text, status text, purged_before timestamptz, watermark timestamptz, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    policy inbox.retention_policy;
    span interval;
    cutoff timestamptz;
    mark timestamptz;
    state inbox.purge_state;
BEGIN
    PERFORM inbox._check_purge_args('inbox.announce_purge', announce_purge.consumer, announce_purge.producer, 1);
    IF NOT inbox.purge_lock(announce_purge.consumer) THEN
        RETURN QUERY SELECT announce_purge.producer, 'busy'::text, NULL::timestamptz, NULL::timestamptz,
                            'another session is purging this consumer'::text;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM inbox.retention_policy p WHERE p.consumer = announce_purge.consumer
                      AND (announce_purge.producer IS NULL OR p.producer = announce_purge.producer)) THEN
        RETURN QUERY SELECT announce_purge.producer, 'no_policy'::text, NULL::timestamptz, NULL::timestamptz,
                            'no retention policy: its rows are never purged (set one with inbox.set_retention_policy)'::text;
        RETURN;
    END IF;
    FOR policy IN SELECT p.* FROM inbox.retention_policy p
                   WHERE p.consumer = announce_purge.consumer
                     AND (announce_purge.producer IS NULL OR p.producer = announce_purge.producer)
                   ORDER BY p.producer
    LOOP
        span := (inbox._retention_window(policy)).retention_window;
        cutoff := inbox._active_cutoff(policy.consumer, span);
        INSERT INTO inbox.purge_state (consumer, producer) VALUES (policy.consumer, policy.producer)
        ON CONFLICT ON CONSTRAINT purge_state_pkey DO NOTHING;
        SELECT s.* INTO state FROM inbox.purge_state s
         WHERE s.consumer = policy.consumer AND s.producer = policy.producer FOR UPDATE;
        IF cutoff IS NULL THEN
            RETURN QUERY SELECT policy.producer, 'inactive'::text, state.purged_before, state.watermark,
                pg_catalog.format('the consumer has not been active for %s yet (or is down now): nothing is old enough', span);
        ELSIF cutoff <= coalesce(state.announced_before, '-infinity') THEN
            RETURN QUERY SELECT policy.producer, 'unchanged'::text, state.purged_before, state.watermark,
                'the cutoff has not moved past the announced one'::text;
        ELSE
            -- The watermark is the cutoff: the purge deletes only rows produced before it (a row
            -- produced after its processing, by a clock ahead, waits for a later cutoff), so no
            -- margin is added and it is never ahead of the clock. It never moves back: a message
            -- purged under an earlier, higher watermark must stay older than it.
            mark := greatest(state.watermark, cutoff);
            UPDATE inbox.purge_state s
               SET announced_before = cutoff, watermark = mark, announced_at = now(),
                   announce_xid = pg_catalog.pg_current_xact_id(), waiting_for = NULL
             WHERE s.consumer = policy.consumer AND s.producer = policy.producer;
            INSERT INTO inbox.consumer_config AS c (consumer, purge_watermark)
            VALUES (policy.consumer, mark)
            ON CONFLICT ON CONSTRAINT consumer_config_pkey DO UPDATE
               SET purge_watermark = greatest(c.purge_watermark, EXCLUDED.purge_watermark);
            RETURN QUERY SELECT policy.producer, 'announced'::text, state.purged_before, mark,
                pg_catalog.format('rows processed before %s go once the transactions running now have ended', cutoff);
        END IF;
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox.announce_purge(text, text) IS
    'Purge step 1: commit the new cutoff and watermark of a consumer''s policies (announced | unchanged | inactive | no_policy | busy)';

-- The transactions of this database other than this one (their virtual transaction ids).
CREATE OR REPLACE FUNCTION inbox._running_transactions() RETURNS text[]
    LANGUAGE sql STABLE
AS $$
    SELECT coalesce(pg_catalog.array_agg(l.virtualxid ORDER BY l.virtualxid), '{}')
      FROM pg_catalog.pg_locks l
      JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
     WHERE l.locktype = 'virtualxid' AND l.mode = 'ExclusiveLock' AND l.granted
       AND a.datname = pg_catalog.current_database() AND l.pid <> pg_catalog.pg_backend_pid()
$$;
COMMENT ON FUNCTION inbox._running_transactions() IS 'internal: virtual transaction ids of the other transactions of this database';

-- Step 2, one batch: once every transaction that was running after the announcement has ended,
-- deletes at most batch_size processed rows older than the announced cutoff (all policies of the
-- consumer when producer is NULL). status per policy:
--   purged     rows were deleted (commit, call again)
--   done       nothing left below the cutoff
--   waiting    transactions from before the announcement still run (commit, wait, call again)
--   uncommitted  the announcement is not committed yet
--   no_policy, busy  as for announce_purge
-- Kept whatever their age: rows that are not 'processed', rows with a retention_hold, identities
-- with an open quarantine entry, rows produced at or after the watermark (0.3.0: the watermark
-- bounds what is deleted, and purged_produced_max records the latest produced_at deleted), rows
-- processed at or after the creation of the oldest undelivered outbox effect of the consumer or of
-- an anonymous one (the detail names that effect when it held rows back).
CREATE OR REPLACE FUNCTION inbox.purge_batch(consumer text, producer text DEFAULT NULL, batch_size integer DEFAULT 5000)
    RETURNS TABLE (policy_producer text, status text, rows_deleted bigint, purged_before timestamptz,
                   watermark timestamptz, detail text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    state inbox.purge_state;
    budget integer := purge_batch.batch_size;
    still_running text[];
    outbox_floor timestamptz;
    deleted bigint;
    reached timestamptz;
    reached_produced timestamptz;
    floor_note text;
    any_hold boolean;
    any_open_entry boolean;
    any_producer_policy boolean;
    doomed tid[];
BEGIN
    PERFORM inbox._check_purge_args('inbox.purge_batch', purge_batch.consumer, purge_batch.producer,
                                    purge_batch.batch_size);
    IF NOT inbox.purge_lock(purge_batch.consumer) THEN
        RETURN QUERY SELECT purge_batch.producer, 'busy'::text, 0::bigint, NULL::timestamptz, NULL::timestamptz,
                            'another session is purging this consumer'::text;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM inbox.retention_policy p WHERE p.consumer = purge_batch.consumer
                      AND (purge_batch.producer IS NULL OR p.producer = purge_batch.producer)) THEN
        RETURN QUERY SELECT purge_batch.producer, 'no_policy'::text, 0::bigint, NULL::timestamptz, NULL::timestamptz,
                            'no retention policy: its rows are never purged (set one with inbox.set_retention_policy)'::text;
        RETURN;
    END IF;
    -- The consumer's own undelivered effects, and those enqueued before 0.2.0 or anonymously
    -- (consumer ''): nobody else's (an effect waiting for 9999 held back every consumer in 0.1.0).
    -- Two probes of outbox_consumer_undelivered_idx.
    outbox_floor := least(
        (SELECT min(o.created_at) FROM inbox.outbox o
          WHERE o.consumer = purge_batch.consumer AND o.status IN ('pending', 'leased', 'dead')),
        (SELECT min(o.created_at) FROM inbox.outbox o
          WHERE o.consumer = '' AND o.status IN ('pending', 'leased', 'dead')));
    -- Per-row probes only when there is something to find (the OR skips them otherwise).
    any_hold := EXISTS (SELECT 1 FROM inbox.retention_hold h WHERE h.consumer = purge_batch.consumer);
    any_open_entry := EXISTS (SELECT 1 FROM inbox.quarantine q WHERE q.consumer = purge_batch.consumer AND q.status = 'open');
    any_producer_policy := EXISTS (SELECT 1 FROM inbox.retention_policy p
                                    WHERE p.consumer = purge_batch.consumer AND p.producer <> '');
    FOR state IN SELECT s.* FROM inbox.purge_state s
                  JOIN inbox.retention_policy p ON p.consumer = s.consumer AND p.producer = s.producer
                 WHERE s.consumer = purge_batch.consumer
                   AND (purge_batch.producer IS NULL OR s.producer = purge_batch.producer)
                 ORDER BY s.producer
                   FOR UPDATE OF s
    LOOP
        IF state.announced_before > coalesce(state.purged_before, '-infinity') THEN
            IF pg_catalog.pg_xact_status(state.announce_xid) IS DISTINCT FROM 'committed' THEN
                RETURN QUERY SELECT state.producer, 'uncommitted'::text, 0::bigint, state.purged_before, state.watermark,
                    'commit the announcement first, then call inbox.purge_batch again'::text;
                CONTINUE;
            END IF;
            IF state.waiting_for IS NULL THEN
                still_running := inbox._running_transactions();
            ELSE
                still_running := ARRAY(SELECT v FROM unnest(state.waiting_for) v
                                        WHERE v = ANY (inbox._running_transactions()) ORDER BY v);
            END IF;
            IF pg_catalog.cardinality(still_running) > 0 THEN
                UPDATE inbox.purge_state s SET waiting_for = still_running
                 WHERE s.consumer = state.consumer AND s.producer = state.producer;
                RETURN QUERY SELECT state.producer, 'waiting'::text, 0::bigint, state.purged_before, state.watermark,
                    pg_catalog.format('%s transaction(s) from before the announcement still running: %s',
                                      pg_catalog.cardinality(still_running),
                                      pg_catalog.array_to_string(still_running[1:5], ', '));
                CONTINUE;
            END IF;
            UPDATE inbox.purge_state s
               SET purged_before = s.announced_before, settled_at = now(), waiting_for = NULL, resume_at = NULL
             WHERE s.consumer = state.consumer AND s.producer = state.producer
            RETURNING s.* INTO state;
        END IF;
        IF state.purged_before IS NULL OR budget <= 0 THEN
            RETURN QUERY SELECT state.producer, 'done'::text, 0::bigint, state.purged_before, state.watermark,
                CASE WHEN state.purged_before IS NULL THEN 'no cutoff announced yet' ELSE 'batch budget used' END;
            CONTINUE;
        END IF;
        -- Two statements. The first locks a batch, oldest first from where the previous batch
        -- stopped (SKIP LOCKED: a row someone holds a lock on is left for a later cutoff). The
        -- second runs with a new snapshot, so it sees every hold committed until then (a replay
        -- plan locks the row FOR KEY SHARE before it inserts its hold, and that lock now waits
        -- for ours): a row held meanwhile is kept. A single DELETE would not do: its re-check
        -- after waiting for a row lock uses the old snapshot and would miss the new hold.
        doomed := ARRAY(
            SELECT m.ctid FROM inbox.message m
             WHERE m.consumer = state.consumer
               AND m.processed_at >= coalesce(state.resume_at, '-infinity')
               AND (m.producer = state.producer
                    OR (state.producer = '' AND (NOT any_producer_policy OR NOT EXISTS (
                            SELECT 1 FROM inbox.retention_policy p
                             WHERE p.consumer = state.consumer AND p.producer = m.producer))))
               AND m.status = 'processed'
               AND m.processed_at < state.purged_before
               AND (m.produced_at IS NULL OR m.produced_at < state.watermark)
               AND (outbox_floor IS NULL OR m.processed_at < outbox_floor)
               AND (NOT any_hold OR NOT EXISTS (
                        SELECT 1 FROM inbox.retention_hold h
                         WHERE h.consumer = m.consumer AND h.tenant = m.tenant AND h.producer = m.producer
                           AND h.message_id = m.message_id))
               AND (NOT any_open_entry OR NOT EXISTS (
                        SELECT 1 FROM inbox.quarantine q
                         WHERE q.consumer = m.consumer AND q.tenant = m.tenant AND q.producer = m.producer
                           AND q.message_id = m.message_id AND q.status = 'open'))
             ORDER BY m.processed_at
             LIMIT budget
               FOR UPDATE OF m SKIP LOCKED);
        WITH gone AS (
            DELETE FROM inbox.message m
             WHERE m.ctid = ANY (doomed)
               AND NOT EXISTS (SELECT 1 FROM inbox.retention_hold h
                                WHERE h.consumer = m.consumer AND h.tenant = m.tenant AND h.producer = m.producer
                                  AND h.message_id = m.message_id)
            RETURNING m.processed_at, m.produced_at
        )
        SELECT count(*), max(g.processed_at), max(g.produced_at) INTO deleted, reached, reached_produced FROM gone g;
        budget := budget - deleted::integer;
        UPDATE inbox.purge_state s
           SET rows_purged = s.rows_purged + deleted, last_purge_at = now(),
               resume_at = coalesce(reached, s.resume_at),
               purged_produced_max = greatest(s.purged_produced_max, reached_produced)
         WHERE s.consumer = state.consumer AND s.producer = state.producer;
        -- Say what held rows back when nothing more goes: the oldest undelivered effect (an
        -- anonymous one holds back every consumer: inbox.configure_security(anonymous_enqueue)).
        floor_note := '';
        IF deleted = 0 AND outbox_floor IS NOT NULL AND outbox_floor < state.purged_before THEN
            SELECT pg_catalog.format('; rows processed from %s on are kept for the undelivered outbox effect %s of %s (%s)',
                                     o.created_at, quote_literal(o.effect_id),
                                     CASE WHEN o.consumer = '' THEN 'no consumer (anonymous: it holds back every consumer''s purge)'
                                          ELSE 'consumer ' || quote_literal(o.consumer) END,
                                     o.status)
              INTO floor_note
              FROM inbox.outbox o
             WHERE o.consumer IN (state.consumer, '') AND o.status IN ('pending', 'leased', 'dead')
             ORDER BY o.created_at
             LIMIT 1;
        END IF;
        RETURN QUERY SELECT state.producer, CASE WHEN deleted > 0 THEN 'purged' ELSE 'done' END, deleted,
                            state.purged_before, state.watermark,
                            pg_catalog.format('%s row(s) processed before %s deleted', deleted, state.purged_before)
                            || coalesce(floor_note, '');
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox.purge_batch(text, text, integer) IS
    'Purge step 2, one batch: delete processed rows below the settled cutoff (purged | done | waiting | uncommitted | no_policy | busy)';

-- The whole purge of a consumer, for CALL (psql, cron, pg_cron): announce, commit, wait for the
-- transactions from before the announcement (at most wait_timeout: then it raises 55P03 having
-- deleted nothing new), then batches with a commit after each, at most max_batches.
-- Must be CALLed outside an explicit transaction block (it commits).
DROP PROCEDURE IF EXISTS inbox.purge(text, text, integer, integer, interval, bigint, text);

-- The arguments of the purge procedure, checked before anything happens.
CREATE OR REPLACE FUNCTION inbox._check_purge_call(batch_size integer, max_batches integer, wait_timeout interval,
                                                   pause interval)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF batch_size IS NULL OR batch_size NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'inbox.purge: batch_size must be between 1 and 100000, got %', coalesce(batch_size::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Batches of a few thousand rows keep each transaction short.';
    END IF;
    IF max_batches IS NULL OR max_batches < 1 OR wait_timeout IS NULL OR wait_timeout < '0'::interval
       OR pause IS NULL OR pause NOT BETWEEN '0'::interval AND '1 minute'::interval THEN
        RAISE EXCEPTION 'inbox.purge: max_batches must be at least 1, wait_timeout a non-negative interval and pause between 0 and 1 minute'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_purge_call(integer, integer, interval, interval) IS 'internal: validates the arguments of inbox.purge';

-- What the announcement said for a whole consumer: busy | no_policy | inactive (every policy:
-- not active for a whole window yet, or down) | announced (something may be deleted).
CREATE OR REPLACE FUNCTION inbox._announced(statuses text[]) RETURNS text
    LANGUAGE sql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
    RETURN CASE WHEN 'busy' = ANY (statuses) THEN 'busy'
                WHEN 'no_policy' = ANY (statuses) THEN 'no_policy'
                WHEN statuses <@ ARRAY['inactive'] THEN 'inactive'
                ELSE 'announced' END;
COMMENT ON FUNCTION inbox._announced(text[]) IS 'internal: the announcement''s outcome for a consumer';

CREATE OR REPLACE FUNCTION inbox._announced_detail(status text) RETURNS text
    LANGUAGE sql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
    RETURN CASE status WHEN 'busy' THEN 'another session is purging it: nothing to do'
                       WHEN 'no_policy' THEN 'no retention policy: its rows are never purged'
                       WHEN 'inactive' THEN 'not active for a whole retention window yet: nothing is old enough'
                       ELSE status END;
COMMENT ON FUNCTION inbox._announced_detail(text) IS 'internal: what an announcement outcome means, for a notice';

-- The whole purge of one consumer, for cron, pg_cron and `pginbox purge` alike: become its purger,
-- announce and commit, then one committed batch after another (a NOTICE each, with the rows so
-- far), pausing `pause` after each. status: purged | done | busy | no_policy | inactive. Gives up
-- with 55P03 when transactions from before the announcement outlive wait_timeout (nothing more is
-- deleted). A procedure cannot pin its search_path (it commits), so every operator in it is
-- schema-qualified.
CREATE OR REPLACE PROCEDURE inbox.purge(consumer text, producer text DEFAULT NULL, batch_size integer DEFAULT 5000,
                             max_batches integer DEFAULT 1000, wait_timeout interval DEFAULT '5 minutes',
                             INOUT rows_deleted bigint DEFAULT NULL, INOUT status text DEFAULT NULL,
                             pause interval DEFAULT '0')
    LANGUAGE plpgsql
AS $$
DECLARE
    deadline timestamptz;
    batches integer := 0;
    announced text[];
    statuses text[];
    deleted bigint;
    held text;
BEGIN
    PERFORM inbox._check_purge_call(purge.batch_size, purge.max_batches, purge.wait_timeout, purge.pause);
    rows_deleted := 0;
    announced := ARRAY(SELECT a.status FROM inbox.announce_purge(purge.consumer, purge.producer) a);
    COMMIT;
    status := inbox._announced(announced);
    IF status OPERATOR(pg_catalog.<>) 'announced' THEN
        RAISE NOTICE 'inbox.purge: consumer %: %', purge.consumer, inbox._announced_detail(status);
        IF status OPERATOR(pg_catalog.<>) 'busy' THEN
            PERFORM inbox.purge_unlock(purge.consumer);
        END IF;
        RETURN;
    END IF;
    deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) purge.wait_timeout;
    LOOP
        SELECT pg_catalog.array_agg(b.status), pg_catalog.sum(b.rows_deleted)::bigint,
               pg_catalog.string_agg(b.detail, '; ') FILTER (WHERE pg_catalog.strpos(b.detail, 'undelivered outbox effect') OPERATOR(pg_catalog.>) 0)
          INTO statuses, deleted, held
          FROM inbox.purge_batch(purge.consumer, purge.producer, purge.batch_size) b;
        COMMIT;
        IF deleted OPERATOR(pg_catalog.>) 0 THEN
            rows_deleted := rows_deleted OPERATOR(pg_catalog.+) deleted;
            batches := batches OPERATOR(pg_catalog.+) 1;
            RAISE NOTICE 'inbox.purge: consumer %: batch %: % rows deleted, % so far', purge.consumer, batches,
                deleted, rows_deleted;
            EXIT WHEN batches OPERATOR(pg_catalog.>=) purge.max_batches;
            PERFORM pg_catalog.pg_sleep_for(purge.pause);
        ELSIF statuses OPERATOR(pg_catalog.&&) ARRAY['waiting', 'uncommitted'] THEN
            IF pg_catalog.clock_timestamp() OPERATOR(pg_catalog.>) deadline THEN
                PERFORM inbox.purge_unlock(purge.consumer);
                COMMIT;
                RAISE EXCEPTION 'inbox.purge: transactions from before the announcement of consumer % still run after %',
                    purge.consumer, purge.wait_timeout
                    USING ERRCODE = 'lock_not_available',
                          HINT = 'Find long transactions in pg_stat_activity (xact_start); nothing more was deleted, run the purge again later.';
            END IF;
            PERFORM pg_catalog.pg_sleep(0.05);
        ELSE
            IF held IS NOT NULL THEN
                RAISE NOTICE 'inbox.purge: consumer %: %', purge.consumer, held;
            END IF;
            EXIT;
        END IF;
    END LOOP;
    status := CASE WHEN rows_deleted OPERATOR(pg_catalog.>) 0 THEN 'purged' ELSE 'done' END;
    PERFORM inbox.purge_unlock(purge.consumer);
END
$$;
COMMENT ON PROCEDURE inbox.purge(text, text, integer, integer, interval, bigint, text, interval) IS
    'The whole purge of a consumer with a commit per batch (CALL it outside a transaction block; cron, pg_cron): purged | done | busy | no_policy | inactive';

-- ------------------------------------------------------------------ correcting a watermark
-- The audited way out of a watermark set too far ahead (by a mistyped policy, or a margin before
-- 0.3.0): moves the watermark of one policy of a consumer down to `watermark`, which must stay later
-- than the latest produced_at its purges deleted (purged_produced_max: a redelivery of anything
-- purged stays expired, as it is produced before the watermark), never up (the purge raises it). The cutoffs follow it down, so nothing processed after it
-- is deleted until a purge announces again. Fix the policy first (set_retention_policy): the next
-- announcement takes its cutoff from the policy.
CREATE OR REPLACE FUNCTION inbox.correct_watermark(consumer text, producer text, watermark timestamptz, note text)
    RETURNS inbox.purge_state
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.correct_watermark';
    state inbox.purge_state;
BEGIN
    PERFORM inbox._check_identity(fn, correct_watermark.consumer, '-', '-', '');
    PERFORM inbox._check_note(fn, correct_watermark.note);
    IF correct_watermark.producer IS NULL OR correct_watermark.watermark IS NULL THEN
        RAISE EXCEPTION '%: % must not be NULL', fn, CASE WHEN correct_watermark.producer IS NULL THEN 'producer' ELSE 'watermark' END
            USING ERRCODE = 'null_value_not_allowed', HINT = 'producer '''' is the consumer''s default policy.';
    END IF;
    IF NOT isfinite(correct_watermark.watermark) THEN
        RAISE EXCEPTION '%: watermark must be a finite time, got %', fn, correct_watermark.watermark
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s.* INTO state FROM inbox.purge_state s
     WHERE s.consumer = correct_watermark.consumer AND s.producer = correct_watermark.producer
       FOR UPDATE;
    IF NOT FOUND OR state.watermark IS NULL THEN
        RAISE EXCEPTION '%: consumer % has no purge watermark for producer %', fn,
            quote_literal(correct_watermark.consumer), quote_literal(correct_watermark.producer)
            USING ERRCODE = 'no_data_found', HINT = 'pginbox retention show lists the watermarks (inbox.retention_status).';
    END IF;
    IF correct_watermark.watermark > state.watermark THEN
        RAISE EXCEPTION '%: % is above the watermark %: only a purge raises it', fn, correct_watermark.watermark,
            state.watermark USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF correct_watermark.watermark <= state.purged_produced_max THEN
        RAISE EXCEPTION '%: % is not later than the latest produced_at the purge deleted (%)', fn,
            correct_watermark.watermark, state.purged_produced_max
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = 'A redelivery of a purged message produced at or after the new watermark would be applied again.',
                  HINT = pg_catalog.format('Pass a watermark later than %s.', state.purged_produced_max);
    END IF;
    INSERT INTO inbox.watermark_change (consumer, producer, previous_watermark, watermark, purged_produced_max, note)
    VALUES (state.consumer, state.producer, state.watermark, correct_watermark.watermark, state.purged_produced_max,
            correct_watermark.note);
    UPDATE inbox.purge_state s
       SET watermark = correct_watermark.watermark,
           announced_before = least(s.announced_before, correct_watermark.watermark),
           purged_before = least(s.purged_before, correct_watermark.watermark),
           waiting_for = NULL, resume_at = NULL
     WHERE s.consumer = state.consumer AND s.producer = state.producer
    RETURNING s.* INTO state;
    UPDATE inbox.consumer_config c
       SET purge_watermark = (SELECT max(s.watermark) FROM inbox.purge_state s WHERE s.consumer = c.consumer)
     WHERE c.consumer = state.consumer;
    RETURN state;
END
$$;
COMMENT ON FUNCTION inbox.correct_watermark(text, text, timestamptz, text) IS
    'Move a purge watermark down (kept later than what the purge deleted, never up), audited in inbox.watermark_change';

-- ------------------------------------------------------------------ status
CREATE OR REPLACE VIEW inbox.retention_status AS
SELECT p.consumer, p.producer, w.retention_window, w.dominating_scenario,
       s.watermark, s.purged_before, s.announced_before, s.last_purge_at, coalesce(s.rows_purged, 0) AS rows_purged,
       CASE WHEN s.purged_before IS NOT NULL
            THEN greatest(inbox._active_cutoff(p.consumer, w.retention_window) - s.purged_before, '0'::interval)
       END AS purge_lag,
       coalesce((SELECT sum(q.deliveries) FROM inbox.quarantine q
                  WHERE q.consumer = p.consumer AND q.kind = 'expired'
                    AND (q.producer = p.producer
                         OR (p.producer = '' AND NOT EXISTS (SELECT 1 FROM inbox.retention_policy o
                                                              WHERE o.consumer = p.consumer AND o.producer = q.producer)))),
                0)::bigint AS expired_total,
       c.last_active_at
  FROM inbox.retention_policy p
 CROSS JOIN LATERAL inbox._retention_window(p) w
  LEFT JOIN inbox.purge_state s ON s.consumer = p.consumer AND s.producer = p.producer
  LEFT JOIN inbox.consumer_config c ON c.consumer = p.consumer;
COMMENT ON VIEW inbox.retention_status IS
    'Per consumer and policy producer: window, dominating scenario, watermark, last purge, rows purged, purge lag, expired deliveries';
GRANT SELECT ON inbox.retention_status TO inbox_reader, inbox_operator;

REVOKE ALL ON FUNCTION inbox.retention_window(text, text),
    inbox.set_retention_policy(text, text, interval, interval, interval, interval, interval, interval, interval,
                               interval, text),
    inbox.purge_lock(text), inbox.purge_unlock(text), inbox.announce_purge(text, text),
    inbox.purge_batch(text, text, integer), inbox.correct_watermark(text, text, timestamptz, text) FROM PUBLIC;
REVOKE ALL ON PROCEDURE inbox.purge(text, text, integer, integer, interval, bigint, text, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.retention_window(text, text), inbox._retention_window(inbox.retention_policy),
    inbox._active_cutoff(text, interval) TO inbox_reader, inbox_operator;
GRANT EXECUTE ON FUNCTION
    inbox.set_retention_policy(text, text, interval, interval, interval, interval, interval, interval, interval,
                               interval, text),
    inbox.purge_lock(text), inbox.purge_unlock(text), inbox.announce_purge(text, text),
    inbox.purge_batch(text, text, integer), inbox.correct_watermark(text, text, timestamptz, text) TO inbox_operator;
GRANT EXECUTE ON PROCEDURE inbox.purge(text, text, integer, integer, interval, bigint, text, interval) TO inbox_operator;
GRANT EXECUTE ON FUNCTION inbox._check_purge_call(integer, integer, interval, interval), inbox._announced(text[]),
    inbox._announced_detail(text) TO inbox_operator;

COMMIT;
