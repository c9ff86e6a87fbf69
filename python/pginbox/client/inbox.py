# Generated from async_inbox.py by python/tools/async_to_sync.py: DO NOT EDIT.
# Edit python/pginbox/client/async_inbox.py, then run the script (tests/run checks this file).
"""`Inbox`: the client of schema `inbox` (psycopg.Connection or
psycopg_pool.ConnectionPool).

Every delivery runs in transactions of its own, started with an explicit BEGIN (honouring the
connection's isolation_level) and sent in one round trip with the claim (pipeline mode):

  handle       BEGIN + inbox.claim | the Python handler's statements | COMMIT
  apply        BEGIN + inbox.claim_and_apply | COMMIT
  apply_batch  BEGIN + inbox.claim_and_apply_batch (<= 64 messages) | COMMIT, per chunk

The protocol around these transactions (retries, a COMMIT whose answer was lost, the handler's
rules) is pginbox.client.protocol, shared with the SQLAlchemy and Django integrations: this module
runs its transactions on psycopg.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import replace
from datetime import datetime
from functools import partial
from typing import Any, TypeVar, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.rows import TupleRow, tuple_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout

from pginbox import pooler
from pginbox.client import queries
from pginbox.client import shared as _core
from pginbox.client.connection import conninfo_of, handler_verdict
from pginbox.client.drive import drive
from pginbox.client.durability import WAIT_DURABLE, Durability
from pginbox.client.outcomes import InboxStats, Message, Outcome, Result
from pginbox.client.protocol import Protocol, Transient, applied, commit_lost, raise_if_failed
from pginbox.client.retry import RetryPolicy, TransientKind, classify
from pginbox.client.shared import BeforeCommit, CallCost, ChunkHook, Failure
from pginbox.errors import NotDurable, PginboxError
from pginbox.sql_limits import MAX_BATCH

__all__ = ["Handler", "Inbox"]

T = TypeVar("T")
Conn = psycopg.Connection[Any]

#: handler(cursor, message): runs inside the transaction that holds the claim. Its return value is
#: ignored, except an awaitable (a coroutine it forgot to await): that fails the message
#: (HandlerProtocolError, reason handler_returned_awaitable) instead of committing without its
#: writes; raising rolls back the claim and its writes.
Handler = Callable[[psycopg.Cursor[Any], Message], object]

_IDLE = pq.TransactionStatus.IDLE
_PIPELINE = psycopg.Pipeline.is_supported()


def _transient(exc: BaseException) -> TransientKind | None:
    """The transient kind of a driver error (a pool that timed out or closed is not one: raised)."""
    if not isinstance(exc, psycopg.Error) or isinstance(exc, PoolTimeout | PoolClosed):
        return None
    return classify(exc)


# The hot paths (handle, one statement) switch autocommit with these two calls around a
# try/finally rather than with the _autocommit context manager: a generator-based context manager
# costs a few microseconds per call. set_autocommit is a method of both flavours (the sync
# `autocommit` property setter calls it), so the two modules make the same calls.
def _enter_autocommit(conn: Conn, pipeline: bool = True) -> bool:
    """In pipeline mode our transactions start with our own BEGIN, sent in the same round trip as
    the first statement: psycopg must not send one of its own, so the connection is switched to
    autocommit for the transaction. True when it was switched and must be switched back with
    `_leave_autocommit`."""
    if not pipeline or conn.autocommit:
        return False
    conn.set_autocommit(True)
    return True


def _leave_autocommit(conn: Conn, switched: bool) -> None:
    if switched and not conn.closed and conn.pgconn.transaction_status == _IDLE:
        conn.set_autocommit(False)


@contextmanager
def _autocommit(conn: Conn) -> Iterator[None]:
    switched = _enter_autocommit(conn)
    try:
        yield
    finally:
        _leave_autocommit(conn, switched)


def _rollback_quietly(conn: Conn) -> None:
    if conn.closed:
        return
    with suppress(psycopg.Error):
        conn.rollback()


def _check_idle(conn: Conn) -> None:
    if conn.pgconn.transaction_status != _IDLE:
        raise PginboxError(
            "the connection given to Inbox is inside a transaction: Inbox runs its own transactions "
            "(commit or roll back first, or give Inbox a connection of its own)"
        )


def _begin_and_execute(conn: Conn, cur: psycopg.Cursor[TupleRow], query: Any, params: Any, pipeline: bool) -> None:
    """BEGIN, then `query`: in one round trip in pipeline mode, else in two (a connection not in
    autocommit mode gets psycopg's own BEGIN, which honours its isolation_level, read_only and
    deferrable)."""
    if pipeline:
        with conn.pipeline():
            cur.execute(queries.BEGIN[conn.isolation_level], prepare=False)
            cur.execute(query, params, prepare=True)
        return
    if conn.autocommit:
        cur.execute(queries.BEGIN[conn.isolation_level], prepare=False)
    cur.execute(query, params, prepare=True)


class Inbox:
    """Delivers messages for one consumer through schema `inbox`.

    conn_or_pool      a psycopg.Connection (used under a lock, one call at a time, replaced by a
                      new connection with the same parameters if it breaks: see `connection`) or a
                      psycopg_pool.ConnectionPool (one connection per call: safe for concurrent
                      callers).
    consumer          the consumer name: part of every message identity.
    handler_version   recorded with each claim and failure by `handle` (`apply` records the
                      version the SQL handler was registered with).
    retry             RetryPolicy for transient errors.
    pipeline          True: BEGIN and the claim travel in one round trip (psycopg pipeline mode);
                      False: two round trips, but less client CPU per message. None (default):
                      pipelined unless the server is on this machine (a Unix socket or a loopback
                      address), where a round trip costs less than the pipeline's client CPU.
                      Ignored where libpq has no pipeline mode.
    raise_on_failure  default of `handle(..., raise_on_failure=)`: False returns a FAILED or
                      QUARANTINED Result; True re-raises the handler's exception after recording it.
    batch_size        chunk size of apply_batch / handle_batch (at most 64).
    durability        when a call reports success (pginbox.client.durability.Durability): the
                      default `commit` returns after COMMIT on the primary; `Durability.standby()`
                      returns only once the standbys report the call's commits (inbox.wait_durable,
                      one statement per call, after its last COMMIT) and raises NotDurable when
                      they do not within its timeout: then do not ack (docs/failover.md).

    Behind a transaction pooler (PgBouncer), detected on first use (see `behind_pooler`), every
    connection Inbox uses is switched to `prepare_threshold = None`: no prepared statements, the
    handler's included (docs/pgbouncer.md).
    """

    def __init__(
        self,
        conn_or_pool: psycopg.Connection[Any] | ConnectionPool[Any],
        *,
        consumer: str,
        handler_version: str = "unversioned",
        retry: RetryPolicy | None = None,
        raise_on_failure: bool = False,
        batch_size: int = MAX_BATCH,
        pipeline: bool | None = None,
        durability: Durability | None = None,
    ) -> None:
        _core.check_names(consumer, handler_version)
        self.durability = durability if durability is not None else Durability()
        self.consumer = consumer
        self.handler_version = handler_version
        self.raise_on_failure = raise_on_failure
        self.batch_size = _core.check_batch_size(batch_size)
        self.pipeline = pipeline if _PIPELINE else False
        self._stats = _core.StatsCounter()
        self._protocol = Protocol(
            retry if retry is not None else RetryPolicy(),
            classify=_transient,
            poll_status=self._poll_status,
            terminate=self._terminate,
            stats=self._stats,
            on_pooler=self._found_pooler,
            rng=random.Random(),
        )
        self._schema_version: int | None = None
        self._behind_pooler = False
        self._pool: ConnectionPool[Any] | None = None
        self._conn: Conn | None = None
        self._own_conn = False
        self._lock = threading.Lock()
        given: object = conn_or_pool  # checked at run time too: callers are not always typed
        if isinstance(given, ConnectionPool):
            self._pool = given
        elif isinstance(given, psycopg.Connection):
            self._conn = given
            self._snapshot_connection(given)
        elif isinstance(given, psycopg.AsyncConnection | AsyncConnectionPool):
            raise TypeError("Inbox takes a sync connection or pool; use pginbox.AsyncInbox for asyncio")
        else:
            raise TypeError(
                f"Inbox takes a psycopg.Connection or a psycopg_pool.ConnectionPool, not {type(given).__name__}"
            )

    # ------------------------------------------------------------------------- public API

    @property
    def retry(self) -> RetryPolicy:
        """The RetryPolicy for transient errors (may be replaced)."""
        return self._protocol.policy

    @retry.setter
    def retry(self, policy: RetryPolicy) -> None:
        self._protocol.policy = policy

    @property
    def stats(self) -> InboxStats:
        """Cumulative counters since this Inbox was created (a snapshot)."""
        return self._stats.snapshot()

    @property
    def connection(self) -> Conn | None:
        """The connection in use when Inbox was given a connection (None with a pool). After
        the given connection broke, this is the replacement Inbox opened (and closes in
        `close()`)."""
        return self._conn

    @property
    def behind_pooler(self) -> bool:
        """True once Inbox found a connection pooler between it and PostgreSQL (on first use, or
        in `check_schema()`; or when the server rejected a prepared statement, 42P05 / 26000): from
        then on it prepares no statements on the connections it uses (pginbox.pooler)."""
        return self._behind_pooler

    def close(self) -> None:
        """Close the replacement connection Inbox opened, if any (never the caller's own)."""
        if self._own_conn and self._conn is not None:
            self._conn.close()

    def __enter__(self) -> Inbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_schema(self) -> int:
        """Check `inbox.schema_release()` now (otherwise done on first use); returns the version.
        Raises SchemaVersionError (missing or unknown schema) or SchemaAccessError."""
        with self._connection() as conn:
            return self._check_schema(conn)

    def handle(self, message: Message, handler: Handler, *, raise_on_failure: bool | None = None) -> Result:
        """Claim `message` and run `handler(cursor, message)` in the transaction that holds the
        claim; commit only if the handler returns.

        APPLIED after the commit; DUPLICATE, CONFLICT, QUARANTINED without running the handler.
        A permanent handler error rolls back the claim and the handler's writes, is recorded with
        inbox.record_failure in a new transaction, and comes back as FAILED (or QUARANTINED at the
        consumer's max_attempts), with the exception in `Result.exception`; with raise_on_failure
        the exception is re-raised instead, after recording. Transient errors re-run the whole
        transaction; RetriesExhausted when the policy gives up."""
        message = _core.check_message(message)
        consumer, version = self.consumer, self.handler_version

        def record_failure(error: BaseException) -> Callable[[], Result]:
            reason, text = _core.failure_reason(error)
            params = _core.record_failure_params(consumer, version, message, reason, text)
            return partial(
                self._attempt,
                partial(self._statement_tx, query=queries.RECORD_FAILURE, params=params, build=_core.first_result),
            )

        start = None
        if message.redelivered:
            params = _core.record_starts_params(consumer, version, [message])
            start = partial(
                self._attempt,
                partial(self._statement_tx, query=queries.RECORD_STARTS, params=params, build=_core.first_start),
            )
        result = drive(
            self._protocol.handle(
                message,
                start=start,
                attempt=partial(self._attempt, partial(self._handle_attempt, message=message, handler=handler)),
                record_failure=record_failure,
            )
        )
        result = self._durable(result)
        return raise_if_failed(result, message, self.raise_on_failure if raise_on_failure is None else raise_on_failure)

    def apply(self, message: Message) -> Result:
        """inbox.claim_and_apply: claim and run the SQL handler registered for the message type,
        in one round trip. A handler failure is recorded by the SQL (FAILED / QUARANTINED)."""
        message = _core.check_message(message)
        cost = CallCost()
        if message.redelivered:
            start = self._record_starts([message], cost)[0]
            if start is not None:
                return self._durable(self._stats.stamp([start], cost)[0])
        params = _core.apply_params(self.consumer, message)
        result = self._run(
            lambda conn: self._statement_tx(conn, queries.CLAIM_AND_APPLY, params, _core.first_result), cost
        )
        return self._durable(self._stats.stamp([result], cost)[0])

    def apply_batch(self, messages: Iterable[Message], *, before_commit: BeforeCommit | None = None) -> list[Result]:
        """inbox.claim_and_apply_batch over chunks of `batch_size` messages, one transaction per
        chunk, each message isolated from the others' failures. Results in input order.
        If a chunk exhausts its retries, RetriesExhausted is raised: earlier chunks are committed
        (their redeliveries are duplicates), later ones were not attempted.
        `before_commit(start, results)`: called in each chunk's transaction once its results are
        known (`start`: the chunk's first index in `messages`); the statement it returns, if any,
        runs in that transaction before COMMIT (pginbox consume stores Kafka offsets with it)."""
        batch = [_core.check_message(m) for m in messages]
        results: list[Result] = []
        for start, chunk in _core.indexed_chunks(batch, self.batch_size):
            cost = CallCost()
            out, pending = self._announce_redeliveries(chunk, cost)
            if pending:
                params = _core.batch_params(self.consumer, [chunk[i] for i in pending])
                extra = None if before_commit is None else _core.chunk_hook(before_commit, start, out, pending)
                applied = self._run(
                    partial(
                        self._statement_tx,
                        query=queries.CLAIM_AND_APPLY_BATCH,
                        params=params,
                        build=_core.batch_results,
                        extra=extra,
                    ),
                    cost,
                )
                for i, r in zip(pending, applied, strict=True):
                    out[i] = r
            results.extend(self._stats.stamp(cast(list[Result], out), cost))
        return self._durable(results)

    def handle_batch(
        self, messages: Iterable[Message], handler: Handler, *, before_commit: BeforeCommit | None = None
    ) -> list[Result]:
        """`handle` for many messages: one transaction per chunk of `batch_size`, every identity of
        the chunk claimed in one statement (inbox.claim_batch), a savepoint per handler. A permanent
        handler error rolls back to the message's savepoint, takes its claim back and is recorded in
        the same transaction (FAILED / QUARANTINED Result, never raised); a transient error re-runs
        the whole chunk. Results in input order. `before_commit`: as in apply_batch."""
        batch = [_core.check_message(m) for m in messages]
        results: list[Result] = []
        for start, chunk in _core.indexed_chunks(batch, self.batch_size):
            cost = CallCost()
            out, pending = self._announce_redeliveries(chunk, cost)
            if pending:
                todo = [chunk[i] for i in pending]
                extra = None if before_commit is None else _core.chunk_hook(before_commit, start, out, pending)
                done = self._run(partial(self._handle_batch_attempt, messages=todo, handler=handler, extra=extra), cost)
                for i, (r, exc) in zip(pending, done, strict=True):
                    out[i] = r if exc is None else replace(r, exception=exc)
            results.extend(self._stats.stamp(cast(list[Result], out), cost))
        return self._durable(results)

    # ------------------------------------------------------------------------- durability

    def _durable(self, results: T) -> T:
        """`results` once the call's commits are durable by `self.durability`: at once for `commit`;
        for `standby`, after inbox.wait_durable said the standbys have every commit that returned
        before it (the primary's WAL position read after the last COMMIT, so one wait covers the
        whole call). NotDurable when they do not within the timeout, or the database went away
        while waiting (the commits may be on the old primary only). A permanent database error
        (the schema is older, the owner may not read pg_stat_replication: 42501) is raised as it is."""
        durability = self.durability
        if not durability.waits:
            return results
        try:
            with self._connection() as conn, _autocommit(conn):
                cur = conn.execute(WAIT_DURABLE, durability.params())
                row = cur.fetchone()
        except (PoolTimeout, PoolClosed) as exc:
            raise NotDurable(
                f"committed on the primary, but the standbys' positions could not be read ({exc}): do not ack; "
                "a redelivery is safe",
                results=results,
            ) from exc
        except psycopg.Error as exc:
            if classify(exc) is None:  # permanent: the deployment is wrong, not the moment
                raise
            raise NotDurable(
                f"committed on the primary, but the wait for the standbys failed ({_core.error_key(exc)}: {exc}): "
                "do not ack; a redelivery is safe",
                results=results,
                sqlstate=exc.sqlstate,
            ) from exc
        if row is None or row[0] is not True:
            raise NotDurable(
                f"committed on the primary, but the standbys did not confirm it within {durability.timeout:g} s "
                f"({durability.describe()}): do not ack; a redelivery is safe",
                results=results,
            )
        return results

    def enqueue(
        self,
        target: psycopg.Connection[Any] | psycopg.Cursor[Any],
        effect_id: str,
        destination: str,
        payload: Any,
        *,
        headers: Mapping[str, Any] | None = None,
        ordering_key: str | None = None,
        available_at: datetime | None = None,
        tenant: str | None = None,
    ) -> bool:
        """inbox.enqueue_effect for this consumer, in the caller's transaction on `target` (a
        connection, or the cursor a handler was given): the effect is sent by the dispatcher once
        that transaction commits, and never if it rolls back. True: enqueued; False: already enqueued
        (same effect_id, destination and payload: a retried request is a no-op).

        For a service that only produces (an HTTP endpoint writing an order and its effect): call it
        in the transaction of the domain write. The service's role must be bound to this consumer
        (inbox.bind_consumer) and the consumer to `destination` (inbox.bind_destination): see
        docs/outbox.md, "Producer-only services". Refuses an autocommit connection outside a
        transaction (the effect would commit apart from the write it belongs to)."""
        conn = target.connection if isinstance(target, psycopg.Cursor) else target
        if conn.autocommit and conn.pgconn.transaction_status == _IDLE:
            raise PginboxError(
                "Inbox.enqueue writes in the caller's transaction, and this autocommit connection has none: "
                "the effect would commit apart from the write it belongs to (open one with conn.transaction())"
            )
        params = (
            effect_id,
            destination,
            Jsonb(payload),
            None if headers is None else Jsonb(dict(headers)),
            ordering_key,
            available_at,
            self.consumer,
            tenant,
        )
        cur = conn.execute(queries.ENQUEUE, params)
        row = cur.fetchone()
        assert row is not None
        return bool(row[0])

    # ------------------------------------------------------------------------- attempts

    def _handle_attempt(self, conn: Conn, message: Message, handler: Handler) -> Result | Failure:
        pipeline = _core.use_pipeline(self.pipeline, conn.info)
        switched = _enter_autocommit(conn, pipeline)
        try:
            cur = conn.cursor(row_factory=tuple_row)
            try:
                _begin_and_execute(
                    conn,
                    cur,
                    queries.CLAIM,
                    _core.claim_params(self.consumer, self.handler_version, message),
                    pipeline,
                )
                row = cur.fetchone()
            except BaseException:
                _rollback_quietly(conn)
                raise
            assert row is not None
            xid: str | None = row[9]
            if row[0] != "claimed":
                claim = _core.result_from_row(row)
                self._commit(conn, xid, claim)
                return claim
            done = Result(Outcome.APPLIED, row[1], None, row[3], row[4])
            failure = self._call_handler(conn, handler, message, done, savepoint=False)
            if failure is not None:
                return failure
            try:
                self._commit(conn, xid, done)
            except psycopg.Error as exc:
                # The server answered COMMIT with an error (a deferred constraint, 40001 at
                # SERIALIZABLE): the transaction rolled back.
                if classify(exc) is not None:
                    raise
                return Failure(exc, done)
            return done
        finally:
            _leave_autocommit(conn, switched)

    def _call_handler(
        self, conn: Conn, handler: Handler, message: Message, claim: Result, *, savepoint: bool
    ) -> Failure | None:
        """Runs the handler; None when it returned with the transaction intact. Permanent error:
        rolls back (the transaction, or to the message's savepoint) and returns a Failure.
        Transient error: rolls back the transaction and raises Transient."""
        hcur = conn.cursor()
        error: Exception | None = None
        returned: object = None
        try:
            returned = handler(hcur, message)
        except Exception as exc:
            error = exc
        except BaseException:
            _rollback_quietly(conn)
            raise
        finally:
            with suppress(psycopg.Error):
                hcur.close()
        verdict = handler_verdict(conn, error, returned, client="Inbox")
        if verdict is None:
            return None
        if isinstance(verdict, Transient):
            _rollback_quietly(conn)
            raise verdict from verdict.error
        if savepoint:
            conn.execute(queries.ROLLBACK_TO_SAVEPOINT, prepare=False)
        else:
            _rollback_quietly(conn)
        return Failure(verdict, claim)

    def _handle_batch_attempt(
        self, conn: Conn, messages: Sequence[Message], handler: Handler, extra: ChunkHook | None = None
    ) -> list[tuple[Result, BaseException | None]]:
        """One transaction: every message claimed in one statement (inbox.claim_batch), then each
        claimed message's handler after a savepoint of its own. A permanent handler error rolls
        back to that savepoint, takes the claim back (inbox._unclaim) and records the failure, in
        the same transaction. An identity repeated within the chunk is claimed with inbox.claim
        once the earlier one is decided."""
        out: list[tuple[Result, BaseException | None]] = []
        pipeline = _core.use_pipeline(self.pipeline, conn.info)
        switched = _enter_autocommit(conn, pipeline)
        try:
            cur = conn.cursor(row_factory=tuple_row)
            xid: str | None = None
            try:
                params = (*_core.batch_params(self.consumer, messages), self.handler_version)
                _begin_and_execute(conn, cur, queries.CLAIM_BATCH, params, pipeline)
                rows = cur.fetchall()
                assert len(rows) == len(messages), "inbox.claim_batch returned a row per message"
                opened = False  # a savepoint of an earlier message is open: released with the next one

                def savepoint() -> None:
                    nonlocal opened
                    if opened and pipeline:
                        with conn.pipeline():
                            cur.execute(queries.RELEASE_SAVEPOINT, prepare=False)
                            cur.execute(queries.SAVEPOINT, prepare=False)
                    else:
                        if opened:
                            cur.execute(queries.RELEASE_SAVEPOINT, prepare=False)
                        cur.execute(queries.SAVEPOINT, prepare=False)
                    opened = True

                for message, row in zip(messages, rows, strict=True):
                    xid = row[-1] or xid
                    repeat = row[1] == "repeat"
                    if repeat:
                        # Decided by its earlier element: claim it now, inside its savepoint.
                        params1 = _core.claim_params(self.consumer, self.handler_version, message)
                        savepoint()
                        cur.execute(queries.CLAIM, params1, prepare=True)
                        one = cur.fetchone()
                        assert one is not None
                        claim = _core.result_from_row(one)
                        xid = one[9] or xid
                    else:
                        claim = _core.result_from_row(row, 1)
                    if claim.outcome is not Outcome.CLAIMED:
                        out.append((claim, None))
                        continue
                    if not repeat:
                        savepoint()
                    failure = self._call_handler(conn, handler, message, claim, savepoint=True)
                    if failure is None:
                        out.append((applied(claim), None))
                        continue
                    if not repeat:
                        # The claim was made before the savepoint: take it back (a repeat's claim
                        # was inside it and rolled back with the handler's writes).
                        cur.execute(
                            queries.UNCLAIM,
                            (self.consumer, message.tenant, message.producer, message.message_id),
                            prepare=True,
                        )
                    reason, text = _core.failure_reason(failure.error)
                    cur.execute(
                        queries.RECORD_FAILURE,
                        _core.record_failure_params(self.consumer, self.handler_version, message, reason, text),
                        prepare=True,
                    )
                    frow = cur.fetchone()
                    assert frow is not None
                    xid = frow[9] or xid
                    out.append((_core.result_from_row(frow), failure.error))
                statement = None if extra is None else extra([r for r, _ in out])
                if statement is not None:
                    cur.execute(statement[0], statement[1], prepare=True)
            except BaseException:
                _rollback_quietly(conn)
                raise
            self._commit(conn, xid, out)
        finally:
            _leave_autocommit(conn, switched)
        return out

    def _statement_tx(
        self,
        conn: Conn,
        query: Any,
        params: Any,
        build: Callable[[list[TupleRow]], T],
        extra: Callable[[T], tuple[Any, Any] | None] | None = None,
    ) -> T:
        """One statement in a transaction of its own: BEGIN + statement, then COMMIT (`extra`: a
        second statement from the first one's value, before COMMIT)."""
        pipeline = _core.use_pipeline(self.pipeline, conn.info)
        switched = _enter_autocommit(conn, pipeline)
        try:
            cur = conn.cursor(row_factory=tuple_row)
            try:
                _begin_and_execute(conn, cur, query, params, pipeline)
                rows = cur.fetchall()
                value = build(rows)
                statement = None if extra is None else extra(value)
                if statement is not None:
                    cur.execute(statement[0], statement[1], prepare=True)
            except BaseException:
                _rollback_quietly(conn)
                raise
            self._commit(conn, rows[0][-1] if rows else None, value)
            return value
        finally:
            _leave_autocommit(conn, switched)

    def _announce_redeliveries(self, chunk: Sequence[Message], cost: CallCost) -> tuple[list[Result | None], list[int]]:
        """record_start for the redelivered messages of a chunk: their QUARANTINED Results in place,
        and the indices of the messages still to process."""
        out: list[Result | None] = [None] * len(chunk)
        redelivered = [i for i, m in enumerate(chunk) if m.redelivered]
        if redelivered:
            starts = self._record_starts([chunk[i] for i in redelivered], cost)
            for i, start in zip(redelivered, starts, strict=True):
                out[i] = start
        return out, [i for i in range(len(chunk)) if out[i] is None]

    def _record_starts(self, messages: Sequence[Message], cost: CallCost) -> list[Result | None]:
        """inbox.record_start for redelivered messages, committed before they are processed:
        a QUARANTINED Result for each crash-looping one, None for those to process."""
        params = _core.record_starts_params(self.consumer, self.handler_version, messages)
        return self._run(
            lambda conn: self._statement_tx(conn, queries.RECORD_STARTS, params, _core.start_results), cost
        )

    def _commit(self, conn: Conn, xid: str | None, value: object) -> None:
        try:
            conn.commit()
        except psycopg.Error as exc:
            if _core.connection_lost(exc, conn):
                commit_lost(xid, conn.pgconn.backend_pid or None, value, exc)
                return
            raise

    # ------------------------------------------------------------------------- the protocol's I/O

    def _run(self, attempt: Callable[[Conn], T], cost: CallCost) -> T:
        """`attempt` on a connection of its own, retried by the protocol."""
        result: T = drive(self._protocol.retry(partial(self._attempt, attempt), cost))
        return result

    def _attempt(self, attempt: Callable[[Conn], T]) -> T:
        """One transaction: a connection, the schema check on first use, `attempt`."""
        conn = self._acquire()
        try:
            _check_idle(conn)
            if self._schema_version is None:
                self._check_schema(conn)
            return attempt(conn)
        finally:
            self._release(conn)

    def _poll_status(self, xid: str) -> str | None:
        with self._connection() as conn, _autocommit(conn):
            cur = conn.execute(queries.XACT_STATUS, (xid,))
            row = cur.fetchone()
        return row[0] if row else None

    def _terminate(self, backend_pid: int, xid: str) -> None:
        with suppress(pg_errors.InsufficientPrivilege), self._connection() as conn, _autocommit(conn):
            conn.execute(queries.TERMINATE_ORPHAN, (backend_pid, xid))

    def _found_pooler(self) -> None:
        self._behind_pooler = True

    # ------------------------------------------------------------------------- connections

    def _acquire(self) -> Conn:
        """A connection for one attempt: from the pool, or the given one under the lock."""
        if self._pool is not None:
            conn = cast(Conn, self._pool.getconn())
        else:
            self._lock.acquire()
            try:
                given = self._conn
                assert given is not None
                conn = self._reconnect() if given.closed else given
            except BaseException:
                self._lock.release()
                raise
        if self._behind_pooler and conn.prepare_threshold is not None:
            pooler.configure(conn)
        return conn

    def _release(self, conn: Conn) -> None:
        if self._pool is not None:
            self._pool.putconn(conn)
        else:
            self._lock.release()

    @contextmanager
    def _connection(self) -> Iterator[Conn]:
        conn = self._acquire()
        try:
            yield conn
        finally:
            self._release(conn)

    def _snapshot_connection(self, conn: Conn) -> None:
        """What `_reconnect` needs to open a connection like the given one."""
        self._conninfo = conninfo_of(conn)
        self._conn_settings = (conn.autocommit, conn.isolation_level, conn.prepare_threshold, conn.row_factory)

    def _reconnect(self) -> Conn:
        old = self._conn
        assert old is not None
        autocommit, isolation_level, prepare_threshold, row_factory = self._conn_settings
        new = type(old).connect(
            self._conninfo, autocommit=autocommit, prepare_threshold=prepare_threshold, row_factory=row_factory
        )
        # set_isolation_level exists on both flavours (the sync one is the property's setter).
        new.set_isolation_level(isolation_level)
        with suppress(psycopg.Error):
            old.close()  # broken already: this only frees it
        self._conn = new
        self._own_conn = True
        return new

    def _check_schema(self, conn: Conn) -> int:
        _check_idle(conn)
        where = _core.describe(conn.info)
        try:
            with _autocommit(conn):
                cur = conn.execute(queries.SCHEMA_CHECK, prepare=False)
                row = cur.fetchone()
        except psycopg.Error as exc:
            translated = _core.schema_error(exc, where)
            if translated is not None:
                raise translated from exc
            raise
        version = _core.check_schema_version(row[:3] if row else row, where)
        if row is not None and pooler.differs(conn.info.backend_pid, row[3]):
            self._behind_pooler = True
            pooler.configure(conn)
        self._schema_version = version
        return version
