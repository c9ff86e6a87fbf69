"""`pginbox deploy | verify | revert`: Sqitch against the DSN; `pginbox schema sql`: the same
deploy as one plain SQL script, for hosts without Sqitch."""

from __future__ import annotations

from pathlib import Path

import click
import psycopg

from pginbox.cli.context import database, dsn_option
from pginbox.schema import sqitch
from pginbox.schema.sqitch_script import render_script

__all__ = ["deploy", "revert", "schema_group", "verify"]

# What a revert of the whole schema (or of the changes that hold them) would throw away.
_HISTORY = """
SELECT (SELECT count(*) FROM inbox.message) AS identities,
       (SELECT count(*) FROM inbox.outbox WHERE status IN ('pending', 'leased', 'dead')) AS effects_owed,
       (SELECT count(*) FROM inbox.quarantine WHERE status = 'open') AS open_entries
"""


@click.command()
@dsn_option
@click.option("--to-change", metavar="CHANGE", help="Deploy up to this change (or @tag) only.")
@click.option(
    "--proxy",
    is_flag=True,
    help="Deploy the routing layer (PL/Proxy, project pginbox_proxy) to a proxy database in front of the shards.",
)
@click.pass_context
def deploy(ctx: click.Context, command_dsn: str | None, to_change: str | None, proxy: bool) -> None:
    """Deploy the schema with Sqitch, or upgrade it in place to this package's release (idempotent).
    With --proxy: the routing layer instead (docs/scaling.md); shards get the plain deploy."""
    project = sqitch.find_proxy_project() if proxy else None
    output = sqitch.deploy(database(ctx, command_dsn), to_change=to_change, project=project)
    click.echo(output.rstrip())


@click.command()
@dsn_option
@click.option("--proxy", is_flag=True, help="Verify the routing layer (project pginbox_proxy) of a proxy database.")
@click.pass_context
def verify(ctx: click.Context, command_dsn: str | None, proxy: bool) -> None:
    """Run the Sqitch verify scripts."""
    project = sqitch.find_proxy_project() if proxy else None
    click.echo(sqitch.verify(database(ctx, command_dsn), project=project).rstrip())


def _history(dsn: str) -> tuple[int, int, int] | None:
    with psycopg.connect(dsn, autocommit=True, application_name="pginbox-cli") as conn:
        # Pinned like the revert scripts that follow: the deployer's search_path may name a schema
        # where anyone can plant an operator (`status = 'open'` compares text).
        conn.execute("SET search_path = pg_catalog, pg_temp")
        deployed = conn.execute("SELECT to_regclass('inbox.message') IS NOT NULL").fetchone()
        if not deployed or not deployed[0]:
            return None
        if conn.execute("SELECT to_regclass('inbox.outbox') IS NULL").fetchone() == (True,):
            row = conn.execute(
                "SELECT (SELECT count(*) FROM inbox.message), 0,"
                " (SELECT count(*) FROM inbox.quarantine WHERE status = 'open')"
            ).fetchone()
        else:
            row = conn.execute(_HISTORY).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


@click.command()
@dsn_option
@click.option("--to-change", metavar="CHANGE", help="Revert down to this change (or @tag), which is kept.")
@click.option("--yes", is_flag=True, help="Do not ask: revert.")
@click.option(
    "--discard-history", is_flag=True, help="Accept losing every remembered identity and owed effect (with --yes)."
)
@click.pass_context
def revert(
    ctx: click.Context, command_dsn: str | None, to_change: str | None, yes: bool, discard_history: bool
) -> None:
    """Revert the schema with Sqitch. Refused while the inbox remembers identities or owes effects,
    unless --yes --discard-history: after that, every redelivery would be applied again. To pick up a
    fix, upgrade with `pginbox deploy` instead; reverting to an earlier release (--to-change @tag)
    keeps the data and needs no flag."""
    dsn = database(ctx, command_dsn)
    keeps_data = to_change is not None and to_change.startswith("@")
    history = None if keeps_data else _history(dsn)
    if history is not None and (history[0] or history[1]) and not (yes and discard_history):
        identities, owed, open_entries = history
        raise click.ClickException(
            f"refusing to revert: inbox.message remembers {identities} identities, the outbox owes {owed} "
            f"effects and {open_entries} quarantine entries are open; after a revert every redelivery "
            "would be applied again and the effects would never be delivered. Upgrade with `pginbox deploy` "
            "to pick up a fix; pass --yes --discard-history only to throw all of it away"
        )
    click.echo(sqitch.revert(dsn, to_change=to_change).rstrip())


@click.group(name="schema")
def schema_group() -> None:
    """The schema as plain SQL, for hosts without Sqitch."""


@schema_group.command(name="sql")
@click.option("--to", "to_tag", metavar="TAG", help="Stop at this release tag [default: the whole plan].")
@click.option(
    "--since", "since_tag", metavar="TAG", help="Only the changes after this tag: the upgrade of a database at TAG."
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write to this file instead of standard output.",
)
def schema_sql(to_tag: str | None, since_tag: str | None, output: Path | None) -> None:
    """Print the deploy (or the upgrade from --since TAG) as one psql script, with the Sqitch
    registry rows, so that Sqitch can take over later. Apply it with
    `psql -X -v ON_ERROR_STOP=1 -d DB -f FILE`."""
    script = render_script(sqitch.find_project(), to=to_tag, since=since_tag)
    if output is None:
        click.echo(script, nl=False)
    else:
        output.write_text(script)
        click.echo(f"wrote {output}", err=True)
