"""The in-memory adapter: a broker inside the process, for the fast test tier and the demo.

`MemoryBroker` keeps named queues with at-least-once semantics, as a real broker does: every
publish is a message of its own (a tag), even when it repeats an earlier one; a message leaves only
when a delivery of it is acked; a delivery not settled within the visibility timeout, handed back,
or held by a connection that closed, is delivered again, marked redelivered; `retry` acks it and
queues a copy (not marked) that becomes visible after the delay. With probability `race_rate` a
delivery is also copied to the front of its queue, so that a second worker gets the same message
at the same time (not marked: brokers do not know they duplicated). It is thread-safe; its calls
never block except `receive`, up to its timeout.

`MemorySource` is the port's Broker over one queue of a MemoryBroker (`pginbox consume --url
memory://NAME --queue Q` within one process: MemoryBroker.named(NAME)); `MemoryPublisher` /
`MemoryTransport` publish effects to a queue with the identity in the Pginbox-* headers, as JetStream
and Redis carry them. Nothing survives the process: a crash of the consumer is its task or thread
dying without settling (the visibility timeout hands its deliveries out again), not a SIGKILL.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pginbox.brokers.port import Delivery, Outgoing, SourceConfig
from pginbox.brokers.publish import BrokerDestination
from pginbox.brokers.wire import dead_letter_headers, identity_headers
from pginbox.errors import BrokerError
from pginbox.transports.protocol import DeliveryReport

__all__ = ["MemoryBroker", "MemoryHandle", "MemoryPublisher", "MemorySource", "MemoryTransport", "StoredMessage"]


@dataclass(frozen=True)
class StoredMessage:
    """One published message: its body and headers."""

    body: bytes
    headers: Mapping[str, str]


@dataclass(frozen=True)
class MemoryHandle:
    """`Delivery.raw` of the in-memory broker: which message (`tag`) of which queue, which delivery
    of it, and whether it is a raced copy."""

    queue: str
    tag: int
    delivery_id: int
    owner: int
    raced: bool = False


@dataclass
class _Queue:
    ready: list[tuple[float, int, int, bool, bool]] = field(default_factory=list)  # ready_at, seq, tag, redel., raced
    messages: dict[int, StoredMessage] = field(default_factory=dict)
    inflight: dict[int, tuple[int, float, int]] = field(default_factory=dict)  # delivery -> tag, deadline, owner
    inflight_tags: Counter[int] = field(default_factory=Counter)
    acked: set[int] = field(default_factory=set)
    published: int = 0
    closed: bool = False


class MemoryBroker:
    """See the module docstring. `stats` counts deliveries, redeliveries, raced copies, acks,
    nacks (hand-backs), retries, dead letters and visibility timeouts."""

    _named: ClassVar[dict[str, MemoryBroker]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self, *, visibility_timeout: float = 30.0, race_rate: float = 0.0, rng: random.Random | None = None
    ) -> None:
        self.visibility_timeout = visibility_timeout
        self.race_rate = race_rate
        self._rng = rng or random.Random()
        self._cond = threading.Condition()
        self._queues: dict[str, _Queue] = {}
        self._seq = 0
        self.stats: Counter[str] = Counter()

    @classmethod
    def named(cls, name: str) -> MemoryBroker:
        """The process-wide broker called `name` (`memory://name`), created on first use."""
        with cls._named_lock:
            found = cls._named.get(name)
            if found is None:
                found = cls._named[name] = cls()
            return found

    # ------------------------------------------------------------------ producing

    def _queue(self, name: str) -> _Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _Queue()
        return q

    def _push(self, q: _Queue, ready_at: float, tag: int, redelivered: bool, raced: bool = False) -> None:
        self._seq += 1
        heapq.heappush(q.ready, (ready_at, self._seq, tag, redelivered, raced))

    def publish(
        self,
        queue: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        redelivered: bool = False,
        delay: float = 0.0,
    ) -> int:
        """Queue a message (redelivered: as the copy of a delivery whose ack was lost); its tag."""
        with self._cond:
            q = self._queue(queue)
            tag = q.published
            q.published += 1
            q.messages[tag] = StoredMessage(bytes(body), dict(headers or {}))
            self._push(q, time.monotonic() + delay, tag, redelivered)
            self._cond.notify_all()
            return tag

    def close(self, queue: str) -> None:
        """The producer of `queue` is done: once everything is acked, it is drained."""
        with self._cond:
            self._queue(queue).closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ consuming

    def _expire(self, q: _Queue, now: float) -> float | None:
        """Hand out again what passed its visibility timeout; the next deadline."""
        next_deadline = None
        for delivery_id, (tag, deadline, _owner) in list(q.inflight.items()):
            if deadline <= now:
                self._forget(q, delivery_id)
                if tag not in q.acked:
                    self.stats["visibility_timeouts"] += 1
                    self._push(q, now, tag, True)
            elif next_deadline is None or deadline < next_deadline:
                next_deadline = deadline
        return next_deadline

    def _take(self, queue: str, q: _Queue, now: float, owner: int) -> Delivery | None:
        while q.ready and q.ready[0][0] <= now:
            _, _, tag, redelivered, raced = heapq.heappop(q.ready)
            if tag in q.acked:
                continue  # acked meanwhile: a stale copy
            self._seq += 1
            handle = MemoryHandle(queue, tag, self._seq, owner, raced)
            if raced:
                self.stats["raced_copies"] += 1
                if q.inflight_tags[tag]:
                    self.stats["raced_concurrently"] += 1
            q.inflight[handle.delivery_id] = (tag, now + self.visibility_timeout, owner)
            q.inflight_tags[tag] += 1
            self.stats["deliveries"] += 1
            if redelivered:
                self.stats["redeliveries"] += 1
            if not raced and self.race_rate and self._rng.random() < self.race_rate:
                self._push(q, 0.0, tag, False, raced=True)
            stored = q.messages[tag]
            return Delivery(stored.body, {"queue": queue}, stored.headers, redelivered, handle)
        return None

    def receive_many(self, queue: str, max_messages: int, timeout: float = 0.0, *, owner: int = 0) -> list[Delivery]:
        """Up to `max_messages` deliveries, waiting up to `timeout` s for the first."""
        end = time.monotonic() + timeout
        with self._cond:
            q = self._queue(queue)
            while True:
                now = time.monotonic()
                next_deadline = self._expire(q, now)
                out: list[Delivery] = []
                while len(out) < max_messages and (d := self._take(queue, q, now, owner)) is not None:
                    out.append(d)
                if out or now >= end or self._drained(q):
                    return out
                wake = end
                if next_deadline is not None:
                    wake = min(wake, next_deadline)
                if q.ready:
                    wake = min(wake, q.ready[0][0])
                self._cond.wait(max(wake - now, 0.001))

    def receive(self, queue: str, timeout: float = 0.1) -> Delivery | None:
        """The next delivery, or None after `timeout` (or when drained)."""
        got = self.receive_many(queue, 1, timeout)
        return got[0] if got else None

    def _forget(self, q: _Queue, delivery_id: int) -> int | None:
        found = q.inflight.pop(delivery_id, None)
        if found is None:
            return None
        q.inflight_tags[found[0]] -= 1
        return found[0]

    def _settle(self, delivery: Delivery) -> tuple[_Queue, MemoryHandle]:
        handle = delivery.raw
        if not isinstance(handle, MemoryHandle):
            raise BrokerError("not a delivery of the in-memory broker")
        q = self._queue(handle.queue)
        self._forget(q, handle.delivery_id)
        return q, handle

    def ack(self, delivery: Delivery) -> None:
        with self._cond:
            q, handle = self._settle(delivery)
            q.acked.add(handle.tag)
            self.stats["acks"] += 1
            self._cond.notify_all()

    def nack(self, delivery: Delivery, delay: float = 0.0) -> None:
        """Hand it back unsettled: delivered again after `delay`, marked redelivered."""
        with self._cond:
            q, handle = self._settle(delivery)
            if handle.tag not in q.acked:
                self._push(q, time.monotonic() + delay, handle.tag, True)
            self.stats["nacks"] += 1
            self._cond.notify_all()

    def retry(self, delivery: Delivery, delay: float) -> None:
        """Ack it and queue a copy (a new message, not marked redelivered) visible after `delay`."""
        with self._cond:
            q, handle = self._settle(delivery)
            stored = q.messages[handle.tag]
            q.acked.add(handle.tag)
            self.stats["retries"] += 1
        self.publish(handle.queue, stored.body, stored.headers, delay=delay)

    def dead_letter(self, delivery: Delivery, target: str, sqlstate: str, reason: str) -> None:
        """Publish a copy to the queue `target` with the dead-letter headers, then ack it."""
        handle = delivery.raw
        if not isinstance(handle, MemoryHandle):
            raise BrokerError("not a delivery of the in-memory broker")
        headers = {
            **{str(k): str(v) for k, v in delivery.headers.items()},
            **dead_letter_headers(sqlstate, reason, handle.queue),
        }
        self.publish(target, delivery.body, headers)
        with self._cond:
            self.stats["dead_letters"] += 1
        self.ack(delivery)

    def release(self, owner: int) -> int:
        """A connection closed: every delivery `owner` holds is handed out again, marked
        redelivered. How many."""
        released = 0
        with self._cond:
            now = time.monotonic()
            for q in self._queues.values():
                for delivery_id, (tag, _deadline, held_by) in list(q.inflight.items()):
                    if held_by == owner:
                        self._forget(q, delivery_id)
                        if tag not in q.acked:
                            self._push(q, now, tag, True)
                            released += 1
            self._cond.notify_all()
        return released

    # ------------------------------------------------------------------ looking

    def _drained(self, q: _Queue) -> bool:
        return q.closed and len(q.acked) == q.published

    def drained(self, queue: str) -> bool:
        with self._cond:
            return self._drained(self._queue(queue))

    def is_acked(self, queue: str, tag: int) -> bool:
        with self._cond:
            return tag in self._queue(queue).acked

    def backlog(self, queue: str) -> int:
        """Messages waiting to be delivered (copies included)."""
        with self._cond:
            return len(self._queue(queue).ready)

    def in_flight(self, queue: str) -> int:
        with self._cond:
            return len(self._queue(queue).inflight)

    def unacked(self, queue: str) -> int:
        """Messages published and not acked yet."""
        with self._cond:
            q = self._queue(queue)
            return q.published - len(q.acked)

    def messages(self, queue: str) -> list[StoredMessage]:
        """Every message published to `queue` and not acked (a dead-letter queue's content)."""
        with self._cond:
            q = self._queue(queue)
            return [m for tag, m in sorted(q.messages.items()) if tag not in q.acked]

    def delete(self, queue: str) -> None:
        with self._cond:
            self._queues.pop(queue, None)


class MemorySource:
    """The port's Broker over the queue `config.queue` of a MemoryBroker (given, or the named one
    of `config.url`, memory://NAME)."""

    name = "memory"

    def __init__(self, config: SourceConfig, broker: MemoryBroker | None = None) -> None:
        if not config.queue:
            raise BrokerError("the in-memory adapter needs a queue")
        self.config = config
        self.queue = config.queue
        self.broker = broker
        self._connected = False

    async def connect(self) -> None:
        if self.broker is None:
            scheme, _, name = self.config.url.partition("://")
            if scheme != "memory" or not name:
                raise BrokerError(f"the in-memory adapter needs memory://NAME, got {self.config.url!r}")
            self.broker = MemoryBroker.named(name)
        self._connected = True

    def _broker(self) -> MemoryBroker:
        if self.broker is None or not self._connected:
            raise BrokerError("in-memory broker: not connected")
        return self.broker

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        broker = self._broker()
        end = time.monotonic() + timeout
        while True:  # polls: a blocking wait would stop the event loop
            got = broker.receive_many(self.queue, max_messages, owner=id(self))
            if got or time.monotonic() >= end:
                return got
            await asyncio.sleep(min(0.005, max(end - time.monotonic(), 0.0)))

    async def ack(self, delivery: Delivery) -> None:
        self._broker().ack(delivery)

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            await self.ack(delivery)

    async def retry(self, delivery: Delivery, delay: float) -> None:
        self._broker().retry(delivery, delay)

    async def dead_letter(self, delivery: Delivery, sqlstate: str, reason: str) -> None:
        self._broker().dead_letter(delivery, self.config.dead_letter, sqlstate, reason)

    async def hand_back(self, delivery: Delivery, delay: float) -> None:
        self._broker().nack(delivery, delay)

    async def close(self) -> None:
        if self.broker is not None and self._connected:
            self.broker.release(id(self))
        self._connected = False


class MemoryPublisher:
    name = "memory"
    confirm = "publish"

    def __init__(self, broker: MemoryBroker, queue: str) -> None:
        self.broker = broker
        self.queue = queue

    async def publish(self, messages: Sequence[Outgoing]) -> list[DeliveryReport]:
        for out in messages:
            self.broker.publish(self.queue, out.body, identity_headers(out))
        return [DeliveryReport.ok() for _ in messages]

    async def close(self) -> None:
        return None


class MemoryTransport(BrokerDestination):
    """A dispatcher destination publishing to a queue of a MemoryBroker."""

    def __init__(
        self,
        broker: MemoryBroker,
        queue: str,
        *,
        producer: str = "pginbox",
        message_type: str | None = None,
        destination: str = "",
    ) -> None:
        super().__init__(
            MemoryPublisher(broker, queue), producer=producer, message_type=message_type, destination=destination
        )
