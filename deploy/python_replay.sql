-- Deploy pginbox:python_replay: written from sql/122_python_replay.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: replay plans with a Python handler (docs/replay.md, "Python handlers"; the column and the
-- type: 082_python_replay_tables.sql).
--   inbox.create_python_replay_plan   operator: a plan approved for one Python handler
--                                     (module:function) and version, audited like any plan
--                                     (inbox.replay_decision 'create'); items are added, the plan
--                                     is cancelled and watched as any plan (085_replay.sql)
--   inbox.begin_python_replay_item    a login of the consumer's own role, in its transaction:
--                                     takes the next pending item, claims its operation id and
--                                     marks it applied (as inbox.run_replay_plan does), and
--                                     returns the message; the login's Python handler then runs in
--                                     the same transaction. All of it commits together, or rolls
--                                     back with the handler, and the item stays pending.
--   inbox.python_replay_item_failed   the same login, after the handler failed and its transaction
--                                     rolled back: the item is recorded failed (as run_replay_plan
--                                     records a SQL handler's failure); the plan goes on
-- The authorization is here, not in the client: the plan is refused when no live role is bound to
-- the consumer (nobody could run its handler with the consumer's rights); a run, when the plan is
-- not approved for Python, names another handler than the approved one, or the login is not a
-- member, through real grants, of a role bound to the consumer (no superuser exception, never the
-- operator's login); an item of a tenant the login is not bound for is recorded failed (42501)
-- without running. One item per transaction: a crash leaves the item pending (retried by the next
-- run), and its claimed operation id makes a second application impossible. New in 0.3.0.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

-- A Python handler is named module:function, as `pginbox consume --handler` names it.
CREATE OR REPLACE FUNCTION inbox._check_python_handler(fn text, handler text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_text(fn, 'handler', _check_python_handler.handler, 200);
    IF _check_python_handler.handler !~ '^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$' THEN
        RAISE EXCEPTION '%: handler must be module:function (a Python name), got %', fn,
            quote_literal(_check_python_handler.handler)
            USING ERRCODE = 'invalid_parameter_value', HINT = 'For example: billing.handlers:credit.';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox._check_python_handler(text, text) IS 'internal: a Python handler name, module:function (22004, 22023)';

CREATE OR REPLACE FUNCTION inbox.create_python_replay_plan(plan_name text, consumer text, message_type text,
                                                           handler text, handler_version text, note text)
    RETURNS inbox.replay_plan
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.create_python_replay_plan';
    existing inbox.replay_plan;
    plan inbox.replay_plan;
BEGIN
    PERFORM inbox._check_text(fn, 'plan_name', create_python_replay_plan.plan_name, 128);
    PERFORM inbox._check_identity(fn, create_python_replay_plan.consumer, '-', '-', '');
    IF starts_with(create_python_replay_plan.consumer, 'replay:') THEN
        RAISE EXCEPTION '%: consumer names starting with ''replay:'' belong to replay plans themselves', fn
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Name the consumer whose messages are replayed.';
    END IF;
    PERFORM inbox._check_message_type(fn, create_python_replay_plan.message_type);
    PERFORM inbox._check_python_handler(fn, create_python_replay_plan.handler);
    PERFORM inbox._check_delivery(fn, 0, 1, create_python_replay_plan.handler_version);
    PERFORM inbox._check_replay_note(fn, create_python_replay_plan.note);
    SELECT p.* INTO existing FROM inbox.replay_plan p WHERE p.plan_name = create_python_replay_plan.plan_name;
    IF FOUND THEN
        RAISE EXCEPTION '%: a replay plan named % already exists (plan %, %)', fn,
            quote_literal(create_python_replay_plan.plan_name), existing.plan_id, existing.status
            USING ERRCODE = 'duplicate_object', HINT = 'Plan names are never reused: choose another name.';
    END IF;
    -- The operator cannot act for a consumer nobody could run as.
    IF NOT EXISTS (SELECT 1 FROM inbox.consumer_binding b JOIN pg_roles r ON r.oid = b.role
                    WHERE b.consumer = ANY (ARRAY[create_python_replay_plan.consumer,
                                                  inbox._consumer_base(create_python_replay_plan.consumer)])) THEN
        RAISE EXCEPTION '%: no live role is bound to consumer %', fn, quote_literal(create_python_replay_plan.consumer)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'A Python replay plan''s handler acts as the consumer: it runs with the login of a role bound to it.',
                  HINT = pg_catalog.format('Bind the consumer''s role first (SELECT inbox.bind_consumer(%L, ''<role>'', note => ''...'')).',
                                           create_python_replay_plan.consumer);
    END IF;

    INSERT INTO inbox.replay_plan AS p (plan_name, consumer, message_type, handler, python_handler, handler_version,
                                        takes_context, note)
    VALUES (create_python_replay_plan.plan_name, create_python_replay_plan.consumer,
            create_python_replay_plan.message_type, NULL, create_python_replay_plan.handler,
            create_python_replay_plan.handler_version, false, create_python_replay_plan.note)
    RETURNING p.* INTO plan;
    INSERT INTO inbox.replay_decision (plan_id, decision, note, handler, handler_version)
    VALUES (plan.plan_id, 'create', create_python_replay_plan.note, plan.python_handler, plan.handler_version);
    RETURN plan;
END
$$;
COMMENT ON FUNCTION inbox.create_python_replay_plan(text, text, text, text, text, text) IS
    'Create a replay plan approved for a Python handler (module:function) and version, run by a login of the consumer''s role (audited)';

-- The checks of a Python run, in order: the plan exists and is locked (P0002; runs of one plan take
-- turns), is neither completed nor cancelled (55000), is approved for Python (42501), for this
-- handler (42501), and the caller is a member through real grants of a role bound to the consumer
-- (42501). Returns the locked plan.
CREATE OR REPLACE FUNCTION inbox._python_replay_plan(fn text, plan_id bigint, handler text) RETURNS inbox.replay_plan
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    plan inbox.replay_plan;
    caller name := inbox._caller();
BEGIN
    IF _python_replay_plan.handler IS NULL THEN
        RAISE EXCEPTION '%: handler must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Name the Python handler that runs: module:function.';
    END IF;
    plan := inbox._lock_replay_plan(fn, _python_replay_plan.plan_id);
    PERFORM inbox._check_plan_active(fn, plan);
    IF plan.python_handler IS NULL THEN
        RAISE EXCEPTION '%: replay plan % (%) is not approved for a Python handler: it runs the SQL handler %', fn,
            plan.plan_id, quote_literal(plan.plan_name), plan.handler
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'An operator approves a plan for a Python handler when creating it (inbox.create_python_replay_plan).',
                  HINT = 'An operator runs this plan: pginbox replay run <plan> (inbox.run_replay_plan); or create a plan for the Python handler: pginbox replay create ... --python module:function.';
    END IF;
    IF _python_replay_plan.handler <> plan.python_handler THEN
        RAISE EXCEPTION '%: replay plan % is approved for handler %, not %', fn, plan.plan_id,
            quote_literal(plan.python_handler), quote_literal(_python_replay_plan.handler)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'The operator chose which handler replays the plan.',
                  HINT = pg_catalog.format('Run it with --python %s, or have an operator create a plan for the other handler.',
                                           plan.python_handler);
    END IF;
    IF NOT inbox._role_may_act_as((SELECT r.oid FROM pg_roles r WHERE r.rolname = caller), plan.consumer, NULL) THEN
        RAISE EXCEPTION '%: role % may not run replay plan %: only a login of a role bound to consumer % does', fn,
            quote_ident(caller), plan.plan_id, quote_literal(plan.consumer)
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = 'The handler acts as the consumer: it runs with the consumer''s own login (a member of a role bound to it), never with an operator''s or a superuser''s.',
                  HINT = pg_catalog.format('Run it with the consumer service''s credentials: pginbox replay run %s --python %s --dsn <the consumer''s DSN>.',
                                           plan.plan_id, plan.python_handler);
    END IF;
    RETURN plan;
END
$$;
COMMENT ON FUNCTION inbox._python_replay_plan(text, bigint, text) IS
    'internal: the checks of a Python replay run (P0002, 55000, 42501); locks the plan';

-- Takes the next item the caller's handler runs on. On the way, items whose message was processed
-- with the pinned version already, is gone or no longer processed are skipped (as
-- inbox.run_replay_plan skips them), and items of a tenant the caller is not bound for are recorded
-- failed (42501); these marks commit with the item's transaction. Without a pending item the plan
-- completes (its retention holds go) and action is 'done'.
CREATE OR REPLACE FUNCTION inbox.begin_python_replay_item(plan_id bigint, handler text)
    RETURNS inbox.python_replay_step
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.begin_python_replay_item';
    plan inbox.replay_plan;
    caller oid;
    step inbox._replay_step;
    item inbox.replay_item;
    finished inbox.replay_run;
    result inbox.python_replay_step;
BEGIN
    plan := inbox._python_replay_plan(fn, begin_python_replay_item.plan_id, begin_python_replay_item.handler);
    caller := (SELECT r.oid FROM pg_roles r WHERE r.rolname = inbox._caller());
    result.plan_id := plan.plan_id;
    result.status := plan.status;
    result.consumer := plan.consumer;
    result.message_type := plan.message_type;
    result.handler_version := plan.handler_version;
    result.skipped_now := 0;
    result.failed_now := 0;
    -- Bounded: a long run of skips returns 'again' rather than holding the plan's lock for long.
    FOR i IN 1 .. 1000 LOOP
        step := inbox._replay_next(plan.plan_id);
        IF step.action = ANY (ARRAY['done', 'stop']) THEN
            finished := inbox._replay_run_finish(plan.plan_id);
            result.action := 'done';
            result.status := finished.status;
            RETURN result;
        END IF;
        IF step.action = 'skipped' THEN
            result.skipped_now := result.skipped_now + 1;
            CONTINUE;
        END IF;
        IF NOT inbox._role_may_act_as(caller, plan.consumer, (step.context).tenant) THEN
            PERFORM inbox._replay_item_failed(plan.plan_id, step.item_no, '42501',
                format('the login %s is not bound to consumer %s for tenant %s', quote_ident(inbox._caller()),
                       quote_literal(plan.consumer), quote_literal((step.context).tenant)));
            result.failed_now := result.failed_now + 1;
            CONTINUE;
        END IF;
        IF NOT inbox._begin_replay_item(plan.plan_id, step.item_no) THEN
            result.skipped_now := result.skipped_now + 1;  -- its operation id was claimed already
            CONTINUE;
        END IF;
        SELECT i.* INTO STRICT item FROM inbox.replay_item i
         WHERE i.plan_id = plan.plan_id AND i.item_no = step.item_no;
        result.action := 'run';
        result.item_no := item.item_no;
        result.tenant := item.tenant;
        result.producer := item.producer;
        result.message_id := item.message_id;
        result.operation_id := item.operation_id;
        result.payload := item.payload;
        result.produced_at := (step.context).produced_at;
        RETURN result;
    END LOOP;
    result.action := 'again';
    RETURN result;
END
$$;
COMMENT ON FUNCTION inbox.begin_python_replay_item(bigint, text) IS
    'Take the next item of a Python replay plan in this transaction (a login of the consumer''s role): its operation id is claimed and it is marked applied; all of it rolls back with the handler';

CREATE OR REPLACE FUNCTION inbox.python_replay_item_failed(plan_id bigint, item_no bigint, handler text,
                                                           reason_code text, error_message text DEFAULT NULL)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'inbox.python_replay_item_failed';
    plan inbox.replay_plan;
    item inbox.replay_item;
BEGIN
    PERFORM inbox._check_text(fn, 'reason_code', python_replay_item_failed.reason_code, 1000);
    plan := inbox._python_replay_plan(fn, python_replay_item_failed.plan_id, python_replay_item_failed.handler);
    SELECT i.* INTO item FROM inbox.replay_item i
     WHERE i.plan_id = plan.plan_id AND i.item_no = python_replay_item_failed.item_no
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: replay plan % has no item %', fn, plan.plan_id, python_replay_item_failed.item_no
            USING ERRCODE = 'no_data_found';
    END IF;
    IF item.status <> 'pending' THEN
        RETURN false;  -- another run finished it meanwhile: its outcome stands
    END IF;
    IF NOT inbox._role_may_act_as((SELECT r.oid FROM pg_roles r WHERE r.rolname = inbox._caller()), plan.consumer,
                                  item.tenant) THEN
        RAISE EXCEPTION '%: role % is not bound to consumer % for tenant %', fn, quote_ident(inbox._caller()),
            quote_literal(plan.consumer), quote_literal(item.tenant)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    PERFORM inbox._replay_item_failed(plan.plan_id, item.item_no, left(python_replay_item_failed.reason_code, 64),
                                      coalesce(python_replay_item_failed.error_message, python_replay_item_failed.reason_code));
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox.python_replay_item_failed(bigint, bigint, text, text, text) IS
    'Record a Python replay item whose handler failed (its transaction rolled back): the item is failed, the plan goes on';

REVOKE ALL ON FUNCTION inbox._check_python_handler(text, text),
    inbox.create_python_replay_plan(text, text, text, text, text, text),
    inbox._python_replay_plan(text, bigint, text),
    inbox.begin_python_replay_item(bigint, text),
    inbox.python_replay_item_failed(bigint, bigint, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.create_python_replay_plan(text, text, text, text, text, text) TO inbox_operator;
GRANT EXECUTE ON FUNCTION inbox.begin_python_replay_item(bigint, text),
    inbox.python_replay_item_failed(bigint, bigint, text, text, text) TO inbox_consumer;

COMMIT;
