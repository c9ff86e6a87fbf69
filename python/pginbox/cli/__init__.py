"""The `pginbox` command line.

    pginbox [--dsn DSN] [--verbose] deploy | verify | revert | status | demo
    pginbox quarantine list | show | repair | discard | release
    pginbox dispatch [--once] [--name N] [--callable DEST=MODULE:FUNCTION ...] [--config FILE] [--health-port P]
    pginbox dispatch-health [--port P | --url URL]
    pginbox outbox list | show | redrive | discard
    pginbox cluster [--datadir DIR] start | stop | status | dsn

Without --dsn (or DATABASE_URL) the commands use the private demo cluster (see
pginbox.cluster.default_cluster), started on demand, database pginbox_demo.

Errors are reported as one line without a traceback (use --verbose for the details). Passwords
in connection strings are never printed.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import re
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from pginbox.devtools.cluster import Cluster, StopMode, default_cluster, resolve_dsn
from pginbox.errors import PginboxError
from pginbox.ops import quarantine as operator
from pginbox.schema import sqitch
from pginbox.transports.config import load_config

__all__ = ["main", "mask_dsn"]

F = TypeVar("F", bound=Callable[..., Any])

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
class _State:
    dsn: str | None = None
    verbose: bool = False
    secrets: set[str] = field(default_factory=set)

    def remember_secrets_of(self, dsn: str | None) -> None:
        if dsn:
            password = _password_of(dsn)
            if password:
                self.secrets.add(password)

    def redact(self, text: str) -> str:
        for secret in sorted(self.secrets, key=len, reverse=True):
            text = text.replace(secret, _MASK)
        return _mask_patterns(text)


def _one_line(exc: BaseException) -> str:
    """A one-line description of `exc` for the error message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = "; ".join(lines) if lines else type(exc).__name__
    if isinstance(exc, psycopg.Error):
        sqlstate = getattr(exc, "sqlstate", None)
        prefix = f"database error [{sqlstate}]" if sqlstate else "database error"
        text = f"{prefix}: {text}"
    elif not isinstance(exc, PginboxError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 1000 else text[:997] + "..."


class _Group(click.Group):
    """Turns errors into one clean line (or a traceback with --verbose)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            state = ctx.find_object(_State) or _State()
            for param in ("dsn",):
                state.remember_secrets_of(ctx.params.get(param))
            if state.verbose:
                if isinstance(exc, sqitch.SqitchError) and exc.output:
                    click.echo(state.redact(exc.output.rstrip()), err=True)
                raise
            raise click.ClickException(state.redact(_one_line(exc))) from None


def _dsn_option(func: F) -> F:
    """--dsn on a subcommand as well, so `pginbox deploy --dsn ...` works too."""
    return click.option(
        "--dsn",
        "command_dsn",
        metavar="DSN",
        default=None,
        help="Connection string; overrides the global --dsn.",
    )(func)


def _database(ctx: click.Context, command_dsn: str | None) -> str:
    state = ctx.find_object(_State)
    assert state is not None
    state.remember_secrets_of(command_dsn)
    dsn = resolve_dsn(command_dsn or state.dsn)
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise click.ClickException(f"invalid connection string: {state.redact(str(exc))}") from None
    state.remember_secrets_of(dsn)
    if state.verbose:
        click.echo(f"using {mask_dsn(dsn)}", err=True)
    return dsn


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--dsn",
    envvar="DATABASE_URL",
    metavar="DSN",
    default=None,
    help="libpq connection string or URL [env DATABASE_URL; default: the private demo cluster, database pginbox_demo].",
)
@click.option("-v", "--verbose", is_flag=True, help="Show details and tracebacks on errors.")
@click.version_option(package_name="pginbox")
@click.pass_context
def main(ctx: click.Context, dsn: str | None, verbose: bool) -> None:
    """pginbox: deploy and inspect the SQL inbox package (schema inbox)."""
    state = _State(dsn=dsn or None, verbose=verbose)
    state.remember_secrets_of(dsn)
    ctx.obj = state


# --------------------------------------------------------------------------- sqitch commands


@main.command()
@_dsn_option
@click.option("--to-change", metavar="CHANGE", help="Deploy up to this change only.")
@click.pass_context
def deploy(ctx: click.Context, command_dsn: str | None, to_change: str | None) -> None:
    """Deploy the schema with Sqitch (idempotent)."""
    output = sqitch.deploy(_database(ctx, command_dsn), to_change=to_change)
    click.echo(output.rstrip())


@main.command()
@_dsn_option
@click.pass_context
def verify(ctx: click.Context, command_dsn: str | None) -> None:
    """Run the Sqitch verify scripts."""
    click.echo(sqitch.verify(_database(ctx, command_dsn)).rstrip())


@main.command()
@_dsn_option
@click.option("--to-change", metavar="CHANGE", help="Revert down to this change (kept).")
@click.pass_context
def revert(ctx: click.Context, command_dsn: str | None, to_change: str | None) -> None:
    """Revert the schema with Sqitch (no confirmation prompt)."""
    click.echo(sqitch.revert(_database(ctx, command_dsn), to_change=to_change).rstrip())


def _connect(ctx: click.Context, command_dsn: str | None) -> psycopg.Connection[tuple[Any, ...]]:
    """An autocommit connection for the operator commands."""
    return psycopg.connect(_database(ctx, command_dsn), autocommit=True, application_name="pginbox-cli")


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False, ensure_ascii=False))


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: columns as wide as their widest cell, numbers right-aligned."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    numeric = [all(isinstance(row[i], int) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


@main.command()
@_dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def status(ctx: click.Context, command_dsn: str | None, as_json: bool) -> None:
    """Deployed Sqitch changes, messages by status and quarantine entries."""
    dsn = _database(ctx, command_dsn)
    sqitch_output: str | None = None
    sqitch_problem: str | None = None
    try:
        sqitch_output = sqitch.run("status", dsn, "--show-changes")
    except sqitch.SqitchError as exc:
        lines = [line.strip() for line in exc.output.splitlines() if line.strip()]
        sqitch_problem = lines[-1] if lines else str(exc)
    with psycopg.connect(dsn, autocommit=True, application_name="pginbox-cli") as conn:
        inbox_status = operator.inbox_status(conn)

    if as_json:
        result: dict[str, Any] = {"sqitch": {"problem": sqitch_problem}}
        if sqitch_output is not None:
            result["sqitch"].update(operator.parse_sqitch_status(sqitch_output))
        result.update(inbox_status.as_json())
        _echo_json(result)
        return

    click.echo(sqitch_output.rstrip() if sqitch_output is not None else f"sqitch: {sqitch_problem}")
    if not inbox_status.deployed:
        click.echo("schema inbox: not deployed (run `pginbox deploy`)")
        return
    click.echo(f"schema inbox: version {inbox_status.schema_version}")
    if inbox_status.problem:
        click.echo(f"inbox: {inbox_status.problem}")
        return
    click.echo("inbox.message by status:")
    for message_status, count in inbox_status.messages.items():
        click.echo(f"  {message_status:<12} {count}")
    click.echo("inbox.quarantine by status:")
    for q_status, kinds in inbox_status.quarantine.items():
        detail = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
        click.echo(f"  {q_status:<12} {sum(kinds.values())}  ({detail})")
    if inbox_status.open_by_consumer:
        click.echo(f"open quarantine entries: {inbox_status.open_entries}")
        busiest = sorted(inbox_status.open_by_consumer, key=lambda r: (-r["open"], r["consumer"]))
        rows = [
            [r["consumer"], r["open"], r["conflicts"], r["failures"], operator.format_age(r["oldest_age"])]
            for r in busiest[:_STATUS_CONSUMERS]
        ]
        click.echo(_indent(_table(["consumer", "open", "conflicts", "failures", "oldest"], rows)))
        if len(busiest) > _STATUS_CONSUMERS:
            click.echo(f"  ... and {len(busiest) - _STATUS_CONSUMERS} more consumers (--json lists them all)")
        click.echo("  (pginbox quarantine list [--consumer NAME] shows the entries)")
    else:
        click.echo("open quarantine entries: none")


_STATUS_CONSUMERS = 20  # consumers with open entries listed by `status` (the busiest first)


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


# --------------------------------------------------------------------------- quarantine


@main.group(name="quarantine")
def quarantine_group() -> None:
    """Inspect and decide on quarantined messages (conflicts, exhausted attempts).

    Quarantine is a change of ownership, not success: each entry stays open until an operator
    repairs, discards or releases it, and every decision is audited (see `show`).
    """


@quarantine_group.command(name="list")
@_dsn_option
@click.option("--consumer", metavar="NAME", default=None, help="Only entries of this consumer.")
@click.option(
    "--status",
    "entry_status",
    type=click.Choice([*operator.QUARANTINE_STATUSES, "all"]),
    default="open",
    show_default=True,
    help="Entries in this status.",
)
@click.option("--limit", type=click.IntRange(1, 100000), default=50, show_default=True, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def quarantine_list(
    ctx: click.Context, command_dsn: str | None, consumer: str | None, entry_status: str, limit: int, as_json: bool
) -> None:
    """Quarantine entries, oldest first."""
    with _connect(ctx, command_dsn) as conn:
        operator.check_schema(conn)
        listing = operator.list_entries(
            conn, consumer=consumer, status=None if entry_status == "all" else entry_status, limit=limit
        )
    if as_json:
        _echo_json(listing.as_json())
        return
    what = f"{entry_status} entries" if entry_status != "all" else "entries"
    where = f" of consumer {consumer}" if consumer else ""
    if not listing.entries:
        click.echo(f"no {what}{where} in quarantine")
        return
    rows = [
        [
            e["quarantine_id"],
            e["consumer"],
            e["producer"],
            e["message_id"] if len(e["message_id"]) <= 40 else e["message_id"][:37] + "...",
            e["kind"],
            e["reason_code"],
            e["attempts"],
            e["deliveries"],
            e["status"],
            operator.format_age(e["age"]),
        ]
        for e in listing.entries
    ]
    headers = ["id", "consumer", "producer", "message_id", "kind", "reason_code", "attempts", "deliveries",
               "status", "age"]
    click.echo(_table(headers, rows))
    more = f" (showing {len(listing.entries)}; --limit shows more)" if listing.total > len(listing.entries) else ""
    click.echo(f"{listing.total} {what}{where}{more}")


_ENTRY_FIELDS = (
    "quarantine_id", "status", "kind", "consumer", "tenant", "producer", "message_id", "message_type",
    "reason_code", "error_message", "attempts", "crashes", "deliveries", "handler_version", "payload_sha256",
    "stored_sha256", "payload_ref", "first_failure_at", "last_failure_at", "created_at", "last_seen_at",
    "decided_at", "decided_by",
)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime.datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, str):
        return repr(value) if value == "" else value
    return str(value)


@quarantine_group.command(name="show")
@click.argument("quarantine_id", type=int, metavar="ID")
@_dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--show-payload", is_flag=True, help="Also print the stored payload (sensitive; needs inbox_operator).")
@click.pass_context
def quarantine_show(
    ctx: click.Context, quarantine_id: int, command_dsn: str | None, as_json: bool, show_payload: bool
) -> None:
    """Every field of entry ID, its audit trail and its attempt record."""
    with _connect(ctx, command_dsn) as conn:
        operator.check_schema(conn)
        details = operator.show_entry(conn, quarantine_id, with_payload=show_payload)
    if as_json:
        _echo_json(details.as_json())
        return
    entry = details.entry
    click.echo(f"quarantine entry {entry['quarantine_id']} ({entry['status']}, {entry['kind']})")
    width = max(len(name) for name in _ENTRY_FIELDS)
    for name in _ENTRY_FIELDS:
        click.echo(f"  {name:<{width}}  {_fmt(entry[name])}")

    click.echo("audit trail (inbox.quarantine_decision):")
    if not details.decisions:
        click.echo("  no decisions yet")
    for d in details.decisions:
        reason = f"; reason {d['reason_code']}: {d['error_message']}" if d["reason_code"] else ""
        click.echo(
            f"  {_fmt(d['decided_at'])}  {d['decided_by']}  {d['decision']} -> {d['result']}"
            f"  note: {d['note']}{reason}"
        )

    click.echo("attempt record (inbox.attempt):")
    if details.attempt is None:
        click.echo("  none (no failure or redelivery was recorded for this identity)")
    else:
        a = details.attempt
        click.echo(f"  started {a['started']} (announced redeliveries), failed {a['failed']}")
        for name in ("reason_code", "error_message", "handler_version", "message_type", "first_failure_at",
                     "last_failure_at", "last_started_at"):
            click.echo(f"  {name:<16}  {_fmt(a[name])}")

    click.echo("inbox row (inbox.message):")
    if details.message is None:
        click.echo("  none (the identity is not held: its next delivery is processed normally)")
    else:
        m = details.message
        click.echo(
            f"  status {m['status']}, handler {m['handler_version']}, hash {m['payload_sha256'] or '-'}, "
            f"processed_at {_fmt(m['processed_at'])}"
        )

    if not show_payload:
        click.echo("payload: not shown (sensitive; --show-payload prints it)")
    elif details.payload is not None:
        click.echo("payload:")
        click.echo(_indent(json.dumps(details.payload, indent=2, ensure_ascii=False)))
    elif details.payload_bytes is not None:
        click.echo(f"payload: {len(details.payload_bytes)} bytes (not JSON; --json prints them in base64)")
    else:
        click.echo("payload: not stored" + (f" (payload_ref {entry['payload_ref']})" if entry["payload_ref"] else ""))


_DECISION_HELP = {
    "repair": "Run the stored payload through the current handler now (failure entries). "
    "Exit status 1 when the handler fails again: the entry stays open and the failure is audited.",
    "discard": "Close the entry without effect: redeliveries of its message become duplicates.",
    "release": "Lift the hold: the next delivery is processed normally (failure entries).",
}

_DECISION_SAYS = {
    "recovered": "the stored payload was applied{version}; redeliveries are duplicates now",
    "discarded": "nothing was applied; redeliveries of its message are duplicates now",
    "released": "the hold is lifted; the next delivery is processed normally, with a full set of attempts",
}


def _decision_command(action: operator.Action) -> None:
    @quarantine_group.command(name=action, help=_DECISION_HELP[action])
    @click.argument("quarantine_id", type=int, metavar="ID")
    @click.option("--note", required=True, help="Why: goes into the audit trail.")
    @_dsn_option
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
    @click.pass_context
    def command(ctx: click.Context, quarantine_id: int, note: str, command_dsn: str | None, as_json: bool) -> None:
        with _connect(ctx, command_dsn) as conn:
            operator.check_schema(conn)
            decision = operator.decide(conn, action, quarantine_id, note)
        if as_json:
            _echo_json(decision.as_json())
        elif decision.ok:
            version = f" by handler version {decision.handler_version}" if decision.handler_version else ""
            says = _DECISION_SAYS[decision.result].format(version=version)
            click.echo(f"entry {quarantine_id}: {decision.result} ({says})")
        else:
            click.echo(
                f"entry {quarantine_id}: repair failed, the entry stays open "
                f"(reason {decision.reason_code}: {decision.error_message})"
            )
        if not decision.ok:
            ctx.exit(1)

    del command


_ACTIONS: tuple[operator.Action, ...] = ("repair", "discard", "release")
for _action in _ACTIONS:
    _decision_command(_action)


# --------------------------------------------------------------------------- outbox dispatcher

# Operator queries on the outbox (inbox_reader may run LIST and SHOW without payload columns;
# SHOW_PAYLOAD, REDRIVE and DISCARD need inbox_operator).
OUTBOX_LIST: Final = """
SELECT effect_id, destination, status::text AS status, attempts, ordering_key, created_at, available_at,
       leased_by, last_status_code, dead_reason::text AS dead_reason, last_error
  FROM inbox.outbox
 WHERE %(status)s::text IS NULL OR status::text = %(status)s::text
 ORDER BY created_at, order_seq NULLS LAST, effect_id
 LIMIT %(limit)s
"""
OUTBOX_SHOW: Final = """
SELECT effect_id, destination, status::text AS status, attempts, ordering_key, order_seq, blocked, created_at,
       available_at, lease_token, leased_by, lease_expires_at, last_attempt_at, last_error, last_status_code,
       last_duration_ms, delivered_at, dead_reason::text AS dead_reason, discarded_at
  FROM inbox.outbox
 WHERE effect_id = %(effect_id)s
"""
OUTBOX_SHOW_PAYLOAD: Final = """
SELECT payload, headers, last_response_excerpt FROM inbox.outbox WHERE effect_id = %(effect_id)s
"""
OUTBOX_REDRIVES: Final = """
SELECT redrive_id, redriven_by, redriven_at, note, attempts, dead_reason::text AS dead_reason, last_error
  FROM inbox.outbox_redrive
 WHERE effect_id = %(effect_id)s
 ORDER BY redrive_id
"""
OUTBOX_REDRIVE: Final = """
SELECT effect_id, status::text AS status, attempts FROM inbox.redrive_effect(%(effect_id)s, %(note)s)
"""
OUTBOX_DISCARDS: Final = """
SELECT discard_id, discarded_by, discarded_at, note, attempts, dead_reason, last_error
  FROM inbox.outbox_discard
 WHERE effect_id = %(effect_id)s
 ORDER BY discard_id
"""
OUTBOX_DISCARD: Final = """
SELECT effect_id, status::text AS status, attempts, ordering_key, discarded_at
  FROM inbox.discard_effect(%(effect_id)s, %(note)s)
"""
OUTBOX_STATUSES: Final = ("pending", "leased", "delivered", "dead", "discarded")


def _load_callable(spec: str) -> tuple[str, Callable[..., object]]:
    """`destination=module:function` -> (destination, the function)."""
    destination, sep, target = spec.partition("=")
    module_name, colon, attribute = target.partition(":")
    if not sep or not colon or not destination or not module_name or not attribute:
        raise click.BadParameter(f"expected destination=module:function, got {spec!r}", param_hint="--callable")
    try:
        found: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"{spec}: {exc}", param_hint="--callable") from None
    if not callable(found):
        raise click.BadParameter(f"{spec}: {attribute} is not callable", param_hint="--callable")
    return destination, found


def _configured_transports(config: Path | None) -> dict[str, Any]:
    """Destinations from pginbox.transports.load_config (TOML file, environment, entry points)."""
    return dict(load_config(config))


@main.command()
@_dsn_option
@click.option("--once", is_flag=True, help="Deliver everything due, then exit (for cron and tests).")
@click.option("--name", default=None, help="Dispatcher name (unique per process) [default: pginbox-<host>-<pid>].")
@click.option("--batch-size", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option("--lease", type=click.FloatRange(0.001, 86400), default=30.0, show_default=True, help="Lease, seconds.")
@click.option("--concurrency", type=click.IntRange(1, 1000), default=8, show_default=True,
              help="In-flight deliveries per destination.")
@click.option("--poll-interval", type=click.FloatRange(0.01, 3600), default=1.0, show_default=True,
              help="Longest wait between claims when idle (the NOTIFY signal usually comes first), seconds.")
@click.option("--delivery-timeout", type=click.FloatRange(0.001, 86400), default=None,
              help="A delivery running longer is reported as an ambiguous, retryable failure, seconds.")
@click.option("--callable", "callables", multiple=True, metavar="DEST=MODULE:FUNCTION",
              help="Deliver destination DEST by calling MODULE:FUNCTION(effect) (repeatable).")
@click.option("--config", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="TOML file of destinations (pginbox.transports).")
@click.option("--health-port", type=click.IntRange(0, 65535), default=None,
              help="Serve GET /healthz and GET /metrics (Prometheus) on this port (0: any free port, logged).")
@click.option("--health-host", default="127.0.0.1", show_default=True,
              help="Address the health endpoint binds to (it has no authentication).")
@click.option("--purge-every", type=click.FloatRange(1, 86400 * 7), default=None, metavar="SECONDS",
              help="Also purge every consumer with a retention policy this often (with --once: once, at the end).")
@click.option("--database-metrics", is_flag=True, default=False,
              help="Also serve inbox.metrics() at the health endpoint's /metrics (the role needs inbox_reader).")
@click.option("--keep-delivered", type=click.FloatRange(0, None), default=7 * 86400.0, show_default=True,
              metavar="SECONDS",
              help="With --purge-every: also delete delivered and discarded effects older than this, in batches.")
@click.pass_context
def dispatch(
    ctx: click.Context,
    command_dsn: str | None,
    once: bool,
    name: str | None,
    batch_size: int,
    lease: float,
    concurrency: int,
    poll_interval: float,
    delivery_timeout: float | None,
    callables: tuple[str, ...],
    config: Path | None,
    health_port: int | None,
    health_host: str,
    purge_every: float | None,
    database_metrics: bool,
    keep_delivered: float,
) -> None:
    """Deliver committed outbox effects to their destinations (SIGTERM/SIGINT: finish and exit 0)."""
    from pginbox.dispatcher import CallableTransport, ClaimError, Dispatcher, HealthServer
    from pginbox.ops.metrics import DatabaseCollector

    dsn = _database(ctx, command_dsn)
    transports: dict[str, Any] = _configured_transports(config)
    for spec in callables:
        destination, func = _load_callable(spec)
        transports[destination] = CallableTransport(func)
    if not transports:
        raise click.UsageError("no destinations: pass --callable DEST=MODULE:FUNCTION or --config FILE")
    name = name or f"pginbox-{socket.gethostname()}-{os.getpid()}"
    state = ctx.find_object(_State)
    logging.basicConfig(
        level=logging.DEBUG if state is not None and state.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    dispatcher = Dispatcher(
        dsn, name, transports, batch_size=batch_size, lease=lease, concurrency_per_destination=concurrency,
        poll_interval=poll_interval, delivery_timeout=delivery_timeout,
        extra_collectors=[DatabaseCollector(dsn)] if database_metrics else (),
    )
    previous = {}

    def on_signal(signum: int, frame: object) -> None:
        logging.getLogger("pginbox.dispatcher").info(f"stopping signal={signal.Signals(signum).name}")
        dispatcher.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    health = None
    purger = None
    if purge_every is not None:
        purger = retention.PeriodicPurger(dsn, purge_every, keep_delivered=datetime.timedelta(seconds=keep_delivered))
    try:
        if health_port is not None:
            health = HealthServer(dispatcher, health_host, health_port).start()
        if once:
            try:
                dispatcher.run_once()
            except ClaimError as exc:  # claims kept failing: --once did not drain
                raise click.ClickException(str(exc)) from None
            if purger is not None:
                purger.run_once()
        else:
            if purger is not None:
                purger.start()
            dispatcher.run()
    finally:
        if purger is not None:
            purger.stop()
        if health is not None:
            health.close()
        dispatcher.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stats = dispatcher.stats.as_dict()
    click.echo(" ".join(f"{k}={'-' if v is None else v}" for k, v in stats.items()))


@main.command(name="dispatch-health")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="The dispatcher's --health-port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="With --port: the dispatcher's --health-host.")
@click.option("--url", default=None, help="Full URL instead [default: http://HOST:PORT/healthz].")
@click.option("--timeout", type=click.FloatRange(0.1, 600), default=5.0, show_default=True, help="Seconds.")
def dispatch_health(port: int | None, host: str, url: str | None, timeout: float) -> None:
    """Ask a running `pginbox dispatch --health-port` whether it is healthy: prints its JSON;
    exit status 0 when healthy, 1 when not (503) or unreachable."""
    import urllib.error
    import urllib.request

    if url is None:
        if port is None:
            raise click.UsageError("pass --port PORT (the dispatcher's --health-port) or --url URL")
        url = f"http://{host}:{port}/healthz"
    if not url.startswith(("http://", "https://")):
        raise click.UsageError(f"--url must be http(s)://..., got {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"{url}: unreachable: {getattr(exc, 'reason', exc)}") from None
    click.echo(body.decode("utf-8", errors="replace").rstrip())
    if status != 200:
        raise click.exceptions.Exit(1)


@main.group(name="outbox")
def outbox_group() -> None:
    """Inspect outbox effects; redrive or discard dead ones (audited)."""


@outbox_group.command(name="list")
@_dsn_option
@click.option("--status", "effect_status", type=click.Choice([*OUTBOX_STATUSES, "all"]), default="all",
              show_default=True)
@click.option("--limit", type=click.IntRange(1, 100000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def outbox_list(ctx: click.Context, command_dsn: str | None, effect_status: str, limit: int, as_json: bool) -> None:
    """Effects, oldest first."""
    params = {"status": None if effect_status == "all" else effect_status, "limit": limit}
    with _connect(ctx, command_dsn) as conn, conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(OUTBOX_LIST, params).fetchall()
    if as_json:
        _echo_json({"status": effect_status, "effects": [operator.jsonable(r) for r in rows]})
        return
    if not rows:
        click.echo("no effects" if effect_status == "all" else f"no {effect_status} effects")
        return
    table = [
        [r["effect_id"] if len(r["effect_id"]) <= 40 else r["effect_id"][:37] + "...", r["destination"], r["status"],
         r["attempts"], r["ordering_key"], _fmt(r["created_at"]), r["dead_reason"] or r["last_error"]]
        for r in rows
    ]
    click.echo(_table(["effect_id", "destination", "status", "attempts", "ordering_key", "created", "problem"], table))


@outbox_group.command(name="show")
@click.argument("effect_id", metavar="ID")
@_dsn_option
@click.option("--payload", "with_payload", is_flag=True, help="Also show payload, headers and response (operator).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def outbox_show(ctx: click.Context, effect_id: str, command_dsn: str | None, with_payload: bool, as_json: bool) -> None:
    """One effect, its redrives, and (with --payload) its body."""
    with _connect(ctx, command_dsn) as conn, conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_SHOW, {"effect_id": effect_id}).fetchone()
        if row is None:
            raise click.ClickException(f"no effect {effect_id!r}")
        redrives = cur.execute(OUTBOX_REDRIVES, {"effect_id": effect_id}).fetchall()
        discards = cur.execute(OUTBOX_DISCARDS, {"effect_id": effect_id}).fetchall()
        if with_payload:
            extra = cur.execute(OUTBOX_SHOW_PAYLOAD, {"effect_id": effect_id}).fetchone()
            row.update(extra or {})
    result = {**operator.jsonable(row), "redrives": [operator.jsonable(r) for r in redrives],
              "discards": [operator.jsonable(r) for r in discards]}
    if as_json:
        _echo_json(result)
        return
    for key, value in row.items():
        click.echo(f"{key}: {_fmt(value)}")
    for r in redrives:
        click.echo(f"redrive {r['redrive_id']}: {_fmt(r['redriven_at'])} by {r['redriven_by']}: {r['note']}")
    for r in discards:
        click.echo(f"discard {r['discard_id']}: {_fmt(r['discarded_at'])} by {r['discarded_by']}: {r['note']}")


@outbox_group.command(name="redrive")
@click.argument("effect_id", metavar="ID")
@click.option("--note", required=True, help="Why: goes into the audit trail (inbox.outbox_redrive).")
@_dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def outbox_redrive(ctx: click.Context, effect_id: str, note: str, command_dsn: str | None, as_json: bool) -> None:
    """Send a dead effect again (inbox.redrive_effect: attempts reset, audited)."""
    with _connect(ctx, command_dsn) as conn, conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_REDRIVE, {"effect_id": effect_id, "note": note}).fetchone()
    assert row is not None
    if as_json:
        _echo_json(operator.jsonable(row))
        return
    click.echo(f"effect {effect_id}: {row['status']} (attempts {row['attempts']})")


@outbox_group.command(name="discard")
@click.argument("effect_id", metavar="ID")
@click.option("--note", required=True, help="Why: goes into the audit trail (inbox.outbox_discard).")
@_dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def outbox_discard(ctx: click.Context, effect_id: str, note: str, command_dsn: str | None, as_json: bool) -> None:
    """Close a dead effect without delivering it (inbox.discard_effect, audited): later effects of
    its ordering key are no longer held behind it."""
    with _connect(ctx, command_dsn) as conn, conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_DISCARD, {"effect_id": effect_id, "note": note}).fetchone()
    assert row is not None
    if as_json:
        _echo_json(operator.jsonable(row))
        return
    key = f"; ordering key {row['ordering_key']} moves on" if row["ordering_key"] is not None else ""
    click.echo(f"effect {effect_id}: {row['status']} (after {row['attempts']} attempts){key}")


# --------------------------------------------------------------------------- demo


@main.command()
@_dsn_option
@click.option(
    "--messages",
    type=click.IntRange(10, 1_000_000),
    default=3000,
    show_default=True,
    help="Messages the producer sends in the simulation.",
)
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Consumer threads.")
@click.option("--seed", type=int, default=None, help="Seed of the fault injection [default: random, printed].")
@click.option("--act", "acts", type=click.IntRange(1, 3), multiple=True,
              help="Run only this act (repeatable): 1 every outcome, 2 the simulation, 3 the outbox [default: all].")
@click.option("--outbox-messages", type=click.IntRange(10, 100_000), default=200, show_default=True,
              help="Act 3: messages whose handlers enqueue effects.")
@click.option("--sink-no-dedup", is_flag=True,
              help="Act 3: the HTTP sink does not deduplicate on Idempotency-Key (see why it must: the proof fails).")
@click.pass_context
def demo(ctx: click.Context, command_dsn: str | None, messages: int, workers: int, seed: int | None,
         acts: tuple[int, ...], outbox_messages: int, sink_no_dedup: bool) -> None:
    """Walk through every outcome, simulate at-least-once delivery with faults and prove that no
    message was applied twice, then deliver outbox effects to a flaky HTTP sink and prove each was
    sent with one stable key and counted once (exit status 1 if anything is violated)."""
    from pginbox import demo as demo_module

    demo_module.run(_database(ctx, command_dsn), messages=messages, workers=workers, seed=seed,
                    acts=acts or (1, 2, 3), outbox_messages=outbox_messages, sink_dedup=not sink_no_dedup)


# --------------------------------------------------------------------------- cluster


@main.group(name="cluster")
@click.option(
    "--datadir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Data directory [env PGINBOX_CLUSTER_DIR; default: <checkout>/.pginbox/cluster].",
)
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port to use.")
@click.pass_context
def cluster_group(ctx: click.Context, datadir: Path | None, port: int | None) -> None:
    """The private PostgreSQL cluster used by the demo (127.0.0.1, trust auth)."""
    if datadir is None:
        datadir = default_cluster().datadir
    ctx.meta["pginbox.cluster"] = Cluster(datadir, port)


def _cluster(ctx: click.Context) -> Cluster:
    found = ctx.meta["pginbox.cluster"]
    assert isinstance(found, Cluster)
    return found


@cluster_group.command(name="start")
@click.pass_context
def cluster_start(ctx: click.Context) -> None:
    """Create the cluster if needed and start it."""
    cluster = _cluster(ctx)
    cluster.start()
    click.echo(f"running: {cluster.dsn()}  (data directory {cluster.datadir})")


@cluster_group.command(name="stop")
@click.option(
    "--mode",
    type=click.Choice(["smart", "fast", "immediate"]),
    default="fast",
    show_default=True,
)
@click.pass_context
def cluster_stop(ctx: click.Context, mode: StopMode) -> None:
    """Stop the cluster."""
    cluster = _cluster(ctx)
    cluster.stop(mode)
    click.echo(f"stopped: {cluster.datadir}")


@cluster_group.command(name="status")
@click.pass_context
def cluster_status(ctx: click.Context) -> None:
    """Show whether the cluster runs (exit status 3 when it does not)."""
    cluster = _cluster(ctx)
    if not cluster.is_initialized():
        click.echo(f"not created: {cluster.datadir}")
        ctx.exit(3)
    if cluster.is_running():
        click.echo(f"running: {cluster.dsn()}  (data directory {cluster.datadir})")
        return
    click.echo(f"stopped: {cluster.datadir}")
    ctx.exit(3)


@cluster_group.command(name="dsn")
@click.option("--dbname", default="postgres", show_default=True)
@click.option("--no-dbname", is_flag=True, help="Leave the database name out.")
@click.pass_context
def cluster_dsn(ctx: click.Context, dbname: str, no_dbname: bool) -> None:
    """Print the connection string of the cluster (it must have been created)."""
    cluster = _cluster(ctx)
    click.echo(cluster.dsn_base() if no_dbname else cluster.dsn(dbname))


from pginbox.cli.replay import replay_group  # noqa: E402  (`pginbox replay`; imports the helpers above)

main.add_command(replay_group)

from pginbox.cli.metrics import metrics_group, stats  # noqa: E402  (`pginbox stats`, `pginbox metrics`)

main.add_command(stats)
main.add_command(metrics_group)

from pginbox.cli.retention import purge_command, retention_group  # noqa: E402  (`pginbox purge`, `pginbox retention`)
from pginbox.ops import retention  # noqa: E402  (`pginbox dispatch --purge-every`)

main.add_command(purge_command)
main.add_command(retention_group)
