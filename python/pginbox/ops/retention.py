"""Retention from Python: policies, the purge loop (`pginbox purge`) and a background purger
(`pginbox dispatch --purge-every`). The rules live in SQL (sql/070_retention.sql); this module
only drives `inbox.announce_purge` and `inbox.purge_batch` with a commit after each call.

The purge of one consumer: become its purger (session advisory lock: another purger makes this
one return BUSY), announce the new cutoff and commit it, call purge_batch until it stops saying
'waiting' (transactions from before the announcement still run: at most `wait_timeout`, then
TIMEOUT and nothing more is deleted), then until it says 'done' (at most `max_batches` batches).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from pginbox import pooler

__all__ = [
    "SCENARIOS",
    "PeriodicPurger",
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

ANNOUNCE: Final = """
SELECT a.policy_producer, a.status, a.purged_before, a.watermark, a.detail
  FROM inbox.announce_purge(%(consumer)s, %(producer)s) a
"""

BATCH: Final = """
SELECT b.policy_producer, b.status, b.rows_deleted, b.purged_before, b.watermark, b.detail
  FROM inbox.purge_batch(%(consumer)s, %(producer)s, %(batch_size)s) b
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
    poll_interval: float = 0.05,
    pause: float = 0.0,
    stop: threading.Event | None = None,
) -> PurgeReport:
    """Purge one consumer (all its policies when producer is None) on an autocommit connection.
    `pause`: seconds to sleep after each batch, to leave the claims their share of a busy machine."""
    if not conn.autocommit:
        raise ValueError("purge_consumer needs an autocommit connection: it commits after every batch")
    # The purger's session advisory lock spans the batches' transactions: behind a transaction pooler
    # it would stay on a server session that other clients get (PoolerError, before anything runs).
    pooler.refuse_pooled(pooler.behind_pooler(conn), "purge (its session-level advisory lock)")
    started = time.monotonic()
    report = PurgeReport(consumer, "done")
    try:
        announced = _rows(conn, ANNOUNCE, {"consumer": consumer, "producer": producer})
        statuses = {row["status"] for row in announced}
        report.details.extend(f"{row['policy_producer'] or '*'}: {row['status']}: {row['detail']}" for row in announced)
        if "busy" in statuses or "no_policy" in statuses:
            report.status = "busy" if "busy" in statuses else "no_policy"
            return report
        deadline = time.monotonic() + wait_timeout
        while report.batches < max_batches and not (stop is not None and stop.is_set()):
            rows = _rows(conn, BATCH, {"consumer": consumer, "producer": producer, "batch_size": batch_size})
            statuses = {row["status"] for row in rows}
            deleted = sum(int(row["rows_deleted"]) for row in rows)
            report.rows_deleted += deleted
            for row in rows:
                report.watermark = max(filter(None, (report.watermark, row["watermark"])), default=None)
                report.purged_before = max(filter(None, (report.purged_before, row["purged_before"])), default=None)
            if deleted > 0:
                report.batches += 1
                if pause > 0:
                    time.sleep(pause)
                continue
            if statuses & {"waiting", "uncommitted"}:
                if time.monotonic() > deadline:
                    report.status = "timeout"
                    report.details.extend(f"{row['policy_producer'] or '*'}: {row['detail']}" for row in rows
                                          if row["status"] == "waiting")
                    return report
                time.sleep(poll_interval)
                continue
            break
        if report.rows_deleted > 0:
            report.status = "purged"
        elif announced and all(row["status"] == "inactive" for row in announced):
            report.status = "inactive"
        return report
    finally:
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
) -> list[PurgeReport]:
    """Purge the named consumer, or every consumer that has a retention policy."""
    pooler.refuse_pooled(pooler.behind_pooler(conn), "purge (its session-level advisory lock)")
    consumers: Sequence[str]
    if consumer is not None:
        consumers = [consumer]
    else:
        consumers = [row["consumer"] for row in _rows(conn, POLICY_CONSUMERS, {})]
    return [
        purge_consumer(conn, name, batch_size=batch_size, max_batches=max_batches, wait_timeout=wait_timeout,
                       pause=pause, stop=stop)
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

    def __init__(self, dsn: str, every: float, *, batch_size: int = 5000, max_batches: int = 1000,
                 wait_timeout: float = 300.0, keep_delivered: timedelta | None = None) -> None:
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
            reports = purge(conn, batch_size=self.batch_size, max_batches=self.max_batches,
                            wait_timeout=self.wait_timeout, stop=self._stop)
        self.rounds += 1
        for report in reports:
            self.rows_deleted += report.rows_deleted
            _log.info(f"purge consumer={report.consumer} status={report.status} rows={report.rows_deleted} "
                      f"seconds={report.seconds}")
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
                row = conn.execute(PURGE_EFFECTS, {"older_than": self.keep_delivered,
                                                   "batch_size": self.batch_size}).fetchone()
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
