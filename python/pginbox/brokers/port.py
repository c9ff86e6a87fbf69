"""The broker port: what `pginbox consume` needs from a broker (Broker, Delivery, SourceConfig) and
what the dispatcher's broker destinations need from one (Publisher, Outgoing). Adapters
(pginbox.brokers.memory, .rabbitmq, .jetstream, .redis) implement these and import this module and
pginbox.brokers.wire, never the consumer loop or the dispatcher.

The contract an inbound adapter keeps (tests/python/e2e/test_broker_conformance.py checks it on every
adapter; docs/brokers.md, "Writing an adapter"):

  fetch        up to `max_messages` deliveries, waiting at most `timeout` seconds for the first;
               a delivery the broker handed out before without a settlement is marked
               `redelivered` (the consumer then announces it: crash loops end in quarantine)
  ack          settle it for good; called only after the COMMIT that decided it (ack_many: the
               acks of one batch, in one round trip where the broker allows)
  retry        settle it now and have it delivered again after `delay` seconds, not earlier and
               never in a loop; the copy is NOT marked redelivered
  dead_letter  put it where operators read dead letters, with the SQLSTATE and the reason, then
               settle it; a dead letter that cannot be stored raises BrokerError (never dropped)
  hand_back    give it back unsettled, to be delivered again after about `delay` seconds (the
               database is unavailable, or the consumer halts); it may come back marked redelivered
  close        drop the connection; what was not settled comes back later, marked redelivered
  Any failure of the broker connection raises BrokerError: the consumer reconnects.

An adapter whose position lives in the database (Kafka: ProgressStore) also gives the consumer the
statement that stores its position, run in the transaction that decides a batch, before COMMIT.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pginbox.client.outcomes import Message
from pginbox.transports.protocol import DeliveryReport

__all__ = ["Broker", "Delivery", "Outgoing", "Progress", "ProgressStore", "Publisher", "SourceConfig"]


@dataclass
class Delivery:
    """One message as the broker delivered it: its body, broker properties (by the names of
    pginbox.brokers.wire.PROPERTIES), headers (stream fields, for Redis) and the redelivery mark.
    `raw`: the adapter's own handle (the library's message object, an entry id, ...);
    `message`: the pginbox Message once the consumer parsed it."""

    body: bytes
    properties: Mapping[str, Any]
    headers: Mapping[str, Any]
    redelivered: bool
    raw: Any = None
    message: Message | None = None


@dataclass(frozen=True)
class SourceConfig:
    """What an inbound adapter is told. `stream`: the NATS stream or the Redis stream key;
    `durable`: the NATS durable consumer or the Redis consumer group; `claim_idle`: seconds a
    delivery may stay unsettled before the broker hands it out again (JetStream ack_wait, the idle
    time after which Redis entries are reclaimed with XAUTOCLAIM); `dead_letter`: the resolved
    dead-letter queue, subject or stream; `options`: adapter-specific settings."""

    broker: str
    url: str
    consumer: str
    dead_letter: str
    prefetch: int = 50
    queue: str | None = None
    stream: str | None = None
    subject: str | None = None
    durable: str | None = None
    declare: bool = True
    claim_idle: float = 30.0
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def source_name(self) -> str:
        """The queue, or stream/durable, for logs."""
        return self.queue or f"{self.stream}/{self.durable}"


class Broker(Protocol):
    """An inbound adapter: see the module docstring for what each call promises."""

    name: str

    async def connect(self) -> None: ...
    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]: ...
    async def ack(self, delivery: Delivery) -> None: ...
    async def ack_many(self, deliveries: Sequence[Delivery]) -> None: ...
    async def retry(self, delivery: Delivery, delay: float) -> None: ...
    async def dead_letter(self, delivery: Delivery, sqlstate: str, reason: str) -> None: ...
    async def hand_back(self, delivery: Delivery, delay: float) -> None: ...
    async def close(self) -> None: ...


@dataclass(frozen=True)
class Progress:
    """A position to store in the database: `query` with `params` (one statement), run in the
    transaction that decides a batch, just before its COMMIT, or in one of its own for positions
    settled outside a transaction (dead letters). `positions`: what it stores, for the adapter."""

    query: str
    params: Sequence[Any]
    positions: Mapping[Any, tuple[int, int]]


@runtime_checkable
class ProgressStore(Protocol):
    """An inbound adapter whose consumption progress is stored with the claims (Kafka offsets):

    attach_database     the consumer's DSN (the adapter acquires partitions with it)
    progress            the statement storing the position reached once `deliveries` (a part of
                        the last fetch) are settled as `acked` says, or None; pure: it may be
                        asked again when the transaction is re-run
    progress_committed  that statement committed
    pending_progress    the position settled outside transactions since (dead letters), or None
    fenced              the store was refused (SQLSTATE FENCED): the transaction rolled back;
                        acquire the partitions again and read from their stored offsets
    """

    def attach_database(self, dsn: str) -> None: ...
    def progress(self, deliveries: Sequence[Delivery], acked: Sequence[bool]) -> Progress | None: ...
    def progress_committed(self, progress: Progress) -> None: ...
    def pending_progress(self) -> Progress | None: ...
    async def fenced(self, deliveries: Sequence[Delivery]) -> None: ...


@dataclass(frozen=True)
class Outgoing:
    """One effect as a broker message (pginbox.brokers.wire.outgoing builds it): the JSON body and
    the identity a pginbox consumer reads. `message_id` is the idempotency key; `dedup_id` the key
    a broker that deduplicates by itself (JetStream's Nats-Msg-Id) is given: the key and the
    body's hash, so that only a true duplicate is dropped there. `headers`: the effect's own
    headers plus the wire contract's (Pginbox-*)."""

    body: bytes
    message_id: str
    dedup_id: str
    producer: str
    message_type: str
    produced_at: datetime.datetime
    headers: Mapping[str, str]
    ordering_key: str | None = None


class Publisher(Protocol):
    """An outbound adapter: publishes a batch and reports per message, in order. A report is a
    DeliveryReport: delivered once the broker confirmed it (publisher confirm, PubAck, the XADD
    reply); a retryable failure for a refusal; an error starting with "ambiguous" when the outcome
    is unknown (the dispatcher retries with the same key). It never raises for a batch."""

    name: str
    #: What the broker answers a publish with, named in ambiguous reports.
    confirm: str

    async def publish(self, messages: Sequence[Outgoing]) -> list[DeliveryReport]: ...
    async def close(self) -> None: ...
