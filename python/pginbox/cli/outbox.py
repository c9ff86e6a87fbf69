"""`pginbox outbox list | show | redrive | discard`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from pginbox.cli.context import connect, dsn_option
from pginbox.cli.output import echo_json, fmt, table
from pginbox.cli.progress import Render, duration, progress_for_stderr
from pginbox.ops import outbox
from pginbox.ops.json_values import jsonable

__all__ = ["outbox_group"]

F = TypeVar("F", bound=Callable[..., Any])


@click.group(name="outbox")
def outbox_group() -> None:
    """Inspect outbox effects; redrive or discard dead ones (audited); provision broker queues and streams."""


@outbox_group.command(name="list")
@dsn_option
@click.option(
    "--status", "effect_status", type=click.Choice([*outbox.OUTBOX_STATUSES, "all"]), default="all", show_default=True
)
@click.option("--consumer", default=None, help="Only this consumer's effects ('' for anonymous ones).")
@click.option("--destination", default=None, help="Only effects to this destination.")
@click.option(
    "--limit",
    type=click.IntRange(1, 100000),
    default=50,
    show_default=True,
    help="Show at most this many (the newest); the last line says how many match.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def outbox_list(
    ctx: click.Context,
    command_dsn: str | None,
    effect_status: str,
    consumer: str | None,
    destination: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Effects, newest first, with their whole ids and their consumer (effect ids are unique per
    consumer); the last line says how many of how many are shown. A role without access to error
    texts (inbox_reader) sees the dead reason only."""
    wanted = None if effect_status == "all" else effect_status
    with connect(ctx, command_dsn) as conn:
        rows = outbox.list_effects(conn, wanted, limit, consumer, destination)
        total = len(rows) if len(rows) < limit else outbox.count_effects(conn, wanted, consumer, destination)
    if as_json:
        echo_json(
            {
                "status": effect_status,
                "consumer": consumer,
                "destination": destination,
                "shown": len(rows),
                "total": total,
                "effects": [jsonable(r) for r in rows],
            }
        )
        return
    if not rows:
        whose = "" if consumer is None else f" of consumer {consumer!r}"
        whose += "" if destination is None else f" to destination {destination!r}"
        click.echo(("no effects" if effect_status == "all" else f"no {effect_status} effects") + whose)
        return
    lines = [
        [
            r["effect_id"],
            fmt(r["consumer"]),
            r["destination"],
            r["status"],
            r["attempts"],
            r["ordering_key"],
            fmt(r["created_at"]),
            _problem(r),
        ]
        for r in rows
    ]
    click.echo(
        table(
            ["effect_id", "consumer", "destination", "status", "attempts", "ordering_key", "created", "problem"], lines
        )
    )
    more = f" (newest first; --limit {total} or filters for the rest)" if total > len(rows) else " (newest first)"
    click.echo(f"{len(rows)} of {total} shown{more}")


def _problem(row: dict[str, object]) -> str | None:
    """The dead reason (or why it waits: deferred, no attempt spent) and the last error, one line,
    the error cut to 80 characters (whole in show)."""
    error = row.get("last_error")
    if isinstance(error, str):
        error = " ".join(error.split())
        error = error if len(error) <= 80 else error[:77] + "..."
    reason = row.get("dead_reason")
    if row.get("deferred_reason"):
        reason = f"deferred {row['deferred_reason']} x{row.get('deferrals')}"
    parts = [str(p) for p in (reason, error) if p]
    return ": ".join(parts) or None


def _consumer_option(help_text: str) -> Callable[[F], F]:
    return click.option("--consumer", default=None, help=help_text)


@outbox_group.command(name="show")
@click.argument("effect_id", metavar="ID")
@dsn_option
@_consumer_option("The effect's consumer (needed when several consumers hold the id).")
@click.option("--payload", "with_payload", is_flag=True, help="Also show payload, headers and response (operator).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def outbox_show(
    ctx: click.Context, effect_id: str, command_dsn: str | None, consumer: str | None, with_payload: bool, as_json: bool
) -> None:
    """One effect, its redrives, and (with --payload) its body. ID may be a unique prefix of the id."""
    with connect(ctx, command_dsn) as conn:
        details = outbox.show_effect(conn, effect_id, with_payload=with_payload, consumer=consumer)
    if details is None:
        whose = "" if consumer is None else f" of consumer {consumer!r}"
        raise click.ClickException(f"no effect {effect_id!r}{whose}, and no effect id begins with it")
    row, redrives, discards = details.effect, details.redrives, details.discards
    result = {**jsonable(row), "redrives": [jsonable(r) for r in redrives], "discards": [jsonable(r) for r in discards]}
    if as_json:
        echo_json(result)
        return
    for key, value in row.items():
        click.echo(f"{key}: {fmt(value)}")
    for r in redrives:
        click.echo(f"redrive {r['redrive_id']}: {fmt(r['redriven_at'])} by {r['redriven_by']}: {r['note']}")
    for r in discards:
        click.echo(f"discard {r['discard_id']}: {fmt(r['discarded_at'])} by {r['discarded_by']}: {r['note']}")


@outbox_group.command(name="redrive")
@click.argument("effect_id", metavar="[ID]", required=False)
@click.option("--note", required=True, help="Why: goes into the audit trail (inbox.outbox_redrive).")
@_consumer_option(
    "The effect's consumer (needed when several consumers hold the id); without ID: only this consumer's dead effects."
)
@click.option("--destination", default=None, help="Without ID: only dead effects to this destination.")
@click.option(
    "--dead-reason",
    type=click.Choice(["max_attempts", "permanent_failure", "lease_expired"]),
    default=None,
    help="Without ID: only dead effects that died for this reason.",
)
@click.option(
    "--since",
    default=None,
    metavar="TIMESTAMP",
    help="Without ID: only effects enqueued at or after this time (a PostgreSQL timestamptz).",
)
@click.option("--until", default=None, metavar="TIMESTAMP", help="Without ID: only effects enqueued before this time.")
@click.option("--all", "all_dead", is_flag=True, help="Without ID and without filters: every dead effect.")
@click.option(
    "--limit",
    type=click.IntRange(1, 1000000),
    default=10000,
    show_default=True,
    help="Without ID: redrive at most this many (the oldest first).",
)
@click.option("--dry-run", is_flag=True, help="Without ID: list what would be redriven, change nothing.")
@click.option(
    "--progress/--no-progress", "show_progress", default=None, help="Show progress on stderr [default: on a terminal]."
)
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def outbox_redrive(
    ctx: click.Context,
    effect_id: str | None,
    note: str,
    consumer: str | None,
    destination: str | None,
    dead_reason: str | None,
    since: str | None,
    until: str | None,
    all_dead: bool,
    limit: int,
    dry_run: bool,
    show_progress: bool | None,
    command_dsn: str | None,
    as_json: bool,
) -> None:
    """Send dead effects again (inbox.redrive_effect: attempts reset, each audited). With ID: that
    effect. Without: every dead effect matching --destination, --consumer, --dead-reason and the
    time range (--since/--until on the time it was enqueued), or --all; each in its own
    transaction, audited like a single redrive, with progress."""
    filters = destination is not None or consumer is not None or dead_reason is not None or since or until
    if effect_id is not None:
        if destination or dead_reason or since or until or all_dead or dry_run:
            raise click.UsageError("with ID, only --consumer narrows it; the filters are for a bulk redrive")
        with connect(ctx, command_dsn) as conn:
            row = outbox.redrive_effect(conn, effect_id, note, consumer)
        if as_json:
            echo_json(jsonable(row))
        else:
            click.echo(
                f"effect {effect_id} of consumer {fmt(row['consumer'])}: {row['status']} (attempts {row['attempts']})"
            )
        return
    if not filters and not all_dead:
        raise click.UsageError(
            "pass an effect ID, or filters (--destination, --consumer, --dead-reason, --since, "
            "--until), or --all for every dead effect"
        )
    progress = progress_for_stderr(show_progress, quiet=as_json and show_progress is None)
    with connect(ctx, command_dsn) as conn:
        if not dry_run:
            outbox.check_may_redrive(conn)
        chosen = outbox.select_dead(
            conn,
            destination=destination,
            consumer=consumer,
            dead_reason=dead_reason,
            since=since,
            until=until,
            limit=limit,
        )
        if dry_run:
            _echo_dry_run(chosen, as_json=as_json)
            return

        def render(done: outbox.BulkRedrive) -> Render:
            return lambda elapsed: (
                f"redriven {done.redriven + done.skipped} of {done.selected}"
                f" ({done.skipped} skipped), {duration(elapsed)}"
            )

        if progress is not None:
            progress.begin(render(outbox.BulkRedrive(selected=len(chosen))))
        try:
            result = outbox.redrive_many(
                conn, chosen, note, None if progress is None else lambda r: progress.show(render(r))
            )
        finally:
            if progress is not None:
                progress.close()
    _echo_bulk_redrive(result, limit_reached=len(chosen) >= limit, limit=limit, as_json=as_json)


def _echo_dry_run(chosen: list[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        echo_json({"dry_run": True, "selected": len(chosen), "effects": [jsonable(r) for r in chosen]})
        return
    for r in chosen:
        click.echo(f"{r['effect_id']}  consumer {fmt(r['consumer'])}")
    click.echo(
        f"{len(chosen)} dead effect{'s' if len(chosen) != 1 else ''} would be redriven (--dry-run: nothing changed)"
    )


def _echo_bulk_redrive(result: outbox.BulkRedrive, *, limit_reached: bool, limit: int, as_json: bool) -> None:
    if as_json:
        echo_json(
            {
                "selected": result.selected,
                "redriven": result.redriven,
                "skipped": result.skipped,
                "first_skip": result.first_skip,
                "limit_reached": limit_reached,
                "effects": [jsonable(r) for r in result.effects],
            }
        )
        return
    more = f"; --limit {limit} reached, run again for the rest" if limit_reached else ""
    skipped = f", {result.skipped} skipped ({result.first_skip})" if result.skipped else ""
    click.echo(
        f"redrove {result.redriven} of {result.selected} dead effects{skipped}{more}; "
        "each is audited in inbox.outbox_redrive"
    )


@outbox_group.command(name="discard")
@click.argument("effect_id", metavar="ID")
@click.option("--note", required=True, help="Why: goes into the audit trail (inbox.outbox_discard).")
@_consumer_option("The effect's consumer (needed when several consumers hold the id).")
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def outbox_discard(
    ctx: click.Context, effect_id: str, note: str, consumer: str | None, command_dsn: str | None, as_json: bool
) -> None:
    """Close a dead effect without delivering it (inbox.discard_effect, audited): later effects of
    its ordering key are no longer held behind it."""
    with connect(ctx, command_dsn) as conn:
        row = outbox.discard_effect(conn, effect_id, note, consumer)
    if as_json:
        echo_json(jsonable(row))
        return
    key = f"; ordering key {row['ordering_key']} moves on" if row["ordering_key"] is not None else ""
    click.echo(
        f"effect {effect_id} of consumer {fmt(row['consumer'])}: {row['status']} "
        f"(after {row['attempts']} attempts){key}"
    )


@outbox_group.command(name="provision")
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="The dispatcher's destinations file (the PGINBOX_DEST_* environment is read too).",
)
@click.option("--check", is_flag=True, help="Only look: change nothing, exit 2 when something is missing.")
@click.option(
    "--timeout", type=click.FloatRange(0.1, 120), default=5.0, show_default=True, help="Seconds per broker connection."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def outbox_provision(config: Path | None, check: bool, timeout: float, as_json: bool) -> None:
    """Create (or --check) what the configured destinations need on their brokers: the durable
    RabbitMQ queue of a routing_key on the default exchange, a JetStream stream capturing a NATS
    subject. Redis streams, webhooks and callables need nothing. Exit status 0 when all is there,
    2 with --check when something is missing, 1 when a broker refused or could not be reached."""
    from pginbox.ops import provision as prov
    from pginbox.transports.config import destination_sections

    try:
        sections = destination_sections(config)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot read the destinations: {exc}") from None
    if not sections:
        raise click.UsageError("no destinations: pass --config FILE (or set PGINBOX_DEST_<NAME>_URL)")
    outcomes = prov.provision(sections, check=check, timeout=timeout)
    if as_json:
        echo_json({"check": check, "destinations": [o.__dict__ for o in outcomes]})
    else:
        click.echo(
            table(
                ["destination", "type", "needs", "status", "detail"],
                [[o.destination, o.kind, o.what, o.status, o.detail] for o in outcomes],
            )
        )
    if any(o.status == prov.FAILED for o in outcomes):
        raise click.exceptions.Exit(1)
    if any(o.status == prov.MISSING for o in outcomes):
        raise click.exceptions.Exit(2)
