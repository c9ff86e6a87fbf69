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

The payload is bound as JSONB. Errors are SQLAlchemy's (`sqlalchemy.exc.DBAPIError`, the psycopg
error in `.orig`), except the ones pginbox raises itself (pginbox.errors).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Connection, bindparam, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import TextClause

from pginbox import pooler
from pginbox.client import shared as _core
from pginbox.client.outcomes import Message, Outcome, Result
from pginbox.client.retry import RetryPolicy, TransientKind, classify
from pginbox.client.shared import Transient
from pginbox.errors import CommitOutcomeUnknown, HandlerProtocolError, PginboxError, RetriesExhausted
from pginbox.sql_limits import MAX_BATCH

__all__ = ["SQLAlchemyHandler", "SQLAlchemyInbox", "Target"]

#: The Session (the handler gets it: its ORM writes commit with the claim) or Connection to use.
Target = Session | Connection
T = TypeVar("T")
#: handler(target, message): runs in the transaction that holds the claim; raising rolls back both.
SQLAlchemyHandler = Callable[[Any, Message], object]

_RESULT = """r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at,
       r.quarantine_id, r.attempts, r.reason_code, r.error_message,
       pg_catalog.pg_current_xact_id_if_assigned()::text"""


def _jsonb(sql: str) -> TextClause:
    return text(sql).bindparams(bindparam("payload", type_=JSONB))


CLAIM: TextClause = _jsonb(f"""
SELECT {_RESULT}
  FROM inbox.claim(consumer => :consumer, producer => :producer, message_id => :message_id,
                   payload => :payload, handler_version => :handler_version, tenant => :tenant,
                   produced_at => CAST(:produced_at AS timestamptz)) AS r""")
CLAIM_AND_APPLY: TextClause = _jsonb(f"""
SELECT {_RESULT}
  FROM inbox.claim_and_apply(consumer => :consumer, producer => :producer, message_id => :message_id,
                             message_type => :message_type, payload => :payload, tenant => :tenant,
                             produced_at => CAST(:produced_at AS timestamptz)) AS r""")
CLAIM_AND_APPLY_BATCH: TextClause = text(f"""
SELECT r.ordinal, {_RESULT}
  FROM inbox.claim_and_apply_batch(consumer => :consumer, messages => :messages) AS r
 ORDER BY r.ordinal""").bindparams(bindparam("messages", type_=JSONB))
RECORD_FAILURE: TextClause = _jsonb(f"""
SELECT {_RESULT}
  FROM inbox.record_failure(consumer => :consumer, producer => :producer, message_id => :message_id,
                            payload => :payload, reason_code => :reason_code, error_message => :error_message,
                            handler_version => :handler_version, tenant => :tenant,
                            message_type => :message_type) AS r""")
RECORD_START: TextClause = _jsonb(f"""
SELECT {_RESULT}
  FROM inbox.record_start(consumer => :consumer, producer => :producer, message_id => :message_id,
                          tenant => :tenant, message_type => :message_type, payload => :payload,
                          handler_version => :handler_version) AS r""")
ENQUEUE: TextClause = text("""
SELECT inbox.enqueue_effect(effect_id => :effect_id, destination => :destination, payload => :payload,
                            headers => coalesce(:headers, CAST('{}' AS jsonb)), ordering_key => :ordering_key,
                            available_at => coalesce(CAST(:available_at AS timestamptz), pg_catalog.now()),
                            consumer => :consumer, tenant => :tenant)""").bindparams(
    bindparam("payload", type_=JSONB), bindparam("headers", type_=JSONB(none_as_null=True))
)
SCHEMA_CHECK: TextClause = text(
    "SELECT r.version, r.release, r.breaking_since, pg_catalog.pg_backend_pid() FROM inbox.schema_release() r"
)
XACT_STATUS: TextClause = text("SELECT pg_catalog.pg_xact_status(CAST(:xid AS xid8))")

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


class _Failed(Exception):
    """internal: the handler raised a permanent error; its transaction was rolled back."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


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
        return _core.result_from_row(self._one(target, CLAIM, self._claim_params(message)))

    def apply(self, target: Target, message: Message) -> Result:
        """inbox.claim_and_apply (the SQL handler registered for the message type) in the caller's
        transaction; a handler failure is recorded by the SQL (FAILED / QUARANTINED)."""
        message = _core.check_message(message)
        params = {"consumer": self.consumer, "producer": message.producer, "message_id": message.message_id,
                  "message_type": message.message_type, "payload": message.payload, "tenant": message.tenant,
                  "produced_at": message.produced_at}
        return _core.result_from_row(self._one(target, CLAIM_AND_APPLY, params))

    def apply_batch(self, target: Target, messages: Iterable[Message]) -> list[Result]:
        """inbox.claim_and_apply_batch in the caller's transaction, 64 messages per statement;
        results in input order."""
        batch = [_core.check_message(m) for m in messages]
        results: list[Result] = []
        for chunk in _core.chunks(batch, MAX_BATCH):
            items = _core.batch_params(self.consumer, chunk)[1].obj
            self._prepare(target)
            rows = target.execute(CLAIM_AND_APPLY_BATCH, {"consumer": self.consumer, "messages": items}).all()
            results.extend(_core.batch_results([tuple(r) for r in rows]))
        return results

    def record_failure(
        self, target: Target, message: Message, error: BaseException | None = None, *,
        reason_code: str | None = None, error_message: str | None = None,
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
        return _core.result_from_row(self._one(target, RECORD_FAILURE, params))

    def enqueue(
        self, target: Target, effect_id: str, destination: str, payload: Any, *,
        headers: Mapping[str, Any] | None = None, ordering_key: str | None = None,
        available_at: datetime | None = None, tenant: str | None = None,
    ) -> bool:
        """inbox.enqueue_effect for this consumer in the caller's transaction (the write it belongs
        to commits with it): True enqueued, False already enqueued (same id, destination and
        payload). For producer-only services and handlers alike; the role must be bound to the
        consumer and the consumer to `destination` (docs/outbox.md, "Producer-only services")."""
        self._prepare(target)
        params = {"effect_id": effect_id, "destination": destination, "payload": payload,
                  "headers": None if headers is None else dict(headers), "ordering_key": ordering_key,
                  "available_at": available_at, "consumer": self.consumer, "tenant": tenant}
        return bool(target.execute(ENQUEUE, params).scalar())

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
        retries = 0
        if message.redelivered:
            start, retries = self._run(target, lambda: self._record_start(target, message), retries)
            if start is not None:
                return replace(start, retries=retries)
        try:
            result, retries = self._run(target, lambda: self._handle_attempt(target, message, handler), retries)
            return replace(result, retries=retries) if retries else result
        except _Failed as failed:
            error = failed.error
        recorded, retries = self._run(target, lambda: self._record_failure_tx(target, message, error), retries)
        recorded = replace(recorded, retries=retries, exception=error)
        if self.raise_on_failure if raise_on_failure is None else raise_on_failure:
            error.add_note(f"pginbox: recorded as {recorded.outcome.value} (attempt {recorded.attempts}, "
                           f"reason {recorded.reason_code!r}) for message {message.message_id!r}")
            raise error
        return recorded

    # ------------------------------------------------------------------ internals

    def _claim_params(self, m: Message) -> dict[str, Any]:
        return {"consumer": self.consumer, "producer": m.producer, "message_id": m.message_id,
                "payload": m.payload, "handler_version": self.handler_version, "tenant": m.tenant,
                "produced_at": m.produced_at}

    def _failure_params(self, m: Message, reason_code: str, error_message: str) -> dict[str, Any]:
        return {"consumer": self.consumer, "producer": m.producer, "message_id": m.message_id,
                "payload": m.payload, "reason_code": reason_code, "error_message": error_message,
                "handler_version": self.handler_version, "tenant": m.tenant, "message_type": m.message_type}

    def _prepare(self, target: Target) -> None:
        """First use: the schema check (and pooler detection); behind a pooler, no prepared
        statements on the psycopg connection in use."""
        raw = _dbapi(target)
        if raw.autocommit and raw.info.transaction_status == _IDLE:
            # isolation_level="AUTOCOMMIT": SQLAlchemy's begin() sends no BEGIN, so the claim would
            # commit on its own, before the handler's writes (and a failing handler would leave them
            # half applied, its redelivery answered "duplicate").
            raise PginboxError(
                "SQLAlchemyInbox was given an AUTOCOMMIT connection (isolation_level=\"AUTOCOMMIT\"): "
                "the claim would commit on its own, apart from the handler's writes; give it a session or "
                "connection of an engine created without isolation_level=\"AUTOCOMMIT\" (or with "
                "create_engine(..., isolation_level=\"READ COMMITTED\"))"
            )
        if self._schema_version is None:
            row = target.execute(SCHEMA_CHECK).one()
            version = _core.check_schema_version(tuple(row)[:3], _core.describe(raw.info))
            if pooler.differs(raw.info.backend_pid, row[3]):
                self._behind_pooler = True
            self._schema_version = version
        if self._behind_pooler and raw.prepare_threshold is not None:
            pooler.configure(raw)

    def _one(self, target: Target, statement: TextClause, params: Mapping[str, Any]) -> tuple[Any, ...]:
        self._prepare(target)
        return tuple(target.execute(statement, dict(params)).one())

    @staticmethod
    def _check_idle(target: Target) -> None:
        if target.in_transaction():
            raise PginboxError(
                "the Session or Connection given to SQLAlchemyInbox.handle is inside a "
                "transaction: handle runs its own transactions (commit or roll back first; or use claim/apply "
                "in your own transaction)"
            )

    def _record_start(self, target: Target, message: Message) -> Result | None:
        with target.begin():
            row = self._one(target, RECORD_START, {
                "consumer": self.consumer, "producer": message.producer, "message_id": message.message_id,
                "tenant": message.tenant, "message_type": message.message_type, "payload": message.payload,
                "handler_version": self.handler_version,
            })
        return _core.result_from_row(row) if row[0] == "quarantined" else None

    def _record_failure_tx(self, target: Target, message: Message, error: BaseException) -> Result:
        code, text_ = _core.failure_reason(_database_error(error))
        with target.begin():
            row = self._one(target, RECORD_FAILURE, self._failure_params(message, code, text_))
        return _core.result_from_row(row)

    def _handle_attempt(self, target: Target, message: Message, handler: SQLAlchemyHandler) -> Result:
        tx = target.begin()
        try:
            row = self._one(target, CLAIM, self._claim_params(message))
            claim = _core.result_from_row(row)
            xid: str | None = row[9]
            if claim.outcome is Outcome.CLAIMED:
                try:
                    handler(target, message)
                    if isinstance(target, Session):
                        target.flush()  # ORM writes fail here, as the handler's
                except Exception as exc:
                    kind = classify(exc) or (TransientKind.CONNECTION if _lost(exc) else None)
                    with suppress(DBAPIError):  # the connection may be gone: nothing to roll back then
                        tx.rollback()
                    if kind is not None:
                        raise Transient(kind, exc) from exc
                    raise _Failed(exc) from exc
                if not tx.is_active:
                    raise HandlerProtocolError(
                        "the handler ended the transaction that holds the claim (commit or rollback): "
                        "SQLAlchemyInbox commits it when the handler returns",
                        reason_code="handler_ended_transaction",
                    )
                raw = _dbapi(target)
                if raw.info.transaction_status == _INERROR:
                    tx.rollback()
                    raise _Failed(HandlerProtocolError(
                        "the handler returned, but a database error it caught left its transaction failed: "
                        "rolled back (let the error propagate, or use a savepoint: session.begin_nested())",
                        reason_code="25P02", sqlstate="25P02",
                    ))
                claim = Result(Outcome.APPLIED, claim.payload_sha256, None, claim.handler_version, claim.processed_at)
        except (_Failed, Transient, HandlerProtocolError):
            raise
        except BaseException:
            if tx.is_active:
                tx.rollback()
            raise
        try:
            tx.commit()
        except DBAPIError as exc:
            if _lost(exc) and xid is not None:
                if self._resolve(target, xid):
                    return claim
                raise Transient(TransientKind.CONNECTION, exc) from exc
            raise
        return claim

    def _resolve(self, target: Target, xid: str) -> bool:
        """Whether the transaction whose COMMIT answer was lost committed (pg_xact_status)."""
        policy = self.retry
        deadline = time.monotonic() + policy.resolve_timeout
        polls = 0
        status: str | None = "unreachable"
        while True:
            polls += 1
            try:
                if target.in_transaction():
                    target.rollback()
                with target.begin():
                    status = target.execute(XACT_STATUS, {"xid": xid}).scalar()
            except DBAPIError as exc:
                if classify(exc) is None:
                    raise
            if status == "committed":
                return True
            if status == "aborted":
                return False
            if status is None or time.monotonic() >= deadline:
                raise CommitOutcomeUnknown(
                    f"the connection was lost during COMMIT of transaction {xid} and its outcome could not be "
                    f"established (last status: {status}): do not ack; a redelivery is safe",
                    xid=xid,
                )
            time.sleep(min(policy.backoff(polls, self._rng) + 0.005, max(deadline - time.monotonic(), 0.0)))

    def _run(self, target: Target, attempt: Callable[[], T], retries: int) -> tuple[T, int]:
        """`attempt` until it returns or raises a permanent error; (its value, retries so far)."""
        policy = self.retry
        number = 0
        while True:
            number += 1
            try:
                return attempt(), retries
            except Transient as transient:
                error, kind = transient.error, transient.kind
            except DBAPIError as exc:
                found = classify(exc) or (TransientKind.CONNECTION if _lost(exc) else None)
                if found is None:
                    raise
                error, kind = exc, found
                if target.in_transaction():
                    target.rollback()
            if kind is TransientKind.POOLER:
                self._behind_pooler = True
            if number >= policy.max_attempts:
                inner = _database_error(error)
                raise RetriesExhausted(
                    f"gave up after {number} attempts; the last failed with {_core.error_key(inner)}: {inner}",
                    attempts=number,
                    sqlstate=inner.sqlstate if isinstance(inner, psycopg.Error) else None,
                ) from error
            retries += 1
            time.sleep(policy.backoff(number, self._rng))


