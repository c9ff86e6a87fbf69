"""`BrokerDestination`: a Publisher (an outbound adapter) as a dispatcher destination.

The dispatcher delivers from worker threads through `Transport.deliver` and
`BatchTransport.deliver_batch`; a broker destination maps each effect to an Outgoing message
(pginbox.brokers.wire.outgoing: the idempotency key, producer, type, produced_at, body) and runs
its publisher on a LoopThread of its own. One report per effect, in order:

  confirmed by the broker            delivered
  refused (nack, unroutable, no stream, an error answer)
                                     retryable failure
  no confirm in `timeout`, connection lost after sending
                                     ambiguous: retryable, published again with the same key
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pginbox.brokers.port import Publisher
from pginbox.brokers.wire import outgoing
from pginbox.errors import BrokerError
from pginbox.runtime.aioloop import LoopThread
from pginbox.transports.protocol import DeliveryReport

__all__ = ["BrokerDestination"]


class BrokerDestination:
    def __init__(
        self,
        publisher: Publisher,
        *,
        producer: str = "pginbox",
        message_type: str | None = None,
        timeout: float = 10.0,
        destination: str = "",
    ) -> None:
        self.publisher = publisher
        self.producer = producer
        self.message_type = message_type
        self.timeout = timeout
        self.destination = destination
        self._loop = LoopThread(f"{publisher.name}-{destination or 'destination'}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.destination or self.publisher.name})"

    def deliver(self, effect: Any) -> DeliveryReport:
        report = self.deliver_batch([effect])[0]
        if report.error is not None and report.error.startswith("ambiguous"):
            raise BrokerError(report.error)
        return report

    def deliver_batch(self, effects: Sequence[Any]) -> list[DeliveryReport]:
        messages = [
            outgoing(e, producer=self.producer, message_type=self.message_type, destination=self.destination)
            for e in effects
        ]
        try:
            return self._loop.run(self.publisher.publish(messages), self.timeout + 5.0)
        except TimeoutError:
            return [
                DeliveryReport.failed(
                    f"ambiguous: no {self.publisher.confirm} within {self.timeout:g} s", retryable=True
                )
                for _ in effects
            ]

    def close(self) -> None:
        self._loop.close(self.publisher.close())
