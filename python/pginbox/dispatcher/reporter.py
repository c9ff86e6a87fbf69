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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from pginbox.dispatcher.log import kv, log
from pginbox.dispatcher.queries import CAN_DEFER, COMPLETE_MANY, DEFER_MANY, FAIL_MANY, REPORT_MANY
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
            return (
                self.effect_ids,
                self.lease_tokens,
                self.errors,
                self.retryables,
                self.status_codes,
                self.excerpts,
                self.durations_ms,
            )
        return self.effect_ids, self.lease_tokens, self.status_codes, self.excerpts, self.durations_ms


class Reporter:
    """The reporter thread of one dispatcher (see the module docstring)."""

    def __init__(
        self,
        name: str,
        pool: ConnectionPool[Any],
        stats: DispatcherStats,
        metrics: DispatcherMetrics,
        *,
        batch: int,
        interval: float,
        on_flushed: Callable[[list[Report]], None],
        defer_after: float = 30.0,
    ) -> None:
        self.name = name
        self.defer_after = defer_after
        self._can_defer: bool | None = None  # the schema has inbox.defer_effects (asked at the first deferral)
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
            batch = self._queue[: self.batch]
            del self._queue[: self.batch]
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
        """One statement for the batch (a second one for deferrals), then stats, metrics and one log
        line per report."""
        done, failed = _Arrays(failures=False), _Arrays(failures=True)
        deferred = _Arrays(failures=True)
        for item in batch:
            if item.report.delivered:
                done.add(item, self.name)
            elif item.report.defer is not None and self._defer_supported():
                deferred.add(item, self.name)
            else:
                failed.add(item, self.name)
        outcomes: dict[tuple[str, int], str] = {}
        statements: list[tuple[str, tuple[Any, ...], list[_Arrays]]] = []
        if done.items and failed.items:
            statements.append((REPORT_MANY, done.params() + failed.params(), [done, failed]))
        elif done.items:
            statements.append((COMPLETE_MANY, done.params(), [done]))
        elif failed.items:
            statements.append((FAIL_MANY, failed.params(), [failed]))
        if deferred.items:
            reasons = [str(item.report.defer) for item, _ in deferred.items]
            params = (
                deferred.effect_ids,
                deferred.lease_tokens,
                reasons,
                deferred.errors,
                datetime.timedelta(seconds=self.defer_after),
            )
            statements.append((DEFER_MANY, params, [deferred]))
        for query, params, arrays in statements:
            try:
                with self._pool.connection() as conn:
                    rows = conn.execute(query, params).fetchall()
            except psycopg.Error as exc:
                # the leases expire and another claim redelivers with the same effect ids
                error = str(exc).strip()
                reports = sum(len(a.items) for a in arrays)
                self._stats.add(report_errors=reports)
                self._metrics.report_errors.inc(reports)
                for a in arrays:
                    for _, fields in a.items:
                        log.error(kv("report_failed", **fields, error=error))
                for a in arrays:
                    a.items.clear()
                continue
            outcomes.update({(str(kind), int(ord_)): str(result) for kind, ord_, result in rows})
        self._record_outcomes(outcomes, done, failed, deferred)

    def _defer_supported(self) -> bool:
        """Whether the schema has inbox.defer_effects (0.3.0); before it, a deferral is reported as
        a retryable failure, as it always was."""
        if self._can_defer is None:
            try:
                with self._pool.connection() as conn:
                    row = conn.execute(CAN_DEFER).fetchone()
                self._can_defer = bool(row and row[0])
            except psycopg.Error:
                return False  # ask again next time
        return self._can_defer

    def _record_outcomes(
        self, outcomes: dict[tuple[str, int], str], done: _Arrays, failed: _Arrays, deferred: _Arrays | None = None
    ) -> None:
        """Counts, lag observations and log lines of the results SQL returned for each report
        (a report without a result row was fenced)."""
        counts = {"delivered": 0, "retried": 0, "dead": 0, "deferred": 0, "fenced": 0}
        by_destination: Counter[tuple[str, str]] = Counter()
        lags: list[float] = []
        info = log.isEnabledFor(logging.INFO)  # building a line per effect costs more than the report
        now = datetime.datetime.now(datetime.UTC)
        groups = [("complete", done), ("fail", failed)] + ([("defer", deferred)] if deferred is not None else [])
        for kind, arrays in groups:
            for n, (item, fields) in enumerate(arrays.items, start=1):
                outcome = outcomes.get((kind, n), "fenced")
                destination = item.effect.destination
                if kind == "defer" and outcome == "pending":
                    counts["deferred"] += 1
                    by_destination["deferred", destination] += 1
                    self._stats.destination_outcome(destination, item.report.defer)
                    log.warning(
                        kv(
                            "effect_deferred",
                            **fields,
                            reason=item.report.defer,
                            retry_in_seconds=f"{self.defer_after:g}",
                        )
                    )
                elif outcome == "delivered":
                    created = item.effect.created_at
                    lag = max((now - created).total_seconds(), 0.0) if created is not None else 0.0
                    counts["delivered"] += 1
                    by_destination["delivered", destination] += 1
                    if self._stats.deferring:
                        self._stats.destination_outcome(destination, None)
                    lags.append(lag)
                    self._metrics.lag.labels(destination).observe(lag)
                    if info:
                        log.info(kv("effect_delivered", **fields, lag_seconds=f"{lag:.3f}"))
                elif outcome == "fenced":
                    counts["fenced"] += 1
                    self._metrics.fenced_out.labels(kind).inc()
                    log.warning(kv("report_fenced", **fields, report=kind))
                elif outcome == "dead":
                    counts["dead"] += 1
                    by_destination["dead", destination] += 1
                    log.warning(kv("effect_dead", **fields, retryable=item.report.retryable))
                else:
                    counts["retried"] += 1
                    by_destination["retried", destination] += 1
                    if info:
                        log.info(kv("effect_retry", **fields))
        self._stats.record_lags(lags)
        self._stats.add(**counts)
        metric = {
            "delivered": self._metrics.delivered,
            "retried": self._metrics.retried,
            "dead": self._metrics.dead,
            "deferred": self._metrics.deferred,
        }
        for (outcome, destination), n in by_destination.items():
            metric[outcome].labels(destination).inc(n)
