"""NATS JetStream adapter (nats-py, extra `pginbox[nats]`): `JetStreamBroker` for `pginbox consume`,
`JetStreamTransport` (a BrokerDestination over `JetStreamPublisher`) for the dispatcher; both
connect through `connect_nats`.

Consuming (JetStreamBroker):
  fetch        a durable pull consumer (explicit acks) on the stream, created when missing
               (declare); one pull request at a time keeps a local buffer filled ahead with up to
               2 x prefetch messages (what is left in it at close is NAKed back at once)
  ack          +ACK after the COMMIT
  retry        NAK with a delay (the server redelivers it then)
  dead letter  published to the dead-letter subject with Pginbox-Sqlstate / Pginbox-Reason headers,
               its PubAck checked (a stream must capture that subject), then TERM
  hand back    NAK with the consumer's pause as delay
  redelivery   num_delivered > 1

Publishing (JetStreamPublisher): one message per effect on `subject`, the identity in the
Pginbox-* headers (Pginbox-Message-Id = the idempotency key) and Nats-Msg-Id = the key and the
body's SHA-256: the stream's duplicate window drops a true repeat (same key, same body), and a
message with the same key and another body still reaches the consumer, which quarantines it as a
conflict. PubAck: delivered (a duplicate PubAck too); an error answer (no stream for the subject):
retryable; no PubAck in time: ambiguous.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any

from pginbox.brokers.port import Delivery, Outgoing, SourceConfig
from pginbox.brokers.publish import BrokerDestination
from pginbox.brokers.wire import Header, dead_letter_headers, identity_headers
from pginbox.errors import BrokerError
from pginbox.runtime.log import safe_url
from pginbox.transports.protocol import DeliveryReport

try:
    import nats
    import nats.errors
    import nats.js.errors
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import api
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise BrokerError("NATS JetStream support needs nats-py: pip install 'pginbox[nats]'") from exc

__all__ = ["JetStreamBroker", "JetStreamPublisher", "JetStreamTransport", "connect_nats"]

_ERRORS = (nats.errors.Error, ConnectionError, OSError, asyncio.TimeoutError, asyncio.InvalidStateError, RuntimeError)


async def connect_nats(url: str, timeout: float = 5.0) -> Client:
    """nats.connect bounded by `timeout`: nats-py keeps retrying a refused first connection (every
    server it knows, max_reconnect_attempts times), which would hang the caller."""
    try:
        return await asyncio.wait_for(
            nats.connect(
                servers=[url],
                connect_timeout=min(timeout, 2.0),
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                name="pginbox",
            ),
            timeout,
        )
    except (*_ERRORS, TimeoutError) as exc:
        raise BrokerError(f"NATS {safe_url(url)}: cannot connect ({type(exc).__name__}: {exc})") from exc


class JetStreamBroker:
    name = "nats"

    def __init__(self, config: SourceConfig, *, connect_timeout: float = 5.0, ack_wait: float | None = None) -> None:
        if not config.stream or not config.durable:
            raise BrokerError("the NATS JetStream adapter needs a stream and a durable name")
        self.config = config
        self.connect_timeout = connect_timeout
        self.ack_wait = config.claim_idle if ack_wait is None else ack_wait
        self._nc: Client | None = None
        self._sub: Any = None
        self._buffer: deque[Msg] = deque()
        self._pull: asyncio.Task[list[Msg]] | None = None
        self._broken: BaseException | None = None

    async def connect(self) -> None:
        await self.close()
        nc = await connect_nats(self.config.url, self.connect_timeout)
        self._nc = nc
        stream, durable = self.config.stream or "", self.config.durable or ""
        try:
            js = nc.jetstream()
            if self.config.declare:
                try:
                    await js.consumer_info(stream, durable)
                except nats.js.errors.NotFoundError:
                    await js.add_consumer(
                        stream,
                        api.ConsumerConfig(
                            durable_name=durable,
                            ack_policy=api.AckPolicy.EXPLICIT,
                            filter_subject=self.config.subject,
                            ack_wait=self.ack_wait,
                            max_ack_pending=max(1000, 4 * self.config.prefetch),
                            deliver_policy=api.DeliverPolicy.ALL,
                        ),
                    )
            self._sub = await js.pull_subscribe_bind(durable, stream)
        except _ERRORS as exc:
            await self.close()
            raise BrokerError(
                f"NATS JetStream stream {stream!r} consumer {durable!r}: {type(exc).__name__}: {exc}"
            ) from exc

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Up to max_messages from the local buffer, which one pull request at a time keeps
        filled ahead with up to 2 x max_messages (as RabbitMQ's basic.qos of 2 x prefetch does):
        the next messages arrive while a batch commits, instead of one pull round trip per batch."""
        nc = self._nc
        if nc is None or nc.is_closed:
            raise BrokerError(f"NATS connection to {safe_url(self.config.url)} closed")
        deadline = asyncio.get_running_loop().time() + timeout
        while not self._buffer:
            if not nc.is_connected:  # nats-py is reconnecting: wait
                await asyncio.sleep(timeout)
                return []
            task = self._pull_ahead(2 * max_messages, timeout)
            assert task is not None  # the buffer is empty: a pull is in flight
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return []
            await asyncio.wait({task}, timeout=remaining)
            if not task.done():
                return []
            self._collect(task)
            broken, self._broken = self._broken, None
            if broken is not None:
                raise BrokerError(f"NATS fetch failed: {type(broken).__name__}: {broken}") from broken
        out = [self._buffer.popleft() for _ in range(min(max_messages, len(self._buffer)))]
        self._pull_ahead(2 * max_messages, timeout)
        return [self._delivery(m) for m in out]

    def _pull_ahead(self, target: int, timeout: float) -> asyncio.Task[list[Msg]] | None:
        """The pull request in flight, or a new one for what the buffer lacks of `target`."""
        if self._pull is None and len(self._buffer) < target:
            task = asyncio.ensure_future(self._sub.fetch(batch=target - len(self._buffer), timeout=timeout))
            task.add_done_callback(self._collect)
            self._pull = task
        return self._pull

    def _collect(self, task: asyncio.Task[list[Msg]]) -> None:
        """A finished pull (once): its messages into the buffer; an error on a closed connection
        is kept for fetch to raise (no message in time, or a disconnection nats-py is repairing,
        are not errors)."""
        if self._pull is not task:
            return
        self._pull = None
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self._buffer.extend(task.result())
        elif not isinstance(exc, nats.errors.TimeoutError) and (self._nc is None or self._nc.is_closed):
            self._broken = exc

    @staticmethod
    def _delivery(m: Msg) -> Delivery:
        meta = m.metadata
        properties = {
            "subject": m.subject,
            "stream": meta.stream,
            "sequence": meta.sequence.stream,
            "timestamp": meta.timestamp,
        }
        return Delivery(m.data, properties, dict(m.headers or {}), meta.num_delivered > 1, m)

    async def ack(self, delivery: Delivery) -> None:
        try:
            await delivery.raw.ack()
        except _ERRORS as exc:
            raise BrokerError(f"NATS ack failed: {exc}") from exc

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            await self.ack(delivery)

    async def retry(self, delivery: Delivery, delay: float) -> None:
        try:
            await delivery.raw.nak(delay=delay)
        except _ERRORS as exc:
            raise BrokerError(f"NATS nak failed: {exc}") from exc

    async def dead_letter(self, delivery: Delivery, sqlstate: str, reason: str) -> None:
        assert self._nc is not None
        subject = self.config.dead_letter
        headers = {str(k): str(v) for k, v in delivery.headers.items() if str(k).lower() != "nats-msg-id"}
        headers.update(dead_letter_headers(sqlstate, reason, delivery.raw.subject))
        try:
            await self._nc.jetstream().publish(subject, delivery.body, headers=headers, timeout=5.0)
            await delivery.raw.term()
        except _ERRORS as exc:
            raise BrokerError(
                f"NATS dead letter to {subject!r} failed (does a stream capture it?): {type(exc).__name__}: {exc}"
            ) from exc

    async def hand_back(self, delivery: Delivery, delay: float) -> None:
        await self.retry(delivery, delay)

    async def close(self) -> None:
        pull, self._pull = self._pull, None
        if pull is not None:
            pull.cancel()
            with contextlib.suppress(BaseException):
                await pull
        buffered, self._buffer = list(self._buffer), deque()
        for m in buffered:  # pulled ahead, never handed out: back now, not after ack_wait
            with contextlib.suppress(Exception):
                await m.nak()
        nc, self._nc, self._sub = self._nc, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)


class JetStreamPublisher:
    name = "nats"
    confirm = "PubAck"

    def __init__(self, url: str, *, subject: str, timeout: float = 10.0) -> None:
        if not subject:
            raise ValueError("a NATS destination needs subject")
        self.url = url
        self.subject = subject
        self.timeout = timeout
        self.duplicates = 0  # PubAcks that said the stream already had the message
        self._nc: Client | None = None
        self._lock: asyncio.Lock | None = None

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)

    async def _ready(self) -> Client:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._nc is None or self._nc.is_closed:
                self._nc = await connect_nats(self.url, min(self.timeout, 5.0))
            return self._nc

    @staticmethod
    def headers(out: Outgoing) -> dict[str, str]:
        headers = identity_headers(out)
        headers[Header.NATS_MSG_ID] = out.dedup_id
        return headers

    async def publish(self, messages: Sequence[Outgoing]) -> list[DeliveryReport]:
        try:
            nc = await self._ready()
        except BrokerError as exc:
            return [DeliveryReport.failed(str(exc), retryable=True) for _ in messages]
        js = nc.jetstream()

        async def one(out: Outgoing) -> DeliveryReport:
            try:
                ack = await js.publish(self.subject, out.body, timeout=self.timeout, headers=self.headers(out))
            except nats.js.errors.NoStreamResponseError as exc:
                # Until the stream exists (`pginbox outbox provision`): not an attempt, the effect waits.
                return DeliveryReport.deferred("no_stream", f"no stream captures subject {self.subject!r}: {exc}")
            except nats.js.errors.APIError as exc:
                return DeliveryReport.failed(f"JetStream refused the message: {exc}", retryable=True)
            except nats.errors.MaxPayloadError as exc:
                return DeliveryReport.failed(f"JetStream refused the message: {exc}", retryable=True)
            except (TimeoutError, nats.errors.Error, ConnectionError, OSError) as exc:
                return DeliveryReport.failed(f"ambiguous: {type(exc).__name__}: {exc}", retryable=True)
            if ack.duplicate:
                self.duplicates += 1
            return DeliveryReport.ok()

        return list(await asyncio.gather(*(one(m) for m in messages)))


class JetStreamTransport(BrokerDestination):
    """The dispatcher's JetStream destination (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        subject: str,
        producer: str = "pginbox",
        message_type: str | None = None,
        timeout: float = 10.0,
        destination: str = "",
    ) -> None:
        self.url = url
        self.subject = subject
        self._publisher = JetStreamPublisher(url, subject=subject, timeout=timeout)
        super().__init__(
            self._publisher, producer=producer, message_type=message_type, timeout=timeout, destination=destination
        )

    @property
    def duplicates(self) -> int:
        """PubAcks that said the stream already had the message (its duplicate window dropped it)."""
        return self._publisher.duplicates
