# Generated from granted_repair_async.py by python/tools/async_to_sync.py: DO NOT EDIT.
# Edit python/pginbox/ops/granted_repair_async.py, then run the script (tests/run checks this file).
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

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pginbox.client import shared as _core
from pginbox.client.outcomes import Message
from pginbox.client.retry import RetryPolicy
from pginbox.ops.granted_repair_async import (
    BEGIN_SQL,
    FAILED_SQL,
    AsyncHandler,
    Grant,
    Redemption,
    _HandlerFailed,
    _refused,
    grant,
    redeem_async,
)
from pginbox.ops.handler_run import HandlerRun, judge

__all__ = ["AsyncHandler", "Grant", "Handler", "Redemption", "grant", "redeem", "redeem_async"]

#: handler(cursor, message): runs in the transaction that redeems the grant (pginbox.Inbox's shape).
Handler = Callable[[psycopg.Cursor[Any], Message], object]


def _attempt(conn: psycopg.Connection[Any], grant_id: int, spec: str, handler: Handler) -> dict[str, Any]:
    """One transaction: redeem, run the handler, commit. _HandlerFailed: rolled back."""
    with conn.transaction():
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(BEGIN_SQL, {"grant": grant_id, "handler": spec}).fetchone()
        assert row is not None
        message = Message(row["producer"], row["message_id"], row["message_type"], row["payload"], tenant=row["tenant"])
        error: Exception | None = None
        returned: object = None
        with conn.cursor() as hcur:
            try:
                returned = handler(hcur, message)
            except Exception as exc:
                error = exc
        # A transient error is raised as it is (rolled back, run again), a failure as _HandlerFailed.
        verdict = judge(conn, error, returned, client="the repair")
        if verdict is not None:
            raise _HandlerFailed(verdict) from error
    return row


def _record_failure(conn: psycopg.Connection[Any], grant_id: int, spec: str, error: BaseException) -> Redemption:
    """inbox.granted_repair_failed, in a transaction of its own: the handler's failure, audited."""
    reason, text = _core.failure_reason(error)
    params = {"grant": grant_id, "handler": spec, "reason": reason, "text": text}
    try:
        with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            frow = cur.execute(FAILED_SQL, params).fetchone()
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


def _redeem(
    conn: psycopg.Connection[Any], grant_id: int, spec: str, handler: Handler, retry: RetryPolicy | None
) -> Redemption:
    """What `redeem` does, on `conn`; a connection opened to replace a lost one is closed on return."""
    with HandlerRun(conn, retry, f"repair grant {grant_id}", _refused) as run:
        outcome = run.transaction(lambda c: _attempt(c, grant_id, spec, handler), _HandlerFailed)
        if isinstance(outcome, _HandlerFailed):
            return _record_failure(run.conn, grant_id, spec, outcome.error)
        return Redemption(grant_id, outcome["quarantine_id"], "recovered", spec, outcome["handler_version"])


def redeem(
    conn: psycopg.Connection[Any],
    grant_id: int,
    spec: str,
    handler: Handler,
    *,
    retry: RetryPolicy | None = None,
) -> Redemption:
    """Run `handler` (named `spec`, module:function, as the grant does) on the granted entry's
    message, on `conn`: a connection of the consumer's own login, not in a transaction. A lost
    connection is replaced by one with the same parameters for the next attempt; if it was lost
    during COMMIT and the COMMIT happened, the next attempt is refused with "already used by ...
    (recovered)"."""
    return _redeem(conn, grant_id, spec, handler, retry)
