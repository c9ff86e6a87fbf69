"""NATS JetStream for `pginbox consume` (nats-py, extra `pginbox[nats]`).

  consume      a durable pull consumer (explicit acks) on the stream, created when missing
               (declare), fetched `prefetch` messages at a time
  ack          +ACK after the COMMIT
  retry        NAK with a delay (the server redelivers it then)
  dead letter  published to the dead-letter subject with Pginbox-Sqlstate / Pginbox-Reason headers,
               its PubAck checked (a stream must capture that subject), then TERM
  hand back    NAK with the consumer's pause as delay
  redelivery   num_delivered > 1
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from pginbox.consumer.config import ConsumeConfig, safe_url
from pginbox.consumer.core import REASON_HEADER, SQLSTATE_HEADER, Delivery
from pginbox.errors import BrokerError

try:
    import nats
    import nats.errors
    import nats.js.errors
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import api
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise BrokerError("NATS JetStream support needs nats-py: pip install 'pginbox[nats]'") from exc

__all__ = ["JetStreamBroker", "connect_nats"]

_ERRORS = (nats.errors.Error, ConnectionError, OSError, asyncio.TimeoutError, asyncio.InvalidStateError, RuntimeError)


async def connect_nats(url: str, timeout: float = 5.0) -> Client:
    """nats.connect bounded by `timeout`: nats-py keeps retrying a refused first connection (every
    server it knows, max_reconnect_attempts times), which would hang the caller."""
    try:
        return await asyncio.wait_for(
            nats.connect(servers=[url], connect_timeout=min(timeout, 2.0), allow_reconnect=True,
                         max_reconnect_attempts=-1, reconnect_time_wait=0.25, name="pginbox"),
            timeout,
        )
    except (*_ERRORS, TimeoutError) as exc:
        raise BrokerError(f"NATS {safe_url(url)}: cannot connect ({type(exc).__name__}: {exc})") from exc


class JetStreamBroker:
    name = "nats"

    def __init__(self, config: ConsumeConfig, *, connect_timeout: float = 5.0, ack_wait: float = 30.0) -> None:
        assert config.stream is not None and config.durable is not None
        self.config = config
        self.connect_timeout = connect_timeout
        self.ack_wait = ack_wait
        self._nc: Client | None = None
        self._sub: Any = None

    async def connect(self) -> None:
        await self.close()
        nc = await connect_nats(self.config.url, self.connect_timeout)
        self._nc = nc
        try:
            js = nc.jetstream()
            stream, durable = self.config.stream, self.config.durable
            if self.config.declare:
                try:
                    await js.consumer_info(stream, durable)  # type: ignore[arg-type]
                except nats.js.errors.NotFoundError:
                    await js.add_consumer(stream, api.ConsumerConfig(  # type: ignore[arg-type]
                        durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, filter_subject=self.config.subject,
                        ack_wait=self.ack_wait, max_ack_pending=max(1000, 4 * self.config.prefetch),
                        deliver_policy=api.DeliverPolicy.ALL,
                    ))
            self._sub = await js.pull_subscribe_bind(durable, stream)
        except _ERRORS as exc:
            await self.close()
            raise BrokerError(f"NATS JetStream stream {self.config.stream!r} consumer {self.config.durable!r}: "
                              f"{type(exc).__name__}: {exc}") from exc

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        nc = self._nc
        if nc is None or nc.is_closed:
            raise BrokerError(f"NATS connection to {safe_url(self.config.url)} closed")
        if not nc.is_connected:  # nats-py is reconnecting: wait
            await asyncio.sleep(timeout)
            return []
        try:
            msgs: list[Msg] = await self._sub.fetch(batch=max_messages, timeout=timeout)
        except nats.errors.TimeoutError:
            return []
        except _ERRORS as exc:
            if nc.is_closed:
                raise BrokerError(f"NATS fetch failed: {type(exc).__name__}: {exc}") from exc
            return []  # a disconnection nats-py is repairing
        return [self._delivery(m) for m in msgs]

    @staticmethod
    def _delivery(m: Msg) -> Delivery:
        meta = m.metadata
        properties = {"subject": m.subject, "stream": meta.stream, "sequence": meta.sequence.stream,
                      "timestamp": meta.timestamp}
        return Delivery(m.data, properties, dict(m.headers or {}), meta.num_delivered > 1, m)

    async def ack(self, delivery: Delivery) -> None:
        try:
            await delivery.raw.ack()
        except _ERRORS as exc:
            raise BrokerError(f"NATS ack failed: {exc}") from exc

    async def retry(self, delivery: Delivery, delay: float) -> None:
        try:
            await delivery.raw.nak(delay=delay)
        except _ERRORS as exc:
            raise BrokerError(f"NATS nak failed: {exc}") from exc

    async def dead_letter(self, delivery: Delivery, sqlstate: str, reason: str) -> None:
        assert self._nc is not None
        subject = self.config.dead_letter_target
        headers = {str(k): str(v) for k, v in delivery.headers.items() if str(k).lower() != "nats-msg-id"}
        headers.update({SQLSTATE_HEADER: sqlstate, REASON_HEADER: reason.replace("\r", " ").replace("\n", " "),
                        "Pginbox-Original-Subject": delivery.raw.subject})
        try:
            await self._nc.jetstream().publish(subject, delivery.body, headers=headers, timeout=5.0)
            await delivery.raw.term()
        except _ERRORS as exc:
            raise BrokerError(f"NATS dead letter to {subject!r} failed (does a stream capture it?): "
                              f"{type(exc).__name__}: {exc}") from exc

    async def hand_back(self, delivery: Delivery, delay: float) -> None:
        await self.retry(delivery, delay)

    async def close(self) -> None:
        nc, self._nc, self._sub = self._nc, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)
