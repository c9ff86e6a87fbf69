-- pginbox: retention. Inbox rows cannot live forever, but deleting one too soon makes an old
-- delivery new again. The window is derived from named failure scenarios (never a free-form TTL),
-- age counts in the consumer's active time (a consumer back from downtime does not purge), and the
-- purge announces a watermark before it deletes: a first delivery produced before the watermark
-- cannot be told apart from a purged message, so it is quarantined as 'expired' instead of applied.
-- docs/retention.md explains the formula, the race argument and every SQLSTATE.
-- The functions are in 075_retention.sql.
BEGIN;

SET LOCAL ROLE inbox_owner;

-- Identities the purge must keep whatever their age (a replay plan that still needs them, an
-- operator's hold). One row per holder; the purge never deletes an inbox.message row with a hold.
CREATE TABLE inbox.retention_hold (
    consumer text NOT NULL,
    tenant text NOT NULL,
    producer text NOT NULL,
    message_id text NOT NULL,
    holder text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT retention_hold_pkey PRIMARY KEY (consumer, tenant, producer, message_id, holder)
);
COMMENT ON TABLE inbox.retention_hold IS 'Identities the purge keeps whatever their age, one row per holder (e.g. replay:<plan_id>)';
GRANT SELECT ON inbox.retention_hold TO inbox_reader, inbox_operator;

-- The policy: one row per consumer (producer '' = every producer without a row of its own).
-- Each scenario is how long after a message was produced a copy of it may still arrive from that
-- source ('0': the scenario does not apply).
CREATE TABLE inbox.retention_policy (
    consumer text NOT NULL,
    producer text NOT NULL DEFAULT '',
    broker_retention interval NOT NULL,
    max_offset_rewind interval NOT NULL,
    dead_letter_redrive_horizon interval NOT NULL,
    producer_retry_horizon interval NOT NULL,
    outage_allowance interval NOT NULL,
    backup_restore_window interval NOT NULL,
    planned_replay_horizon interval NOT NULL,
    safety_margin interval NOT NULL,
    note text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL DEFAULT session_user,
    CONSTRAINT retention_policy_pkey PRIMARY KEY (consumer, producer)
);
COMMENT ON TABLE inbox.retention_policy IS 'Retention policy per consumer (and producer): named failure scenarios, each an interval';

CREATE TABLE inbox.retention_policy_change (
    change_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer text NOT NULL,
    producer text NOT NULL,
    broker_retention interval NOT NULL,
    max_offset_rewind interval NOT NULL,
    dead_letter_redrive_horizon interval NOT NULL,
    producer_retry_horizon interval NOT NULL,
    outage_allowance interval NOT NULL,
    backup_restore_window interval NOT NULL,
    planned_replay_horizon interval NOT NULL,
    safety_margin interval NOT NULL,
    retention_window interval NOT NULL,
    dominating_scenario text NOT NULL,
    note text NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    changed_by text NOT NULL DEFAULT session_user
);
COMMENT ON TABLE inbox.retention_policy_change IS 'Audit trail: every retention policy change (who, when, the values, the window, the note)';

-- Periods when a consumer claimed nothing (recorded by the claims' heartbeat when the previous
-- heartbeat is more than 5 minutes old; gap_from = '-infinity' before its first heartbeat).
CREATE TABLE inbox.activity_gap (
    consumer text NOT NULL,
    gap_from timestamptz NOT NULL,
    gap_to timestamptz NOT NULL,
    CONSTRAINT activity_gap_pkey PRIMARY KEY (consumer, gap_from),
    CONSTRAINT activity_gap_order CHECK (gap_from <= gap_to)
);
COMMENT ON TABLE inbox.activity_gap IS 'Periods without claims per consumer: retention age counts only the time outside them';

-- Where the purge of one (consumer, policy producer) stands. announced_before / watermark are
-- committed before anything is deleted; purged_before becomes announced_before once every
-- transaction that was running after the announcement has ended; rows are deleted only below
-- purged_before.
CREATE TABLE inbox.purge_state (
    consumer text NOT NULL,
    producer text NOT NULL,
    announced_before timestamptz,
    watermark timestamptz,
    announced_at timestamptz,
    announce_xid xid8,
    waiting_for text[],
    purged_before timestamptz,
    settled_at timestamptz,
    last_purge_at timestamptz,
    rows_purged bigint NOT NULL DEFAULT 0,
    resume_at timestamptz,
    CONSTRAINT purge_state_pkey PRIMARY KEY (consumer, producer)
);
COMMENT ON TABLE inbox.purge_state IS 'Purge progress per consumer and policy producer: announced cutoff, watermark, settled cutoff, counts';

-- The purge's way to rows older than its cutoff, oldest first, each batch resuming where the last
-- one stopped (purge_state.resume_at). A BRIN on processed_at costs the claims less to maintain but
-- cannot return rows in order, so every batch re-read all remaining candidates: measured in
-- bench/bench_purge.py, figures in docs/retention.md.
CREATE INDEX message_purge_idx ON inbox.message (consumer, processed_at);

GRANT SELECT ON inbox.retention_policy, inbox.retention_policy_change, inbox.activity_gap, inbox.purge_state
    TO inbox_reader, inbox_operator;

COMMIT;
