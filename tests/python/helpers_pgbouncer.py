"""A private PgBouncer (Debian package `pgbouncer`) in transaction mode in front of the test cluster.

    with PgBouncer(pg_base, workdir, pool_size=1) as bouncer:
        dsn = bouncer.route(db_dsn)      # the same conninfo, through PgBouncer

auth_type trust, with auth_user=postgres and the default auth_query, so that every role the tests
create logs in as itself without an auth_file entry. Prepared statements are not tracked by this
PgBouncer (1.18): a statement one client prepares stays on the shared server session, as in the
PgBouncer most installations run.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _let_postgres_in(path: Path) -> None:
    """PgBouncer runs as the postgres OS user: it must reach its directory (pytest makes 0700 ones)."""
    tmp_root = Path(tempfile.gettempdir()).resolve()
    for directory in [path, *path.parents]:
        if directory == tmp_root or tmp_root not in directory.parents:
            break
        directory.chmod(stat.S_IMODE(directory.stat().st_mode) | stat.S_IXOTH)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    def __init__(self, base: str, workdir: Path, *, pool_size: int = 20) -> None:
        params = conninfo_to_dict(base)
        self.backend_host = str(params.get("host") or "127.0.0.1")
        self.backend_port = int(params.get("port") or 5432)
        self.workdir = workdir
        self.pool_size = pool_size
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def route(self, dsn: str) -> str:
        """`dsn` (a conninfo to the test cluster) through this PgBouncer."""
        params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
        params["host"] = "127.0.0.1"
        params["port"] = str(self.port)
        return make_conninfo("", **params)

    def start(self) -> PgBouncer:
        if not os.path.exists(PGBOUNCER):
            raise RuntimeError("pgbouncer is not installed: run ./dev.sh setup (Debian package pgbouncer)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        as_postgres = os.geteuid() == 0  # PgBouncer refuses to run as root
        if as_postgres:
            _let_postgres_in(self.workdir)
        log = self.workdir / "pgbouncer.log"
        for _ in range(5):
            self.port = free_port()
            ini = self.workdir / "pgbouncer.ini"
            users = self.workdir / "users.txt"
            users.write_text('"postgres" ""\n')
            ini.write_text(
                "[databases]\n"
                f"* = host={self.backend_host} port={self.backend_port} auth_user=postgres\n"
                "[pgbouncer]\n"
                "listen_addr = 127.0.0.1\n"
                f"listen_port = {self.port}\n"
                "unix_socket_dir =\n"
                "auth_type = trust\n"
                f"auth_file = {users}\n"
                "pool_mode = transaction\n"
                f"default_pool_size = {self.pool_size}\n"
                "max_client_conn = 1000\n"
                "max_db_connections = 0\n"
                "server_login_retry = 1\n"
                "ignore_startup_parameters = extra_float_digits,options\n"
                f"logfile = {log}\n"
            )
            if as_postgres:
                owner = pwd.getpwnam("postgres")
                for path in (self.workdir, ini, users):
                    os.chown(path, owner.pw_uid, owner.pw_gid)
            command = [PGBOUNCER, *(["-u", "postgres"] if as_postgres else []), str(ini)]
            with (self.workdir / "stderr.txt").open("wb") as stderr:
                self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
            if self._wait_ready():
                return self
            self.stop()
        said = "".join(p.read_text() for p in (log, self.workdir / "stderr.txt") if p.exists())
        raise RuntimeError(f"pgbouncer did not start: {said}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 10
        dsn = make_conninfo("", host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", connect_timeout=2)
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute("SELECT 1")
                return True
            except psycopg.OperationalError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # SIGTERM: immediate shutdown
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
