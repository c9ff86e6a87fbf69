"""The dispatcher's reporter: one thread that records finished deliveries in batches.

Reports wait in a queue; the reporter flushes `batch` of them, or what has waited `interval`
seconds, whichever comes first, with ONE statement (inbox.complete_effects and/or
inbox.fail_effects: one implicit transaction, one commit), then counts, observes and logs each
report. After every flush, `on_flushed(batch)` hands the batch back to the dispatcher (its effects
leave the in-flight set), whether the statement succeeded or not: a failed flush leaves the leases
to expire, and another claim redelivers with the same effect ids. close() flushes what is queued.

Values go to SQL as the transport reported them (SQL cuts excerpts and errors to 2000 characters
itself), with two exceptions whose reasons are in `_Arrays.add`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from pginbox.dispatcher.log import kv, log
from pginbox.dispatcher.queries import COMPLETE_MANY, FAIL_MANY, REPORT_MANY
from pginbox.dispatcher.stats import DispatcherMetrics, DispatcherStats
from pginbox.transports.effect import Effect
from pginbox.transports.protocol import DeliveryReport

__all__ = ["Report", "Reporter"]


@dataclass
class Report:
    """A finished attempt waiting for the reporter. `release`: the delivery is over (the effect
    leaves the in-flight set once the report is flushed); False for a timed-out delivery's
    report, whose hung call still runs."""

    effect: Effect
    report: DeliveryReport
    duration_ms: int
    release: bool


@dataclass
class _Arrays:
    """The array arguments of one report statement, plus each report's log fields."""

    failures: bool
    items: list[tuple[Report, dict[str, object]]] = field(default_factory=list)
    effect_ids: list[str] = field(default_factory=list)
    lease_tokens: list[int] = field(default_factory=list)
    status_codes: list[int | None] = field(default_factory=list)
    excerpts: list[str | None] = field(default_factory=list)
    durations_ms: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    retryables: list[bool] = field(default_factory=list)

    def add(self, item: Report, dispatcher: str) -> None:
        report = item.report
        # SQL refuses a status outside 100-599 for the WHOLE statement (22023), and a transport can
        # return one (a misbehaving server, a callable's own DeliveryReport): it is recorded as
        # unknown (NULL) rather than letting one report fail the batch.
        status_code = report.status_code if report.status_code is None or 100 <= report.status_code <= 599 else None
        fields: dict[str, object] = {
            "dispatcher": dispatcher,
            "effect_id": item.effect.effect_id,
            "destination": item.effect.destination,
            "attempt": item.effect.attempts,
            "lease_token": item.effect.lease_token,
            "status_code": status_code,
            "duration_ms": item.duration_ms,
        }
        self.items.append((item, fields))
        self.effect_ids.append(item.effect.effect_id)
        self.lease_tokens.append(item.effect.lease_token)
        self.status_codes.append(status_code)
        self.excerpts.append(report.response_excerpt or None)  # an empty body is no excerpt
        self.durations_ms.append(item.duration_ms)  # from time.monotonic(): never negative
        if self.failures:
            # SQL refuses an error without a visible character for the whole statement; a
            # transport can return one: it becomes "failed".
            error = (report.error or "").strip() or "failed"
            fields["error"] = error
            self.errors.append(error)
            self.retryables.append(report.retryable)

    def params(self) -> tuple[list[Any], ...]:
        if self.failures:
            return (self.effect_ids, self.lease_tokens, self.errors, self.retryables, self.status_codes,
                    self.excerpts, self.durations_ms)
        return self.effect_ids, self.lease_tokens, self.status_codes, self.excerpts, self.durations_ms


class Reporter:
    """The reporter thread of one dispatcher (see the module docstring)."""

    def __init__(self, name: str, pool: ConnectionPool[Any], stats: DispatcherStats, metrics: DispatcherMetrics, *,
                 batch: int, interval: float, on_flushed: Callable[[list[Report]], None]) -> None:
        self.name = name
        self.batch = batch
        self.interval = interval
        self._pool = pool
        self._stats = stats
        self._metrics = metrics
        self._on_flushed = on_flushed
        self._queue: list[Report] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"report-{name}", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def put(self, item: Report) -> None:
        """Queue a report (flushed within `interval`)."""
        with self._cond:
            self._queue.append(item)
            if len(self._queue) == 1 or len(self._queue) >= self.batch:
                self._cond.notify()

    def close(self) -> None:
        """Flush everything queued, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _next_batch(self) -> list[Report] | None:
        """`batch` reports, or what has waited `interval`; None when stopping with nothing left."""
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if not self._queue:
                return None
            deadline = time.monotonic() + self.interval
            while len(self._queue) < self.batch and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch = self._queue[:self.batch]
            del self._queue[:self.batch]
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self.flush(batch)
            except Exception:  # never lose the in-flight bookkeeping (the leases expire: redelivered)
                log.exception(kv("report_crashed", dispatcher=self.name, reports=len(batch)))
            finally:
                self._on_flushed(batch)

    def flush(self, batch: list[Report]) -> None:
        """One statement for the batch, then stats, metrics and one log line per report."""
        done, failed = _Arrays(failures=False), _Arrays(failures=True)
        for item in batch:
            (done if item.report.delivered else failed).add(item, self.name)
        if done.items and failed.items:
            query, params = REPORT_MANY, done.params() + failed.params()
        elif done.items:
            query, params = COMPLETE_MANY, done.params()
        else:
            query, params = FAIL_MANY, failed.params()
        try:
            with self._pool.connection() as conn:
                rows = conn.execute(query, params).fetchall()
        except psycopg.Error as exc:
            # the leases expire and another claim redelivers with the same effect ids
            error = str(exc).strip()
            self._stats.add(report_errors=len(batch))
            self._metrics.report_errors.inc(len(batch))
            for _, fields in done.items + failed.items:
                log.error(kv("report_failed", **fields, error=error))
            return
        self._record_outcomes({(str(kind), int(ord_)): str(result) for kind, ord_, result in rows}, done, failed)

    def _record_outcomes(self, outcomes: dict[tuple[str, int], str], done: _Arrays, failed: _Arrays) -> None:
        """Counts, lag observations and log lines of the results SQL returned for each report
        (a report without a result row was fenced)."""
        counts = {"delivered": 0, "retried": 0, "dead": 0, "fenced": 0}
        lags: list[float] = []
        info = log.isEnabledFor(logging.INFO)  # building a line per effect costs more than the report
        now = datetime.datetime.now(datetime.UTC)
        for kind, arrays in (("complete", done), ("fail", failed)):
            for n, (item, fields) in enumerate(arrays.items, start=1):
                outcome = outcomes.get((kind, n), "fenced")
                if outcome == "delivered":
                    created = item.effect.created_at
                    lag = max((now - created).total_seconds(), 0.0) if created is not None else 0.0
                    counts["delivered"] += 1
                    lags.append(lag)
                    self._metrics.lag.observe(lag)
                    if info:
                        log.info(kv("effect_delivered", **fields, lag_seconds=f"{lag:.3f}"))
                elif outcome == "fenced":
                    counts["fenced"] += 1
                    self._metrics.fenced_out.labels(kind).inc()
                    log.warning(kv("report_fenced", **fields, report=kind))
                elif outcome == "dead":
                    counts["dead"] += 1
                    log.warning(kv("effect_dead", **fields, retryable=item.report.retryable))
                else:
                    counts["retried"] += 1
                    if info:
                        log.info(kv("effect_retry", **fields))
        self._stats.record_lags(lags)
        self._stats.add(**counts)
        self._metrics.delivered.inc(counts["delivered"])
        self._metrics.retried.inc(counts["retried"])
        self._metrics.dead.inc(counts["dead"])
