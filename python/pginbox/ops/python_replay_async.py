# @ async: the sync module is generated from this module
# This module is the one source of both flavours: python/tools/async_to_sync.py writes
# pginbox/ops/python_replay.py (`run_plan`) from it, and tests/run fails when that file is out of
# date. Edit this file, then run `python python/tools/async_to_sync.py`.
# @ end
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

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from pginbox.client import shared as _core
from pginbox.client.outcomes import Message
from pginbox.client.retry import RetryPolicy
from pginbox.errors import ReplayError, server_message
from pginbox.ops.handler_run_async import AsyncHandlerRun, judge
from pginbox.ops.replay import _execute_one, _plan_params

# @ async: what has no asyncio in it is defined once, here; the sync module imports it
__all__ = ["AsyncHandler", "PythonRun", "create_plan", "run_plan_async"]

CREATE_SQL: Final = """
SELECT p.plan_id FROM inbox.create_python_replay_plan(plan_name => %(name)s, consumer => %(consumer)s,
       message_type => %(message_type)s, handler => %(handler)s, handler_version => %(version)s, note => %(note)s) p
"""
BEGIN_SQL: Final = """
SELECT s.action, s.plan_id, s.item_no, s.status, s.consumer, s.tenant, s.producer, s.message_id, s.message_type,
       s.operation_id, s.payload, s.produced_at, s.handler_version, s.skipped_now, s.failed_now
  FROM inbox.begin_python_replay_item(plan_id => %(plan_id)s, handler => %(handler)s) s
"""
FAILED_SQL: Final = """
SELECT inbox.python_replay_item_failed(plan_id => %(plan_id)s, item_no => %(item_no)s, handler => %(handler)s,
                                       reason_code => %(reason)s, error_message => %(text)s) AS recorded
"""


@dataclass
class PythonRun:
    """What run_plan came to: this run's applied, failed and skipped items, and the plan's status
    after it (`completed` when no item is pending any more). `failures`: this run's handler
    failures, (item_no, reason_code, error_message)."""

    plan_id: int
    handler: str
    status: str = "open"
    applied_now: int = 0
    failed_now: int = 0
    skipped_now: int = 0
    failures: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def done_now(self) -> int:
        return self.applied_now + self.failed_now + self.skipped_now

    def as_json(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "handler": self.handler,
            "status": self.status,
            "this_run": {
                "applied": self.applied_now,
                "failed": self.failed_now,
                "skipped": self.skipped_now,
                "failures": [
                    {"item_no": n, "reason_code": code, "error_message": text} for n, code, text in self.failures
                ],
            },
        }


def _refused(what: str, exc: psycopg.Error) -> ReplayError:
    return ReplayError(f"{what}: {server_message(exc)}", sqlstate=exc.sqlstate)


def create_plan(
    conn: psycopg.Connection[Any], name: str, consumer: str, message_type: str, handler: str, version: str, note: str
) -> int:
    """inbox.create_python_replay_plan, committed on return (the operator's connection); the plan_id.
    The same parameters and statement handling as pginbox.ops.replay.create_plan; a refusal is
    told as the Python plans' others are (_refused)."""
    params = _plan_params(name, consumer, message_type, handler, version, note)
    what = f"cannot create replay plan {name!r}"
    row = _execute_one(conn, CREATE_SQL, params, what, lambda exc, text: _refused(text, exc))
    return int(row["plan_id"])


class _HandlerFailed(Exception):
    def __init__(self, item_no: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.item_no = item_no
        self.error = error


def _message(row: dict[str, Any]) -> Message:
    return Message(
        row["producer"],
        row["message_id"],
        row["message_type"],
        row["payload"],
        tenant=row["tenant"],
        produced_at=row["produced_at"],
    )


def _failed(row: dict[str, Any], error: Exception | None, verdict: BaseException) -> _HandlerFailed:
    failed = _HandlerFailed(row["item_no"], verdict)
    failed.__cause__ = error
    return failed


def _failure_params(plan_id: int, spec: str, failed: _HandlerFailed) -> dict[str, Any]:
    reason, text = _core.failure_reason(failed.error)
    return {"plan_id": plan_id, "item_no": failed.item_no, "handler": spec, "reason": reason, "text": text}


def _counted(run: PythonRun, outcome: dict[str, Any] | _HandlerFailed, recorded: bool, params: dict[str, Any]) -> bool:
    """Adds one item's outcome to `run`; True when no item is pending any more."""
    if isinstance(outcome, _HandlerFailed):
        if recorded:
            run.failed_now += 1
            run.failures.append((outcome.item_no, params["reason"], params["text"]))
        return False
    run.skipped_now += outcome["skipped_now"]
    run.failed_now += outcome["failed_now"]
    run.status = outcome["status"]
    if outcome["action"] == "run":
        run.applied_now += 1
    return bool(outcome["action"] == "done")


# @ sync
# from pginbox.ops.python_replay_async import (
#     BEGIN_SQL,
#     FAILED_SQL,
#     AsyncHandler,
#     PythonRun,
#     _counted,
#     _failed,
#     _failure_params,
#     _HandlerFailed,
#     _message,
#     _refused,
#     create_plan,
#     run_plan_async,
# )
#
# __all__ = ["AsyncHandler", "Handler", "PythonRun", "create_plan", "run_plan", "run_plan_async"]
# @ end

#: handler(cursor, message): runs in the transaction that takes the item (pginbox.AsyncInbox's shape).
AsyncHandler = Callable[[psycopg.AsyncCursor[Any], Message], Awaitable[object]]


async def _attempt(
    conn: psycopg.AsyncConnection[Any], plan_id: int, spec: str, handler: AsyncHandler
) -> dict[str, Any]:
    """One transaction: take the next item, run the handler on it, commit. _HandlerFailed: rolled
    back; a transient error is raised as it is (Protocol.retry runs the transaction again)."""
    async with conn.transaction():
        async with conn.cursor(row_factory=dict_row) as cur:
            row = await (await cur.execute(BEGIN_SQL, {"plan_id": plan_id, "handler": spec})).fetchone()
        assert row is not None
        if row["action"] != "run":
            return row
        error: Exception | None = None
        returned: object = None
        async with conn.cursor() as hcur:
            try:
                returned = await handler(hcur, _message(row))
            except Exception as exc:
                error = exc
        verdict = judge(conn, error, returned, client="the replay")
        if verdict is not None:
            raise _failed(row, error, verdict)
    return row


async def _record_failure(conn: psycopg.AsyncConnection[Any], plan_id: int, params: dict[str, Any]) -> bool:
    """inbox.python_replay_item_failed, in a transaction of its own; False when the item was no
    longer pending."""
    try:
        async with conn.transaction(), conn.cursor() as cur:
            row = await (await cur.execute(FAILED_SQL, params)).fetchone()
    except psycopg.Error as exc:
        what = f"cannot record the failure of item {params['item_no']} of replay plan {plan_id}"
        raise _refused(what, exc) from exc
    return row is not None and bool(row[0])


async def _run_plan(
    conn: psycopg.AsyncConnection[Any],
    plan_id: int,
    spec: str,
    handler: AsyncHandler,
    max_items: int | None,
    retry: RetryPolicy | None,
    progress: Callable[[PythonRun], None] | None,
) -> PythonRun:
    """What `run_plan` does, on `conn`; a connection opened to replace a lost one is closed on return."""
    run = PythonRun(plan_id, spec)
    async with AsyncHandlerRun(conn, retry, f"replay plan {plan_id}", _refused) as runner:
        while max_items is None or run.applied_now + run.failed_now < max_items:
            outcome = await runner.transaction(lambda c: _attempt(c, plan_id, spec, handler), _HandlerFailed)
            params: dict[str, Any] = {}
            recorded = False
            if isinstance(outcome, _HandlerFailed):
                params = _failure_params(plan_id, spec, outcome)
                recorded = await _record_failure(runner.conn, plan_id, params)
            if _counted(run, outcome, recorded, params):
                break
            if progress is not None:
                progress(run)
        if progress is not None:
            progress(run)
        return run


# @ async: the asyncio flavour opens (and closes) a connection of its own
async def run_plan_async(
    dsn: str,
    plan_id: int,
    spec: str,
    handler: AsyncHandler,
    *,
    max_items: int | None = None,
    retry: RetryPolicy | None = None,
) -> PythonRun:
    """`run_plan` for an `async def` handler, on an asyncio connection of its own to `dsn` (the
    consumer's login)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=None)
    try:
        return await _run_plan(conn, plan_id, spec, handler, max_items, retry, None)
    finally:
        await conn.close()


# @ sync
# def run_plan(
#     conn: psycopg.Connection[Any],
#     plan_id: int,
#     spec: str,
#     handler: Handler,
#     *,
#     max_items: int | None = None,
#     retry: RetryPolicy | None = None,
#     progress: Callable[[PythonRun], None] | None = None,
# ) -> PythonRun:
#     """Run `handler` (named `spec`, module:function, as the plan does) on the plan's pending items,
#     one transaction each, on `conn`: a connection of the consumer's own login, not in a
#     transaction. Stops when no item is pending (the plan completes), or after `max_items` items
#     taken by the handler. A refusal raises ReplayError with the database's reason; a lost
#     connection is replaced by one with the same parameters. Each item's transaction is retried
#     by pginbox.client.protocol's Protocol.retry, as pginbox.Inbox retries a delivery."""
#     return _run_plan(conn, plan_id, spec, handler, max_items, retry, progress)
# @ end
