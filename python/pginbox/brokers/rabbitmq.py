"""RabbitMQ adapter (aio-pika, extra `pginbox[rabbitmq]`): `RabbitMQBroker` for `pginbox consume`,
`RabbitMQTransport` (a BrokerDestination over `RabbitMQPublisher`) for the dispatcher.

Consuming (RabbitMQBroker):
  fetch        basic.consume on the queue with a prefetch (basic.qos) of 2 x prefetch, so that the
               next batch arrives while one is being committed
  ack          basic.ack after the COMMIT
  retry        the message is published (with publisher confirms) to `<queue>.retry.<ms>`, a queue
               whose x-message-ttl is that delay and whose dead-letter exchange routes it back to
               `<queue>`, then acked: one queue per delay, because RabbitMQ expires messages only
               from the head of a queue (a per-message TTL behind a longer one would wait for it)
  dead letter  published (confirmed) to `<queue>.dead` with Pginbox-Sqlstate / Pginbox-Reason
               headers, then acked
  hand back    basic.nack(requeue=True) (the consumer pauses before it fetches again)
  redelivery   AMQP `redelivered`, or quorum queues' x-delivery-count > 0

Publishing (RabbitMQPublisher): each effect is one persistent message, published with `mandatory`
on a channel in publisher-confirm mode: message_id = the idempotency key, app_id = the producer,
type, timestamp = created_at, the effect's headers; its ordering key as Pginbox-Ordering-Key, or
as the routing key with ordering_key = "routing_key". Confirmed: delivered; basic.nack or
unroutable (basic.return): retryable; connection lost or no confirm: ambiguous.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from pginbox.brokers.port import Delivery, Outgoing, SourceConfig
from pginbox.brokers.publish import BrokerDestination
from pginbox.brokers.wire import Header, dead_letter_headers
from pginbox.errors import BrokerError
from pginbox.runtime.log import safe_url
from pginbox.transports.protocol import DeliveryReport

try:
    import aio_pika
    import aio_pika.exceptions
    import aiormq
    import aiormq.exceptions
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise BrokerError("RabbitMQ support needs aio-pika: pip install 'pginbox[rabbitmq]'") from exc

__all__ = ["RabbitMQBroker", "RabbitMQPublisher", "RabbitMQTransport", "retry_queue_name"]

# Any failure of a broker operation means the connection or channel is gone (aiormq raises
# ChannelInvalidStateError, an asyncio.InvalidStateError, on a closed channel): reconnect.
_BROKER_ERRORS = (
    aio_pika.exceptions.AMQPError,
    aiormq.exceptions.AMQPError,
    ConnectionError,
    OSError,
    asyncio.TimeoutError,
    asyncio.InvalidStateError,
    RuntimeError,
)


def _closed_under_us(exc: BaseException) -> bool:
    """aiormq rejects the pending operations of a connection or channel that closed without a
    reason with a bare `Exception` (aiormq.base.FutureStore.reject_all): a lost connection too."""
    return type(exc) is Exception


def _why(exc: BaseException) -> str:
    return "the connection closed under the operation" if _closed_under_us(exc) else f"{type(exc).__name__}: {exc}"


def _unless_broker_failure(exc: Exception) -> None:
    """Re-raises `exc` unless it says the connection or channel is gone."""
    if not (isinstance(exc, _BROKER_ERRORS) or _closed_under_us(exc)):
        raise exc


_CONNECTION_ERRORS = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    aio_pika.exceptions.ChannelClosed,
)
_BROKER_HEADERS = (
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-delivery-count",
)


def retry_queue_name(queue: str, delay: float) -> str:
    return f"{queue}.retry.{max(1, round(delay * 1000))}"


class RabbitMQBroker:
    name = "rabbitmq"

    def __init__(self, config: SourceConfig, *, connect_timeout: float = 5.0) -> None:
        if not config.queue:
            raise BrokerError("the RabbitMQ adapter needs a queue")
        self.config = config
        self.queue_name = config.queue
        self.connect_timeout = connect_timeout
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._buffer: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self._retry_queues: set[str] = set()
        self._dead_declared = False

    async def connect(self) -> None:
        await self.close()
        self._buffer = asyncio.Queue()
        self._retry_queues.clear()
        self._dead_declared = False
        try:
            self._connection = await aio_pika.connect(self.config.url, timeout=self.connect_timeout)
            self._queue = await self._ensure_queue(self.queue_name, create=self.config.declare)
            assert self._channel is not None
            await self._channel.set_qos(prefetch_count=2 * self.config.prefetch)
            await self._queue.consume(self._on_message, no_ack=False)
        except Exception as exc:
            _unless_broker_failure(exc)
            await self.close()
            raise BrokerError(f"RabbitMQ {safe_url(self.config.url)} queue {self.queue_name!r}: {_why(exc)}") from exc

    async def _ensure_queue(
        self, name: str, *, create: bool = True, arguments: dict[str, Any] | None = None
    ) -> AbstractQueue:
        """The queue `name`: an existing one as it is (a quorum queue, with its own arguments, is
        not declared again: RabbitMQ would refuse arguments that differ), else declared durable.
        The existence check runs on a channel of its own: a passive declare of a missing queue
        closes its channel, and the deliveries in hand belong to the main one."""
        assert self._connection is not None
        if self._channel is None:
            self._channel = await self._connection.channel(publisher_confirms=True)
        probe = await self._connection.channel()
        try:
            await probe.declare_queue(name, passive=True)
            exists = True
        except aio_pika.exceptions.ChannelClosed:
            exists = False
        finally:
            if not probe.is_closed:
                await probe.close()
        if exists:
            return await self._channel.declare_queue(name, passive=True)
        if not create:
            raise BrokerError(f"RabbitMQ queue {name!r} does not exist (declare = false: create it first)")
        return await self._channel.declare_queue(name, durable=True, arguments=arguments)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        await self._buffer.put(message)

    def _check(self) -> None:
        if self._connection is None or self._connection.is_closed or self._channel is None or self._channel.is_closed:
            raise BrokerError(f"RabbitMQ connection to {safe_url(self.config.url)} lost")

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        self._check()
        try:
            first = await asyncio.wait_for(self._buffer.get(), timeout)
        except TimeoutError:
            self._check()
            return []
        out = [first]
        for _ in range(2):
            while len(out) < max_messages and not self._buffer.empty():
                out.append(self._buffer.get_nowait())
            if len(out) >= max_messages:
                break
            await asyncio.sleep(0.002)  # let a burst in flight arrive
        return [self._delivery(m) for m in out]

    @staticmethod
    def _delivery(m: AbstractIncomingMessage) -> Delivery:
        headers: dict[str, Any] = dict(m.headers or {})
        count = headers.get("x-delivery-count")
        redelivered = bool(m.redelivered) or (isinstance(count, int) and count > 0)
        properties = {
            "app_id": m.app_id,
            "message_id": m.message_id,
            "type": m.type,
            "timestamp": m.timestamp,
            "correlation_id": m.correlation_id,
            "user_id": m.user_id,
            "routing_key": m.routing_key,
            "exchange": m.exchange,
            "content_type": m.content_type,
            "reply_to": m.reply_to,
        }
        return Delivery(m.body, properties, headers, redelivered, m)

    async def ack(self, delivery: Delivery) -> None:
        try:
            await delivery.raw.ack()
        except Exception as exc:
            _unless_broker_failure(exc)
            raise BrokerError(f"RabbitMQ ack failed: {_why(exc)}") from exc

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            await self.ack(delivery)

    @staticmethod
    def _copy(m: AbstractIncomingMessage, extra: Mapping[str, Any] | None = None) -> aio_pika.Message:
        headers = {k: v for k, v in (m.headers or {}).items() if k not in _BROKER_HEADERS}
        headers.update(extra or {})
        return aio_pika.Message(
            m.body,
            headers=headers,
            content_type=m.content_type,
            content_encoding=m.content_encoding,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            priority=m.priority,
            correlation_id=m.correlation_id,
            reply_to=m.reply_to,
            message_id=m.message_id,
            timestamp=m.timestamp,
            type=m.type,
            user_id=m.user_id,
            app_id=m.app_id,
        )

    async def retry(self, delivery: Delivery, delay: float) -> None:
        name = retry_queue_name(self.queue_name, delay)
        try:
            assert self._channel is not None
            if name not in self._retry_queues:
                await self._ensure_queue(
                    name,
                    arguments={
                        "x-message-ttl": max(1, round(delay * 1000)),
                        "x-dead-letter-exchange": "",
                        "x-dead-letter-routing-key": self.queue_name,
                    },
                )
                self._retry_queues.add(name)
            await self._channel.default_exchange.publish(self._copy(delivery.raw), routing_key=name, mandatory=True)
            await delivery.raw.ack()
        except Exception as exc:
            _unless_broker_failure(exc)
            raise BrokerError(f"RabbitMQ retry through {name!r} failed: {_why(exc)}") from exc

    async def dead_letter(self, delivery: Delivery, sqlstate: str, reason: str) -> None:
        name = self.config.dead_letter
        try:
            assert self._channel is not None
            if not self._dead_declared:
                await self._ensure_queue(name)
                self._dead_declared = True
            copy = self._copy(delivery.raw, dead_letter_headers(sqlstate, reason, self.queue_name))
            await self._channel.default_exchange.publish(copy, routing_key=name, mandatory=True)
            await delivery.raw.ack()
        except Exception as exc:
            _unless_broker_failure(exc)
            raise BrokerError(f"RabbitMQ dead letter to {name!r} failed: {_why(exc)}") from exc

    async def hand_back(self, delivery: Delivery, delay: float) -> None:
        try:
            await delivery.raw.nack(requeue=True)
        except Exception as exc:
            _unless_broker_failure(exc)
            raise BrokerError(f"RabbitMQ nack failed: {_why(exc)}") from exc

    async def close(self) -> None:
        connection, self._connection, self._channel, self._queue = self._connection, None, None, None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 5.0)


class RabbitMQPublisher:
    name = "rabbitmq"
    confirm = "confirm"

    def __init__(
        self,
        url: str,
        *,
        routing_key: str | None = None,
        exchange: str = "",
        ordering_key: str = "header",
        timeout: float = 10.0,
    ) -> None:
        if ordering_key not in ("header", "routing_key"):
            raise ValueError(f"ordering_key must be 'header' or 'routing_key', got {ordering_key!r}")
        if routing_key is None and not (exchange and ordering_key == "routing_key"):
            raise ValueError("a RabbitMQ destination needs routing_key (the queue name with the default exchange)")
        self.url = url
        self.routing_key = routing_key
        self.exchange_name = exchange
        self.ordering_key = ordering_key
        self.timeout = timeout
        self._lock: asyncio.Lock | None = None
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await connection.close()

    async def _ready(self) -> AbstractChannel:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if (
                self._channel is None
                or self._channel.is_closed
                or self._connection is None
                or self._connection.is_closed
            ):
                await self.close()
                self._connection = await aio_pika.connect(self.url, timeout=self.timeout)
                self._channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
            return self._channel

    def _message(self, out: Outgoing) -> tuple[aio_pika.Message, str]:
        headers: dict[str, Any] = dict(out.headers)
        routing_key = self.routing_key or ""
        if out.ordering_key:
            if self.ordering_key == "routing_key":
                routing_key = out.ordering_key
            else:
                headers[Header.ORDERING_KEY] = out.ordering_key
        message = aio_pika.Message(
            out.body,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=out.message_id,
            app_id=out.producer,
            type=out.message_type,
            timestamp=out.produced_at,
            headers=headers,
        )
        return message, routing_key

    async def publish(self, messages: Sequence[Outgoing]) -> list[DeliveryReport]:
        try:
            channel = await self._ready()
            exchange = (
                channel.default_exchange
                if not self.exchange_name
                else await channel.get_exchange(self.exchange_name, ensure=False)
            )
        except Exception as exc:
            unreachable = isinstance(exc, (TimeoutError, *_CONNECTION_ERRORS, aio_pika.exceptions.AMQPError))
            if not (unreachable or _closed_under_us(exc)):
                raise
            await self.close()
            return [DeliveryReport.failed(f"RabbitMQ unreachable: {_why(exc)}", retryable=True) for _ in messages]

        async def one(out: Outgoing) -> DeliveryReport:
            message, routing_key = self._message(out)
            try:
                await asyncio.wait_for(exchange.publish(message, routing_key=routing_key, mandatory=True), self.timeout)
            except aio_pika.exceptions.PublishError as exc:
                # Until the consuming service declares its queue: not an attempt, the effect waits.
                return DeliveryReport.deferred(
                    "unroutable", f"unroutable: no queue bound for routing key {routing_key!r} ({_reply_text(exc)})"
                )
            except aio_pika.exceptions.DeliveryError as exc:
                return DeliveryReport.failed(f"RabbitMQ refused the message (nack): {_reply_text(exc)}", retryable=True)
            except (TimeoutError, *_CONNECTION_ERRORS, aio_pika.exceptions.AMQPError) as exc:
                return DeliveryReport.failed(f"ambiguous: {type(exc).__name__}: {exc}", retryable=True)
            except Exception as exc:
                if not _closed_under_us(exc):
                    raise
                return DeliveryReport.failed("ambiguous: the connection closed under the publish", retryable=True)
            return DeliveryReport.ok()

        reports = list(await asyncio.gather(*(one(m) for m in messages)))
        if any(r.error is not None and r.error.startswith("ambiguous") for r in reports):
            await self.close()
        return reports


class RabbitMQTransport(BrokerDestination):
    """The dispatcher's RabbitMQ destination (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        routing_key: str | None = None,
        exchange: str = "",
        producer: str = "pginbox",
        message_type: str | None = None,
        ordering_key: str = "header",
        timeout: float = 10.0,
        destination: str = "",
    ) -> None:
        self.url = url
        publisher = RabbitMQPublisher(
            url, routing_key=routing_key, exchange=exchange, ordering_key=ordering_key, timeout=timeout
        )
        super().__init__(
            publisher, producer=producer, message_type=message_type, timeout=timeout, destination=destination
        )


def _reply_text(exc: BaseException) -> str:
    frame: Mapping[str, Any] | Any = getattr(exc, "frame", None)
    text = getattr(frame, "reply_text", None)
    return str(text) if text else str(exc) or type(exc).__name__
