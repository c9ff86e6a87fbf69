"""`TimelineWatch`: notice that the database failed over (docs/failover.md).

A promoted standby starts a new WAL timeline. The consumer and the dispatcher read the timeline of
every new database connection (one statement, when the pool opens it) and compare it with the last
one seen: a higher timeline means a failover happened since (a lower one: the old primary came
back, or another cluster answers). Each change is counted (`pginbox_<daemon>_failovers_total`) and
logged at WARNING with its window:

    failover_detected from_timeline=1 to_timeline=2 down_seconds=3.2 last_ok_at=... durability=commit
                      at_risk="batches acked in the last replication lag before last_ok_at"

`down_seconds` is the time from the last successful batch on the old primary to the first
connection to the new one; with durability `commit`, what was acked in the standby's replication
lag before `last_ok_at` may be gone (the broker will not redeliver it); with `standby`, nothing
acked is. Connect with libpq multi-host and `target_session_attrs=read-write`
(`host=pg1,pg2 ... target_session_attrs=read-write`) so that new connections find the new primary.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import psycopg

from pginbox.runtime.log import kv

__all__ = ["TIMELINE", "TimelineWatch"]

#: The timeline of the WAL the server writes now (the first 8 hex digits of its WAL file name) and
#: its WAL position. Fails on a standby (recovery in progress): nothing is recorded then.
TIMELINE: Final = (
    "SELECT ('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))"
    "::bit(32)::integer, pg_catalog.pg_current_wal_lsn()::text"
)


class TimelineWatch:
    """Timelines seen by one daemon's connections. `observe` is called with each new connection's
    (timeline, lsn); `ok()` after each successful unit of work (a batch, a report)."""

    def __init__(self, logger: logging.Logger, on_failover: Callable[[], None], **labels: Any) -> None:
        self._log = logger
        self._on_failover = on_failover
        self._labels = labels
        self._lock = threading.Lock()
        self.timeline: int | None = None
        self.lsn: str | None = None
        self.failovers = 0
        self.last: dict[str, Any] | None = None
        self._last_ok: float | None = None
        self._last_ok_wall: datetime.datetime | None = None

    def ok(self) -> None:
        self._last_ok = time.monotonic()
        self._last_ok_wall = datetime.datetime.now(datetime.UTC)

    def observe(self, timeline: int, lsn: str, **window: Any) -> bool:
        """Records a connection's timeline; True (and a log line, a count) when it changed."""
        with self._lock:
            before, before_lsn = self.timeline, self.lsn
            self.timeline, self.lsn = timeline, lsn
            if before is None or before == timeline:
                return False
            self.failovers += 1
            down = None if self._last_ok is None else round(time.monotonic() - self._last_ok, 3)
            self.last = {
                "from_timeline": before,
                "to_timeline": timeline,
                "last_lsn_seen": before_lsn,
                "first_lsn": lsn,
                "down_seconds": down,
                "last_ok_at": None if self._last_ok_wall is None else self._last_ok_wall.isoformat(),
                "detected_at": datetime.datetime.now(datetime.UTC).isoformat(),
                **window,
            }
        self._on_failover()
        self._log.warning(kv("failover_detected", **self._labels, **self.last))
        return True

    def read(self, conn: psycopg.Connection[Any], **window: Any) -> None:
        """Reads the timeline of a new (sync) connection, leaving it idle."""
        try:
            row = conn.execute(TIMELINE, prepare=False).fetchone()
        except psycopg.Error:
            row = None
        if not conn.autocommit and not conn.closed:
            conn.rollback()
        if row is not None:
            self.observe(int(row[0]), str(row[1]), **window)

    async def aread(self, conn: psycopg.AsyncConnection[Any], **window: Any) -> None:
        """`read` for an asyncio connection."""
        try:
            cur = await conn.execute(TIMELINE, prepare=False)
            row = await cur.fetchone()
        except psycopg.Error:
            row = None
        if not conn.autocommit and not conn.closed:
            await conn.rollback()
        if row is not None:
            self.observe(int(row[0]), str(row[1]), **window)
