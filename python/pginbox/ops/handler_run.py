# Generated from handler_run_async.py by python/tools/async_to_sync.py: DO NOT EDIT.
# Edit python/pginbox/ops/handler_run_async.py, then run the script (tests/run checks this file).
"""What the operator paths that run a Python handler with the consumer's login share (repair grants,
pginbox.ops.granted_repair; Python replay plans, pginbox.ops.python_replay): the handler rules of
pginbox.client.protocol applied to a psycopg connection, the transient kind of an error, so that
both retry through Protocol.retry like pginbox.Inbox does, how a lost connection is replaced,
and the runner of their transactions that does all that, once for both paths.

pginbox.ops.handler_run (HandlerRun) is generated from pginbox.ops.handler_run_async
(AsyncHandlerRun), which defines the pieces both share and that do no I/O (judge, transient_kind,
reconnect_args). Both flavours of each path (pginbox.ops.granted_repair and its source,
granted_repair_async; the same for python_replay) use the flavour of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from pginbox.client.drive import drive
from pginbox.client.protocol import Protocol
from pginbox.client.retry import RetryPolicy
from pginbox.client.shared import CallCost
from pginbox.errors import RetriesExhausted
from pginbox.ops.handler_run_async import judge, reconnect_args, transient_kind

__all__ = ["HandlerRun", "judge", "reconnect_args", "transient_kind"]

T = TypeVar("T")
F = TypeVar("F", bound=Exception)


class HandlerRun:
    """The transactions of an operator-side handler on `conn`, a connection of the consumer's login
    (not in a transaction), each run by `transaction` through one Protocol.retry, as
    pginbox.Inbox retries a delivery: a transient error or a lost connection runs it again, a
    lost connection first replaced by one with the same parameters (reconnect_args). `conn` is
    the connection the next transaction runs on; leaving the context manager closes it when it is
    such a replacement (the caller's own connection is left open).

    `what` names the run in errors ("repair grant 7"): RetriesExhausted gets the note
    "pginbox: <what>", and another psycopg.Error is raised as refused("cannot run <what>", error)."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        retry: RetryPolicy | None,
        what: str,
        refused: Callable[[str, psycopg.Error], Exception],
    ) -> None:
        self.conn = conn
        self._given = conn
        self._what = what
        self._refused = refused
        self._protocol = Protocol(retry or RetryPolicy(), classify=lambda exc: transient_kind(exc, self.conn))

    def __enter__(self) -> HandlerRun:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.conn is not self._given:
            self.conn.close()

    def transaction(self, attempt: Callable[[psycopg.Connection[Any]], T], failed: type[F]) -> T | F:
        """attempt(conn), one transaction, until it returns (its result) or raises `failed` (the
        handler failed and the transaction rolled back: that error is returned, not raised)."""

        def once() -> T | F:
            if self.conn.closed:
                self.conn = psycopg.connect(**reconnect_args(self.conn))
            try:
                return attempt(self.conn)
            except failed as error:
                return error

        try:
            outcome: T | F = drive(self._protocol.retry(once, CallCost()))
        except RetriesExhausted as exc:
            exc.add_note(f"pginbox: {self._what}")
            raise
        except psycopg.Error as exc:
            raise self._refused(f"cannot run {self._what}", exc) from exc
        return outcome
