"""`pginbox outbox list | show | redrive | discard`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from pginbox.cli.context import connect, dsn_option
from pginbox.cli.output import echo_json, fmt, table
from pginbox.ops import outbox
from pginbox.ops.json_values import jsonable

__all__ = ["outbox_group"]

F = TypeVar("F", bound=Callable[..., Any])


@click.group(name="outbox")
def outbox_group() -> None:
    """Inspect outbox effects; redrive or discard dead ones (audited)."""


@outbox_group.command(name="list")
@dsn_option
@click.option("--status", "effect_status", type=click.Choice([*outbox.OUTBOX_STATUSES, "all"]), default="all",
              show_default=True)
@click.option("--consumer", default=None, help="Only this consumer's effects ('' for anonymous ones).")
@click.option("--destination", default=None, help="Only effects to this destination.")
@click.option("--limit", type=click.IntRange(1, 100000), default=50, show_default=True,
              help="Show at most this many (the newest); the last line says how many match.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def outbox_list(ctx: click.Context, command_dsn: str | None, effect_status: str, consumer: str | None,
                destination: str | None, limit: int, as_json: bool) -> None:
    """Effects, newest first, with their whole ids and their consumer (effect ids are unique per
    consumer); the last line says how many of how many are shown. A role without access to error
    texts (inbox_reader) sees the dead reason only."""
    wanted = None if effect_status == "all" else effect_status
    with connect(ctx, command_dsn) as conn:
        rows = outbox.list_effects(conn, wanted, limit, consumer, destination)
        total = len(rows) if len(rows) < limit else outbox.count_effects(conn, wanted, consumer, destination)
    if as_json:
        echo_json({"status": effect_status, "consumer": consumer, "destination": destination, "shown": len(rows),
                   "total": total, "effects": [jsonable(r) for r in rows]})
        return
    if not rows:
        whose = "" if consumer is None else f" of consumer {consumer!r}"
        whose += "" if destination is None else f" to destination {destination!r}"
        click.echo(("no effects" if effect_status == "all" else f"no {effect_status} effects") + whose)
        return
    lines = [
        [r["effect_id"], fmt(r["consumer"]), r["destination"], r["status"], r["attempts"], r["ordering_key"],
         fmt(r["created_at"]), _problem(r)]
        for r in rows
    ]
    click.echo(table(["effect_id", "consumer", "destination", "status", "attempts", "ordering_key", "created",
                      "problem"], lines))
    more = f" (newest first; --limit {total} or filters for the rest)" if total > len(rows) else " (newest first)"
    click.echo(f"{len(rows)} of {total} shown{more}")


def _problem(row: dict[str, object]) -> str | None:
    """The dead reason and the last error, one line, the error cut to 80 characters (whole in show)."""
    error = row.get("last_error")
    if isinstance(error, str):
        error = " ".join(error.split())
        error = error if len(error) <= 80 else error[:77] + "..."
    parts = [str(p) for p in (row.get("dead_reason"), error) if p]
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
def outbox_show(ctx: click.Context, effect_id: str, command_dsn: str | None, consumer: str | None,
                with_payload: bool, as_json: bool) -> None:
    """One effect, its redrives, and (with --payload) its body. ID may be a unique prefix of the id."""
    with connect(ctx, command_dsn) as conn:
        details = outbox.show_effect(conn, effect_id, with_payload=with_payload, consumer=consumer)
    if details is None:
        whose = "" if consumer is None else f" of consumer {consumer!r}"
        raise click.ClickException(f"no effect {effect_id!r}{whose}, and no effect id begins with it")
    row, redrives, discards = details.effect, details.redrives, details.discards
    result = {**jsonable(row), "redrives": [jsonable(r) for r in redrives],
              "discards": [jsonable(r) for r in discards]}
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
@click.argument("effect_id", metavar="ID")
@click.option("--note", required=True, help="Why: goes into the audit trail (inbox.outbox_redrive).")
@_consumer_option("The effect's consumer (needed when several consumers hold the id).")
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def outbox_redrive(ctx: click.Context, effect_id: str, note: str, consumer: str | None, command_dsn: str | None,
                   as_json: bool) -> None:
    """Send a dead effect again (inbox.redrive_effect: attempts reset, audited)."""
    with connect(ctx, command_dsn) as conn:
        row = outbox.redrive_effect(conn, effect_id, note, consumer)
    if as_json:
        echo_json(jsonable(row))
        return
    click.echo(f"effect {effect_id} of consumer {fmt(row['consumer'])}: {row['status']} (attempts {row['attempts']})")


@outbox_group.command(name="discard")
@click.argument("effect_id", metavar="ID")
@click.option("--note", required=True, help="Why: goes into the audit trail (inbox.outbox_discard).")
@_consumer_option("The effect's consumer (needed when several consumers hold the id).")
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def outbox_discard(ctx: click.Context, effect_id: str, note: str, consumer: str | None, command_dsn: str | None,
                   as_json: bool) -> None:
    """Close a dead effect without delivering it (inbox.discard_effect, audited): later effects of
    its ordering key are no longer held behind it."""
    with connect(ctx, command_dsn) as conn:
        row = outbox.discard_effect(conn, effect_id, note, consumer)
    if as_json:
        echo_json(jsonable(row))
        return
    key = f"; ordering key {row['ordering_key']} moves on" if row["ordering_key"] is not None else ""
    click.echo(f"effect {effect_id} of consumer {fmt(row['consumer'])}: {row['status']} "
               f"(after {row['attempts']} attempts){key}")
