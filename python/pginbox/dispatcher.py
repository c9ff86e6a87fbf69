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
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from pginbox.transports import CallableTransport, DeliveryReport, Transport

__all__ = [
    "CHANNEL",
    "CallableTransport",
    "DeliveryReport",
    "Dispatcher",
    "DispatcherStats",
    "Effect",
    "Transport",
    "TransportResolver",
]

log = logging.getLogger("pginbox.dispatcher")

CHANNEL = "inbox_outbox"

_CLAIM = (
    "SELECT effect_id, destination, payload, headers, ordering_key, attempts, lease_token, lease_expires_at,"
    " created_at FROM inbox.claim_effects(%s, %s, %s)"
)
_COMPLETE = "SELECT inbox.complete_effect(%s, %s, %s, %s, %s)"
_FAIL = "SELECT inbox.fail_effect(%s, %s, %s, %s, %s, %s, %s)"
_EXTEND = "SELECT inbox.extend_lease(%s, %s, %s)"
_IDLE = "SELECT inbox.dispatcher_idle(%s, %s)"
_EXCERPT = 2000


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


@dataclass
class DispatcherStats:
    """Counters since the dispatcher started (read them; the dispatcher updates them under a lock)."""

    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    fenced: int = 0
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
        with self._lock:
            self.lag_seconds_last = seconds
            self.lag_seconds_max = max(self.lag_seconds_max, seconds)
            self.lag_seconds_total += seconds

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            mean = self.lag_seconds_total / self.delivered if self.delivered else None
            return {
                "claimed": self.claimed,
                "delivered": self.delivered,
                "retried": self.retried,
                "dead": self.dead,
                "fenced": self.fenced,
                "report_errors": self.report_errors,
                "reconnects": self.reconnects,
                "lag_seconds_last": self.lag_seconds_last,
                "lag_seconds_max": self.lag_seconds_max,
                "lag_seconds_mean": mean,
            }


class _Listener:
    """The autocommit LISTEN session: reconnects with capped, jittered exponential backoff."""

    def __init__(self, dsn: str, name: str, stats: DispatcherStats, *, probe_interval: float,
                 backoff_base: float = 0.05, backoff_max: float = 5.0) -> None:
        self.dsn = dsn
        self.name = name
        self.stats = stats
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
    ) -> None:
        if not 1 <= batch_size <= 1000:
            raise ValueError(f"batch_size must be between 1 and 1000, got {batch_size}")
        if not 0 < lease <= 86400:
            raise ValueError(f"lease must be longer than 0 and at most 1 day, got {lease}")
        if concurrency_per_destination < 1:
            raise ValueError("concurrency_per_destination must be at least 1")
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
        self._started: dict[int, float] = {}
        self._timed_out: set[int] = set()
        self.stats = DispatcherStats()
        self._stop = threading.Event()
        self._in_flight: dict[int, Effect] = {}  # by lease token
        self._in_flight_cond = threading.Condition()
        self._semaphores: dict[str, threading.BoundedSemaphore] = {}
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
        self._listener = _Listener(dsn, name, self.stats, probe_interval=probe_interval)
        self._registered = False
        self._closed = False

    # ------------------------------------------------------------------ public

    @property
    def listen_backend_pid(self) -> int | None:
        """The backend pid of the LISTEN session (None while disconnected)."""
        return self._listener.backend_pid

    @property
    def in_flight(self) -> int:
        with self._in_flight_cond:
            return len(self._in_flight)

    def stop(self) -> None:
        """Stop claiming; run()/run_once() finish the in-flight deliveries and return. Safe from a
        signal handler and from other threads."""
        self._stop.set()

    def run_once(self) -> int:
        """Claim and deliver until nothing is due (waiting for in-flight deliveries, whose
        completion can make the next effect of an ordering key due). Returns how many effects
        were claimed."""
        claimed = 0
        while not self._stop.is_set():
            got = self._claim_and_submit()
            claimed += got
            if got:
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
                if self._listener.ensure(self._stop):
                    self._registered = False  # notifications may have been lost: catch up
                    idle_wait = self.settle
                self._housekeeping()
                if self._claim_and_submit():
                    self._registered = False  # a claim that gets work unregisters us
                    idle_wait = self.settle
                    continue
                if not self._registered:
                    try:
                        self._set_idle(True)
                    except psycopg.Error as exc:  # the poll still runs; register again next round
                        log.warning(_kv("register_idle_failed", dispatcher=self.name, error=str(exc).strip()))
                    if self._claim_and_submit():  # catch-up: committed before the registration
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

    def _claim_and_submit(self) -> int:
        """One claim_effects call for the free in-flight capacity; submits the deliveries."""
        with self._in_flight_cond:
            free = self.max_in_flight - len(self._in_flight)
            if free <= 0:
                self._in_flight_cond.wait(timeout=0.05)
                return 0
        limit = min(self.batch_size, free)
        try:
            with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
                rows = cur.execute(_CLAIM, (self.name, limit, datetime.timedelta(seconds=self.lease))).fetchall()
        except psycopg.Error as exc:
            log.warning(_kv("claim_failed", dispatcher=self.name, error=str(exc).strip()))
            self._stop.wait(0.5)
            return 0
        if not rows:
            return 0
        self.stats.add(claimed=len(rows))
        for row in rows:
            effect = Effect(**row)
            with self._in_flight_cond:
                self._in_flight[effect.lease_token] = effect
            self._executor.submit(self._deliver, effect)
        return len(rows)

    def _wait_in_flight(self) -> bool:
        """Wait until no delivery is in flight (extending leases and timing out hung deliveries
        meanwhile). True when there were some (so claim again)."""
        waited = False
        while True:
            with self._in_flight_cond:
                if all(token in self._timed_out for token in self._in_flight):
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
            self._report(effect, report, int(self.delivery_timeout * 1000))

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
                        log.warning(_kv("extend_fenced", dispatcher=self.name, effect_id=effect.effect_id,
                                        lease_token=effect.lease_token))
                        # keep it in flight (the delivery still runs); stop trying to extend it
                        expires = now + datetime.timedelta(days=1)
                    self._in_flight[effect.lease_token] = Effect(
                        **{**effect.__dict__, "lease_expires_at": expires}
                    )

    # ------------------------------------------------------------------ delivering

    def _semaphore(self, destination: str) -> threading.BoundedSemaphore:
        with self._in_flight_cond:
            sem = self._semaphores.get(destination)
            if sem is None:
                sem = self._semaphores[destination] = threading.BoundedSemaphore(self.concurrency_per_destination)
            return sem

    def _deliver(self, effect: Effect) -> None:
        try:
            with self._semaphore(effect.destination):
                started = time.monotonic()
                with self._in_flight_cond:
                    self._started[effect.lease_token] = started
                report = self._attempt(effect)
                duration_ms = int((time.monotonic() - started) * 1000)
            self._report(effect, report, duration_ms)
        except Exception:  # never lose the in-flight bookkeeping
            log.exception(_kv("delivery_crashed", dispatcher=self.name, effect_id=effect.effect_id))
        finally:
            with self._in_flight_cond:
                self._in_flight.pop(effect.lease_token, None)
                self._started.pop(effect.lease_token, None)
                self._timed_out.discard(effect.lease_token)
                self._in_flight_cond.notify_all()

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

    def _report(self, effect: Effect, report: DeliveryReport, duration_ms: int) -> None:
        status_code = report.status_code if report.status_code is None or 100 <= report.status_code <= 599 else None
        excerpt = report.response_excerpt[:_EXCERPT] if report.response_excerpt else None
        fields: dict[str, object] = {
            "dispatcher": self.name,
            "effect_id": effect.effect_id,
            "destination": effect.destination,
            "attempt": effect.attempts,
            "lease_token": effect.lease_token,
            "status_code": status_code,
            "duration_ms": duration_ms,
        }
        try:
            with self._pool.connection() as conn:
                if report.delivered:
                    row = conn.execute(_COMPLETE, (effect.effect_id, effect.lease_token, status_code, excerpt,
                                                   duration_ms)).fetchone()
                    outcome = "delivered" if row and row[0] else "fenced"
                else:
                    error = (report.error or "").strip() or "failed"
                    row = conn.execute(_FAIL, (effect.effect_id, effect.lease_token, error[:_EXCERPT],
                                               report.retryable, status_code, excerpt, duration_ms)).fetchone()
                    outcome = str(row[0]) if row else "fenced"
                    fields["error"] = error
        except psycopg.Error as exc:
            # the lease expires and another claim redelivers with the same effect id
            self.stats.add(report_errors=1)
            log.error(_kv("report_failed", **fields, error=str(exc).strip()))
            return
        if outcome == "delivered":
            lag = (datetime.datetime.now(datetime.UTC) - effect.created_at).total_seconds()
            self.stats.add(delivered=1)
            self.stats.record_lag(max(lag, 0.0))
            log.info(_kv("effect_delivered", **fields, lag_seconds=f"{lag:.3f}"))
        elif outcome == "fenced":
            self.stats.add(fenced=1)
            log.warning(_kv("report_fenced", **fields, report="complete" if report.delivered else "fail"))
        elif outcome == "dead":
            self.stats.add(dead=1)
            log.warning(_kv("effect_dead", **fields, retryable=report.retryable))
        else:
            self.stats.add(retried=1)
            log.info(_kv("effect_retry", **fields))
