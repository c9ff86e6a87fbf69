"""What the sync and async clients share: parameters, row decoding, failure reasons, schema check,
counters and the internal signals of the retry loop. No I/O here."""

from __future__ import annotations

import functools
import ipaddress
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb

from pginbox._version import __version__
from pginbox.client.outcomes import InboxStats, Message, Outcome, Result
from pginbox.errors import PginboxError, SchemaAccessError, SchemaVersionError
from pginbox.schema.compat import check_release
from pginbox.sql_limits import MAX_BATCH, REASON_MAX_BYTES

_OUTCOMES: Final = {o.value: o for o in Outcome}


# ----------------------------------------------------------------------------- parameters


def claim_params(consumer: str, handler_version: str, m: Message) -> tuple[Any, ...]:
    return (consumer, m.producer, m.message_id, Jsonb(m.payload), handler_version, m.tenant, m.produced_at)


def apply_params(consumer: str, m: Message) -> tuple[Any, ...]:
    return (consumer, m.producer, m.message_id, m.message_type, Jsonb(m.payload), m.tenant, m.produced_at)


def batch_params(consumer: str, messages: Sequence[Message]) -> tuple[Any, ...]:
    items = []
    for m in messages:
        item: dict[str, Any] = {
            "producer": m.producer,
            "message_id": m.message_id,
            "message_type": m.message_type,
            "payload": m.payload,
            "tenant": m.tenant,
        }
        if m.produced_at is not None:
            item["produced_at"] = m.produced_at.isoformat()
        items.append(item)
    return (consumer, Jsonb(items))


def record_failure_params(
    consumer: str, handler_version: str, m: Message, reason_code: str, error_message: str
) -> tuple[Any, ...]:
    return (
        consumer,
        m.producer,
        m.message_id,
        Jsonb(m.payload),
        reason_code,
        error_message,
        handler_version,
        m.tenant,
        m.message_type,
    )


def record_starts_params(consumer: str, handler_version: str, messages: Sequence[Message]) -> tuple[Any, ...]:
    return (
        [m.producer for m in messages],
        [m.message_id for m in messages],
        [m.tenant for m in messages],
        [m.message_type for m in messages],
        [Jsonb(m.payload) for m in messages],
        consumer,
        handler_version,
    )


@functools.lru_cache(maxsize=64)
def is_local_server(host: str, hostaddr: str) -> bool:
    """True when the server is on this machine: a Unix socket directory, or a loopback address."""
    if not host or host.startswith(("/", "@")):
        return True  # libpq's default and abstract-namespace sockets are local too
    for text in (hostaddr, host):
        try:
            return ipaddress.ip_address(text).is_loopback
        except ValueError:
            continue
    return host == "localhost"


def use_pipeline(setting: bool | None, info: psycopg.ConnectionInfo) -> bool:
    """Whether BEGIN and the claim travel in one pipelined round trip. An explicit setting wins;
    None (the default) pipelines only to a server on another machine: on a local socket a round
    trip costs less client CPU than psycopg's pipeline block (docs/performance.md)."""
    if setting is not None:
        return setting
    return not is_local_server(info.host or "", info.hostaddr or "")


def discard_awaitable(value: object) -> None:
    """Close a coroutine a handler returned without awaiting (no "never awaited" warning later)."""
    close = getattr(value, "close", None)
    if callable(close):
        close()


def check_message(m: object) -> Message:
    if not isinstance(m, Message):
        raise TypeError(f"expected a pginbox.Message, got {type(m).__name__}")
    return m


# ----------------------------------------------------------------------------- rows


def parse_outcome(text: str) -> Outcome:
    try:
        return _OUTCOMES[text]
    except KeyError:
        raise PginboxError(
            f"the database answered with outcome {text!r}, which pginbox {__version__} does not know: "
            "upgrade the pginbox package to match the deployed schema"
        ) from None


def result_from_row(row: Sequence[Any], start: int = 0) -> Result:
    """A Result from the 9 delivery_result columns of `row` starting at `start`."""
    return Result(
        _OUTCOMES.get(row[start]) or parse_outcome(row[start]),
        row[start + 1],
        row[start + 2],
        row[start + 3],
        row[start + 4],
        row[start + 5],
        row[start + 6],
        row[start + 7],
        row[start + 8],
    )


def first_result(rows: Sequence[Sequence[Any]]) -> Result:
    """The Result of a statement that returns one delivery_result row."""
    return result_from_row(rows[0])


def batch_results(rows: Sequence[Sequence[Any]]) -> list[Result]:
    """Results of claim_and_apply_batch rows (position, then the delivery_result columns)."""
    return [result_from_row(row, 1) for row in rows]


def start_results(rows: Sequence[Sequence[Any]]) -> list[Result | None]:
    """record_start rows: a Result where the delivery is held by quarantine, else None (go on)."""
    return [result_from_row(row, 1) if row[1] == "quarantined" else None for row in rows]


def first_start(rows: Sequence[Sequence[Any]]) -> Result | None:
    """The start_results of one message."""
    return start_results(rows)[0]


# ----------------------------------------------------------------------------- failures


def _truncate_bytes(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit].decode(errors="ignore")


def failure_reason(exc: BaseException) -> tuple[str, str]:
    """(reason_code, error_message) recorded for a handler exception.

    reason_code: the exception's `reason_code` attribute when it is a non-empty string; else, for a
    database error, its constraint name when 1-64 bytes long, else its SQLSTATE (the rule of
    inbox.claim_and_apply for SQL handlers, so both paths count failures alike); else the
    exception's class name. Cut to 64 bytes."""
    code = getattr(exc, "reason_code", None)
    if not (isinstance(code, str) and code.strip()):
        code = None
        if isinstance(exc, psycopg.Error):
            constraint = exc.diag.constraint_name
            if constraint and len(constraint.encode()) <= REASON_MAX_BYTES:
                code = constraint
            else:
                code = exc.sqlstate
        if not code:
            code = type(exc).__name__
    message = str(exc) or type(exc).__name__
    return _truncate_bytes(code, REASON_MAX_BYTES), message


# ----------------------------------------------------------------------------- schema


def check_schema_version(row: object, where: str) -> int:
    """The deployed schema version, when this package works with it (pginbox.schema.compat)."""
    return check_release(row, where).version


def schema_error(exc: psycopg.Error, where: str) -> PginboxError | None:
    """The PginboxError for an error of the schema release query, None if unrelated."""
    if isinstance(exc, pg_errors.InsufficientPrivilege):
        return SchemaAccessError(
            f"this role may not use schema inbox in {where} ({exc.diag.message_primary}): "
            "an administrator runs GRANT inbox_consumer TO <your role>",
            sqlstate=exc.sqlstate,
        )
    if isinstance(exc, pg_errors.UndefinedFunction | pg_errors.InvalidSchemaName):
        return SchemaVersionError(
            f"schema inbox is not deployed in {where}: deploy it with `pginbox deploy --dsn <dsn>` "
            "(or `sqitch deploy` in the pginbox project)",
            found=None,
            supported=frozenset(),
            sqlstate=exc.sqlstate,
        )
    return None


def describe(info: psycopg.ConnectionInfo) -> str:
    """Where a connection points, without secrets."""
    try:
        return f"database {info.dbname!r} on {info.host}:{info.port}"
    except psycopg.Error:
        return "the database"


def connection_lost(exc: BaseException, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """True when `exc` left us without a server answer: the connection is gone."""
    if conn.closed or conn.broken:
        return True
    return isinstance(exc, psycopg.OperationalError) and exc.sqlstate is None


# ----------------------------------------------------------------------------- attempts


@dataclass(slots=True)
class Failure:
    """A handler raised a permanent error; its attempt was rolled back."""

    error: BaseException
    claim: Result


@dataclass(slots=True)
class CallCost:
    """What one call spent across its transactions."""

    retries: int = 0
    lock_wait: float = 0.0
    backoff: float = 0.0

    def stamp(self, result: Result, exception: BaseException | None = None) -> Result:
        """`result` with this call's retries and lock wait (and `exception`, when given)."""
        if self.retries == 0 and self.lock_wait == 0.0 and exception is None:
            return result
        return replace(
            result, retries=self.retries, lock_wait_seconds=self.lock_wait, exception=exception or result.exception
        )


def error_key(error: BaseException) -> str:
    state = error.sqlstate if isinstance(error, psycopg.Error) else None
    return state or "connection"


@dataclass
class StatsCounter:
    """Thread-safe accumulation of InboxStats."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    deliveries: int = 0
    outcomes: Counter[Outcome] = field(default_factory=Counter)
    retries: int = 0
    lock_wait: float = 0.0
    backoff: float = 0.0
    transient: Counter[str] = field(default_factory=Counter)
    unknown_commits: int = 0
    unknown_committed: int = 0
    exhausted: int = 0

    def finished(self, results: Sequence[Result], cost: CallCost) -> None:
        with self._lock:
            self.deliveries += len(results)
            for r in results:
                self.outcomes[r.outcome] += 1
            self.retries += cost.retries
            self.lock_wait += cost.lock_wait
            self.backoff += cost.backoff

    def stamp(self, results: Sequence[Result], cost: CallCost, exception: BaseException | None = None) -> list[Result]:
        """The results with the call's cost on them, counted."""
        stamped = [cost.stamp(r, exception) for r in results]
        self.finished(stamped, cost)
        return stamped

    def transient_error(self, error: BaseException) -> None:
        with self._lock:
            self.transient[error_key(error)] += 1

    def unknown_commit(self, committed: bool | None) -> None:
        with self._lock:
            self.unknown_commits += 1
            if committed:
                self.unknown_committed += 1

    def gave_up(self, cost: CallCost) -> None:
        with self._lock:
            self.exhausted += 1
            self.retries += cost.retries
            self.lock_wait += cost.lock_wait
            self.backoff += cost.backoff

    def snapshot(self) -> InboxStats:
        with self._lock:
            return InboxStats(
                deliveries=self.deliveries,
                outcomes=dict(self.outcomes),
                retries=self.retries,
                lock_wait_seconds=self.lock_wait,
                backoff_seconds=self.backoff,
                transient_errors=dict(self.transient),
                unknown_commits=self.unknown_commits,
                unknown_committed=self.unknown_committed,
                retries_exhausted=self.exhausted,
            )


def chunks(messages: Sequence[Message], size: int) -> list[Sequence[Message]]:
    return [messages[i : i + size] for i in range(0, len(messages), size)]


def check_names(consumer: object, handler_version: object) -> None:
    """The constructor arguments Inbox and AsyncInbox share."""
    if not isinstance(consumer, str) or not consumer:
        raise ValueError("consumer must be a non-empty string")
    if not isinstance(handler_version, str) or not handler_version:
        raise ValueError("handler_version must be a non-empty string")


def check_batch_size(size: int) -> int:
    if not 1 <= size <= MAX_BATCH:
        raise ValueError(f"batch_size must be between 1 and {MAX_BATCH}, got {size}")
    return size


#: before_commit(start, results) of apply_batch / handle_batch: a statement (query, params) to run
#: in the chunk's transaction before COMMIT, or None. `start`: the chunk's first index in the call.
BeforeCommit = Callable[[int, Sequence[Result]], tuple[Any, Any] | None]
#: The same, bound to one chunk: called with the results of the messages the transaction processed.
ChunkHook = Callable[[Sequence[Result]], tuple[Any, Any] | None]


def indexed_chunks(messages: Sequence[Message], size: int) -> list[tuple[int, Sequence[Message]]]:
    return [(i, messages[i : i + size]) for i in range(0, len(messages), size)]


def chunk_hook(
    before_commit: BeforeCommit, start: int, out: Sequence[Result | None], pending: Sequence[int]
) -> ChunkHook:
    """before_commit for one chunk: the results of the processed messages merged, in order, with
    those decided before the transaction (record_start's quarantines)."""
    decided = list(out)

    def hook(processed: Sequence[Result]) -> tuple[Any, Any] | None:
        merged = list(decided)
        for i, r in zip(pending, processed, strict=True):
            merged[i] = r
        return before_commit(start, cast(list[Result], merged))

    return hook
