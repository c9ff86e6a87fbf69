"""What the operator paths that run a Python handler with the consumer's login share (repair grants,
pginbox.ops.granted_repair; Python replay plans, pginbox.ops.python_replay): the handler rules of
pginbox.client.protocol applied to a psycopg connection, and the transient kind of an error, so
that both retry through Protocol.retry like pginbox.Inbox does."""

from __future__ import annotations

from typing import Any

import psycopg

from pginbox.client import shared as _core
from pginbox.client.protocol import Transient, judge_handler
from pginbox.client.retry import TransientKind, classify

__all__ = ["judge", "transient_kind"]


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
