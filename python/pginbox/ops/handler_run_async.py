# @ async: the sync module is generated from this module
# This module is the one source of both flavours: python/tools/async_to_sync.py writes
# pginbox/ops/handler_run.py (`HandlerRun`) from it, and tests/run fails when that file is out of
# date. Edit this file, then run `python python/tools/async_to_sync.py`.
# @ end
"""What the operator paths that run a Python handler with the consumer's login share (repair grants,
pginbox.ops.granted_repair; Python replay plans, pginbox.ops.python_replay): the handler rules of
pginbox.client.protocol applied to a psycopg connection, the transient kind of an error, so that
both retry through Protocol.retry like pginbox.AsyncInbox does, how a lost connection is replaced,
and the runner of their transactions that does all that, once for both paths.

pginbox.ops.handler_run (HandlerRun) is generated from pginbox.ops.handler_run_async
(AsyncHandlerRun), which defines the pieces both share and that do no I/O (judge, transient_kind,
reconnect_args). Both flavours of each path (pginbox.ops.granted_repair and its source,
granted_repair_async; the same for python_replay) use the flavour of their own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg

from pginbox.client import shared as _core
from pginbox.client.connection import conninfo_of, handler_verdict
from pginbox.client.drive import drive_async
from pginbox.client.protocol import Protocol, Transient
from pginbox.client.retry import RetryPolicy, TransientKind, classify
from pginbox.client.shared import CallCost
from pginbox.errors import RetriesExhausted

# @ async: what does no I/O is defined once, here; the sync module imports it
__all__ = ["AsyncHandlerRun", "judge", "reconnect_args", "transient_kind"]


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
    verdict = handler_verdict(conn, error, returned, client=client)
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
    return {
        "conninfo": conninfo_of(conn),
        "autocommit": conn.autocommit,
        "prepare_threshold": conn.prepare_threshold,
    }


# @ sync
# from pginbox.ops.handler_run_async import judge, reconnect_args, transient_kind
#
# __all__ = ["HandlerRun", "judge", "reconnect_args", "transient_kind"]
# @ end

T = TypeVar("T")
F = TypeVar("F", bound=Exception)


class AsyncHandlerRun:
    """The transactions of an operator-side handler on `conn`, a connection of the consumer's login
    (not in a transaction), each run by `transaction` through one Protocol.retry, as
    pginbox.AsyncInbox retries a delivery: a transient error or a lost connection runs it again, a
    lost connection first replaced by one with the same parameters (reconnect_args). `conn` is
    the connection the next transaction runs on; leaving the context manager closes it when it is
    such a replacement (the caller's own connection is left open).

    `what` names the run in errors ("repair grant 7"): RetriesExhausted gets the note
    "pginbox: <what>", and another psycopg.Error is raised as refused("cannot run <what>", error)."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        retry: RetryPolicy | None,
        what: str,
        refused: Callable[[str, psycopg.Error], Exception],
    ) -> None:
        self.conn = conn
        self._given = conn
        self._what = what
        self._refused = refused
        self._protocol = Protocol(retry or RetryPolicy(), classify=lambda exc: transient_kind(exc, self.conn))

    async def __aenter__(self) -> AsyncHandlerRun:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.conn is not self._given:
            await self.conn.close()

    async def transaction(
        self, attempt: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], failed: type[F]
    ) -> T | F:
        """attempt(conn), one transaction, until it returns (its result) or raises `failed` (the
        handler failed and the transaction rolled back: that error is returned, not raised)."""

        async def once() -> T | F:
            if self.conn.closed:
                self.conn = await psycopg.AsyncConnection.connect(**reconnect_args(self.conn))
            try:
                return await attempt(self.conn)
            except failed as error:
                return error

        try:
            outcome: T | F = await drive_async(self._protocol.retry(once, CallCost()))
        except RetriesExhausted as exc:
            exc.add_note(f"pginbox: {self._what}")
            raise
        except psycopg.Error as exc:
            raise self._refused(f"cannot run {self._what}", exc) from exc
        return outcome
