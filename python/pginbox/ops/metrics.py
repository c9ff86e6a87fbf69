"""Prometheus metrics for pginbox.

DatabaseCollector   every series of the SQL entry point inbox.metrics() (first-seen, duplicates,
                    conflicts, failures by reason code, quarantine in and out, outbox lag, storage,
                    ...), read on each scrape through a DSN or a psycopg_pool.ConnectionPool.
InboxCollector      the client side of one Inbox / AsyncInbox (Inbox.stats): transaction retries,
                    lock wait time, transient errors by SQLSTATE, outcomes.
serve(registry)     an HTTP endpoint for a registry (Prometheus text format).

Wiring it into an application, or into another exporter (e.g. the dispatcher's):

    registry = CollectorRegistry()            # or prometheus_client.REGISTRY
    registry.register(DatabaseCollector(pool))
    registry.register(InboxCollector(inbox))
    serve(registry, port=9188)

Neither collector touches the database or the inbox when it is registered (describe() is empty),
only when it is scraped. Names and labels are listed in docs/metrics.md.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol
from wsgiref.simple_server import WSGIServer

import psycopg
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from pginbox.client.outcomes import InboxStats

__all__ = [
    "METRICS_QUERY",
    "DatabaseCollector",
    "InboxCollector",
    "MetricRow",
    "RowEstimate",
    "configure",
    "count_messages",
    "fetch_metrics",
    "message_rows_estimate",
    "rollup",
    "serve",
]

# The one SQL entry point (readable by inbox_reader). Rows: metric, type, help, labels, value.
METRICS_QUERY: Final = "SELECT metric, type, help, labels, value FROM inbox.metrics()"
# A scrape must not hang on a locked catalog or a stuck server.
SCRAPE_TIMEOUT_SQL: Final = "SELECT pg_catalog.set_config('statement_timeout', %s, true)"
# The rollup a read runs need not wait for its WAL flush: lost in a crash, the next read redoes it
# (the cursor and the totals commit together). Only for the collector's own transaction.
SCRAPE_ASYNC_COMMIT_SQL: Final = "SELECT pg_catalog.set_config('synchronous_commit', 'off', true)"
# What PostgreSQL estimates inbox.message holds, and since when. reltuples is -1 until the table's
# first ANALYZE or VACUUM (inbox.metrics() then has no sample for it); the statistics views say when.
ROWS_ESTIMATE: Final = """
SELECT c.reltuples::bigint,
       greatest(s.last_analyze, s.last_autoanalyze, s.last_vacuum, s.last_autovacuum)
  FROM pg_catalog.pg_class c
  LEFT JOIN pg_catalog.pg_stat_all_tables s ON s.relid = c.oid
 WHERE c.oid = 'inbox.message'::regclass
"""
COUNT_MESSAGES: Final = "SELECT count(*) FROM inbox.message"
# `pginbox metrics rollup | configure` (inbox_operator).
ROLLUP: Final = "SELECT inbox.metrics_rollup(%(max_rows)s)"
CONFIGURE: Final = """
SELECT counting, rollup_grace::text AS rollup_grace, rollup_batch, updated_at, updated_by
  FROM inbox.configure_metrics(%(counting)s, %(grace)s::interval, %(batch)s)
"""


@dataclass(frozen=True, slots=True)
class MetricRow:
    """One series of inbox.metrics()."""

    metric: str
    type: str
    help: str
    labels: dict[str, str]
    value: float


def _row(raw: Sequence[Any]) -> MetricRow:
    labels = raw[3] if isinstance(raw[3], dict) else json.loads(raw[3] or "{}")
    return MetricRow(str(raw[0]), str(raw[1]), str(raw[2]), {str(k): str(v) for k, v in labels.items()}, float(raw[4]))


def fetch_metrics(conn: psycopg.Connection[Any], timeout_ms: int | None = None) -> list[MetricRow]:
    """Every row of inbox.metrics(), in one transaction on `conn` (committed, so the rollup it
    runs is kept; an autocommit connection works too)."""
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(SCRAPE_ASYNC_COMMIT_SQL)
        if timeout_ms is not None:
            cur.execute(SCRAPE_TIMEOUT_SQL, (f"{int(timeout_ms)}ms",))
        cur.execute(METRICS_QUERY)
        return [_row(r) for r in cur.fetchall()]


@dataclass(frozen=True)
class RowEstimate:
    """PostgreSQL's estimate of the rows in inbox.message: `rows` None before the table's first
    ANALYZE (or VACUUM); `as_of` the last of those, None when unknown (e.g. statistics reset)."""

    rows: int | None
    as_of: datetime.datetime | None


def message_rows_estimate(conn: psycopg.Connection[Any]) -> RowEstimate:
    """The planner's estimate of inbox.message's rows, and when it was made (no table access)."""
    row = conn.execute(ROWS_ESTIMATE).fetchone()
    if row is None or row[0] is None or row[0] < 0:
        return RowEstimate(None, row[1] if row is not None else None)
    return RowEstimate(int(row[0]), row[1])


def count_messages(conn: psycopg.Connection[Any]) -> int:
    """The rows of inbox.message, counted (reads the whole table)."""
    row = conn.execute(COUNT_MESSAGES).fetchone()
    assert row is not None
    return int(row[0])


def rollup(conn: psycopg.Connection[Any], max_rows: int | None = None) -> int:
    """inbox.metrics_rollup: fold new first deliveries and counted events into the totals now;
    how many it folded. `max_rows` None: the configured rollup batch."""
    row = conn.execute(ROLLUP, {"max_rows": max_rows}).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def configure(
    conn: psycopg.Connection[Any], *, counting: bool | None = None, grace: str | None = None, batch: int | None = None
) -> dict[str, Any]:
    """inbox.configure_metrics (None keeps a setting); the settings after the call."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(CONFIGURE, {"counting": counting, "grace": grace, "batch": batch}).fetchone()
    assert row is not None
    return row


def _families(rows: Iterable[MetricRow]) -> list[Metric]:
    """Prometheus metric families: one per name, with the label names of its first row."""
    families: dict[str, tuple[Metric, tuple[str, ...]]] = {}
    for row in rows:
        entry = families.get(row.metric)
        if entry is None:
            names = tuple(sorted(row.labels))
            family: Metric
            if row.type == "counter":
                family = CounterMetricFamily(row.metric, row.help, labels=names)
            else:
                family = GaugeMetricFamily(row.metric, row.help, labels=names)
            entry = families[row.metric] = (family, names)
        family, names = entry
        family.add_metric([row.labels.get(n, "") for n in names], row.value)  # type: ignore[attr-defined]
    return [family for family, _ in families.values()]


class DatabaseCollector:
    """A prometheus-client collector over inbox.metrics().

    `source` is a conninfo string (a new connection per scrape) or a psycopg_pool.ConnectionPool.
    The role needs inbox_reader (or inbox_operator). A scrape that cannot reach the database still
    answers: pginbox_database_up 0 and no database series.
    """

    def __init__(
        self, source: str | ConnectionPool[Any], *, timeout: float = 10.0, application_name: str = "pginbox-metrics"
    ) -> None:
        self._source = source
        self._timeout = timeout
        self._application_name = application_name
        self.last_error: str | None = None

    def describe(self) -> list[Metric]:
        """Nothing: registering must not query the database."""
        return []

    def rows(self) -> list[MetricRow]:
        """The rows of inbox.metrics(), read now."""
        timeout_ms = int(self._timeout * 1000)
        if isinstance(self._source, str):
            with psycopg.connect(
                self._source,
                autocommit=True,
                connect_timeout=max(1, int(self._timeout)),
                application_name=self._application_name,
            ) as conn:
                return fetch_metrics(conn, timeout_ms)
        with self._source.connection(timeout=self._timeout) as conn:
            return fetch_metrics(conn, timeout_ms)

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        try:
            rows = self.rows()
        except Exception as exc:  # a scrape reports the outage as a value, it does not fail
            self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            rows, up = [], 0.0
        else:
            self.last_error = None
            up = 1.0
        yield from _families(rows)
        yield GaugeMetricFamily("pginbox_database_up", "Whether the last read of inbox.metrics() succeeded", value=up)
        yield GaugeMetricFamily(
            "pginbox_database_scrape_seconds",
            "Time the last read of inbox.metrics() took",
            value=time.monotonic() - started,
        )


class _HasStats(Protocol):
    """What InboxCollector reads: Inbox and AsyncInbox have both."""

    @property
    def consumer(self) -> str: ...

    @property
    def stats(self) -> InboxStats: ...


class InboxCollector:
    """A prometheus-client collector over Inbox.stats() / AsyncInbox.stats() (the client side:
    retries and lock waits do not reach the database's books). Label consumer = inbox.consumer."""

    def __init__(self, inbox: _HasStats, *, consumer: str | None = None) -> None:
        self._inbox = inbox
        self._consumer = consumer if consumer is not None else inbox.consumer

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._inbox.stats
        c = self._consumer
        labels = ["consumer"]

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric([c], value)
            return family

        yield counter("pginbox_client_deliveries_total", "Messages that came back with a result", stats.deliveries)
        outcomes = CounterMetricFamily(
            "pginbox_client_outcomes_total", "Final outcomes of deliveries, by outcome", labels=["consumer", "outcome"]
        )
        for outcome, n in sorted(stats.outcomes.items(), key=lambda item: str(item[0].value)):
            outcomes.add_metric([c, str(outcome.value)], n)
        yield outcomes
        yield counter("pginbox_client_retries_total", "Whole-transaction re-runs after transient errors", stats.retries)
        yield counter(
            "pginbox_client_lock_wait_seconds_total",
            "Wall time of attempts that ended in a concurrency error (class 40, 55P03)",
            stats.lock_wait_seconds,
        )
        yield counter("pginbox_client_backoff_seconds_total", "Time slept between attempts", stats.backoff_seconds)
        transient = CounterMetricFamily(
            "pginbox_client_transient_errors_total",
            "Transient errors seen, by SQLSTATE ('connection' when there was none)",
            labels=["consumer", "sqlstate"],
        )
        for key, n in sorted(stats.transient_errors.items()):
            transient.add_metric([c, key], n)
        yield transient
        yield counter(
            "pginbox_client_unknown_commits_total",
            "COMMITs whose reply was lost with the connection",
            stats.unknown_commits,
        )
        yield counter(
            "pginbox_client_retries_exhausted_total",
            "Calls that gave up after RetryPolicy.max_attempts",
            stats.retries_exhausted,
        )


def serve(
    registry: CollectorRegistry, *, port: int = 9188, host: str = "127.0.0.1"
) -> tuple[WSGIServer, threading.Thread]:
    """Serve `registry` at http://host:port/metrics (any path answers) from a daemon thread.
    Stop it with server.shutdown(). port 0 picks a free port: server.server_port."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, thread
