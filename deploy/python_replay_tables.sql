-- Deploy pginbox:python_replay_tables: written from sql/082_python_replay_tables.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: replay plans whose handler is Python (docs/replay.md, "Python handlers"). A consumer
-- whose handler is Python (what `pginbox consume --handler MODULE:FUNCTION` runs) has no SQL handler
-- registered for inbox.run_replay_plan to run, and an operator must not run its code with the
-- operator's login: the handler acts as the consumer. So an operator approves a plan for one Python
-- handler (inbox.create_python_replay_plan, audited in inbox.replay_decision), and a login of the
-- consumer's own role runs it, one item per transaction (inbox.begin_python_replay_item, then the
-- handler, then COMMIT; inbox.python_replay_item_failed after a failure). A plan names either a
-- SQL handler (handler, regprocedure) or a Python one (python_handler, module:function), never both.
-- Sorted before 085_replay.sql: its view and runner read python_handler. Tables and types only: the
-- functions are in 122_python_replay.sql.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

ALTER TABLE inbox.replay_plan
    ALTER COLUMN handler DROP NOT NULL,
    ADD COLUMN python_handler text,
    ADD CONSTRAINT replay_plan_one_handler CHECK ((handler IS NULL) <> (python_handler IS NULL));
COMMENT ON COLUMN inbox.replay_plan.python_handler IS
    'The Python handler (module:function) a login of the consumer''s role runs the plan with; NULL for a SQL plan (handler)';

-- What inbox.begin_python_replay_item hands the consumer's login: the next item to run its handler
-- on (action run), or none (done: no item is pending; again: call again), with the items it
-- skipped or recorded failed on the way.
CREATE TYPE inbox.python_replay_step AS (
    action text,
    plan_id bigint,
    item_no bigint,
    status text,
    consumer text,
    tenant text,
    producer text,
    message_id text,
    message_type text,
    operation_id text,
    payload jsonb,
    produced_at timestamptz,
    handler_version text,
    skipped_now integer,
    failed_now integer
);
COMMENT ON TYPE inbox.python_replay_step IS
    'The next item of a Python replay plan for its handler (action run), or none (done, again), with this call''s skips and failures';

COMMIT;
