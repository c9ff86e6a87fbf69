"""The `pginbox` command line: one module per command group, the shared parts in context.py (state,
errors, --dsn, connecting, environment variables) and output.py (JSON, tables, values).

    pginbox [--dsn DSN] [--verbose]
      deploy | verify | revert | schema sql             schema.py      Sqitch, or a plain SQL script
      status                                            status.py      Sqitch changes, messages, quarantine
      doctor                                            doctor.py      what is wrong, in plain words (exit 0/1/2)
      quarantine list | show | repair | discard | release   quarantine.py
      outbox list | show | redrive | discard | provision  outbox.py
      dispatch | dispatch-health                        dispatch.py    the outbox dispatcher daemon
      replay create | add | run | status | accept-version | cancel   replay.py
      purge | retention show | set                      retention.py
      stats | metrics serve | rollup | configure        metrics.py
      demo                                              demo.py
      cluster start | stop | status | dsn               cluster.py     the private demo cluster

Every command needs a database: --dsn, or PGINBOX_DSN, or DATABASE_URL. Only `demo` (and
`cluster`) fall back to the private demo cluster (pginbox.devtools.cluster.default_cluster),
started on demand, database pginbox_demo.

Every option can also be set in the environment: PGINBOX_<COMMAND>_<OPTION>, e.g.
PGINBOX_DISPATCH_HEALTH_PORT=9187 or PGINBOX_QUARANTINE_LIST_CONSUMER=billing (`--help` shows each
name; see context.read_options_from_environment).

Errors are reported as one line without a traceback (use --verbose for the details). Passwords
in connection strings are never printed.
"""

from __future__ import annotations

import click

from pginbox.cli.cluster import cluster_group
from pginbox.cli.consume import consume
from pginbox.cli.context import DsnGroup, State, mask_dsn, read_options_from_environment
from pginbox.cli.demo import demo
from pginbox.cli.dispatch import dispatch, dispatch_health
from pginbox.cli.doctor import doctor
from pginbox.cli.metrics import metrics_group, stats
from pginbox.cli.outbox import outbox_group
from pginbox.cli.quarantine import quarantine_group
from pginbox.cli.replay import replay_group
from pginbox.cli.retention import purge_command, retention_group
from pginbox.cli.schema import deploy, revert, schema_group, verify
from pginbox.cli.status import status

__all__ = ["main", "mask_dsn"]


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from pginbox import __version__
    from pginbox.schema.compat import version_text

    click.echo(version_text(__version__))
    ctx.exit()


@click.group(cls=DsnGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--dsn",
    envvar=["PGINBOX_DSN", "DATABASE_URL"],
    metavar="DSN",
    default=None,
    help="libpq connection string or URL (required, except for `demo`, which uses the private demo cluster).",
)
@click.option("-v", "--verbose", is_flag=True, help="Show details and tracebacks on errors.")
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the package version and the schema release it deploys, and exit.",
)
@click.pass_context
def main(ctx: click.Context, dsn: str | None, verbose: bool) -> None:
    """pginbox: deploy and inspect the SQL inbox package (schema inbox)."""
    state = State(dsn=dsn or None, verbose=verbose)
    state.remember_secrets_of(dsn)
    ctx.obj = state


for _command in (
    deploy,
    verify,
    revert,
    schema_group,
    status,
    doctor,
    quarantine_group,
    outbox_group,
    dispatch,
    dispatch_health,
    consume,
    replay_group,
    purge_command,
    retention_group,
    stats,
    metrics_group,
    demo,
    cluster_group,
):
    main.add_command(_command)
read_options_from_environment(main)
