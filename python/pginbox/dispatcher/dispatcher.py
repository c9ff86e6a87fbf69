"""`Dispatcher`: claims due effects, delivers them through the destination's transport, and
hands the reports to its reporter (pginbox.dispatcher.reporter). The package docstring tells the
whole protocol."""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector
from psycopg.abc import Buffer
from psycopg.rows import dict_row
from psycopg.types.json import JsonbLoader
from psycopg_pool import ConnectionPool

from pginbox import pooler
from pginbox.dispatcher.listener import Listener
from pginbox.dispatcher.log import kv, log
from pginbox.dispatcher.queries import CLAIM, CLAIM_V2, EXTEND, IDLE, SCHEMA_VERSION
from pginbox.dispatcher.reporter import Report, Reporter
from pginbox.dispatcher.stats import DispatcherMetrics, DispatcherStats
from pginbox.errors import ClaimError
from pginbox.runtime.backoff import doubling, jittered
from pginbox.runtime.failover import TimelineWatch
from pginbox.sql_limits import CLAIM_LIMIT, LEASE_MAX_SECONDS, REPORT_LIMIT
from pginbox.transports.effect import Effect
from pginbox.transports.protocol import BatchTransport, DeliveryReport, Transport, TransportResolver

__all__ = ["Dispatcher"]

# What _claim_and_submit did, besides claiming n > 0 effects.
_NOTHING_DUE = 0
_CAPACITY_FULL = -1
_CLAIM_FAILED = -2


class _JsonbLoader(JsonbLoader):
    """jsonb -> Python as psycopg does, without parsing the usual empty headers object."""

    def load(self, data: Buffer) -> Any:
        if data == b"{}":  # (text format, as the claim query fetches it)
            return {}
        return super().load(data)


class _Lane:
    """The claimed effects of one destination, drained by at most `limit` delivery tasks."""

    __slots__ = ("active", "queue")

    def __init__(self) -> None:
        self.queue: deque[Effect] = deque()
        self.active = 0


def _check_settings(
    batch_size: int,
    lease: float,
    concurrency_per_destination: int,
    report_batch: int,
    report_interval: float,
    claim_retries: int,
) -> None:
    if not 1 <= batch_size <= CLAIM_LIMIT:
        raise ValueError(f"batch_size must be between 1 and {CLAIM_LIMIT}, got {batch_size}")
    if not 0 < lease <= LEASE_MAX_SECONDS:
        raise ValueError(f"lease must be longer than 0 and at most 1 day, got {lease}")
    if concurrency_per_destination < 1:
        raise ValueError("concurrency_per_destination must be at least 1")
    if not 1 <= report_batch <= REPORT_LIMIT:
        raise ValueError(f"report_batch must be between 1 and {REPORT_LIMIT}, got {report_batch}")
    if not 0 <= report_interval <= lease / 10:
        raise ValueError(
            f"report_interval must be between 0 and lease / 10 ({lease / 10:g} s), got "
            f"{report_interval}: a queued report must be flushed long before its lease ends"
        )
    if claim_retries < 1:
        raise ValueError("claim_retries must be at least 1")


class Dispatcher:
    """Claims due effects, delivers them through the destination's transport, reports the result.

    `transports` maps destination names to transports, or is a function returning the transport
    of a destination (None: not configured here; the attempt is reported as a retryable failure
    so that a dispatcher that knows the destination can deliver it). `lease` and `poll_interval`
    are seconds; at most `concurrency_per_destination` deliveries of one destination run at once.
    `extra_collectors` are registered on `registry` (served at /metrics by HealthServer);
    `stall_after` is how long (seconds) the loop may go without a round before health() says it
    is stuck [default: max(10, 5 x poll_interval)].

    Behind a transaction pooler (PgBouncer; pginbox.pooler): every pool connection is checked when
    it is opened and, behind the pooler, prepares no statements; LISTEN needs a session of its own,
    so `listen_dsn` gives it a direct connection (without one, the dispatcher does not LISTEN behind
    a pooler and polls every `poll_interval`; health() says so).
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
        listen_dsn: str | None = None,
        defer_after: float = 30.0,
    ) -> None:
        _check_settings(batch_size, lease, concurrency_per_destination, report_batch, report_interval, claim_retries)
        if not 1.0 <= defer_after <= 3600.0:
            raise ValueError(f"defer_after must be between 1 and 3600 seconds, got {defer_after}")
        self.dsn = dsn
        self.listen_dsn = listen_dsn
        self.name = name
        self._resolve: TransportResolver = dict(transports).get if isinstance(transports, Mapping) else transports
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
        self.defer_after = defer_after  # seconds a deferred effect waits (no transport, cannot route yet)
        self.stall_after = stall_after if stall_after is not None else max(10.0, 5 * poll_interval)
        self.stats = DispatcherStats()
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = DispatcherMetrics(self.registry, lambda: float(self.in_flight))
        self.timeline = TimelineWatch(log, self.metrics.failovers.inc, dispatcher=self.name)
        if isinstance(transports, Mapping):
            self.metrics.destinations(transports)
        for collector in extra_collectors:
            self.registry.register(collector)
        self._init_bookkeeping()
        self._open(probe_interval)

    def _init_bookkeeping(self) -> None:
        """The state the loop, the delivery tasks and the reporter share (under _in_flight_cond)."""
        self._stop = threading.Event()
        self._last_loop: float | None = None  # time.monotonic() of the last round of run()/run_once()
        self._in_flight: dict[int, Effect] = {}  # by lease token: claimed, report not flushed yet
        self._in_flight_cond = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._started: dict[int, float] = {}  # lease token -> time.monotonic() its delivery started
        self._timed_out: set[int] = set()
        self._queued = 0  # effects in _in_flight whose delivery is over and whose report waits
        self._unflushed = 0  # reports queued or being flushed (timed-out deliveries' reports too)
        self._claim_failures = 0
        self._claim_sql: str | None = None  # CLAIM, or CLAIM_V2 against a 0.2.0 schema (first claim decides)
        self._last_claim_error = ""
        self._last_claim_sqlstate: str | None = None
        self._last_claim_exc: psycopg.Error | None = None
        self._registered = False
        self._closed = False
        self._behind_pooler = False

    def _open(self, probe_interval: float) -> None:
        """The connections and threads: the pool for claims and reports, the delivery executor, the
        LISTEN session, and the reporter thread (started)."""
        workers = max(self.max_in_flight, 1)
        self._pool = ConnectionPool(
            self.dsn,
            min_size=1,
            max_size=min(workers, 16) + 1,
            kwargs={"autocommit": True, "application_name": f"pginbox-dispatch:{self.name}"},
            configure=self._configure_connection,
            open=True,
            name=f"pginbox-dispatch-{self.name}",
        )
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"deliver-{self.name}")
        self._listener = Listener(
            self.listen_dsn or self.dsn,
            self.name,
            self.stats,
            probe_interval=probe_interval,
            on_reconnect=self.metrics.reconnects.inc,
            dedicated=self.listen_dsn is not None,
        )
        self._reporter = Reporter(
            self.name,
            self._pool,
            self.stats,
            self.metrics,
            batch=self.report_batch,
            interval=self.report_interval,
            on_flushed=self._reports_flushed,
            defer_after=self.defer_after,
        ).start()

    def _configure_connection(self, conn: psycopg.Connection[Any]) -> None:
        """Every new pool connection: behind a pooler, no prepared statements (pginbox.pooler);
        its WAL timeline (a new one: a failover, counted and logged; pginbox.runtime.failover)."""
        self.timeline.read(conn)
        if pooler.behind_pooler(conn):
            if not self._behind_pooler:
                log.info(
                    kv(
                        "behind_pooler",
                        dispatcher=self.name,
                        detail="the claims' connections go through a connection pooler: no prepared statements",
                    )
                )
            self._behind_pooler = True
            pooler.configure(conn)

    # ------------------------------------------------------------------ public

    @property
    def behind_pooler(self) -> bool:
        """True once a claim connection was found to go through a pooler (PgBouncer)."""
        return self._behind_pooler

    @property
    def wakeup(self) -> str:
        """'listen' (LISTEN/NOTIFY wakes the loop) or 'polling' (it claims every poll_interval)."""
        return "polling" if self._listener.polling_reason is not None else "listen"

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
        """(healthy, details): healthy while the LISTEN session is up (or the dispatcher polls by
        design: behind a pooler without a direct LISTEN connection) and the loop ran within
        `stall_after` seconds. details: listening, wakeup ('listen' | 'polling'), wakeup_reason
        (why it polls, else None), behind_pooler, last_loop_age_seconds (None before the first
        round), stall_after_seconds, in_flight, counters (stats.as_dict()), deferring (destination ->
        reason of its effects deferred without spending attempts: no transport configured, the broker
        cannot route yet; healthy still: the dispatcher works, the deployment is incomplete)."""
        last = self._last_loop
        age = None if last is None else time.monotonic() - last
        listening = self.listening
        reason = self._listener.polling_reason
        healthy = (
            (listening or reason is not None)
            and age is not None
            and age <= self.stall_after
            and not self._stop.is_set()
        )
        return healthy, {
            "healthy": healthy,
            "dispatcher": self.name,
            "listening": listening,
            "wakeup": "polling" if reason is not None else "listen",
            "wakeup_reason": reason,
            "behind_pooler": self._behind_pooler,
            "last_loop_age_seconds": None if age is None else round(age, 3),
            "stall_after_seconds": self.stall_after,
            "in_flight": self.in_flight,
            "counters": self.stats.as_dict(),
            "deferring": self.stats.deferring_now(),
        }

    def replace_transports(self, transports: Mapping[str, Transport] | TransportResolver) -> None:
        """Deliver with these destinations from now on (`pginbox dispatch` on SIGHUP): effects
        claimed from now on use them; deliveries in flight finish with the transport they started
        with, and no lease is dropped. A destination no longer configured is deferred
        (no_transport), not failed."""
        resolve: TransportResolver = dict(transports).get if isinstance(transports, Mapping) else transports
        if isinstance(transports, Mapping):
            self.metrics.destinations(transports)
        self._resolve = resolve
        log.info(
            kv(
                "transports_replaced",
                dispatcher=self.name,
                destinations=",".join(sorted(transports)) if isinstance(transports, Mapping) else "resolver",
            )
        )

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
                    raise ClaimError(
                        f"dispatcher {self.name}: {self._claim_failures} claims in a row failed, "
                        f"the last with: {self._last_claim_error}",
                        sqlstate=self._last_claim_sqlstate,
                    ) from self._last_claim_exc
                self._stop.wait(self._claim_backoff())
                continue
            if not self._wait_in_flight():
                break
        self._wait_in_flight()
        return claimed

    def run(self) -> None:
        """The daemon loop: until stop(). Finishes in-flight deliveries before returning."""
        idle_rounds = 0  # quiet waits in a row: the wait doubles from settle up to poll_interval
        try:
            while not self._stop.is_set():
                self._last_loop = time.monotonic()
                if self._listener.ensure(self._stop):
                    self._registered = False  # notifications may have been lost: catch up
                    idle_rounds = 0
                self._housekeeping()
                got = self._claim_and_submit()
                if got > 0:
                    self._registered = False  # a claim that gets work unregisters us
                    idle_rounds = 0
                    continue
                if got == _CAPACITY_FULL:
                    continue
                if got == _CLAIM_FAILED:
                    self._stop.wait(self._claim_backoff())
                    continue
                if not self._registered and self._listener.polling_reason is None:
                    try:
                        self._set_idle(True)
                    except psycopg.Error as exc:  # the poll still runs; register again next round
                        log.warning(kv("register_idle_failed", dispatcher=self.name, error=str(exc).strip()))
                    if self._claim_and_submit() != _NOTHING_DUE:  # catch-up: committed before the registration
                        self._registered = False
                        continue
                idle_wait = doubling(idle_rounds + 1, self.settle, self.poll_interval)
                timeout = idle_wait if not self.in_flight else min(idle_wait, 0.05)
                if self._listener.wait(timeout):
                    self._registered = False  # the waking commit deleted the registration
                    idle_rounds = 0
                else:
                    idle_rounds += 1
        finally:
            self._wait_in_flight()

    def close(self) -> None:
        """Stop, finish in-flight deliveries, unregister, and close the connections."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._executor.shutdown(wait=True)
        self._reporter.close()  # flushes what is queued, then ends
        try:
            self._set_idle(False)
        except Exception as exc:  # the database may be gone; the registration costs one NOTIFY
            log.warning(kv("unregister_failed", dispatcher=self.name, error=str(exc).strip()))
        self._listener.close()
        self._pool.close()
        log.info(kv("dispatcher_stopped", dispatcher=self.name, **self.stats.as_dict()))

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ claiming

    def _set_idle(self, idle: bool) -> None:
        with self._pool.connection() as conn:
            conn.execute(IDLE, (self.name, idle))
        self._registered = idle

    def _free(self) -> int:
        """Room for more claims (caller holds _in_flight_cond): deliveries (claimed, report not
        queued yet) below max_in_flight, and queued reports below two flushes' worth."""
        delivering = len(self._in_flight) - self._queued
        return min(self.max_in_flight - delivering, self.max_in_flight + 2 * self.report_batch - len(self._in_flight))

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
                if self._claim_sql is None:
                    version = cur.execute(SCHEMA_VERSION).fetchone()
                    self._claim_sql = CLAIM if version and int(next(iter(version.values()))) >= 3 else CLAIM_V2
                lease = datetime.timedelta(seconds=self.lease)
                rows = cur.execute(self._claim_sql, (self.name, limit, lease)).fetchall()
        except psycopg.Error as exc:
            self._claim_failures += 1
            self._last_claim_exc = exc
            self._last_claim_sqlstate = exc.sqlstate
            message = (exc.diag.message_primary or str(exc)).strip().splitlines()
            self._last_claim_error = (
                f"{message[0] if message else type(exc).__name__}"
                f"{f' (SQLSTATE {exc.sqlstate})' if exc.sqlstate else ''}"
            )
            log.warning(
                kv("claim_failed", dispatcher=self.name, attempt=self._claim_failures, error=self._last_claim_error)
            )
            return _CLAIM_FAILED
        self._claim_failures = 0
        self.timeline.ok()
        if not rows:
            return _NOTHING_DUE
        self.stats.add(claimed=len(rows))
        for destination, n in Counter(str(row["destination"]) for row in rows).items():
            self.metrics.claimed.labels(destination).inc(n)
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
        return jittered(self._claim_failures, 0.1, 5.0)

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
            report = DeliveryReport.failed(
                f"ambiguous: delivery timed out after {self.delivery_timeout:g} s", retryable=True
            )
            self._report(effect, report, int(self.delivery_timeout * 1000), release=False)

    def _maybe_extend_leases(self) -> None:
        if not self.extend_leases:
            return
        now = datetime.datetime.now(datetime.UTC)
        with self._in_flight_cond:
            due = [
                e
                for e in self._in_flight.values()
                if e.lease_expires_at is not None
                and (e.lease_expires_at - now).total_seconds() < self.lease / 3
                and e.lease_token not in self._timed_out
            ]
        for effect in due:
            try:
                with self._pool.connection() as conn:
                    row = conn.execute(
                        EXTEND, (effect.effect_id, effect.lease_token, datetime.timedelta(seconds=self.lease))
                    ).fetchone()
            except psycopg.Error as exc:
                log.warning(
                    kv("extend_failed", dispatcher=self.name, effect_id=effect.effect_id, error=str(exc).strip())
                )
                continue
            expires = row[0] if row else None
            with self._in_flight_cond:
                if effect.lease_token in self._in_flight:
                    if expires is None:
                        started = self._started.get(effect.lease_token)
                        self.stats.add(extend_fenced=1)
                        self.metrics.fenced_out.labels("extend").inc()
                        log.warning(
                            kv(
                                "report_fenced",
                                dispatcher=self.name,
                                effect_id=effect.effect_id,
                                destination=effect.destination,
                                attempt=effect.attempts,
                                lease_token=effect.lease_token,
                                report="extend",
                                duration_ms=None if started is None else int((time.monotonic() - started) * 1000),
                            )
                        )
                        # keep it in flight (the delivery still runs); stop trying to extend it
                        expires = now + datetime.timedelta(days=1)
                    self._in_flight[effect.lease_token] = replace(effect, lease_expires_at=expires)

    # ------------------------------------------------------------------ delivering

    def _drain(self, lane: _Lane) -> None:
        """A delivery task: delivers the lane's effects until its queue is empty (at most
        concurrency_per_destination of these run per destination): one at a time, or, when the
        destination's transport has deliver_batch (BatchTransport: the broker transports), up to
        batch_size at a time."""
        while True:
            with self._in_flight_cond:
                if not lane.queue:
                    lane.active -= 1
                    return
                effect = lane.queue.popleft()
                batch = [effect]
                transport = self._resolve(effect.destination)
                if isinstance(transport, BatchTransport):
                    # share the queue with the lane's other tasks: take a fair part of it
                    share = max(1, -(-len(lane.queue) // max(lane.active, 1)))
                    while lane.queue and len(batch) < min(self.batch_size, share + 1):
                        batch.append(lane.queue.popleft())
                now = time.monotonic()
                for e in batch:
                    self._started[e.lease_token] = now
            if len(batch) == 1 or not isinstance(transport, BatchTransport):
                self._deliver(effect)
            else:
                self._deliver_batch(transport, batch)

    def _deliver_batch(self, transport: BatchTransport, batch: list[Effect]) -> None:
        """deliver_batch: one report per effect (a transport error is an ambiguous outcome for
        every effect of the batch: retried with the same ids)."""
        queued: set[int] = set()
        try:
            started = time.monotonic()
            try:
                reports: list[DeliveryReport] = list(transport.deliver_batch(batch))
                if len(reports) != len(batch):
                    raise RuntimeError(f"deliver_batch returned {len(reports)} reports for {len(batch)} effects")
            except Exception as exc:
                message = str(exc).strip()
                failed = DeliveryReport.failed(
                    f"ambiguous: {type(exc).__name__}: {message}" if message else f"ambiguous: {type(exc).__name__}",
                    retryable=True,
                )
                reports = [failed] * len(batch)
            duration_ms = int((time.monotonic() - started) * 1000)
            for effect, report in zip(batch, reports, strict=True):
                self._report(effect, report, duration_ms)
                queued.add(effect.lease_token)
        except Exception:  # never lose the in-flight bookkeeping
            log.exception(kv("delivery_crashed", dispatcher=self.name, effects=len(batch)))
        finally:
            with self._in_flight_cond:
                for effect in batch:
                    self._started.pop(effect.lease_token, None)
                    if effect.lease_token not in queued:
                        self._release(effect.lease_token)

    def _deliver(self, effect: Effect) -> None:
        queued = False
        try:
            started = time.monotonic()
            report = self._attempt(effect)
            duration_ms = int((time.monotonic() - started) * 1000)
            self._report(effect, report, duration_ms)
            queued = True
        except Exception:  # never lose the in-flight bookkeeping
            log.exception(kv("delivery_crashed", dispatcher=self.name, effect_id=effect.effect_id))
        finally:
            with self._in_flight_cond:
                self._started.pop(effect.lease_token, None)
                if not queued:
                    self._release(effect.lease_token)

    def _attempt(self, effect: Effect) -> DeliveryReport:
        transport = self._resolve(effect.destination)
        if transport is None:
            # A deployment-order incident, not a failed delivery: the effect waits, attempts unspent,
            # until a dispatcher with a transport for it takes it (or this one after SIGHUP).
            return DeliveryReport.deferred(
                "no_transport", f"no transport for destination {effect.destination!r} in dispatcher {self.name}"
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
            defer = getattr(report, "defer", None)
        except AttributeError:
            return DeliveryReport.failed(
                f"transport returned {type(report).__name__}, not a DeliveryReport", retryable=True
            )
        return DeliveryReport(
            status_code if isinstance(status_code, int) else None,
            excerpt if isinstance(excerpt, str) else None,
            bool(retryable),
            None if error is None else str(error),
            defer if isinstance(defer, str) and error is not None else None,
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
        self._reporter.put(Report(effect, report, duration_ms, release))

    def _reports_flushed(self, batch: list[Report]) -> None:
        """The reporter is done with `batch` (recorded, or failed: its leases expire): the
        released effects leave the in-flight set."""
        with self._in_flight_cond:
            self._unflushed -= len(batch)
            self._in_flight_cond.notify_all()
            for item in batch:
                if item.release:
                    self._queued -= 1
                    self._release(item.effect.lease_token)
