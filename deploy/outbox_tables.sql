-- Deploy pginbox:outbox_tables. Generated from sql/060_outbox_tables.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: the transactional outbox. A handler cannot call an API atomically with its database
-- change, so it records the intended effect in the same transaction (inbox.enqueue_effect); a
-- dispatcher (role inbox_dispatcher) claims committed effects under a lease with a fencing token,
-- delivers each with its effect id as the idempotency key, and records the remote result.
--   pending -> leased (claim_effects) -> delivered (complete_effect)
--                                    -> pending, after a jittered exponential backoff (fail_effect, retryable)
--                                    -> dead (fail_effect, permanent or at max_attempts; claim_effects, when a
--                                       lease at max_attempts expired without a report)
--   dead -> pending (redrive_effect, by an operator, audited)
--   dead -> discarded (discard_effect, by an operator, audited): closed without delivery
-- Effects that share an ordering_key go out one at a time, in commit order: numbered at commit
-- (_order_at_commit), claimed only at the head of their key, the others set aside until the head
-- is delivered or discarded (claim_effects, complete_effect, discard_effect). A dead head blocks its
-- key until it is redriven or discarded.
-- The functions are in 065_outbox.sql.
BEGIN;

SET LOCAL ROLE inbox_owner;

-- An enum, like inbox.message_status: no CHECK expression to evaluate on every insert.
CREATE TYPE inbox.effect_status AS ENUM ('pending', 'leased', 'delivered', 'dead', 'discarded');
COMMENT ON TYPE inbox.effect_status IS
    'pending: waits for available_at; leased: a dispatcher holds it; delivered: the destination accepted it; dead: given up, until redriven or discarded; discarded: closed by an operator without delivery';

-- Fencing tokens: every claim gets a new one, so a late report of an earlier lease never matches.
CREATE SEQUENCE inbox.outbox_lease_token;
-- Commit order of effects with an ordering key (assigned at commit, see _order_at_commit).
CREATE SEQUENCE inbox.outbox_order_seq;

-- The effects. Every column is written by the functions below only: nobody else has a privilege
-- on this table except SELECT for operators (and readers, without payload, headers and response).
CREATE TABLE inbox.outbox (
    effect_id text NOT NULL,
    destination text NOT NULL,
    payload jsonb NOT NULL,
    payload_sha256 bytea NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}',
    ordering_key text,
    order_seq bigint,
    blocked boolean NOT NULL DEFAULT false,
    status inbox.effect_status NOT NULL DEFAULT 'pending',
    attempts integer NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz NOT NULL DEFAULT now(),
    created_xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    lease_token bigint,
    leased_by text,
    lease_expires_at timestamptz,
    last_attempt_at timestamptz,
    last_error text,
    last_status_code integer,
    last_response_excerpt text,
    last_duration_ms integer,
    delivered_at timestamptz,
    dead_reason text,
    discarded_at timestamptz,
    CONSTRAINT outbox_pkey PRIMARY KEY (effect_id)
);
COMMENT ON TABLE inbox.outbox IS 'Effects to deliver at least once, each under its stable effect id (the idempotency key)';
COMMENT ON COLUMN inbox.outbox.payload_sha256 IS 'inbox.payload_hash(payload): a second enqueue of the id must match it';
COMMENT ON COLUMN inbox.outbox.order_seq IS
    'Commit order among effects with an ordering_key; NULL until the enqueuing transaction commits, and for keyless effects';
COMMENT ON COLUMN inbox.outbox.blocked IS
    'Set aside by claim_effects: waits behind an earlier undelivered effect of its ordering key, until complete_effect delivers that one';
COMMENT ON COLUMN inbox.outbox.available_at IS
    'When the effect can be claimed next: its due time while pending, the lease expiry while leased';
COMMENT ON COLUMN inbox.outbox.created_xid IS 'Top-level transaction that enqueued the effect';
COMMENT ON COLUMN inbox.outbox.attempts IS 'Claims so far (each claim is one delivery attempt)';
COMMENT ON COLUMN inbox.outbox.lease_token IS 'Fencing token of the current (status leased) or last lease';
COMMENT ON COLUMN inbox.outbox.leased_by IS 'Dispatcher holding the current (status leased) or last lease';
COMMENT ON COLUMN inbox.outbox.lease_expires_at IS 'End of the current lease; NULL unless leased';
COMMENT ON COLUMN inbox.outbox.dead_reason IS 'permanent_failure | max_attempts | lease_expired (details in last_error)';
COMMENT ON COLUMN inbox.outbox.discarded_at IS 'When an operator discarded the dead effect (discard_effect); NULL otherwise';

-- The claim scans due effects in due order: pending ones whose time has come and leased ones whose
-- lease expired (available_at is the lease expiry then), in one index. Effects set aside behind
-- their ordering key (blocked) leave it, so a long queue on one key is not scanned again and again.
CREATE INDEX outbox_due_idx ON inbox.outbox (available_at) WHERE status IN ('pending', 'leased') AND NOT blocked;
-- "Is there an earlier undelivered effect with my ordering key?" (keyless effects stay out of it)
CREATE INDEX outbox_order_idx ON inbox.outbox (ordering_key, order_seq)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'leased', 'dead');
-- Keyed effects of a transaction that has not committed yet (the commit-time numbering finds them).
CREATE INDEX outbox_unordered_idx ON inbox.outbox (created_xid) WHERE ordering_key IS NOT NULL AND order_seq IS NULL;
CREATE INDEX outbox_delivered_idx ON inbox.outbox (delivered_at) WHERE status = 'delivered';
CREATE INDEX outbox_dead_idx ON inbox.outbox (created_at) WHERE status = 'dead';
CREATE INDEX outbox_discarded_idx ON inbox.outbox (discarded_at) WHERE status = 'discarded';

-- Per-destination retry policy. Transport settings (URL, method, timeouts) live in the
-- dispatcher's configuration, not here. A destination without a row uses the column defaults.
CREATE TABLE inbox.outbox_destination (
    destination text NOT NULL,
    max_attempts integer NOT NULL DEFAULT 10 CHECK (max_attempts BETWEEN 1 AND 1000),
    base_backoff interval NOT NULL DEFAULT '1 second' CHECK (base_backoff > '0'),
    max_backoff interval NOT NULL DEFAULT '1 hour' CHECK (max_backoff >= base_backoff AND max_backoff <= '30 days'),
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL DEFAULT session_user,
    CONSTRAINT outbox_destination_pkey PRIMARY KEY (destination)
);
COMMENT ON TABLE inbox.outbox_destination IS 'Retry policy per destination; a destination without a row uses the column defaults';

CREATE TABLE inbox.outbox_redrive (
    redrive_id bigint GENERATED ALWAYS AS IDENTITY,
    effect_id text NOT NULL,
    redriven_by text NOT NULL DEFAULT session_user,
    redriven_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    note text NOT NULL,
    attempts integer NOT NULL,
    dead_reason text,
    last_error text,
    CONSTRAINT outbox_redrive_pkey PRIMARY KEY (redrive_id)
);
COMMENT ON TABLE inbox.outbox_redrive IS 'Audit trail: every redrive of a dead effect (who, when, note, and the failure it overrode)';
CREATE INDEX outbox_redrive_effect_idx ON inbox.outbox_redrive (effect_id);

CREATE TABLE inbox.outbox_discard (
    discard_id bigint GENERATED ALWAYS AS IDENTITY,
    effect_id text NOT NULL,
    discarded_by text NOT NULL DEFAULT session_user,
    discarded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    note text NOT NULL,
    attempts integer NOT NULL,
    dead_reason text,
    last_error text,
    CONSTRAINT outbox_discard_pkey PRIMARY KEY (discard_id)
);
COMMENT ON TABLE inbox.outbox_discard IS
    'Audit trail: every discard of a dead effect (who, when, note, and the failure it closed); kept by the purge';
CREATE INDEX outbox_discard_effect_idx ON inbox.outbox_discard (effect_id);

-- Late reports refused by fencing: one row each (counted here rather than in a hot counter row).
CREATE TABLE inbox.outbox_fenced_report (
    report_id bigint GENERATED ALWAYS AS IDENTITY,
    effect_id text NOT NULL,
    lease_token bigint NOT NULL,
    report text NOT NULL,
    reported_by text NOT NULL DEFAULT session_user,
    application_name text,
    reported_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    current_status inbox.effect_status,
    current_token bigint,
    CONSTRAINT outbox_fenced_report_pkey PRIMARY KEY (report_id)
);
COMMENT ON TABLE inbox.outbox_fenced_report IS
    'Reports (complete, fail, extend) refused because the lease they name is no longer current';
COMMENT ON COLUMN inbox.outbox_fenced_report.current_status IS 'Status of the effect when the report came; NULL: no such effect';
CREATE INDEX outbox_fenced_report_at_idx ON inbox.outbox_fenced_report (reported_at);

-- Idle dispatchers waiting on LISTEN inbox_outbox. An enqueue notifies only when this table has a
-- row, so under load (no dispatcher idle) nobody pays for NOTIFY.
CREATE TABLE inbox.outbox_waiter (
    dispatcher text NOT NULL,
    since timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_waiter_pkey PRIMARY KEY (dispatcher)
);
COMMENT ON TABLE inbox.outbox_waiter IS 'Dispatchers registered idle (inbox.dispatcher_idle): the next enqueue wakes them';

GRANT SELECT ON inbox.outbox, inbox.outbox_destination, inbox.outbox_redrive, inbox.outbox_discard,
    inbox.outbox_fenced_report, inbox.outbox_waiter TO inbox_operator;
-- Readers see no payloads, headers (they may carry credentials) or response bodies.
GRANT SELECT ON inbox.outbox_destination, inbox.outbox_redrive, inbox.outbox_discard, inbox.outbox_fenced_report,
    inbox.outbox_waiter TO inbox_reader;
GRANT SELECT (effect_id, destination, payload_sha256, ordering_key, order_seq, blocked, status, attempts, available_at,
    created_at, created_xid, lease_token, leased_by, lease_expires_at, last_attempt_at, last_error, last_status_code,
    last_duration_ms, delivered_at, dead_reason, discarded_at)
    ON inbox.outbox TO inbox_reader;

COMMIT;
