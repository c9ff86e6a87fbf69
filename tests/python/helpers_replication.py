"""A private PostgreSQL primary with a streaming standby (Debian's PostgreSQL, `pg_basebackup -R`),
for the failover tests: crash the primary for real (SIGKILL of the postmaster and of every server
process, as when its machine dies), make the standby lag for real (SIGSTOP of its walreceiver, then
SIGKILL: the WAL in flight is lost as in a network partition), promote the standby.

A `Golden` primary (initdb, schema inbox deployed, the test's setup SQL) is built once per test
module and stopped; each `ReplicatedPair` copies its data directory (seconds, instead of a deploy
per run), starts it and takes a standby from it. Ports are picked free (Cluster retries another one
when a port is taken); as root the servers run as the postgres OS user, in directories right under
the system temporary directory (see conftest.make_cluster).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from conftest import PRIVATE_DB, sqitch_project
from helpers_brokers import wait_for
from psycopg.conninfo import make_conninfo

from pginbox.devtools.cluster import SERVICE_USER, Cluster
from pginbox.schema import sqitch

STANDBY_NAME = "standby1"


def _home() -> Path:
    home = Path(tempfile.mkdtemp(prefix="pginbox-failover-"))
    home.chmod(0o755)
    return home


def _as_service_user(argv: list[str]) -> list[str]:
    return ["runuser", "-u", SERVICE_USER, "--", *argv] if os.geteuid() == 0 else argv


def _chown(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, SERVICE_USER, SERVICE_USER)


class Golden:
    """A stopped primary with schema inbox and `setup_sql` in database `pginbox`: copied per run."""

    def __init__(self, setup_sql: str) -> None:
        self.home = _home()
        self.cluster = Cluster(self.home / "golden")
        self.cluster.start()
        try:
            self.cluster.create_database(PRIVATE_DB)
            dsn = self.cluster.dsn(PRIVATE_DB)
            sqitch.deploy(dsn, project=sqitch_project())
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(setup_sql.encode())
        finally:
            self.cluster.stop()

    def destroy(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


class ReplicatedPair:
    """A primary copied from `golden` and a streaming standby of it (application_name `name`)."""

    def __init__(self, golden: Golden, name: str = STANDBY_NAME) -> None:
        self.name = name
        self.home = _home()
        self.walreceiver_stopped: int | None = None
        self._clusters: list[Cluster] = []
        try:
            self._start(golden)
        except BaseException:
            self.destroy()
            raise

    def _start(self, golden: Golden) -> None:
        subprocess.run(["cp", "-a", str(golden.cluster.datadir), str(self.home / "primary")], check=True)
        (self.home / "primary" / "postmaster.pid").unlink(missing_ok=True)
        self.primary = Cluster(self.home / "primary")
        self.primary._port = None  # the golden's port is not ours: pick a free one
        self._clusters.append(self.primary)
        self.primary.start()
        standby_dir = self.home / "standby"
        standby_dir.mkdir(mode=0o700)
        _chown(standby_dir)
        subprocess.run(
            _as_service_user(
                [
                    str(self.primary.bindir / "pg_basebackup"),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(self.primary.port),
                    "-U",
                    "postgres",
                    "-D",
                    str(standby_dir),
                    "-R",
                    "-X",
                    "stream",
                    "-c",
                    "fast",
                ]
            ),
            check=True,
            capture_output=True,
            cwd="/",
        )
        (standby_dir / "postmaster.pid").unlink(missing_ok=True)
        auto = standby_dir / "postgresql.auto.conf"
        conninfo = make_conninfo(
            host="127.0.0.1", port=str(self.primary.port), user="postgres", application_name=self.name
        )
        with auto.open("a") as fh:
            fh.write(f"primary_conninfo = '{conninfo}'\nwal_receiver_status_interval = 1\n")
        self.standby = Cluster(standby_dir)
        self.standby._port = None
        (standby_dir / "pginbox.conf").unlink(missing_ok=True)
        self._clusters.append(self.standby)
        self.standby.start()
        wait_for(self._streaming, "the standby to stream from the primary", timeout=30)

    # ------------------------------------------------------------------ connection strings

    def dsn(self) -> str:
        """libpq multi-host: the primary, then the standby; only a read-write server is taken."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} user=postgres "
            f"dbname={PRIVATE_DB} target_session_attrs=read-write connect_timeout=2"
        )

    def primary_dsn(self) -> str:
        return self.primary.dsn(PRIVATE_DB)

    def standby_dsn(self) -> str:
        return self.standby.dsn(PRIVATE_DB)

    def _streaming(self) -> bool:
        with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming'",
                (self.name,),
            ).fetchone()
        return row is not None and row[0] == 1

    # ------------------------------------------------------------------ faults

    def stop_wal(self) -> None:
        """SIGSTOP the standby's walreceiver: the primary goes on committing, the standby lags."""
        with psycopg.connect(self.standby.dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT pid FROM pg_stat_wal_receiver").fetchone()
        assert row is not None, "the standby has no walreceiver"
        self.walreceiver_stopped = int(row[0])
        os.kill(self.walreceiver_stopped, signal.SIGSTOP)

    def resume_wal(self) -> None:
        """SIGCONT the stopped walreceiver: the standby catches up."""
        if self.walreceiver_stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.walreceiver_stopped, signal.SIGCONT)
            self.walreceiver_stopped = None

    def crash_primary(self) -> None:
        """SIGKILL of the postmaster and of every process of the primary, at once (its machine died)."""
        pid = int((self.primary.datadir / "postmaster.pid").read_text().splitlines()[0])
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        os.kill(pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGKILL)

    def promote(self) -> None:
        """The WAL the stopped walreceiver held in flight is lost (SIGKILL: the standby restarts its
        recovery from what it flushed), then the standby is promoted; returns once it writes."""
        if self.walreceiver_stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.walreceiver_stopped, signal.SIGKILL)
            self.walreceiver_stopped = None
            time.sleep(0.5)
        wait_for(self._accepts, "the standby to accept connections again", timeout=60, interval=0.2)
        subprocess.run(
            _as_service_user(
                [str(self.standby.bindir / "pg_ctl"), "promote", "-w", "-t", "60", "-D", str(self.standby.datadir)]
            ),
            check=True,
            capture_output=True,
            cwd="/",
        )
        wait_for(self._writable, "the promoted standby to accept writes", timeout=60, interval=0.2)

    def _accepts(self) -> bool:
        try:
            with psycopg.connect(self.standby.dsn(), autocommit=True, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def _writable(self) -> bool:
        try:
            with psycopg.connect(self.standby.dsn(), autocommit=True, connect_timeout=2) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                return row is not None and row[0] is False
        except psycopg.OperationalError:
            return False

    def destroy(self) -> None:
        if self.walreceiver_stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.walreceiver_stopped, signal.SIGCONT)
        for cluster in reversed(self._clusters):
            with contextlib.suppress(Exception):  # a crashed primary may leave nothing to stop
                cluster.stop("immediate")
        shutil.rmtree(self.home, ignore_errors=True)
