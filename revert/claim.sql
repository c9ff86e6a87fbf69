-- Revert pginbox:claim to @v0.2.0: the released functions again (deploy/claim@v0.2.0.sql), then the functions this version added.
-- pginbox: the claim. inbox.claim takes a message identity inside the caller's transaction; the
-- caller then makes its domain change and both commit or roll back together. Failures and crash
-- loops are recorded here too, because quarantine is decided on the same identity.
-- Every function acting under a consumer name first asks whether session_user may act as it
-- (sql/027_security.sql). Reworked in 0.2.0 (docs/releasing.md).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

-- This version's _claim_core took three more arguments: the released one is created again below.
DROP FUNCTION IF EXISTS inbox._claim_core(text, text, text, text, bytea, text, timestamptz, jsonb, bytea, boolean,
                                          text, timestamptz, boolean);

-- The semantic hash: SHA-256 of jsonb's canonical text (key order and whitespace normalised),
-- with the named top-level keys of an object left out. Number scale is not normalised: 1.0 and
-- 1.00 hash differently.
-- It runs on every claim, so it must be inlined by the planner: hence not STRICT (a strict body
-- with a CASE is never inlined) and STABLE, like convert_to (an immutable function calling a
-- stable one is not inlined either). NULL in, NULL out all the same.
CREATE OR REPLACE FUNCTION inbox.payload_hash(payload jsonb, exclude_keys text[] DEFAULT '{}') RETURNS bytea
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN pg_catalog.sha256(pg_catalog.convert_to(
        (CASE WHEN pg_catalog.cardinality(exclude_keys) OPERATOR(pg_catalog.>) 0
                   AND pg_catalog.jsonb_typeof(payload) OPERATOR(pg_catalog.=) 'object'
              THEN payload OPERATOR(pg_catalog.-) exclude_keys
              ELSE payload END)::text,
        'UTF8'));
COMMENT ON FUNCTION inbox.payload_hash(jsonb, text[]) IS 'SHA-256 of the canonical payload text, without the excluded top-level keys';

-- Rejects a bad identity before anything is written. fn names the public function in messages.
-- True for a string made only of whitespace (and for ''). Inlined; operators schema-qualified.
CREATE OR REPLACE FUNCTION inbox._blank(value text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_catalog.btrim(value, E' \t\n\r\f\x0b') OPERATOR(pg_catalog.=) '';
COMMENT ON FUNCTION inbox._blank(text) IS 'internal: true for an empty or whitespace-only string';

CREATE OR REPLACE FUNCTION inbox._check_identity(fn text, consumer text, producer text, message_id text, tenant text)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF consumer IS NULL OR producer IS NULL OR message_id IS NULL OR tenant IS NULL THEN
        RAISE EXCEPTION '%: % must not be NULL', fn,
            CASE WHEN consumer IS NULL THEN 'consumer' WHEN producer IS NULL THEN 'producer'
                 WHEN message_id IS NULL THEN 'message_id' ELSE 'tenant' END
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = CASE WHEN message_id IS NULL THEN 'Pass the producer-assigned id of the message.'
                              WHEN tenant IS NULL THEN 'Use tenant '''' when message ids are global.'
                              ELSE 'consumer and producer name who applies and who sent the message.' END;
    END IF;
    IF consumer = '' OR producer = '' OR message_id = '' THEN
        RAISE EXCEPTION '%: % must not be empty', fn,
            CASE WHEN consumer = '' THEN 'consumer' WHEN producer = '' THEN 'producer' ELSE 'message_id' END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'An empty id cannot tell one message from another.';
    END IF;
    IF inbox._blank(consumer) OR inbox._blank(producer) OR inbox._blank(message_id)
       OR (tenant <> '' AND inbox._blank(tenant)) THEN
        RAISE EXCEPTION '%: % must not be only whitespace', fn,
            CASE WHEN inbox._blank(consumer) THEN 'consumer' WHEN inbox._blank(producer) THEN 'producer'
                 WHEN inbox._blank(message_id) THEN 'message_id' ELSE 'tenant' END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A blank name is almost always a bug in the producer or the consumer''s mapping.';
    END IF;
    IF pg_catalog.octet_length(consumer) > 128 OR pg_catalog.octet_length(producer) > 128
       OR pg_catalog.octet_length(tenant) > 128 THEN
        RAISE EXCEPTION '%: % is longer than 128 bytes', fn,
            CASE WHEN pg_catalog.octet_length(consumer) > 128 THEN 'consumer'
                 WHEN pg_catalog.octet_length(producer) > 128 THEN 'producer' ELSE 'tenant' END
            USING ERRCODE = 'string_data_right_truncation',
                  HINT = 'consumer, producer and tenant are names: keep them to 128 bytes.';
    END IF;
    IF pg_catalog.octet_length(message_id) > 256 THEN
        RAISE EXCEPTION '%: message_id is % bytes long, the limit is 256', fn, pg_catalog.octet_length(message_id)
            USING ERRCODE = 'string_data_right_truncation',
                  HINT = 'Use the producer''s event or command id, not the payload, as message_id.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_identity(text, text, text, text, text) IS 'internal: validates an identity (22004, 22023, 22001)';

-- The fast checks of the hot paths: inlined by the planner into one boolean expression. Only when
-- one says no does the caller run the _check_* function, which names what is wrong.
CREATE OR REPLACE FUNCTION inbox._identity_ok(consumer text, producer text, message_id text, tenant text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN NOT inbox._blank(consumer) AND NOT inbox._blank(producer) AND NOT inbox._blank(message_id)
       AND (tenant OPERATOR(pg_catalog.=) '' OR NOT inbox._blank(tenant))
       AND pg_catalog.octet_length(consumer) OPERATOR(pg_catalog.<=) 128
       AND pg_catalog.octet_length(producer) OPERATOR(pg_catalog.<=) 128
       AND pg_catalog.octet_length(tenant) OPERATOR(pg_catalog.<=) 128
       AND pg_catalog.octet_length(message_id) OPERATOR(pg_catalog.<=) 256;
COMMENT ON FUNCTION inbox._identity_ok(text, text, text, text) IS 'internal: true when inbox._check_identity would accept the identity';

-- The settings of a consumer that has no row: the column defaults of inbox.consumer_config
-- (a pgTAP test keeps the two in step).
CREATE OR REPLACE FUNCTION inbox._default_settings(consumer text) RETURNS inbox.consumer_config
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN ROW(consumer, '{}'::text[], 5, true, 1048576, NULL::timestamptz, NULL::text, NULL::timestamptz,
               NULL::timestamptz)::inbox.consumer_config;
COMMENT ON FUNCTION inbox._default_settings(text) IS 'internal: settings of an unconfigured consumer';

CREATE OR REPLACE FUNCTION inbox._settings(consumer text) RETURNS inbox.consumer_config
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    settings inbox.consumer_config;
BEGIN
    SELECT c.* INTO settings FROM inbox.consumer_config c WHERE c.consumer = _settings.consumer;
    IF NOT FOUND THEN
        settings := inbox._default_settings(_settings.consumer);
    END IF;
    RETURN settings;
END
$$;
COMMENT ON FUNCTION inbox._settings(text) IS 'internal: a consumer''s settings, defaults when unconfigured';

-- Rejects a bad payload or handler version before anything is written. _delivery_ok is the fast,
-- inlined check of the hot paths; _check_delivery names what is wrong.
CREATE OR REPLACE FUNCTION inbox._delivery_ok(payload_size integer, max_payload_bytes integer, handler_version text)
    RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN payload_size OPERATOR(pg_catalog.<=) max_payload_bytes AND NOT inbox._blank(handler_version)
       AND pg_catalog.octet_length(handler_version) OPERATOR(pg_catalog.<=) 128;
COMMENT ON FUNCTION inbox._delivery_ok(integer, integer, text) IS 'internal: true when inbox._check_delivery would accept the delivery';

CREATE OR REPLACE FUNCTION inbox._check_delivery(fn text, payload_size integer, max_payload_bytes integer, handler_version text)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF payload_size IS NULL THEN
        RAISE EXCEPTION '%: payload must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the message body; use ''{}''::jsonb for a message without one.';
    END IF;
    IF payload_size > max_payload_bytes THEN
        RAISE EXCEPTION '%: payload is % bytes, the consumer''s limit is % bytes', fn, payload_size, max_payload_bytes
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Store large bodies elsewhere and send a reference, or raise max_payload_bytes with inbox.configure_consumer.';
    END IF;
    IF handler_version IS NOT NULL AND handler_version <> '' AND inbox._blank(handler_version) THEN
        RAISE EXCEPTION '%: handler_version must not be only whitespace', fn
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Name the version of the code that applies the message, e.g. ''v1'' or a git sha.';
    END IF;
    IF handler_version IS NULL OR handler_version = '' THEN
        RAISE EXCEPTION '%: handler_version must not be NULL or empty', fn
            USING ERRCODE = CASE WHEN handler_version IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'Name the version of the code that applies the message, e.g. ''v1'' or a git sha.';
    END IF;
    IF pg_catalog.octet_length(handler_version) > 128 THEN
        RAISE EXCEPTION '%: handler_version is longer than 128 bytes', fn
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_delivery(text, integer, integer, text) IS 'internal: validates payload size and handler version (22004, 54000, 22023, 22001)';

-- The size a payload is held to: the length of its JSON text. pg_column_size would be the stored
-- size, compressed for a value read from a table, so a large body could pass a small limit.
CREATE OR REPLACE FUNCTION inbox._payload_size(payload jsonb) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_catalog.octet_length(payload::text);
COMMENT ON FUNCTION inbox._payload_size(jsonb) IS 'internal: the size a payload limit applies to (bytes of its JSON text)';

-- How far ahead of the database clock a produced_at may be when no retention policy names a
-- safety margin. The purge's watermark covers at least this much (sql/075_retention.sql).
CREATE OR REPLACE FUNCTION inbox._default_clock_tolerance() RETURNS interval
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN '5 minutes'::interval;
COMMENT ON FUNCTION inbox._default_clock_tolerance() IS 'internal: produced_at tolerance without a retention policy (5 minutes)';

-- A produced_at ahead of the database clock by more than the consumer's retention safety margin
-- (or 5 minutes without a policy) is refused before anything is written: once purged, a message
-- "from the future" would be newer than every watermark and apply again on its next redelivery.
-- Called only when produced_at > now(), so the happy path pays nothing.
CREATE OR REPLACE FUNCTION inbox._check_produced_at(fn text, consumer text, producer text, produced_at timestamptz)
    RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    tolerance interval;
BEGIN
    IF _check_produced_at.produced_at IS NULL OR _check_produced_at.produced_at <= now() THEN
        RETURN;
    END IF;
    SELECT p.safety_margin INTO tolerance
      FROM inbox.retention_policy p
     WHERE p.consumer = _check_produced_at.consumer AND p.producer IN (_check_produced_at.producer, '')
     ORDER BY p.producer DESC
     LIMIT 1;
    tolerance := coalesce(tolerance, inbox._default_clock_tolerance());
    IF _check_produced_at.produced_at > now() + tolerance THEN
        RAISE EXCEPTION '%: produced_at % is ahead of the database clock (%) by more than %', fn,
            _check_produced_at.produced_at, now(), tolerance
            USING ERRCODE = 'datetime_field_overflow',
                  DETAIL = 'Once purged, a message from the future would be newer than every purge watermark and be applied again.',
                  HINT = 'Fix the producer''s clock, pass produced_at => NULL (no watermark protection), or raise the retention policy''s safety_margin.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_produced_at(text, text, text, timestamptz) IS
    'internal: refuses a produced_at ahead of the database clock by more than the safety margin (22008)';

-- The claim itself. INSERT ... ON CONFLICT DO NOTHING on the identity: the unique key, not a
-- prior SELECT, decides who owns first processing. At READ COMMITTED a concurrent claimer waits
-- for the first one to commit (then sees it) or abort (then claims). At REPEATABLE READ and above
-- PostgreSQL raises 40001 instead: the caller retries the whole transaction and sees a duplicate.
CREATE OR REPLACE FUNCTION inbox._claim_core(
    consumer text, tenant text, producer text, message_id text, payload_hash bytea, handler_version text,
    produced_at timestamptz, payload jsonb, payload_bytes bytea, store_payload boolean)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    result inbox.delivery_result;
    existing inbox.message;
BEGIN
    result.payload_sha256 := pg_catalog.encode(payload_hash, 'hex');
    -- A purge may delete the existing row between our INSERT and our SELECT: then try again.
    FOR round IN 1..3 LOOP
        INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,
                                   produced_at, processed_at)
        VALUES (_claim_core.consumer, _claim_core.tenant, _claim_core.producer, _claim_core.message_id,
                _claim_core.payload_hash, _claim_core.handler_version, _claim_core.produced_at, now())
        ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;
        IF FOUND THEN
            -- A first delivery (also after a purge deleted the row we conflicted with): check the
            -- purge watermark (sql/075_retention.sql).
            IF _claim_core.produced_at IS NOT NULL THEN
                result := coalesce(inbox._expire_check(_claim_core.consumer, _claim_core.tenant, _claim_core.producer,
                                                       _claim_core.message_id, _claim_core.payload_hash,
                                                       _claim_core.handler_version, _claim_core.produced_at, NULL,
                                                       _claim_core.payload, _claim_core.payload_bytes,
                                                       _claim_core.store_payload), result);
                IF result.outcome IS NOT NULL THEN
                    RETURN result;
                END IF;
            END IF;
            result.outcome := 'claimed';
            result.handler_version := _claim_core.handler_version;
            result.processed_at := now();
            RETURN result;
        END IF;
        SELECT m.* INTO existing
          FROM inbox.message m
         WHERE m.consumer = _claim_core.consumer AND m.tenant = _claim_core.tenant
           AND m.producer = _claim_core.producer AND m.message_id = _claim_core.message_id;
        EXIT WHEN FOUND;
    END LOOP;
    IF existing.consumer IS NULL THEN
        RAISE EXCEPTION 'inbox.claim: the identity kept disappearing under a concurrent purge'
            USING ERRCODE = 'serialization_failure', HINT = 'Retry the transaction.';
    END IF;

    -- A hold announced by record_start without a payload has no hash: report NULL, not ''.
    result.stored_sha256 := pg_catalog.encode(nullif(existing.payload_sha256, '\x'::bytea), 'hex');
    result.handler_version := existing.handler_version;
    result.processed_at := existing.processed_at;

    IF existing.status = 'discarded'
       OR (existing.status = 'processed' AND existing.payload_sha256 = _claim_core.payload_hash) THEN
        result.outcome := 'duplicate';
        -- Metrics (sql/095_metrics.sql): one appended event row, no counter row shared with anyone.
        PERFORM inbox._count_duplicate(_claim_core.consumer, _claim_core.producer);
        RETURN result;
    END IF;

    IF existing.status = 'processed' THEN
        -- Same identity, different payload: the producer broke its contract. Record both hashes.
        INSERT INTO inbox.quarantine AS q (consumer, tenant, producer, message_id, kind, payload_sha256,
                                           stored_sha256, payload, payload_bytes, reason_code, error_message,
                                           handler_version, recorded_by)
        VALUES (_claim_core.consumer, _claim_core.tenant, _claim_core.producer, _claim_core.message_id, 'conflict',
                _claim_core.payload_hash, existing.payload_sha256,
                CASE WHEN _claim_core.store_payload THEN _claim_core.payload END,
                CASE WHEN _claim_core.store_payload THEN _claim_core.payload_bytes END,
                'identity_conflict',
                pg_catalog.format('message id was processed with payload hash %s; this delivery has %s',
                                  pg_catalog.encode(existing.payload_sha256, 'hex'), result.payload_sha256),
                existing.handler_version, session_user)
        ON CONFLICT ON CONSTRAINT quarantine_entry_key
        DO UPDATE SET deliveries = q.deliveries + 1, last_seen_at = now()
        RETURNING q.quarantine_id INTO result.quarantine_id;
        result.outcome := 'conflict';
        result.reason_code := 'identity_conflict';
        RETURN result;
    END IF;

    -- Held by quarantine (exhausted attempts, or an expired delivery): count the delivery on the
    -- open entry, run nothing. A held expired delivery stays 'expired' whatever its produced_at.
    UPDATE inbox.quarantine q
       SET deliveries = q.deliveries + 1, last_seen_at = now()
     WHERE q.quarantine_id = (
            SELECT max(o.quarantine_id) FROM inbox.quarantine o
             WHERE o.consumer = _claim_core.consumer AND o.tenant = _claim_core.tenant
               AND o.producer = _claim_core.producer AND o.message_id = _claim_core.message_id
               AND o.kind IN ('failure', 'expired') AND o.status = 'open')
    RETURNING q.quarantine_id, q.attempts, q.reason_code
         INTO result.quarantine_id, result.attempts, result.reason_code;
    result.outcome := CASE WHEN result.reason_code = 'expired' THEN 'expired' ELSE 'quarantined' END;
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox._claim_core(text, text, text, text, bytea, text, timestamptz, jsonb, bytea, boolean) IS 'internal: the claim on a validated, hashed delivery';

CREATE OR REPLACE FUNCTION inbox.claim(
    consumer text, producer text, message_id text, payload jsonb, handler_version text DEFAULT 'unversioned',
    tenant text DEFAULT '', produced_at timestamptz DEFAULT NULL)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lookup record;
    settings inbox.consumer_config;
    hash bytea;
    expired inbox.delivery_result;
BEGIN
    IF inbox._identity_ok(claim.consumer, claim.producer, claim.message_id, claim.tenant) IS NOT TRUE THEN
        PERFORM inbox._check_identity('inbox.claim', claim.consumer, claim.producer, claim.message_id, claim.tenant);
    END IF;
    -- One query: may the caller act as the consumer (inbox._acting_as, inlined), and its settings.
    SELECT a.allowed, c AS settings INTO lookup
      FROM inbox._acting_as(claim.consumer, claim.tenant) a
      LEFT JOIN inbox.consumer_config c ON c.consumer = claim.consumer;
    IF lookup.allowed IS NOT TRUE THEN
        PERFORM inbox._authorize('inbox.claim', claim.consumer, claim.tenant);
    END IF;
    IF claim.produced_at > now() THEN
        PERFORM inbox._check_produced_at('inbox.claim', claim.consumer, claim.producer, claim.produced_at);
    END IF;
    settings := lookup.settings;
    IF settings IS NULL THEN
        settings := inbox._default_settings(claim.consumer);
    END IF;
    IF inbox._delivery_ok(inbox._payload_size(claim.payload), settings.max_payload_bytes, claim.handler_version)
       IS NOT TRUE THEN
        PERFORM inbox._check_delivery('inbox.claim', inbox._payload_size(claim.payload), settings.max_payload_bytes,
                                      claim.handler_version);
    END IF;
    -- The consumer this transaction claims for: inbox.enqueue_effect enqueues under it by default.
    PERFORM pg_catalog.set_config('inbox.consumer', claim.consumer, true);
    hash := inbox.payload_hash(claim.payload, settings.hash_exclude_keys);
    -- Retention's heartbeat (sql/075_retention.sql), at most once a minute per consumer.
    IF settings.last_active_at IS NULL OR settings.last_active_at < now() - '60 seconds'::interval THEN
        PERFORM inbox._heartbeat(claim.consumer);
    END IF;
    -- The first delivery, inline: it is the path every message takes once.
    INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,
                               produced_at, processed_at)
    VALUES (claim.consumer, claim.tenant, claim.producer, claim.message_id, hash, claim.handler_version,
            claim.produced_at, now())
    ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;
    IF FOUND THEN
        -- Produced before the purge watermark: maybe purged already, so expired, not new.
        IF claim.produced_at < settings.purge_watermark THEN
            expired := inbox._expire_check(claim.consumer, claim.tenant, claim.producer, claim.message_id, hash,
                                           claim.handler_version, claim.produced_at, NULL, claim.payload, NULL,
                                           settings.store_payloads);
            IF expired.outcome IS NOT NULL THEN
                RETURN expired;
            END IF;
        END IF;
        RETURN ROW('claimed', pg_catalog.encode(hash, 'hex'), NULL, claim.handler_version, now(), NULL, NULL, NULL,
                   NULL)::inbox.delivery_result;
    END IF;
    RETURN inbox._claim_core(claim.consumer, claim.tenant, claim.producer, claim.message_id, hash,
                             claim.handler_version, claim.produced_at, claim.payload, NULL, settings.store_payloads);
END
$$;
COMMENT ON FUNCTION inbox.claim(text, text, text, jsonb, text, text, timestamptz) IS
    'Claim a message identity in the caller''s transaction: claimed | duplicate | conflict | quarantined';

CREATE OR REPLACE FUNCTION inbox.claim_bytea(
    consumer text, producer text, message_id text, payload bytea, handler_version text DEFAULT 'unversioned',
    tenant text DEFAULT '', produced_at timestamptz DEFAULT NULL)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    settings inbox.consumer_config;
BEGIN
    PERFORM inbox._check_identity('inbox.claim_bytea', claim_bytea.consumer, claim_bytea.producer,
                                  claim_bytea.message_id, claim_bytea.tenant);
    PERFORM inbox._authorize('inbox.claim_bytea', claim_bytea.consumer, claim_bytea.tenant);
    PERFORM inbox._check_produced_at('inbox.claim_bytea', claim_bytea.consumer, claim_bytea.producer,
                                     claim_bytea.produced_at);
    settings := inbox._settings(claim_bytea.consumer);
    PERFORM pg_catalog.set_config('inbox.consumer', claim_bytea.consumer, true);
    PERFORM inbox._check_delivery('inbox.claim_bytea', octet_length(claim_bytea.payload),
                                  settings.max_payload_bytes, claim_bytea.handler_version);
    IF settings.last_active_at IS NULL OR settings.last_active_at < now() - '60 seconds'::interval THEN
        PERFORM inbox._heartbeat(claim_bytea.consumer);
    END IF;
    RETURN inbox._claim_core(claim_bytea.consumer, claim_bytea.tenant, claim_bytea.producer, claim_bytea.message_id,
                             sha256(claim_bytea.payload), claim_bytea.handler_version, claim_bytea.produced_at,
                             NULL, claim_bytea.payload, settings.store_payloads);
END
$$;
COMMENT ON FUNCTION inbox.claim_bytea(text, text, text, bytea, text, text, timestamptz) IS
    'inbox.claim for payloads that are not JSON: the hash is SHA-256 of the raw bytes';

-- Moves an identity into quarantine for exhausted attempts. The placeholder row in inbox.message
-- makes every later claim of the identity answer 'quarantined' through the same unique key.
-- An identity has at most one open failure entry: when it is held already (a concurrent failure,
-- or redeliveries announced after the hold), the open entry is updated, never doubled.
-- Returns NULL when the identity was meanwhile processed or discarded: nothing to hold then.
CREATE OR REPLACE FUNCTION inbox._quarantine_failure(
    attempt inbox.attempt, reason_code text, error_message text, crashes integer,
    payload jsonb, payload_ref text, store_payload boolean)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    entry_id bigint;
BEGIN
    INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, status)
    VALUES (attempt.consumer, attempt.tenant, attempt.producer, attempt.message_id,
            coalesce(attempt.payload_sha256, '\x'::bytea), coalesce(attempt.handler_version, 'unversioned'),
            'quarantined')
    ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;
    IF NOT FOUND THEN
        IF NOT EXISTS (
            SELECT 1 FROM inbox.message m
             WHERE m.consumer = attempt.consumer AND m.tenant = attempt.tenant AND m.producer = attempt.producer
               AND m.message_id = attempt.message_id AND m.status = 'quarantined') THEN
            RETURN NULL;
        END IF;
        -- Held already: count on the open entry, keep its reason and payload.
        UPDATE inbox.quarantine q
           SET deliveries = q.deliveries + 1, last_seen_at = now(),
               attempts = greatest(q.attempts, attempt.failed), crashes = greatest(q.crashes, _quarantine_failure.crashes),
               last_failure_at = coalesce(attempt.last_failure_at, q.last_failure_at)
         WHERE q.quarantine_id = (
                SELECT max(o.quarantine_id) FROM inbox.quarantine o
                 WHERE o.consumer = attempt.consumer AND o.tenant = attempt.tenant AND o.producer = attempt.producer
                   AND o.message_id = attempt.message_id AND o.kind IN ('failure', 'expired') AND o.status = 'open')
        RETURNING q.quarantine_id INTO entry_id;
        IF FOUND THEN
            RETURN entry_id;
        END IF;
    END IF;

    INSERT INTO inbox.quarantine AS q (consumer, tenant, producer, message_id, kind, message_type, payload_sha256,
                                       payload, payload_ref, reason_code, error_message, attempts, crashes,
                                       first_failure_at, last_failure_at, handler_version, recorded_by)
    VALUES (attempt.consumer, attempt.tenant, attempt.producer, attempt.message_id, 'failure', attempt.message_type,
            attempt.payload_sha256, CASE WHEN store_payload THEN payload END, payload_ref,
            _quarantine_failure.reason_code, _quarantine_failure.error_message, attempt.failed,
            _quarantine_failure.crashes, attempt.first_failure_at, attempt.last_failure_at,
            coalesce(attempt.handler_version, 'unversioned'), session_user)
    ON CONFLICT ON CONSTRAINT quarantine_entry_key DO UPDATE
       SET status = 'open', deliveries = q.deliveries + 1, last_seen_at = now(),
           reason_code = EXCLUDED.reason_code, error_message = EXCLUDED.error_message,
           attempts = EXCLUDED.attempts, crashes = EXCLUDED.crashes,
           first_failure_at = coalesce(q.first_failure_at, EXCLUDED.first_failure_at),
           last_failure_at = EXCLUDED.last_failure_at, handler_version = EXCLUDED.handler_version,
           message_type = coalesce(EXCLUDED.message_type, q.message_type),
           payload = coalesce(EXCLUDED.payload, q.payload), payload_ref = coalesce(EXCLUDED.payload_ref, q.payload_ref),
           recorded_by = CASE WHEN EXCLUDED.payload IS NOT NULL THEN EXCLUDED.recorded_by ELSE q.recorded_by END,
           decided_at = NULL, decided_by = NULL
    RETURNING q.quarantine_id INTO entry_id;
    RETURN entry_id;
END
$$;
COMMENT ON FUNCTION inbox._quarantine_failure(inbox.attempt, text, text, integer, jsonb, text, boolean) IS 'internal: holds an identity in quarantine after exhausted attempts';

-- A 'quarantined' result names what the identity is held for: the entry's reason and message,
-- which a later failure or announced redelivery does not change.
CREATE OR REPLACE FUNCTION inbox._held_by(result inbox.delivery_result) RETURNS inbox.delivery_result
    LANGUAGE plpgsql STABLE
AS $$
BEGIN
    SELECT q.reason_code, q.error_message, q.attempts INTO result.reason_code, result.error_message, result.attempts
      FROM inbox.quarantine q WHERE q.quarantine_id = result.quarantine_id;
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox._held_by(inbox.delivery_result) IS 'internal: fills a quarantined result from its entry';

-- Records a permanent failure outside the rolled-back work; quarantines at max_attempts.
CREATE OR REPLACE FUNCTION inbox._record_failure_core(
    settings inbox.consumer_config, tenant text, producer text, message_id text, message_type text,
    payload jsonb, payload_hash bytea, payload_ref text, reason_code text, error_message text, handler_version text)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    result inbox.delivery_result;
    att inbox.attempt;
BEGIN
    INSERT INTO inbox.attempt AS a (consumer, tenant, producer, message_id, failed, first_failure_at, last_failure_at,
                                    reason_code, error_message, handler_version, message_type, payload_sha256)
    VALUES (settings.consumer, _record_failure_core.tenant, _record_failure_core.producer,
            _record_failure_core.message_id, 1, now(), now(), _record_failure_core.reason_code,
            _record_failure_core.error_message, _record_failure_core.handler_version,
            _record_failure_core.message_type, _record_failure_core.payload_hash)
    ON CONFLICT ON CONSTRAINT attempt_pkey DO UPDATE
       SET failed = a.failed + 1,
           first_failure_at = coalesce(a.first_failure_at, EXCLUDED.first_failure_at),
           last_failure_at = EXCLUDED.last_failure_at, reason_code = EXCLUDED.reason_code,
           error_message = EXCLUDED.error_message, handler_version = EXCLUDED.handler_version,
           message_type = coalesce(EXCLUDED.message_type, a.message_type),
           payload_sha256 = coalesce(EXCLUDED.payload_sha256, a.payload_sha256)
    RETURNING a.* INTO att;

    result.outcome := 'failed';
    result.payload_sha256 := pg_catalog.encode(_record_failure_core.payload_hash, 'hex');
    result.handler_version := _record_failure_core.handler_version;
    result.attempts := att.failed;
    result.reason_code := _record_failure_core.reason_code;
    result.error_message := _record_failure_core.error_message;
    IF att.failed >= settings.max_attempts THEN
        -- Attempts so far: the first delivery plus each announced redelivery; the ones that
        -- recorded no failure crashed.
        result.quarantine_id := inbox._quarantine_failure(
            att, _record_failure_core.reason_code, _record_failure_core.error_message,
            greatest(1 + att.started - att.failed, 0), _record_failure_core.payload,
            _record_failure_core.payload_ref, settings.store_payloads);
        IF result.quarantine_id IS NOT NULL THEN
            result.outcome := 'quarantined';
            result := inbox._held_by(result);
        END IF;
    END IF;
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox._record_failure_core(inbox.consumer_config, text, text, text, text, jsonb, bytea, text, text, text, text) IS 'internal: records a failed attempt, quarantines at max_attempts';

CREATE OR REPLACE FUNCTION inbox._check_reason(fn text, reason_code text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF reason_code IS NULL OR reason_code = '' OR pg_catalog.octet_length(reason_code) > 64 THEN
        RAISE EXCEPTION '%: reason_code must be a stable code of 1 to 64 bytes, got %', fn,
            coalesce(pg_catalog.quote_literal(reason_code), 'NULL')
            USING ERRCODE = CASE WHEN reason_code IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'Use the SQLSTATE or your handler''s own code (e.g. ''invalid_account''), not the error text.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_reason(text, text) IS 'internal: validates a failure reason code';

-- The reason code of a handler error: the constraint it names (a violated named constraint, or
-- RAISE ... USING CONSTRAINT = 'my_code') when that is a valid code, else its SQLSTATE.
CREATE OR REPLACE FUNCTION inbox._reason_code(sqlstate text, constraint_name text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN pg_catalog.octet_length(constraint_name) OPERATOR(pg_catalog.>=) 1
                     AND pg_catalog.octet_length(constraint_name) OPERATOR(pg_catalog.<=) 64
                THEN constraint_name ELSE sqlstate END;
COMMENT ON FUNCTION inbox._reason_code(text, text) IS 'internal: reason code of a handler error (constraint name or SQLSTATE)';

-- The optional fields of record_failure / record_start.
CREATE OR REPLACE FUNCTION inbox._check_optional(fn text, message_type text, payload_ref text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF message_type IS NOT NULL AND (message_type !~ '\S' OR pg_catalog.octet_length(message_type) > 128) THEN
        RAISE EXCEPTION '%: message_type must be NULL or a name of 1 to 128 bytes, not only whitespace', fn
            USING ERRCODE = CASE WHEN message_type !~ '\S' THEN 'invalid_parameter_value'
                                 ELSE 'string_data_right_truncation' END;
    END IF;
    IF pg_catalog.octet_length(payload_ref) > 1024 THEN
        RAISE EXCEPTION '%: payload_ref is longer than 1024 bytes', fn
            USING ERRCODE = 'string_data_right_truncation',
                  HINT = 'A payload_ref points to where the payload is kept (a URL or a key), it is not the payload.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_optional(text, text, text) IS 'internal: validates message_type and payload_ref of record_failure / record_start';

-- For clients that run handlers outside SQL: after rolling back the failed attempt, record it in
-- a new transaction. payload may be NULL when the body cannot be represented as jsonb.
CREATE OR REPLACE FUNCTION inbox.record_failure(
    consumer text, producer text, message_id text, payload jsonb, reason_code text,
    error_message text DEFAULT NULL, handler_version text DEFAULT 'unversioned', tenant text DEFAULT '',
    message_type text DEFAULT NULL, payload_ref text DEFAULT NULL)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    settings inbox.consumer_config;
BEGIN
    PERFORM inbox._check_identity('inbox.record_failure', record_failure.consumer, record_failure.producer,
                                  record_failure.message_id, record_failure.tenant);
    PERFORM inbox._check_reason('inbox.record_failure', record_failure.reason_code);
    PERFORM inbox._check_optional('inbox.record_failure', record_failure.message_type, record_failure.payload_ref);
    PERFORM inbox._authorize('inbox.record_failure', record_failure.consumer, record_failure.tenant);
    settings := inbox._settings(record_failure.consumer);
    PERFORM inbox._check_delivery('inbox.record_failure', coalesce(inbox._payload_size(record_failure.payload), 0),
                                  settings.max_payload_bytes, record_failure.handler_version);
    RETURN inbox._record_failure_core(
        settings, record_failure.tenant, record_failure.producer, record_failure.message_id,
        record_failure.message_type, record_failure.payload,
        inbox.payload_hash(record_failure.payload, settings.hash_exclude_keys), record_failure.payload_ref,
        record_failure.reason_code, left(record_failure.error_message, 2000), record_failure.handler_version);
END
$$;
COMMENT ON FUNCTION inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text) IS
    'Record a permanent failure after the attempt rolled back: failed | quarantined (at max_attempts)';

-- Crash loops: a handler that kills its process never records its failure. A consumer calls this
-- in its own committed transaction when the broker flags a delivery as a redelivery, before it
-- processes it. Attempts so far = the first delivery + each announced redelivery; once they reach
-- max_attempts the identity is quarantined and the delivery must not be processed.
-- First deliveries never call it, so the happy path pays nothing.
CREATE OR REPLACE FUNCTION inbox.record_start(
    consumer text, producer text, message_id text, tenant text DEFAULT '', message_type text DEFAULT NULL,
    payload jsonb DEFAULT NULL, handler_version text DEFAULT 'unversioned', payload_ref text DEFAULT NULL)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    settings inbox.consumer_config;
    att inbox.attempt;
    hash bytea;
    result inbox.delivery_result;
BEGIN
    PERFORM inbox._check_identity('inbox.record_start', record_start.consumer, record_start.producer,
                                  record_start.message_id, record_start.tenant);
    PERFORM inbox._check_optional('inbox.record_start', record_start.message_type, record_start.payload_ref);
    PERFORM inbox._authorize('inbox.record_start', record_start.consumer, record_start.tenant);
    settings := inbox._settings(record_start.consumer);
    PERFORM inbox._check_delivery('inbox.record_start', coalesce(inbox._payload_size(record_start.payload), 0),
                                  settings.max_payload_bytes, record_start.handler_version);
    hash := inbox.payload_hash(record_start.payload, settings.hash_exclude_keys);

    INSERT INTO inbox.attempt AS a (consumer, tenant, producer, message_id, started, last_started_at,
                                    handler_version, message_type, payload_sha256)
    VALUES (record_start.consumer, record_start.tenant, record_start.producer, record_start.message_id, 1, now(),
            record_start.handler_version, record_start.message_type, hash)
    ON CONFLICT ON CONSTRAINT attempt_pkey DO UPDATE
       SET started = a.started + 1, last_started_at = EXCLUDED.last_started_at,
           message_type = coalesce(EXCLUDED.message_type, a.message_type),
           payload_sha256 = coalesce(EXCLUDED.payload_sha256, a.payload_sha256)
    RETURNING a.* INTO att;

    result.outcome := 'proceed';
    result.payload_sha256 := pg_catalog.encode(hash, 'hex');
    result.handler_version := record_start.handler_version;
    -- Attempts so far: the first delivery plus each announced redelivery before this one.
    result.attempts := att.started;
    -- Below max_attempts failures (else the identity is quarantined already), so at least one of
    -- the attempts so far ended without recording anything: a crash.
    IF att.started >= settings.max_attempts THEN
        result.reason_code := 'crash_loop';
        result.error_message := pg_catalog.format(
            '%s attempts so far, %s recorded a failure: the others ended without a word (the consumer probably crashed)',
            att.started, att.failed);
        result.quarantine_id := inbox._quarantine_failure(
            att, 'crash_loop', result.error_message, greatest(att.started - att.failed, 0), record_start.payload,
            record_start.payload_ref, settings.store_payloads);
        IF result.quarantine_id IS NOT NULL THEN
            result.outcome := 'quarantined';
            result := inbox._held_by(result);
        ELSE
            -- Processed or discarded meanwhile: nothing to hold, the claim will say duplicate.
            result.reason_code := NULL;
            result.error_message := NULL;
        END IF;
    END IF;
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox.record_start(text, text, text, text, text, jsonb, text, text) IS
    'Announce a redelivered attempt in its own transaction: proceed | quarantined (crash loop)';

-- Per-consumer settings. An argument left out (or NULL) keeps the consumer's current value (the
-- default for a new consumer). Changing hash_exclude_keys after messages were processed would turn
-- their redeliveries into conflicts, so it needs allow_hash_change => true (or a new consumer name).
CREATE OR REPLACE FUNCTION inbox.configure_consumer(
    consumer text, hash_exclude_keys text[] DEFAULT NULL, max_attempts integer DEFAULT NULL,
    store_payloads boolean DEFAULT NULL, max_payload_bytes integer DEFAULT NULL,
    allow_hash_change boolean DEFAULT false)
    RETURNS inbox.consumer_config
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    previous inbox.consumer_config;
    wanted inbox.consumer_config;
    saved inbox.consumer_config;
BEGIN
    PERFORM inbox._check_identity('inbox.configure_consumer', configure_consumer.consumer, '-', '-', '');
    IF allow_hash_change IS NULL THEN
        RAISE EXCEPTION 'inbox.configure_consumer: allow_hash_change must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    previous := inbox._settings(configure_consumer.consumer);
    wanted := previous;
    -- Stored as a sorted set: the order and repetition of keys do not matter to the hash.
    wanted.hash_exclude_keys := coalesce(
        (SELECT array_agg(DISTINCT k ORDER BY k) FROM unnest(configure_consumer.hash_exclude_keys) k),
        CASE WHEN configure_consumer.hash_exclude_keys IS NULL THEN previous.hash_exclude_keys ELSE '{}' END);
    wanted.max_attempts := coalesce(configure_consumer.max_attempts, previous.max_attempts);
    wanted.store_payloads := coalesce(configure_consumer.store_payloads, previous.store_payloads);
    wanted.max_payload_bytes := coalesce(configure_consumer.max_payload_bytes, previous.max_payload_bytes);

    IF array_position(wanted.hash_exclude_keys, NULL) IS NOT NULL OR '' = ANY (wanted.hash_exclude_keys) THEN
        RAISE EXCEPTION 'inbox.configure_consumer: hash_exclude_keys must not contain NULL or empty keys'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF wanted.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'inbox.configure_consumer: max_attempts must be between 1 and 1000, got %', wanted.max_attempts
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF wanted.max_payload_bytes NOT BETWEEN 1 AND 104857600 THEN
        RAISE EXCEPTION 'inbox.configure_consumer: max_payload_bytes must be between 1 and 104857600, got %',
            wanted.max_payload_bytes USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT allow_hash_change
       AND (SELECT array_agg(DISTINCT k ORDER BY k) FROM unnest(previous.hash_exclude_keys) k)
           IS DISTINCT FROM (SELECT array_agg(DISTINCT k ORDER BY k) FROM unnest(wanted.hash_exclude_keys) k)
       AND EXISTS (SELECT 1 FROM inbox.message m WHERE m.consumer = configure_consumer.consumer) THEN
        RAISE EXCEPTION 'inbox.configure_consumer: consumer % already processed messages under other hash_exclude_keys',
            configure_consumer.consumer
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = 'Their redeliveries would hash differently and be quarantined as conflicts.',
                  HINT = 'Use a new consumer name, or pass allow_hash_change => true if you accept that.';
    END IF;

    INSERT INTO inbox.consumer_config AS c (consumer, hash_exclude_keys, max_attempts, store_payloads,
                                            max_payload_bytes)
    VALUES (configure_consumer.consumer, wanted.hash_exclude_keys, wanted.max_attempts, wanted.store_payloads,
            wanted.max_payload_bytes)
    ON CONFLICT ON CONSTRAINT consumer_config_pkey DO UPDATE
       SET hash_exclude_keys = EXCLUDED.hash_exclude_keys, max_attempts = EXCLUDED.max_attempts,
           store_payloads = EXCLUDED.store_payloads, max_payload_bytes = EXCLUDED.max_payload_bytes,
           updated_at = now(), updated_by = session_user
    RETURNING c.* INTO saved;
    RETURN saved;
END
$$;
COMMENT ON FUNCTION inbox.configure_consumer(text, text[], integer, boolean, integer, boolean) IS
    'Set a consumer''s hash exclusions, attempt limit, payload storage and payload size limit';

REVOKE ALL ON FUNCTION inbox.claim(text, text, text, jsonb, text, text, timestamptz),
    inbox.claim_bytea(text, text, text, bytea, text, text, timestamptz),
    inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text),
    inbox.record_start(text, text, text, text, text, jsonb, text, text),
    inbox.configure_consumer(text, text[], integer, boolean, integer, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.claim(text, text, text, jsonb, text, text, timestamptz),
    inbox.claim_bytea(text, text, text, bytea, text, text, timestamptz),
    inbox.record_failure(text, text, text, jsonb, text, text, text, text, text, text),
    inbox.record_start(text, text, text, text, text, jsonb, text, text) TO inbox_consumer;
GRANT EXECUTE ON FUNCTION inbox.configure_consumer(text, text[], integer, boolean, integer, boolean) TO inbox_operator;
GRANT EXECUTE ON FUNCTION inbox.payload_hash(jsonb, text[]) TO inbox_consumer, inbox_operator;
-- Readers see no payload hashes (0.2.0), so they get no hash function to guess payloads with either.
REVOKE EXECUTE ON FUNCTION inbox.payload_hash(jsonb, text[]) FROM inbox_reader;
GRANT EXECUTE ON FUNCTION inbox._reason_code(text, text) TO inbox_consumer, inbox_operator;
GRANT EXECUTE ON FUNCTION inbox._blank(text) TO inbox_consumer, inbox_operator;

-- This version granted the identity rule's accept test to consumers (inbox._check_identity calls it).
REVOKE EXECUTE ON FUNCTION inbox._identity_ok(text, text, text, text) FROM inbox_consumer;
DROP FUNCTION inbox._identity_problem(text, text, text, text), inbox._delivery_problem(integer, integer, text),
    inbox._raise_problem(text, text[]);
DROP FUNCTION inbox._has_control(text), inbox._name_ok(text);

COMMIT;
