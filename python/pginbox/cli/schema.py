"""`pginbox deploy | verify | revert`: Sqitch against the DSN."""

from __future__ import annotations

import click

from pginbox.cli.context import database, dsn_option
from pginbox.schema import sqitch

__all__ = ["deploy", "revert", "verify"]


@click.command()
@dsn_option
@click.option("--to-change", metavar="CHANGE", help="Deploy up to this change only.")
@click.pass_context
def deploy(ctx: click.Context, command_dsn: str | None, to_change: str | None) -> None:
    """Deploy the schema with Sqitch (idempotent)."""
    output = sqitch.deploy(database(ctx, command_dsn), to_change=to_change)
    click.echo(output.rstrip())


@click.command()
@dsn_option
@click.pass_context
def verify(ctx: click.Context, command_dsn: str | None) -> None:
    """Run the Sqitch verify scripts."""
    click.echo(sqitch.verify(database(ctx, command_dsn)).rstrip())


@click.command()
@dsn_option
@click.option("--to-change", metavar="CHANGE", help="Revert down to this change (kept).")
@click.pass_context
def revert(ctx: click.Context, command_dsn: str | None, to_change: str | None) -> None:
    """Revert the schema with Sqitch (no confirmation prompt)."""
    click.echo(sqitch.revert(database(ctx, command_dsn), to_change=to_change).rstrip())
