# Generated from python_replay_async.py by python/tools/async_to_sync.py: DO NOT EDIT.
# Edit python/pginbox/ops/python_replay_async.py, then run the script (tests/run checks this file).
"""Replay plans with a Python handler: `pginbox replay create ... --python MODULE:FUNCTION` and
`pginbox replay run PLAN --python MODULE:FUNCTION` (docs/replay.md, "Python handlers").

The database decides who may do what (sql/122_python_replay.sql); this module only makes the calls:

  create_plan(operator_conn, ...)   inbox.create_python_replay_plan: a plan approved for one Python
                                    handler and version, audited like any plan
  run_plan(consumer_conn, ...)      on a connection of the consumer's own login, one transaction per
                                    item: inbox.begin_python_replay_item (the item's operation id is
                                    claimed, the item marked applied, the message comes back), the
                                    handler(cursor, message), COMMIT. When the handler raises, the
                                    transaction rolls back and inbox.python_replay_item_failed
                                    records the item failed in a new one; the plan goes on.
  run_plan_async(dsn, ...)          the same for an `async def` handler, on an asyncio connection
                                    of its own

A transient error (class 40, 57014, a lost connection, ...) re-runs the item's transaction; a
COMMIT whose answer was lost needs nothing: the next call finds the item applied, or pending.
A killed runner leaves its item pending, and the next run applies it once.

pginbox.ops.python_replay (create_plan, run_plan) is generated from pginbox.ops.python_replay_async
(run_plan_async), which defines the pieces both share (the statements, PythonRun, create_plan).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pginbox.client.outcomes import Message
from pginbox.client.retry import RetryPolicy
from pginbox.ops.handler_run import HandlerRun, judge
from pginbox.ops.python_replay_async import (
    BEGIN_SQL,
    FAILED_SQL,
    AsyncHandler,
    PythonRun,
    _counted,
    _failed,
    _failure_params,
    _HandlerFailed,
    _message,
    _refused,
    create_plan,
    run_plan_async,
)

__all__ = ["AsyncHandler", "Handler", "PythonRun", "create_plan", "run_plan", "run_plan_async"]

#: handler(cursor, message): runs in the transaction that takes the item (pginbox.Inbox's shape).
Handler = Callable[[psycopg.Cursor[Any], Message], object]


def _attempt(conn: psycopg.Connection[Any], plan_id: int, spec: str, handler: Handler) -> dict[str, Any]:
    """One transaction: take the next item, run the handler on it, commit. _HandlerFailed: rolled
    back; a transient error is raised as it is (Protocol.retry runs the transaction again)."""
    with conn.transaction():
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(BEGIN_SQL, {"plan_id": plan_id, "handler": spec}).fetchone()
        assert row is not None
        if row["action"] != "run":
            return row
        error: Exception | None = None
        returned: object = None
        with conn.cursor() as hcur:
            try:
                returned = handler(hcur, _message(row))
            except Exception as exc:
                error = exc
        verdict = judge(conn, error, returned, client="the replay")
        if verdict is not None:
            raise _failed(row, error, verdict)
    return row


def _record_failure(conn: psycopg.Connection[Any], plan_id: int, params: dict[str, Any]) -> bool:
    """inbox.python_replay_item_failed, in a transaction of its own; False when the item was no
    longer pending."""
    try:
        with conn.transaction(), conn.cursor() as cur:
            row = cur.execute(FAILED_SQL, params).fetchone()
    except psycopg.Error as exc:
        what = f"cannot record the failure of item {params['item_no']} of replay plan {plan_id}"
        raise _refused(what, exc) from exc
    return row is not None and bool(row[0])


def _run_plan(
    conn: psycopg.Connection[Any],
    plan_id: int,
    spec: str,
    handler: Handler,
    max_items: int | None,
    retry: RetryPolicy | None,
    progress: Callable[[PythonRun], None] | None,
) -> PythonRun:
    """What `run_plan` does, on `conn`; a connection opened to replace a lost one is closed on return."""
    run = PythonRun(plan_id, spec)
    with HandlerRun(conn, retry, f"replay plan {plan_id}", _refused) as runner:
        while max_items is None or run.applied_now + run.failed_now < max_items:
            outcome = runner.transaction(lambda c: _attempt(c, plan_id, spec, handler), _HandlerFailed)
            params: dict[str, Any] = {}
            recorded = False
            if isinstance(outcome, _HandlerFailed):
                params = _failure_params(plan_id, spec, outcome)
                recorded = _record_failure(runner.conn, plan_id, params)
            if _counted(run, outcome, recorded, params):
                break
            if progress is not None:
                progress(run)
        if progress is not None:
            progress(run)
        return run


def run_plan(
    conn: psycopg.Connection[Any],
    plan_id: int,
    spec: str,
    handler: Handler,
    *,
    max_items: int | None = None,
    retry: RetryPolicy | None = None,
    progress: Callable[[PythonRun], None] | None = None,
) -> PythonRun:
    """Run `handler` (named `spec`, module:function, as the plan does) on the plan's pending items,
    one transaction each, on `conn`: a connection of the consumer's own login, not in a
    transaction. Stops when no item is pending (the plan completes), or after `max_items` items
    taken by the handler. A refusal raises ReplayError with the database's reason; a lost
    connection is replaced by one with the same parameters. Each item's transaction is retried
    by pginbox.client.protocol's Protocol.retry, as pginbox.Inbox retries a delivery."""
    return _run_plan(conn, plan_id, spec, handler, max_items, retry, progress)
