"""`Consumer`: broker deliveries -> `AsyncInbox` -> one verdict per message, told to the broker.

One transaction per batch (inbox.claim_and_apply_batch / AsyncInbox.handle_batch; a batch of one:
claim_and_apply / handle), then, after the COMMIT, per message:

  applied, duplicate, conflict,       ack
  quarantined, expired
  failed                              redelivered after a delay doubling with the attempts
                                      (retry_delay ... max_retry_delay), never at once
  bad input: no identity (22004),     to the dead letter, with the SQLSTATE and the reason in
  body not JSON (22P02), bad          headers (Pginbox-Sqlstate, Pginbox-Reason); a batch the
  produced_at (22007), class 22,      database refuses is split so that only the bad message goes
  42704 (no handler), 54000           there
  database unavailable                the client retries transient errors (RetryPolicy); then the
                                      batch is handed back to the broker, and the consumer pauses
                                      (growing, jittered) before it fetches again; these
                                      redeliveries are not announced as crashes

A delivery the broker marks as redelivered (AMQP `redelivered`, quorum queues' x-delivery-count,
JetStream num_delivered > 1) that this process did not hand back itself is announced with
inbox.record_start first, so that a message that crashes its consumer every time ends in quarantine.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib
import inspect
import json
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from pginbox.client.async_inbox import AsyncHandler, AsyncInbox
from pginbox.client.outcomes import Message, Outcome, Result
from pginbox.client.retry import RetryPolicy, classify
from pginbox.consumer.config import ConsumeConfig, IdentitySource
from pginbox.dispatcher.log import kv
from pginbox.errors import BrokerError, CommitOutcomeUnknown, ConsumerConfigError, RetriesExhausted

__all__ = ["BadInput", "Broker", "Consumer", "ConsumerStats", "Delivery", "load_handler", "retry_delay"]

import logging

log = logging.getLogger("pginbox.consumer")

#: SQLSTATEs that say the message itself is bad: retrying it can never succeed.
BAD_INPUT_STATES = frozenset({"42704", "54000"})

SQLSTATE_HEADER = "Pginbox-Sqlstate"
REASON_HEADER = "Pginbox-Reason"


def is_bad_input(sqlstate: str | None) -> bool:
    return sqlstate is not None and (sqlstate.startswith("22") or sqlstate in BAD_INPUT_STATES)


@dataclass
class Delivery:
    """One message as the broker delivered it. `raw`: the broker library's message object."""

    body: bytes
    properties: Mapping[str, Any]
    headers: Mapping[str, Any]
    redelivered: bool
    raw: Any = None
    message: Message | None = None


class BadInput(Exception):
    """A message pginbox cannot process (no identity, body not JSON, ...): dead-lettered."""

    def __init__(self, sqlstate: str, reason: str) -> None:
        super().__init__(reason)
        self.sqlstate = sqlstate
        self.reason = reason


class Broker(Protocol):
    """What the consumer needs from a broker (pginbox.consumer.rabbitmq / .jetstream)."""

    name: str

    async def connect(self) -> None: ...
    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]: ...
    async def ack(self, delivery: Delivery) -> None: ...
    async def retry(self, delivery: Delivery, delay: float) -> None: ...
    async def dead_letter(self, delivery: Delivery, sqlstate: str, reason: str) -> None: ...
    async def hand_back(self, delivery: Delivery, delay: float) -> None: ...
    async def close(self) -> None: ...


def retry_delay(attempts: int | None, base: float, cap: float) -> float:
    """Delay before a FAILED message comes back: base, 2 x base, 4 x base ... up to cap."""
    n = max((attempts or 1) - 1, 0)
    return float(min(cap, base * 2.0 ** min(n, 40)))


def load_handler(spec: str) -> AsyncHandler:
    """`module:function` -> the handler(cursor, message); a plain function is awaited if it
    returns an awaitable."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ConsumerConfigError(f"consume setting handler={spec!r}: expected 'sql' or 'module:function'")
    try:
        found: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ConsumerConfigError(f"consume setting handler={spec!r}: {exc}") from None
    if not callable(found):
        raise ConsumerConfigError(f"consume setting handler={spec!r}: {attribute} is not callable")
    fn = found

    async def call(cur: psycopg.AsyncCursor[Any], message: Message) -> object:
        result = fn(cur, message)
        if inspect.isawaitable(result):
            result = await result
        return result

    return call


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = str(value)
    return text if text else None


def _timestamp(value: Any, source: IdentitySource) -> datetime.datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, datetime.datetime):
        return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
    if isinstance(value, int | float):
        return datetime.datetime.fromtimestamp(float(value), datetime.UTC)
    text = _text(value) or ""
    try:
        parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BadInput("22007", f"produced_at {text[:64]!r} (from {source.kind} {source.name}) is not an "
                                "ISO 8601 timestamp") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def parse_message(delivery: Delivery, sources: Mapping[str, IdentitySource]) -> Message:
    """The pginbox Message of a delivery, or BadInput."""

    def read(name: str) -> Any:
        source = sources[name]
        if source.kind == "const":
            return source.name
        if source.kind == "header":
            for key, value in delivery.headers.items():
                if key.lower() == source.name.lower():
                    return value
            return None
        return delivery.properties.get(source.name)

    values: dict[str, str] = {}
    for name in ("producer", "message_id", "message_type"):
        text = _text(read(name))
        if text is None:
            source = sources[name]
            where = source.name if source.kind == "property" else f"header {source.name}"
            raise BadInput("22004", f"the message has no {name} (read from {where})")
        values[name] = text
    try:
        payload = json.loads(delivery.body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput("22P02", f"the body is not JSON: {exc}") from None
    return Message(
        producer=values["producer"],
        message_id=values["message_id"],
        message_type=values["message_type"],
        payload=payload,
        tenant=_text(read("tenant")) or "",
        produced_at=_timestamp(read("produced_at"), sources["produced_at"]),
        redelivered=delivery.redelivered,
    )


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
    outcomes: dict[str, int] = field(default_factory=dict)
    last_lag_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed, "batches": self.batches, "transactions": self.transactions,
            "redeliveries": self.redeliveries, "dead_letters": self.dead_letters, "retried": self.retried,
            "handed_back": self.handed_back, "broker_reconnects": self.broker_reconnects,
            "database_outages": self.database_outages, "outcomes": dict(sorted(self.outcomes.items())),
            "last_lag_seconds": self.last_lag_seconds,
        }


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.consumed = Counter("pginbox_consumer_messages", "Messages consumed, by outcome", ["outcome"],
                                registry=registry)
        self.redeliveries = Counter("pginbox_consumer_redeliveries", "Deliveries the broker marked as redelivered",
                                    registry=registry)
        self.dead_letters = Counter("pginbox_consumer_dead_letters", "Messages sent to the dead letter, by SQLSTATE",
                                    ["sqlstate"], registry=registry)
        self.handed_back = Counter("pginbox_consumer_handed_back", "Messages handed back while the database "
                                   "was unavailable", registry=registry)
        self.reconnects = Counter("pginbox_consumer_broker_reconnects", "Broker connections opened again",
                                  registry=registry)
        self.batch_size = Histogram("pginbox_consumer_batch_size", "Messages per batch",
                                    buckets=(1, 2, 5, 10, 20, 50, 64), registry=registry)
        self.lag = Gauge("pginbox_consumer_lag_seconds", "Age of the last message at its commit (produced_at)",
                         registry=registry)


BrokerFactory = Callable[[ConsumeConfig], Broker]


def make_broker(config: ConsumeConfig) -> Broker:
    if config.broker == "rabbitmq":
        from pginbox.consumer.rabbitmq import RabbitMQBroker

        return RabbitMQBroker(config)
    from pginbox.consumer.jetstream import JetStreamBroker

    return JetStreamBroker(config)


class Consumer:
    """`pginbox consume`: run() until stop(). `handler`: None for SQL handlers (config.handler
    "sql"), else a Python handler (cursor, message)."""

    def __init__(
        self,
        config: ConsumeConfig,
        dsn: str,
        *,
        handler: AsyncHandler | None = None,
        broker: Broker | None = None,
        retry: RetryPolicy | None = None,
        fetch_timeout: float = 0.5,
        max_pause: float = 10.0,
        stall_after: float = 30.0,
        database_timeout: float = 5.0,
    ) -> None:
        self.config = config
        self.dsn = dsn
        self.name = f"consume:{config.consumer}"
        if handler is None and config.handler != "sql":
            handler = load_handler(config.handler)
        self.handler = handler
        self.broker = broker if broker is not None else make_broker(config)
        self.retry = retry if retry is not None else RetryPolicy(max_attempts=3, max_delay=0.5, resolve_timeout=10.0)
        self.fetch_timeout = fetch_timeout
        self.max_pause = max_pause
        self.stall_after = stall_after
        self.database_timeout = database_timeout
        self.stats = ConsumerStats()
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = _Metrics(self.registry)
        self._stop = asyncio.Event()
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handed_back: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._db_failures = 0
        self._broker_failures = 0
        self._connected = False
        self._db_ok = True
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

    def health(self) -> tuple[bool, dict[str, Any]]:
        last = self._last_loop
        age = None if last is None else time.monotonic() - last
        healthy = (self._connected and self._db_ok and age is not None and age <= self.stall_after
                   and not self._stop_requested)
        return healthy, {
            "healthy": healthy, "consumer": self.config.consumer, "broker": self.config.broker,
            "source": self.config.source_name, "broker_connected": self._connected, "database_ok": self._db_ok,
            "last_loop_age_seconds": None if age is None else round(age, 3), "counters": self.stats.as_dict(),
        }

    def _backoff(self, failures: int, base: float = 0.1) -> float:
        """Capped, jittered exponential backoff: base, 2 x base, ... up to max_pause (x 0.5..1)."""
        cap = min(self.max_pause, base * 2.0 ** min(max(failures - 1, 0), 20))
        return cap * self._rng.uniform(0.5, 1.0)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._stop_requested:
            self._stop.set()
        pool = AsyncConnectionPool(self.dsn, min_size=1, max_size=1, open=False, timeout=self.database_timeout,
                                   kwargs={"application_name": f"pginbox-consume:{self.config.consumer}"},
                                   name=f"pginbox-consume-{self.config.consumer}")
        await pool.open(wait=False)
        inbox = AsyncInbox(pool, consumer=self.config.consumer, handler_version=self.config.handler_version,
                           retry=self.retry, batch_size=self.config.prefetch)
        try:
            while not self._stop.is_set():
                self._last_loop = time.monotonic()
                if not self._connected and not await self._connect():
                    continue
                try:
                    deliveries = await self.broker.fetch(self.config.prefetch, self.fetch_timeout)
                    if deliveries:
                        await self._process(inbox, deliveries)
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
            await pool.close()
            log.info(kv("consumer_stopped", consumer=self.config.consumer, **{
                k: v for k, v in self.stats.as_dict().items() if k != "outcomes"}))

    async def _connect(self) -> bool:
        try:
            await self.broker.connect()
        except BrokerError as exc:
            self._broker_failures += 1
            delay = self._backoff(self._broker_failures)
            log.warning(kv("broker_connect_failed", consumer=self.config.consumer, attempt=self._broker_failures,
                           retry_in=round(delay, 3), error=str(exc)))
            await self._sleep(delay)
            return False
        if self._broker_failures or self.stats.batches:
            self.stats.broker_reconnects += 1
            self.metrics.reconnects.inc()
        self._broker_failures = 0
        self._connected = True
        log.info(kv("broker_connected", consumer=self.config.consumer, broker=self.config.broker,
                    source=self.config.source_name))
        return True

    # ------------------------------------------------------------------ one batch

    def _announce(self, message: Message) -> Message:
        """A redelivery this process handed back itself is not a crash: not announced."""
        key = (message.tenant, message.producer, message.message_id)
        if key in self._handed_back:
            del self._handed_back[key]
            if message.redelivered:
                return Message(message.producer, message.message_id, message.message_type, message.payload,
                               message.tenant, message.produced_at, False)
        return message

    async def _process(self, inbox: AsyncInbox, deliveries: list[Delivery]) -> None:
        self.stats.batches += 1
        self.stats.consumed += len(deliveries)
        self.metrics.batch_size.observe(len(deliveries))
        good: list[Delivery] = []
        for d in deliveries:
            if d.redelivered:
                self.stats.redeliveries += 1
                self.metrics.redeliveries.inc()
            try:
                d.message = self._announce(parse_message(d, self.config.sources))
            except BadInput as bad:
                await self._dead_letter(d, bad.sqlstate, bad.reason)
                continue
            good.append(d)
        if good:
            await self._apply(inbox, good)

    async def _apply(self, inbox: AsyncInbox, batch: list[Delivery]) -> None:
        messages = [d.message for d in batch if d.message is not None]
        try:
            results = await self._call(inbox, messages)
        except psycopg.Error as exc:
            if classify(exc) is None and is_bad_input(exc.sqlstate):
                if len(batch) == 1:
                    await self._dead_letter(batch[0], exc.sqlstate or "", _one_line(exc))
                    return
                for d in batch:  # split: only the bad message goes to the dead letter
                    await self._apply(inbox, [d])
                return
            await self._database_unavailable(batch, exc)
            return
        except (PoolTimeout, PoolClosed, RetriesExhausted, CommitOutcomeUnknown) as exc:
            await self._database_unavailable(batch, exc)
            return
        self._db_failures = 0
        self._db_ok = True
        now = datetime.datetime.now(datetime.UTC)
        for d, result in zip(batch, results, strict=True):
            await self._verdict(d, result)
            if d.message is not None and d.message.produced_at is not None:
                lag = max(0.0, (now - d.message.produced_at).total_seconds())
                self.stats.last_lag_seconds = round(lag, 6)
                self.metrics.lag.set(lag)

    async def _call(self, inbox: AsyncInbox, messages: Sequence[Message]) -> list[Result]:
        self.stats.transactions += 1
        if self.handler is None:
            if len(messages) == 1:
                return [await inbox.apply(messages[0])]
            return await inbox.apply_batch(messages)
        if len(messages) == 1:
            return [await inbox.handle(messages[0], self.handler, raise_on_failure=False)]
        return await inbox.handle_batch(messages, self.handler)

    async def _verdict(self, d: Delivery, result: Result) -> None:
        outcome = result.outcome.value
        self.stats.outcomes[outcome] = self.stats.outcomes.get(outcome, 0) + 1
        self.metrics.consumed.labels(outcome).inc()
        if result.ack:
            await self.broker.ack(d)
            return
        assert result.outcome is Outcome.FAILED
        delay = retry_delay(result.attempts, self.config.retry_delay, self.config.max_retry_delay)
        self.stats.retried += 1
        self._remember(d)
        log.info(kv("message_failed", consumer=self.config.consumer, message_id=d.message and d.message.message_id,
                    attempts=result.attempts, reason=result.reason_code, retry_in=delay))
        await self.broker.retry(d, delay)

    def _remember(self, d: Delivery) -> None:
        if d.message is None:
            return
        self._handed_back[(d.message.tenant, d.message.producer, d.message.message_id)] = None
        while len(self._handed_back) > 100_000:
            self._handed_back.popitem(last=False)

    async def _dead_letter(self, d: Delivery, sqlstate: str, reason: str) -> None:
        self.stats.dead_letters += 1
        self.metrics.dead_letters.labels(sqlstate).inc()
        self.stats.outcomes["dead_letter"] = self.stats.outcomes.get("dead_letter", 0) + 1
        log.warning(kv("dead_letter", consumer=self.config.consumer, sqlstate=sqlstate, reason=reason,
                       target=self.config.dead_letter_target))
        await self.broker.dead_letter(d, sqlstate, reason[:1000])

    async def _database_unavailable(self, batch: list[Delivery], exc: BaseException) -> None:
        self._db_failures += 1
        self._db_ok = False
        if self._db_failures == 1:
            self.stats.database_outages += 1
        pause = self._backoff(self._db_failures, base=0.2)
        log.warning(kv("database_unavailable", consumer=self.config.consumer, attempt=self._db_failures,
                       handed_back=len(batch), pause=round(pause, 3), error=_one_line(exc)))
        for d in batch:
            self._remember(d)
            self.stats.handed_back += 1
            self.metrics.handed_back.inc()
            await self.broker.hand_back(d, pause)
        await self._sleep(pause)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    state = getattr(exc, "sqlstate", None)
    return f"{text} [SQLSTATE {state}]" if state else text


AwaitableFactory = Callable[[], Awaitable[None]]
