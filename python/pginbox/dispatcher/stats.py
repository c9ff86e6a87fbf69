"""What the dispatcher counts: DispatcherStats (read by health() and the CLI) and its Prometheus
metrics (pginbox_dispatcher_*, in a registry of the dispatcher's own)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from pginbox.runtime.metrics import Metrics

__all__ = ["LAG_BUCKETS", "DispatcherMetrics", "DispatcherStats"]


@dataclass
class DispatcherStats:
    """Counters since the dispatcher started (read them; the dispatcher updates them under a lock)."""

    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    deferred: int = 0
    fenced: int = 0
    extend_fenced: int = 0
    report_errors: int = 0
    reconnects: int = 0
    lag_seconds_last: float | None = None
    lag_seconds_max: float = 0.0
    lag_seconds_total: float = 0.0
    #: destination -> the reason of its last deferral (no_transport, unroutable, no_stream), until
    #: an effect of it is delivered again.
    deferring: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def destination_outcome(self, destination: str, deferred: str | None) -> None:
        """A deferral (its reason) or a delivery (None) of an effect of `destination`."""
        with self._lock:
            if deferred is not None:
                self.deferring[destination] = deferred
            else:
                self.deferring.pop(destination, None)

    def deferring_now(self) -> dict[str, str]:
        with self._lock:
            return dict(sorted(self.deferring.items()))

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def record_lags(self, lags: list[float]) -> None:
        """Lags of deliveries recorded together (the last one is lag_seconds_last)."""
        if not lags:
            return
        with self._lock:
            self.lag_seconds_last = lags[-1]
            self.lag_seconds_max = max(self.lag_seconds_max, *lags)
            self.lag_seconds_total += sum(lags)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            mean = self.lag_seconds_total / self.delivered if self.delivered else None
            return {
                "claimed": self.claimed,
                "delivered": self.delivered,
                "retried": self.retried,
                "dead": self.dead,
                "deferred": self.deferred,
                "fenced": self.fenced,
                "extend_fenced": self.extend_fenced,
                "report_errors": self.report_errors,
                "reconnects": self.reconnects,
                "lag_seconds_last": self.lag_seconds_last,
                "lag_seconds_max": self.lag_seconds_max,
                "lag_seconds_mean": mean,
            }


# Lag from an effect's created_at (its enqueuing transaction's start) to the recorded delivery.
LAG_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    21600.0,
    86400.0,
)


class DispatcherMetrics:
    """The dispatcher's Prometheus metrics, in a registry of its own (never the global one)."""

    def __init__(self, registry: CollectorRegistry, in_flight: Callable[[], float]) -> None:
        metrics = Metrics("pginbox_dispatcher", registry)
        counter = metrics.counter

        # Per destination: with several, which one retries or dies is the first question.
        by = ("destination",)
        self.claimed = counter("claimed", "Effects claimed (each claim is one delivery attempt)", by)
        self.delivered = counter("delivered", "Effects delivered (complete_effect accepted)", by)
        self.retried = counter("retried", "Failed attempts to be retried after a backoff (fail_effect -> pending)", by)
        self.dead = counter("dead", "Effects given up (fail_effect -> dead)", by)
        self.deferred = counter(
            "deferred",
            "Effects handed back without spending an attempt: no transport configured "
            "for the destination, or the broker cannot route yet (defer_effects)",
            by,
        )
        self.fenced_out = counter(
            "fenced_out", "Reports refused by fencing: the lease was no longer current", ("report",)
        )
        for report in ("complete", "fail", "extend"):
            self.fenced_out.labels(report)
        self.report_errors = counter("report_errors", "Reports that failed with a database error (the lease expires)")
        self.reconnects = counter("listen_reconnects", "Reconnections of the LISTEN session")
        self.failovers = counter("failovers", "Database failovers noticed (a new connection on a new WAL timeline)")
        self.lag = metrics.histogram(
            "lag_seconds", "Effect created_at (its transaction's start) to delivery recorded, seconds", LAG_BUCKETS, by
        )
        self.in_flight = metrics.gauge("in_flight", "Deliveries in flight")
        self._per_destination = (self.claimed, self.delivered, self.retried, self.dead, self.deferred, self.lag)
        self.in_flight.set_function(in_flight)

    def destinations(self, names: Iterable[str]) -> None:
        """Every per-destination series of these destinations, at 0 from the start: a rate() or an
        alert on a destination's dead effects works before its first one."""
        for name in names:
            for metric in self._per_destination:
                metric.labels(name)
