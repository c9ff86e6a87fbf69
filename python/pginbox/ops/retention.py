"""Retention from Python: policies, the purge (`pginbox purge`) and a background purger
(`pginbox dispatch --purge-every`). The rules live in SQL (sql/075_retention.sql): the purge of one
consumer is one `CALL inbox.purge(...)`, the same procedure cron and pg_cron call.

The procedure becomes the consumer's purger (session advisory lock: another purger makes it return
busy), announces the new cutoff and commits it, waits for the transactions from before the
announcement (at most `wait_timeout`, then 55P03: status timeout, nothing more deleted), then
deletes batch after batch with a commit and a NOTICE after each (at most `max_batches`). The
NOTICEs drive the progress callback; a stop request cancels the CALL (what was committed stays)
and gives the purger's lock back with inbox.purge_unlock.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from pginbox import pooler

__all__ = [
    "SCENARIOS",
    "PeriodicPurger",
    "PurgeProgress",
    "PurgeReport",
    "purge",
    "purge_consumer",
    "retention_status",
    "set_policy",
]

#: The named failure scenarios of a policy, in the order of inbox.set_retention_policy's arguments
#: (pinned by test_sql_contract).
SCENARIOS: Final = (
    "broker_retention",
    "max_offset_rewind",
    "dead_letter_redrive_horizon",
    "producer_retry_horizon",
    "outage_allowance",
    "backup_restore_window",
    "planned_replay_horizon",
    "safety_margin",
)

POLICY_CONSUMERS: Final = "SELECT DISTINCT p.consumer FROM inbox.retention_policy p ORDER BY 1"

CALL_PURGE: Final = """
CALL inbox.purge(%(consumer)s, %(producer)s, %(batch_size)s, %(max_batches)s, %(wait_timeout)s, NULL, NULL,
                 %(pause)s)
"""
# The per-batch NOTICE of inbox.purge: 'inbox.purge: consumer C: batch N: D rows deleted, T so far'.
BATCH_NOTICE: Final = re.compile(r"^inbox\.purge: consumer .*: batch (\d+): (\d+) rows deleted, (\d+) so far$")

# Where the purge stands after a call (per policy; the report takes the latest).
PURGE_STATE: Final = """
SELECT max(s.watermark) AS watermark, max(s.purged_before) AS purged_before
  FROM inbox.purge_state s
 WHERE s.consumer = %(consumer)s AND (%(producer)s::text IS NULL OR s.producer = %(producer)s::text)
"""

# Before a purge shown on a terminal: about how many rows it will delete (processed rows of the
# consumer older than the newest cutoff of its policies; holds, quarantine and the outbox floor,
# which keep some of them, are left out: an estimate, counted through message_purge_idx).
ROWS_TO_GO: Final = """
SELECT count(*)
  FROM inbox.message m
 WHERE m.consumer = %(consumer)s AND (%(producer)s::text IS NULL OR m.producer = %(producer)s::text)
   AND m.status = 'processed'
   AND m.processed_at < (SELECT max(inbox._active_cutoff(r.consumer, r.retention_window))
                           FROM inbox.retention_status r
                          WHERE r.consumer = %(consumer)s
                            AND (%(producer)s::text IS NULL OR r.producer = %(producer)s::text))
"""

UNLOCK: Final = "SELECT inbox.purge_unlock(%(consumer)s)"

# Outbox housekeeping (sql/060_outbox.sql): delivered and discarded effects, and old fenced-report
# rows, older than the horizon; one bounded batch per call.
PURGE_EFFECTS: Final = "SELECT inbox.purge_delivered_effects(%(older_than)s, %(batch_size)s)"

STATUS: Final = """
SELECT s.consumer, s.producer, s.retention_window, s.dominating_scenario, s.watermark, s.purged_before,
       s.last_purge_at, s.rows_purged, s.purge_lag, s.expired_total, s.last_active_at
  FROM inbox.retention_status s
 WHERE %(consumer)s::text IS NULL OR s.consumer = %(consumer)s
 ORDER BY s.consumer, s.producer
"""

SET_POLICY: Final = """
SELECT r.retention_window, r.dominating_scenario
  FROM inbox.set_retention_policy(
           consumer => %(consumer)s, producer => %(producer)s,
           broker_retention => %(broker_retention)s::interval, max_offset_rewind => %(max_offset_rewind)s::interval,
           dead_letter_redrive_horizon => %(dead_letter_redrive_horizon)s::interval,
           producer_retry_horizon => %(producer_retry_horizon)s::interval,
           outage_allowance => %(outage_allowance)s::interval,
           backup_restore_window => %(backup_restore_window)s::interval,
           planned_replay_horizon => %(planned_replay_horizon)s::interval,
           safety_margin => %(safety_margin)s::interval, note => %(note)s) r
"""

_log = logging.getLogger("pginbox.retention")


@dataclass
class PurgeReport:
    """What the purge of one consumer came to.

    status: purged (rows deleted) | done (nothing old enough) | busy (another purger) |
    no_policy (never purged) | inactive (not active for a whole window yet, or down) |
    timeout (transactions from before the announcement outlived wait_timeout; nothing more deleted).
    """

    consumer: str
    status: str
    rows_deleted: int = 0
    batches: int = 0
    seconds: float = 0.0
    watermark: datetime | None = None
    purged_before: datetime | None = None
    details: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("watermark", "purged_before"):
            value = out[key]
            out[key] = value.isoformat() if value is not None else None
        return out


@dataclass(frozen=True)
class PurgeProgress:
    """Where a running purge of one consumer stands (after each committed batch). `estimate`: the
    rows it was expected to delete, counted before it started (None: not counted)."""

    consumer: str
    batches: int
    rows_deleted: int
    seconds: float
    estimate: int | None = None

    @property
    def rate(self) -> float | None:
        """Rows deleted per second so far."""
        return self.rows_deleted / self.seconds if self.seconds > 0 and self.rows_deleted else None

    @property
    def rows_left(self) -> int | None:
        return None if self.estimate is None else max(self.estimate - self.rows_deleted, 0)

    @property
    def seconds_left(self) -> float | None:
        """At the rate so far, until the estimated rows are gone (None: no estimate or no rate)."""
        rate, left = self.rate, self.rows_left
        return None if rate is None or left is None else left / rate


def estimate_rows_to_go(conn: psycopg.Connection[Any], consumer: str, producer: str | None = None) -> int | None:
    """About how many rows a purge of `consumer` would delete now (see ROWS_TO_GO); None when this
    role may not count them."""
    try:
        row = conn.execute(ROWS_TO_GO, {"consumer": consumer, "producer": producer}).fetchone()
    except psycopg.errors.InsufficientPrivilege:
        return None
    return None if row is None else int(row[0])


def _rows(conn: psycopg.Connection[Any], query: str, params: Mapping[str, object]) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()


def purge_consumer(
    conn: psycopg.Connection[Any],
    consumer: str,
    producer: str | None = None,
    *,
    batch_size: int = 5000,
    max_batches: int = 1000,
    wait_timeout: float = 300.0,
    pause: float = 0.0,
    stop: threading.Event | None = None,
    progress: Callable[[PurgeProgress], None] | None = None,
    estimate: int | None = None,
) -> PurgeReport:
    """Purge one consumer (all its policies when producer is None) with `CALL inbox.purge` on an
    autocommit connection. `pause`: seconds to sleep after each batch, to leave the claims their
    share of a busy machine. `progress` is called after each committed batch (from the batch's
    NOTICE), `estimate` passed on to it. Setting `stop` cancels the call: the batches committed
    so far stay deleted."""
    if not conn.autocommit:
        raise ValueError("purge_consumer needs an autocommit connection: it commits after every batch")
    # The purger's session advisory lock spans the batches' transactions: behind a transaction pooler
    # it would stay on a server session that other clients get (PoolerError, before anything runs).
    pooler.refuse_pooled(pooler.behind_pooler(conn), "purge (its session-level advisory lock)")
    started = time.monotonic()
    report = PurgeReport(consumer, "done")

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        message = diag.message_primary or ""
        found = BATCH_NOTICE.match(message)
        if found is None:
            if message:
                report.details.append(message.removeprefix("inbox.purge: "))
            return
        report.batches, report.rows_deleted = int(found.group(1)), int(found.group(3))
        if progress is not None:
            progress(PurgeProgress(consumer, report.batches, report.rows_deleted, time.monotonic() - started, estimate))

    cancelled = threading.Event()
    finished = threading.Event()
    calling = threading.Lock()  # a cancel reaches the CALL, never a later statement

    def watch_stop() -> None:
        assert stop is not None
        while not finished.is_set():
            if stop.wait(0.05):
                with calling:
                    if not finished.is_set():
                        cancelled.set()
                        conn.cancel_safe()
                return

    watcher = threading.Thread(target=watch_stop, name="pginbox-purge-stop", daemon=True) if stop else None
    params = {
        "consumer": consumer,
        "producer": producer,
        "batch_size": batch_size,
        "max_batches": max_batches,
        "wait_timeout": timedelta(seconds=wait_timeout),
        "pause": timedelta(seconds=pause),
    }
    conn.add_notice_handler(on_notice)
    try:
        if watcher is not None:
            watcher.start()
        try:
            row = conn.execute(CALL_PURGE, params).fetchone()
        except psycopg.errors.LockNotAvailable as exc:  # 55P03: old transactions outlived wait_timeout
            report.status = "timeout"
            report.details.append((exc.diag.message_primary or str(exc)).removeprefix("inbox.purge: "))
            return report
        except psycopg.errors.QueryCanceled:
            if not cancelled.is_set():
                raise
            report.details.append("stopped")
            report.status = "purged" if report.rows_deleted > 0 else "done"
            return report
        finally:
            with calling:
                finished.set()
        assert row is not None
        report.rows_deleted, report.status = int(row[0] or 0), str(row[1])
        if report.status in ("purged", "done", "inactive"):
            state = _rows(conn, PURGE_STATE, {"consumer": consumer, "producer": producer})
            if state:
                report.watermark, report.purged_before = state[0]["watermark"], state[0]["purged_before"]
        return report
    finally:
        conn.remove_notice_handler(on_notice)
        if watcher is not None:
            watcher.join(5)
        report.seconds = round(time.monotonic() - started, 3)
        if not conn.closed and not conn.broken:
            _rows(conn, UNLOCK, {"consumer": consumer})


def purge(
    conn: psycopg.Connection[Any],
    consumer: str | None = None,
    *,
    batch_size: int = 5000,
    max_batches: int = 1000,
    wait_timeout: float = 300.0,
    pause: float = 0.0,
    stop: threading.Event | None = None,
    progress: Callable[[PurgeProgress], None] | None = None,
    estimate: bool = False,
) -> list[PurgeReport]:
    """Purge the named consumer, or every consumer that has a retention policy. `progress`: see
    purge_consumer; `estimate`: count the rows to go of each consumer before purging it (for the
    progress: it reads the consumer's old rows once)."""
    pooler.refuse_pooled(pooler.behind_pooler(conn), "purge (its session-level advisory lock)")
    consumers: Sequence[str]
    if consumer is not None:
        consumers = [consumer]
    else:
        consumers = [row["consumer"] for row in _rows(conn, POLICY_CONSUMERS, {})]
    return [
        purge_consumer(
            conn,
            name,
            batch_size=batch_size,
            max_batches=max_batches,
            wait_timeout=wait_timeout,
            pause=pause,
            stop=stop,
            progress=progress,
            estimate=estimate_rows_to_go(conn, name) if estimate else None,
        )
        for name in consumers
    ]


def retention_status(conn: psycopg.Connection[Any], consumer: str | None = None) -> list[dict[str, Any]]:
    """Rows of inbox.retention_status (one per consumer and policy producer)."""
    return _rows(conn, STATUS, {"consumer": consumer})


def set_policy(
    conn: psycopg.Connection[Any], consumer: str, producer: str, scenarios: Mapping[str, str], note: str
) -> tuple[timedelta, str]:
    """inbox.set_retention_policy: every scenario by name (an interval text, '0' = does not apply).
    Returns (window, dominating scenario)."""
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    params: dict[str, object] = {name: scenarios.get(name) for name in SCENARIOS}
    params.update(consumer=consumer, producer=producer, note=note)
    row = _rows(conn, SET_POLICY, params)[0]
    return row["retention_window"], row["dominating_scenario"]


class PeriodicPurger:
    """Runs `purge` for every consumer with a policy every `every` seconds in a daemon thread
    (`pginbox dispatch --purge-every`). Errors are logged, never raised: the next round retries."""

    def __init__(
        self,
        dsn: str,
        every: float,
        *,
        batch_size: int = 5000,
        max_batches: int = 1000,
        wait_timeout: float = 300.0,
        keep_delivered: timedelta | None = None,
    ) -> None:
        self.dsn = dsn
        self.every = every
        self.keep_delivered = keep_delivered
        self.effects_deleted = 0
        self.batch_size = batch_size
        self.max_batches = max_batches
        self.wait_timeout = wait_timeout
        self.rounds = 0
        self.rows_deleted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pginbox-purger", daemon=True)

    def start(self) -> PeriodicPurger:
        self._thread.start()
        return self

    def run_once(self) -> list[PurgeReport]:
        with psycopg.connect(self.dsn, autocommit=True, application_name="pginbox-purger") as conn:
            reports = purge(
                conn,
                batch_size=self.batch_size,
                max_batches=self.max_batches,
                wait_timeout=self.wait_timeout,
                stop=self._stop,
            )
        self.rounds += 1
        for report in reports:
            self.rows_deleted += report.rows_deleted
            _log.info(
                f"purge consumer={report.consumer} status={report.status} rows={report.rows_deleted} "
                f"seconds={report.seconds}"
            )
        if self.keep_delivered is not None:
            deleted = self.purge_effects()
            _log.info(f"purge outbox older_than={self.keep_delivered} rows={deleted}")
        return reports

    def purge_effects(self) -> int:
        """Deletes delivered/discarded effects older than keep_delivered, one bounded batch per
        transaction, until a batch comes back short (or stop())."""
        total = 0
        with psycopg.connect(self.dsn, autocommit=True, application_name="pginbox-purger") as conn:
            for _ in range(self.max_batches):
                row = conn.execute(
                    PURGE_EFFECTS, {"older_than": self.keep_delivered, "batch_size": self.batch_size}
                ).fetchone()
                deleted = int(row[0]) if row is not None and row[0] is not None else 0
                total += deleted
                if deleted < self.batch_size or self._stop.is_set():
                    break
        self.effects_deleted += total
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except (psycopg.Error, OSError) as exc:
                first_line = (str(exc).strip().splitlines() or [""])[0]
                _log.warning(f"purge failed: {type(exc).__name__}: {first_line}")
            self._stop.wait(self.every)

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
