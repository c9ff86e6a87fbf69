"""The dispatcher's LISTEN session: its own autocommit connection, reconnected with capped,
jittered exponential backoff (the caller claims after every reconnect: notifications sent while
nobody listened are gone), probed with SELECT 1 when idle.

LISTEN belongs to a server session: through a transaction pooler (PgBouncer) it lands on whichever
server connection the statement got, and the notifications never reach this client. The listener
checks its connection before LISTEN (pginbox.pooler) and, behind a pooler, does not listen: `wait`
then only sleeps (the dispatcher polls), and `polling_reason` says why."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from pginbox import pooler
from pginbox.dispatcher.log import kv, log
from pginbox.dispatcher.queries import LISTEN
from pginbox.dispatcher.stats import DispatcherStats
from pginbox.runtime.backoff import jittered

__all__ = ["Listener"]


class Listener:
    """The autocommit LISTEN session: reconnects with capped, jittered exponential backoff."""

    def __init__(
        self,
        dsn: str,
        name: str,
        stats: DispatcherStats,
        *,
        probe_interval: float,
        backoff_base: float = 0.05,
        backoff_max: float = 5.0,
        on_reconnect: Callable[[], None] | None = None,
        dedicated: bool = False,
    ) -> None:
        self.dsn = dsn
        self.dedicated = dedicated  # dsn is the --listen-dsn, not the claims' DSN
        #: Why this listener does not LISTEN (the dispatcher polls), or None while it may.
        self.polling_reason: str | None = None
        self._stop_wait = threading.Event()
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
        if self.polling_reason is not None or (self.conn is not None and not self.conn.closed):
            return False
        self.conn = None
        self._stop_wait = stop
        while not stop.is_set():
            try:
                conn = psycopg.connect(
                    self.dsn,
                    autocommit=True,
                    application_name=f"pginbox-dispatch-listen:{self.name}",
                    prepare_threshold=None,
                )
                if pooler.behind_pooler(conn):
                    conn.close()
                    self._poll_instead()
                    return False
                conn.execute(LISTEN)
            except psycopg.Error as exc:
                self.failures += 1
                delay = jittered(self.failures, self.backoff_base, self.backoff_max)
                log.warning(
                    kv(
                        "listen_connect_failed",
                        dispatcher=self.name,
                        attempt=self.failures,
                        retry_in=f"{delay:.3f}",
                        error=str(exc).strip(),
                    )
                )
                stop.wait(delay)
                continue
            self.conn = conn
            self.failures = 0
            self.last_activity = time.monotonic()
            if self.connected_once:
                self.stats.add(reconnects=1)
                if self.on_reconnect is not None:
                    self.on_reconnect()
                log.info(kv("listen_reconnected", dispatcher=self.name, backend_pid=conn.info.backend_pid))
            self.connected_once = True
            return True
        return False

    def _poll_instead(self) -> None:
        where = "--listen-dsn" if self.dedicated else "the dispatcher's DSN"
        fix = "" if self.dedicated else "; give it a direct connection with --listen-dsn (PGINBOX_DISPATCH_LISTEN_DSN)"
        self.polling_reason = (
            f"{where} goes through a connection pooler (PgBouncer): LISTEN needs a server session of its "
            f"own, so the dispatcher polls instead{fix}"
        )
        log.warning(kv("listen_disabled", dispatcher=self.name, reason=self.polling_reason))

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a notification. True on one, or when the session was lost
        (the caller claims either way; ensure() reconnects). Without LISTEN (polling_reason), it
        only sleeps, and answers False."""
        if self.polling_reason is not None:
            self._stop_wait.wait(timeout)
            return False
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
            log.warning(kv("listen_lost", dispatcher=self.name, error=str(exc).strip() or type(exc).__name__))
            self.close()
            return True

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken
                conn.close()
