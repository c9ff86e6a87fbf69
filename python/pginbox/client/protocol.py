"""The transaction protocol of every client, written once and without I/O (sans-I/O).

`Inbox` / `AsyncInbox` (psycopg), `SQLAlchemyInbox` / `AsyncSQLAlchemyInbox` and `DjangoInbox` run
the same protocol; each only says how to run one transaction on its connection. The protocol is
a generator that yields operations and receives their outcome; the client drives it with
`pginbox.client.drive.drive` (sync) or `drive_async` (asyncio), as psycopg drives its own
generators with `wait()` and `wait_async()`:

    Call(fn)        run fn() (a transaction attempt, a pg_xact_status poll, ...; an awaitable it
                    returns is awaited) and send back its value, or throw its exception in
    Sleep(seconds)  sleep, then send back None

What the protocol decides:

  retry      an attempt that ends in a transient error (pginbox.client.retry) runs again after a
             jittered back-off, up to RetryPolicy.max_attempts, then RetriesExhausted
  commit     a COMMIT whose answer was lost (the attempt raises `CommitUnknown`) is resolved with
             pg_xact_status on the transaction id read before COMMIT, never guessed: committed ->
             the attempt's value; aborted -> run again; unknown -> CommitOutcomeUnknown. A backend
             still 'in progress' after RetryPolicy.orphan_grace is terminated.
  handle     a redelivery is announced first (record_start; quarantined -> done); the attempt
             claims, runs the handler, commits; a permanent handler failure is recorded in a
             transaction of its own and returned (or raised, with raise_on_failure)
  handler    `judge_handler`: what the handler's end means for its transaction
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, TypeVar

from pginbox.client.outcomes import Message, Outcome, Result
from pginbox.client.retry import RetryPolicy, TransientKind
from pginbox.client.shared import CallCost, Failure, StatsCounter, discard_awaitable, error_key
from pginbox.errors import CommitOutcomeUnknown, HandlerProtocolError, RetriesExhausted, database_error

__all__ = [
    "Call",
    "CommitUnknown",
    "Op",
    "Protocol",
    "Sleep",
    "Transient",
    "applied",
    "commit_lost",
    "judge_handler",
    "raise_if_failed",
]

T = TypeVar("T")


# ----------------------------------------------------------------------------- operations


@dataclass(frozen=True, slots=True)
class Call:
    """Run `fn()` (await what it returns, in the asyncio driver); send back its value or throw its
    exception in."""

    fn: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


Op = Call | Sleep
#: A protocol step: yields operations, receives their values, returns T.
Steps = Generator[Op, Any, T]


# ----------------------------------------------------------------------------- signals


class Transient(Exception):
    """internal: this attempt ended in a transient error after rolling back; run it again. Raised
    by the clients' attempts, caught by `Protocol.retry`, never raised to a caller."""

    def __init__(self, kind: TransientKind, error: BaseException) -> None:
        super().__init__(str(error))
        self.kind = kind
        self.error = error


class CommitUnknown(Exception):
    """internal: the connection was lost during COMMIT of transaction `xid` (of server process
    `backend_pid`, None when unknown); `value` is what the attempt returns if that transaction
    committed. Raised by the clients' attempts, resolved by `Protocol.retry`."""

    def __init__(self, xid: str, backend_pid: int | None, value: Any, error: BaseException) -> None:
        super().__init__(str(error))
        self.xid = xid
        self.backend_pid = backend_pid
        self.value = value
        self.error = error


def commit_lost(xid: str | None, backend_pid: int | None, value: T, error: BaseException) -> T:
    """A COMMIT whose answer was lost: `value` when the transaction wrote nothing (no transaction id:
    whether it committed changes nothing), else CommitUnknown for the retry loop to resolve."""
    if xid is None:
        return value
    raise CommitUnknown(xid, backend_pid, value, error) from error


# ----------------------------------------------------------------------------- handler rules

_AWAITABLE: Final = "the handler returned an awaitable it did not await (a coroutine): its statements never ran; {fix}"
_ENDED: Final = (
    "the handler ended the transaction that holds the claim (commit or rollback): {client} commits it when the "
    "handler returns"
)
_FAILED_TX: Final = (
    "the handler returned, but a database error it caught left its transaction failed: rolled back "
    "(let the error propagate, or {fix})"
)


def judge_handler(
    error: Exception | None,
    returned: object,
    *,
    transient: TransientKind | None,
    lost: bool,
    failed_tx: bool,
    ended_tx: bool,
    client: str,
    await_fix: str = "await them inside the handler",
    savepoint_fix: str = "use a savepoint: cursor.connection.transaction()",
) -> Transient | BaseException | None:
    """What the end of a handler means for the transaction that holds the claim.

    error      the exception the handler raised (None: it returned `returned`)
    transient  the transient kind of `error` (pginbox.client.retry.classify, through the client's
               error wrappers), None when permanent
    lost       the connection is gone; failed_tx: the transaction is in error (25P02); ended_tx:
               the handler committed or rolled back itself

    None: commit. A `Transient`: roll back and raise it (the attempt runs again). Another
    exception: the handler failed with it: roll back and record it. Raises HandlerProtocolError
    when the handler ended the transaction itself (nothing left to roll back or commit)."""
    if error is not None:
        kind = transient or (TransientKind.CONNECTION if lost else None)
        if kind is not None:
            return Transient(kind, error)
        return error
    if _is_awaitable(returned):
        discard_awaitable(returned)
        return HandlerProtocolError(_AWAITABLE.format(fix=await_fix), reason_code="handler_returned_awaitable")
    if lost:
        gone = ConnectionError("the connection was lost in the handler")
        return Transient(TransientKind.CONNECTION, gone)
    if failed_tx:
        return HandlerProtocolError(_FAILED_TX.format(fix=savepoint_fix), reason_code="25P02", sqlstate="25P02")
    if ended_tx:
        raise HandlerProtocolError(_ENDED.format(client=client), reason_code="handler_ended_transaction")
    return None


def _is_awaitable(value: object) -> bool:
    # inspect.isawaitable, without its cost for the common None
    return value is not None and hasattr(value, "__await__")


def raise_if_failed(result: Result, message: Message, raise_on_failure: bool) -> Result:
    """`result`, or with raise_on_failure the handler's exception behind a recorded failure, noted
    with what was recorded."""
    error = result.exception
    if raise_on_failure and error is not None:
        error.add_note(
            f"pginbox: recorded as {result.outcome.value} (attempt {result.attempts}, "
            f"reason {result.reason_code!r}) for message {message.message_id!r}"
        )
        raise error
    return result


# ----------------------------------------------------------------------------- the protocol


class Protocol:
    """The protocol of one client object.

    classify        the transient kind of an error an attempt raised (the client unwraps its own
                    error classes), None when permanent: raised to the caller
    poll_status     poll_status(xid) -> pg_xact_status text, on a working connection (None: the
                    client's attempts never raise CommitUnknown)
    terminate       terminate(backend_pid, xid): end the orphaned backend still holding xid open
                    (None: the client cannot)
    stats           counters to keep (None: none)
    on_pooler       called when a prepared statement met a pooler (TransientKind.POOLER)
    """

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        classify: Callable[[BaseException], TransientKind | None],
        poll_status: Callable[[str], Any] | None = None,
        terminate: Callable[[int, str], Any] | None = None,
        stats: StatsCounter | None = None,
        on_pooler: Callable[[], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self.classify = classify
        self.poll_status = poll_status
        self.terminate = terminate
        self.stats = stats
        self.on_pooler = on_pooler
        self.rng = rng if rng is not None else random.Random()

    # ------------------------------------------------------------------ retry

    def retry(self, attempt: Callable[[], Any], cost: CallCost) -> Steps[Any]:
        """`attempt` (one transaction) until it returns, raises a permanent error, or the policy
        gives up (RetriesExhausted, the last error as its cause)."""
        policy = self.policy
        stats = self.stats
        number = 0
        while True:
            number += 1
            started = time.monotonic()
            try:
                return (yield Call(attempt))
            except CommitUnknown as unknown:
                if (yield from self.resolve(unknown)):
                    return unknown.value
                error, kind = unknown.error, TransientKind.CONNECTION
            except Transient as transient:
                error, kind = transient.error, transient.kind
            except Exception as exc:
                found = self.classify(exc)
                if found is None:
                    raise
                error, kind = exc, found
            if kind is TransientKind.POOLER and self.on_pooler is not None:
                self.on_pooler()  # the next attempt prepares nothing
            if kind is TransientKind.CONFLICT:
                cost.lock_wait += time.monotonic() - started
            if stats is not None:
                stats.transient_error(error)
            if number >= policy.max_attempts:
                if stats is not None:
                    stats.gave_up(cost)
                inner = _sqlstate_error(error)
                raise RetriesExhausted(
                    f"gave up after {number} attempts; the last failed with {error_key(inner)}: {inner}",
                    attempts=number,
                    sqlstate=getattr(inner, "sqlstate", None),
                ) from error
            delay = policy.backoff(number, self.rng)
            cost.retries += 1
            cost.backoff += delay
            yield Sleep(delay)

    # ------------------------------------------------------------------ lost COMMIT

    def resolve(self, unknown: CommitUnknown) -> Steps[bool]:
        """Whether the transaction whose COMMIT answer was lost committed (pg_xact_status), polled
        until RetryPolicy.resolve_timeout; CommitOutcomeUnknown when it cannot be told."""
        policy = self.policy
        first = time.monotonic()
        deadline = first + policy.resolve_timeout
        terminated = unknown.backend_pid is None or self.terminate is None
        polls = 0
        while True:
            polls += 1
            status: str | None = "unreachable"
            try:
                assert self.poll_status is not None, "CommitUnknown from a client that cannot resolve it"
                status = yield Call(partial(self.poll_status, unknown.xid))
                if status == "in progress" and not terminated and time.monotonic() - first >= policy.orphan_grace:
                    terminated = True
                    assert self.terminate is not None and unknown.backend_pid is not None
                    yield Call(partial(self.terminate, unknown.backend_pid, unknown.xid))
            except Exception as exc:
                if self.classify(exc) is None:
                    raise
            if status == "committed":
                self._count_unknown(True)
                return True
            if status == "aborted":
                self._count_unknown(False)
                return False
            if status is None or time.monotonic() >= deadline:
                self._count_unknown(None)
                raise CommitOutcomeUnknown(
                    f"the connection was lost during COMMIT of transaction {unknown.xid} and its outcome "
                    f"could not be established (last status: {status}): do not ack; a redelivery is safe",
                    xid=unknown.xid,
                ) from unknown.error
            yield Sleep(min(policy.backoff(polls, self.rng) + 0.005, max(deadline - time.monotonic(), 0.0)))

    def _count_unknown(self, committed: bool | None) -> None:
        if self.stats is not None:
            self.stats.unknown_commit(committed)

    # ------------------------------------------------------------------ handle

    def handle(
        self,
        message: Message,
        *,
        start: Callable[[], Any] | None,
        attempt: Callable[[], Any],
        record_failure: Callable[[BaseException], Callable[[], Any]],
    ) -> Steps[Result]:
        """One message: `start` (record_start of a redelivery: a Result held by quarantine, or None
        to go on), then `attempt` (claim, handler, COMMIT: a Result, or a Failure of the handler),
        then for a Failure `record_failure(error)` (its attempt: the recorded Result). Each in
        transactions of its own, retried; the Result carries the call's cost, and the handler's
        exception when its failure was recorded."""
        cost = CallCost()
        stats = self.stats
        if message.redelivered and start is not None:
            held = yield from self.retry(start, cost)
            if held is not None:
                return self._stamp(held, cost)
        outcome = yield from self.retry(attempt, cost)
        if not isinstance(outcome, Failure):
            return self._stamp(outcome, cost)
        error = outcome.error
        recorded = yield from self.retry(record_failure(error), cost)
        stamped = cost.stamp(recorded, error)
        if stats is not None:
            stats.finished([stamped], cost)
        return stamped

    def _stamp(self, result: Result, cost: CallCost) -> Result:
        stamped = cost.stamp(result)
        if self.stats is not None:
            self.stats.finished([stamped], cost)
        return stamped


def _sqlstate_error(error: BaseException) -> BaseException:
    """The driver's error behind `error` (SQLAlchemy and Django wrap it), for messages."""
    return database_error(error, context=False) or error


def applied(claim: Result) -> Result:
    """The Result of a claimed message once its transaction committed."""
    return Result(Outcome.APPLIED, claim.payload_sha256, None, claim.handler_version, claim.processed_at)
