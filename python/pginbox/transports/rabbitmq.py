"""`RabbitMQTransport`: effects published to RabbitMQ (aio-pika, extra `pginbox[rabbitmq]`).

Each effect is one persistent message (delivery_mode 2), published with `mandatory` on a channel
in publisher-confirm mode:

  message_id    the effect id: a pginbox consumer downstream deduplicates on it
  app_id        `producer` (default "pginbox"): the producer of the message for the consumer
  type          the effect's Pginbox-Type header, else `message_type`, else the destination name
  timestamp     when the effect was created (produced_at downstream)
  headers       the effect's headers; its ordering key as Pginbox-Ordering-Key, or as the routing
                key with ordering_key = "routing_key"

  confirmed (basic.ack)            delivered
  basic.nack, unroutable (basic.return with mandatory)
                                   retryable failure (a missing queue or binding is fixed, then
                                   the effect goes out)
  connection lost / no confirm in `timeout`
                                   ambiguous: retryable, the same effect id is published again
                                   (the consumer's inbox absorbs the repeat)

deliver_batch publishes a whole batch and waits for all its confirms at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pginbox.errors import BrokerError
from pginbox.transports.aioloop import LoopThread, LoopTransport
from pginbox.transports.effect import delivery_key
from pginbox.transports.protocol import DeliveryReport

try:
    import aio_pika
    import aio_pika.exceptions
    import aiormq.exceptions
    from aio_pika.abc import AbstractChannel, AbstractConnection
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise BrokerError("the RabbitMQ destination needs aio-pika: pip install 'pginbox[rabbitmq]'") from exc

__all__ = ["RabbitMQTransport"]

_CONNECTION_ERRORS = (aiormq.exceptions.AMQPConnectionError, aiormq.exceptions.ChannelInvalidStateError,
                      ConnectionError, OSError, aio_pika.exceptions.ChannelClosed)


class RabbitMQTransport(LoopTransport):
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
        if ordering_key not in ("header", "routing_key"):
            raise ValueError(f"ordering_key must be 'header' or 'routing_key', got {ordering_key!r}")
        if routing_key is None and not (exchange and ordering_key == "routing_key"):
            raise ValueError("a RabbitMQ destination needs routing_key (the queue name with the default exchange)")
        self.url = url
        self.routing_key = routing_key
        self.exchange_name = exchange
        self.producer = producer
        self.message_type = message_type
        self.ordering_key = ordering_key
        self.timeout = timeout
        self.destination = destination
        self._loop = LoopThread(f"rabbitmq-{destination or 'destination'}")
        self._lock: asyncio.Lock | None = None
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def _close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await connection.close()

    async def _ready(self) -> AbstractChannel:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._channel is None or self._channel.is_closed or self._connection is None \
                    or self._connection.is_closed:
                await self._close()
                self._connection = await aio_pika.connect(self.url, timeout=self.timeout)
                self._channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
            return self._channel

    def _message(self, effect: Any) -> tuple[aio_pika.Message, str]:
        headers: dict[str, Any] = {str(k): str(v) for k, v in dict(effect.headers or {}).items()}
        ordering = getattr(effect, "ordering_key", None)
        routing_key = self.routing_key or ""
        if ordering:
            if self.ordering_key == "routing_key":
                routing_key = str(ordering)
            else:
                headers["Pginbox-Ordering-Key"] = str(ordering)
        created = getattr(effect, "created_at", None)
        message_type = headers.get("Pginbox-Type") or self.message_type or self.destination or "effect"
        message = aio_pika.Message(
            json.dumps(effect.payload, separators=(",", ":")).encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=delivery_key(effect),
            app_id=self.producer,
            type=message_type,
            timestamp=created if isinstance(created, datetime.datetime) else datetime.datetime.now(datetime.UTC),
            headers=headers,
        )
        return message, routing_key

    async def _publish_all(self, effects: Sequence[Any]) -> list[DeliveryReport]:
        try:
            channel = await self._ready()
            exchange = (channel.default_exchange if not self.exchange_name
                        else await channel.get_exchange(self.exchange_name, ensure=False))
        except (TimeoutError, *_CONNECTION_ERRORS, aio_pika.exceptions.AMQPError) as exc:
            await self._close()
            return [DeliveryReport.failed(f"RabbitMQ unreachable: {type(exc).__name__}: {exc}", retryable=True)
                    for _ in effects]

        async def one(effect: Any) -> DeliveryReport:
            message, routing_key = self._message(effect)
            try:
                await asyncio.wait_for(exchange.publish(message, routing_key=routing_key, mandatory=True),
                                       self.timeout)
            except aio_pika.exceptions.PublishError as exc:
                return DeliveryReport.failed(f"unroutable: no queue bound for routing key {routing_key!r} "
                                             f"({_reply_text(exc)})", retryable=True)
            except aio_pika.exceptions.DeliveryError as exc:
                return DeliveryReport.failed(f"RabbitMQ refused the message (nack): {_reply_text(exc)}",
                                             retryable=True)
            except (TimeoutError, *_CONNECTION_ERRORS, aio_pika.exceptions.AMQPError) as exc:
                return DeliveryReport.failed(f"ambiguous: {type(exc).__name__}: {exc}", retryable=True)
            return DeliveryReport.ok()

        reports = list(await asyncio.gather(*(one(e) for e in effects)))
        if any(r.error is not None and r.error.startswith("ambiguous") for r in reports):
            await self._close()
        return reports


def _reply_text(exc: BaseException) -> str:
    frame: Mapping[str, Any] | Any = getattr(exc, "frame", None)
    text = getattr(frame, "reply_text", None)
    return str(text) if text else str(exc) or type(exc).__name__
