"""The outbox dispatcher: claims committed effects, delivers them through a transport, reports.

    dispatcher = Dispatcher(dsn, "disp-1", {"crm": CallableTransport(send_to_crm)})
    dispatcher.run_once()      # drain what is due, then return (cron, tests)
    dispatcher.run()           # the daemon loop, until stop() (SIGTERM/SIGINT in the CLI)

It follows the wake-up protocol of docs/outbox.md §7: claim until a claim returns nothing; then
register idle (inbox.dispatcher_idle), claim once more (catch-up), and wait for a notification on
channel `inbox_outbox`, claiming after each wait, the waits growing from `settle` up to
`poll_interval` (polling stays behind the signal). The LISTEN connection is its own autocommit
session, reconnected with capped, jittered exponential backoff, followed by a catch-up claim; an
idle LISTEN connection is probed with SELECT 1. Claims and reports use a separate pool.

Every delivery carries the effect's `effect_id` as its idempotency key, on every attempt: an
exception from a transport is an ambiguous outcome (the destination may have acted) and is
reported as a retryable failure, so the retry carries the same key. Reports refused by fencing
(the lease expired and another dispatcher took the effect) are counted and dropped.

Claimed effects wait in a queue per destination, drained by at most `concurrency_per_destination`
delivery tasks (one executor task per free slot, not per effect). Finished deliveries put their
report on the report queue; one reporter thread flushes it every `report_batch` reports or
`report_interval` seconds, whichever comes first, with ONE statement (inbox.complete_effects and
inbox.fail_effects, one implicit transaction, one commit). An effect stays in flight (and its
lease is extended as needed) until its report is flushed; the flush interval is far below the
lease (at most lease / 10, enforced), so a queued report is recorded long before the lease ends.
close() (and so SIGTERM in the CLI) flushes the queue before it returns; if the process dies with
reports queued, those effects are redelivered with the same key once their leases expire (the
at-least-once contract). A claim that fails with a database error is retried with capped,
jittered exponential backoff; run_once() raises ClaimError after `claim_retries` failures in a row.

Observability: `dispatcher.health()` says whether the LISTEN session is up and the loop ran
recently; `dispatcher.registry` is a prometheus-client registry of its own with the counters
(pginbox_dispatcher_*: claimed, delivered, retried, dead, fenced_out by report, report errors,
LISTEN reconnects), the lag histogram (created_at -> delivery recorded) and the in-flight gauge;
more collectors can be registered on it (`extra_collectors=` or `dispatcher.registry.register`).
`HealthServer(dispatcher, host, port)` serves GET /healthz and GET /metrics (`pginbox dispatch
--health-port`). Every delivered, retried, dead and fenced report is logged (logger
pginbox.dispatcher) as one `event key=value ...` line with effect_id, destination, attempt and
duration_ms.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector
from psycopg.abc import Buffer
from psycopg.rows import dict_row
from psycopg.types.json import JsonbLoader
from psycopg_pool import ConnectionPool

from pginbox.errors import ClaimError
from pginbox.transports.webhook import CallableTransport, DeliveryReport, Transport

__all__ = [
    "CHANNEL",
    "CallableTransport",
    "ClaimError",
    "DeliveryReport",
    "Dispatcher",
    "DispatcherStats",
    "Effect",
    "HealthServer",
    "Transport",
    "TransportResolver",
]

log = logging.getLogger("pginbox.dispatcher")

CHANNEL = "inbox_outbox"

_CLAIM = (
    "SELECT effect_id, destination, payload, headers, ordering_key, attempts, lease_token, lease_expires_at,"
    " created_at FROM inbox.claim_effects(%s, %s, %s)"
)
# Set-based reports: one row per report (ord = position in the arrays, from 1), in one statement.
_COMPLETE_MANY = (
    "SELECT 'complete' AS report, ord, result FROM inbox.complete_effects("
    "%s::text[], %s::bigint[], %s::integer[], %s::text[], %s::integer[])"
)
_FAIL_MANY = (
    "SELECT 'fail' AS report, ord, result FROM inbox.fail_effects("
    "%s::text[], %s::bigint[], %s::text[], %s::boolean[], %s::integer[], %s::text[], %s::integer[])"
)
_REPORT_MANY = _COMPLETE_MANY + " UNION ALL " + _FAIL_MANY
_REPORT_LIMIT = 1000  # the most reports inbox.complete_effects / fail_effects take per call
_EXTEND = "SELECT inbox.extend_lease(%s, %s, %s)"
_IDLE = "SELECT inbox.dispatcher_idle(%s, %s)"
_EXCERPT = 2000


class _JsonbLoader(JsonbLoader):
    """jsonb -> Python as psycopg does, without parsing the usual empty headers object."""

    def load(self, data: Buffer) -> Any:
        if data == b"{}":  # (text format, as the claim query fetches it)
            return {}
        return super().load(data)


def _kv(event: str, **fields: object) -> str:
    """A structured log line: `event key=value ...` (values with spaces quoted)."""
    parts = [event]
    for key, value in fields.items():
        text = "-" if value is None else str(value)
        if not text or any(c.isspace() or c in '"=' for c in text):
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        parts.append(f"{key}={text}")
    return " ".join(parts)


@dataclass(frozen=True)
class Effect:
    """One claimed effect, as inbox.claim_effects returned it. `effect_id` is the idempotency key."""

    effect_id: str
    destination: str
    payload: Any
    headers: dict[str, str]
    ordering_key: str | None
    attempts: int
    lease_token: int
    lease_expires_at: datetime.datetime
    created_at: datetime.datetime


TransportResolver = Callable[[str], Transport | None]


# What _claim_and_submit did, besides claiming n > 0 effects.
_NOTHING_DUE = 0
_CAPACITY_FULL = -1
_CLAIM_FAILED = -2


@dataclass
class _Report:
    """A finished attempt waiting for the reporter. `release`: the delivery is over (the effect
    leaves the in-flight set once the report is flushed); False for a timed-out delivery's
    report, whose hung call still runs."""

    effect: Effect
    report: DeliveryReport
    duration_ms: int
    release: bool


class _Lane:
    """The claimed effects of one destination, drained by at most `limit` delivery tasks."""

    __slots__ = ("active", "queue")

    def __init__(self) -> None:
        self.queue: deque[Effect] = deque()
        self.active = 0


@dataclass
class DispatcherStats:
    """Counters since the dispatcher started (read them; the dispatcher updates them under a lock)."""

    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    fenced: int = 0
    extend_fenced: int = 0
    report_errors: int = 0
    reconnects: int = 0
    lag_seconds_last: float | None = None
    lag_seconds_max: float = 0.0
    lag_seconds_total: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def record_lag(self, seconds: float) -> None:
        self.record_lags([seconds])

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
                "fenced": self.fenced,
                "extend_fenced": self.extend_fenced,
                "report_errors": self.report_errors,
                "reconnects": self.reconnects,
                "lag_seconds_last": self.lag_seconds_last,
                "lag_seconds_max": self.lag_seconds_max,
                "lag_seconds_mean": mean,
            }


# Lag from an effect's created_at (its enqueuing transaction's start) to the recorded delivery.
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
               21600.0, 86400.0)


class _Metrics:
    """The dispatcher's Prometheus metrics, in a registry of its own (never the global one)."""

    def __init__(self, registry: CollectorRegistry, in_flight: Callable[[], float]) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pginbox_dispatcher_{name}", doc, labels, registry=registry)

        self.claimed = counter("claimed", "Effects claimed (each claim is one delivery attempt)")
        self.delivered = counter("delivered", "Effects delivered (complete_effect accepted)")
        self.retried = counter("retried", "Failed attempts to be retried after a backoff (fail_effect -> pending)")
        self.dead = counter("dead", "Effects given up (fail_effect -> dead)")
        self.fenced_out = counter("fenced_out", "Reports refused by fencing: the lease was no longer current",
                                  ("report",))
        for report in ("complete", "fail", "extend"):
            self.fenced_out.labels(report)
        self.report_errors = counter("report_errors", "Reports that failed with a database error (the lease expires)")
        self.reconnects = counter("listen_reconnects", "Reconnections of the LISTEN session")
        self.lag = Histogram("pginbox_dispatcher_lag_seconds",
                             "Effect created_at (its transaction's start) to delivery recorded, seconds",
                             buckets=LAG_BUCKETS, registry=registry)
        self.in_flight = Gauge("pginbox_dispatcher_in_flight", "Deliveries in flight", registry=registry)
        self.in_flight.set_function(in_flight)


class _Listener:
    """The autocommit LISTEN session: reconnects with capped, jittered exponential backoff."""

    def __init__(self, dsn: str, name: str, stats: DispatcherStats, *, probe_interval: float,
                 backoff_base: float = 0.05, backoff_max: float = 5.0,
                 on_reconnect: Callable[[], None] | None = None) -> None:
        self.dsn = dsn
        self.name = name
        self.stats = stats
        self.on_reconnect = on_reconnect
        self.probe_interval = probe_interval
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.conn: psycopg.Connection[tuple[Any, ...]] | None = None
        self.failures = 0
        self.last_activity = time.monotonic()
        self.connected_once = False

    @property
    def backend_pid(self) -> int | None:
        conn = self.conn
        return None if conn is None or conn.closed else conn.info.backend_pid

    @property
    def listening(self) -> bool:
        conn = self.conn
        return conn is not None and not conn.closed

    def ensure(self, stop: threading.Event) -> bool:
        """Connect and LISTEN if not connected. True when a new session was set up (the caller
        must claim to catch up: notifications sent meanwhile were lost)."""
        if self.conn is not None and not self.conn.closed:
            return False
        self.conn = None
        while not stop.is_set():
            try:
                conn = psycopg.connect(
                    self.dsn, autocommit=True, application_name=f"pginbox-dispatch-listen:{self.name}"
                )
                conn.execute(f"LISTEN {CHANNEL}")
            except psycopg.Error as exc:
                self.failures += 1
                delay = min(self.backoff_max, self.backoff_base * 2 ** min(self.failures - 1, 16))
                delay *= random.uniform(0.5, 1.0)
                log.warning(_kv("listen_connect_failed", dispatcher=self.name, attempt=self.failures,
                                retry_in=f"{delay:.3f}", error=str(exc).strip()))
                stop.wait(delay)
                continue
            self.conn = conn
            self.failures = 0
            self.last_activity = time.monotonic()
            if self.connected_once:
                self.stats.add(reconnects=1)
                if self.on_reconnect is not None:
                    self.on_reconnect()
                log.info(_kv("listen_reconnected", dispatcher=self.name, backend_pid=conn.info.backend_pid))
            self.connected_once = True
            return True
        return False

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a notification. True on one, or when the session was lost
        (the caller claims either way; ensure() reconnects)."""
        conn = self.conn
        if conn is None:
            return True
        try:
            got = any(True for _ in conn.notifies(timeout=timeout, stop_after=1))
            if got:
                self.last_activity = time.monotonic()
            elif time.monotonic() - self.last_activity >= self.probe_interval:
                conn.execute("SELECT 1")  # a half-open connection shows up here
                self.last_activity = time.monotonic()
            return got
        except psycopg.Error as exc:
            log.warning(_kv("listen_lost", dispatcher=self.name, error=str(exc).strip() or type(exc).__name__))
            self.close()
            return True

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken
                conn.close()


class Dispatcher:
    """Claims due effects, delivers them through the destination's transport, reports the result.

    `transports` maps destination names to transports, or is a function returning the transport
    of a destination (None: not configured here; the attempt is reported as a retryable failure
    so that a dispatcher that knows the destination can deliver it). `lease` and `poll_interval`
    are seconds; at most `concurrency_per_destination` deliveries of one destination run at once.
    `extra_collectors` are registered on `registry` (served at /metrics by HealthServer);
    `stall_after` is how long (seconds) the loop may go without a round before health() says it
    is stuck [default: max(10, 5 x poll_interval)].
    """

    def __init__(
        self,
        dsn: str,
        name: str,
        transports: Mapping[str, Transport] | TransportResolver,
        *,
        batch_size: int = 100,
        lease: float = 30.0,
        concurrency_per_destination: int = 8,
        max_in_flight: int | None = None,
        poll_interval: float = 1.0,
        settle: float = 0.02,
        probe_interval: float = 30.0,
        extend_leases: bool = True,
        delivery_timeout: float | None = None,
        extra_collectors: Iterable[Collector] = (),
        stall_after: float | None = None,
        report_batch: int = 500,
        report_interval: float = 0.005,
        claim_retries: int = 5,
    ) -> None:
        if not 1 <= batch_size <= 1000:
            raise ValueError(f"batch_size must be between 1 and 1000, got {batch_size}")
        if not 0 < lease <= 86400:
            raise ValueError(f"lease must be longer than 0 and at most 1 day, got {lease}")
        if concurrency_per_destination < 1:
            raise ValueError("concurrency_per_destination must be at least 1")
        if not 1 <= report_batch <= _REPORT_LIMIT:
            raise ValueError(f"report_batch must be between 1 and {_REPORT_LIMIT}, got {report_batch}")
        if not 0 <= report_interval <= lease / 10:
            raise ValueError(f"report_interval must be between 0 and lease / 10 ({lease / 10:g} s), got "
                             f"{report_interval}: a queued report must be flushed long before its lease ends")
        if claim_retries < 1:
            raise ValueError("claim_retries must be at least 1")
        self.dsn = dsn
        self.name = name
        if isinstance(transports, Mapping):
            table = dict(transports)
            self._resolve: TransportResolver = table.get
        else:
            self._resolve = transports
        self.batch_size = batch_size
        self.lease = lease
        self.concurrency_per_destination = concurrency_per_destination
        self.max_in_flight = max_in_flight or max(batch_size, concurrency_per_destination)
        self.poll_interval = poll_interval
        self.settle = min(settle, poll_interval)
        self.extend_leases = extend_leases
        self.delivery_timeout = delivery_timeout
        self.report_batch = report_batch
        self.report_interval = report_interval
        self.claim_retries = claim_retries
        self._started: dict[int, float] = {}
        self._timed_out: set[int] = set()
        self.stats = DispatcherStats()
        self.stall_after = stall_after if stall_after is not None else max(10.0, 5 * poll_interval)
        self._last_loop: float | None = None  # time.monotonic() of the last round of run()/run_once()
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = _Metrics(self.registry, lambda: float(self.in_flight))
        for collector in extra_collectors:
            self.registry.register(collector)
        self._stop = threading.Event()
        self._in_flight: dict[int, Effect] = {}  # by lease token: claimed, report not flushed yet
        self._in_flight_cond = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._queued = 0  # effects in _in_flight whose delivery is over and whose report waits
        self._reports: list[_Report] = []
        self._reports_cond = threading.Condition()
        self._reporter_stop = False
        self._unflushed = 0  # reports queued or being flushed (timed-out deliveries' reports too)
        self._claim_failures = 0
        self._last_claim_error = ""
        self._last_claim_sqlstate: str | None = None
        self._workers = max(self.max_in_flight, 1)
        self._pool = ConnectionPool(
            dsn,
            min_size=1,
            max_size=min(self._workers, 16) + 1,
            kwargs={"autocommit": True, "application_name": f"pginbox-dispatch:{name}"},
            open=True,
            name=f"pginbox-dispatch-{name}",
        )
        self._executor = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix=f"deliver-{name}")
        self._listener = _Listener(dsn, name, self.stats, probe_interval=probe_interval,
                                   on_reconnect=self.metrics.reconnects.inc)
        self._registered = False
        self._closed = False
        self._reporter = threading.Thread(target=self._report_loop, name=f"report-{name}", daemon=True)
        self._reporter.start()

    # ------------------------------------------------------------------ public

    @property
    def listen_backend_pid(self) -> int | None:
        """The backend pid of the LISTEN session (None while disconnected)."""
        return self._listener.backend_pid

    @property
    def in_flight(self) -> int:
        with self._in_flight_cond:
            return len(self._in_flight)

    @property
    def listening(self) -> bool:
        """True while the LISTEN session is connected (as far as the loop knows)."""
        return self._listener.listening

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): healthy while the LISTEN session is up and the loop ran within
        `stall_after` seconds. details: listening, last_loop_age_seconds (None before the first
        round), stall_after_seconds, in_flight, counters (stats.as_dict())."""
        last = self._last_loop
        age = None if last is None else time.monotonic() - last
        listening = self.listening
        healthy = listening and age is not None and age <= self.stall_after and not self._stop.is_set()
        return healthy, {
            "healthy": healthy,
            "dispatcher": self.name,
            "listening": listening,
            "last_loop_age_seconds": None if age is None else round(age, 3),
            "stall_after_seconds": self.stall_after,
            "in_flight": self.in_flight,
            "counters": self.stats.as_dict(),
        }

    def stop(self) -> None:
        """Stop claiming; run()/run_once() finish the in-flight deliveries and return. Safe from a
        signal handler and from other threads."""
        self._stop.set()

    def run_once(self) -> int:
        """Claim and deliver until nothing is due and nothing is in flight (waiting for in-flight
        deliveries and their reports, whose completion can make the next effect of an ordering
        key due). Returns how many effects were claimed. Raises ClaimError when `claim_retries`
        claims in a row failed with a database error (after finishing what is in flight)."""
        claimed = 0
        while not self._stop.is_set():
            self._last_loop = time.monotonic()
            got = self._claim_and_submit()
            if got > 0:
                claimed += got
                continue
            if got == _CAPACITY_FULL:  # not "nothing due": wait for room, then claim again
                self._housekeeping()
                continue
            if got == _CLAIM_FAILED:
                if self._claim_failures >= self.claim_retries:
                    self._wait_in_flight()
                    raise ClaimError(f"dispatcher {self.name}: {self._claim_failures} claims in a row failed, "
                                     f"the last with: {self._last_claim_error}", sqlstate=self._last_claim_sqlstate)
                self._stop.wait(self._claim_backoff())
                continue
            if not self._wait_in_flight():
                break
        self._wait_in_flight()
        return claimed

    def run(self) -> None:
        """The daemon loop: until stop(). Finishes in-flight deliveries before returning."""
        idle_wait = self.settle
        try:
            while not self._stop.is_set():
                self._last_loop = time.monotonic()
                if self._listener.ensure(self._stop):
                    self._registered = False  # notifications may have been lost: catch up
                    idle_wait = self.settle
                self._housekeeping()
                got = self._claim_and_submit()
                if got > 0:
                    self._registered = False  # a claim that gets work unregisters us
                    idle_wait = self.settle
                    continue
                if got == _CAPACITY_FULL:
                    continue
                if got == _CLAIM_FAILED:
                    self._stop.wait(self._claim_backoff())
                    continue
                if not self._registered:
                    try:
                        self._set_idle(True)
                    except psycopg.Error as exc:  # the poll still runs; register again next round
                        log.warning(_kv("register_idle_failed", dispatcher=self.name, error=str(exc).strip()))
                    if self._claim_and_submit() != _NOTHING_DUE:  # catch-up: committed before the registration
                        self._registered = False
                        continue
                timeout = idle_wait if not self.in_flight else min(idle_wait, 0.05)
                if self._listener.wait(timeout):
                    self._registered = False  # the waking commit deleted the registration
                    idle_wait = self.settle
                else:
                    idle_wait = min(idle_wait * 2, self.poll_interval)
        finally:
            self._wait_in_flight()

    def close(self) -> None:
        """Stop, finish in-flight deliveries, unregister, and close the connections."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._executor.shutdown(wait=True)
        with self._reports_cond:  # the reporter flushes what is queued, then ends
            self._reporter_stop = True
            self._reports_cond.notify_all()
        self._reporter.join()
        try:
            self._set_idle(False)
        except Exception as exc:  # the database may be gone; the registration costs one NOTIFY
            log.warning(_kv("unregister_failed", dispatcher=self.name, error=str(exc).strip()))
        self._listener.close()
        self._pool.close()
        log.info(_kv("dispatcher_stopped", dispatcher=self.name, **self.stats.as_dict()))

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ claiming

    def _set_idle(self, idle: bool) -> None:
        with self._pool.connection() as conn:
            conn.execute(_IDLE, (self.name, idle))
        self._registered = idle

    def _free(self) -> int:
        """Room for more claims (caller holds _in_flight_cond): deliveries (claimed, report not
        queued yet) below max_in_flight, and queued reports below two flushes' worth."""
        delivering = len(self._in_flight) - self._queued
        return min(self.max_in_flight - delivering,
                   self.max_in_flight + 2 * self.report_batch - len(self._in_flight))

    def _claim_and_submit(self) -> int:
        """One claim_effects call for the free in-flight capacity; queues the deliveries.
        Returns how many effects were claimed, or _NOTHING_DUE (0), _CAPACITY_FULL (after
        waiting up to 50 ms for room), _CLAIM_FAILED (a database error, logged)."""
        with self._in_flight_cond:
            free = self._free()
            if free <= 0:
                self._in_flight_cond.wait(timeout=0.05)
                return _CAPACITY_FULL
        limit = min(self.batch_size, free)
        try:
            with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
                cur.adapters.register_loader("jsonb", _JsonbLoader)
                rows = cur.execute(_CLAIM, (self.name, limit, datetime.timedelta(seconds=self.lease))).fetchall()
        except psycopg.Error as exc:
            self._claim_failures += 1
            self._last_claim_sqlstate = exc.sqlstate
            message = (exc.diag.message_primary or str(exc)).strip().splitlines()
            self._last_claim_error = (f"{message[0] if message else type(exc).__name__}"
                                      f"{f' (SQLSTATE {exc.sqlstate})' if exc.sqlstate else ''}")
            log.warning(_kv("claim_failed", dispatcher=self.name, attempt=self._claim_failures,
                            error=self._last_claim_error))
            return _CLAIM_FAILED
        self._claim_failures = 0
        if not rows:
            return _NOTHING_DUE
        self.stats.add(claimed=len(rows))
        self.metrics.claimed.inc(len(rows))
        effects = [Effect(**row) for row in rows]
        starts: list[_Lane] = []
        with self._in_flight_cond:
            for effect in effects:
                self._in_flight[effect.lease_token] = effect
                lane = self._lanes.get(effect.destination)
                if lane is None:
                    lane = self._lanes[effect.destination] = _Lane()
                lane.queue.append(effect)
                if lane.active < self.concurrency_per_destination:
                    lane.active += 1
                    starts.append(lane)
        for lane in starts:
            self._executor.submit(self._drain, lane)
        return len(rows)

    def _claim_backoff(self) -> float:
        """Capped, jittered exponential backoff after failed claims: 0.1 s, 0.2 s, ... up to 5 s."""
        delay: float = min(5.0, 0.1 * 2.0 ** min(max(self._claim_failures - 1, 0), 16))
        return delay * random.uniform(0.5, 1.0)

    def _wait_in_flight(self) -> bool:
        """Wait until no delivery is in flight (extending leases and timing out hung deliveries
        meanwhile). True when there were some (so claim again)."""
        waited = False
        while True:
            with self._in_flight_cond:
                if not self._unflushed and all(token in self._timed_out for token in self._in_flight):
                    return waited  # nothing, or only hung calls already reported as timed out
                waited = True
                self._in_flight_cond.wait(timeout=0.05)
            self._housekeeping()

    def _housekeeping(self) -> None:
        self._time_out_deliveries()
        self._maybe_extend_leases()

    def _time_out_deliveries(self) -> None:
        """A delivery running longer than delivery_timeout is an ambiguous outcome: reported as a
        retryable failure now (the same effect id is retried); the hung call's own report, if it
        ever comes, is fenced."""
        if self.delivery_timeout is None:
            return
        now = time.monotonic()
        with self._in_flight_cond:
            hung = [
                self._in_flight[token]
                for token, started in self._started.items()
                if now - started > self.delivery_timeout and token not in self._timed_out and token in self._in_flight
            ]
            self._timed_out.update(e.lease_token for e in hung)
        for effect in hung:
            report = DeliveryReport.failed(f"ambiguous: delivery timed out after {self.delivery_timeout:g} s",
                                           retryable=True)
            self._report(effect, report, int(self.delivery_timeout * 1000), release=False)

    def _maybe_extend_leases(self) -> None:
        if not self.extend_leases:
            return
        now = datetime.datetime.now(datetime.UTC)
        with self._in_flight_cond:
            due = [
                e for e in self._in_flight.values()
                if (e.lease_expires_at - now).total_seconds() < self.lease / 3 and e.lease_token not in self._timed_out
            ]
        for effect in due:
            try:
                with self._pool.connection() as conn:
                    row = conn.execute(_EXTEND, (effect.effect_id, effect.lease_token,
                                                 datetime.timedelta(seconds=self.lease))).fetchone()
            except psycopg.Error as exc:
                log.warning(_kv("extend_failed", dispatcher=self.name, effect_id=effect.effect_id,
                                error=str(exc).strip()))
                continue
            expires = row[0] if row else None
            with self._in_flight_cond:
                if effect.lease_token in self._in_flight:
                    if expires is None:
                        started = self._started.get(effect.lease_token)
                        self.stats.add(extend_fenced=1)
                        self.metrics.fenced_out.labels("extend").inc()
                        log.warning(_kv("report_fenced", dispatcher=self.name, effect_id=effect.effect_id,
                                        destination=effect.destination, attempt=effect.attempts,
                                        lease_token=effect.lease_token, report="extend",
                                        duration_ms=None if started is None
                                        else int((time.monotonic() - started) * 1000)))
                        # keep it in flight (the delivery still runs); stop trying to extend it
                        expires = now + datetime.timedelta(days=1)
                    self._in_flight[effect.lease_token] = Effect(
                        **{**effect.__dict__, "lease_expires_at": expires}
                    )

    # ------------------------------------------------------------------ delivering

    def _drain(self, lane: _Lane) -> None:
        """A delivery task: delivers the lane's effects one at a time until its queue is empty
        (at most concurrency_per_destination of these run per destination)."""
        while True:
            with self._in_flight_cond:
                if not lane.queue:
                    lane.active -= 1
                    return
                effect = lane.queue.popleft()
                self._started[effect.lease_token] = time.monotonic()
            self._deliver(effect)

    def _deliver(self, effect: Effect) -> None:
        queued = False
        try:
            started = time.monotonic()
            report = self._attempt(effect)
            duration_ms = int((time.monotonic() - started) * 1000)
            self._report(effect, report, duration_ms)
            queued = True
        except Exception:  # never lose the in-flight bookkeeping
            log.exception(_kv("delivery_crashed", dispatcher=self.name, effect_id=effect.effect_id))
        finally:
            with self._in_flight_cond:
                self._started.pop(effect.lease_token, None)
                if not queued:
                    self._release(effect.lease_token)

    def _attempt(self, effect: Effect) -> DeliveryReport:
        transport = self._resolve(effect.destination)
        if transport is None:
            return DeliveryReport.failed(
                f"no transport for destination {effect.destination!r} in dispatcher {self.name}", retryable=True
            )
        try:
            report: object = transport.deliver(effect)
        except Exception as exc:  # ambiguous: the destination may have acted; retry with the same id
            message = str(exc).strip()
            return DeliveryReport.failed(
                f"ambiguous: {type(exc).__name__}: {message}" if message else f"ambiguous: {type(exc).__name__}",
                retryable=True,
            )
        if isinstance(report, DeliveryReport):
            return report
        # any object with the same four fields (e.g. pginbox.transports.DeliveryReport)
        try:
            status_code, excerpt = getattr(report, "status_code"), getattr(report, "response_excerpt")  # noqa: B009
            retryable, error = getattr(report, "retryable"), getattr(report, "error")  # noqa: B009
        except AttributeError:
            return DeliveryReport.failed(
                f"transport returned {type(report).__name__}, not a DeliveryReport", retryable=True
            )
        return DeliveryReport(
            status_code if isinstance(status_code, int) else None,
            excerpt if isinstance(excerpt, str) else None,
            bool(retryable),
            None if error is None else str(error),
        )

    def _release(self, token: int) -> None:
        """The effect leaves the in-flight set (caller holds _in_flight_cond)."""
        self._in_flight.pop(token, None)
        self._timed_out.discard(token)
        self._in_flight_cond.notify_all()

    def _report(self, effect: Effect, report: DeliveryReport, duration_ms: int, *, release: bool = True) -> None:
        """Queue the report for the reporter thread (flushed within report_interval)."""
        with self._in_flight_cond:
            self._unflushed += 1
            if release:
                self._queued += 1
                # wake a claimer waiting for room once half a claim's worth is free
                if self._free() >= min(self.batch_size, self.max_in_flight) // 2:
                    self._in_flight_cond.notify_all()
        with self._reports_cond:
            self._reports.append(_Report(effect, report, duration_ms, release))
            if len(self._reports) == 1 or len(self._reports) >= self.report_batch:
                self._reports_cond.notify()

    def _report_loop(self) -> None:
        """The reporter thread: flushes report_batch reports at a time, or what has waited
        report_interval; on close() flushes everything left, then ends."""
        while True:
            with self._reports_cond:
                while not self._reports and not self._reporter_stop:
                    self._reports_cond.wait()
                if not self._reports:
                    return  # stopping, and nothing left
                deadline = time.monotonic() + self.report_interval
                while len(self._reports) < self.report_batch and not self._reporter_stop:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._reports_cond.wait(remaining)
                batch = self._reports[:self.report_batch]
                del self._reports[:self.report_batch]
            try:
                self._flush(batch)
            except Exception:  # never lose the in-flight bookkeeping (the leases expire: redelivered)
                log.exception(_kv("report_crashed", dispatcher=self.name, reports=len(batch)))
            finally:
                with self._in_flight_cond:
                    self._unflushed -= len(batch)
                    self._in_flight_cond.notify_all()
                    for item in batch:
                        if item.release:
                            self._queued -= 1
                            self._release(item.effect.lease_token)

    def _flush(self, batch: list[_Report]) -> None:
        """One statement for the batch (inbox.complete_effects and/or inbox.fail_effects: one
        implicit transaction), then stats, metrics and one log line per report, as before."""
        done: list[tuple[_Report, dict[str, object]]] = []
        failed: list[tuple[_Report, dict[str, object]]] = []
        for item in batch:
            report = item.report
            status_code = (report.status_code
                           if report.status_code is None or 100 <= report.status_code <= 599 else None)
            fields: dict[str, object] = {
                "dispatcher": self.name,
                "effect_id": item.effect.effect_id,
                "destination": item.effect.destination,
                "attempt": item.effect.attempts,
                "lease_token": item.effect.lease_token,
                "status_code": status_code,
                "duration_ms": item.duration_ms,
            }
            if report.delivered:
                done.append((item, fields))
            else:
                fields["error"] = (report.error or "").strip() or "failed"
                failed.append((item, fields))

        def excerpt(item: _Report) -> str | None:
            text = item.report.response_excerpt
            return text[:_EXCERPT] if text else None

        complete_args: tuple[list[Any], ...] = (
            [i.effect.effect_id for i, _ in done], [i.effect.lease_token for i, _ in done],
            [f["status_code"] for _, f in done], [excerpt(i) for i, _ in done],
            [max(i.duration_ms, 0) for i, _ in done],
        )
        fail_args: tuple[list[Any], ...] = (
            [i.effect.effect_id for i, _ in failed], [i.effect.lease_token for i, _ in failed],
            [str(f["error"])[:_EXCERPT] for _, f in failed], [i.report.retryable for i, _ in failed],
            [f["status_code"] for _, f in failed], [excerpt(i) for i, _ in failed],
            [max(i.duration_ms, 0) for i, _ in failed],
        )
        if done and failed:
            query, params = _REPORT_MANY, complete_args + fail_args
        elif done:
            query, params = _COMPLETE_MANY, complete_args
        else:
            query, params = _FAIL_MANY, fail_args
        try:
            with self._pool.connection() as conn:
                rows = conn.execute(query, params).fetchall()
        except psycopg.Error as exc:
            # the leases expire and another claim redelivers with the same effect ids
            error = str(exc).strip()
            self.stats.add(report_errors=len(batch))
            self.metrics.report_errors.inc(len(batch))
            for _, fields in done + failed:
                log.error(_kv("report_failed", **fields, error=error))
            return
        outcomes = {(str(kind), int(ord_)): str(result) for kind, ord_, result in rows}
        counts = {"delivered": 0, "retried": 0, "dead": 0, "fenced": 0}
        lags: list[float] = []
        info = log.isEnabledFor(logging.INFO)  # building a line per effect costs more than the report
        now = datetime.datetime.now(datetime.UTC)
        for kind, items in (("complete", done), ("fail", failed)):
            for n, (item, fields) in enumerate(items, start=1):
                outcome = outcomes.get((kind, n), "fenced")
                if outcome == "delivered":
                    lag = max((now - item.effect.created_at).total_seconds(), 0.0)
                    counts["delivered"] += 1
                    lags.append(lag)
                    self.metrics.lag.observe(lag)
                    if info:
                        log.info(_kv("effect_delivered", **fields, lag_seconds=f"{lag:.3f}"))
                elif outcome == "fenced":
                    counts["fenced"] += 1
                    self.metrics.fenced_out.labels(kind).inc()
                    log.warning(_kv("report_fenced", **fields, report=kind))
                elif outcome == "dead":
                    counts["dead"] += 1
                    log.warning(_kv("effect_dead", **fields, retryable=item.report.retryable))
                else:
                    counts["retried"] += 1
                    if info:
                        log.info(_kv("effect_retry", **fields))
        self.stats.record_lags(lags)
        self.stats.add(**counts)
        self.metrics.delivered.inc(counts["delivered"])
        self.metrics.retried.inc(counts["retried"])
        self.metrics.dead.inc(counts["dead"])


class HealthServer:
    """GET /healthz (200 or 503, JSON from Dispatcher.health()) and GET /metrics (Prometheus text
    of dispatcher.registry), on a daemon thread. Port 0 picks a free port (see `.port`). Bind it
    to loopback unless the network in front of it is trusted: it needs no authentication."""

    def __init__(self, dispatcher: Dispatcher, host: str = "127.0.0.1", port: int = 0) -> None:
        self.dispatcher = dispatcher
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    healthy, details = owner.dispatcher.health()
                    self._reply(200 if healthy else 503, "application/json",
                                json.dumps(details, sort_keys=True).encode())
                elif path == "/metrics":
                    self._reply(200, CONTENT_TYPE_LATEST, generate_latest(owner.dispatcher.registry))
                else:
                    self._reply(404, "text/plain; charset=utf-8", b"GET /healthz or /metrics\n")

            def _reply(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(body)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"health-{dispatcher.name}", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        log.info(_kv("health_listening", dispatcher=self.dispatcher.name, host=self.host, port=self.port))
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
