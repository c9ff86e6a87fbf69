"""What the operator paths that run a Python handler with the consumer's login share (repair grants,
pginbox.ops.granted_repair; Python replay plans, pginbox.ops.python_replay): the handler rules of
pginbox.client.protocol applied to a psycopg connection, the transient kind of an error, so that
both retry through Protocol.retry like pginbox.Inbox does, and how a lost connection is replaced.
Both flavours of each path (pginbox.ops.granted_repair and its source, granted_repair_async; the
same for python_replay) use these: none does I/O."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from pginbox.client import shared as _core
from pginbox.client.protocol import Transient, judge_handler
from pginbox.client.retry import TransientKind, classify

__all__ = ["judge", "reconnect_args", "transient_kind"]


def judge(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    error: Exception | None,
    returned: object,
    *,
    client: str,
) -> BaseException | None:
    """The end of a handler that ran in `conn`'s transaction: None when it may commit; the error
    to record (the transaction rolls back) when it failed. A transient error is raised as it is:
    the transaction rolls back and the caller's Protocol.retry runs it again."""
    status = conn.pgconn.transaction_status
    verdict = judge_handler(
        error,
        returned,
        transient=None if error is None else classify(error),
        lost=conn.closed if error is None else _core.connection_lost(error, conn),
        failed_tx=status == psycopg.pq.TransactionStatus.INERROR,
        ended_tx=status == psycopg.pq.TransactionStatus.IDLE,
        client=client,
    )
    if isinstance(verdict, Transient):
        raise verdict.error
    return verdict


def transient_kind(
    exc: BaseException, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
) -> TransientKind | None:
    """Protocol's classify for these paths: a transient SQLSTATE, or the connection lost."""
    if not isinstance(exc, psycopg.Error):
        return None
    return classify(exc) or (TransientKind.CONNECTION if _core.connection_lost(exc, conn) else None)


def reconnect_args(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> dict[str, Any]:
    """The arguments of psycopg's connect (sync or asyncio) that open a connection like `conn`, which
    was lost: its parameters (the password too, which `info.dsn` leaves out), autocommit and
    prepare_threshold. The next attempt runs on that one."""
    info = conn.info
    return {
        "conninfo": make_conninfo(info.dsn, **({"password": info.password} if info.password else {})),
        "autocommit": conn.autocommit,
        "prepare_threshold": conn.prepare_threshold,
    }
