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

A transient error (class 40, 57014, a lost connection, ...) re-runs the item's transaction; a
COMMIT whose answer was lost needs nothing: the next call finds the item applied, or pending.
A killed runner leaves its item pending, and the next run applies it once.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from pginbox.client import shared as _core
from pginbox.client.outcomes import Message
from pginbox.client.retry import RetryPolicy, classify
from pginbox.errors import HandlerProtocolError, ReplayError, RetriesExhausted, server_message

__all__ = ["AsyncHandler", "Handler", "PythonRun", "create_plan", "run_plan", "run_plan_async"]

#: handler(cursor, message): runs in the transaction that takes the item (pginbox.Inbox's shape).
Handler = Callable[[psycopg.Cursor[Any], Message], object]

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
    """inbox.create_python_replay_plan, committed on return (the operator's connection); the plan_id."""
    params = {
        "name": name,
        "consumer": consumer,
        "message_type": message_type,
        "handler": handler,
        "version": version,
        "note": note,
    }
    try:
        with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(CREATE_SQL, params).fetchone()
    except psycopg.Error as exc:
        raise _refused(f"cannot create replay plan {name!r}", exc) from exc
    assert row is not None
    return int(row["plan_id"])


class _HandlerFailed(Exception):
    def __init__(self, item_no: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.item_no = item_no
        self.error = error


def _attempt(conn: psycopg.Connection[Any], plan_id: int, spec: str, handler: Handler) -> dict[str, Any]:
    """One transaction: take the next item, run the handler on it, commit. _HandlerFailed: rolled back."""
    with conn.transaction():
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(BEGIN_SQL, {"plan_id": plan_id, "handler": spec}).fetchone()
        assert row is not None
        if row["action"] != "run":
            return row
        message = Message(
            row["producer"],
            row["message_id"],
            row["message_type"],
            row["payload"],
            tenant=row["tenant"],
            produced_at=row["produced_at"],
        )
        with conn.cursor() as hcur:
            try:
                returned = handler(hcur, message)
                if inspect.isawaitable(returned):
                    _core.discard_awaitable(returned)
                    raise HandlerProtocolError(
                        "the handler returned an awaitable it did not await (a coroutine): its statements never ran",
                        reason_code="handler_returned_awaitable",
                    )
            except Exception as exc:
                if classify(exc) is not None or _core.connection_lost(exc, conn):
                    raise
                raise _HandlerFailed(row["item_no"], exc) from exc
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            raise _HandlerFailed(
                row["item_no"],
                HandlerProtocolError(
                    "the handler returned, but a database error it caught left its transaction failed: rolled back",
                    reason_code="25P02",
                    sqlstate="25P02",
                ),
            )
    return row


def _reconnect(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    info = conn.info
    return psycopg.Connection.connect(
        make_conninfo(info.dsn, **({"password": info.password} if info.password else {})),
        autocommit=conn.autocommit,
    )


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
    connection is replaced by one with the same parameters."""
    policy = retry or RetryPolicy()
    rng = random.Random()
    run = PythonRun(plan_id, spec)
    number = 0  # attempts of the current item's transaction
    while max_items is None or run.applied_now + run.failed_now < max_items:
        number += 1
        try:
            if conn.closed:
                conn = _reconnect(conn)
            row = _attempt(conn, plan_id, spec, handler)
        except _HandlerFailed as failed:
            reason, text = _core.failure_reason(failed.error)
            try:
                with conn.transaction(), conn.cursor() as cur:
                    params = {
                        "plan_id": plan_id,
                        "item_no": failed.item_no,
                        "handler": spec,
                        "reason": reason,
                        "text": text,
                    }
                    recorded = cur.execute(FAILED_SQL, params).fetchone()
            except psycopg.Error as exc:
                what = f"cannot record the failure of item {failed.item_no} of replay plan {plan_id}"
                raise _refused(what, exc) from exc
            if recorded is not None and recorded[0]:
                run.failed_now += 1
                run.failures.append((failed.item_no, reason, text))
            number = 0
        except psycopg.Error as exc:
            if classify(exc) is None and not _core.connection_lost(exc, conn):
                raise _refused(f"cannot run replay plan {plan_id}", exc) from exc
            if number >= policy.max_attempts:
                raise RetriesExhausted(
                    f"replay plan {plan_id}: gave up after {number} attempts: {exc}",
                    attempts=number,
                    sqlstate=exc.sqlstate,
                ) from exc
            time.sleep(policy.backoff(number, rng))
            continue
        else:
            number = 0
            run.skipped_now += row["skipped_now"]
            run.failed_now += row["failed_now"]
            run.status = row["status"]
            if row["action"] == "run":
                run.applied_now += 1
            elif row["action"] == "done":
                break
        if progress is not None:
            progress(run)
    if progress is not None:
        progress(run)
    return run


#: async handler(cursor, message), as `pginbox consume` runs an `async def` handler.
AsyncHandler = Callable[[psycopg.AsyncCursor[Any], Message], Awaitable[object]]


async def _attempt_async(
    conn: psycopg.AsyncConnection[Any], plan_id: int, spec: str, handler: AsyncHandler
) -> dict[str, Any]:
    async with conn.transaction():
        async with conn.cursor(row_factory=dict_row) as cur:
            row = await (await cur.execute(BEGIN_SQL, {"plan_id": plan_id, "handler": spec})).fetchone()
        assert row is not None
        if row["action"] != "run":
            return row
        message = Message(
            row["producer"],
            row["message_id"],
            row["message_type"],
            row["payload"],
            tenant=row["tenant"],
            produced_at=row["produced_at"],
        )
        async with conn.cursor() as hcur:
            try:
                await handler(hcur, message)
            except Exception as exc:
                if classify(exc) is not None or _core.connection_lost(exc, conn):
                    raise
                raise _HandlerFailed(row["item_no"], exc) from exc
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            raise _HandlerFailed(
                row["item_no"],
                HandlerProtocolError(
                    "the handler returned, but a database error it caught left its transaction failed: rolled back",
                    reason_code="25P02",
                    sqlstate="25P02",
                ),
            )
    return row


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
    policy = retry or RetryPolicy()
    rng = random.Random()
    run = PythonRun(plan_id, spec)
    number = 0
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=None)
    try:
        while max_items is None or run.applied_now + run.failed_now < max_items:
            number += 1
            try:
                if conn.closed:
                    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=None)
                row = await _attempt_async(conn, plan_id, spec, handler)
            except _HandlerFailed as failed:
                reason, text = _core.failure_reason(failed.error)
                params = {
                    "plan_id": plan_id,
                    "item_no": failed.item_no,
                    "handler": spec,
                    "reason": reason,
                    "text": text,
                }
                try:
                    async with conn.transaction(), conn.cursor() as cur:
                        recorded = await (await cur.execute(FAILED_SQL, params)).fetchone()
                except psycopg.Error as exc:
                    what = f"cannot record the failure of item {failed.item_no} of replay plan {plan_id}"
                    raise _refused(what, exc) from exc
                if recorded is not None and recorded[0]:
                    run.failed_now += 1
                    run.failures.append((failed.item_no, reason, text))
                number = 0
            except psycopg.Error as exc:
                if classify(exc) is None and not _core.connection_lost(exc, conn):
                    raise _refused(f"cannot run replay plan {plan_id}", exc) from exc
                if number >= policy.max_attempts:
                    raise RetriesExhausted(
                        f"replay plan {plan_id}: gave up after {number} attempts: {exc}",
                        attempts=number,
                        sqlstate=exc.sqlstate,
                    ) from exc
                await asyncio.sleep(policy.backoff(number, rng))
            else:
                number = 0
                run.skipped_now += row["skipped_now"]
                run.failed_now += row["failed_now"]
                run.status = row["status"]
                if row["action"] == "run":
                    run.applied_now += 1
                elif row["action"] == "done":
                    break
        return run
    finally:
        await conn.close()
