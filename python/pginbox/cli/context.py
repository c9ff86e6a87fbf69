"""What every command shares: the run's state (DSN, --verbose, secrets to keep out of output), the
top-level group that turns errors into one line, the per-command --dsn option, connecting, and the
PGINBOX_* environment variables of every option."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pginbox.cli.errors import describe
from pginbox.devtools.cluster import resolve_dsn
from pginbox.errors import PginboxError, SqitchError

__all__ = [
    "ENV_PREFIX",
    "DsnGroup",
    "State",
    "connect",
    "database",
    "dsn_option",
    "mask_dsn",
    "read_options_from_environment",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Every option can be given as PGINBOX_<COMMAND>_<OPTION> (see read_options_from_environment).
ENV_PREFIX = "PGINBOX"

_MASK = "***"
# Generic fallbacks for secrets in text we did not build ourselves.
_PASSWORD_PATTERNS = (
    re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE),
    re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/:@\s]*:)([^@\s]*)(@)", re.IGNORECASE),
)


def mask_dsn(dsn: str) -> str:
    """`dsn` with its password (if any) replaced by ***."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # not parseable: fall back to pattern masking
        return _mask_patterns(dsn)
    if params.get("password") is None:
        return _mask_patterns(dsn)
    params["password"] = _MASK
    return make_conninfo("", **params)


def _mask_patterns(text: str) -> str:
    text = _PASSWORD_PATTERNS[0].sub(lambda m: m.group(1) + _MASK, text)
    return _PASSWORD_PATTERNS[1].sub(lambda m: m.group(1) + _MASK + m.group(3), text)


def _password_of(dsn: str) -> str | None:
    try:
        value = conninfo_to_dict(dsn).get("password")
    except Exception:
        return None
    return str(value) if value else None


@dataclass
class State:
    """The global options of one run, and the secrets seen in it (never printed)."""

    dsn: str | None = None
    verbose: bool = False
    secrets: set[str] = field(default_factory=set)
    #: The DSN the command connected with and its path ('quarantine repair'), for error reports.
    used_dsn: str | None = None
    command: str | None = None

    def remember_secrets_of(self, dsn: str | None) -> None:
        if dsn:
            password = _password_of(dsn)
            if password:
                self.secrets.add(password)

    def redact(self, text: str) -> str:
        for secret in sorted(self.secrets, key=len, reverse=True):
            text = text.replace(secret, _MASK)
        return _mask_patterns(text)


def _schema_missing(exc: BaseException) -> PginboxError | None:
    """One error for every command that meets a database without schema inbox (3F000, or an
    inbox relation or function that does not exist)."""
    if not isinstance(exc, psycopg.Error):
        return None
    primary = (exc.diag.message_primary or "") if exc.diag else ""
    if exc.sqlstate == "3F000" or (exc.sqlstate in ("42P01", "42883") and "inbox." in primary):
        return PginboxError(
            "schema inbox is not deployed in this database: deploy it with `pginbox deploy --dsn <dsn>`",
            sqlstate=exc.sqlstate,
        )
    return None


class DsnGroup(click.Group):
    """The top-level group: the one handler of every command's errors. It prints what failed, then
    what the database said (message, DETAIL, HINT, SQLSTATE) and, for a missing grant, the group
    role that has it (pginbox.cli.errors); with --verbose, the traceback instead."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            missing = _schema_missing(exc)
            if missing is not None:
                missing.__cause__ = exc
                exc = missing
            state = ctx.find_object(State) or State()
            state.remember_secrets_of(ctx.params.get("dsn"))
            if state.verbose:
                if isinstance(exc, SqitchError) and exc.output:
                    click.echo(state.redact(exc.output.rstrip()), err=True)
                raise
            text = describe(exc, dsn=state.used_dsn, command=state.command)
            raise click.ClickException(state.redact(text)) from None


def dsn_option(func: F) -> F:
    """--dsn on a subcommand as well, so `pginbox deploy --dsn ...` works too. It reads no
    environment variable of its own: PGINBOX_DSN is the global --dsn's, and a value from the
    environment must never override one given on the command line."""
    return click.option(
        "--dsn",
        "command_dsn",
        metavar="DSN",
        default=None,
        allow_from_autoenv=False,
        help="Connection string; overrides the global --dsn.",
    )(func)


if TYPE_CHECKING:  # generic in click >= 8.2 only: subscripted for the type checker, not at run time
    _StrParamType = click.ParamType[str]
else:
    _StrParamType = click.ParamType


class _ShardDsn(_StrParamType):
    """A connection string of --shard-dsn (repeatable). In the environment, one per line: a
    connection string holds spaces."""

    name = "dsn"
    envvar_list_splitter = "\n"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        return str(value).strip()


SHARD_DSN: Final = _ShardDsn()

NO_DATABASE: Final = (
    "no database given: pass --dsn, or set PGINBOX_DSN or DATABASE_URL "
    "(only `pginbox demo` and `pginbox cluster` use the private demo cluster)"
)


def database(ctx: click.Context, command_dsn: str | None, *, demo_cluster: bool = False) -> str:
    """The DSN this command uses: its --dsn, the global one (PGINBOX_DSN, DATABASE_URL). Only the
    demo falls back to the private demo cluster (demo_cluster=True): an operator command run from
    cron without a DSN must fail loudly, not purge or report on a demo database."""
    state = ctx.find_object(State)
    assert state is not None
    state.remember_secrets_of(command_dsn)
    given = command_dsn or state.dsn or os.environ.get("DATABASE_URL")
    if not given and not demo_cluster:
        raise click.ClickException(NO_DATABASE)
    dsn = resolve_dsn(given)
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise click.ClickException(f"invalid connection string: {state.redact(str(exc))}") from None
    state.remember_secrets_of(dsn)
    state.used_dsn = dsn
    state.command = " ".join(ctx.command_path.split()[1:]) or None
    if state.verbose:
        click.echo(f"using {mask_dsn(dsn)}", err=True)
    return dsn


def connect(ctx: click.Context, command_dsn: str | None) -> psycopg.Connection[tuple[Any, ...]]:
    """An autocommit connection for the operator commands. No prepared statements: they are not hot
    paths, and so they work through a transaction pooler (PgBouncer: docs/pgbouncer.md)."""
    return psycopg.connect(
        database(ctx, command_dsn), autocommit=True, application_name="pginbox-cli", prepare_threshold=None
    )


def _env_name(prefix: str, option: click.Option) -> str:
    flag = max((o for o in option.opts if o.startswith("--")), key=len, default=option.opts[0])
    return f"{prefix}_{flag.lstrip('-').upper().replace('-', '_')}"


def read_options_from_environment(command: click.Command, prefix: str = ENV_PREFIX) -> None:
    """Let every option of `command` and its subcommands be given in the environment, named after
    the command path and the option's long flag: `pginbox quarantine list --consumer` reads
    PGINBOX_QUARANTINE_LIST_CONSUMER, `pginbox dispatch --health-port` PGINBOX_DISPATCH_HEALTH_PORT.
    The command line wins over the environment. Options that name their own variable keep it
    (the global --dsn: PGINBOX_DSN, then DATABASE_URL; cluster --datadir: PGINBOX_CLUSTER_DIR), and
    --help lists each option's variable. (click's auto_envvar_prefix would name them after the
    Python parameter, e.g. ..._COMMAND_DSN or ..._AS_JSON: these follow the flags users type.)"""
    for param in command.params:
        if not isinstance(param, click.Option) or param.is_eager or not param.expose_value:
            continue  # --version, --help
        if not param.allow_from_autoenv:
            continue
        if param.envvar is None:
            param.envvar = _env_name(prefix, param)
        param.show_envvar = True
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            read_options_from_environment(sub, f"{prefix}_{name.upper().replace('-', '_')}")
