"""Kafka adapter (aiokafka, extra `pginbox[kafka]`): `KafkaBroker` for `pginbox consume`, with its
offsets stored in the database, and `KafkaTransport` (a BrokerDestination over `KafkaPublisher`)
for the dispatcher. docs/kafka.md has the protocol and why it is safe.

Consuming (KafkaBroker, a ProgressStore of the port): a consumer group (`durable`, default: the
consumer name) on one topic, broker auto-commit off.
  assignment   inbox.kafka_acquire advances each partition's owner generation and returns the
               stored next offset: the consumer seeks there (no stored offset: the group's
               committed offset, else offset_reset). A partition whose previous owner never
               released it (a crash) has its first `prefetch` records marked redelivered: the
               consumer announces them (inbox.record_start), so a record that kills every
               consumer ends in quarantine.
  progress     the batch's transaction stores, per partition, the offset after the last record
               settled without a gap (inbox.kafka_store_offsets, under the generation that read
               it): a failed record holds its partition's offset, later ones come back as
               duplicates. A partition assigned elsewhere meanwhile fails the store (IRK01): the
               whole transaction rolls back, and the adapter acquires the partition again.
  ack          nothing to tell Kafka per record; the stored offsets are committed to the group
               after COMMIT, about once a second, as a hint for lag tools (never read back)
  retry        the partition is paused and sought back to the failed record; it resumes after the
               delay (other partitions go on: a bounded head-of-line wait for this one only)
  dead letter  the record, its headers, Pginbox-Sqlstate, Pginbox-Reason and Pginbox-Original
               (topic:partition:offset) to the dead-letter topic (acks=all, awaited), then settled
  hand back    like retry, after the pause
  revocation   released when nothing of the partition is in flight (inbox.kafka_release)

Publishing (KafkaPublisher): one record per effect, the ordering key as the record key (one key,
one partition: the dispatcher's order is kept), the identity in Pginbox-* headers, acks=all; a
batch is sent at once and its delivery reports awaited together. No idempotent producer (some
brokers refuse InitProducerId, Tansu among them): a resend after a timeout can duplicate a record,
which the consumer downstream answers `duplicate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg

from pginbox.brokers.port import Delivery, Outgoing, Progress, SourceConfig
from pginbox.brokers.publish import BrokerDestination
from pginbox.brokers.wire import dead_letter_headers, identity_headers
from pginbox.errors import BrokerError
from pginbox.runtime.log import kv
from pginbox.transports.protocol import DeliveryReport

try:
    import aiokafka  # type: ignore[import-untyped]
    import aiokafka.errors  # type: ignore[import-untyped]
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise BrokerError("Kafka support needs aiokafka: pip install 'pginbox[kafka]'") from exc

__all__ = ["KafkaBroker", "KafkaPublisher", "KafkaTransport", "bootstrap_servers"]

log = logging.getLogger("pginbox.consumer")

_ERRORS = (aiokafka.errors.KafkaError, OSError, asyncio.TimeoutError)

_ACQUIRE = (
    "SELECT topic, partition_id, generation, next_offset, was_released "
    "FROM inbox.kafka_acquire(%s, %s::text[], %s::integer[], %s)"
)
_STORE = "SELECT inbox.kafka_store_offsets(%s, %s::text[], %s::integer[], %s::bigint[], %s::bigint[])"
_RELEASE = "SELECT inbox.kafka_release(%s, %s::text[], %s::integer[], %s::bigint[])"
#: Kafka's timestamp types
_LOG_APPEND_TIME = 1


def bootstrap_servers(url: str) -> str:
    """kafka://host:port[,host:port]/ -> host:port[,host:port]."""
    rest = url.partition("://")[2] if "://" in url else url
    servers = rest.split("/", 1)[0].split("?", 1)[0]
    if not servers:
        raise BrokerError(f"Kafka url {url!r}: expected kafka://host:port[,host:port]")
    return servers


def _millis(ms: int | None) -> datetime.datetime | None:
    if ms is None or ms < 0:
        return None
    try:
        return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return datetime.datetime.max.replace(tzinfo=datetime.UTC)


class _Partition:
    """What the adapter knows of one partition it owns."""

    def __init__(self, generation: int, stored: int | None, suspect: int) -> None:
        self.generation = generation
        self.stored = stored  # the next offset the database holds (None: never stored)
        self.suspect = suspect  # records still to mark redelivered (the previous owner crashed)
        self.fetched: list[int] = []  # offsets read and not yet below the stored offset, in order
        self.settled: set[int] = set()
        self.resume_at: float | None = None  # paused for a retry or a hand-back until then
        self.seek_to: int | None = None

    def frontier(self, also: set[int] | frozenset[int] = frozenset()) -> int | None:
        """The offset after the last record settled without a gap (None: nothing fetched)."""
        nxt = None
        for offset in self.fetched:
            if offset in self.settled or offset in also:
                nxt = offset + 1
            else:
                break
        return nxt


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, broker: KafkaBroker) -> None:
        self.broker = broker

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.broker._revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        await self.broker._assigned(list(assigned))


class KafkaBroker:
    """The inbound adapter (see the module docstring)."""

    name = "kafka"

    def __init__(self, config: SourceConfig, *, hint_interval: float = 1.0, connect_timeout: float = 10.0) -> None:
        if not config.stream:
            raise BrokerError("the Kafka adapter needs a topic")
        self.config = config
        self.topic = config.stream
        self.group = config.durable or config.consumer
        self.bootstrap = bootstrap_servers(config.url)
        self.member = str(
            config.options.get("consumer_name") or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.offset_reset = str(config.options.get("offset_reset", "earliest"))
        self.hint_interval = hint_interval
        self.connect_timeout = connect_timeout
        self._dsn: str | None = None
        self._db: psycopg.AsyncConnection[Any] | None = None
        self._db_lock = asyncio.Lock()
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._owned: dict[TopicPartition, _Partition] = {}
        self._unacquired: set[TopicPartition] = set()
        self._acquire_error: BaseException | None = None
        self._next_hint = 0.0
        self._hint_dirty = False
        self._hint_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the database side

    def attach_database(self, dsn: str) -> None:
        self._dsn = dsn

    async def _execute(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        if self._dsn is None:
            raise BrokerError("the Kafka adapter stores offsets in the database: attach_database(dsn) first")
        async with self._db_lock:
            for attempt in (1, 2):
                if self._db is None or self._db.closed:
                    self._db = await psycopg.AsyncConnection.connect(
                        self._dsn,
                        autocommit=True,
                        connect_timeout=5,
                        application_name=f"pginbox-consume-kafka:{self.config.consumer}",
                    )
                try:
                    cur = await self._db.execute(query, params)
                    return await cur.fetchall() if cur.description else []
                except psycopg.OperationalError:
                    with contextlib.suppress(Exception):
                        await self._db.close()
                    self._db = None
                    if attempt == 2:
                        raise
            raise AssertionError("unreachable")

    async def _acquire(self, tps: Sequence[TopicPartition]) -> None:
        if not tps:
            return
        consumer = self._consumer
        try:
            rows = await self._execute(
                _ACQUIRE,
                (self.config.consumer, [tp.topic for tp in tps], [tp.partition for tp in tps], self.member),
            )
        except Exception as exc:
            # Not acquired: not read. Paused, and acquired again before each fetch (which raises
            # a permanent error: the consumer halts and says what to fix).
            self._acquire_error = exc
            self._unacquired.update(tps)
            if consumer is not None:
                with contextlib.suppress(Exception):
                    consumer.pause(*tps)
            log.warning(
                kv(
                    "partitions_not_acquired",
                    consumer=self.config.consumer,
                    topic=self.topic,
                    partitions=",".join(str(tp.partition) for tp in tps),
                    error=" ".join(str(exc).split()),
                )
            )
            return
        self._acquire_error = None
        for topic, partition, generation, next_offset, was_released in rows:
            tp = TopicPartition(topic, partition)
            self._unacquired.discard(tp)
            self._owned[tp] = _Partition(int(generation), next_offset, 0 if was_released else self.config.prefetch)
            if consumer is not None:
                with contextlib.suppress(Exception):
                    if next_offset is not None:
                        consumer.seek(tp, int(next_offset))
                    else:
                        # never stored: the group's committed offset, else offset_reset
                        committed = await consumer.committed(tp)
                        if committed is not None:
                            consumer.seek(tp, committed)
                        elif self.offset_reset == "latest":
                            await consumer.seek_to_end(tp)
                        else:
                            await consumer.seek_to_beginning(tp)
                    consumer.resume(tp)
            log.info(
                kv(
                    "partition_acquired",
                    consumer=self.config.consumer,
                    topic=topic,
                    partition=partition,
                    generation=generation,
                    next_offset=next_offset,
                    crashed_owner=not was_released,
                )
            )

    async def _assigned(self, assigned: list[TopicPartition]) -> None:
        await self._acquire(sorted(assigned))

    async def _revoked(self, revoked: list[TopicPartition]) -> None:
        await self._release([tp for tp in revoked if tp in self._owned])
        for tp in revoked:
            self._owned.pop(tp, None)
            self._unacquired.discard(tp)

    async def _release(self, tps: Sequence[TopicPartition]) -> None:
        """Release the partitions with nothing in flight (a partition with unsettled records stays
        held: its next owner marks them redelivered)."""
        # nothing read and not stored (progress_committed drops what the database holds)
        clean = [tp for tp in tps if tp in self._owned and not self._owned[tp].fetched]
        if not clean:
            return
        with contextlib.suppress(Exception):
            await self._execute(
                _RELEASE,
                (
                    self.config.consumer,
                    [tp.topic for tp in clean],
                    [tp.partition for tp in clean],
                    [self._owned[tp].generation for tp in clean],
                ),
            )

    # ------------------------------------------------------------------ ProgressStore

    def _progress(self, also: dict[TopicPartition, set[int]]) -> Progress | None:
        positions: dict[Any, tuple[int, int]] = {}
        for tp, part in self._owned.items():
            nxt = part.frontier(also.get(tp, set()))
            if nxt is not None and nxt != part.stored:
                positions[tp] = (nxt, part.generation)
        if not positions:
            return None
        tps = sorted(positions)
        return Progress(
            _STORE,
            (
                self.config.consumer,
                [tp.topic for tp in tps],
                [tp.partition for tp in tps],
                [positions[tp][0] for tp in tps],
                [positions[tp][1] for tp in tps],
            ),
            positions,
        )

    def progress(self, deliveries: Sequence[Delivery], acked: Sequence[bool]) -> Progress | None:
        also: dict[TopicPartition, set[int]] = {}
        for d, ack in zip(deliveries, acked, strict=True):
            tp, offset, generation = d.raw
            part = self._owned.get(tp)
            if ack and part is not None and part.generation == generation:
                also.setdefault(tp, set()).add(offset)
        return self._progress(also)

    def progress_committed(self, progress: Progress) -> None:
        for tp, (offset, generation) in progress.positions.items():
            part = self._owned.get(tp)
            if part is None or part.generation != generation:
                continue
            part.stored = offset
            part.fetched = [o for o in part.fetched if o >= offset]
            part.settled = {o for o in part.settled if o >= offset}
            self._hint_dirty = True
        if self._hint_dirty and (self._hint_task is None or self._hint_task.done()):
            with contextlib.suppress(RuntimeError):  # no running loop: the next fetch commits it
                self._hint_task = asyncio.get_running_loop().create_task(self._hint_loop())

    def pending_progress(self) -> Progress | None:
        return self._progress({})

    async def fenced(self, deliveries: Sequence[Delivery]) -> None:
        """Acquire again what the broker still assigns us (a reset by an operator, or a rebalance
        whose revocation has not reached us yet: then the new owner is fenced in turn, until the
        group settles); what it no longer assigns is dropped."""
        consumer = self._consumer
        if consumer is None:
            return
        # every partition held: a reset or a rebalance rarely comes alone
        tps = {d.raw[0] for d in deliveries} | set(self._owned)
        assigned = consumer.assignment()
        for tp in tps:
            self._owned.pop(tp, None)
        await self._acquire(sorted(tp for tp in tps if tp in assigned))

    # ------------------------------------------------------------------ Broker

    async def connect(self) -> None:
        await self.close()
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.group,
            client_id=f"pginbox-{self.member}",
            enable_auto_commit=False,
            auto_offset_reset=self.offset_reset,
            max_poll_records=self.config.prefetch,
            request_timeout_ms=int(self.connect_timeout * 1000) + 30000,
        )
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, acks="all", client_id=f"pginbox-dead-letter-{self.member}"
        )
        try:
            await asyncio.wait_for(consumer.start(), self.connect_timeout)
            await asyncio.wait_for(producer.start(), self.connect_timeout)
            consumer.subscribe(topics=[self.topic], listener=_Listener(self))
        except (*_ERRORS, ValueError) as exc:
            with contextlib.suppress(Exception):
                await consumer.stop()
            with contextlib.suppress(Exception):
                await producer.stop()
            raise BrokerError(f"Kafka {self.bootstrap} topic {self.topic!r}: {type(exc).__name__}: {exc}") from exc
        self._consumer = consumer
        self._producer = producer

    def _client(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise BrokerError(f"Kafka {self.bootstrap}: not connected")
        return self._consumer

    def _delivery(self, record: Any, tp: TopicPartition, part: _Partition) -> Delivery:
        append = record.timestamp_type == _LOG_APPEND_TIME
        redelivered = part.suspect > 0
        if redelivered:
            part.suspect -= 1
        headers = {str(k): v for k, v in (record.headers or ())}
        return Delivery(
            record.value if record.value is not None else b"",
            {
                "topic": tp.topic,
                "partition": tp.partition,
                "offset": record.offset,
                "key": record.key,
                "create_time": None if append else _millis(record.timestamp),
                "log_append_time": _millis(record.timestamp) if append else None,
                "position": f"{tp.topic}:{tp.partition}:{record.offset}",
            },
            headers,
            redelivered,
            (tp, record.offset, part.generation),
        )

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        consumer = self._client()
        try:
            if self._unacquired:
                await self._acquire(sorted(self._unacquired & consumer.assignment()))
                error = self._acquire_error
                if self._unacquired and isinstance(error, psycopg.Error):
                    self._acquire_error = None
                    raise error  # the consumer decides: halt (42501, 42704 ...) or a database pause
            now = time.monotonic()
            for tp, part in self._owned.items():
                if part.resume_at is not None and part.resume_at <= now:
                    if part.seek_to is not None:
                        consumer.seek(tp, part.seek_to)
                    part.resume_at = part.seek_to = None
                    consumer.resume(tp)
            await self._hint(now)
            batches = await consumer.getmany(timeout_ms=max(1, int(timeout * 1000)), max_records=max_messages)
        except (*_ERRORS, AssertionError) as exc:
            raise BrokerError(f"Kafka fetch failed: {type(exc).__name__}: {exc}") from exc
        out: list[Delivery] = []
        for tp, records in batches.items():
            owner = self._owned.get(tp)
            if owner is None or owner.resume_at is not None:
                continue  # not acquired (yet), or paused meanwhile: read again after the seek
            for record in records:
                if owner.fetched and record.offset <= owner.fetched[-1]:
                    continue
                owner.fetched.append(record.offset)
                if record.offset in owner.settled:
                    continue  # settled before a retry sought back past it (applied, dead-lettered)
                out.append(self._delivery(record, tp, owner))
        return out

    async def _hint(self, now: float) -> None:
        """The stored offsets committed to the group, for lag tools: a hint, never read back."""
        if not self._hint_dirty or now < self._next_hint or self._consumer is None:
            return
        self._next_hint = now + self.hint_interval
        self._hint_dirty = False
        offsets = {tp: part.stored for tp, part in self._owned.items() if part.stored is not None}
        if offsets:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._consumer.commit(offsets), 5.0)

    async def _hint_loop(self) -> None:
        """After a COMMIT: the hint, at most once per hint_interval (one task: commits in order)."""
        while self._hint_dirty and self._consumer is not None:
            delay = self._next_hint - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self._hint(time.monotonic())

    def _settle(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            tp, offset, generation = d.raw
            part = self._owned.get(tp)
            if part is not None and part.generation == generation:
                part.settled.add(offset)

    async def ack(self, delivery: Delivery) -> None:
        self._settle([delivery])

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        self._settle(deliveries)

    def _pause(self, delivery: Delivery, delay: float) -> None:
        """Seek the partition back to this record and pause it for `delay` (the earliest record
        wins when several of a partition come back)."""
        tp, offset, generation = delivery.raw
        part = self._owned.get(tp)
        if part is None or part.generation != generation:
            return  # no longer ours: the next owner reads it from the stored offset
        # what is settled after it stays settled: read again, it is skipped, not delivered again
        part.fetched = [o for o in part.fetched if o < offset]
        part.seek_to = offset if part.seek_to is None else min(part.seek_to, offset)
        due = time.monotonic() + delay
        part.resume_at = due if part.resume_at is None else max(part.resume_at, due)
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                self._consumer.pause(tp)

    async def retry(self, delivery: Delivery, delay: float) -> None:
        self._pause(delivery, delay)

    async def hand_back(self, delivery: Delivery, delay: float) -> None:
        self._pause(delivery, delay)

    async def dead_letter(self, delivery: Delivery, sqlstate: str, reason: str) -> None:
        producer = self._producer
        if producer is None:
            raise BrokerError(f"Kafka {self.bootstrap}: not connected")
        tp, offset, _ = delivery.raw
        headers = {
            **{k: v if isinstance(v, bytes) else str(v).encode() for k, v in delivery.headers.items()},
            **{
                k: v.encode()
                for k, v in dead_letter_headers(sqlstate, reason, f"{tp.topic}:{tp.partition}:{offset}").items()
            },
        }
        key = delivery.properties.get("key")
        try:
            future = await producer.send(
                self.config.dead_letter, value=delivery.body, key=key, headers=list(headers.items())
            )
            await asyncio.wait_for(future, 30.0)
        except _ERRORS as exc:
            raise BrokerError(f"Kafka dead letter to {self.config.dead_letter!r} failed: {exc}") from exc
        self._settle([delivery])

    async def close(self) -> None:
        task, self._hint_task = self._hint_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        consumer, self._consumer = self._consumer, None
        producer, self._producer = self._producer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await self._release(list(self._owned))
            offsets = {tp: part.stored for tp, part in self._owned.items() if part.stored is not None}
            if offsets:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(consumer.commit(offsets), 2.0)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), 5.0)
        if producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), 3.0)
        self._owned.clear()
        self._unacquired.clear()
        db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(Exception):
                await db.close()


class KafkaPublisher:
    """Outbound: one record per effect, acks=all, a batch's delivery reports awaited together."""

    name = "kafka"
    confirm = "acks=all delivery report"

    def __init__(self, url: str, *, topic: str, timeout: float = 10.0) -> None:
        if not topic:
            raise ValueError("a Kafka destination needs topic")
        self.url = url
        self.topic = topic
        self.timeout = timeout
        self._producer: AIOKafkaProducer | None = None

    async def _client(self) -> AIOKafkaProducer:
        if self._producer is None:
            # enable_idempotence stays off: brokers without InitProducerId (Tansu) refuse it; the
            # consumer downstream deduplicates on Pginbox-Message-Id.
            producer = AIOKafkaProducer(
                bootstrap_servers=bootstrap_servers(self.url),
                acks="all",
                request_timeout_ms=int(self.timeout * 1000),
                linger_ms=0,
            )
            await asyncio.wait_for(producer.start(), self.timeout)
            self._producer = producer
        return self._producer

    async def publish(self, messages: Sequence[Outgoing]) -> list[DeliveryReport]:
        try:
            producer = await self._client()
        except (*_ERRORS, ValueError) as exc:
            await self.close()
            return [
                DeliveryReport.failed(f"Kafka unreachable: {type(exc).__name__}: {exc}", retryable=True)
                for _ in messages
            ]
        futures: list[Any] = []
        for out in messages:
            headers = [(k, v.encode()) for k, v in identity_headers(out).items()]
            try:
                futures.append(
                    await producer.send(
                        self.topic,
                        value=out.body,
                        key=out.ordering_key.encode() if out.ordering_key else None,
                        headers=headers,
                        timestamp_ms=int(out.produced_at.timestamp() * 1000),
                    )
                )
            except _ERRORS as exc:
                futures.append(exc)
        reports: list[DeliveryReport] = []
        deadline = time.monotonic() + self.timeout
        for f in futures:
            if isinstance(f, BaseException):
                reports.append(DeliveryReport.failed(f"Kafka refused the record: {f}", retryable=True))
                continue
            try:
                await asyncio.wait_for(asyncio.shield(f), max(0.001, deadline - time.monotonic()))
                reports.append(DeliveryReport.ok())
            except TimeoutError:
                reports.append(
                    DeliveryReport.failed(f"ambiguous: no delivery report in {self.timeout} s", retryable=True)
                )
            except aiokafka.errors.KafkaError as exc:
                text = f"{type(exc).__name__}: {exc}"
                retriable = getattr(exc, "retriable", True)
                reports.append(
                    DeliveryReport.failed(
                        f"ambiguous: {text}" if retriable else f"Kafka refused the record: {text}", retryable=True
                    )
                )
        if any(not r.delivered for r in reports):
            await self.close()
        return reports

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), 5.0)


class KafkaTransport(BrokerDestination):
    """The dispatcher's Kafka destination (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        topic: str,
        producer: str = "pginbox",
        message_type: str | None = None,
        timeout: float = 10.0,
        destination: str = "",
    ) -> None:
        self.url = url
        self.topic = topic
        super().__init__(
            KafkaPublisher(url, topic=topic, timeout=timeout),
            producer=producer,
            message_type=message_type,
            timeout=timeout,
            destination=destination,
        )
