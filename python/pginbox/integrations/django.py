"""`DjangoInbox`: schema `inbox` on Django's own database connection (Django >= 4.2 with the psycopg 3
driver). Install with the extra: `pip install pginbox[django]`. Guide: docs/django.md.

In transactions of its own, like `pginbox.Inbox.handle`:

    handle(message, handler)   transaction.atomic(): inbox.claim, handler(message) (its ORM code,
                               nested atomic() included, on the same connection), COMMIT

In the caller's `transaction.atomic()` block (nothing is committed here):

    claim(message)                                   inbox.claim           -> Result
    enqueue(effect_id, destination, payload, ...)    inbox.enqueue_effect  -> bool
    pginbox.integrations.django.enqueue(..., consumer=...)   the same, without a DjangoInbox

Why not `pginbox.Inbox` on Django's psycopg connection: Inbox switches the connection's autocommit
around its own BEGIN, and Django forbids that inside atomic(), which `get_or_create`,
`update_or_create` and multi-table saves open: every such handler failed with "can't change
'autocommit' now". Here the transaction is Django's atomic() block, so the handler's nested
atomic() blocks are savepoints in it. The protocol around it (retries, a lost COMMIT, the handler's
rules) is pginbox.client.protocol, shared with pginbox.Inbox.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db import Error as DjangoError
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg.types.json import Jsonb

from pginbox import pooler
from pginbox.client import queries
from pginbox.client import shared as _core
from pginbox.client.drive import drive
from pginbox.client.outcomes import Message, Outcome, Result
from pginbox.client.protocol import Protocol, Transient, applied, commit_lost, judge_handler, raise_if_failed
from pginbox.client.retry import RetryPolicy, TransientKind, classify
from pginbox.client.shared import Failure
from pginbox.errors import PginboxError, database_error

__all__ = ["DjangoHandler", "DjangoInbox", "enqueue"]

T = TypeVar("T")

#: handler(message): runs inside the atomic() block that holds the claim, on the connection of the
#: DjangoInbox's database alias (the ORM's, by default). Raising rolls back the claim and its writes.
DjangoHandler = Callable[[Message], object]

_INERROR = psycopg.pq.TransactionStatus.INERROR
_PIPELINE = psycopg.Pipeline.is_supported()
#: psycopg's default; with prepare=True a statement is prepared at its first execution whatever it is
_PREPARE_THRESHOLD = 5


def _psycopg_error(exc: BaseException) -> BaseException:
    """The psycopg error behind a Django database error (Django raises its own classes `from` the
    driver's, so causes only): what reason codes and SQLSTATEs come from; `exc` when there is none."""
    return database_error(exc, context=False) or exc


def _lost(exc: BaseException, conn: BaseDatabaseWrapper) -> bool:
    """The connection went away: no answer from the server."""
    raw = conn.connection
    if raw is None or getattr(raw, "closed", False) or getattr(raw, "broken", False):
        return True
    inner = _psycopg_error(exc)
    return isinstance(inner, psycopg.OperationalError) and inner.sqlstate is None


def _transient(exc: BaseException, conn: BaseDatabaseWrapper) -> TransientKind | None:
    """The transient kind of a database error (Django's, or the driver's), None when permanent."""
    if not isinstance(exc, DjangoError | psycopg.Error):
        return None
    return classify(exc) or (TransientKind.CONNECTION if _lost(exc, conn) else None)


def _connection(using: str, caller: str) -> BaseDatabaseWrapper:
    conn = connections[using]
    if conn.vendor != "postgresql":
        raise PginboxError(f"{caller} needs a PostgreSQL database; database {using!r} is {conn.vendor}")
    return conn


def _raw(conn: BaseDatabaseWrapper) -> psycopg.Connection[Any]:
    conn.ensure_connection()
    raw: object = conn.connection
    if not isinstance(raw, psycopg.Connection):
        raise PginboxError(
            "pginbox.integrations.django needs Django's PostgreSQL backend on psycopg 3 "
            f"(pip install 'psycopg[binary]'); database {conn.alias!r} uses {type(raw).__module__}"
        )
    return raw


def _fetch(conn: BaseDatabaseWrapper, query: str, params: Sequence[Any] | None = None) -> tuple[Any, ...]:
    with conn.cursor() as cur:
        cur.execute(query, params)
        row = cur.fetchone()
    assert row is not None, "the statement returns one row"
    return tuple(row)


def _claim(raw: psycopg.Connection[Any], params: Sequence[Any], prepare: bool, pipeline: bool) -> tuple[Any, ...]:
    """inbox.claim on the psycopg connection under Django's, inside the atomic() block Django just
    opened, with the parameters bound server-side (Django's cursor class binds them into the query
    text). pipeline: psycopg's BEGIN and the claim travel in one round trip (pginbox.Inbox's rule:
    by default only to a server on another machine).

    prepare: prepare the claim on the server session (the statement is parsed and planned once per
    connection, not per message), also where Django left `prepare_threshold` at its default, None.
    Only the claim: the threshold is restored before the handler runs, so Django's own statements
    are prepared exactly as its settings say."""
    threshold = raw.prepare_threshold
    if prepare and threshold is None:
        raw.prepare_threshold = _PREPARE_THRESHOLD
    try:
        with psycopg.Cursor(raw) as cur:
            if pipeline:
                with raw.pipeline():
                    cur.execute(queries.CLAIM, params, prepare=prepare)
            else:
                cur.execute(queries.CLAIM, params, prepare=prepare)
            row = cur.fetchone()
    finally:
        raw.prepare_threshold = threshold
    assert row is not None, "inbox.claim returns one row"
    return tuple(row)


def _in_atomic(conn: BaseDatabaseWrapper, what: str) -> None:
    if not conn.in_atomic_block:
        raise PginboxError(
            f"{what} writes in the caller's transaction, and there is none: call it inside "
            "`with transaction.atomic():` (with the writes it belongs to)"
        )


def _enqueue(
    conn: BaseDatabaseWrapper,
    consumer: str,
    effect_id: str,
    destination: str,
    payload: Any,
    headers: Mapping[str, Any] | None,
    ordering_key: str | None,
    available_at: datetime | None,
    tenant: str | None,
) -> bool:
    _in_atomic(conn, "enqueue")
    _raw(conn)
    params = (
        effect_id,
        destination,
        Jsonb(payload),
        None if headers is None else Jsonb(dict(headers)),
        ordering_key,
        available_at,
        consumer,
        tenant,
    )
    return bool(_fetch(conn, queries.ENQUEUE, params)[0])


def enqueue(
    effect_id: str,
    destination: str,
    payload: Any,
    *,
    consumer: str,
    headers: Mapping[str, Any] | None = None,
    ordering_key: str | None = None,
    available_at: datetime | None = None,
    tenant: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> bool:
    """inbox.enqueue_effect for `consumer` inside the caller's `transaction.atomic()` block (the
    effect commits with the writes it belongs to, and never if they roll back): True enqueued,
    False already enqueued (same id, destination and payload). For producer-only services (a view
    that writes an order and its effect): the database role must be bound to `consumer`
    (inbox.bind_consumer) and `consumer` to `destination` (inbox.bind_destination)."""
    conn = _connection(using, "enqueue")
    return _enqueue(conn, consumer, effect_id, destination, payload, headers, ordering_key, available_at, tenant)


class _HandlerError(Exception):
    """internal: the handler failed (its verdict: a Transient or the error to record); raised
    through the atomic() block so that it rolls back, caught right outside it."""

    def __init__(self, verdict: BaseException) -> None:
        super().__init__(str(verdict))
        self.verdict = verdict


class DjangoInbox:
    """Delivers messages for one consumer through schema `inbox` on Django's connection `using`
    (the calling thread's, as the ORM's). Holds no connection of its own; safe to share between
    threads.

    consumer, handler_version, retry, raise_on_failure: as for pginbox.Inbox.
    using   the Django database alias (DATABASES key) whose connection runs the claim and the handler.
    pipeline  as for pginbox.Inbox: True sends BEGIN and the claim in one round trip (psycopg's
            pipeline mode); None (the default) does so only to a server on another machine.
    """

    def __init__(
        self,
        *,
        consumer: str,
        handler_version: str = "unversioned",
        retry: RetryPolicy | None = None,
        raise_on_failure: bool = False,
        using: str = DEFAULT_DB_ALIAS,
        pipeline: bool | None = None,
    ) -> None:
        _core.check_names(consumer, handler_version)
        self.consumer = consumer
        self.handler_version = handler_version
        self.retry = retry if retry is not None else RetryPolicy()
        self.raise_on_failure = raise_on_failure
        self.using = using
        self.pipeline = pipeline if _PIPELINE else False
        self._schema_version: int | None = None
        #: whether `handle` prepares its claim (decided on first use, see _prepare; False for good
        #: once a pooler shows itself)
        self._prepare_claim = False
        self._rng = random.Random()

    # ------------------------------------------------------------------ in a transaction of its own

    def handle(self, message: Message, handler: DjangoHandler, *, raise_on_failure: bool | None = None) -> Result:
        """Claim `message` and run `handler(message)` in the atomic() block that holds the claim;
        commit when it returns. As pginbox.Inbox.handle: APPLIED after the commit; DUPLICATE,
        CONFLICT, QUARANTINED without running the handler; a permanent handler error rolls back,
        is recorded in a new transaction (FAILED / QUARANTINED, or re-raised with raise_on_failure);
        transient errors re-run the whole transaction; a COMMIT whose answer was lost is resolved
        with pg_xact_status. Refused inside an atomic() block (ATOMIC_REQUESTS included): there the
        "commit" would be a savepoint, and the broker's ack would come before the real commit."""
        message = _core.check_message(message)
        conn = _connection(self.using, "DjangoInbox.handle")
        if conn.in_atomic_block:
            raise PginboxError(
                "DjangoInbox.handle was called inside transaction.atomic() (ATOMIC_REQUESTS=True wraps every view "
                "in one): its commit would only release a savepoint, and the message would be acked before the "
                "outer block commits. Call it outside any atomic block (mark the view "
                "@transaction.non_atomic_requests), or use DjangoInbox.claim inside your own block."
            )
        if not conn.get_autocommit():
            raise PginboxError(
                "DjangoInbox.handle needs Django's autocommit mode (AUTOCOMMIT=False in DATABASES, or "
                "transaction.set_autocommit(False)): atomic() would not commit"
            )
        # A long-running worker: a connection that broke, or outlived CONN_MAX_AGE, is replaced (what
        # Django does around each request with close_old_connections).
        conn.close_if_unusable_or_obsolete()
        protocol = Protocol(
            self.retry,
            classify=partial(_transient, conn=conn),
            poll_status=partial(self._poll_status, conn),
            terminate=partial(self._terminate, conn),
            on_pooler=self._found_pooler,
            rng=self._rng,
        )
        result = drive(
            protocol.handle(
                message,
                start=partial(self._attempt, conn, partial(self._record_start, conn, message)),
                attempt=partial(self._attempt, conn, partial(self._handle_attempt, conn, message, handler)),
                record_failure=lambda error: partial(
                    self._attempt, conn, partial(self._record_failure_tx, conn, message, error)
                ),
            )
        )
        return raise_if_failed(result, message, self.raise_on_failure if raise_on_failure is None else raise_on_failure)

    # ------------------------------------------------------------------ in the caller's atomic() block

    def claim(self, message: Message) -> Result:
        """inbox.claim inside the caller's `transaction.atomic()` block: CLAIMED (do the work; the
        claim commits with the block), DUPLICATE, CONFLICT or QUARANTINED (do nothing)."""
        message = _core.check_message(message)
        conn = _connection(self.using, "DjangoInbox.claim")
        _in_atomic(conn, "DjangoInbox.claim")
        self._prepare(conn)
        return _core.result_from_row(
            _fetch(conn, queries.CLAIM, _core.claim_params(self.consumer, self.handler_version, message))
        )

    def enqueue(
        self,
        effect_id: str,
        destination: str,
        payload: Any,
        *,
        headers: Mapping[str, Any] | None = None,
        ordering_key: str | None = None,
        available_at: datetime | None = None,
        tenant: str | None = None,
    ) -> bool:
        """inbox.enqueue_effect for this consumer inside the caller's atomic() block (a handler run
        by `handle` is inside one): see `pginbox.integrations.django.enqueue`."""
        conn = _connection(self.using, "DjangoInbox.enqueue")
        return _enqueue(
            conn, self.consumer, effect_id, destination, payload, headers, ordering_key, available_at, tenant
        )

    # ------------------------------------------------------------------ internals

    def _prepare(self, conn: BaseDatabaseWrapper) -> psycopg.Connection[Any]:
        """The psycopg connection; on first use, the schema check and whether `handle` prepares its
        claim: yes, as pginbox.Inbox does, unless the database's OPTIONS set `prepare_threshold`
        (then None means never, a number always) or a connection pooler answered the login (told
        by the schema check's own answer: no query more)."""
        raw = _raw(conn)
        if self._schema_version is None:
            try:
                row = _fetch(conn, queries.SCHEMA_CHECK)
            except DjangoError as exc:
                inner = _psycopg_error(exc)
                translated = (
                    _core.schema_error(inner, _core.describe(raw.info)) if isinstance(inner, psycopg.Error) else None
                )
                if translated is not None:
                    raise translated from exc
                raise
            options: Mapping[str, Any] = conn.settings_dict.get("OPTIONS") or {}
            wanted = options["prepare_threshold"] is not None if "prepare_threshold" in options else True
            # The schema check returns the server session's pid: a pooler answered the login when
            # it is not the pid the login got (as pginbox.Inbox detects it).
            self._prepare_claim = wanted and not pooler.differs(raw.info.backend_pid, row[3])
            self._schema_version = _core.check_schema_version(row[:3], _core.describe(raw.info))
        return raw

    def _found_pooler(self) -> None:
        """The server rejected a prepared statement (42P05 / 26000: a transaction pooler that the
        login check did not see): prepare nothing from now on."""
        self._prepare_claim = False

    def _record_start(self, conn: BaseDatabaseWrapper, message: Message) -> Result | None:
        self._prepare(conn)
        params = _core.record_starts_params(self.consumer, self.handler_version, [message])
        with transaction.atomic(using=self.using):
            row = _fetch(conn, queries.RECORD_STARTS, params)
        return _core.start_results([row])[0]

    def _record_failure_tx(self, conn: BaseDatabaseWrapper, message: Message, error: BaseException) -> Result:
        self._prepare(conn)
        reason, text = _core.failure_reason(_psycopg_error(error))
        params = _core.record_failure_params(self.consumer, self.handler_version, message, reason, text)
        with transaction.atomic(using=self.using):
            row = _fetch(conn, queries.RECORD_FAILURE, params)
        return _core.result_from_row(row)

    def _handle_attempt(self, conn: BaseDatabaseWrapper, message: Message, handler: DjangoHandler) -> Result | Failure:
        raw = self._prepare(conn)
        xid: str | None = None
        pid: int | None = None
        committing = False
        params = _core.claim_params(self.consumer, self.handler_version, message)
        try:
            with transaction.atomic(using=self.using):
                row = _claim(raw, params, self._prepare_claim, _core.use_pipeline(self.pipeline, raw.info))
                xid, pid = row[9], raw.info.backend_pid
                result = _core.result_from_row(row)
                if result.outcome is Outcome.CLAIMED:
                    self._call_handler(conn, raw, handler, message)
                    result = applied(result)
                committing = True
        except _HandlerError as failed:
            if isinstance(failed.verdict, Transient):
                raise failed.verdict from failed.verdict.error
            return Failure(failed.verdict, result)
        except DjangoError as exc:
            if not committing:
                raise  # the claim statement failed: the protocol tells transient from permanent
            if _lost(exc, conn):
                conn.close()  # the protocol asks pg_xact_status on a new connection
                return commit_lost(xid, pid, result, exc)
            if classify(exc) is not None:
                raise
            # The server answered COMMIT with an error (a deferred constraint): rolled back.
            return Failure(exc, result)
        return result

    def _call_handler(
        self, conn: BaseDatabaseWrapper, raw: psycopg.Connection[Any], handler: DjangoHandler, message: Message
    ) -> None:
        """Runs the handler inside the atomic() block; raises _HandlerError (the block then rolls
        back) when it raised or broke the protocol."""
        error: Exception | None = None
        returned: object = None
        try:
            returned = handler(message)
        except Exception as exc:
            error = exc
        # An error the handler caught (inside an inner atomic(savepoint=False), or a failed statement
        # outside any savepoint) would make Django roll back at the end of the block, silently: it is
        # the handler's failure, recorded.
        verdict = judge_handler(
            error,
            returned,
            transient=None if error is None else classify(error),
            lost=_lost(error, conn) if error is not None else raw.closed,
            failed_tx=conn.needs_rollback or raw.info.transaction_status == _INERROR,
            ended_tx=False,  # Django refuses commit() and rollback() inside atomic()
            client="DjangoInbox",
            await_fix="DjangoInbox runs sync handlers (wrap async code with asgiref's async_to_sync)",
            savepoint_fix="catch it outside a nested transaction.atomic()",
        )
        if verdict is not None:
            raise _HandlerError(verdict) from error

    def _attempt(self, conn: BaseDatabaseWrapper, attempt: Callable[[], T]) -> T:
        """One transaction of `handle`; a connection that was lost is closed, so that the next
        attempt connects again."""
        try:
            return attempt()
        except Exception as exc:
            transient = exc.kind if isinstance(exc, Transient) else _transient(exc, conn)
            if transient is TransientKind.CONNECTION and not conn.in_atomic_block:
                conn.close()
            raise

    def _poll_status(self, conn: BaseDatabaseWrapper, xid: str) -> str | None:
        try:
            status = _fetch(conn, queries.XACT_STATUS, (xid,))[0]
        except DjangoError as exc:
            if _transient(exc, conn) is not None:
                conn.close()  # the next poll connects again
            raise
        return None if status is None else str(status)

    def _terminate(self, conn: BaseDatabaseWrapper, backend_pid: int, xid: str) -> None:
        with suppress(DjangoError):
            _fetch(conn, queries.TERMINATE_ORPHAN, (backend_pid, xid))
