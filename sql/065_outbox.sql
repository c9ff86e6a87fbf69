-- pginbox: the transactional outbox's functions (tables in 060_outbox_tables.sql and
-- 061_outbox_scope_tables.sql).
-- Trust boundaries (docs/outbox.md#13-trust-boundaries):
--   * enqueue_effect acts under a consumer and a tenant (its arguments, else the ones claimed in the
--     transaction): the caller must be allowed to act as them (inbox._authorize) and the consumer
--     must be bound to the destination (bind_destination); an enqueue without a consumer needs
--     anonymous_enqueue. Effect ids and ordering keys are scoped per consumer and tenant, and a
--     destination deduplicates on inbox.idempotency_key(consumer, tenant, effect_id) (0.3.0).
--     Headers the dispatcher owns, invalid header names and values, names and ids that are blank or
--     hold control characters, and an available_at beyond max_effect_delay are refused before
--     anything is written; an available_at in the past means now (it cannot jump the queue).
--   * A lease token is 63 random bits, and a report is accepted only from the role that claimed the
--     lease (outbox.lease_role) with that token.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;
-- DROP ... IF EXISTS below makes this script rerunnable (sqitch rework): no notices for it.
SET LOCAL client_min_messages = warning;

-- ------------------------------------------------------------------ validation

-- NULL, empty and over-long names and ids, with the argument named: 22004, 22023, 22001.
CREATE OR REPLACE FUNCTION inbox._check_text(fn text, what text, value text, max_bytes integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION '%: % must not be NULL', fn, what USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF value = '' THEN
        RAISE EXCEPTION '%: % must not be empty', fn, what USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF inbox._blank(value) THEN
        RAISE EXCEPTION '%: % must not be only whitespace', fn, what USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF inbox._has_control(value) THEN
        RAISE EXCEPTION '%: % must not contain control characters', fn, what
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Line breaks, tabs and escape sequences would reach terminals and logs raw; use printable characters.';
    END IF;
    IF pg_catalog.octet_length(value) > max_bytes THEN
        RAISE EXCEPTION '%: % is % bytes long, the limit is %', fn, what, pg_catalog.octet_length(value), max_bytes
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_text(text, text, text, integer) IS 'internal: rejects a NULL, empty, blank, over-long argument or one with control characters (22004, 22023, 22001)';

-- Effect headers the dispatcher may send: a JSON object of strings; each name an RFC 7230 token,
-- each value without control characters other than HTAB (CR and LF would split the request; NUL
-- cannot occur: jsonb refuses \u0000); no name the dispatcher owns (case-insensitive): the target
-- and credentials (Host, Authorization, Proxy-Authorization, Cookie), the framing (Content-Length,
-- Transfer-Encoding), hop-by-hop headers (Connection, Keep-Alive, Proxy-Connection,
-- Proxy-Authenticate, TE, Trailer, Upgrade) and the idempotency key. One jsonpath, so that the
-- check is inlined (an EXISTS would not be).
CREATE OR REPLACE FUNCTION inbox._headers_ok(headers jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.=) 'object'
       AND pg_catalog.octet_length(headers::text) OPERATOR(pg_catalog.<=) 65536
       AND NOT pg_catalog.jsonb_path_exists(headers,
           '$.keyvalue() ? (@.value.type() != "string"
                            || !(@.key like_regex "^[-!#$%&''*+.^_`|~0-9A-Za-z]+$")
                            || @.key like_regex "^(host|authorization|proxy-authorization|cookie|content-length|transfer-encoding|connection|keep-alive|proxy-connection|proxy-authenticate|te|trailer|upgrade|idempotency-key)$" flag "i"
                            || @.value like_regex "[\x01-\x08\x0a-\x1f\x7f]")');
COMMENT ON FUNCTION inbox._headers_ok(jsonb) IS
    'internal: true when effect headers are a JSON object of valid names and string values the dispatcher may send';

-- The fast check of enqueue_effect, inlined by the planner (IMMUTABLE, and only IMMUTABLE calls:
-- check with EXPLAIN VERBOSE); _check_effect names what is wrong. payload_size is the length of the
-- payload's text (not pg_column_size, the compressed size). Empty headers skip the header check.
CREATE OR REPLACE FUNCTION inbox._effect_ok(
    effect_id text, destination text, payload_size integer, headers jsonb, ordering_key text, available_at timestamptz)
    RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN NOT inbox._blank(effect_id) AND pg_catalog.octet_length(effect_id) <= 256
       AND NOT inbox._blank(destination) AND pg_catalog.octet_length(destination) <= 128
       AND NOT inbox._has_control(effect_id OPERATOR(pg_catalog.||) destination
                                  OPERATOR(pg_catalog.||) coalesce(ordering_key, ''))
       AND payload_size <= 1048576
       AND (headers OPERATOR(pg_catalog.=) '{}'::jsonb OR inbox._headers_ok(headers))
       AND (ordering_key IS NULL OR (NOT inbox._blank(ordering_key) AND pg_catalog.octet_length(ordering_key) <= 256))
       AND pg_catalog.isfinite(available_at);
COMMENT ON FUNCTION inbox._effect_ok(text, text, integer, jsonb, text, timestamptz) IS
    'internal: true when inbox._check_effect would accept the effect';

CREATE OR REPLACE FUNCTION inbox._check_effect(
    fn text, effect_id text, destination text, payload_size integer, headers jsonb, ordering_key text,
    available_at timestamptz)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    bad record;
BEGIN
    PERFORM inbox._check_text(fn, 'effect_id', effect_id, 256);
    PERFORM inbox._check_text(fn, 'destination', destination, 128);
    IF payload_size IS NULL THEN
        RAISE EXCEPTION '%: payload must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Use ''{}''::jsonb for an effect without a body.';
    END IF;
    IF payload_size > 1048576 THEN
        RAISE EXCEPTION '%: payload is % bytes, the limit is 1048576 bytes', fn, payload_size
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Store large bodies elsewhere and put a reference in the payload.';
    END IF;
    IF headers IS NULL THEN
        RAISE EXCEPTION '%: headers must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Leave the argument out (or pass ''{}'') for no headers.';
    END IF;
    IF pg_catalog.jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION '%: headers must be a JSON object of strings, got a JSON %', fn, pg_catalog.jsonb_typeof(headers)
            USING ERRCODE = 'invalid_parameter_value', HINT = 'For example ''{"X-Tenant": "acme"}''.';
    END IF;
    FOR bad IN
        SELECT h.key, pg_catalog.jsonb_typeof(h.value) AS type, h.value #>> '{}' AS value
          FROM pg_catalog.jsonb_each(headers) h
         ORDER BY h.key
    LOOP
        IF bad.type <> 'string' THEN
            RAISE EXCEPTION '%: header % must be a string', fn, pg_catalog.quote_literal(pg_catalog.left(bad.key, 64))
                USING ERRCODE = 'invalid_parameter_value', DETAIL = pg_catalog.format('It is a JSON %s.', bad.type);
        END IF;
        IF bad.key !~ '^[-!#$%&''*+.^_`|~0-9A-Za-z]+$' THEN
            RAISE EXCEPTION '%: header name % is not an HTTP token', fn, pg_catalog.quote_literal(pg_catalog.left(bad.key, 64))
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'A header name is letters, digits and !#$%&''*+-.^_`|~ (RFC 7230), without spaces or colons.';
        END IF;
        IF pg_catalog.lower(bad.key) = ANY (ARRAY['host', 'authorization', 'proxy-authorization', 'cookie', 'content-length',
                                                  'transfer-encoding', 'connection', 'keep-alive', 'proxy-connection',
                                                  'proxy-authenticate', 'te', 'trailer', 'upgrade', 'idempotency-key']) THEN
            RAISE EXCEPTION '%: header % belongs to the dispatcher', fn, pg_catalog.quote_literal(bad.key)
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Credentials, the target host, framing and hop-by-hop headers come from the destination''s configuration; the dispatcher sends the idempotency key (inbox.idempotency_key).';
        END IF;
        IF bad.value ~ '[\x01-\x08\x0a-\x1f\x7f]' THEN
            RAISE EXCEPTION '%: the value of header % contains a control character (CR, LF, ...)', fn,
                pg_catalog.quote_literal(bad.key) USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    IF pg_catalog.octet_length(headers::text) > 65536 THEN
        RAISE EXCEPTION '%: headers are % bytes, the limit is 65536 bytes', fn, pg_catalog.octet_length(headers::text)
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF ordering_key IS NOT NULL THEN
        PERFORM inbox._check_text(fn, 'ordering_key', ordering_key, 256);
    END IF;
    IF available_at IS NULL THEN
        RAISE EXCEPTION '%: available_at must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Leave the argument out to make the effect due now.';
    END IF;
    IF NOT pg_catalog.isfinite(available_at) THEN
        RAISE EXCEPTION '%: available_at must be a finite time, got %', fn, available_at
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_effect(text, text, text, integer, jsonb, text, timestamptz) IS
    'internal: validates an effect before it is enqueued (22004, 22023, 22001, 54000)';

-- A lease length: positive, at most a day.
CREATE OR REPLACE FUNCTION inbox._check_lease(fn text, lease interval) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF lease IS NULL THEN
        RAISE EXCEPTION '%: lease must not be NULL', fn USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF lease <= '0'::interval OR lease > '1 day'::interval THEN
        RAISE EXCEPTION '%: lease must be longer than 0 and at most 1 day, got %', fn, lease
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Make it longer than a delivery takes; extend it with inbox.extend_lease for slow ones.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_lease(text, interval) IS 'internal: validates a lease length (22004, 22023)';

-- What a dispatcher reports about one attempt.
CREATE OR REPLACE FUNCTION inbox._check_report(fn text, effect_id text, lease_token bigint, status_code integer, duration_ms integer)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    PERFORM inbox._check_text(fn, 'effect_id', effect_id, 256);
    IF lease_token IS NULL THEN
        RAISE EXCEPTION '%: lease_token must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Pass the lease_token inbox.claim_effects returned.';
    END IF;
    IF status_code IS NOT NULL AND status_code NOT BETWEEN 100 AND 599 THEN
        RAISE EXCEPTION '%: status_code must be NULL or an HTTP status between 100 and 599, got %', fn, status_code
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF duration_ms < 0 THEN
        RAISE EXCEPTION '%: duration_ms must not be negative, got %', fn, duration_ms
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_report(text, text, bigint, integer, integer) IS
    'internal: validates the effect id, lease token, status code and duration of a report (22004, 22023, 22001)';

-- ------------------------------------------------------------------ effect ids

-- A stable effect id: the same message identity and effect name give the same id on every run
-- of the handler, so a re-run enqueues a no-op. Each part is length-prefixed before hashing, so
-- ('a', 'bc') and ('ab', 'c') differ; the prefix tag versions the derivation.
CREATE OR REPLACE FUNCTION inbox.effect_id(consumer text, producer text, message_id text, effect_name text, tenant text DEFAULT '')
    RETURNS text
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    PERFORM inbox._check_identity('inbox.effect_id', effect_id.consumer, effect_id.producer, effect_id.message_id,
                                  effect_id.tenant);
    PERFORM inbox._check_text('inbox.effect_id', 'effect_name', effect_id.effect_name, 128);
    RETURN 'fx_' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.sha256(
        pg_catalog.convert_to('pginbox.effect_id.v1', 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(effect_id.tenant))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(effect_id.tenant, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(effect_id.consumer))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(effect_id.consumer, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(effect_id.producer))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(effect_id.producer, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(effect_id.message_id))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(effect_id.message_id, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(effect_id.effect_name))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(effect_id.effect_name, 'UTF8')), 'hex');
END
$$;
COMMENT ON FUNCTION inbox.effect_id(text, text, text, text, text) IS
    'Stable effect id (fx_ + 64 hex digits) derived from a message identity and an effect name';

-- The key a destination deduplicates on (webhook Idempotency-Key, AMQP message_id, Nats-Msg-Id,
-- ...): 'ik_' and the SHA-256 of the consumer, the tenant and the effect id, each length-prefixed.
-- Two effects of different consumers or tenants never share a key, whatever ids they chose, and no
-- consumer can make another's key without a SHA-256 collision. It is the same on every attempt of
-- an effect. Effects enqueued before 0.3.0 keep their bare effect id as key (outbox.key_scoped).
CREATE OR REPLACE FUNCTION inbox.idempotency_key(consumer text, tenant text, effect_id text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 'ik_' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.sha256(
        pg_catalog.convert_to('pginbox.idempotency_key.v1', 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(consumer))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(consumer, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(tenant))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(tenant, 'UTF8')
        OPERATOR(pg_catalog.||) pg_catalog.int4send(pg_catalog.octet_length(effect_id))
        OPERATOR(pg_catalog.||) pg_catalog.convert_to(effect_id, 'UTF8')), 'hex');
COMMENT ON FUNCTION inbox.idempotency_key(text, text, text) IS
    'The key a destination deduplicates an effect on: ik_ + 64 hex digits of (consumer, tenant, effect_id)';

-- ------------------------------------------------------------------ wake-up signal

-- Wakes the idle dispatchers: deletes their registrations and notifies, both committing with the
-- caller. Rows another transaction is deleting right now are skipped (never waited for): that
-- transaction's own notify wakes them, so in an idle period only the first enqueue notifies.
-- NOTIFY serializes committing transactions (a cluster-wide lock held through the commit's WAL
-- flush), which is why it is sent only when a dispatcher is idle, and then about once.
CREATE OR REPLACE FUNCTION inbox._wake_dispatchers() RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    DELETE FROM inbox.outbox_waiter w
     WHERE w.dispatcher IN (SELECT x.dispatcher FROM inbox.outbox_waiter x FOR UPDATE SKIP LOCKED);
    IF FOUND THEN
        PERFORM pg_catalog.pg_notify('inbox_outbox', '');
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._wake_dispatchers() IS 'internal: notifies channel inbox_outbox when dispatchers are registered idle';

-- The dispatcher protocol: claim while there is work (inbox.claim_effects unregisters a dispatcher
-- that claims something). When a claim finds nothing: dispatcher_idle(name, true), with its LISTEN
-- inbox_outbox already in place; claim once more (catch-up: an effect committed before the
-- registration sent no signal); then wait for a notification, and claim again after each wait,
-- the waits growing from a few milliseconds (say 20 ms, doubling) up to the poll timeout.
-- dispatcher_idle(name, false) when it stops. The early claims cover the one race left: an
-- enqueuing transaction that looked at the waiter table (inbox.enqueue_effect) before the
-- registration and committed after the catch-up claim. An effect whose signal was missed waits for the next claim, at worst the poll
-- timeout, never longer. Stale registrations of dead dispatchers cost one NOTIFY: the first
-- enqueue deletes them.
-- Neither direction waits for the row lock of a transaction that is waking the dispatcher.
CREATE OR REPLACE FUNCTION inbox.dispatcher_idle(dispatcher text, idle boolean) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_text('inbox.dispatcher_idle', 'dispatcher', dispatcher_idle.dispatcher, 128);
    IF dispatcher_idle.idle IS NULL THEN
        RAISE EXCEPTION 'inbox.dispatcher_idle: idle must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF dispatcher_idle.idle THEN
        -- Already registered (perhaps being woken right now): nothing to do.
        IF NOT EXISTS (SELECT FROM inbox.outbox_waiter w WHERE w.dispatcher = dispatcher_idle.dispatcher) THEN
            INSERT INTO inbox.outbox_waiter (dispatcher) VALUES (dispatcher_idle.dispatcher)
            ON CONFLICT ON CONSTRAINT outbox_waiter_pkey DO NOTHING;
        END IF;
    ELSE
        DELETE FROM inbox.outbox_waiter w
         WHERE w.dispatcher IN (SELECT x.dispatcher FROM inbox.outbox_waiter x
                                 WHERE x.dispatcher = dispatcher_idle.dispatcher FOR UPDATE SKIP LOCKED);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox.dispatcher_idle(text, boolean) IS
    'Register (true) or unregister (false) an idle dispatcher: enqueues notify channel inbox_outbox only while one is registered';

-- ------------------------------------------------------------------ enqueue

-- Commit order for ordering keys, per consumer and tenant. A sequence number taken at insert is not
-- commit order: T1 can insert first and commit last. So order_seq is assigned by this deferred
-- constraint trigger, at commit, under a row lock on the key's bucket (inbox.outbox_order_lock):
-- the lock is held from the moment the number is taken until the transaction's commit is visible,
-- so a second transaction with the same key waits for it and takes a higher number. Same-key
-- transactions are therefore numbered in commit order, and a dispatcher that sees an effect also
-- sees every earlier one of its key. Within one transaction, numbers follow insertion order
-- (deferred events fire in order). All buckets of the transaction are locked at its first event, in
-- bucket order, so two transactions sharing several keys cannot deadlock at commit (a
-- transaction-local setting remembers that this was done, so a transaction enqueuing n keyed
-- effects does this scan once, not n times; a forged setting only skips the deadlock avoidance);
-- each event then locks its own bucket again (a no-op when held). Same-key commits are serialized
-- for the moment between this trigger and the commit record. SET CONSTRAINTS ... IMMEDIATE numbers
-- the effects early and holds the lock (and so blocks same-key commits) until the end of the
-- transaction.
-- Row locks rather than advisory locks: nobody but the package can lock those rows, while any
-- session can take an advisory lock whose key it saw in pg_locks or computed, and stall the
-- commits of that key. Two keys in one bucket only serialize a little more.
CREATE OR REPLACE FUNCTION inbox._order_bucket(consumer text, tenant text, ordering_key text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN (pg_catalog.hashtextextended(consumer OPERATOR(pg_catalog.||) E'\x01' OPERATOR(pg_catalog.||) tenant
                                        OPERATOR(pg_catalog.||) E'\x01' OPERATOR(pg_catalog.||) ordering_key, 0)
            OPERATOR(pg_catalog.&) 16383)::integer;
COMMENT ON FUNCTION inbox._order_bucket(text, text, text) IS 'internal: the inbox.outbox_order_lock row of an ordering key';

CREATE OR REPLACE FUNCTION inbox._order_at_commit() RETURNS trigger
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    this_xact xid8 := pg_catalog.pg_current_xact_id();
BEGIN
    IF pg_catalog.current_setting('inbox.ordering_keys_locked', true) IS DISTINCT FROM this_xact::text THEN
        PERFORM FROM inbox.outbox_order_lock l
         WHERE l.bucket IN (SELECT inbox._order_bucket(o.consumer, o.tenant, o.ordering_key)
                              FROM inbox.outbox o
                             WHERE o.created_xid = this_xact AND o.ordering_key IS NOT NULL AND o.order_seq IS NULL)
         ORDER BY l.bucket
           FOR UPDATE;
        PERFORM pg_catalog.set_config('inbox.ordering_keys_locked', this_xact::text, true);
    END IF;
    PERFORM FROM inbox.outbox_order_lock l
     WHERE l.bucket = inbox._order_bucket(NEW.consumer, NEW.tenant, NEW.ordering_key)
       FOR UPDATE;
    UPDATE inbox.outbox o
       SET order_seq = pg_catalog.nextval('inbox.outbox_order_seq')
     WHERE o.effect_id = NEW.effect_id AND o.consumer = NEW.consumer AND o.tenant = NEW.tenant AND o.order_seq IS NULL;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION inbox._order_at_commit() IS 'internal (trigger): numbers keyed effects in commit order, at commit';

DROP TRIGGER IF EXISTS outbox_order_at_commit ON inbox.outbox;
CREATE CONSTRAINT TRIGGER outbox_order_at_commit
    AFTER INSERT ON inbox.outbox
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL)
    EXECUTE FUNCTION inbox._order_at_commit();

-- inbox.enqueue_effect checks for idle dispatchers itself, at a fraction of the cost of a deferred
-- trigger per inserted effect (docs/performance.md): a database that has the trigger loses it.
DROP TRIGGER IF EXISTS outbox_signal_at_commit ON inbox.outbox;
DROP FUNCTION IF EXISTS inbox._signal_at_commit();

-- The slow path of enqueue_effect's authorization, run only when the fast checks said no: names
-- what is wrong, or lets a superuser through (unless strict_consumers), as inbox._authorize does.
--   consumer NULL (none given, none claimed): 22004 unless anonymous_enqueue is on;
--   a consumer and tenant the caller may not act as: 42501 / 42704 (inbox._authorize);
--   a destination not bound to the consumer (nor to '*'): 42501.
DROP FUNCTION IF EXISTS inbox._authorize_enqueue(text, text, text);
CREATE OR REPLACE FUNCTION inbox._authorize_enqueue(fn text, destination text, consumer text, tenant text) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    settings inbox.security_settings;
    superuser_passes boolean;
BEGIN
    SELECT s.* INTO settings FROM inbox.security_settings s;
    superuser_passes := NOT settings.strict_consumers
                        AND (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = inbox._caller());
    IF _authorize_enqueue.consumer IS NULL THEN
        IF NOT settings.anonymous_enqueue AND NOT superuser_passes THEN
            RAISE EXCEPTION '%: no consumer: the effect must belong to one', fn
                USING ERRCODE = 'null_value_not_allowed',
                      DETAIL = 'Neither the consumer argument nor a claim in this transaction names one, and anonymous enqueues are off (inbox.security_settings.anonymous_enqueue).',
                      HINT = 'Enqueue from a handler run by inbox.claim_and_apply (or after inbox.claim in the same transaction), or pass consumer => ''<consumer>''.';
        END IF;
    ELSE
        PERFORM inbox._authorize(fn, _authorize_enqueue.consumer, _authorize_enqueue.tenant);
    END IF;
    IF NOT EXISTS (SELECT FROM inbox.destination_binding d
                    WHERE d.destination = _authorize_enqueue.destination
                      AND d.consumer = ANY (ARRAY[_authorize_enqueue.consumer,
                                                  inbox._consumer_base(_authorize_enqueue.consumer), '*']))
       AND NOT superuser_passes THEN
        RAISE EXCEPTION '%: % may not enqueue effects to destination %', fn,
            coalesce('consumer ' || quote_literal(_authorize_enqueue.consumer), 'an enqueue without a consumer'),
            quote_literal(_authorize_enqueue.destination)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = CASE WHEN EXISTS (SELECT FROM inbox.destination_binding d
                                              WHERE d.destination = _authorize_enqueue.destination)
                                THEN 'The destination is bound to other consumers (inbox.destination_binding).'
                                ELSE 'No consumer is bound to the destination: check its name for a typo.' END,
                  HINT = format('An operator binds it: SELECT inbox.bind_destination(%L, %L, ''<why>'');',
                                _authorize_enqueue.destination, coalesce(_authorize_enqueue.consumer, '*'));
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._authorize_enqueue(text, text, text, text) IS
    'internal: returns when the session may enqueue to the destination under the consumer and tenant (NULL consumer: anonymously), else raises 22004 / 42501 / 42704';

-- Records an effect in the caller's transaction: true when newly enqueued, false when the same
-- consumer and tenant already enqueued the same effect id with the same destination and payload (a
-- re-run handler: no-op). The same id with another payload or destination is a bug in the caller
-- and raises 23505 (CONSTRAINT effect_id_conflict, which inbox.claim_and_apply records as the reason
-- code). Headers, ordering_key and available_at of a repeat are ignored: the first enqueue's stay.
-- The effect belongs to `consumer` and `tenant`, by default the ones claimed in this transaction
-- (settings inbox.consumer and inbox.tenant, which the claim paths set; the tenant defaults to the
-- claimed one only when the consumer does, else to ''). Anyone can set those settings: they only
-- choose, the caller must still be allowed to act as the consumer for the tenant. Effect ids and
-- ordering keys are scoped per consumer and tenant: another consumer's or tenant's effect under
-- the same id or key is another effect, and destinations receive inbox.idempotency_key(consumer,
-- tenant, effect_id), never the bare id.
-- Every check runs before anything is written: the effect's fields (22004, 22023, 22001, 54000;
-- headers: see _headers_ok), available_at at most max_effect_delay ahead (22023), then who may
-- enqueue what (_authorize_enqueue: 22004, 42501, 42704). An available_at in the past is stored as
-- now: it cannot put the effect ahead of others already due.
-- As with inbox.claim, the primary key decides: a concurrent enqueue of the same id waits for the
-- first transaction; at REPEATABLE READ and above it gets 40001 instead (retry the transaction).
-- The id is remembered as long as the effect row is kept (see purge_delivered_effects).
-- The signature without `tenant` is dropped: a call without it resolves to this function.
DROP FUNCTION IF EXISTS inbox.enqueue_effect(text, text, jsonb, jsonb, text, timestamptz, text);
CREATE OR REPLACE FUNCTION inbox.enqueue_effect(
    effect_id text, destination text, payload jsonb, headers jsonb DEFAULT '{}', ordering_key text DEFAULT NULL,
    available_at timestamptz DEFAULT now(), consumer text DEFAULT NULL, tenant text DEFAULT NULL)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    -- Generic plans, always: a custom plan of the authorization query folds its CASE on the
    -- consumer and always looks cheaper than the generic one, so the plan cache planned that query
    -- again at every call (inlining inbox._acting_as each time), several times the cost of a call
    -- once the outbox held rows (docs/performance.md). Every statement here is a key lookup a generic
    -- plan does as well.
    SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    who text := coalesce(enqueue_effect.consumer, NULLIF(current_setting('inbox.consumer', true), ''));
    whose text := coalesce(enqueue_effect.tenant,
                           CASE WHEN enqueue_effect.consumer IS NULL
                                     OR enqueue_effect.consumer = current_setting('inbox.consumer', true)
                                THEN current_setting('inbox.tenant', true) END,
                           '');
    payload_text text := enqueue_effect.payload::text;
    due timestamptz := greatest(enqueue_effect.available_at, now());
    stored_payload jsonb;
    stored_destination text;
    wake boolean;
BEGIN
    IF inbox._effect_ok(enqueue_effect.effect_id, enqueue_effect.destination, octet_length(payload_text),
                        enqueue_effect.headers, enqueue_effect.ordering_key, enqueue_effect.available_at) IS NOT TRUE THEN
        PERFORM inbox._check_effect('inbox.enqueue_effect', enqueue_effect.effect_id, enqueue_effect.destination,
                                    octet_length(payload_text), enqueue_effect.headers,
                                    enqueue_effect.ordering_key, enqueue_effect.available_at);
    END IF;
    -- The raising checks (their own search_path: a GUC level per call) only when the inlined ones say no.
    IF enqueue_effect.consumer OPERATOR(pg_catalog.=) ''
       OR pg_catalog.octet_length(enqueue_effect.consumer) OPERATOR(pg_catalog.>) 128
       OR inbox._has_control(enqueue_effect.consumer) OR inbox._blank(enqueue_effect.consumer) THEN
        PERFORM inbox._check_text('inbox.enqueue_effect', 'consumer', enqueue_effect.consumer, 128);
    END IF;
    IF whose OPERATOR(pg_catalog.<>) '' AND (pg_catalog.octet_length(whose) OPERATOR(pg_catalog.>) 128
                                              OR inbox._has_control(whose) OR inbox._blank(whose)) THEN
        PERFORM inbox._check_text('inbox.enqueue_effect', 'tenant', whose, 128);
    END IF;
    -- max_effect_delay is at least 1 second: an effect due now (the default) skips the lookup.
    IF due > now() + '1 second'::interval
       AND due > now() + (SELECT s.max_effect_delay FROM inbox.security_settings s) THEN
        RAISE EXCEPTION 'inbox.enqueue_effect: available_at % is further ahead than max_effect_delay (%)',
            enqueue_effect.available_at, (SELECT s.max_effect_delay FROM inbox.security_settings s)
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = 'An effect that waits that long holds back the purge of its consumer''s messages.',
                  HINT = 'Enqueue it closer to its time, or an operator raises the limit: inbox.configure_security(max_effect_delay => ...).';
    END IF;
    -- Who may enqueue what: the consumer's binding for the tenant (inbox._acting_as, inlined into
    -- this one query), the destination's (or the settings, when anonymous). _authorize_enqueue
    -- (through inbox._authorize) has the last word.
    IF NOT (CASE WHEN who IS NULL THEN (SELECT s.anonymous_enqueue FROM inbox.security_settings s)
                 ELSE (SELECT a.allowed FROM inbox._acting_as(who, whose) a)
            END
            AND EXISTS (SELECT FROM inbox.destination_binding d
                         WHERE d.destination = enqueue_effect.destination
                           AND d.consumer = ANY (ARRAY[who, inbox._consumer_base(who), '*']))) THEN
        PERFORM inbox._authorize_enqueue('inbox.enqueue_effect', enqueue_effect.destination, who, whose);
    END IF;
    who := coalesce(who, '');
    -- A purge may delete the existing row between our INSERT and our SELECT: then try again.
    FOR round IN 1..3 LOOP
        -- Wake the idle dispatchers: their registrations go and a notification is queued, both
        -- with this transaction's commit (nothing if it rolls back). A dispatcher registering idle
        -- after this check and before the commit is not notified: its early claims after
        -- registering (20 ms, then doubling up to its poll interval) find the effect
        -- (tests/python/test_outbox_signal.py). One probe of an empty table under load, made by
        -- the INSERT itself (RETURNING) rather than by a statement of its own.
        INSERT INTO inbox.outbox (effect_id, destination, payload, headers, ordering_key, available_at, consumer, tenant)
        VALUES (enqueue_effect.effect_id, enqueue_effect.destination, enqueue_effect.payload, enqueue_effect.headers,
                enqueue_effect.ordering_key, due, who, whose)
        ON CONFLICT ON CONSTRAINT outbox_pkey DO NOTHING
        RETURNING due <= now() AND EXISTS (SELECT FROM inbox.outbox_waiter) INTO wake;
        IF FOUND THEN
            IF wake THEN
                PERFORM inbox._wake_dispatchers();
            END IF;
            RETURN true;
        END IF;
        SELECT o.payload, o.destination INTO stored_payload, stored_destination
          FROM inbox.outbox o WHERE o.effect_id = enqueue_effect.effect_id AND o.consumer = who AND o.tenant = whose;
        EXIT WHEN FOUND;
    END LOOP;
    IF stored_destination IS NULL THEN
        RAISE EXCEPTION 'inbox.enqueue_effect: effect % kept disappearing under a concurrent purge', enqueue_effect.effect_id
            USING ERRCODE = 'serialization_failure', HINT = 'Retry the transaction.';
    END IF;
    -- A repeat of the id (a handler run again): the same destination and payload (jsonb equality:
    -- key order and whitespace do not matter) is a no-op; anything else is a bug.
    IF stored_payload = enqueue_effect.payload AND stored_destination = enqueue_effect.destination THEN
        RETURN false;
    END IF;
    RAISE EXCEPTION 'inbox.enqueue_effect: effect % was enqueued for destination % with payload hash %; this call has destination % and payload hash %',
        pg_catalog.quote_literal(enqueue_effect.effect_id), pg_catalog.quote_literal(stored_destination),
        pg_catalog.encode(sha256(convert_to(stored_payload::text, 'UTF8')), 'hex'),
        pg_catalog.quote_literal(enqueue_effect.destination), pg_catalog.encode(sha256(convert_to(payload_text, 'UTF8')), 'hex')
        USING ERRCODE = 'unique_violation', CONSTRAINT = 'effect_id_conflict',
              HINT = 'One effect id per intended effect: derive ids with inbox.effect_id(consumer, producer, message_id, effect_name).';
END
$$;
COMMENT ON FUNCTION inbox.enqueue_effect(text, text, jsonb, jsonb, text, timestamptz, text, text) IS
    'Record an effect of a consumer and tenant (default: the ones claimed in this transaction) in the caller''s transaction: true = enqueued, false = already enqueued (same destination and payload)';

-- ------------------------------------------------------------------ destinations

-- The policy of a destination that has no row: the column defaults of inbox.outbox_destination
-- (a pgTAP test keeps the two in step).
CREATE OR REPLACE FUNCTION inbox._default_destination(destination text) RETURNS inbox.outbox_destination
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN ROW(destination, 10, '1 second'::interval, '1 hour'::interval, NULL::timestamptz, NULL::text)::inbox.outbox_destination;
COMMENT ON FUNCTION inbox._default_destination(text) IS 'internal: retry policy of an unconfigured destination';

-- An argument left out (or NULL) keeps the destination's current value (the default for a new
-- destination), as inbox.configure_consumer does.
CREATE OR REPLACE FUNCTION inbox.configure_destination(
    destination text, max_attempts integer DEFAULT NULL, base_backoff interval DEFAULT NULL,
    max_backoff interval DEFAULT NULL)
    RETURNS inbox.outbox_destination
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    wanted inbox.outbox_destination;
    saved inbox.outbox_destination;
BEGIN
    PERFORM inbox._check_text('inbox.configure_destination', 'destination', configure_destination.destination, 128);
    SELECT d.* INTO wanted FROM inbox.outbox_destination d WHERE d.destination = configure_destination.destination;
    IF NOT FOUND THEN
        wanted := inbox._default_destination(configure_destination.destination);
    END IF;
    wanted.max_attempts := coalesce(configure_destination.max_attempts, wanted.max_attempts);
    wanted.base_backoff := coalesce(configure_destination.base_backoff, wanted.base_backoff);
    wanted.max_backoff := coalesce(configure_destination.max_backoff, wanted.max_backoff);
    IF wanted.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'inbox.configure_destination: max_attempts must be between 1 and 1000, got %',
            wanted.max_attempts USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF wanted.base_backoff <= '0'::interval THEN
        RAISE EXCEPTION 'inbox.configure_destination: base_backoff must be positive, got %', wanted.base_backoff
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF wanted.max_backoff < wanted.base_backoff OR wanted.max_backoff > '30 days'::interval THEN
        RAISE EXCEPTION 'inbox.configure_destination: max_backoff must be between base_backoff (%) and 30 days, got %',
            wanted.base_backoff, wanted.max_backoff
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO inbox.outbox_destination AS d (destination, max_attempts, base_backoff, max_backoff)
    VALUES (configure_destination.destination, wanted.max_attempts, wanted.base_backoff, wanted.max_backoff)
    ON CONFLICT ON CONSTRAINT outbox_destination_pkey DO UPDATE
       SET max_attempts = EXCLUDED.max_attempts, base_backoff = EXCLUDED.base_backoff,
           max_backoff = EXCLUDED.max_backoff, updated_at = now(), updated_by = session_user
    RETURNING d.* INTO saved;
    RETURN saved;
END
$$;
COMMENT ON FUNCTION inbox.configure_destination(text, integer, interval, interval) IS
    'Set a destination''s retry policy: attempts before dead, and the exponential backoff''s base and cap';

-- Allows a consumer (and its versioned names; '*': every consumer, and enqueues without a
-- consumer) to enqueue effects to a destination. The dispatcher sends them with the destination's
-- configured credentials: bind a destination only to the consumers entitled to use them. Binding
-- again replaces the note. Audited in inbox.binding_change.
CREATE OR REPLACE FUNCTION inbox.bind_destination(destination text, consumer text, note text DEFAULT 'bound')
    RETURNS inbox.destination_binding
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    saved inbox.destination_binding;
BEGIN
    PERFORM inbox._check_text('inbox.bind_destination', 'destination', bind_destination.destination, 128);
    PERFORM inbox._check_text('inbox.bind_destination', 'consumer', bind_destination.consumer, 128);
    PERFORM inbox._check_note('inbox.bind_destination', bind_destination.note);
    INSERT INTO inbox.destination_binding AS b (destination, consumer, note)
    VALUES (bind_destination.destination, bind_destination.consumer, bind_destination.note)
    ON CONFLICT ON CONSTRAINT destination_binding_pkey DO UPDATE
       SET bound_at = now(), bound_by = session_user, note = EXCLUDED.note
    RETURNING b.* INTO saved;
    INSERT INTO inbox.binding_change (action, consumer, destination, note)
    VALUES ('bind_destination', bind_destination.consumer, bind_destination.destination, bind_destination.note);
    RETURN saved;
END
$$;
COMMENT ON FUNCTION inbox.bind_destination(text, text, text) IS
    'Allow a consumer (''*'': every consumer) to enqueue effects to a destination; audited';

-- Effects already enqueued stay and are delivered; only new enqueues are refused.
CREATE OR REPLACE FUNCTION inbox.unbind_destination(destination text, consumer text, note text DEFAULT 'unbound')
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_note('inbox.unbind_destination', unbind_destination.note);
    DELETE FROM inbox.destination_binding b
     WHERE b.destination = unbind_destination.destination AND b.consumer = unbind_destination.consumer;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO inbox.binding_change (action, consumer, destination, note)
    VALUES ('unbind_destination', unbind_destination.consumer, unbind_destination.destination, unbind_destination.note);
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox.unbind_destination(text, text, text) IS
    'Stop a consumer (''*'': the binding for every consumer) enqueueing to a destination (false: it was not bound); audited';

-- ------------------------------------------------------------------ dispatch

-- A fencing token nobody can guess: 63 random bits of two version 4 UUIDs (gen_random_uuid, a
-- strong random source), from their random bytes 9 to 15 and 7 (never the version and variant
-- bits); positive. One expression, so that the planner inlines it.
CREATE OR REPLACE FUNCTION inbox._new_lease_token() RETURNS bigint
    LANGUAGE sql VOLATILE PARALLEL SAFE
    RETURN (('x' OPERATOR(pg_catalog.||) pg_catalog.substr(pg_catalog.encode(pg_catalog.uuid_send(pg_catalog.gen_random_uuid()), 'hex'), 19, 14)
                 OPERATOR(pg_catalog.||) pg_catalog.substr(pg_catalog.encode(pg_catalog.uuid_send(pg_catalog.gen_random_uuid()), 'hex'), 15, 2)
            )::bit(64)::bigint) OPERATOR(pg_catalog.&) 9223372036854775807;
COMMENT ON FUNCTION inbox._new_lease_token() IS 'internal: a new fencing token, 63 random bits';

-- Claims up to max_effects due effects for one dispatcher, FOR UPDATE SKIP LOCKED: pending effects
-- whose available_at has come, and leased ones whose lease expired (reclaimed). An effect with an
-- ordering key is claimed only when it is the head of its key, within its consumer and tenant: no
-- effect of the same consumer, tenant and key with a lower order_seq is pending, leased or dead. So
-- at most one effect per key is out at a time, in commit order, and a dead effect holds its key until
-- it is redriven or discarded (discard_effect; a discarded or delivered effect no longer counts).
-- Effects whose order_seq is still NULL are not committed (invisible to other sessions anyway). Each
-- claimed effect gets status leased, attempts + 1 and a new fencing token. An expired lease that
-- already used max_attempts is not reclaimed but turned dead (lease_expired): a dispatcher that dies
-- on an effect every time must not loop forever.
-- Keyed effects found behind the head of their key are set aside (blocked) so that later claims do
-- not scan them again; complete_effect unblocks the next one when it delivers a head. An effect is
-- set aside only while one of its undelivered predecessors is share-locked here (SKIP LOCKED:
-- otherwise it is left for a later claim), so a delivery of that predecessor, which must then
-- wait, always sees it blocked and unblocks it. Nothing here waits for a lock: claims never
-- deadlock. When the scan meets effects to set aside, it goes on in rounds of up to 1000 more
-- rows (at most 10 rounds per call), so a long queue on one key is set aside in a few calls; a
-- call can then return fewer than max_effects, or none, although more are due: a dispatcher
-- claims again until a claim returns nothing (its catch-up claim after registering idle too).
-- The lease belongs to the caller (lease_role): only that role can report on it, with the token
-- (63 random bits, _new_lease_token). Effects are handled as (effect_id, consumer, tenant).
-- idempotency_key is the key the destination must deduplicate on (inbox.idempotency_key; the
-- bare effect id for effects enqueued before 0.3.0). key_aware: the caller sends idempotency_key.
-- A dispatcher of an earlier release calls this without it and sends the bare effect id: it is
-- given only effects whose key is their id, so that no effect is ever sent under two keys while
-- dispatchers of two releases run side by side (the signature without key_aware is dropped).
DROP FUNCTION IF EXISTS inbox.claim_effects(text, integer, interval);
CREATE OR REPLACE FUNCTION inbox.claim_effects(dispatcher text, max_effects integer DEFAULT 10,
                                               lease interval DEFAULT '30 seconds', key_aware boolean DEFAULT false)
    RETURNS TABLE (effect_id text, destination text, payload jsonb, headers jsonb, ordering_key text, attempts integer,
                   lease_token bigint, lease_expires_at timestamptz, created_at timestamptz, consumer text,
                   tenant text, idempotency_key text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    ROWS 10
AS $$
DECLARE
    claimed integer := 0;
    leased integer;
    scan_limit integer;
    heads text[];
    head_consumers text[];
    head_tenants text[];
    behind text[];
    behind_consumers text[];
    behind_tenants text[];
    scanned integer;
    holder oid := (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = inbox._caller());  -- the lease's role
BEGIN
    PERFORM inbox._check_text('inbox.claim_effects', 'dispatcher', claim_effects.dispatcher, 128);
    IF claim_effects.max_effects IS NULL THEN
        RAISE EXCEPTION 'inbox.claim_effects: max_effects must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF claim_effects.max_effects NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'inbox.claim_effects: max_effects must be between 1 and 1000, got %', claim_effects.max_effects
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF claim_effects.key_aware IS NULL THEN
        RAISE EXCEPTION 'inbox.claim_effects: key_aware must not be NULL' USING ERRCODE = 'null_value_not_allowed',
            HINT = 'true: the dispatcher sends idempotency_key to destinations.';
    END IF;
    PERFORM inbox._check_lease('inbox.claim_effects', claim_effects.lease);

    FOR round IN 1..10 LOOP
        -- Round 1 locks no more rows than it may claim; later rounds wade through a queue to set aside.
        scan_limit := claim_effects.max_effects - claimed + CASE WHEN round = 1 THEN 0 ELSE 1000 END;
        SELECT coalesce(array_agg(s.id ORDER BY s.due, s.id, s.consumer, s.tenant) FILTER (WHERE NOT s.behind), '{}'),
               coalesce(array_agg(s.consumer ORDER BY s.due, s.id, s.consumer, s.tenant) FILTER (WHERE NOT s.behind), '{}'),
               coalesce(array_agg(s.tenant ORDER BY s.due, s.id, s.consumer, s.tenant) FILTER (WHERE NOT s.behind), '{}'),
               coalesce(array_agg(s.id ORDER BY s.id, s.consumer, s.tenant) FILTER (WHERE s.behind), '{}'),
               coalesce(array_agg(s.consumer ORDER BY s.id, s.consumer, s.tenant) FILTER (WHERE s.behind), '{}'),
               coalesce(array_agg(s.tenant ORDER BY s.id, s.consumer, s.tenant) FILTER (WHERE s.behind), '{}')
          INTO heads, head_consumers, head_tenants, behind, behind_consumers, behind_tenants
          FROM (SELECT o.effect_id AS id, o.consumer, o.tenant, o.available_at AS due,
                       o.ordering_key IS NOT NULL
                         AND EXISTS (SELECT FROM inbox.outbox p
                                      WHERE p.consumer = o.consumer AND p.tenant = o.tenant
                                        AND p.ordering_key = o.ordering_key AND p.order_seq < o.order_seq
                                        AND p.status IN ('pending', 'leased', 'dead')) AS behind
                  FROM inbox.outbox o
                 WHERE o.status IN ('pending', 'leased') AND NOT o.blocked AND o.available_at <= now()
                   AND (o.ordering_key IS NULL OR o.order_seq IS NOT NULL)
                   AND (claim_effects.key_aware OR NOT o.key_scoped)
                 ORDER BY o.available_at
                 LIMIT scan_limit
                   FOR UPDATE OF o SKIP LOCKED) s;
        scanned := pg_catalog.cardinality(heads) + pg_catalog.cardinality(behind);

        IF pg_catalog.cardinality(behind) > 0 THEN
            -- First lock each one's nearest undelivered predecessor (often a row this scan holds
            -- already), in a statement that modifies nothing, then set aside those that got it.
            SELECT coalesce(array_agg(o.effect_id ORDER BY o.effect_id, o.consumer, o.tenant), '{}'),
                   coalesce(array_agg(o.consumer ORDER BY o.effect_id, o.consumer, o.tenant), '{}'),
                   coalesce(array_agg(o.tenant ORDER BY o.effect_id, o.consumer, o.tenant), '{}')
              INTO behind, behind_consumers, behind_tenants
              FROM inbox.outbox o
             WHERE (o.effect_id, o.consumer, o.tenant) IN (SELECT * FROM ROWS FROM (pg_catalog.unnest(behind),
                                                                                    pg_catalog.unnest(behind_consumers),
                                                                                    pg_catalog.unnest(behind_tenants)))
               AND EXISTS (SELECT FROM inbox.outbox q
                            WHERE q.consumer = o.consumer AND q.tenant = o.tenant
                              AND q.ordering_key = o.ordering_key AND q.order_seq < o.order_seq
                              AND q.status IN ('pending', 'leased', 'dead')
                            ORDER BY q.order_seq DESC
                            LIMIT 1
                              FOR SHARE OF q SKIP LOCKED);
            UPDATE inbox.outbox o SET blocked = true
             WHERE (o.effect_id, o.consumer, o.tenant) IN (SELECT * FROM ROWS FROM (pg_catalog.unnest(behind),
                                                                                    pg_catalog.unnest(behind_consumers),
                                                                                    pg_catalog.unnest(behind_tenants)));
        END IF;

        IF pg_catalog.cardinality(heads) > 0 THEN
            RETURN QUERY
            WITH picked AS (
                SELECT h.id, h.consumer, h.tenant, h.rank,
                       o.status = 'leased' AND o.attempts >= coalesce(
                           (SELECT d.max_attempts FROM inbox.outbox_destination d WHERE d.destination = o.destination),
                           (inbox._default_destination(o.destination)).max_attempts) AS exhausted
                  FROM ROWS FROM (pg_catalog.unnest(heads[1:claim_effects.max_effects - claimed]),
                                  pg_catalog.unnest(head_consumers[1:claim_effects.max_effects - claimed]),
                                  pg_catalog.unnest(head_tenants[1:claim_effects.max_effects - claimed]))
                       WITH ORDINALITY AS h (id, consumer, tenant, rank)
                  JOIN inbox.outbox o ON o.effect_id = h.id AND o.consumer = h.consumer AND o.tenant = h.tenant
                                     AND o.effect_id = ANY (heads[1:claim_effects.max_effects - claimed])  -- by key
            ), changed AS (
                UPDATE inbox.outbox o
                   SET status = CASE WHEN p.exhausted THEN 'dead' ELSE 'leased' END::inbox.effect_status,
                       attempts = o.attempts + CASE WHEN p.exhausted THEN 0 ELSE 1 END,
                       lease_token = CASE WHEN p.exhausted THEN o.lease_token ELSE inbox._new_lease_token() END,
                       lease_role = CASE WHEN p.exhausted THEN o.lease_role ELSE holder END,
                       leased_by = CASE WHEN p.exhausted THEN o.leased_by ELSE claim_effects.dispatcher END,
                       lease_expires_at = CASE WHEN p.exhausted THEN NULL ELSE now() + claim_effects.lease END,
                       available_at = CASE WHEN p.exhausted THEN o.available_at ELSE now() + claim_effects.lease END,
                       last_attempt_at = CASE WHEN p.exhausted THEN o.last_attempt_at ELSE now() END,
                       dead_reason = CASE WHEN p.exhausted THEN 'lease_expired' END,
                       last_error = CASE WHEN p.exhausted
                                         THEN pg_catalog.format('the lease of attempt %s (dispatcher %s) expired without a report',
                                                                o.attempts, o.leased_by)
                                         ELSE o.last_error END
                  FROM picked p
                 WHERE o.effect_id = p.id AND o.consumer = p.consumer AND o.tenant = p.tenant
                RETURNING o.effect_id, o.destination, o.payload, o.headers, o.ordering_key, o.attempts, o.lease_token,
                          o.lease_expires_at, o.created_at, o.consumer, o.tenant, o.key_scoped, o.status, p.rank
            )
            SELECT c.effect_id, c.destination, c.payload, c.headers, c.ordering_key, c.attempts, c.lease_token,
                   c.lease_expires_at, c.created_at, c.consumer, c.tenant,
                   CASE WHEN c.key_scoped THEN inbox.idempotency_key(c.consumer, c.tenant, c.effect_id)
                        ELSE c.effect_id END
              FROM changed c
             WHERE c.status = 'leased'
             ORDER BY c.rank;
            GET DIAGNOSTICS leased = ROW_COUNT;
            claimed := claimed + leased;
        END IF;

        EXIT WHEN claimed >= claim_effects.max_effects
               OR scanned < scan_limit                          -- nothing more is due
               OR scanned = pg_catalog.cardinality(heads);      -- no queue to wade through
    END LOOP;

    -- A caller that does not say it sends idempotency_key gets none of the effects keyed so: say why
    -- when they are waiting for it (a dispatcher of an earlier release, or one written by hand).
    IF claimed = 0 AND NOT claim_effects.key_aware
       AND EXISTS (SELECT FROM inbox.outbox o
                    WHERE o.status IN ('pending', 'leased') AND NOT o.blocked AND o.available_at <= now() AND o.key_scoped) THEN
        RAISE WARNING 'inbox.claim_effects: due effects wait for a dispatcher that sends their idempotency_key'
            USING DETAIL = 'Effects enqueued since 0.3.0 are delivered under inbox.idempotency_key(consumer, tenant, effect_id), which claim_effects returns; a dispatcher that sends the bare effect id does not get them.',
                  HINT = 'Upgrade the dispatcher, or call inbox.claim_effects(..., key_aware => true) and send the idempotency_key column as the destination''s key.';
    END IF;
    -- A dispatcher that has work is not idle.
    IF claimed > 0 AND EXISTS (SELECT FROM inbox.outbox_waiter w WHERE w.dispatcher = claim_effects.dispatcher) THEN
        DELETE FROM inbox.outbox_waiter w
         WHERE w.dispatcher IN (SELECT x.dispatcher FROM inbox.outbox_waiter x
                                 WHERE x.dispatcher = claim_effects.dispatcher FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN;
END
$$;
COMMENT ON FUNCTION inbox.claim_effects(text, integer, interval, boolean) IS
    'Lease up to max_effects due effects (FOR UPDATE SKIP LOCKED, one per ordering key of a consumer and tenant, in commit order), each with a new random fencing token held by the caller, and the key the destination deduplicates on';

-- The backoff before attempt n + 1 after n failed attempts: base * 2^(n-1), capped at max, then
-- jittered down to 50..100% of that ("equal jitter") so that a burst of failures spreads out.
CREATE OR REPLACE FUNCTION inbox._backoff(policy inbox.outbox_destination, attempts integer) RETURNS interval
    LANGUAGE sql VOLATILE
    RETURN pg_catalog.make_interval(secs => least(
               pg_catalog.date_part('epoch', (policy).max_backoff),
               pg_catalog.date_part('epoch', (policy).base_backoff)
                   * pg_catalog.power(2::double precision, least(greatest(attempts - 1, 0), 60)::double precision))
           * (0.5::double precision + pg_catalog.random() / 2));
COMMENT ON FUNCTION inbox._backoff(inbox.outbox_destination, integer) IS
    'internal: jittered exponential backoff after the given number of attempts';

-- The reports of a dispatcher are FENCED: each is accepted only while the effect is leased under
-- exactly this lease_token, and only from the role that claimed the lease (outbox.lease_role; a
-- lease taken before 0.2.0 has none and is accepted from any role, until it ends). A report names
-- (effect_id, lease_token): effect ids are unique per consumer only, tokens tell two apart. A lease that expired but that nobody reclaimed yet is still current
-- (its holder may still report, and the effect is not delivered twice for it). Any other report
-- (the effect was reclaimed under a new token, already reported, redriven or purged) is refused:
-- complete_effect returns false, fail_effect returns 'fenced', extend_lease returns NULL, the
-- set-based complete_effects / fail_effects return result 'fenced' with a reason, and every
-- refusal is recorded in inbox.outbox_fenced_report. A refused dispatcher drops the effect.
-- The rules live once, in the set-based helpers below (_complete_reports, _fail_reports,
-- _report_outcomes); the single-effect functions call them with one-element arrays.

-- The outcome of each report of a call, in input order (ord = position in the input arrays, from
-- 1). `accepted` holds the positions the caller applied, `outcomes` their results (same order);
-- every other report is refused by fencing: recorded in inbox.outbox_fenced_report (one row each,
-- like the single functions) and returned as 'fenced' with a reason: unknown_effect (no such
-- row: never enqueued, or purged), not_leased (delivered, pending again, dead, discarded, or
-- reported earlier in the same call), superseded (leased again under another token) or
-- not_lease_holder (the token is current, but another role holds the lease).
CREATE OR REPLACE FUNCTION inbox._report_outcomes(
    report text, effect_ids text[], lease_tokens bigint[], accepted integer[], outcomes text[])
    RETURNS TABLE (ord integer, effect_id text, lease_token bigint, result text, fenced_reason text)
    LANGUAGE plpgsql VOLATILE
    SET plan_cache_mode = force_generic_plan  -- planned once per session: cheap single reports
AS $$
BEGIN
    IF pg_catalog.cardinality(_report_outcomes.accepted) = pg_catalog.cardinality(_report_outcomes.effect_ids) THEN
        RETURN QUERY  -- all accepted (the usual case): nothing to record
        SELECT u.n::integer, u.id, u.token, a.outcome, NULL::text
          FROM ROWS FROM (pg_catalog.unnest(_report_outcomes.effect_ids),
                          pg_catalog.unnest(_report_outcomes.lease_tokens))
               WITH ORDINALITY AS u (id, token, n)
          JOIN ROWS FROM (pg_catalog.unnest(_report_outcomes.accepted),
                          pg_catalog.unnest(_report_outcomes.outcomes)) AS a (n, outcome)
            ON a.n = u.n
         ORDER BY u.n;
        RETURN;
    END IF;
    RETURN QUERY
    WITH input AS (
        SELECT u.n::integer AS n, u.id, u.token, a.outcome
          FROM ROWS FROM (pg_catalog.unnest(_report_outcomes.effect_ids),
                          pg_catalog.unnest(_report_outcomes.lease_tokens))
               WITH ORDINALITY AS u (id, token, n)
          LEFT JOIN ROWS FROM (pg_catalog.unnest(_report_outcomes.accepted),
                               pg_catalog.unnest(_report_outcomes.outcomes)) AS a (n, outcome)
                 ON a.n = u.n
    ), refused AS MATERIALIZED (
        -- The effect the report names: the one with its token, else any row of the id.
        SELECT i.n, i.id, i.token, o.status, o.lease_token AS current_token
          FROM input i
          LEFT JOIN LATERAL (SELECT x.status, x.lease_token FROM inbox.outbox x
                              WHERE x.effect_id = i.id
                              ORDER BY x.lease_token = i.token DESC NULLS LAST, x.consumer, x.tenant
                              LIMIT 1) o ON true
         WHERE i.outcome IS NULL
    ), recorded AS (
        INSERT INTO inbox.outbox_fenced_report (effect_id, lease_token, report, application_name, current_status,
                                                current_token)
        SELECT r.id, r.token, _report_outcomes.report, NULLIF(pg_catalog.current_setting('application_name'), ''),
               r.status, r.current_token
          FROM refused r
         ORDER BY r.n
    )
    SELECT i.n, i.id, i.token, coalesce(i.outcome, 'fenced'),
           CASE WHEN i.outcome IS NOT NULL THEN NULL
                WHEN r.status IS NULL THEN 'unknown_effect'
                WHEN r.status <> 'leased' THEN 'not_leased'
                WHEN r.current_token = i.token THEN 'not_lease_holder'
                ELSE 'superseded' END
      FROM input i
      LEFT JOIN refused r ON r.n = i.n
     ORDER BY i.n;
END
$$;
COMMENT ON FUNCTION inbox._report_outcomes(text, text[], bigint[], integer[], text[]) IS
    'internal: one result row per report; records the refused ones in inbox.outbox_fenced_report';

-- The next undelivered effect of each ordering key (of consumer `consumers[i]` and tenant
-- `tenants[i]`) after order_seq `seqs[i]` becomes the head: unblocked if claim_effects had set it
-- aside. The caller holds the row locks of the effects that closed (its UPDATE): a claim that was
-- setting a successor aside held a share lock on that row, so the caller waited for it, and this
-- statement (a new snapshot) sees the successor blocked. Returns how many effects were unblocked.
DROP FUNCTION IF EXISTS inbox._unblock_successors(text[], bigint[]);
CREATE OR REPLACE FUNCTION inbox._unblock_successors(consumers text[], tenants text[], keys text[], seqs bigint[])
    RETURNS integer
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    unblocked integer;
BEGIN
    UPDATE inbox.outbox o
       SET blocked = false
     WHERE (o.effect_id, o.consumer, o.tenant) IN (
               SELECT n.effect_id, n.consumer, n.tenant
                 FROM ROWS FROM (pg_catalog.unnest(_unblock_successors.consumers),
                                 pg_catalog.unnest(_unblock_successors.tenants),
                                 pg_catalog.unnest(_unblock_successors.keys),
                                 pg_catalog.unnest(_unblock_successors.seqs)) AS k (consumer, tenant, key, seq)
                 CROSS JOIN LATERAL (
                     SELECT x.effect_id, x.consumer, x.tenant FROM inbox.outbox x
                      WHERE x.consumer = k.consumer AND x.tenant = k.tenant AND x.ordering_key = k.key
                        AND x.order_seq > k.seq AND x.status IN ('pending', 'leased', 'dead')
                      ORDER BY x.order_seq
                      LIMIT 1) n)
       AND o.blocked;
    GET DIAGNOSTICS unblocked = ROW_COUNT;
    RETURN unblocked;
END
$$;
COMMENT ON FUNCTION inbox._unblock_successors(text[], text[], text[], bigint[]) IS
    'internal: unblocks the next undelivered effect of each ordering key (of a consumer and tenant) after its head closed';

-- The error and retryable flag of a failure report (22004, 22023).
CREATE OR REPLACE FUNCTION inbox._check_failure(fn text, error text, retryable boolean) RETURNS void
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF error IS NULL OR error !~ '\S' THEN
        RAISE EXCEPTION '%: error must say what went wrong', fn
            USING ERRCODE = CASE WHEN error IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = 'Pass the exception''s type when its message is empty.';
    END IF;
    IF retryable IS NULL THEN
        RAISE EXCEPTION '%: retryable must not be NULL', fn USING ERRCODE = 'null_value_not_allowed';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_failure(text, text, boolean) IS
    'internal: validates the error and retryable flag of a failure report (22004, 22023)';

-- The arrays of a set-based report call: present (22004), one-dimensional and of one length
-- (22023), at most 1000 reports (54000); then each report as the single functions check it, the
-- message naming its position ("inbox.fail_effects: report 3: error must say what went wrong").
-- Optional arrays may be NULL (no value for any report). Nothing is written before this passes.
CREATE OR REPLACE FUNCTION inbox._check_reports(
    fn text, failures boolean, effect_ids text[], lease_tokens bigint[], status_codes integer[],
    response_excerpts text[], durations_ms integer[], errors text[], retryables boolean[])
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    n integer;
    arg record;
BEGIN
    FOR arg IN
        SELECT a.name, a.required, a.ndims, a.len
          FROM (VALUES ('effect_ids', true, pg_catalog.array_ndims(effect_ids), pg_catalog.cardinality(effect_ids)),
                       ('lease_tokens', true, pg_catalog.array_ndims(lease_tokens), pg_catalog.cardinality(lease_tokens)),
                       ('errors', failures, pg_catalog.array_ndims(errors), pg_catalog.cardinality(errors)),
                       ('retryables', failures, pg_catalog.array_ndims(retryables), pg_catalog.cardinality(retryables)),
                       ('status_codes', false, pg_catalog.array_ndims(status_codes), pg_catalog.cardinality(status_codes)),
                       ('response_excerpts', false, pg_catalog.array_ndims(response_excerpts),
                        pg_catalog.cardinality(response_excerpts)),
                       ('durations_ms', false, pg_catalog.array_ndims(durations_ms), pg_catalog.cardinality(durations_ms))
               ) AS a (name, required, ndims, len)
    LOOP
        IF arg.len IS NULL AND arg.required THEN
            RAISE EXCEPTION '%: % must not be NULL', fn, arg.name
                USING ERRCODE = 'null_value_not_allowed', HINT = 'Pass an array with one element per report.';
        END IF;
        IF arg.ndims > 1 THEN
            RAISE EXCEPTION '%: % must be a one-dimensional array, got % dimensions', fn, arg.name, arg.ndims
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF n IS NULL THEN
            n := arg.len;  -- effect_ids comes first
            IF n > 1000 THEN
                RAISE EXCEPTION '%: % reports in one call, the limit is 1000', fn, n
                    USING ERRCODE = 'program_limit_exceeded', HINT = 'Split the reports into calls of at most 1000.';
            END IF;
        ELSIF arg.len IS NOT NULL AND arg.len <> n THEN
            RAISE EXCEPTION '%: % has % elements, effect_ids has %', fn, arg.name, arg.len, n
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass one element per report, in the order of effect_ids (NULL elements for no value).';
        END IF;
    END LOOP;
    -- One pass over all reports; only when one is bad, find the first and name what is wrong.
    IF EXISTS (SELECT FROM ROWS FROM (pg_catalog.unnest(effect_ids),
                                      pg_catalog.unnest(lease_tokens),
                                      pg_catalog.unnest(status_codes),
                                      pg_catalog.unnest(durations_ms),
                                      pg_catalog.unnest(errors),
                                      pg_catalog.unnest(retryables))
                            AS u (id, token, code, ms, error, retryable)
                WHERE u.id IS NULL OR u.id = '' OR pg_catalog.octet_length(u.id) > 256 OR u.token IS NULL
                   OR u.code NOT BETWEEN 100 AND 599 OR u.ms < 0
                   OR (failures AND (u.error IS NULL OR u.error !~ '\S' OR u.retryable IS NULL))) THEN
        FOR i IN 1..n LOOP
            PERFORM inbox._check_report(pg_catalog.format('%s: report %s', fn, i), effect_ids[i], lease_tokens[i],
                                        status_codes[i], durations_ms[i]);
            IF failures THEN
                PERFORM inbox._check_failure(pg_catalog.format('%s: report %s', fn, i), errors[i], retryables[i]);
            END IF;
        END LOOP;
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_reports(text, boolean, text[], bigint[], integer[], text[], integer[], text[], boolean[]) IS
    'internal: validates the arrays of complete_effects / fail_effects (22004, 22023, 22001, 54000)';

-- Delivered: the destination accepted the effects. Each report is applied only while its effect
-- is leased under its token (a second report of the same lease in the same call is refused, as a
-- second call would be). The next undelivered effect of each delivered effect's ordering key
-- becomes the head: unblocked if claim_effects had set it aside (if a claim is setting it aside
-- right now, the UPDATE here waits for that claim, then the unblocking sees it).
CREATE OR REPLACE FUNCTION inbox._complete_reports(
    effect_ids text[], lease_tokens bigint[], status_codes integer[], response_excerpts text[], durations_ms integer[])
    RETURNS TABLE (ord integer, effect_id text, lease_token bigint, result text, fenced_reason text)
    LANGUAGE plpgsql VOLATILE
    SET plan_cache_mode = force_generic_plan  -- planned once per session: cheap single reports
AS $$
DECLARE
    report jsonb;
    accepted integer[];
    outcomes text[];
    key_consumers text[];
    key_tenants text[];
    keys text[];
    seqs bigint[];
    holder oid := (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = inbox._caller());  -- the lease's role
BEGIN
    -- The reports as ONE map from 'effect_id lease_token' (the token has no space: unambiguous) to
    -- [position, status_code, excerpt, duration]; for a repeated report the first position wins.
    -- No join: the UPDATE finds the rows by primary key, whatever the planner's row estimates.
    SELECT pg_catalog.jsonb_object_agg(u.id || ' ' || u.token, pg_catalog.jsonb_build_array(u.n, u.code, u.excerpt, u.ms)
                                       ORDER BY u.n DESC)
      INTO report
      FROM ROWS FROM (pg_catalog.unnest(_complete_reports.effect_ids),
                      pg_catalog.unnest(_complete_reports.lease_tokens),
                      pg_catalog.unnest(_complete_reports.status_codes),
                      pg_catalog.unnest(_complete_reports.response_excerpts),
                      pg_catalog.unnest(_complete_reports.durations_ms)) WITH ORDINALITY AS u (id, token, code, excerpt, ms, n);
    WITH delivered AS (
        UPDATE inbox.outbox o
           SET status = 'delivered', delivered_at = now(), lease_expires_at = NULL,
               last_status_code = (report -> (o.effect_id || ' ' || o.lease_token) ->> 1)::integer,
               last_response_excerpt = pg_catalog.left(report -> (o.effect_id || ' ' || o.lease_token) ->> 2, 2000),
               last_duration_ms = (report -> (o.effect_id || ' ' || o.lease_token) ->> 3)::integer
         WHERE o.effect_id IN (SELECT pg_catalog.unnest(_complete_reports.effect_ids)) AND o.status = 'leased'
           AND (o.lease_role = holder OR o.lease_role IS NULL)
           AND report ? (o.effect_id || ' ' || o.lease_token)
        RETURNING (report -> (o.effect_id || ' ' || o.lease_token) ->> 0)::integer AS n, o.consumer, o.tenant,
                  o.ordering_key, o.order_seq
    )
    SELECT coalesce(array_agg(d.n), '{}'), coalesce(array_agg('delivered'::text), '{}'),
           array_agg(d.consumer) FILTER (WHERE d.ordering_key IS NOT NULL AND d.order_seq IS NOT NULL),
           array_agg(d.tenant) FILTER (WHERE d.ordering_key IS NOT NULL AND d.order_seq IS NOT NULL),
           array_agg(d.ordering_key) FILTER (WHERE d.ordering_key IS NOT NULL AND d.order_seq IS NOT NULL),
           array_agg(d.order_seq) FILTER (WHERE d.ordering_key IS NOT NULL AND d.order_seq IS NOT NULL)
      INTO accepted, outcomes, key_consumers, key_tenants, keys, seqs
      FROM delivered d;
    IF keys IS NOT NULL THEN
        PERFORM inbox._unblock_successors(key_consumers, key_tenants, keys, seqs);
    END IF;
    RETURN QUERY
    SELECT r.ord, r.effect_id, r.lease_token, r.result, r.fenced_reason
      FROM inbox._report_outcomes('complete', _complete_reports.effect_ids, _complete_reports.lease_tokens, accepted,
                                  outcomes) r;
END
$$;
COMMENT ON FUNCTION inbox._complete_reports(text[], bigint[], integer[], text[], integer[]) IS
    'internal: applies delivery reports (fenced), unblocks ordering-key successors; one result row per report';

-- Failed attempts. Retryable (an ambiguous timeout too: the retry carries the same effect id):
-- pending again after the destination's backoff, or dead once attempts reached max_attempts.
-- Not retryable: dead at once. Fenced like _complete_reports. A failed keyed effect stays the
-- head of its key.
CREATE OR REPLACE FUNCTION inbox._fail_reports(
    effect_ids text[], lease_tokens bigint[], errors text[], retryables boolean[], status_codes integer[],
    response_excerpts text[], durations_ms integer[])
    RETURNS TABLE (ord integer, effect_id text, lease_token bigint, result text, fenced_reason text)
    LANGUAGE plpgsql VOLATILE
    SET plan_cache_mode = force_generic_plan  -- planned once per session: cheap single reports
AS $$
DECLARE
    report jsonb;
    decided jsonb;
    accepted integer[];
    outcomes text[];
    holder oid := (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = inbox._caller());  -- the lease's role
BEGIN
    -- As in _complete_reports: one map 'effect_id lease_token' -> [position, error, retryable,
    -- status_code, excerpt, duration], first position first; then the new status and backoff of
    -- each current lease (attempts cannot change while the token stays). The UPDATE applies them to
    -- the rows still leased under the same token (a claim may have taken one meanwhile: fenced).
    SELECT pg_catalog.jsonb_object_agg(u.id || ' ' || u.token,
                                       pg_catalog.jsonb_build_array(u.n, u.error, u.retryable, u.code, u.excerpt, u.ms)
                                       ORDER BY u.n DESC)
      INTO report
      FROM ROWS FROM (pg_catalog.unnest(_fail_reports.effect_ids),
                      pg_catalog.unnest(_fail_reports.lease_tokens),
                      pg_catalog.unnest(_fail_reports.errors),
                      pg_catalog.unnest(_fail_reports.retryables),
                      pg_catalog.unnest(_fail_reports.status_codes),
                      pg_catalog.unnest(_fail_reports.response_excerpts),
                      pg_catalog.unnest(_fail_reports.durations_ms))
           WITH ORDINALITY AS u (id, token, error, retryable, code, excerpt, ms, n);
    SELECT pg_catalog.jsonb_object_agg(
               c.k, c.v || pg_catalog.jsonb_build_array(
                   CASE WHEN (c.v ->> 2)::boolean AND c.attempts < (c.policy).max_attempts THEN 'pending' ELSE 'dead' END,
                   pg_catalog.date_part('epoch', inbox._backoff(c.policy, c.attempts))))
      INTO decided
      FROM (SELECT o.effect_id || ' ' || o.lease_token AS k, report -> (o.effect_id || ' ' || o.lease_token) AS v,
                   o.attempts,
                   coalesce((SELECT d FROM inbox.outbox_destination d WHERE d.destination = o.destination),
                            inbox._default_destination(o.destination)) AS policy
              FROM inbox.outbox o
             WHERE o.effect_id IN (SELECT pg_catalog.unnest(_fail_reports.effect_ids)) AND o.status = 'leased'
               AND (o.lease_role = holder OR o.lease_role IS NULL)
               AND report ? (o.effect_id || ' ' || o.lease_token)) c;
    -- decided: 'effect_id lease_token' -> [position, error, retryable, code, excerpt, ms, new status, backoff s]
    WITH failed AS (
        UPDATE inbox.outbox o
           SET status = (decided -> (o.effect_id || ' ' || o.lease_token) ->> 6)::inbox.effect_status,
               available_at = CASE WHEN decided -> (o.effect_id || ' ' || o.lease_token) ->> 6 = 'pending'
                                   THEN now() + pg_catalog.make_interval(
                                            secs => (decided -> (o.effect_id || ' ' || o.lease_token) ->> 7)::double precision)
                                   ELSE o.available_at END,
               lease_expires_at = NULL,
               last_error = pg_catalog.left(decided -> (o.effect_id || ' ' || o.lease_token) ->> 1, 2000),
               last_status_code = (decided -> (o.effect_id || ' ' || o.lease_token) ->> 3)::integer,
               last_response_excerpt = pg_catalog.left(decided -> (o.effect_id || ' ' || o.lease_token) ->> 4, 2000),
               last_duration_ms = (decided -> (o.effect_id || ' ' || o.lease_token) ->> 5)::integer,
               dead_reason = CASE WHEN decided -> (o.effect_id || ' ' || o.lease_token) ->> 6 = 'pending' THEN NULL
                                  WHEN (decided -> (o.effect_id || ' ' || o.lease_token) ->> 2)::boolean THEN 'max_attempts'
                                  ELSE 'permanent_failure' END
         WHERE o.effect_id IN (SELECT pg_catalog.unnest(_fail_reports.effect_ids)) AND o.status = 'leased'
           AND (o.lease_role = holder OR o.lease_role IS NULL)
           AND decided ? (o.effect_id || ' ' || o.lease_token)
        RETURNING (decided -> (o.effect_id || ' ' || o.lease_token) ->> 0)::integer AS n, o.status
    )
    SELECT coalesce(array_agg(f.n), '{}'), coalesce(array_agg(f.status::text), '{}')
      INTO accepted, outcomes
      FROM failed f;
    RETURN QUERY
    SELECT r.ord, r.effect_id, r.lease_token, r.result, r.fenced_reason
      FROM inbox._report_outcomes('fail', _fail_reports.effect_ids, _fail_reports.lease_tokens, accepted, outcomes) r;
END
$$;
COMMENT ON FUNCTION inbox._fail_reports(text[], bigint[], text[], boolean[], integer[], text[], integer[]) IS
    'internal: applies failure reports (fenced): pending after backoff | dead; one result row per report';

-- Set-based reports, for a dispatcher that batches them: one statement (and one commit) for up
-- to 1000 reports. Each element follows exactly the rules of complete_effect / fail_effect.
CREATE OR REPLACE FUNCTION inbox.complete_effects(
    effect_ids text[], lease_tokens bigint[], status_codes integer[] DEFAULT NULL,
    response_excerpts text[] DEFAULT NULL, durations_ms integer[] DEFAULT NULL)
    RETURNS TABLE (ord integer, effect_id text, lease_token bigint, result text, fenced_reason text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    ROWS 100
AS $$
BEGIN
    PERFORM inbox._check_reports('inbox.complete_effects', false, complete_effects.effect_ids,
                                 complete_effects.lease_tokens, complete_effects.status_codes,
                                 complete_effects.response_excerpts, complete_effects.durations_ms, NULL, NULL);
    RETURN QUERY
    SELECT r.ord, r.effect_id, r.lease_token, r.result, r.fenced_reason
      FROM inbox._complete_reports(complete_effects.effect_ids, complete_effects.lease_tokens,
                                   complete_effects.status_codes, complete_effects.response_excerpts,
                                   complete_effects.durations_ms) r;
END
$$;
COMMENT ON FUNCTION inbox.complete_effects(text[], bigint[], integer[], text[], integer[]) IS
    'Report up to 1000 deliveries at once (each fenced by its lease token): one row per report, delivered | fenced (with the reason)';

CREATE OR REPLACE FUNCTION inbox.fail_effects(
    effect_ids text[], lease_tokens bigint[], errors text[], retryables boolean[], status_codes integer[] DEFAULT NULL,
    response_excerpts text[] DEFAULT NULL, durations_ms integer[] DEFAULT NULL)
    RETURNS TABLE (ord integer, effect_id text, lease_token bigint, result text, fenced_reason text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    ROWS 100
AS $$
BEGIN
    PERFORM inbox._check_reports('inbox.fail_effects', true, fail_effects.effect_ids, fail_effects.lease_tokens,
                                 fail_effects.status_codes, fail_effects.response_excerpts, fail_effects.durations_ms,
                                 fail_effects.errors, fail_effects.retryables);
    RETURN QUERY
    SELECT r.ord, r.effect_id, r.lease_token, r.result, r.fenced_reason
      FROM inbox._fail_reports(fail_effects.effect_ids, fail_effects.lease_tokens, fail_effects.errors,
                               fail_effects.retryables, fail_effects.status_codes, fail_effects.response_excerpts,
                               fail_effects.durations_ms) r;
END
$$;
COMMENT ON FUNCTION inbox.fail_effects(text[], bigint[], text[], boolean[], integer[], text[], integer[]) IS
    'Report up to 1000 failed attempts at once (each fenced by its lease token): one row per report, pending | dead | fenced (with the reason)';

-- Delivered: one report, by the rules of complete_effects. true = delivered, false = fenced.
CREATE OR REPLACE FUNCTION inbox.complete_effect(
    effect_id text, lease_token bigint, status_code integer DEFAULT NULL, response_excerpt text DEFAULT NULL,
    duration_ms integer DEFAULT NULL)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_report('inbox.complete_effect', complete_effect.effect_id, complete_effect.lease_token,
                                complete_effect.status_code, complete_effect.duration_ms);
    RETURN (SELECT r.result = 'delivered'
              FROM inbox._complete_reports(ARRAY[complete_effect.effect_id], ARRAY[complete_effect.lease_token],
                                           ARRAY[complete_effect.status_code], ARRAY[complete_effect.response_excerpt],
                                           ARRAY[complete_effect.duration_ms]) r);
END
$$;
COMMENT ON FUNCTION inbox.complete_effect(text, bigint, integer, text, integer) IS
    'Report a delivery (fenced by the lease token): true = delivered, false = refused, the lease is not current';

-- A failed attempt: one report, by the rules of fail_effects. Returns the new status (pending,
-- dead), or 'fenced' when the lease is not current.
CREATE OR REPLACE FUNCTION inbox.fail_effect(
    effect_id text, lease_token bigint, error text, retryable boolean DEFAULT true, status_code integer DEFAULT NULL,
    response_excerpt text DEFAULT NULL, duration_ms integer DEFAULT NULL)
    RETURNS text
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_report('inbox.fail_effect', fail_effect.effect_id, fail_effect.lease_token,
                                fail_effect.status_code, fail_effect.duration_ms);
    PERFORM inbox._check_failure('inbox.fail_effect', fail_effect.error, fail_effect.retryable);
    RETURN (SELECT r.result
              FROM inbox._fail_reports(ARRAY[fail_effect.effect_id], ARRAY[fail_effect.lease_token],
                                       ARRAY[fail_effect.error], ARRAY[fail_effect.retryable],
                                       ARRAY[fail_effect.status_code], ARRAY[fail_effect.response_excerpt],
                                       ARRAY[fail_effect.duration_ms]) r);
END
$$;
COMMENT ON FUNCTION inbox.fail_effect(text, bigint, text, boolean, integer, text, integer) IS
    'Report a failed attempt (fenced by the lease token): pending (retry after backoff) | dead | fenced';

-- More time for a slow delivery: the lease now ends at now() + lease. NULL when the lease is not
-- current (fenced): the dispatcher must abandon the effect.
CREATE OR REPLACE FUNCTION inbox.extend_lease(effect_id text, lease_token bigint, lease interval) RETURNS timestamptz
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    expires timestamptz;
BEGIN
    PERFORM inbox._check_report('inbox.extend_lease', extend_lease.effect_id, extend_lease.lease_token, NULL, NULL);
    PERFORM inbox._check_lease('inbox.extend_lease', extend_lease.lease);
    UPDATE inbox.outbox o
       SET lease_expires_at = now() + extend_lease.lease, available_at = now() + extend_lease.lease
     WHERE o.effect_id = extend_lease.effect_id AND o.status = 'leased' AND o.lease_token = extend_lease.lease_token
       AND (o.lease_role = (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = inbox._caller())
            OR o.lease_role IS NULL)
    RETURNING o.lease_expires_at INTO expires;
    IF FOUND THEN
        RETURN expires;
    END IF;
    PERFORM inbox._report_outcomes('extend', ARRAY[extend_lease.effect_id], ARRAY[extend_lease.lease_token], '{}', '{}');
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION inbox.extend_lease(text, bigint, interval) IS
    'Extend a lease (fenced by the lease token): the new expiry, or NULL when the lease is not current';

-- ------------------------------------------------------------------ operations

-- What an operator decision on a dead effect checks first (redrive, discard): a valid id and a
-- note, an effect that exists and is dead. Effect ids are unique per consumer and tenant: consumer
-- (or tenant) NULL finds the effect without it, and refuses (P0003) when several consumers or
-- tenants hold that id. Returns the effect locked (FOR UPDATE).
DROP FUNCTION IF EXISTS inbox._lock_dead_effect(text, text, text, text, text, text, text);
CREATE OR REPLACE FUNCTION inbox._lock_dead_effect(fn text, verb text, effect_id text, consumer text, tenant text,
                                                   note text, audit text, not_dead_hint text)
    RETURNS inbox.outbox
    LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    effect inbox.outbox;
    holders text[];
    holder_tenants text[];
BEGIN
    PERFORM inbox._check_text(fn, 'effect_id', _lock_dead_effect.effect_id, 256);
    IF _lock_dead_effect.note IS NULL OR _lock_dead_effect.note !~ '\S' THEN
        RAISE EXCEPTION '%: a % needs a note saying why', fn, verb
            USING ERRCODE = CASE WHEN _lock_dead_effect.note IS NULL THEN 'null_value_not_allowed' ELSE 'invalid_parameter_value' END,
                  HINT = pg_catalog.format('The note goes into the audit trail (%s).', audit);
    END IF;
    SELECT pg_catalog.array_agg(o.consumer ORDER BY o.consumer, o.tenant),
           pg_catalog.array_agg(o.tenant ORDER BY o.consumer, o.tenant)
      INTO holders, holder_tenants
      FROM inbox.outbox o
     WHERE o.effect_id = _lock_dead_effect.effect_id
       AND (_lock_dead_effect.consumer IS NULL OR o.consumer = _lock_dead_effect.consumer)
       AND (_lock_dead_effect.tenant IS NULL OR o.tenant = _lock_dead_effect.tenant);
    IF pg_catalog.cardinality(holders) > 1 THEN
        RAISE EXCEPTION '%: effect % is held by % consumers or tenants', fn,
            pg_catalog.quote_literal(_lock_dead_effect.effect_id), pg_catalog.cardinality(holders)
            USING ERRCODE = 'too_many_rows',
                  HINT = pg_catalog.format('Name the one you mean: %s.',
                                           (SELECT pg_catalog.string_agg(pg_catalog.format('consumer => %L, tenant => %L', h, t), '; ')
                                              FROM ROWS FROM (pg_catalog.unnest(holders), pg_catalog.unnest(holder_tenants)) x(h, t)));
    END IF;
    SELECT o.* INTO effect FROM inbox.outbox o
     WHERE o.effect_id = _lock_dead_effect.effect_id AND o.consumer = holders[1] AND o.tenant = holder_tenants[1]
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: no effect %', fn,
            pg_catalog.quote_literal(_lock_dead_effect.effect_id)
            || coalesce(' of consumer ' || pg_catalog.quote_literal(_lock_dead_effect.consumer), '')
            || coalesce(' for tenant ' || pg_catalog.quote_literal(_lock_dead_effect.tenant), '')
            USING ERRCODE = 'no_data_found';
    END IF;
    IF effect.status <> 'dead' THEN
        RAISE EXCEPTION '%: effect % is %, not dead', fn, pg_catalog.quote_literal(effect.effect_id), effect.status
            USING ERRCODE = 'object_not_in_prerequisite_state', HINT = not_dead_hint;
    END IF;
    RETURN effect;
END
$$;
COMMENT ON FUNCTION inbox._lock_dead_effect(text, text, text, text, text, text, text, text) IS
    'internal: validates an operator decision on a dead effect and returns the effect locked (22004, 22023, 22001, P0002, P0003, 55000)';

-- dead -> pending, due now, attempts reset; one audit row with the session user and the note.
-- The effect keeps its place in its ordering key. consumer, tenant: whose effect, needed only when
-- several consumers or tenants hold the id (the signature without them is dropped).
DROP FUNCTION IF EXISTS inbox.redrive_effect(text, text, text);
CREATE OR REPLACE FUNCTION inbox.redrive_effect(effect_id text, note text, consumer text DEFAULT NULL,
                                                tenant text DEFAULT NULL)
    RETURNS inbox.outbox
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    effect inbox.outbox;
BEGIN
    effect := inbox._lock_dead_effect('inbox.redrive_effect', 'redrive', redrive_effect.effect_id, redrive_effect.consumer,
                                      redrive_effect.tenant, redrive_effect.note, 'inbox.outbox_redrive',
                                      'Only dead effects can be redriven.');
    INSERT INTO inbox.outbox_redrive (effect_id, consumer, tenant, note, attempts, dead_reason, last_error)
    VALUES (effect.effect_id, effect.consumer, effect.tenant, redrive_effect.note, effect.attempts, effect.dead_reason,
            effect.last_error);
    UPDATE inbox.outbox o
       SET status = 'pending', attempts = 0, available_at = now(), lease_expires_at = NULL, dead_reason = NULL
     WHERE o.effect_id = effect.effect_id AND o.consumer = effect.consumer AND o.tenant = effect.tenant
    RETURNING o.* INTO effect;
    IF EXISTS (SELECT FROM inbox.outbox_waiter) THEN
        PERFORM inbox._wake_dispatchers();
    END IF;
    RETURN effect;
END
$$;
COMMENT ON FUNCTION inbox.redrive_effect(text, text, text, text) IS
    'Send a dead effect again (dead -> pending, attempts reset), audited; consumer and tenant when several hold the id';

-- dead -> discarded: closed without delivery, for good (a repeat enqueue of its id is a no-op while
-- the row is kept). One audit row with the session user and the note. A discarded effect no longer
-- holds its ordering key: the next effect of the key becomes the head (unblocked, and idle
-- dispatchers woken at commit). Only a dead effect can be discarded: a pending or leased one may
-- be in the middle of a delivery, a delivered one is done. consumer, tenant: as for redrive_effect.
DROP FUNCTION IF EXISTS inbox.discard_effect(text, text, text);
CREATE OR REPLACE FUNCTION inbox.discard_effect(effect_id text, note text, consumer text DEFAULT NULL,
                                                tenant text DEFAULT NULL)
    RETURNS inbox.outbox
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    effect inbox.outbox;
BEGIN
    effect := inbox._lock_dead_effect('inbox.discard_effect', 'discard', discard_effect.effect_id, discard_effect.consumer,
                                      discard_effect.tenant, discard_effect.note, 'inbox.outbox_discard',
                                      'Only dead effects can be discarded; a pending or leased effect is still being delivered.');
    INSERT INTO inbox.outbox_discard (effect_id, consumer, tenant, note, attempts, dead_reason, last_error)
    VALUES (effect.effect_id, effect.consumer, effect.tenant, discard_effect.note, effect.attempts, effect.dead_reason,
            effect.last_error);
    UPDATE inbox.outbox o
       SET status = 'discarded', discarded_at = now(), blocked = false, lease_expires_at = NULL
     WHERE o.effect_id = effect.effect_id AND o.consumer = effect.consumer AND o.tenant = effect.tenant
    RETURNING o.* INTO effect;
    IF effect.ordering_key IS NOT NULL AND effect.order_seq IS NOT NULL THEN
        PERFORM inbox._unblock_successors(ARRAY[effect.consumer], ARRAY[effect.tenant], ARRAY[effect.ordering_key],
                                          ARRAY[effect.order_seq]);
        IF EXISTS (SELECT FROM inbox.outbox_waiter) THEN
            PERFORM inbox._wake_dispatchers();  -- the next effect of the key may be due now
        END IF;
    END IF;
    RETURN effect;
END
$$;
COMMENT ON FUNCTION inbox.discard_effect(text, text, text, text) IS
    'Close a dead effect without delivery (dead -> discarded), audited; its ordering key moves on to the next effect; consumer and tenant when several hold the id';

-- Deletes, older than older_than and at most batch_size rows in all: delivered effects (by
-- delivered_at, oldest first), then discarded effects (by discarded_at), then refused-report
-- records of inbox.outbox_fenced_report (by reported_at). Returns how many rows it deleted;
-- callers loop until it returns 0. Rows another purger holds are skipped. The audit trails
-- (inbox.outbox_redrive, inbox.outbox_discard) are kept. Once an effect's row is gone, the same
-- effect id can be enqueued again: keep closed effects at least as long as a handler can re-run
-- for the same message.
CREATE OR REPLACE FUNCTION inbox.purge_delivered_effects(older_than interval, batch_size integer DEFAULT 1000) RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    purged integer;
    deleted integer;
    left_over integer;
BEGIN
    IF purge_delivered_effects.older_than IS NULL OR purge_delivered_effects.batch_size IS NULL THEN
        RAISE EXCEPTION 'inbox.purge_delivered_effects: % must not be NULL',
            CASE WHEN purge_delivered_effects.older_than IS NULL THEN 'older_than' ELSE 'batch_size' END
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF purge_delivered_effects.older_than < '0'::interval THEN
        RAISE EXCEPTION 'inbox.purge_delivered_effects: older_than must not be negative, got %',
            purge_delivered_effects.older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF purge_delivered_effects.batch_size NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'inbox.purge_delivered_effects: batch_size must be between 1 and 100000, got %',
            purge_delivered_effects.batch_size USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- MATERIALIZED: evaluated once. A rescan would skip the rows this statement already deleted
    -- and pick the next ones, past batch_size.
    WITH doomed AS MATERIALIZED (
        SELECT x.effect_id, x.consumer, x.tenant FROM inbox.outbox x
         WHERE x.status IN ('delivered', 'discarded')
           AND coalesce(x.delivered_at, x.discarded_at) < now() - purge_delivered_effects.older_than
         ORDER BY coalesce(x.delivered_at, x.discarded_at)
         LIMIT purge_delivered_effects.batch_size
           FOR UPDATE SKIP LOCKED
    )
    DELETE FROM inbox.outbox o USING doomed d
     WHERE o.effect_id = d.effect_id AND o.consumer = d.consumer AND o.tenant = d.tenant;
    GET DIAGNOSTICS purged = ROW_COUNT;
    left_over := purge_delivered_effects.batch_size - purged;
    IF left_over > 0 THEN
        WITH doomed AS MATERIALIZED (
            SELECT f.report_id FROM inbox.outbox_fenced_report f
             WHERE f.reported_at < now() - purge_delivered_effects.older_than
             ORDER BY f.reported_at
             LIMIT left_over
               FOR UPDATE SKIP LOCKED
        )
        DELETE FROM inbox.outbox_fenced_report f USING doomed d
         WHERE f.report_id = d.report_id;
        GET DIAGNOSTICS deleted = ROW_COUNT;
        purged := purged + deleted;
    END IF;
    RETURN purged;
END
$$;
COMMENT ON FUNCTION inbox.purge_delivered_effects(interval, integer) IS
    'Delete up to batch_size delivered and discarded effects and fenced-report records older than older_than; returns how many (loop until 0)';

REVOKE ALL ON FUNCTION inbox.enqueue_effect(text, text, jsonb, jsonb, text, timestamptz, text, text),
    inbox.effect_id(text, text, text, text, text),
    inbox.idempotency_key(text, text, text),
    inbox.claim_effects(text, integer, interval, boolean),
    inbox.complete_effect(text, bigint, integer, text, integer),
    inbox.fail_effect(text, bigint, text, boolean, integer, text, integer),
    inbox.complete_effects(text[], bigint[], integer[], text[], integer[]),
    inbox.fail_effects(text[], bigint[], text[], boolean[], integer[], text[], integer[]),
    inbox.extend_lease(text, bigint, interval),
    inbox.dispatcher_idle(text, boolean),
    inbox.configure_destination(text, integer, interval, interval),
    inbox.bind_destination(text, text, text),
    inbox.unbind_destination(text, text, text),
    inbox.redrive_effect(text, text, text, text),
    inbox.discard_effect(text, text, text, text),
    inbox.purge_delivered_effects(interval, integer),
    inbox._order_at_commit(),
    inbox._authorize_enqueue(text, text, text, text), inbox._lock_dead_effect(text, text, text, text, text, text, text, text),
    inbox._headers_ok(jsonb), inbox._new_lease_token() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.enqueue_effect(text, text, jsonb, jsonb, text, timestamptz, text, text),
    inbox.effect_id(text, text, text, text, text),
    inbox._check_text(text, text, text, integer) TO inbox_consumer;
GRANT EXECUTE ON FUNCTION inbox.idempotency_key(text, text, text)
    TO inbox_consumer, inbox_dispatcher, inbox_operator, inbox_reader;
GRANT EXECUTE ON FUNCTION inbox.claim_effects(text, integer, interval, boolean),
    inbox.complete_effect(text, bigint, integer, text, integer),
    inbox.fail_effect(text, bigint, text, boolean, integer, text, integer),
    inbox.complete_effects(text[], bigint[], integer[], text[], integer[]),
    inbox.fail_effects(text[], bigint[], text[], boolean[], integer[], text[], integer[]),
    inbox.extend_lease(text, bigint, interval),
    inbox.dispatcher_idle(text, boolean) TO inbox_dispatcher;
GRANT EXECUTE ON FUNCTION inbox.configure_destination(text, integer, interval, interval),
    inbox.bind_destination(text, text, text),
    inbox.unbind_destination(text, text, text),
    inbox.redrive_effect(text, text, text, text),
    inbox.discard_effect(text, text, text, text) TO inbox_operator;
GRANT EXECUTE ON FUNCTION inbox.purge_delivered_effects(interval, integer) TO inbox_operator, inbox_dispatcher;

COMMIT;
