# @ async: the sync module is generated from this module
# This module is the one source of both flavours: python/tools/async_to_sync.py writes
# pginbox/ops/granted_repair.py (`redeem`) from it, and tests/run fails when that file is out of
# date. Edit this file, then run `python python/tools/async_to_sync.py`.
# @ end
"""Repairing a quarantined message with a Python handler: `pginbox quarantine repair ID --python
MODULE:FUNCTION` and `pginbox quarantine redeem GRANT --python MODULE:FUNCTION`.

The database decides who may do what (sql/121_python_repair.sql); this module only makes the calls:

  grant(operator_conn, ...)        inbox.grant_repair: a one-time, expiring grant, audited
  redeem(consumer_conn, ...)       on a connection of the consumer's own login, in one transaction:
                                   inbox.begin_granted_repair (the entry closes as recovered, the
                                   message comes back), the handler(cursor, message), COMMIT. When
                                   the handler raises, the transaction rolls back and
                                   inbox.granted_repair_failed audits the failure in a new one.
  redeem_async(dsn, ...)           the same for an `async def` handler, on an asyncio connection
                                   of its own

A transient error (class 40, 57014, a lost connection, ...) re-runs the transaction; a COMMIT whose
answer was lost is resolved from the grant itself (used, or not). Refusals come back as
OperatorError with the server's reason.

pginbox.ops.granted_repair (grant, redeem) is generated from pginbox.ops.granted_repair_async
(redeem_async), which defines the pieces both share (the statements, Grant, Redemption, grant).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import psycopg
from psycopg.rows import dict_row

from pginbox.client import shared as _core
from pginbox.client.outcomes import Message
from pginbox.client.retry import RetryPolicy
from pginbox.errors import OperatorError, server_message
from pginbox.ops.handler_run_async import AsyncHandlerRun, judge
from pginbox.ops.json_values import jsonable

# @ async: what has no asyncio in it is defined once, here; the sync module imports it
__all__ = ["AsyncHandler", "Grant", "Redemption", "grant", "redeem_async"]

GRANT_SQL: Final = """
SELECT g.grant_id, g.quarantine_id, g.consumer, g.tenant, g.handler, g.handler_version, g.note, g.granted_by,
       g.granted_at, g.expires_at
  FROM inbox.grant_repair(quarantine_id => %(id)s, handler => %(handler)s, note => %(note)s,
                          handler_version => %(version)s, valid_for => pg_catalog.make_interval(secs => %(secs)s)) g
"""
BEGIN_SQL: Final = """
SELECT r.grant_id, r.quarantine_id, r.consumer, r.tenant, r.producer, r.message_id, r.message_type, r.payload,
       r.payload_sha256, r.handler_version, r.attempts
  FROM inbox.begin_granted_repair(grant_id => %(grant)s, handler => %(handler)s) r
"""
FAILED_SQL: Final = """
SELECT g.grant_id, g.quarantine_id, g.handler_version, g.redeemed_by, g.result, g.reason_code, g.error_message
  FROM inbox.granted_repair_failed(grant_id => %(grant)s, handler => %(handler)s, reason_code => %(reason)s,
                                   error_message => %(text)s) g
"""


@dataclass(frozen=True)
class Grant:
    grant_id: int
    quarantine_id: int
    consumer: str
    tenant: str
    handler: str
    handler_version: str
    note: str
    granted_by: str
    granted_at: dt.datetime
    expires_at: dt.datetime

    def as_json(self) -> dict[str, Any]:
        return {k: jsonable(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Redemption:
    grant_id: int
    quarantine_id: int
    result: Literal["recovered", "repair_failed"]
    handler: str
    handler_version: str
    reason_code: str | None = None
    error_message: str | None = None
    exception: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.result == "recovered"

    def as_json(self) -> dict[str, Any]:
        return {
            "grant_id": self.grant_id,
            "quarantine_id": self.quarantine_id,
            "result": self.result,
            "handler": self.handler,
            "handler_version": self.handler_version,
            "reason_code": self.reason_code,
            "error_message": self.error_message,
        }


def _refused(what: str, exc: psycopg.Error) -> OperatorError:
    return OperatorError(f"{what}: {server_message(exc)}", sqlstate=exc.sqlstate)


def grant(
    conn: psycopg.Connection[Any],
    quarantine_id: int,
    handler: str,
    note: str,
    *,
    handler_version: str | None = None,
    valid_for: float = 900.0,
) -> Grant:
    """inbox.grant_repair, committed on return (the operator's connection)."""
    params = {"id": quarantine_id, "handler": handler, "note": note, "version": handler_version, "secs": valid_for}
    try:
        with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(GRANT_SQL, params).fetchone()
    except psycopg.Error as exc:
        raise _refused(f"cannot grant a repair of entry {quarantine_id}", exc) from exc
    assert row is not None
    return Grant(**row)


class _HandlerFailed(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


# @ sync
# from pginbox.ops.granted_repair_async import (
#     BEGIN_SQL,
#     FAILED_SQL,
#     AsyncHandler,
#     Grant,
#     Redemption,
#     _HandlerFailed,
#     _refused,
#     grant,
#     redeem_async,
# )
#
# __all__ = ["AsyncHandler", "Grant", "Handler", "Redemption", "grant", "redeem", "redeem_async"]
# @ end

#: handler(cursor, message): runs in the transaction that redeems the grant (pginbox.AsyncInbox's shape).
AsyncHandler = Callable[[psycopg.AsyncCursor[Any], Message], Awaitable[object]]


async def _attempt(
    conn: psycopg.AsyncConnection[Any], grant_id: int, spec: str, handler: AsyncHandler
) -> dict[str, Any]:
    """One transaction: redeem, run the handler, commit. _HandlerFailed: rolled back."""
    async with conn.transaction():
        async with conn.cursor(row_factory=dict_row) as cur:
            row = await (await cur.execute(BEGIN_SQL, {"grant": grant_id, "handler": spec})).fetchone()
        assert row is not None
        message = Message(row["producer"], row["message_id"], row["message_type"], row["payload"], tenant=row["tenant"])
        error: Exception | None = None
        returned: object = None
        async with conn.cursor() as hcur:
            try:
                returned = await handler(hcur, message)
            except Exception as exc:
                error = exc
        # A transient error is raised as it is (rolled back, run again), a failure as _HandlerFailed.
        verdict = judge(conn, error, returned, client="the repair")
        if verdict is not None:
            raise _HandlerFailed(verdict) from error
    return row


async def _record_failure(
    conn: psycopg.AsyncConnection[Any], grant_id: int, spec: str, error: BaseException
) -> Redemption:
    """inbox.granted_repair_failed, in a transaction of its own: the handler's failure, audited."""
    reason, text = _core.failure_reason(error)
    params = {"grant": grant_id, "handler": spec, "reason": reason, "text": text}
    try:
        async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            frow = await (await cur.execute(FAILED_SQL, params)).fetchone()
    except psycopg.Error as exc:
        raise _refused(f"cannot record the failure of repair grant {grant_id}", exc) from exc
    assert frow is not None
    return Redemption(
        grant_id,
        frow["quarantine_id"],
        "repair_failed",
        spec,
        frow["handler_version"],
        frow["reason_code"],
        frow["error_message"],
        error,
    )


async def _redeem(
    conn: psycopg.AsyncConnection[Any], grant_id: int, spec: str, handler: AsyncHandler, retry: RetryPolicy | None
) -> Redemption:
    """What `redeem` does, on `conn`; a connection opened to replace a lost one is closed on return."""
    async with AsyncHandlerRun(conn, retry, f"repair grant {grant_id}", _refused) as run:
        outcome = await run.transaction(lambda c: _attempt(c, grant_id, spec, handler), _HandlerFailed)
        if isinstance(outcome, _HandlerFailed):
            return await _record_failure(run.conn, grant_id, spec, outcome.error)
        return Redemption(grant_id, outcome["quarantine_id"], "recovered", spec, outcome["handler_version"])


# @ async: the asyncio flavour opens (and closes) a connection of its own
async def redeem_async(
    dsn: str, grant_id: int, spec: str, handler: AsyncHandler, *, retry: RetryPolicy | None = None
) -> Redemption:
    """`redeem` for an `async def` handler, on an asyncio connection of its own to `dsn` (the
    consumer's login)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=None)
    try:
        return await _redeem(conn, grant_id, spec, handler, retry)
    finally:
        await conn.close()


# @ sync
# def redeem(
#     conn: psycopg.Connection[Any],
#     grant_id: int,
#     spec: str,
#     handler: Handler,
#     *,
#     retry: RetryPolicy | None = None,
# ) -> Redemption:
#     """Run `handler` (named `spec`, module:function, as the grant does) on the granted entry's
#     message, on `conn`: a connection of the consumer's own login, not in a transaction. A lost
#     connection is replaced by one with the same parameters for the next attempt; if it was lost
#     during COMMIT and the COMMIT happened, the next attempt is refused with "already used by ...
#     (recovered)"."""
#     return _redeem(conn, grant_id, spec, handler, retry)
# @ end
