"""The demo's broker: an in-process queue with at-least-once semantics, shared by acts 2 and 3.

Every publish is a broker message of its own (`tag`), even when its content repeats an earlier one
(a producer re-send, a replay). A message leaves only when a delivery of it is acked. A delivery
not acked within the visibility timeout, or nacked, is handed out again (after `nack_delay`) with
redelivered=True. With probability `race_rate` a delivery is also copied to the front of the
queue, so that a second worker gets the same message at the same time (not flagged: brokers do not
know they duplicated).
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Broker", "Delivery"]

M = TypeVar("M")


@dataclass(frozen=True)
class Delivery(Generic[M]):
    delivery_id: int
    tag: int  # the broker message delivered
    message: M
    redelivered: bool  # the broker says so: it handed this message out before without an ack
    raced: bool = False  # a copy handed out while another delivery of the message was in flight


class Broker(Generic[M]):
    """See the module docstring. `stats` counts deliveries, redeliveries, raced copies, acks, nacks
    and visibility timeouts."""

    def __init__(self, rng: random.Random, *, visibility_timeout: float, nack_delay: float,
                 race_rate: float = 0.0) -> None:
        self._rng = rng
        self._visibility_timeout = visibility_timeout
        self._nack_delay = nack_delay
        self._race_rate = race_rate
        self._cond = threading.Condition()
        # (ready_at, seq, tag, message, redelivered, raced); seq is unique, so messages are never compared
        self._ready: list[tuple[float, int, int, M, bool, bool]] = []
        self._inflight: dict[int, tuple[int, M, float]] = {}  # delivery_id -> (tag, message, deadline)
        self._inflight_tags: Counter[int] = Counter()  # tag -> deliveries of it in flight
        self._acked: set[int] = set()
        self._published = 0
        self._seq = 0
        self._closed = False
        self.stats: Counter[str] = Counter()

    def _push(self, ready_at: float, tag: int, message: M, redelivered: bool, raced: bool = False) -> None:
        self._seq += 1
        heapq.heappush(self._ready, (ready_at, self._seq, tag, message, redelivered, raced))

    def publish(self, message: M, *, redelivered: bool = False) -> int:
        """Queue `message` (redelivered: as the copy of a delivery whose ack was lost); its tag."""
        with self._cond:
            tag = self._published
            self._published += 1
            self._push(time.monotonic(), tag, message, redelivered)
            self._cond.notify()
            return tag

    def close(self) -> None:
        """The producer is done: once everything is acked, receive() returns None for good."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def is_acked(self, tag: int) -> bool:
        with self._cond:
            return tag in self._acked

    def backlog(self) -> int:
        with self._cond:
            return len(self._ready)

    def in_flight(self) -> int:
        with self._cond:
            return len(self._inflight)

    def drained(self) -> bool:
        with self._cond:
            return self._drained()

    def _drained(self) -> bool:
        return self._closed and len(self._acked) == self._published

    def unacked(self) -> int:
        with self._cond:
            return self._published - len(self._acked)

    def _expire(self, now: float) -> float | None:
        """Redeliver expired deliveries; return the next deadline."""
        next_deadline = None
        for delivery_id, (tag, message, deadline) in list(self._inflight.items()):
            if deadline <= now:
                self._forget(delivery_id)
                if tag not in self._acked:
                    self.stats["visibility_timeouts"] += 1
                    self._push(now, tag, message, True)
            elif next_deadline is None or deadline < next_deadline:
                next_deadline = deadline
        return next_deadline

    def receive(self, timeout: float = 0.1) -> Delivery[M] | None:
        """The next delivery, or None after `timeout` (or when drained)."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                now = time.monotonic()
                next_deadline = self._expire(now)
                while self._ready and self._ready[0][0] <= now:
                    _, _, tag, message, redelivered, raced = heapq.heappop(self._ready)
                    if tag in self._acked:
                        continue  # acked meanwhile: a stale copy
                    self._seq += 1
                    delivery = Delivery(self._seq, tag, message, redelivered, raced)
                    if raced:
                        self.stats["raced_copies"] += 1
                        if self._inflight_tags[tag]:
                            self.stats["raced_concurrently"] += 1
                    self._inflight[delivery.delivery_id] = (tag, message, now + self._visibility_timeout)
                    self._inflight_tags[tag] += 1
                    self.stats["deliveries"] += 1
                    if redelivered:
                        self.stats["redeliveries"] += 1
                    if not raced and self._race_rate and self._rng.random() < self._race_rate:
                        self._push(0.0, tag, message, False, raced=True)
                        self._cond.notify()
                    return delivery
                if self._drained() or now >= end:
                    return None
                wake = end
                if next_deadline is not None:
                    wake = min(wake, next_deadline)
                if self._ready:
                    wake = min(wake, self._ready[0][0])
                self._cond.wait(max(wake - now, 0.001))

    def _forget(self, delivery_id: int) -> None:
        found = self._inflight.pop(delivery_id, None)
        if found is not None:
            self._inflight_tags[found[0]] -= 1

    def ack(self, delivery: Delivery[M]) -> None:
        with self._cond:
            self._forget(delivery.delivery_id)
            self._acked.add(delivery.tag)
            self.stats["acks"] += 1
            self._cond.notify_all()

    def nack(self, delivery: Delivery[M]) -> None:
        with self._cond:
            self._forget(delivery.delivery_id)
            if delivery.tag not in self._acked:
                self._push(time.monotonic() + self._nack_delay, delivery.tag, delivery.message, True)
            self.stats["nacks"] += 1
            self._cond.notify()
