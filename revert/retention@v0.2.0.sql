-- Revert pginbox:retention to @v0.1.0: the released functions again (deploy/retention@v0.1.0.sql),
-- then the functions this version added.
-- Deploy pginbox:retention. Generated from sql/075_retention.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: retention's functions (tables in 070_retention_tables.sql).
BEGIN;

SET LOCAL ROLE inbox_owner;

-- ------------------------------------------------------------------ the window
CREATE OR REPLACE FUNCTION inbox._retention_window(policy inbox.retention_policy,
                                        OUT retention_window interval, OUT dominating_scenario text)
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
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
                                       purged_before, settled_at)
        SELECT s.consumer, policy.producer, s.announced_before, s.watermark, s.announced_at, s.announce_xid,
               s.purged_before, s.settled_at
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
        ELSIF pg_catalog.pg_try_advisory_xact_lock(1886940771, pg_catalog.hashtext(_heartbeat.consumer)) THEN
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
-- deletes the claim row again (this transaction inserted it), quarantines the delivery as
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
    entry_id bigint;
BEGIN
    mark := inbox._watermark(_expire_check.consumer, _expire_check.producer);
    IF _expire_check.produced_at IS NULL OR mark IS NULL OR _expire_check.produced_at >= mark THEN
        RETURN NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM inbox.quarantine q
                WHERE q.consumer = _expire_check.consumer AND q.tenant = _expire_check.tenant
                  AND q.producer = _expire_check.producer AND q.message_id = _expire_check.message_id
                  AND q.kind = 'expired' AND q.status = 'released') THEN
        RETURN NULL;
    END IF;
    DELETE FROM inbox.message m
     WHERE m.consumer = _expire_check.consumer AND m.tenant = _expire_check.tenant
       AND m.producer = _expire_check.producer AND m.message_id = _expire_check.message_id;
    INSERT INTO inbox.quarantine AS q (consumer, tenant, producer, message_id, kind, message_type, payload_sha256,
                                       payload, payload_bytes, reason_code, error_message, handler_version)
    VALUES (_expire_check.consumer, _expire_check.tenant, _expire_check.producer, _expire_check.message_id, 'expired',
            _expire_check.message_type, _expire_check.payload_hash,
            CASE WHEN _expire_check.store_payload THEN _expire_check.payload END,
            CASE WHEN _expire_check.store_payload THEN _expire_check.payload_bytes END,
            'expired',
            pg_catalog.format('produced at %s, before the purge watermark %s: it cannot be told apart from a purged message',
                              _expire_check.produced_at, mark),
            _expire_check.handler_version)
    ON CONFLICT ON CONSTRAINT quarantine_entry_key
    DO UPDATE SET deliveries = q.deliveries + 1, last_seen_at = now(),
                  message_type = coalesce(q.message_type, EXCLUDED.message_type),
                  payload = coalesce(q.payload, EXCLUDED.payload)
    RETURNING q.quarantine_id INTO entry_id;
    RETURN ROW('expired', pg_catalog.encode(_expire_check.payload_hash, 'hex'), NULL, _expire_check.handler_version,
               NULL, entry_id, NULL, 'expired',
               pg_catalog.format('produced at %s, before the purge watermark %s', _expire_check.produced_at, mark)
               )::inbox.delivery_result;
END
$$;
COMMENT ON FUNCTION inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean) IS
    'internal: quarantines a first delivery produced before its purge watermark (outcome expired), else NULL';

-- ------------------------------------------------------------------ the purge
-- One purger per consumer: a session-level advisory lock (class 1886940770, hashtext(consumer)).
CREATE OR REPLACE FUNCTION inbox._purge_lock_held(consumer text) RETURNS boolean
    LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks l
                    WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
                      AND l.classid = 1886940770::oid AND l.objid = pg_catalog.hashtext(_purge_lock_held.consumer)::oid
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
        OR pg_catalog.pg_try_advisory_lock(1886940770, pg_catalog.hashtext(purge_lock.consumer));
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
        released := pg_catalog.pg_advisory_unlock(1886940770, pg_catalog.hashtext(purge_unlock.consumer)) OR released;
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
            UPDATE inbox.purge_state s
               SET announced_before = cutoff, watermark = cutoff + policy.safety_margin, announced_at = now(),
                   announce_xid = pg_catalog.pg_current_xact_id(), waiting_for = NULL
             WHERE s.consumer = policy.consumer AND s.producer = policy.producer;
            INSERT INTO inbox.consumer_config AS c (consumer, purge_watermark)
            VALUES (policy.consumer, cutoff + policy.safety_margin)
            ON CONFLICT ON CONSTRAINT consumer_config_pkey DO UPDATE
               SET purge_watermark = greatest(c.purge_watermark, EXCLUDED.purge_watermark);
            RETURN QUERY SELECT policy.producer, 'announced'::text, state.purged_before, cutoff + policy.safety_margin,
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
-- with an open quarantine entry, rows processed at or after the creation of the oldest outbox
-- effect not delivered yet.
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
    SELECT min(o.created_at) INTO outbox_floor FROM inbox.outbox o WHERE o.status IN ('pending', 'leased', 'dead');
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
            RETURNING m.processed_at
        )
        SELECT count(*), max(g.processed_at) INTO deleted, reached FROM gone g;
        budget := budget - deleted::integer;
        UPDATE inbox.purge_state s
           SET rows_purged = s.rows_purged + deleted, last_purge_at = now(),
               resume_at = coalesce(reached, s.resume_at)
         WHERE s.consumer = state.consumer AND s.producer = state.producer;
        RETURN QUERY SELECT state.producer, CASE WHEN deleted > 0 THEN 'purged' ELSE 'done' END, deleted,
                            state.purged_before, state.watermark,
                            pg_catalog.format('%s row(s) processed before %s deleted', deleted, state.purged_before);
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox.purge_batch(text, text, integer) IS
    'Purge step 2, one batch: delete processed rows below the settled cutoff (purged | done | waiting | uncommitted | no_policy | busy)';

-- The whole purge of a consumer, for CALL (psql, cron, pg_cron): announce, commit, wait for the
-- transactions from before the announcement (at most wait_timeout: then it raises 55P03 having
-- deleted nothing new), then batches with a commit after each, at most max_batches.
-- Must be CALLed outside an explicit transaction block (it commits).
CREATE OR REPLACE PROCEDURE inbox.purge(consumer text, producer text DEFAULT NULL, batch_size integer DEFAULT 5000,
                             max_batches integer DEFAULT 1000, wait_timeout interval DEFAULT '5 minutes',
                             INOUT rows_deleted bigint DEFAULT NULL, INOUT status text DEFAULT NULL)
    LANGUAGE plpgsql
AS $$
DECLARE
    deadline timestamptz;
    batches integer := 0;
    waiting boolean;
    progressed boolean;
    step record;
BEGIN
    IF purge.batch_size IS NULL OR purge.batch_size NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'inbox.purge: batch_size must be between 1 and 100000, got %', coalesce(purge.batch_size::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Batches of a few thousand rows keep each transaction short.';
    END IF;
    IF purge.max_batches IS NULL OR purge.max_batches < 1 OR purge.wait_timeout IS NULL
       OR purge.wait_timeout < '0'::interval THEN
        RAISE EXCEPTION 'inbox.purge: max_batches must be at least 1 and wait_timeout a non-negative interval'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    rows_deleted := 0;
    IF NOT inbox.purge_lock(purge.consumer) THEN
        status := 'busy';
        RAISE NOTICE 'inbox.purge: another session is purging consumer %: nothing to do', purge.consumer;
        RETURN;
    END IF;
    status := 'done';
    FOR step IN SELECT * FROM inbox.announce_purge(purge.consumer, purge.producer) LOOP
        IF step.status = 'no_policy' THEN
            status := 'no_policy';
            RAISE NOTICE 'inbox.purge: consumer % has no retention policy: its rows are never purged', purge.consumer;
        END IF;
    END LOOP;
    COMMIT;
    IF status = 'no_policy' THEN
        PERFORM inbox.purge_unlock(purge.consumer);
        RETURN;
    END IF;
    deadline := clock_timestamp() + purge.wait_timeout;
    LOOP
        waiting := false;
        progressed := false;
        FOR step IN SELECT * FROM inbox.purge_batch(purge.consumer, purge.producer, purge.batch_size) LOOP
            waiting := waiting OR step.status IN ('waiting', 'uncommitted');
            progressed := progressed OR step.status = 'purged';
            rows_deleted := rows_deleted + step.rows_deleted;
        END LOOP;
        COMMIT;
        IF progressed THEN
            batches := batches + 1;
            EXIT WHEN batches >= purge.max_batches;
        ELSIF waiting THEN
            IF clock_timestamp() > deadline THEN
                PERFORM inbox.purge_unlock(purge.consumer);
                COMMIT;
                RAISE EXCEPTION 'inbox.purge: transactions from before the announcement of consumer % still run after %',
                    purge.consumer, purge.wait_timeout
                    USING ERRCODE = 'lock_not_available',
                          HINT = 'Find long transactions in pg_stat_activity (xact_start); nothing more was deleted, run the purge again later.';
            END IF;
            PERFORM pg_catalog.pg_sleep(0.05);
        ELSE
            EXIT;
        END IF;
    END LOOP;
    status := CASE WHEN rows_deleted > 0 THEN 'purged' ELSE 'done' END;
    PERFORM inbox.purge_unlock(purge.consumer);
END
$$;
COMMENT ON PROCEDURE inbox.purge(text, text, integer, integer, interval, bigint, text) IS
    'The whole purge of a consumer with a commit per batch (CALL it outside a transaction block; cron, pg_cron)';

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
    inbox.purge_batch(text, text, integer) FROM PUBLIC;
REVOKE ALL ON PROCEDURE inbox.purge(text, text, integer, integer, interval, bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.retention_window(text, text), inbox._retention_window(inbox.retention_policy),
    inbox._active_cutoff(text, interval) TO inbox_reader, inbox_operator;
GRANT EXECUTE ON FUNCTION
    inbox.set_retention_policy(text, text, interval, interval, interval, interval, interval, interval, interval,
                               interval, text),
    inbox.purge_lock(text), inbox.purge_unlock(text), inbox.announce_purge(text, text),
    inbox.purge_batch(text, text, integer) TO inbox_operator;
GRANT EXECUTE ON PROCEDURE inbox.purge(text, text, integer, integer, interval, bigint, text) TO inbox_operator;

DROP PROCEDURE inbox.purge(text, text, integer, integer, interval, bigint, text, interval);
DROP FUNCTION inbox._announced_detail(text);
DROP FUNCTION inbox._announced(text[]);
DROP FUNCTION inbox._check_purge_call(integer, integer, interval, interval);

COMMIT;
