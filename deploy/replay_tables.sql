-- Deploy pginbox:replay_tables. Generated from sql/080_replay_tables.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: replay after a handler change. The inbox rightly calls an old message a duplicate, so a
-- fixed handler never sees it again. Three explicit policies instead of deleting inbox rows
-- (docs/replay.md):
--   1. no reapplication     rebuild a derived read model elsewhere; nothing here is needed
--   2. versioned projection the projection version is part of the consumer identity:
--                           inbox.versioned_consumer('orders-projection', 'v2') = 'orders-projection@v2'
--   3. compensated migration a replay plan: a pinned handler and version, a selection of messages the
--                           consumer processed (payloads checked against the stored hashes), and
--                           one operation id per item, claimed in inbox.message under consumer
--                           'replay:<plan_id>' in the same transaction as the handler's change, so
--                           a second run or a resumed crash applies each operation once.
-- A plan is pinned to (handler, handler_version). Before each item the runner compares the pin with
-- what inbox.handler has registered; on a change the plan stops (status stopped_version_changed,
-- SQLSTATE IR001) and runs again only after an operator accepts the new pair. Every operator
-- decision leaves a row in inbox.replay_decision. Inbox rows are never deleted or changed here.
-- The functions are in 085_replay.sql.
BEGIN;

SET LOCAL ROLE inbox_owner;

-- ------------------------------------------------------------------ tables

CREATE TABLE inbox.replay_plan (
    plan_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    plan_name text NOT NULL,
    consumer text NOT NULL,
    message_type text NOT NULL,
    handler regprocedure NOT NULL,
    handler_version text NOT NULL,
    takes_context boolean NOT NULL,
    status text NOT NULL DEFAULT 'open'
        CHECK (status IN ('open', 'stopped_version_changed', 'completed', 'cancelled')),
    note text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL DEFAULT session_user,
    stopped_at timestamptz,
    finished_at timestamptz,
    CONSTRAINT replay_plan_name_key UNIQUE (plan_name)
);
COMMENT ON TABLE inbox.replay_plan IS
    'Replay plans (compensated migration): consumer, message type, pinned handler and version, status';

-- One row per message of a plan. The payload is the operator's to read, like quarantine payloads.
CREATE TABLE inbox.replay_item (
    plan_id bigint NOT NULL REFERENCES inbox.replay_plan (plan_id),
    item_no bigint GENERATED ALWAYS AS IDENTITY,
    tenant text NOT NULL,
    producer text NOT NULL,
    message_id text NOT NULL,
    operation_id text NOT NULL,
    payload jsonb NOT NULL,
    payload_sha256 bytea NOT NULL,
    status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'applied', 'failed', 'skipped')),
    handler_version text,
    reason_code text,
    error_message text,
    added_at timestamptz NOT NULL DEFAULT now(),
    added_by text NOT NULL DEFAULT session_user,
    finished_at timestamptz,
    finished_by text,
    CONSTRAINT replay_item_pkey PRIMARY KEY (plan_id, tenant, producer, message_id),
    CONSTRAINT replay_item_operation_key UNIQUE (operation_id)
);
COMMENT ON TABLE inbox.replay_item IS
    'Messages of a replay plan: original identity, payload (operators only), operation id, outcome';
CREATE INDEX replay_item_pending_idx ON inbox.replay_item (plan_id, item_no) WHERE status = 'pending';

CREATE TABLE inbox.replay_decision (
    decision_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    plan_id bigint NOT NULL REFERENCES inbox.replay_plan (plan_id),
    decision text NOT NULL CHECK (decision IN ('create', 'add_items', 'stopped_version_changed', 'accept_version',
                                               'cancel', 'completed')),
    decided_by text NOT NULL DEFAULT session_user,
    decided_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    note text,
    handler text,
    handler_version text,
    previous_handler text,
    previous_version text,
    items integer
);
COMMENT ON TABLE inbox.replay_decision IS
    'Audit trail of replay plans: every operator decision and every stop or completion (who, when, note, pins)';
CREATE INDEX replay_decision_plan_idx ON inbox.replay_decision (plan_id);

-- internal: what the privileged half of run_replay_plan hands to the invoker half for one item.
--   action: run | skipped | stop | done
CREATE TYPE inbox._replay_step AS (
    action text,
    item_no bigint,
    handler regprocedure,
    takes_context boolean,
    payload jsonb,
    context inbox.message_context
);
COMMENT ON TYPE inbox._replay_step IS 'internal: the next step of a replay run (run an item, skipped, stop, done)';

-- What one call of inbox.run_replay_plan came to: this call's counts and the plan's totals after it.
CREATE TYPE inbox.replay_run AS (
    plan_id bigint,
    status text,
    applied_now integer,
    failed_now integer,
    skipped_now integer,
    pending bigint,
    applied bigint,
    failed bigint,
    skipped bigint
);
COMMENT ON TYPE inbox.replay_run IS 'Result of inbox.run_replay_plan: this call''s counts and the plan''s totals';

GRANT SELECT ON inbox.replay_plan, inbox.replay_decision TO inbox_reader, inbox_operator;
GRANT SELECT ON inbox.replay_item TO inbox_operator;
GRANT SELECT (plan_id, item_no, tenant, producer, message_id, operation_id, payload_sha256, status, handler_version,
              reason_code, error_message, added_at, added_by, finished_at, finished_by)
    ON inbox.replay_item TO inbox_reader;

COMMIT;
