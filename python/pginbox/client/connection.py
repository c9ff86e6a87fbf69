"""What the transaction protocol (pginbox.client.protocol) reads off a psycopg connection, for
every psycopg-driven path: pginbox.Inbox / AsyncInbox and the operator paths that run a Python
handler with the consumer's login (pginbox.ops.handler_run)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo

from pginbox.client import shared as _core
from pginbox.client.protocol import Transient, judge_handler
from pginbox.client.retry import classify

__all__ = ["conninfo_of", "handler_verdict"]


def handler_verdict(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    error: Exception | None,
    returned: object,
    *,
    client: str,
) -> BaseException | Transient | None:
    """The protocol's verdict (judge_handler) on a handler that ran in `conn`'s transaction and
    raised `error` (None) or returned `returned`: None when the transaction may commit, a
    Transient to retry, else the error to record."""
    status = conn.pgconn.transaction_status
    return judge_handler(
        error,
        returned,
        transient=None if error is None else classify(error),
        lost=conn.closed if error is None else _core.connection_lost(error, conn),
        failed_tx=status == pq.TransactionStatus.INERROR,
        ended_tx=status == pq.TransactionStatus.IDLE,
        client=client,
    )


def conninfo_of(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    """The connection string that opens a connection like `conn`: its parameters, the password
    too (which `info.dsn` leaves out)."""
    info = conn.info
    return make_conninfo(info.dsn, **({"password": info.password} if info.password else {}))
