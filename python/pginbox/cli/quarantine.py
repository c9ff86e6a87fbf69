"""`pginbox quarantine list | show | repair | discard | release | redeem`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import cast

import click

from pginbox.cli.context import connect, database, dsn_option
from pginbox.cli.output import echo_json, fmt, format_age, indent, table
from pginbox.cli.python_handler import configured_handler, consume_config_option, load_python_handler
from pginbox.consumer.core import is_async_handler
from pginbox.ops import granted_repair as granted
from pginbox.ops import quarantine as ops
from pginbox.ops.status import check_schema

__all__ = ["quarantine_group"]


@click.group(name="quarantine")
def quarantine_group() -> None:
    """Inspect and decide on quarantined messages (conflicts, exhausted attempts).

    Quarantine is a change of ownership, not success: each entry stays open until an operator
    repairs, discards or releases it, and every decision is audited (see `show`).
    """


@quarantine_group.command(name="list")
@dsn_option
@click.option("--consumer", metavar="NAME", default=None, help="Only entries of this consumer.")
@click.option(
    "--status",
    "entry_status",
    type=click.Choice([*ops.QUARANTINE_STATUSES, "all"]),
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
    with connect(ctx, command_dsn) as conn:
        check_schema(conn)
        listing = ops.list_entries(
            conn, consumer=consumer, status=None if entry_status == "all" else entry_status, limit=limit
        )
    if as_json:
        echo_json(listing.as_json())
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
            format_age(e["age"]),
        ]
        for e in listing.entries
    ]
    headers = [
        "id",
        "consumer",
        "producer",
        "message_id",
        "kind",
        "reason_code",
        "attempts",
        "deliveries",
        "status",
        "age",
    ]
    click.echo(table(headers, rows))
    more = f" (showing {len(listing.entries)}; --limit shows more)" if listing.total > len(listing.entries) else ""
    click.echo(f"{listing.total} {what}{where}{more}")


_ENTRY_FIELDS = (
    "quarantine_id",
    "status",
    "kind",
    "consumer",
    "tenant",
    "producer",
    "message_id",
    "message_type",
    "reason_code",
    "error_message",
    "attempts",
    "crashes",
    "deliveries",
    "handler_version",
    "payload_sha256",
    "stored_sha256",
    "payload_ref",
    "first_failure_at",
    "last_failure_at",
    "created_at",
    "last_seen_at",
    "decided_at",
    "decided_by",
)


@quarantine_group.command(name="show")
@click.argument("quarantine_id", type=int, metavar="ID")
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--show-payload", is_flag=True, help="Also print the stored payload (sensitive; needs inbox_operator).")
@click.pass_context
def quarantine_show(
    ctx: click.Context, quarantine_id: int, command_dsn: str | None, as_json: bool, show_payload: bool
) -> None:
    """Every field of entry ID, its audit trail and its attempt record."""
    with connect(ctx, command_dsn) as conn:
        check_schema(conn)
        details = ops.show_entry(conn, quarantine_id, with_payload=show_payload)
    if as_json:
        echo_json(details.as_json())
        return
    entry = details.entry
    click.echo(f"quarantine entry {entry['quarantine_id']} ({entry['status']}, {entry['kind']})")
    width = max(len(name) for name in _ENTRY_FIELDS)
    for name in _ENTRY_FIELDS:
        click.echo(f"  {name:<{width}}  {fmt(entry[name])}")

    click.echo("audit trail (inbox.quarantine_decision):")
    if not details.decisions:
        click.echo("  no decisions yet")
    for d in details.decisions:
        reason = f"; reason {d['reason_code']}: {d['error_message']}" if d["reason_code"] else ""
        click.echo(
            f"  {fmt(d['decided_at'])}  {d['decided_by']}  {d['decision']} -> {d['result']}  note: {d['note']}{reason}"
        )

    click.echo("attempt record (inbox.attempt):")
    if details.attempt is None:
        click.echo("  none (no failure or redelivery was recorded for this identity)")
    else:
        a = details.attempt
        click.echo(f"  started {a['started']} (announced redeliveries), failed {a['failed']}")
        for name in (
            "reason_code",
            "error_message",
            "handler_version",
            "message_type",
            "first_failure_at",
            "last_failure_at",
            "last_started_at",
        ):
            click.echo(f"  {name:<16}  {fmt(a[name])}")

    click.echo("inbox row (inbox.message):")
    if details.message is None:
        click.echo("  none (the identity is not held: its next delivery is processed normally)")
    else:
        m = details.message
        click.echo(
            f"  status {m['status']}, handler {m['handler_version']}, hash {m['payload_sha256'] or '-'}, "
            f"processed_at {fmt(m['processed_at'])}"
        )

    _echo_payload(details, show_payload)


def _echo_payload(details: ops.EntryDetails, show_payload: bool) -> None:
    if not show_payload:
        click.echo("payload: not shown (sensitive; --show-payload prints it)")
    elif details.payload is not None:
        click.echo("payload:")
        click.echo(indent(json.dumps(details.payload, indent=2, ensure_ascii=False)))
    elif details.payload_bytes is not None:
        click.echo(f"payload: {len(details.payload_bytes)} bytes (not JSON; --json prints them in base64)")
    else:
        ref = details.entry["payload_ref"]
        click.echo("payload: not stored" + (f" (payload_ref {ref})" if ref else ""))


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


def _echo_decision(ctx: click.Context, quarantine_id: int, decision: ops.Decision, as_json: bool) -> None:
    if as_json:
        echo_json(decision.as_json())
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


def _decision_command(action: ops.Action) -> None:
    @quarantine_group.command(name=action, help=_DECISION_HELP[action])
    @click.argument("quarantine_id", type=int, metavar="ID")
    @click.option("--note", required=True, help="Why: goes into the audit trail.")
    @dsn_option
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
    @click.pass_context
    def command(ctx: click.Context, quarantine_id: int, note: str, command_dsn: str | None, as_json: bool) -> None:
        with connect(ctx, command_dsn) as conn:
            check_schema(conn)
            decision = ops.decide(conn, action, quarantine_id, note)
        _echo_decision(ctx, quarantine_id, decision, as_json)

    del command


for _action in ops.ACTIONS:
    if _action != "repair":
        _decision_command(_action)


def _echo_redemption(ctx: click.Context, done: granted.Redemption, as_json: bool) -> None:
    if as_json:
        echo_json(done.as_json())
    elif done.ok:
        click.echo(
            f"entry {done.quarantine_id}: recovered (the stored payload was applied by {done.handler}, handler "
            f"version {done.handler_version}, under grant {done.grant_id}; redeliveries are duplicates now)"
        )
    else:
        click.echo(
            f"entry {done.quarantine_id}: repair failed, the entry stays open "
            f"(reason {done.reason_code}: {done.error_message}; grant {done.grant_id} is used)"
        )
    if not done.ok:
        ctx.exit(1)


def _redeem(ctx: click.Context, dsn: str | None, grant_id: int, spec: str, handler: object) -> granted.Redemption:
    """A sync handler on a psycopg Connection; an `async def` one on an AsyncConnection (AsyncCursor),
    as `pginbox consume` runs them."""
    if is_async_handler(handler):
        return asyncio.run(
            granted.redeem_async(database(ctx, dsn), grant_id, spec, cast(granted.AsyncHandler, handler))
        )
    with connect(ctx, dsn) as conn:
        check_schema(conn)
        return granted.redeem(conn, grant_id, spec, cast(granted.Handler, handler))


@quarantine_group.command(name="repair")
@click.argument("quarantine_id", type=int, metavar="ID")
@click.option("--note", required=True, help="Why: goes into the audit trail.")
@click.option(
    "--python",
    "python_handler",
    metavar="MODULE:FUNCTION",
    default=None,
    help="Repair with this Python handler, handler(cursor, message), instead of the registered SQL handler: "
    "grants a one-time repair (inbox.grant_repair) that the consumer's own login runs.",
)
@click.option(
    "--consumer-dsn",
    metavar="DSN",
    default=None,
    envvar="PGINBOX_CONSUMER_DSN",
    help="With --python: the consumer service's own login, which runs the handler now. Without it the grant "
    "is printed for the consumer's side to run (pginbox quarantine redeem).",
)
@consume_config_option()
@click.option("--handler-version", default=None, help="With --python: recorded as the message's handler version.")
@click.option(
    "--valid-for",
    type=click.FloatRange(1, 86400),
    default=900.0,
    show_default=True,
    help="With --python: seconds the grant may be redeemed in.",
)
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def quarantine_repair(
    ctx: click.Context,
    quarantine_id: int,
    note: str,
    python_handler: str | None,
    consumer_dsn: str | None,
    handler_version: str | None,
    valid_for: float,
    consume_config: Path | None,
    command_dsn: str | None,
    as_json: bool,
) -> None:
    """Run the stored payload through the current handler now (failure entries). Exit status 1 when
    the handler fails again: the entry stays open and the failure is audited.

    With --python MODULE:FUNCTION the handler is Python: the operator (--dsn) grants one repair, and
    the consumer's own login (--consumer-dsn) runs the handler in the transaction that claims the
    message; the database refuses the grant when no role bound to the consumer could run it, and the
    run when the login is not the consumer's."""
    python_handler, handler_version = configured_handler(consume_config, python_handler, handler_version)
    if python_handler is None:
        if consumer_dsn or handler_version:
            raise click.UsageError("--consumer-dsn and --handler-version go with --python")
        with connect(ctx, command_dsn) as conn:
            check_schema(conn)
            decision = ops.decide(conn, "repair", quarantine_id, note)
        _echo_decision(ctx, quarantine_id, decision, as_json)
        return
    handler = load_python_handler(python_handler) if consumer_dsn else None
    with connect(ctx, command_dsn) as conn:
        check_schema(conn)
        issued = granted.grant(
            conn, quarantine_id, python_handler, note, handler_version=handler_version, valid_for=valid_for
        )
    if handler is None:
        if as_json:
            echo_json(issued.as_json())
        else:
            click.echo(
                f"entry {quarantine_id}: repair grant {issued.grant_id} issued for {python_handler} "
                f"(consumer {issued.consumer}), valid until {issued.expires_at:%Y-%m-%d %H:%M:%S%z}. "
                f"The consumer's own login runs it: pginbox quarantine redeem {issued.grant_id} "
                f"--python {python_handler} --dsn <the consumer's DSN>"
            )
        return
    assert consumer_dsn is not None
    _echo_redemption(ctx, _redeem(ctx, consumer_dsn, issued.grant_id, python_handler, handler), as_json)


@quarantine_group.command(name="redeem")
@click.argument("grant_id", type=int, metavar="GRANT")
@click.option(
    "--python",
    "python_handler",
    metavar="MODULE:FUNCTION",
    required=True,
    help="The Python handler the grant names, handler(cursor, message).",
)
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def quarantine_redeem(
    ctx: click.Context, grant_id: int, python_handler: str, command_dsn: str | None, as_json: bool
) -> None:
    """Run repair grant GRANT (pginbox quarantine repair ID --python ...) with the consumer's own
    login (--dsn): the handler runs in the transaction that claims the message, and the entry
    closes as recovered when it commits. Exit status 1 when the handler fails: the failure is
    audited, the entry stays open, the grant is used."""
    handler = load_python_handler(python_handler)
    _echo_redemption(ctx, _redeem(ctx, command_dsn, grant_id, python_handler, handler), as_json)
