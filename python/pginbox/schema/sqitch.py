"""Run Sqitch (deploy / verify / revert / status) for the pginbox project against a DSN.

The DSN (libpq conninfo or postgresql:// URL) becomes a `db:pg:` target holding user, host, port
and database; everything else (password, sslmode, socket directory, ...) travels in the libpq
environment variables of the sqitch process, so no secret appears on a command line.

Every script runs with search_path = pg_catalog, pg_temp (`pinned_pgoptions`): nothing planted in
public, or in any other schema the deployer's path names, can shadow a built-in that a script calls
unqualified (docs/security.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

from pginbox.errors import SqitchError

__all__ = [
    "SqitchError",
    "SqitchTarget",
    "deploy",
    "find_project",
    "find_proxy_project",
    "pinned_pgoptions",
    "revert",
    "run",
    "status",
    "summarize_output",
    "target_from_dsn",
    "verify",
]

PLAN_FILE = "sqitch.plan"

# libpq keyword -> environment variable (the ones libpq documents).
_LIBPQ_ENV = {
    "host": "PGHOST",
    "hostaddr": "PGHOSTADDR",
    "port": "PGPORT",
    "dbname": "PGDATABASE",
    "user": "PGUSER",
    "password": "PGPASSWORD",
    "passfile": "PGPASSFILE",
    "channel_binding": "PGCHANNELBINDING",
    "service": "PGSERVICE",
    "options": "PGOPTIONS",
    "application_name": "PGAPPNAME",
    "sslmode": "PGSSLMODE",
    "requiressl": "PGREQUIRESSL",
    "sslcompression": "PGSSLCOMPRESSION",
    "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY",
    "sslrootcert": "PGSSLROOTCERT",
    "sslcrl": "PGSSLCRL",
    "sslcrldir": "PGSSLCRLDIR",
    "sslsni": "PGSSLSNI",
    "requirepeer": "PGREQUIREPEER",
    "ssl_min_protocol_version": "PGSSLMINPROTOCOLVERSION",
    "ssl_max_protocol_version": "PGSSLMAXPROTOCOLVERSION",
    "gssencmode": "PGGSSENCMODE",
    "krbsrvname": "PGKRBSRVNAME",
    "gsslib": "PGGSSLIB",
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "client_encoding": "PGCLIENTENCODING",
    "target_session_attrs": "PGTARGETSESSIONATTRS",
    "load_balance_hosts": "PGLOADBALANCEHOSTS",
}


@dataclass(frozen=True)
class SqitchTarget:
    """A sqitch target URI plus the libpq environment that completes it."""

    uri: str
    env: Mapping[str, str]


#: What starts every deploy, revert and verify session: the released scripts are frozen and call
#: built-in functions and operators unqualified, so their session must not resolve names through
#: the deployer's search_path (a public.format(text, text) planted where public is writable would
#: run as the superuser). The project's own Sqitch client, psql-pinned, appends the same option.
SEARCH_PATH_OPTION = "-c search_path=pg_catalog,pg_temp"


def pinned_pgoptions(pgoptions: str | None = None) -> str:
    """PGOPTIONS for a session that runs deploy, revert or verify scripts: `pgoptions` (kept) with
    search_path = pg_catalog, pg_temp appended. The last setting of an option wins, and one given at
    connection time wins over ALTER ROLE / ALTER DATABASE ... SET search_path; RESET ALL returns to it."""
    if pgoptions and pgoptions.strip():
        return f"{pgoptions} {SEARCH_PATH_OPTION}"
    return SEARCH_PATH_OPTION


def _psql_client() -> str:
    """The psql this package runs (through Sqitch): $PGINBOX_PSQL, else psql on PATH."""
    return os.environ.get("PGINBOX_PSQL") or "psql"


#: The Sqitch project this package ships (pginbox/schema/project: symlinks in a checkout, files in
#: an installed wheel).
PACKAGED_PROJECT = Path(__file__).resolve().parent / "project"


def find_project() -> Path:
    """The Sqitch project directory: $PGINBOX_SQITCH_DIR, else the project this package ships."""
    override = os.environ.get("PGINBOX_SQITCH_DIR")
    if override:
        path = Path(override)
        if not (path / PLAN_FILE).is_file():
            raise SqitchError(f"PGINBOX_SQITCH_DIR={override} holds no {PLAN_FILE}")
        return path
    if (PACKAGED_PROJECT / PLAN_FILE).is_file():
        return PACKAGED_PROJECT
    raise SqitchError(
        f"this pginbox package ships no Sqitch project ({PACKAGED_PROJECT / PLAN_FILE} is missing): "
        "reinstall it, or set PGINBOX_SQITCH_DIR to a pginbox source checkout"
    )


#: The routing layer's Sqitch project (proxy/ in a checkout: PL/Proxy functions deployed to a proxy
#: database in front of the shards; docs/scaling.md).
PACKAGED_PROXY_PROJECT = Path(__file__).resolve().parent / "proxy_project"


def find_proxy_project() -> Path:
    """The proxy Sqitch project: $PGINBOX_SQITCH_DIR/proxy when PGINBOX_SQITCH_DIR names a
    checkout, else the project this package ships."""
    override = os.environ.get("PGINBOX_SQITCH_DIR")
    if override:
        path = Path(override) / "proxy"
        if not (path / PLAN_FILE).is_file():
            raise SqitchError(f"PGINBOX_SQITCH_DIR={override} holds no proxy/{PLAN_FILE}")
        return path
    if (PACKAGED_PROXY_PROJECT / PLAN_FILE).is_file():
        return PACKAGED_PROXY_PROJECT
    raise SqitchError(
        f"this pginbox package ships no proxy Sqitch project ({PACKAGED_PROXY_PROJECT / PLAN_FILE} is missing): "
        "reinstall it, or set PGINBOX_SQITCH_DIR to a pginbox source checkout"
    )


def target_from_dsn(dsn: str) -> SqitchTarget:
    """Convert a libpq conninfo or URL to a `db:pg:` target and environment.

    User, a single TCP host, port and database name go into the URI; the rest (password,
    socket directories, several hosts, SSL settings, ...) into PG* environment variables.
    """
    try:
        params = {key: value for key, value in conninfo_to_dict(dsn).items() if value is not None}
    except Exception as exc:  # psycopg.ProgrammingError on a malformed DSN
        raise SqitchError(f"invalid connection string: {exc}") from None
    env: dict[str, str] = {}
    user = str(params.pop("user", ""))
    dbname = str(params.pop("dbname", ""))
    host = str(params.pop("host", ""))
    port = str(params.pop("port", ""))
    if host and (host.startswith(("/", "@")) or "," in host):
        # Socket directory or several hosts: only libpq's own syntax can say that.
        env["PGHOST"] = host
        host = ""
    if port and (not host or "," in port):
        env["PGPORT"] = port
        port = ""
    for key, value in params.items():
        variable = _LIBPQ_ENV.get(key)
        if variable is None:
            raise SqitchError(f"connection parameter {key!r} cannot be passed on to sqitch")
        env[variable] = str(value)

    authority = ""
    if user:
        authority += quote(user, safe="") + "@"
    if host:
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        authority += quote(host, safe=":[]")
        if port:
            authority += f":{port}"
    if authority:
        uri = f"db:pg://{authority}/{quote(dbname, safe='')}"
    else:
        uri = f"db:pg:{quote(dbname, safe='')}"
    return SqitchTarget(uri=uri, env=env)


def run(
    command: str,
    dsn: str,
    *args: str,
    project: Path | None = None,
) -> str:
    """Run `sqitch <command> --target <target> <args>` in the project; return its output.

    Raises SqitchError (with the full output) when sqitch fails.
    """
    executable = shutil.which("sqitch")
    if executable is None:
        raise SqitchError("sqitch is not installed (run ./dev.sh setup)")
    project_dir = project if project is not None else find_project()
    target = target_from_dsn(dsn)
    env = dict(os.environ)
    env.update(target.env)
    # Every psql session Sqitch starts for a script begins with the pinned search_path. Set here, not
    # left to the project's client (psql-pinned): PGINBOX_SQITCH_DIR may name a project without it,
    # and no mode bit of an installed file matters. Sqitch's registry connection inherits it too and
    # then sets search_path = sqitch, as it always does.
    env["PGOPTIONS"] = pinned_pgoptions(env.get("PGOPTIONS"))
    argv = [executable, command, "--target", target.uri, "--client", _psql_client(), *args]
    result = subprocess.run(
        argv,
        cwd=project_dir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        reason = summarize_output(result.stdout)
        raise SqitchError(
            f"sqitch {command} failed (exit {result.returncode}) on {target.uri}: {reason}",
            output=result.stdout,
            returncode=result.returncode,
        )
    return result.stdout


_ERROR_LINE = re.compile(r"\b(?:ERROR|FATAL|PANIC):\s+(.*)|(.*\bfailed: .*)")


def summarize_output(output: str) -> str:
    """One line out of sqitch's output: the first PostgreSQL error plus sqitch's last word."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return "no output"
    error = next((m for m in map(_ERROR_LINE.search, lines) if m), None)
    if error is None:
        return lines[-1]
    detail = (error.group(1) or error.group(2)).strip()
    return detail if lines[-1] in error.string else f"{detail} ({lines[-1]})"


def deploy(dsn: str, *, to_change: str | None = None, project: Path | None = None) -> str:
    args = ["--to-change", to_change] if to_change else []
    return run("deploy", dsn, *args, project=project)


def verify(dsn: str, *, project: Path | None = None) -> str:
    return run("verify", dsn, project=project)


def revert(dsn: str, *, to_change: str | None = None, project: Path | None = None) -> str:
    args = ["-y"]
    if to_change:
        args += ["--to-change", to_change]
    return run("revert", dsn, *args, project=project)


def status(dsn: str, *, project: Path | None = None) -> str:
    return run("status", dsn, project=project)
