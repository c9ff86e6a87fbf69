"""`pginbox status`: deployed Sqitch changes, messages by status, quarantine entries."""

from __future__ import annotations

from typing import Any

import click
import psycopg

from pginbox.cli.context import database, dsn_option
from pginbox.cli.output import echo_json, format_age, indent, table
from pginbox.ops.status import InboxStatus, inbox_status, parse_sqitch_status
from pginbox.schema import sqitch

__all__ = ["status"]

_STATUS_CONSUMERS = 20  # consumers with open entries listed by `status` (the busiest first)
# Exit statuses besides 0 (and 1 for errors): the schema is missing, or this package cannot work
# with it (older than the package, or a newer breaking release).
NOT_DEPLOYED = 3
INCOMPATIBLE = 4


def _registry_unreadable(dsn: str) -> str | None:
    """Why this role cannot read Sqitch's registry (schema sqitch), or None when it can. An operator
    or a reader usually cannot: the registry belongs to the deploying role; status then reads the
    schema release from inbox.version() alone."""
    try:
        with psycopg.connect(dsn, autocommit=True, application_name="pginbox-cli") as conn:
            row = conn.execute(
                "SELECT to_regnamespace('sqitch') IS NOT NULL, session_user::text, "
                "  to_regnamespace('sqitch') IS NOT NULL AND has_schema_privilege('sqitch', 'USAGE') "
                "  AND to_regclass('sqitch.changes') IS NOT NULL "
                "  AND has_table_privilege('sqitch.changes', 'SELECT')"
            ).fetchone()
    except psycopg.Error:
        return None  # let sqitch (and then the inbox queries) say what is wrong
    assert row is not None
    present, user, readable = row
    if not present:
        return "no Sqitch registry in this database (deployed with `pginbox schema sql`, or not at all)"
    if not readable:
        return (
            f"registry not readable by role {user} (the deploying role owns schema sqitch; "
            "the schema release below is read from inbox.version())"
        )
    return None


@click.command()
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def status(ctx: click.Context, command_dsn: str | None, as_json: bool) -> None:
    """Deployed Sqitch changes, messages by status and quarantine entries. Exits 3 when schema inbox
    is not deployed, 4 when this package cannot work with it (deploy to upgrade it)."""
    dsn = database(ctx, command_dsn)
    sqitch_output, sqitch_problem = _sqitch_status(dsn)
    with psycopg.connect(dsn, autocommit=True, application_name="pginbox-cli") as conn:
        found = inbox_status(conn)

    if as_json:
        result: dict[str, Any] = {"sqitch": {"problem": sqitch_problem}}
        if sqitch_output is not None:
            result["sqitch"].update(parse_sqitch_status(sqitch_output))
        result.update(found.as_json())
        echo_json(result)
        if not found.deployed:
            ctx.exit(NOT_DEPLOYED)
        if found.incompatible:
            ctx.exit(INCOMPATIBLE)
        return

    click.echo(sqitch_output.rstrip() if sqitch_output is not None else f"sqitch: {sqitch_problem}")
    if not found.deployed:
        click.echo("schema inbox: not deployed (run `pginbox deploy`)")
        ctx.exit(NOT_DEPLOYED)
    click.echo(f"schema inbox: release {found.release} (version {found.schema_version})")
    if found.incompatible:
        click.echo(f"schema inbox: {found.incompatible}")
        ctx.exit(INCOMPATIBLE)
    if found.problem:
        click.echo(f"inbox: {found.problem}")
        return
    _echo_counts(found)


def _sqitch_status(dsn: str) -> tuple[str | None, str | None]:
    """(`sqitch status --show-changes` output, None), or (None, why it could not be read)."""
    problem = _registry_unreadable(dsn)
    if problem is not None:
        return None, problem
    try:
        return sqitch.run("status", dsn, "--show-changes"), None
    except sqitch.SqitchError as exc:
        return None, sqitch.summarize_output(exc.output) if exc.output.strip() else str(exc)


def _echo_counts(found: InboxStatus) -> None:
    """Messages and quarantine entries by status, and the consumers with the most open entries."""
    click.echo("inbox.message by status:")
    for message_status, count in found.messages.items():
        click.echo(f"  {message_status:<12} {count}")
    click.echo("inbox.quarantine by status:")
    for q_status, kinds in found.quarantine.items():
        detail = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
        click.echo(f"  {q_status:<12} {sum(kinds.values())}  ({detail})")
    if found.open_by_consumer:
        click.echo(f"open quarantine entries: {found.open_entries}")
        busiest = sorted(found.open_by_consumer, key=lambda r: (-r["open"], r["consumer"]))
        rows = [
            [r["consumer"], r["open"], r["conflicts"], r["failures"], r["expired"], format_age(r["oldest_age"])]
            for r in busiest[:_STATUS_CONSUMERS]
        ]
        click.echo(indent(table(["consumer", "open", "conflicts", "failures", "expired", "oldest"], rows)))
        if len(busiest) > _STATUS_CONSUMERS:
            click.echo(f"  ... and {len(busiest) - _STATUS_CONSUMERS} more consumers (--json lists them all)")
        click.echo("  (pginbox quarantine list [--consumer NAME] shows the entries)")
    else:
        click.echo("open quarantine entries: none")
