-- pginbox: the claim. inbox.claim takes a message identity inside the caller's transaction; the
-- caller then makes its domain change and both commit or roll back together. Failures and crash
-- loops are recorded here too, because quarantine is decided on the same identity.
-- Every function acting under a consumer name first asks whether the caller may act as it
-- (sql/027_security.sql). Reworked in 0.3.0 (docs/releasing.md).
-- Every delivery path (claim, claim_bytea, claim_and_apply's _begin_apply, the batches'
-- _begin_apply_batch, record_start, record_failure) makes the checks it needs in one order,
-- before it writes:
-- identity (inbox._identity_ok / _check_identity), may the caller act as the consumer
-- (inbox._authorize), produced_at (_check_produced_at), delivery (_delivery_ok / _check_delivery)
-- under the consumer's settings, then the consumer setting (set_config) and the retention
-- heartbeat; claim_and_apply and the batches check their handler after produced_at, before the
-- delivery (whose version is the handler's). The single paths set the consumer setting in the
-- query that authorizes: a later check that refuses raises, which takes the setting back. Each
-- path evaluates the inlined accept tests and calls the raising function only when one says no;
-- the batch asks each rule of the whole batch, and its error names the first element at fault.
-- Each path writes the sequence out: the single paths fold authorization and settings into one
-- query, and a shared PL/pgSQL step costs every claim (docs/performance.md, "One claim core" and
-- "The pre-checks in the claim core too"). The claim itself, the identity's INSERT and the
-- decision on an existing row, is inbox._claim_core on every single path; the batch makes one
-- set-based INSERT and decides the rows it met there.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

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

-- True for a string made only of whitespace (and for ''). Inlined; operators schema-qualified.
CREATE OR REPLACE FUNCTION inbox._blank(value text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_catalog.btrim(value, E' \t\n\r\f\x0b') OPERATOR(pg_catalog.=) '';
COMMENT ON FUNCTION inbox._blank(text) IS 'internal: true for an empty or whitespace-only string';

-- True for a string holding a control character (C0, DEL or C1): a name or id that would reach a
-- terminal or a log line raw (escape sequences, forged line breaks). Inlined.
CREATE OR REPLACE FUNCTION inbox._has_control(value text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN value OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f-\x9f]';
COMMENT ON FUNCTION inbox._has_control(text) IS 'internal: true for a string with a control character (C0, DEL, C1)';

-- The accept tests' shape of a name: no control character and not blank, in one regular
-- expression (a character that is neither a control character nor a space; every other character
-- btrim would take off a blank name is a control character). _blank and _has_control say which of
-- the two a refused name breaks. One function in the accept tests instead of three: PL/pgSQL builds
-- an inlined test's expression again in every transaction, one ACL check per function in it
-- (docs/performance.md, "One claim core"). Inlined.
CREATE OR REPLACE FUNCTION inbox._name_ok(value text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN value OPERATOR(pg_catalog.~) '^[^\x01-\x1f\x7f-\x9f]*[^\x01-\x20\x7f-\x9f][^\x01-\x1f\x7f-\x9f]*$';
COMMENT ON FUNCTION inbox._name_ok(text) IS 'internal: true for a string with a character other than a space and no control character';

-- Each validation rule is a pair of inlined SQL functions, side by side: _x_ok, the accept test
-- that the hot paths and the batch evaluate (the planner inlines it into their expression), and
-- _x_problem, which starts from that test and otherwise names the first fault in the rule's order
-- as {SQLSTATE, message, hint}. inbox._raise_problem raises a fault; the _check_x functions
-- (validate, raise if wrong) are that call. The hot paths never evaluate _x_problem: PL/pgSQL
-- prepares each simple expression again in every transaction, at a cost that grows with the
-- expression (docs/performance.md, "Validation rules").
-- Operators schema-qualified: an inlined body runs inside the caller's expression.
CREATE OR REPLACE FUNCTION inbox._raise_problem(fn text, problem text[]) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF problem IS NULL THEN
        RETURN;
    ELSIF problem[3] IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = problem[1], MESSAGE = fn || ': ' || problem[2];
    ELSE
        RAISE EXCEPTION USING ERRCODE = problem[1], MESSAGE = fn || ': ' || problem[2], HINT = problem[3];
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._raise_problem(text, text[]) IS 'internal: raises a rule''s fault {SQLSTATE, message, hint} as fn''s error';

-- The identity rule: consumer, producer, message_id and tenant (22004 NULL, 22023 empty, blank or
-- with control characters, 22001 too long).
CREATE OR REPLACE FUNCTION inbox._identity_ok(consumer text, producer text, message_id text, tenant text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN inbox._name_ok(consumer) AND inbox._name_ok(producer) AND inbox._name_ok(message_id)
       AND (tenant OPERATOR(pg_catalog.=) '' OR inbox._name_ok(tenant))
       AND GREATEST(pg_catalog.octet_length(consumer), pg_catalog.octet_length(producer),
                    pg_catalog.octet_length(tenant)) OPERATOR(pg_catalog.<=) 128
       AND pg_catalog.octet_length(message_id) OPERATOR(pg_catalog.<=) 256;
COMMENT ON FUNCTION inbox._identity_ok(text, text, text, text) IS 'internal: the identity rule''s accept test (inlined into the hot paths)';

CREATE OR REPLACE FUNCTION inbox._identity_problem(consumer text, producer text, message_id text, tenant text)
    RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE
        WHEN inbox._identity_ok(consumer, producer, message_id, tenant) THEN NULL
        WHEN consumer IS NULL
        THEN '{22004,"consumer must not be NULL","consumer and producer name who applies and who sent the message."}'
        WHEN producer IS NULL
        THEN '{22004,"producer must not be NULL","consumer and producer name who applies and who sent the message."}'
        WHEN message_id IS NULL THEN '{22004,"message_id must not be NULL","Pass the producer-assigned id of the message."}'
        WHEN tenant IS NULL THEN '{22004,"tenant must not be NULL","Use tenant '''' when message ids are global."}'
        WHEN consumer OPERATOR(pg_catalog.=) ''
        THEN '{22023,"consumer must not be empty","An empty id cannot tell one message from another."}'
        WHEN producer OPERATOR(pg_catalog.=) ''
        THEN '{22023,"producer must not be empty","An empty id cannot tell one message from another."}'
        WHEN message_id OPERATOR(pg_catalog.=) ''
        THEN '{22023,"message_id must not be empty","An empty id cannot tell one message from another."}'
        WHEN inbox._blank(consumer)
        THEN '{22023,"consumer must not be only whitespace","A blank name is almost always a bug in the producer or the consumer''s mapping."}'
        WHEN inbox._blank(producer)
        THEN '{22023,"producer must not be only whitespace","A blank name is almost always a bug in the producer or the consumer''s mapping."}'
        WHEN inbox._blank(message_id)
        THEN '{22023,"message_id must not be only whitespace","A blank name is almost always a bug in the producer or the consumer''s mapping."}'
        WHEN tenant OPERATOR(pg_catalog.<>) '' AND inbox._blank(tenant)
        THEN '{22023,"tenant must not be only whitespace","A blank name is almost always a bug in the producer or the consumer''s mapping."}'
        WHEN inbox._has_control(consumer OPERATOR(pg_catalog.||) producer OPERATOR(pg_catalog.||) message_id
                                OPERATOR(pg_catalog.||) tenant)
        THEN ARRAY['22023',
                   CASE WHEN inbox._has_control(consumer) THEN 'consumer' WHEN inbox._has_control(producer) THEN 'producer'
                        WHEN inbox._has_control(message_id) THEN 'message_id' ELSE 'tenant' END
                   OPERATOR(pg_catalog.||) ' must not contain control characters',
                   'Line breaks, tabs and escape sequences in a name or id would reach terminals and logs raw; use printable characters.']
        WHEN pg_catalog.octet_length(consumer) OPERATOR(pg_catalog.>) 128
        THEN '{22001,"consumer is longer than 128 bytes","consumer, producer and tenant are names: keep them to 128 bytes."}'
        WHEN pg_catalog.octet_length(producer) OPERATOR(pg_catalog.>) 128
        THEN '{22001,"producer is longer than 128 bytes","consumer, producer and tenant are names: keep them to 128 bytes."}'
        WHEN pg_catalog.octet_length(tenant) OPERATOR(pg_catalog.>) 128
        THEN '{22001,"tenant is longer than 128 bytes","consumer, producer and tenant are names: keep them to 128 bytes."}'
        WHEN pg_catalog.octet_length(message_id) OPERATOR(pg_catalog.>) 256
        THEN ARRAY['22001', 'message_id is ' OPERATOR(pg_catalog.||) pg_catalog.octet_length(message_id)::text
                            OPERATOR(pg_catalog.||) ' bytes long, the limit is 256',
                   'Use the producer''s event or command id, not the payload, as message_id.']
    END;
COMMENT ON FUNCTION inbox._identity_problem(text, text, text, text) IS
    'internal: the identity rule''s first fault {SQLSTATE, message, hint} (22004, 22023, 22001), NULL when it accepts';

CREATE OR REPLACE FUNCTION inbox._check_identity(fn text, consumer text, producer text, message_id text, tenant text)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._raise_problem(fn, inbox._identity_problem(consumer, producer, message_id, tenant));
END
$$;
COMMENT ON FUNCTION inbox._check_identity(text, text, text, text, text) IS
    'internal: raises the identity rule''s fault (inbox._identity_problem)';

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

-- The delivery rule: the payload's size within the consumer's limit, and the handler version a
-- name (22004, 54000, 22023, 22001).
CREATE OR REPLACE FUNCTION inbox._delivery_ok(payload_size integer, max_payload_bytes integer, handler_version text)
    RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN payload_size OPERATOR(pg_catalog.<=) max_payload_bytes AND inbox._name_ok(handler_version)
       AND pg_catalog.octet_length(handler_version) OPERATOR(pg_catalog.<=) 128;
COMMENT ON FUNCTION inbox._delivery_ok(integer, integer, text) IS 'internal: the delivery rule''s accept test (inlined into the hot paths)';

CREATE OR REPLACE FUNCTION inbox._delivery_problem(payload_size integer, max_payload_bytes integer, handler_version text)
    RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE
        WHEN inbox._delivery_ok(payload_size, max_payload_bytes, handler_version) THEN NULL
        WHEN payload_size IS NULL
        THEN ARRAY['22004', 'payload must not be NULL',
                   'Pass the message body; use ''{}''::jsonb for a message without one.']
        WHEN payload_size OPERATOR(pg_catalog.>) max_payload_bytes
        THEN ARRAY['54000', 'payload is ' OPERATOR(pg_catalog.||) payload_size::text
                   OPERATOR(pg_catalog.||) ' bytes, the consumer''s limit is '
                   OPERATOR(pg_catalog.||) max_payload_bytes::text OPERATOR(pg_catalog.||) ' bytes',
                   'Store large bodies elsewhere and send a reference, or raise max_payload_bytes with inbox.configure_consumer.']
        WHEN handler_version OPERATOR(pg_catalog.<>) '' AND inbox._blank(handler_version)
        THEN ARRAY['22023', 'handler_version must not be only whitespace',
                   'Name the version of the code that applies the message, e.g. ''v1'' or a git sha.']
        WHEN handler_version IS NULL OR handler_version OPERATOR(pg_catalog.=) ''
        THEN ARRAY[CASE WHEN handler_version IS NULL THEN '22004' ELSE '22023' END,
                   'handler_version must not be NULL or empty',
                   'Name the version of the code that applies the message, e.g. ''v1'' or a git sha.']
        WHEN pg_catalog.octet_length(handler_version) OPERATOR(pg_catalog.>) 128
        THEN ARRAY['22001', 'handler_version is longer than 128 bytes']
        ELSE ARRAY['22023', 'handler_version must not contain control characters',
                   'Name the version of the code that applies the message, e.g. ''v1'' or a git sha.']
    END;
COMMENT ON FUNCTION inbox._delivery_problem(integer, integer, text) IS
    'internal: the delivery rule''s first fault {SQLSTATE, message, hint} (22004, 54000, 22023, 22001), NULL when it accepts';

CREATE OR REPLACE FUNCTION inbox._check_delivery(fn text, payload_size integer, max_payload_bytes integer, handler_version text)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._raise_problem(fn, inbox._delivery_problem(payload_size, max_payload_bytes, handler_version));
END
$$;
COMMENT ON FUNCTION inbox._check_delivery(text, integer, integer, text) IS
    'internal: raises the delivery rule''s fault (inbox._delivery_problem)';

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
-- Every delivery path claims here: claim, claim_bytea and claim_and_apply's _begin_apply for every
-- delivery, and the batch for the elements its set-based INSERT met an existing row for
-- (conflicted => true: that INSERT is not made twice).
-- purge_watermark: the consumer's (its settings); a first delivery produced before it may be a
-- purged one (inbox._expire_check). message_type, purge_watermark and conflicted came in 0.3.0;
-- their defaults keep a 0.2.0 caller (apply@v0.2.0, after a revert of apply alone) as it was.
DROP FUNCTION IF EXISTS inbox._claim_core(text, text, text, text, bytea, text, timestamptz, jsonb, bytea, boolean);
CREATE OR REPLACE FUNCTION inbox._claim_core(
    consumer text, tenant text, producer text, message_id text, payload_hash bytea, handler_version text,
    produced_at timestamptz, payload jsonb, payload_bytes bytea, store_payload boolean,
    message_type text DEFAULT NULL, purge_watermark timestamptz DEFAULT 'infinity', conflicted boolean DEFAULT false)
    RETURNS inbox.delivery_result
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    result inbox.delivery_result;
    existing inbox.message;
BEGIN
    -- A purge may delete the existing row between our INSERT and our SELECT: then try again.
    -- conflicted: the batch's own INSERT of this row met an existing one just now: look it up first.
    FOR round IN 1..3 LOOP
        IF round > 1 OR NOT _claim_core.conflicted THEN
            INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,
                                       produced_at, processed_at)
            VALUES (_claim_core.consumer, _claim_core.tenant, _claim_core.producer, _claim_core.message_id,
                    _claim_core.payload_hash, _claim_core.handler_version, _claim_core.produced_at, now())
            ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;
            IF FOUND THEN
                -- A first delivery (also after a purge deleted the row we conflicted with). Produced
                -- before the purge watermark: maybe purged already, so expired, not new
                -- (sql/075_retention.sql).
                IF _claim_core.produced_at < _claim_core.purge_watermark THEN
                    result := inbox._expire_check(_claim_core.consumer, _claim_core.tenant, _claim_core.producer,
                                                  _claim_core.message_id, _claim_core.payload_hash,
                                                  _claim_core.handler_version, _claim_core.produced_at,
                                                  _claim_core.message_type, _claim_core.payload,
                                                  _claim_core.payload_bytes, _claim_core.store_payload);
                    IF result.outcome IS NOT NULL THEN
                        RETURN result;
                    END IF;
                END IF;
                -- The path every message takes once: one expression, no field assignments.
                RETURN ROW('claimed', pg_catalog.encode(_claim_core.payload_hash, 'hex'), NULL, _claim_core.handler_version,
                           now(), NULL, NULL, NULL, NULL)::inbox.delivery_result;
            END IF;
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
    result.payload_sha256 := pg_catalog.encode(_claim_core.payload_hash, 'hex');

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
COMMENT ON FUNCTION inbox._claim_core(text, text, text, text, bytea, text, timestamptz, jsonb, bytea, boolean, text, timestamptz, boolean) IS
    'internal: the claim on a validated, hashed delivery: claimed, duplicate, conflict, quarantined or expired';

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
BEGIN
    IF inbox._identity_ok(claim.consumer, claim.producer, claim.message_id, claim.tenant) IS NOT TRUE THEN
        PERFORM inbox._check_identity('inbox.claim', claim.consumer, claim.producer, claim.message_id, claim.tenant);
    END IF;
    -- One query: may the caller act as the consumer (inbox._acting_as, inlined), its settings, and
    -- the consumer and tenant this transaction claims for: inbox.enqueue_effect enqueues under them
    -- by default (it checks the caller may act as them: the settings only choose). Set here, not by
    -- a statement of their own after the checks (each PERFORM is a query); a check that refuses
    -- raises, and the error takes them back with the (sub)transaction.
    SELECT a.allowed, c AS settings, pg_catalog.set_config('inbox.consumer', claim.consumer, true) AS consumer_set,
           pg_catalog.set_config('inbox.tenant', claim.tenant, true) AS tenant_set
      INTO lookup
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
    hash := inbox.payload_hash(claim.payload, settings.hash_exclude_keys);
    -- Retention's heartbeat (sql/075_retention.sql), at most once a minute per consumer.
    IF settings.last_active_at IS NULL OR settings.last_active_at < now() - '60 seconds'::interval THEN
        PERFORM inbox._heartbeat(claim.consumer);
    END IF;
    -- The claim, as on every delivery path (inbox._claim_core).
    RETURN inbox._claim_core(claim.consumer, claim.tenant, claim.producer, claim.message_id, hash,
                             claim.handler_version, claim.produced_at, claim.payload, NULL, settings.store_payloads,
                             NULL, settings.purge_watermark);
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
    lookup record;
    settings inbox.consumer_config;
BEGIN
    -- The pre-checks of inbox.claim: the inlined accept tests, the raising functions when one says no.
    IF inbox._identity_ok(claim_bytea.consumer, claim_bytea.producer, claim_bytea.message_id, claim_bytea.tenant)
       IS NOT TRUE THEN
        PERFORM inbox._check_identity('inbox.claim_bytea', claim_bytea.consumer, claim_bytea.producer,
                                      claim_bytea.message_id, claim_bytea.tenant);
    END IF;
    -- One query: may the caller act as the consumer, its settings, the consumer and tenant claimed
    -- for (as in inbox.claim).
    SELECT a.allowed, c AS settings,
           pg_catalog.set_config('inbox.consumer', claim_bytea.consumer, true) AS consumer_set,
           pg_catalog.set_config('inbox.tenant', claim_bytea.tenant, true) AS tenant_set
      INTO lookup
      FROM inbox._acting_as(claim_bytea.consumer, claim_bytea.tenant) a
      LEFT JOIN inbox.consumer_config c ON c.consumer = claim_bytea.consumer;
    IF lookup.allowed IS NOT TRUE THEN
        PERFORM inbox._authorize('inbox.claim_bytea', claim_bytea.consumer, claim_bytea.tenant);
    END IF;
    IF claim_bytea.produced_at > now() THEN
        PERFORM inbox._check_produced_at('inbox.claim_bytea', claim_bytea.consumer, claim_bytea.producer,
                                         claim_bytea.produced_at);
    END IF;
    settings := lookup.settings;
    IF settings IS NULL THEN
        settings := inbox._default_settings(claim_bytea.consumer);
    END IF;
    IF inbox._delivery_ok(pg_catalog.octet_length(claim_bytea.payload), settings.max_payload_bytes,
                          claim_bytea.handler_version) IS NOT TRUE THEN
        PERFORM inbox._check_delivery('inbox.claim_bytea', pg_catalog.octet_length(claim_bytea.payload),
                                      settings.max_payload_bytes, claim_bytea.handler_version);
    END IF;
    -- Retention's heartbeat (sql/075_retention.sql), at most once a minute per consumer.
    IF settings.last_active_at IS NULL OR settings.last_active_at < now() - '60 seconds'::interval THEN
        PERFORM inbox._heartbeat(claim_bytea.consumer);
    END IF;
    RETURN inbox._claim_core(claim_bytea.consumer, claim_bytea.tenant, claim_bytea.producer, claim_bytea.message_id,
                             pg_catalog.sha256(claim_bytea.payload), claim_bytea.handler_version,
                             claim_bytea.produced_at, NULL, claim_bytea.payload, settings.store_payloads, NULL,
                             settings.purge_watermark);
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
    IF reason_code IS NULL OR reason_code = '' OR pg_catalog.octet_length(reason_code) > 64 OR inbox._has_control(reason_code) THEN
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
    IF message_type IS NOT NULL AND (message_type !~ '\S' OR pg_catalog.octet_length(message_type) > 128
                                     OR inbox._has_control(message_type)) THEN
        RAISE EXCEPTION '%: message_type must be NULL or a name of 1 to 128 bytes, not only whitespace, without control characters', fn
            USING ERRCODE = CASE WHEN pg_catalog.octet_length(message_type) > 128 THEN 'string_data_right_truncation'
                                 ELSE 'invalid_parameter_value' END;
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
            -- The entry's reason and message, but still the attempts so far (the entry counts failures).
            result.attempts := att.started;
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
GRANT EXECUTE ON FUNCTION inbox._blank(text), inbox._has_control(text) TO inbox_consumer, inbox_operator;
-- inbox._check_identity runs with its caller's rights (the consumers' invoker functions call it):
-- the rule and the raise it calls too.
GRANT EXECUTE ON FUNCTION inbox._identity_ok(text, text, text, text), inbox._identity_problem(text, text, text, text),
    inbox._name_ok(text), inbox._raise_problem(text, text[]) TO inbox_consumer;

COMMIT;
