"""Real brokers for the broker tests: RabbitMQ (127.0.0.1:5672) and NATS JetStream (127.0.0.1:4222).

Every queue / stream is named uniquely by the test and deleted afterwards. The helpers are sync
(each runs its own short asyncio loop); `ConsumerThread` runs a pginbox Consumer on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import socket
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
from nats.js import api

from pginbox.consumer import Consumer

RABBIT_URL = os.environ.get("PGINBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("PGINBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
BROKERS = ("rabbitmq", "nats")


def reachable(url: str) -> bool:
    hostport = url.split("://", 1)[1].split("@")[-1].split("/")[0]
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def require(broker: str) -> None:
    url = NATS_URL if broker == "nats" else RABBIT_URL
    # The brokers are part of the test environment (the machine runs them on loopback; dev.sh
    # installs the servers): a broker test without its broker fails, it never passes by skipping.
    if not reachable(url):
        pytest.fail(f"{broker} is not reachable at {url}: start it, or point "
                    "PGINBOX_TEST_RABBITMQ_URL / PGINBOX_TEST_NATS_URL at it")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@dataclass
class Out:
    """A message to publish: identity fields become broker properties / headers like pginbox's
    own destinations write them (None leaves one out)."""

    message_id: str | None
    payload: Any
    message_type: str | None = "credit"
    producer: str | None = "orders"
    produced_at: str | None = None
    raw_body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    nats_msg_id: str | None = None  # Nats-Msg-Id when it must differ from message_id

    @property
    def body(self) -> bytes:
        return self.raw_body if self.raw_body is not None else json.dumps(self.payload).encode()


class Channel:
    """One queue or stream of a test: publish, count, read the dead letters, delete."""

    def __init__(self, broker: str) -> None:
        # "rabbitmq-quorum": a quorum queue (its redeliveries carry x-delivery-count)
        self.quorum = broker == "rabbitmq-quorum"
        broker = "rabbitmq" if self.quorum else broker
        self.broker = broker
        self.name = f"t_{uuid.uuid4().hex[:10]}"
        self.url = RABBIT_URL if broker == "rabbitmq" else NATS_URL
        self.stream = self.name.upper()
        self.subject = f"{self.name}.in"
        self.dead_subject = f"{self.name}.dead"
        self.dead_stream = f"{self.stream}_DEAD"
        if broker == "nats":
            run(self._nats_streams())

    # consume settings for this channel
    def settings(self) -> dict[str, Any]:
        if self.broker == "rabbitmq":
            return {"url": self.url, "queue": self.name}
        return {"url": self.url, "stream": self.stream, "subject": self.subject, "durable": self.name,
                "dead_letter": self.dead_subject}

    async def _nats_streams(self) -> None:
        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            await js.add_stream(name=self.stream, subjects=[self.subject], duplicate_window=120.0)
            await js.add_stream(name=self.dead_stream, subjects=[self.dead_subject])
        finally:
            await nc.close()

    def publish(self, messages: list[Out]) -> None:
        run(self._publish(messages))

    async def _publish(self, messages: list[Out]) -> None:
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel(publisher_confirms=True)
                await ch.declare_queue(self.name, durable=True,
                                       arguments={"x-queue-type": "quorum"} if self.quorum else None)
                for m in messages:
                    ts = None if m.produced_at is None else datetime.datetime.fromisoformat(m.produced_at)
                    await ch.default_exchange.publish(
                        aio_pika.Message(m.body, message_id=m.message_id, type=m.message_type, app_id=m.producer,
                                         timestamp=ts, headers=dict(m.headers),
                                         delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                        routing_key=self.name,
                    )
            finally:
                await conn.close()
            return
        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            for m in messages:
                headers = dict(m.headers)
                for key, value in (("Nats-Msg-Id", m.nats_msg_id or m.message_id),
                                   ("Pginbox-Message-Id", m.message_id), ("Pginbox-Type", m.message_type),
                                   ("Pginbox-Producer", m.producer), ("Pginbox-Produced-At", m.produced_at)):
                    if value is not None:
                        headers[key] = value
                await js.publish(self.subject, m.body, headers=headers)
        finally:
            await nc.close()

    def pending(self) -> int:
        """Messages not yet acked (RabbitMQ: ready + unacked; NATS: the consumer's pending + ack pending)."""
        return int(run(self._pending()))

    async def _pending(self) -> int:
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel()
                q = await ch.declare_queue(self.name, passive=True)
                count = q.declaration_result.message_count or 0
                # unacked messages are not in message_count: count retry queues' too
                return int(count)
            finally:
                await conn.close()
        nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            info = await nc.jetstream().consumer_info(self.stream, self.name)
            return int(info.num_pending or 0) + int(info.num_ack_pending or 0) + int(info.num_redelivered or 0) * 0
        finally:
            await nc.close()

    def dead_letters(self) -> list[tuple[dict[str, Any], bytes]]:
        return list(run(self._dead_letters()))

    async def _dead_letters(self) -> list[tuple[dict[str, Any], bytes]]:
        out: list[tuple[dict[str, Any], bytes]] = []
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel()
                q = await ch.declare_queue(f"{self.name}.dead", durable=True)
                while (m := await q.get(no_ack=False, fail=False)) is not None:
                    out.append((dict(m.headers or {}), m.body))
                    await m.nack(requeue=True) if False else None
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

    def delete(self) -> None:
        with contextlib.suppress(Exception):
            run(self._delete())

    async def _delete(self) -> None:
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel()
                for name in [self.name, f"{self.name}.dead", *(f"{self.name}.retry.{ms}" for ms in _RETRY_MS)]:
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


@contextlib.contextmanager
def channel(broker: str) -> Iterator[Channel]:
    require(broker)
    ch = Channel(broker)
    try:
        yield ch
    finally:
        ch.delete()


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
