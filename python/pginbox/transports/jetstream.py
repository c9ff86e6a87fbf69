"""`JetStreamTransport`: effects published to NATS JetStream (nats-py, extra `pginbox[nats]`).

Each effect is one message on `subject`, with headers:

  Nats-Msg-Id          the effect id: the stream's duplicate window drops a republish, and a
                       pginbox consumer downstream deduplicates on it after that
  Pginbox-Producer     `producer` (default "pginbox")
  Pginbox-Type         the effect's Pginbox-Type header, else `message_type`, else the destination
  Pginbox-Produced-At  when the effect was created (ISO 8601)
  Pginbox-Ordering-Key the effect's ordering key, if any
  and the effect's own headers.

  PubAck               delivered (PubAck.duplicate: the stream already had it; delivered too)
  an error answer      retryable failure (no stream for the subject, ...)
  no PubAck in time    ambiguous: retryable, the same Nats-Msg-Id again

deliver_batch sends the whole batch, then waits for all its PubAcks.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
from collections.abc import Sequence
from typing import Any

from pginbox.errors import BrokerError
from pginbox.transports.aioloop import LoopThread, LoopTransport
from pginbox.transports.effect import delivery_key
from pginbox.transports.protocol import DeliveryReport

try:
    import nats
    import nats.errors
    import nats.js.errors
    from nats.aio.client import Client
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise BrokerError("the NATS destination needs nats-py: pip install 'pginbox[nats]'") from exc

__all__ = ["JetStreamTransport"]


class JetStreamTransport(LoopTransport):
    CONFIRM = "PubAck"

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
        if not subject:
            raise ValueError("a NATS destination needs subject")
        self.url = url
        self.subject = subject
        self.producer = producer
        self.message_type = message_type
        self.timeout = timeout
        self.destination = destination
        self.duplicates = 0  # PubAcks that said the stream already had the message
        self._loop = LoopThread(f"nats-{destination or 'destination'}")
        self._nc: Client | None = None
        self._lock: asyncio.Lock | None = None

    async def _close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)

    async def _ready(self) -> Client:
        from pginbox.consumer.jetstream import connect_nats

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._nc is None or self._nc.is_closed:
                self._nc = await connect_nats(self.url, min(self.timeout, 5.0))
            return self._nc

    def _headers(self, effect: Any) -> dict[str, str]:
        headers = {str(k): str(v) for k, v in dict(effect.headers or {}).items()}
        created = getattr(effect, "created_at", None)
        if not isinstance(created, datetime.datetime):
            created = datetime.datetime.now(datetime.UTC)
        headers.update({
            "Nats-Msg-Id": delivery_key(effect),
            "Pginbox-Producer": self.producer,
            "Pginbox-Type": headers.get("Pginbox-Type") or self.message_type or self.destination or "effect",
            "Pginbox-Produced-At": created.isoformat(),
        })
        ordering = getattr(effect, "ordering_key", None)
        if ordering:
            headers["Pginbox-Ordering-Key"] = str(ordering)
        return headers

    async def _publish_all(self, effects: Sequence[Any]) -> list[DeliveryReport]:
        try:
            nc = await self._ready()
        except BrokerError as exc:
            return [DeliveryReport.failed(str(exc), retryable=True) for _ in effects]
        js = nc.jetstream()

        async def one(effect: Any) -> DeliveryReport:
            body = json.dumps(effect.payload, separators=(",", ":")).encode()
            try:
                ack = await js.publish(self.subject, body, timeout=self.timeout, headers=self._headers(effect))
            except nats.js.errors.NoStreamResponseError as exc:
                return DeliveryReport.failed(f"no stream captures subject {self.subject!r}: {exc}", retryable=True)
            except nats.js.errors.APIError as exc:
                return DeliveryReport.failed(f"JetStream refused the message: {exc}", retryable=True)
            except (TimeoutError, nats.errors.Error, ConnectionError, OSError) as exc:
                return DeliveryReport.failed(f"ambiguous: {type(exc).__name__}: {exc}", retryable=True)
            if ack.duplicate:
                self.duplicates += 1
            return DeliveryReport.ok()

        return list(await asyncio.gather(*(one(e) for e in effects)))
