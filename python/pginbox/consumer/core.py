"""`Consumer`: the loop of `pginbox consume`. Broker deliveries (through the port,
pginbox.brokers) -> AsyncInbox -> one verdict per message, told to the broker.

One transaction per batch (inbox.claim_and_apply_batch / handle_batch; a batch of one:
claim_and_apply / handle), then, after the COMMIT, per message:

  applied, duplicate                  ack
  conflict, quarantined, expired      ack, and a log line with the identity (operators own it now)
  failed                              redelivered after a delay doubling with the attempts
                                      (retry_delay ... max_retry_delay), never at once
  bad input: no identity (22004),     to the dead letter, with the SQLSTATE and the reason
  body not JSON or too deep (22P02),  (Pginbox-Sqlstate, Pginbox-Reason); a batch the database
  produced_at unreadable or out of    refuses is split in halves until the bad message is alone,
  range (22007, 22008), class 22,     so that the good ones are applied
  class 54 (sizes)
  configuration or rights: 42501,     HALT: the message is handed back (no ack, no dead letter),
  42704, 42883 and every other        the good messages of its batch are applied, the consumer
  permanent error                     stops fetching, says what to fix (logged, /healthz 503) and
                                      tries again every `halt_recheck` seconds: dead-lettering
                                      would empty the queue into the dead letter
  database unavailable                the client retries transient errors (RetryPolicy); then the
                                      batch is handed back to the broker, and the consumer pauses
                                      (growing, jittered) before it fetches again; these
                                      redeliveries are not announced as crashes

A delivery the broker marks as redelivered that this process did not hand back itself is announced
with inbox.record_start first, so that a message that crashes its consumer every time ends in
quarantine.

Python handlers: `async def handler(cursor, message)` runs on the consumer's asyncio connection
(an AsyncCursor); a plain `def handler(cursor, message)` runs in a worker thread on a connection of
its own, with a plain psycopg Cursor (pginbox.Inbox). Either way it runs inside the transaction
that holds the claim, and a handler that returns an awaitable it did not await fails the message
(HandlerProtocolError) instead of committing without its writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import inspect
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict, cast

import psycopg
from prometheus_client import CollectorRegistry
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout

from pginbox.brokers import make_broker
from pginbox.brokers.port import Broker, Delivery, Progress, ProgressStore
from pginbox.brokers.wire import FENCED, Action, BadInput, action_for, parse_message
from pginbox.client.async_inbox import AsyncHandler, AsyncInbox
from pginbox.client.durability import Durability
from pginbox.client.inbox import Inbox
from pginbox.client.outcomes import Message, Outcome, Result
from pginbox.client.retry import RetryPolicy
from pginbox.client.shared import BeforeCommit
from pginbox.consumer.config import ConsumeConfig
from pginbox.errors import BrokerError, CommitOutcomeUnknown, ConsumerConfigError, NotDurable, RetriesExhausted
from pginbox.runtime.backoff import doubling, jittered
from pginbox.runtime.failover import TimelineWatch
from pginbox.runtime.loading import load_object
from pginbox.runtime.log import kv
from pginbox.runtime.metrics import Metrics

__all__ = [
    "BadInput",
    "Consumer",
    "ConsumerStats",
    "HandedBack",
    "Handler",
    "is_async_handler",
    "load_handler",
    "retry_delay",
]

log = logging.getLogger("pginbox.consumer")

#: A Python handler: `async def (AsyncCursor, Message)` or `def (Cursor, Message)`.
Handler = Callable[[Any, Message], Any]

#: The outcomes that leave the message to operators: logged with the identity.
_LOGGED = {
    Outcome.CONFLICT: "message_conflict",
    Outcome.QUARANTINED: "message_quarantined",
    Outcome.EXPIRED: "message_expired",
}


class HandedBack:
    """The identities this process handed back itself (database outage, halt): their redelivery
    is not a crash and is not announced with inbox.record_start. `pginbox consume` and the
    framework integrations (pginbox.integrations.celery, .faststream) keep one each."""

    def __init__(self, limit: int = 100_000) -> None:
        self._keys: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._limit = limit

    def remember(self, message: Message | None) -> None:
        if message is None:
            return
        self._keys[(message.tenant, message.producer, message.message_id)] = None
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def announce(self, message: Message) -> Message:
        """`message`, its redelivered flag cleared when this process handed it back itself."""
        key = (message.tenant, message.producer, message.message_id)
        if key in self._keys:
            del self._keys[key]
            if message.redelivered:
                return replace(message, redelivered=False)
        return message


def retry_delay(attempts: int | None, base: float, cap: float) -> float:
    """Delay before a FAILED message comes back: base, 2 x base, 4 x base ... up to cap."""
    return doubling(attempts, base, cap)


def is_async_handler(fn: object) -> bool:
    """True for an `async def` (or an object whose __call__ is one, or a partial of one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def load_handler(spec: str) -> Handler:
    """`module:function` -> the handler(cursor, message), async or not (see the module docstring)."""
    try:
        return cast(Handler, load_object(spec, "consume setting handler"))
    except ValueError as exc:
        raise ConsumerConfigError(f"{exc} (or 'sql' for the registered SQL handlers)") from None


@dataclass
class ConsumerStats:
    consumed: int = 0
    batches: int = 0
    transactions: int = 0
    redeliveries: int = 0
    dead_letters: int = 0
    retried: int = 0
    handed_back: int = 0
    broker_reconnects: int = 0
    database_outages: int = 0
    halts: int = 0
    not_durable: int = 0
    failovers: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    last_lag_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "batches": self.batches,
            "transactions": self.transactions,
            "redeliveries": self.redeliveries,
            "dead_letters": self.dead_letters,
            "retried": self.retried,
            "handed_back": self.handed_back,
            "broker_reconnects": self.broker_reconnects,
            "database_outages": self.database_outages,
            "halts": self.halts,
            "not_durable": self.not_durable,
            "failovers": self.failovers,
            "outcomes": dict(sorted(self.outcomes.items())),
            "last_lag_seconds": self.last_lag_seconds,
        }


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = Metrics("pginbox_consumer", registry)
        self.consumed = m.counter("messages", "Messages consumed, by outcome", ["outcome"])
        self.redeliveries = m.counter("redeliveries", "Deliveries the broker marked as redelivered")
        self.dead_letters = m.counter("dead_letters", "Messages sent to the dead letter, by SQLSTATE", ["sqlstate"])
        self.handed_back = m.counter(
            "handed_back", "Messages handed back while the database was unavailable or the consumer halted"
        )
        self.reconnects = m.counter("broker_reconnects", "Broker connections opened again")
        self.halted = m.gauge("halted", "1 while the consumer is halted by a configuration or rights error")
        self.batch_size = m.histogram("batch_size", "Messages per batch", (1, 2, 5, 10, 20, 50, 64))
        self.lag = m.gauge("lag_seconds", "Age of the last message at its commit (produced_at)")
        self.not_durable = m.counter(
            "not_durable", "Batches handed back because the standbys did not confirm their commit in time"
        )
        self.failovers = m.counter("failovers", "Database failovers noticed (a new connection on a new WAL timeline)")


# What became of one delivery of a batch.
@dataclass(frozen=True)
class _DeadLetter:
    sqlstate: str
    reason: str


@dataclass(frozen=True)
class _Unavailable:
    error: BaseException


@dataclass(frozen=True)
class _Halt:
    error: BaseException


@dataclass(frozen=True)
class _Fenced:
    """The position store refused the batch (the partition was assigned again): it rolled back."""

    error: BaseException


_Verdict = Result | _DeadLetter | _Unavailable | _Halt | _Fenced


def _action(exc: BaseException) -> Action:
    if isinstance(exc, PoolTimeout | PoolClosed | RetriesExhausted | CommitOutcomeUnknown | NotDurable):
        return Action.RETRY
    if isinstance(exc, psycopg.Error):
        return action_for(exc)
    if isinstance(exc, RecursionError):
        return Action.DEAD_LETTER
    return Action.HALT  # a bug, not an outage: stop where it shows


def _one_line(exc: BaseException) -> str:
    """The error on one line: the server's primary message (its HINT and CONTEXT go elsewhere)."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if isinstance(exc, psycopg.Error) else None
    text = " ".join(str(primary or exc).split()) or type(exc).__name__
    state = getattr(exc, "sqlstate", None)
    return f"{text} [SQLSTATE {state}]" if state else text


def _fix(exc: BaseException) -> str:
    """What to fix, for the halt's log line: the server's HINT when it gave one."""
    diag = getattr(exc, "diag", None)
    hint = getattr(diag, "message_hint", None) if diag is not None else None
    if hint:
        return " ".join(str(hint).split())
    state = getattr(exc, "sqlstate", None)
    if state == "42883":
        return "the registered handler function is gone: register it again (inbox.register_handler)"
    if state is not None and state.startswith("42"):
        return "fix the deployment (consumer binding, handler registration, grants) for this consumer"
    return "see the error; every message would fail the same way"


class _PoolOptions(TypedDict):
    conninfo: str
    min_size: int
    max_size: int
    open: bool
    timeout: float
    kwargs: dict[str, Any]
    name: str


def _pool_options(c: Consumer) -> _PoolOptions:
    """A runner's pool (AsyncConnectionPool or ConnectionPool; the caller adds `configure`): one
    connection, opened by the runner, named after the consumer."""
    return _PoolOptions(
        conninfo=c.dsn,
        min_size=1,
        max_size=1,
        open=False,
        timeout=c.database_timeout,
        kwargs={"application_name": f"pginbox-consume:{c.config.consumer}"},
        name=f"pginbox-consume-{c.config.consumer}",
    )


class _InboxOptions(TypedDict):
    consumer: str
    handler_version: str
    retry: RetryPolicy
    batch_size: int
    durability: Durability


def _inbox_options(c: Consumer) -> _InboxOptions:
    """A runner's AsyncInbox or Inbox, from the consume settings."""
    return _InboxOptions(
        consumer=c.config.consumer,
        handler_version=c.config.handler_version,
        retry=c.retry,
        batch_size=c.config.prefetch,
        durability=c.config.durability,
    )


class _AsyncRunner:
    """SQL handlers and async Python handlers: AsyncInbox on the consumer's event loop."""

    def __init__(self, consumer: Consumer, handler: AsyncHandler | None) -> None:
        self.consumer = consumer
        self.pool: AsyncConnectionPool[Any] = AsyncConnectionPool(configure=self._configure, **_pool_options(consumer))
        self.inbox = AsyncInbox(self.pool, **_inbox_options(consumer))
        self.handler = handler

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await self.consumer.timeline.aread(conn, durability=self.consumer.config.durability.mode)

    async def open(self) -> None:
        await self.pool.open(wait=False)

    async def close(self) -> None:
        await self.pool.close()

    async def call(self, messages: Sequence[Message], before_commit: BeforeCommit | None = None) -> list[Result]:
        if self.handler is None:
            if before_commit is not None:
                return await self.inbox.apply_batch(messages, before_commit=before_commit)
            if len(messages) == 1:
                return [await self.inbox.apply(messages[0])]
            return await self.inbox.apply_batch(messages)
        if before_commit is not None:
            return await self.inbox.handle_batch(messages, self.handler, before_commit=before_commit)
        if len(messages) == 1:
            return [await self.inbox.handle(messages[0], self.handler, raise_on_failure=False)]
        return await self.inbox.handle_batch(messages, self.handler)

    async def store(self, progress: Progress) -> None:
        """A position in a transaction of its own."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(progress.query, progress.params)


class _ThreadRunner:
    """Plain (def) Python handlers: pginbox.Inbox with a plain psycopg connection, in a thread."""

    def __init__(self, consumer: Consumer, handler: Handler) -> None:
        self.consumer = consumer
        self.pool: ConnectionPool[Any] = ConnectionPool(configure=self._configure, **_pool_options(consumer))
        self.inbox = Inbox(self.pool, **_inbox_options(consumer))
        self.handler = handler

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        self.consumer.timeline.read(conn, durability=self.consumer.config.durability.mode)

    async def open(self) -> None:
        self.pool.open(wait=False)

    async def close(self) -> None:
        await asyncio.to_thread(self.pool.close)

    def _call(self, messages: Sequence[Message], before_commit: BeforeCommit | None) -> list[Result]:
        if before_commit is not None:
            return self.inbox.handle_batch(messages, self.handler, before_commit=before_commit)
        if len(messages) == 1:
            return [self.inbox.handle(messages[0], self.handler, raise_on_failure=False)]
        return self.inbox.handle_batch(messages, self.handler)

    async def call(self, messages: Sequence[Message], before_commit: BeforeCommit | None = None) -> list[Result]:
        return await asyncio.to_thread(self._call, messages, before_commit)

    def _store(self, progress: Progress) -> None:
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(progress.query, progress.params)

    async def store(self, progress: Progress) -> None:
        """A position in a transaction of its own."""
        await asyncio.to_thread(self._store, progress)


class Consumer:
    """`pginbox consume`: run() until stop(). `handler`: None for SQL handlers (config.handler
    "sql", else it is loaded from config.handler), or a Python handler (cursor, message), async or
    not. `broker`: an inbound adapter [default: pginbox.brokers.make_broker(config.source)]."""

    def __init__(
        self,
        config: ConsumeConfig,
        dsn: str,
        *,
        handler: Handler | None = None,
        broker: Broker | None = None,
        retry: RetryPolicy | None = None,
        fetch_timeout: float = 0.5,
        max_pause: float = 10.0,
        stall_after: float = 30.0,
        database_timeout: float = 5.0,
        halt_recheck: float = 30.0,
    ) -> None:
        self.config = config
        self.dsn = dsn
        self.name = f"consume:{config.consumer}"
        if handler is None and config.handler != "sql":
            handler = load_handler(config.handler)
        self.handler = handler
        self.broker = broker if broker is not None else make_broker(config.source)
        #: the adapter stores its position with the claims (Kafka offsets)
        self.progress: ProgressStore | None = self.broker if isinstance(self.broker, ProgressStore) else None
        if self.progress is not None:
            self.progress.attach_database(dsn)
        self.retry = retry if retry is not None else RetryPolicy(max_attempts=3, max_delay=0.5, resolve_timeout=10.0)
        self.fetch_timeout = fetch_timeout
        self.max_pause = max_pause
        self.stall_after = stall_after
        self.database_timeout = database_timeout
        self.halt_recheck = halt_recheck
        self.stats = ConsumerStats()
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = _Metrics(self.registry)
        self.timeline = TimelineWatch(log, self._failover, consumer=config.consumer)
        self._stop = asyncio.Event()
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handed_back = HandedBack()
        self._db_failures = 0
        self._broker_failures = 0
        self._connected = False
        self._db_ok = True
        self._halted: dict[str, Any] | None = None
        self._last_loop: float | None = None
        self._rng = random.Random()

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Finish the batch in hand, then return from run(). Safe from a signal handler and from
        other threads."""
        self._stop_requested = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._stop.set)

    @property
    def halted(self) -> dict[str, Any] | None:
        """Why the consumer halts (sqlstate, error, fix, since), or None while it runs."""
        return self._halted

    def health(self) -> tuple[bool, dict[str, Any]]:
        last = self._last_loop
        age = None if last is None else time.monotonic() - last
        # a halted consumer sleeps up to halt_recheck between its checks: not a stall
        stall = self.stall_after + (self.halt_recheck if self._halted else 0.0)
        healthy = (
            self._connected
            and self._db_ok
            and self._halted is None
            and age is not None
            and age <= stall
            and not self._stop_requested
        )
        return healthy, {
            "healthy": healthy,
            "consumer": self.config.consumer,
            "broker": self.config.broker,
            "source": self.config.source_name,
            "broker_connected": self._connected,
            "database_ok": self._db_ok,
            "halted": self._halted,
            "last_loop_age_seconds": None if age is None else round(age, 3),
            "counters": self.stats.as_dict(),
        }

    def _failover(self) -> None:
        self.stats.failovers += 1
        self.metrics.failovers.inc()

    def _backoff(self, failures: int, base: float = 0.1) -> float:
        return jittered(failures, base, self.max_pause, self._rng)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._stop_requested:
            self._stop.set()
        handler = self.handler
        runner: _AsyncRunner | _ThreadRunner = (
            _AsyncRunner(self, cast(AsyncHandler | None, handler))
            if handler is None or is_async_handler(handler)
            else _ThreadRunner(self, handler)
        )
        await runner.open()
        try:
            while not self._stop.is_set():
                self._last_loop = time.monotonic()
                if not self._connected and not await self._connect():
                    continue
                try:
                    try:
                        deliveries = await self.broker.fetch(self.config.prefetch, self.fetch_timeout)
                    except psycopg.Error as exc:  # an adapter that reads its position from the database
                        await self._position_unavailable(exc)
                        continue
                    if deliveries:
                        await self._process(runner, deliveries)
                except BrokerError as exc:
                    self._connected = False
                    self._broker_failures += 1
                    log.warning(kv("broker_lost", consumer=self.config.consumer, error=str(exc)))
                    with contextlib.suppress(Exception):
                        await self.broker.close()
                    await self._sleep(self._backoff(self._broker_failures))
        finally:
            with contextlib.suppress(Exception):
                await self.broker.close()
            self._connected = False
            await runner.close()
            log.info(
                kv(
                    "consumer_stopped",
                    consumer=self.config.consumer,
                    **{k: v for k, v in self.stats.as_dict().items() if k != "outcomes"},
                )
            )

    async def _connect(self) -> bool:
        try:
            await self.broker.connect()
        except BrokerError as exc:
            self._broker_failures += 1
            delay = self._backoff(self._broker_failures)
            log.warning(
                kv(
                    "broker_connect_failed",
                    consumer=self.config.consumer,
                    attempt=self._broker_failures,
                    retry_in=round(delay, 3),
                    error=str(exc),
                )
            )
            await self._sleep(delay)
            return False
        if self._broker_failures or self.stats.batches:
            self.stats.broker_reconnects += 1
            self.metrics.reconnects.inc()
        self._broker_failures = 0
        self._connected = True
        log.info(
            kv(
                "broker_connected",
                consumer=self.config.consumer,
                broker=self.config.broker,
                source=self.config.source_name,
            )
        )
        return True

    # ------------------------------------------------------------------ one batch

    async def _process(self, runner: _AsyncRunner | _ThreadRunner, deliveries: list[Delivery]) -> None:
        self.stats.batches += 1
        self.stats.consumed += len(deliveries)
        self.metrics.batch_size.observe(len(deliveries))
        good: list[Delivery] = []
        verdicts: list[tuple[Delivery, _Verdict]] = []
        for d in deliveries:
            if d.redelivered:
                self.stats.redeliveries += 1
                self.metrics.redeliveries.inc()
            try:
                d.message = self._handed_back.announce(parse_message(d, self.config.sources))
            except BadInput as bad:
                verdicts.append((d, _DeadLetter(bad.sqlstate, bad.reason)))
                continue
            good.append(d)
        if good:
            verdicts.extend(await self._decide(runner, good))
        await self._tell_broker(verdicts)
        if self.progress is not None:
            await self._store_pending(runner, self.progress)

    async def _store_pending(self, runner: _AsyncRunner | _ThreadRunner, store: ProgressStore) -> None:
        """The position settled outside the batch's transactions (dead letters, quarantines of
        record_start), in a transaction of its own. Failing here loses nothing: the position
        stays behind, and what is read again answers duplicate (or is dead-lettered again)."""
        pending = store.pending_progress()
        if pending is None:
            return
        try:
            await runner.store(pending)
        except Exception as exc:
            if getattr(exc, "sqlstate", None) == FENCED:
                await store.fenced([])
            else:
                log.warning(kv("progress_not_stored", consumer=self.config.consumer, error=_one_line(exc)))
            return
        store.progress_committed(pending)

    async def _decide(
        self, runner: _AsyncRunner | _ThreadRunner, batch: list[Delivery]
    ) -> list[tuple[Delivery, _Verdict]]:
        """The batch in one transaction; a batch the database refuses (bad input, or a halting
        error of one message) is split in halves until each refusal is alone, so that the good
        messages are applied."""
        self.stats.transactions += 1
        store = self.progress
        stored: list[Progress] = []
        hook: BeforeCommit | None = None
        if store is not None:

            def hook(start: int, results: Sequence[Result]) -> tuple[Any, Any] | None:
                progress = store.progress(batch[start : start + len(results)], [r.ack for r in results])
                stored[:] = [] if progress is None else [progress]
                return None if progress is None else (progress.query, progress.params)

        try:
            results = await runner.call([d.message for d in batch if d.message is not None], hook)
        except Exception as exc:
            if store is not None and getattr(exc, "sqlstate", None) == FENCED:
                return [(d, _Fenced(exc)) for d in batch]
            action = _action(exc)
            if action is Action.RETRY:
                return [(d, _Unavailable(exc)) for d in batch]
            if len(batch) == 1:
                if action is Action.DEAD_LETTER:
                    state = getattr(exc, "sqlstate", None) or ("54001" if isinstance(exc, RecursionError) else "22000")
                    return [(batch[0], _DeadLetter(state, _one_line(exc)))]
                return [(batch[0], _Halt(exc))]
            half = len(batch) // 2
            first = await self._decide(runner, batch[:half])
            if any(isinstance(v, _Unavailable) for _, v in first):  # the database went away meanwhile
                return first + [(d, _Unavailable(exc)) for d in batch[half:]]
            return first + await self._decide(runner, batch[half:])
        if store is not None and stored:
            store.progress_committed(stored[0])
        return list(zip(batch, results, strict=True))

    async def _tell_broker(self, verdicts: list[tuple[Delivery, _Verdict]]) -> None:
        """The broker actions, after the COMMITs that decided them: acks (in one call), retries,
        dead letters; then what could not be decided is handed back (outage, halt)."""
        acks: list[Delivery] = []
        unavailable: list[tuple[Delivery, _Unavailable]] = []
        halts: list[tuple[Delivery, _Halt]] = []
        fenced: list[tuple[Delivery, _Fenced]] = []
        now = datetime.datetime.now(datetime.UTC)
        decided = False
        for d, verdict in verdicts:
            if isinstance(verdict, Result):
                decided = True
                if self._count(d, verdict):
                    acks.append(d)
                else:
                    await self._retry(d, verdict)
                if d.message is not None and d.message.produced_at is not None:
                    lag = max(0.0, (now - d.message.produced_at).total_seconds())
                    self.stats.last_lag_seconds = round(lag, 6)
                    self.metrics.lag.set(lag)
            elif isinstance(verdict, _DeadLetter):
                await self._dead_letter(d, verdict.sqlstate, verdict.reason)
            elif isinstance(verdict, _Unavailable):
                unavailable.append((d, verdict))
            elif isinstance(verdict, _Fenced):
                fenced.append((d, verdict))
            else:
                halts.append((d, verdict))
        if decided:
            self._db_failures = 0
            self._db_ok = True
            self.timeline.ok()
        await self.broker.ack_many(acks)
        if fenced and self.progress is not None:
            log.warning(
                kv(
                    "partition_fenced",
                    consumer=self.config.consumer,
                    rolled_back=len(fenced),
                    error=_one_line(fenced[0][1].error),
                )
            )
            await self.progress.fenced([d for d, _ in fenced])
        if unavailable:  # a halt found before the database went away is handed back with the rest
            await self._database_unavailable(unavailable + [(d, _Unavailable(h.error)) for d, h in halts])
        elif halts:
            await self._halt(halts)
        elif decided and self._halted is not None:
            log.warning(kv("consumer_resumed", consumer=self.config.consumer, after=self._halted["sqlstate"]))
            self._halted = None
            self.metrics.halted.set(0)

    def _count(self, d: Delivery, result: Result) -> bool:
        """Counts and logs one result; True when it is acked."""
        outcome = result.outcome.value
        self.stats.outcomes[outcome] = self.stats.outcomes.get(outcome, 0) + 1
        self.metrics.consumed.labels(outcome).inc()
        m = d.message
        event = _LOGGED.get(result.outcome)
        if event is not None and m is not None:
            log.warning(
                kv(
                    event,
                    consumer=self.config.consumer,
                    tenant=m.tenant,
                    producer=m.producer,
                    message_id=m.message_id,
                    message_type=m.message_type,
                    quarantine_id=result.quarantine_id,
                    reason=result.reason_code,
                    redelivered=d.redelivered,
                )
            )
        elif result.outcome is not Outcome.APPLIED and log.isEnabledFor(logging.DEBUG):
            log.debug(
                kv(
                    "message_outcome",
                    consumer=self.config.consumer,
                    outcome=outcome,
                    message_id=m and m.message_id,
                    redelivered=d.redelivered,
                )
            )
        return result.ack

    async def _retry(self, d: Delivery, result: Result) -> None:
        delay = retry_delay(result.attempts, self.config.retry_delay, self.config.max_retry_delay)
        self.stats.retried += 1
        self._handed_back.remember(d.message)
        log.info(
            kv(
                "message_failed",
                consumer=self.config.consumer,
                message_id=d.message and d.message.message_id,
                attempts=result.attempts,
                reason=result.reason_code,
                retry_in=delay,
            )
        )
        await self.broker.retry(d, delay)

    async def _dead_letter(self, d: Delivery, sqlstate: str, reason: str) -> None:
        self.stats.dead_letters += 1
        self.metrics.dead_letters.labels(sqlstate).inc()
        self.stats.outcomes["dead_letter"] = self.stats.outcomes.get("dead_letter", 0) + 1
        m = d.message
        log.warning(
            kv(
                "dead_letter",
                consumer=self.config.consumer,
                sqlstate=sqlstate,
                reason=reason[:300],
                producer=m and m.producer,
                message_id=m and m.message_id,
                target=self.config.dead_letter_target,
            )
        )
        await self.broker.dead_letter(d, sqlstate, reason[:1000])

    async def _hand_back(self, deliveries: Sequence[Delivery], delay: float) -> None:
        for d in deliveries:
            self._handed_back.remember(d.message)
            self.stats.handed_back += 1
            self.metrics.handed_back.inc()
            await self.broker.hand_back(d, delay)

    async def _database_unavailable(self, batch: list[tuple[Delivery, _Unavailable]]) -> None:
        self._db_failures += 1
        self._db_ok = False
        if self._db_failures == 1:
            self.stats.database_outages += 1
        pause = self._backoff(self._db_failures, base=0.2)
        not_durable = isinstance(batch[0][1].error, NotDurable)
        if not_durable:
            self.stats.not_durable += 1
            self.metrics.not_durable.inc()
        log.warning(
            kv(
                "commit_not_durable" if not_durable else "database_unavailable",
                consumer=self.config.consumer,
                attempt=self._db_failures,
                handed_back=len(batch),
                pause=round(pause, 3),
                error=_one_line(batch[0][1].error),
            )
        )
        await self._hand_back([d for d, _ in batch], pause)
        await self._sleep(pause)

    async def _position_unavailable(self, exc: psycopg.Error) -> None:
        """The adapter could not read its position (Kafka: inbox.kafka_acquire refused): a
        configuration or rights error halts, anything else pauses as a database outage."""
        if _action(exc) is Action.HALT:
            await self._halt([], exc)
            return
        self._db_failures += 1
        self._db_ok = False
        if self._db_failures == 1:
            self.stats.database_outages += 1
        pause = self._backoff(self._db_failures, base=0.2)
        log.warning(
            kv(
                "database_unavailable",
                consumer=self.config.consumer,
                attempt=self._db_failures,
                handed_back=0,
                pause=round(pause, 3),
                error=_one_line(exc),
            )
        )
        await self._sleep(pause)

    async def _halt(self, halts: list[tuple[Delivery, _Halt]], error: BaseException | None = None) -> None:
        """A configuration or rights error: hand the messages back, say what to fix, stop
        fetching for halt_recheck seconds, then try again."""
        if error is None:
            error = halts[0][1].error
        state = getattr(error, "sqlstate", None) or type(error).__name__
        if self._halted is None or self._halted["sqlstate"] != state:
            self.stats.halts += 1
        self._halted = {
            "sqlstate": state,
            "error": _one_line(error)[:1000],
            "fix": _fix(error)[:1000],
            "since": (self._halted or {}).get("since") or datetime.datetime.now(datetime.UTC).isoformat(),
            "messages": len(halts),
        }
        self.metrics.halted.set(1)
        m = halts[0][0].message if halts else None
        log.error(
            kv(
                "consumer_halted",
                consumer=self.config.consumer,
                sqlstate=state,
                error=self._halted["error"],
                fix=self._halted["fix"],
                producer=m and m.producer,
                message_id=m and m.message_id,
                tenant=m and m.tenant,
                held=len(halts),
                recheck_in=self.halt_recheck,
            )
        )
        await self._hand_back([d for d, _ in halts], self.halt_recheck)
        await self._sleep(self.halt_recheck)
