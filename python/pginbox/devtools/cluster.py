"""A private PostgreSQL cluster for the demo and the tests.

The cluster listens on 127.0.0.1 only, with trust authentication for the `postgres` superuser,
and keeps fsync on (crash tests depend on it). The port is stored in the data directory, so the
same cluster is found again next time.

As root, PostgreSQL refuses to run: initdb, pg_ctl and the server then run as the `postgres` OS
user (via runuser) and the data directory is owned by it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pginbox.errors import ClusterError

__all__ = [
    "Cluster",
    "ClusterError",
    "default_cluster",
    "find_bindir",
    "project_root",
    "resolve_dsn",
]

DEMO_DATABASE = "pginbox_demo"
SERVICE_USER = "postgres"
SUPERUSER = "postgres"
HOST = "127.0.0.1"

# Settings file written into the data directory and included from postgresql.conf.
_SETTINGS_FILE = "pginbox.conf"
_LOG_FILE = "server.log"
_START_TIMEOUT_S = 120
# sockaddr_un.sun_path is 108 bytes on Linux; leave room for "/.s.PGSQL.NNNNN".
_MAX_SOCKET_DIR_LEN = 107 - len("/.s.PGSQL.65535")

StopMode = Literal["smart", "fast", "immediate"]


def find_bindir() -> Path:
    """Directory with initdb/pg_ctl: $PGINBOX_PG_BINDIR, else the highest
    /usr/lib/postgresql/<major>/bin, else the directory of initdb on PATH."""
    override = os.environ.get("PGINBOX_PG_BINDIR")
    if override:
        path = Path(override)
        if not (path / "initdb").is_file():
            raise ClusterError(f"PGINBOX_PG_BINDIR={override} has no initdb")
        return path
    candidates: list[tuple[int, Path]] = []
    base = Path("/usr/lib/postgresql")
    if base.is_dir():
        for entry in base.iterdir():
            if entry.name.isdigit() and (entry / "bin" / "initdb").is_file():
                candidates.append((int(entry.name), entry / "bin"))
    if candidates:
        return max(candidates)[1]
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise ClusterError(
        "PostgreSQL server binaries not found (no /usr/lib/postgresql/<major>/bin/initdb, "
        "no initdb on PATH); run ./dev.sh setup or set PGINBOX_PG_BINDIR"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _running_as_root() -> bool:
    return os.geteuid() == 0


def _quote_conf(value: str) -> str:
    """A postgresql.conf string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


class Cluster:
    """A private PostgreSQL cluster in `datadir`.

    `port`: the port to use; when None, the port stored in the data directory, or a free one
    picked at `ensure()` time.
    """

    def __init__(self, datadir: Path, port: int | None = None) -> None:
        self.datadir = Path(datadir).absolute()
        self._explicit_port = port
        self._port = port if port is not None else self._stored_port()
        self._bindir: Path | None = None

    def __repr__(self) -> str:
        return f"Cluster(datadir={str(self.datadir)!r}, port={self._port!r})"

    # ----------------------------------------------------------------- properties

    @property
    def bindir(self) -> Path:
        if self._bindir is None:
            self._bindir = find_bindir()
        return self._bindir

    @property
    def port(self) -> int:
        if self._port is None:
            raise ClusterError(f"cluster in {self.datadir} has no port yet: call ensure() first")
        return self._port

    @property
    def settings_file(self) -> Path:
        return self.datadir / _SETTINGS_FILE

    @property
    def log_file(self) -> Path:
        return self.datadir / _LOG_FILE

    def is_initialized(self) -> bool:
        return (self.datadir / "PG_VERSION").is_file()

    # ----------------------------------------------------------------- connection strings

    def dsn(self, dbname: str = "postgres") -> str:
        """libpq conninfo for `dbname` on this cluster."""
        return make_conninfo(host=HOST, port=str(self.port), user=SUPERUSER, dbname=dbname)

    def dsn_base(self) -> str:
        """libpq conninfo without a database name."""
        return make_conninfo(host=HOST, port=str(self.port), user=SUPERUSER)

    # ----------------------------------------------------------------- life cycle

    def ensure(self) -> None:
        """Create the cluster if missing and (re)write its connection settings."""
        if not self.is_initialized():
            self._initdb()
        if self._port is None:
            self._port = _free_port()
        self._write_settings()

    def start(self) -> None:
        """Start the server (creating the cluster if needed); no-op when it already runs.
        Returns once the server accepts connections."""
        if self.is_running():
            running_port = self._running_port()
            if self._port is None:
                self._port = running_port
            if running_port is not None and running_port != self._port:
                raise ClusterError(f"cluster in {self.datadir} runs on port {running_port}, not {self._port}")
            return
        self.ensure()
        attempts = 1 if self._explicit_port is not None else 3
        for attempt in range(attempts):
            result = self._pg_ctl("start", "-w", "-t", str(_START_TIMEOUT_S), "-l", str(self.log_file), check=False)
            if result.returncode == 0:
                return
            log_tail = self._log_tail()
            if "could not bind" in log_tail and attempt + 1 < attempts:
                # Someone took the port picked earlier: pick another one.
                self._port = _free_port()
                self._write_settings()
                continue
            raise ClusterError(
                f"could not start PostgreSQL in {self.datadir}: "
                f"{_last_lines(result.stdout + result.stderr)} {log_tail}".strip()
            )

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server; no-op when it is not running."""
        if not self.is_running():
            return
        self._pg_ctl("stop", "-w", "-t", str(_START_TIMEOUT_S), "-m", mode)

    def is_running(self) -> bool:
        if not self.is_initialized():
            return False
        result = self._pg_ctl("status", check=False)
        # 0: running, 3: not running, 4: no accessible data directory.
        return result.returncode == 0

    def destroy(self) -> None:
        """Stop the server (immediate) and remove the data directory."""
        if self.datadir.exists():
            with contextlib.suppress(ClusterError):
                self.stop("immediate")
            shutil.rmtree(self.datadir, ignore_errors=True)

    # ----------------------------------------------------------------- databases

    def database_exists(self, name: str) -> bool:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            return row is not None

    def create_database(self, name: str, template: str | None = None) -> None:
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(query)

    def drop_database(self, name: str) -> None:
        """Drop `name` if it exists, disconnecting its sessions."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    # ----------------------------------------------------------------- internals

    def _stored_port(self) -> int | None:
        try:
            text = self.settings_file.read_text()
        except OSError:
            return None
        match = re.search(r"^\s*port\s*=\s*(\d+)", text, re.MULTILINE)
        return int(match.group(1)) if match else None

    def _running_port(self) -> int | None:
        """The port from postmaster.pid (4th line) of the running server."""
        try:
            lines = (self.datadir / "postmaster.pid").read_text().splitlines()
            return int(lines[3])
        except (OSError, IndexError, ValueError):
            return None

    def _command(self, program: str, *args: str) -> list[str]:
        argv = [str(self.bindir / program), *args]
        if _running_as_root():
            return ["runuser", "-u", SERVICE_USER, "--", *argv]
        return argv

    def _run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, LC_ALL="C.UTF-8", LANG="C.UTF-8")
        try:
            result = subprocess.run(
                argv,
                # "/" so that the postgres OS user can always enter the working directory.
                cwd="/",
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                check=False,
            )
        except FileNotFoundError as exc:
            raise ClusterError(f"cannot run {argv[0]}: {exc.strerror}") from exc
        if check and result.returncode != 0:
            program = Path(argv[argv.index("--") + 1] if "--" in argv else argv[0]).name
            raise ClusterError(
                f"{program} failed (exit {result.returncode}) for {self.datadir}: "
                f"{_last_lines(result.stdout + result.stderr)}"
            )
        return result

    def _pg_ctl(self, action: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run(self._command("pg_ctl", action, "-D", str(self.datadir), *args), check=check)

    def _initdb(self) -> None:
        self._make_datadir()
        if any(self.datadir.iterdir()):
            raise ClusterError(f"{self.datadir} exists, is not empty and holds no cluster")
        if _running_as_root():
            self._hand_over_to_service_user()
        else:
            self.datadir.chmod(0o700)
        self._run(
            self._command(
                "initdb",
                "-D",
                str(self.datadir),
                "--auth=trust",
                f"--username={SUPERUSER}",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
            )
        )
        conf = self.datadir / "postgresql.conf"
        with conf.open("a") as handle:
            handle.write(
                f"\n# pginbox: connection settings of this private cluster\ninclude_if_exists = '{_SETTINGS_FILE}'\n"
            )

    def _make_datadir(self) -> None:
        missing = [d for d in [self.datadir, *self.datadir.parents] if not d.exists()]
        for directory in reversed(missing):
            directory.mkdir(exist_ok=True)
            if _running_as_root() and directory != self.datadir:
                # The postgres OS user must be able to traverse what we create for it,
                # whatever the umask.
                directory.chmod(0o755)

    def _hand_over_to_service_user(self) -> None:
        try:
            entry = pwd.getpwnam(SERVICE_USER)
        except KeyError as exc:
            raise ClusterError(f"running as root but there is no '{SERVICE_USER}' OS user to run PostgreSQL") from exc
        os.chown(self.datadir, entry.pw_uid, entry.pw_gid)
        self.datadir.chmod(0o700)
        probe = subprocess.run(
            ["runuser", "-u", SERVICE_USER, "--", "test", "-w", str(self.datadir)],
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        if probe.returncode != 0:
            raise ClusterError(
                f"the '{SERVICE_USER}' OS user cannot reach {self.datadir}: a parent directory "
                f"is not searchable by it; choose a data directory it can reach"
            )

    def _write_settings(self) -> None:
        socket_dir = str(self.datadir) if len(str(self.datadir)) <= _MAX_SOCKET_DIR_LEN else ""
        text = (
            "# Written by pginbox (python/pginbox/devtools/cluster.py); rewritten on each start.\n"
            f"port = {self.port}\n"
            f"listen_addresses = {_quote_conf(HOST)}\n"
            f"unix_socket_directories = {_quote_conf(socket_dir)}\n"
            "fsync = on\n"
        )
        if self.settings_file.exists() and self.settings_file.read_text() == text:
            return
        self.settings_file.write_text(text)
        if _running_as_root():
            entry = pwd.getpwnam(SERVICE_USER)
            os.chown(self.settings_file, entry.pw_uid, entry.pw_gid)

    def _log_tail(self) -> str:
        try:
            return _last_lines(self.log_file.read_text(errors="replace"))
        except OSError:
            return ""


def _last_lines(text: str, count: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-count:])


def project_root() -> Path | None:
    """The top of the source checkout this package runs from, or None when installed."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "python" / "pyproject.toml").is_file() and (
            (parent / "sqitch.plan").is_file() or (parent / ".git").exists()
        ):
            return parent
    return None


def default_cluster() -> Cluster:
    """The demo cluster: $PGINBOX_CLUSTER_DIR, else <checkout>/.pginbox/cluster, else
    $XDG_DATA_HOME/pginbox/cluster (~/.local/share/pginbox/cluster)."""
    override = os.environ.get("PGINBOX_CLUSTER_DIR")
    if override:
        return Cluster(Path(override))
    root = project_root()
    if root is not None:
        return Cluster(root / ".pginbox" / "cluster")
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Cluster(Path(data_home) / "pginbox" / "cluster")


def resolve_dsn(dsn: str | None) -> str:
    """The DSN to use: `dsn` if given, else $DATABASE_URL, else the default private cluster
    (started if needed) with database pginbox_demo (created if missing)."""
    if dsn:
        return dsn
    env_dsn = os.environ.get("DATABASE_URL")
    if env_dsn:
        return env_dsn
    cluster = default_cluster()
    cluster.start()
    if not cluster.database_exists(DEMO_DATABASE):
        cluster.create_database(DEMO_DATABASE)
    return cluster.dsn(DEMO_DATABASE)
