# Generated from sqlalchemy_async.py by python/tools/async_to_sync.py: DO NOT EDIT.
# Edit python/pginbox/integrations/sqlalchemy_async.py, then run the script (tests/run checks this file).
"""`SQLAlchemyInbox`: schema `inbox` from SQLAlchemy 2.x (psycopg 3 driver, `postgresql+psycopg://`,
engines from create_engine). Install with the extra: `pip install pginbox[sqlalchemy]`.
Guide: docs/sqlalchemy.md.

In the caller's transaction (the Session or Connection given; nothing is committed here):

    claim(target, message)            inbox.claim                  -> Result (CLAIMED, DUPLICATE, ...)
    apply(target, message)            inbox.claim_and_apply        -> Result
    apply_batch(target, messages)     inbox.claim_and_apply_batch  -> list[Result], input order
    record_failure(target, message, error)  inbox.record_failure   -> Result (FAILED / QUARANTINED)
    enqueue(target, effect_id, destination, payload)  inbox.enqueue_effect -> bool (producer-only services too)

In transactions of its own, like `pginbox.Inbox.handle`:

    handle(target, message, handler)  claim, handler(target, message), flush, COMMIT

The statements are pginbox.Inbox's own (pginbox.client.queries), run with exec_driver_sql on
the psycopg connection; the protocol of `handle` (retries, a lost COMMIT, the handler's rules) is
pginbox.client.protocol, shared with pginbox.Inbox. The payload is bound as JSONB. Errors are
SQLAlchemy's (`sqlalchemy.exc.DBAPIError`, the psycopg error in `.orig`), except the ones pginbox
raises itself (pginbox.errors).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from pginbox import pooler
from pginbox.client import queries
from pginbox.client import shared as _core
from pginbox.client.drive import drive
from pginbox.client.outcomes import Message, Outcome, Result
from pginbox.client.protocol import Protocol, Transient, applied, commit_lost, judge_handler, raise_if_failed
from pginbox.client.retry import RetryPolicy, TransientKind, classify
from pginbox.client.shared import Failure
from pginbox.errors import PginboxError
from pginbox.sql_limits import MAX_BATCH

__all__ = ["SQLAlchemyHandler", "SQLAlchemyInbox", "Target"]

#: The Session (the handler gets it: its ORM writes commit with the claim) or Connection to use.
Target = Session | Connection
T = TypeVar("T")
#: handler(target, message): runs in the transaction that holds the claim; raising rolls back both.
SQLAlchemyHandler = Callable[[Any, Message], object]

_INERROR = psycopg.pq.TransactionStatus.INERROR
_IDLE = psycopg.pq.TransactionStatus.IDLE


def _database_error(exc: BaseException) -> BaseException:
    """The psycopg error behind a SQLAlchemy DBAPIError (what reason codes and SQLSTATEs come from)."""
    if isinstance(exc, DBAPIError) and isinstance(exc.orig, BaseException):
        return exc.orig
    return exc


def _lost(exc: BaseException) -> bool:
    """The connection went away: no answer from the server."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    inner = _database_error(exc)
    return isinstance(inner, psycopg.OperationalError) and inner.sqlstate is None


def _transient(exc: BaseException) -> TransientKind | None:
    """The transient kind of a database error (SQLAlchemy's, or the driver's), None when permanent."""
    if not isinstance(exc, DBAPIError | psycopg.Error):
        return None
    return classify(exc) or (TransientKind.CONNECTION if _lost(exc) else None)


def _dbapi(target: Target) -> psycopg.Connection[Any]:
    """The psycopg connection under `target` (in its current transaction)."""
    conn = target.connection() if isinstance(target, Session) else target
    raw: object = conn.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        raise PginboxError(
            "SQLAlchemyInbox needs the psycopg (3) driver: create the engine with a "
            f"postgresql+psycopg:// URL (this one uses {conn.dialect.name}+{conn.dialect.driver})"
        )
    return raw


def _fetch(target: Target, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    """The rows of one of pginbox.client.queries, run as it is on the psycopg connection."""
    conn = target.connection() if isinstance(target, Session) else target
    result = conn.exec_driver_sql(query, tuple(params) if params is not None else ())
    return [tuple(row) for row in result.all()]


class SQLAlchemyInbox:
    """Delivers messages for one consumer through schema `inbox` on SQLAlchemy Sessions and
    Connections (psycopg driver). Holds no connection: every call takes the target to use.

    consumer, handler_version, retry, raise_on_failure: as for pginbox.Inbox.
    """

    def __init__(
        self,
        *,
        consumer: str,
        handler_version: str = "unversioned",
        retry: RetryPolicy | None = None,
        raise_on_failure: bool = False,
    ) -> None:
        _core.check_names(consumer, handler_version)
        self.consumer = consumer
        self.handler_version = handler_version
        self.retry = retry if retry is not None else RetryPolicy()
        self.raise_on_failure = raise_on_failure
        self._schema_version: int | None = None
        self._behind_pooler = False
        self._rng = random.Random()

    @property
    def behind_pooler(self) -> bool:
        """True once a connection pooler (PgBouncer) was found in front of PostgreSQL: from then on
        the psycopg connections used prepare no statements (docs/pgbouncer.md)."""
        return self._behind_pooler

    # ------------------------------------------------------------------ in the caller's transaction

    def claim(self, target: Target, message: Message) -> Result:
        """inbox.claim in the caller's transaction: CLAIMED (do the work, then commit: the claim
        commits with it), DUPLICATE, CONFLICT or QUARANTINED (do nothing)."""
        message = _core.check_message(message)
        return _core.result_from_row(self._one(target, queries.CLAIM, self._claim_params(message)))

    def apply(self, target: Target, message: Message) -> Result:
        """inbox.claim_and_apply (the SQL handler registered for the message type) in the caller's
        transaction; a handler failure is recorded by the SQL (FAILED / QUARANTINED)."""
        message = _core.check_message(message)
        params = _core.apply_params(self.consumer, message)
        return _core.result_from_row(self._one(target, queries.CLAIM_AND_APPLY, params))

    def apply_batch(self, target: Target, messages: Iterable[Message]) -> list[Result]:
        """inbox.claim_and_apply_batch in the caller's transaction, 64 messages per statement;
        results in input order."""
        batch = [_core.check_message(m) for m in messages]
        results: list[Result] = []
        for chunk in _core.chunks(batch, MAX_BATCH):
            self._prepare(target)
            rows = _fetch(target, queries.CLAIM_AND_APPLY_BATCH, _core.batch_params(self.consumer, chunk))
            results.extend(_core.batch_results(rows))
        return results

    def record_failure(
        self,
        target: Target,
        message: Message,
        error: BaseException | None = None,
        *,
        reason_code: str | None = None,
        error_message: str | None = None,
    ) -> Result:
        """inbox.record_failure in the caller's transaction: FAILED, or QUARANTINED at the consumer's
        max_attempts. The reason code of `error` is the one Inbox records (its `reason_code`
        attribute, a database error's constraint name or SQLSTATE, else its class name);
        `reason_code` / `error_message` override it."""
        message = _core.check_message(message)
        if error is not None:
            code, text_ = _core.failure_reason(_database_error(error))
        elif reason_code is None:
            raise ValueError("record_failure needs an error or a reason_code")
        else:
            code, text_ = reason_code, error_message or reason_code
        params = self._failure_params(message, reason_code or code, error_message or text_)
        return _core.result_from_row(self._one(target, queries.RECORD_FAILURE, params))

    def enqueue(
        self,
        target: Target,
        effect_id: str,
        destination: str,
        payload: Any,
        *,
        headers: Mapping[str, Any] | None = None,
        ordering_key: str | None = None,
        available_at: datetime | None = None,
        tenant: str | None = None,
    ) -> bool:
        """inbox.enqueue_effect for this consumer in the caller's transaction (the write it belongs
        to commits with it): True enqueued, False already enqueued (same id, destination and
        payload). For producer-only services and handlers alike; the role must be bound to the
        consumer and the consumer to `destination` (docs/outbox.md, "Producer-only services")."""
        self._prepare(target)
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
        return bool(_fetch(target, queries.ENQUEUE, params)[0][0])

    # ------------------------------------------------------------------ transactions of its own

    def handle(
        self, target: Target, message: Message, handler: SQLAlchemyHandler, *, raise_on_failure: bool | None = None
    ) -> Result:
        """Claim `message` and run `handler(target, message)` in the transaction that holds the
        claim (a session is flushed, so ORM writes commit with the claim); commit when it returns.
        As pginbox.Inbox.handle: a permanent handler error rolls back, is recorded in a new
        transaction (FAILED / QUARANTINED, or re-raised with raise_on_failure); transient errors
        re-run the whole transaction; a COMMIT whose answer was lost is resolved with
        pg_xact_status."""
        message = _core.check_message(message)
        self._check_idle(target)
        protocol = Protocol(
            self.retry,
            classify=_transient,
            poll_status=partial(self._poll_status, target),
            terminate=partial(self._terminate, target),
            on_pooler=self._found_pooler,
            rng=self._rng,
        )
        result = drive(
            protocol.handle(
                message,
                start=partial(self._attempt, target, partial(self._record_start, target, message)),
                attempt=partial(self._attempt, target, partial(self._handle_attempt, target, message, handler)),
                record_failure=lambda error: partial(
                    self._attempt, target, partial(self._record_failure_tx, target, message, error)
                ),
            )
        )
        return raise_if_failed(result, message, self.raise_on_failure if raise_on_failure is None else raise_on_failure)

    # ------------------------------------------------------------------ internals

    def _claim_params(self, m: Message) -> tuple[Any, ...]:
        return _core.claim_params(self.consumer, self.handler_version, m)

    def _failure_params(self, m: Message, reason_code: str, error_message: str) -> tuple[Any, ...]:
        return _core.record_failure_params(self.consumer, self.handler_version, m, reason_code, error_message)

    def _prepare(self, target: Target) -> None:
        """First use: the schema check (and pooler detection); behind a pooler, no prepared
        statements on the psycopg connection in use."""
        raw = _dbapi(target)
        if raw.autocommit and raw.info.transaction_status == _IDLE:
            # isolation_level="AUTOCOMMIT": SQLAlchemy's begin() sends no BEGIN, so the claim would
            # commit on its own, before the handler's writes (and a failing handler would leave them
            # half applied, its redelivery answered "duplicate").
            raise PginboxError(
                'SQLAlchemyInbox was given an AUTOCOMMIT connection (isolation_level="AUTOCOMMIT"): '
                "the claim would commit on its own, apart from the handler's writes; give it a session or "
                'connection of an engine created without isolation_level="AUTOCOMMIT" (or with '
                'create_engine(..., isolation_level="READ COMMITTED"))'
            )
        if self._schema_version is None:
            row = _fetch(target, queries.SCHEMA_CHECK)[0]
            version = _core.check_schema_version(row[:3], _core.describe(raw.info))
            if pooler.differs(raw.info.backend_pid, row[3]):
                self._behind_pooler = True
            self._schema_version = version
        if self._behind_pooler and raw.prepare_threshold is not None:
            pooler.configure(raw)

    def _one(self, target: Target, query: str, params: Sequence[Any]) -> tuple[Any, ...]:
        self._prepare(target)
        rows = _fetch(target, query, params)
        assert len(rows) == 1, "the statement returns one row"
        return rows[0]

    @staticmethod
    def _check_idle(target: Target) -> None:
        if target.in_transaction():
            raise PginboxError(
                "the Session or Connection given to SQLAlchemyInbox.handle is inside a "
                "transaction: handle runs its own transactions (commit or roll back first; or use claim/apply "
                "in your own transaction)"
            )

    def _record_start(self, target: Target, message: Message) -> Result | None:
        params = _core.record_starts_params(self.consumer, self.handler_version, [message])
        with target.begin():
            self._prepare(target)
            rows = _fetch(target, queries.RECORD_STARTS, params)
        return _core.first_start(rows)

    def _record_failure_tx(self, target: Target, message: Message, error: BaseException) -> Result:
        code, text_ = _core.failure_reason(_database_error(error))
        with target.begin():
            row = self._one(target, queries.RECORD_FAILURE, self._failure_params(message, code, text_))
        return _core.result_from_row(row)

    def _handle_attempt(self, target: Target, message: Message, handler: SQLAlchemyHandler) -> Result | Failure:
        tx = target.begin()
        try:
            row = self._one(target, queries.CLAIM, self._claim_params(message))
            claim = _core.result_from_row(row)
            xid: str | None = row[9]
            raw = _dbapi(target)
            pid = raw.info.backend_pid or None
            if claim.outcome is Outcome.CLAIMED:
                error: Exception | None = None
                returned: object = None
                try:
                    returned = handler(target, message)
                    if isinstance(target, Session):
                        target.flush()  # ORM writes fail here, as the handler's
                except Exception as exc:
                    error = exc
                ended = error is None and not tx.is_active
                verdict = judge_handler(
                    error,
                    returned,
                    transient=None if error is None else _transient(error),
                    lost=_lost(error) if error is not None else raw.closed,
                    failed_tx=not ended and error is None and raw.info.transaction_status == _INERROR,
                    ended_tx=ended,
                    client="SQLAlchemyInbox",
                    savepoint_fix="use a savepoint: session.begin_nested()",
                )
                if verdict is not None:
                    with suppress(DBAPIError):  # the connection may be gone: nothing to roll back then
                        tx.rollback()
                    if isinstance(verdict, Transient):
                        raise verdict from verdict.error
                    return Failure(verdict, claim)
                claim = applied(claim)
        except BaseException:
            if tx.is_active:
                with suppress(DBAPIError):
                    tx.rollback()
            raise
        try:
            tx.commit()
        except DBAPIError as exc:
            if _lost(exc):
                return commit_lost(xid, pid, claim, exc)
            if _transient(exc) is not None:
                raise
            # The server answered COMMIT with an error (a deferred constraint): rolled back.
            return Failure(exc, claim)
        return claim

    def _attempt(self, target: Target, attempt: Callable[[], T]) -> T:
        """One transaction of `handle`; after a transient database error the target is left
        outside any transaction, for the next attempt."""
        try:
            return attempt()
        except DBAPIError as exc:
            if _transient(exc) is not None and target.in_transaction():
                with suppress(DBAPIError):
                    target.rollback()
            raise

    def _poll_status(self, target: Target, xid: str) -> str | None:
        if target.in_transaction():
            target.rollback()
        with target.begin():
            rows = _fetch(target, queries.XACT_STATUS, (xid,))
        return rows[0][0] if rows else None

    def _terminate(self, target: Target, backend_pid: int, xid: str) -> None:
        try:
            with target.begin():
                _fetch(target, queries.TERMINATE_ORPHAN, (backend_pid, xid))
        except DBAPIError as exc:
            if not isinstance(exc.orig, pg_errors.InsufficientPrivilege):
                raise

    def _found_pooler(self) -> None:
        self._behind_pooler = True
