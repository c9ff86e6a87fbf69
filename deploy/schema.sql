-- Deploy pginbox:schema. Generated from sql/020_schema.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: schema inbox, its core types and tables (the claims, attempts, quarantine, handlers).
-- Tables are never reworked: a later change ALTERs them in a change of its own. Functions are in
-- 030_claim.sql and the modules after it.
-- Everything here is owned by inbox_owner. Consumers get no table privileges at all: they reach
-- the tables only through the SECURITY DEFINER functions of the later modules.
BEGIN;

CREATE SCHEMA inbox AUTHORIZATION inbox_owner;
COMMENT ON SCHEMA inbox IS 'pginbox: claim message identities in the same transaction as the business change they cause';
REVOKE ALL ON SCHEMA inbox FROM PUBLIC;
GRANT USAGE ON SCHEMA inbox TO inbox_consumer, inbox_operator, inbox_reader, inbox_dispatcher;

-- No function created by inbox_owner is ever executable by PUBLIC, not even for the instant
-- between CREATE FUNCTION and its REVOKE.
ALTER DEFAULT PRIVILEGES FOR ROLE inbox_owner REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

SET LOCAL ROLE inbox_owner;

-- What one delivery came to. outcome is one of:
--   claimed      this transaction owns first processing (inbox.claim): make the change, then commit
--   applied      the registered handler ran and its change commits with the caller's transaction
--   duplicate    same identity and same payload hash as an identity already processed (or discarded)
--   conflict     same identity, different payload hash: quarantined, nothing applied
--   failed       the handler raised a permanent error: its writes and the claim rolled back, attempt recorded
--   quarantined  the identity sits in quarantine: nothing applied, the handler did not run
--   expired      produced before the consumer's purge watermark: it cannot be told apart from a purged
--                message, so it is quarantined (kind 'expired'), nothing applied
--   proceed      (inbox.record_start only) go on and process the delivery
CREATE TYPE inbox.delivery_result AS (
    outcome text,
    payload_sha256 text,
    stored_sha256 text,
    handler_version text,
    processed_at timestamptz,
    quarantine_id bigint,
    attempts integer,
    reason_code text,
    error_message text
);
COMMENT ON TYPE inbox.delivery_result IS 'What one delivery came to: outcome plus the facts behind it';

-- The identity of the message a handler is running for (second, optional handler argument).
CREATE TYPE inbox.message_context AS (
    tenant text,
    consumer text,
    producer text,
    message_id text,
    message_type text,
    produced_at timestamptz,
    handler_version text
);
COMMENT ON TYPE inbox.message_context IS 'Identity of the message a handler runs for: handler(payload jsonb, ctx inbox.message_context)';

-- internal: what the privileged half of claim_and_apply / repair hands to the invoker half.
CREATE TYPE inbox._handler_call AS (
    claim inbox.delivery_result,
    handler regprocedure,
    takes_context boolean,
    payload jsonb,
    context inbox.message_context
);
COMMENT ON TYPE inbox._handler_call IS 'internal: a claimed delivery and the handler call to make for it';

CREATE TABLE inbox.consumer_config (
    consumer text PRIMARY KEY,
    hash_exclude_keys text[] NOT NULL DEFAULT '{}',
    max_attempts integer NOT NULL DEFAULT 5 CHECK (max_attempts BETWEEN 1 AND 1000),
    store_payloads boolean NOT NULL DEFAULT true,
    max_payload_bytes integer NOT NULL DEFAULT 1048576 CHECK (max_payload_bytes BETWEEN 1 AND 104857600),
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL DEFAULT session_user,
    -- Retention (sql/075_retention.sql): the claims' heartbeat (refreshed at most once a minute) and
    -- the highest purge watermark of the consumer over its producers (NULL: never purged). The
    -- claim paths read both with the settings, so checking a delivery against them costs nothing.
    last_active_at timestamptz,
    purge_watermark timestamptz
);
COMMENT ON TABLE inbox.consumer_config IS 'Per-consumer settings; a consumer without a row uses the column defaults';
COMMENT ON COLUMN inbox.consumer_config.last_active_at IS 'Heartbeat of the consumer''s claims (at most once a minute): retention counts age in active time';
COMMENT ON COLUMN inbox.consumer_config.purge_watermark IS 'Highest purge watermark over the consumer''s producers: a first delivery produced before it is checked against inbox.purge_state';

CREATE TABLE inbox.handler (
    consumer text NOT NULL,
    message_type text NOT NULL,
    handler regprocedure NOT NULL,
    handler_version text NOT NULL,
    takes_context boolean NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    registered_by text NOT NULL DEFAULT session_user,
    CONSTRAINT handler_pkey PRIMARY KEY (consumer, message_type)
);
COMMENT ON TABLE inbox.handler IS 'SQL handlers run by inbox.claim_and_apply, one per (consumer, message_type)';

CREATE TABLE inbox.handler_registration (
    registration_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer text NOT NULL,
    message_type text NOT NULL,
    handler text NOT NULL,
    handler_version text NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    registered_by text NOT NULL DEFAULT session_user
);
COMMENT ON TABLE inbox.handler_registration IS 'Audit trail of every handler registration';

-- An enum rather than a CHECK constraint: PostgreSQL 15 re-reads a CHECK expression on every
-- INSERT, and this table takes one insert per message.
CREATE TYPE inbox.message_status AS ENUM ('processed', 'quarantined', 'discarded');
COMMENT ON TYPE inbox.message_status IS 'processed: applied once; quarantined: held by an open quarantine entry; discarded: closed by an operator without effect';

-- The claims. One row per identity that was processed, discarded, or is held in quarantine.
-- The primary key is the concurrency control: INSERT ... ON CONFLICT DO NOTHING on it decides
-- which transaction owns first processing.
CREATE TABLE inbox.message (
    consumer text NOT NULL,
    tenant text NOT NULL,
    producer text NOT NULL,
    message_id text NOT NULL,
    payload_sha256 bytea NOT NULL,
    handler_version text NOT NULL,
    status inbox.message_status NOT NULL DEFAULT 'processed',
    produced_at timestamptz,
    received_at timestamptz NOT NULL DEFAULT now(),
    processed_at timestamptz,
    CONSTRAINT message_pkey PRIMARY KEY (consumer, tenant, producer, message_id)
);
COMMENT ON TABLE inbox.message IS 'Claimed message identities: processed, discarded, or held by quarantine';

-- Attempts that did not commit. Written outside the rolled-back work so that it survives it.
CREATE TABLE inbox.attempt (
    consumer text NOT NULL,
    tenant text NOT NULL,
    producer text NOT NULL,
    message_id text NOT NULL,
    started integer NOT NULL DEFAULT 0,
    failed integer NOT NULL DEFAULT 0,
    last_started_at timestamptz,
    first_failure_at timestamptz,
    last_failure_at timestamptz,
    reason_code text,
    error_message text,
    handler_version text,
    message_type text,
    payload_sha256 bytea,
    CONSTRAINT attempt_pkey PRIMARY KEY (consumer, tenant, producer, message_id)
);
COMMENT ON TABLE inbox.attempt IS 'Redelivered attempts announced (started) and permanent failures recorded (failed), per identity';

CREATE TABLE inbox.quarantine (
    quarantine_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer text NOT NULL,
    tenant text NOT NULL,
    producer text NOT NULL,
    message_id text NOT NULL,
    kind text NOT NULL CHECK (kind IN ('conflict', 'failure', 'expired')),
    message_type text,
    payload_sha256 bytea,
    stored_sha256 bytea,
    payload jsonb,
    payload_bytes bytea,
    payload_ref text,
    reason_code text NOT NULL,
    error_message text,
    attempts integer NOT NULL DEFAULT 0,
    crashes integer NOT NULL DEFAULT 0,
    deliveries integer NOT NULL DEFAULT 1,
    first_failure_at timestamptz,
    last_failure_at timestamptz,
    handler_version text NOT NULL,
    status text NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'recovered', 'discarded', 'released')),
    created_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now(),
    decided_at timestamptz,
    decided_by text,
    CONSTRAINT quarantine_entry_key UNIQUE NULLS NOT DISTINCT (consumer, tenant, producer, message_id, kind, payload_sha256)
);
COMMENT ON TABLE inbox.quarantine IS 'Messages whose ownership moved to operators: identity conflicts, exhausted attempts, expired deliveries';
CREATE INDEX quarantine_open_idx ON inbox.quarantine (consumer, created_at) WHERE status = 'open';

CREATE TABLE inbox.quarantine_decision (
    decision_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    quarantine_id bigint NOT NULL REFERENCES inbox.quarantine (quarantine_id),
    decision text NOT NULL CHECK (decision IN ('repair', 'discard', 'release')),
    result text NOT NULL CHECK (result IN ('recovered', 'discarded', 'released', 'repair_failed')),
    decided_by text NOT NULL DEFAULT session_user,
    decided_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    note text NOT NULL,
    reason_code text,
    error_message text
);
COMMENT ON TABLE inbox.quarantine_decision IS 'Audit trail: every operator decision on a quarantine entry (who, when, note, result)';
CREATE INDEX quarantine_decision_entry_idx ON inbox.quarantine_decision (quarantine_id);

-- Readers see everything but payloads.
GRANT SELECT ON inbox.consumer_config, inbox.handler, inbox.handler_registration, inbox.message,
    inbox.attempt, inbox.quarantine_decision TO inbox_reader, inbox_operator;
GRANT SELECT (quarantine_id, consumer, tenant, producer, message_id, kind, message_type, payload_sha256,
    stored_sha256, payload_ref, reason_code, error_message, attempts, crashes, deliveries, first_failure_at,
    last_failure_at, handler_version, status, created_at, last_seen_at, decided_at, decided_by)
    ON inbox.quarantine TO inbox_reader;
GRANT SELECT ON inbox.quarantine TO inbox_operator;

COMMIT;
