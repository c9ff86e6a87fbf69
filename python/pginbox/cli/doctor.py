"""`pginbox doctor`: what is wrong with a deployment, in plain words, with the command to run.

Exit codes (cron, CI): 0 nothing found, 1 warnings only, 2 at least one problem; 1 is also
click's exit for an error (no database, schema missing), which prints `Error:` on stderr.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import click

from pginbox.cli.context import connect, dsn_option
from pginbox.cli.output import echo_json
from pginbox.ops import doctor as checks
from pginbox.ops.json_values import jsonable

__all__ = ["doctor"]

_LABEL = {checks.PROBLEM: "PROBLEM", checks.WARNING: "WARNING", checks.OK: "ok", checks.NOT_CHECKED: "SKIPPED"}


def _configured(config: Path | None) -> set[str] | None:
    """The destinations a dispatcher configuration names (--config, the environment, entry points)."""
    if config is None:
        return None
    from pginbox.transports.config import destination_names

    return destination_names(config)


@click.command()
@dsn_option
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="The dispatcher's destinations file: also check that every destination effects wait for is in it.",
)
@click.option(
    "--purge-max-age",
    type=click.FloatRange(60, None),
    default=86400.0,
    show_default=True,
    metavar="SECONDS",
    help="Warn when a policy's last purge is older than this.",
)
@click.option(
    "--standbys",
    type=click.IntRange(0, 64),
    default=0,
    show_default=True,
    help="How many standbys must have the primary's WAL (what `--durability standby` waits for); 0: not checked.",
)
@click.option(
    "--standby-lag",
    type=click.FloatRange(0.1, 3600),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="With --standbys: a standby that has not flushed the primary's WAL of now after this long is lagging.",
)
@click.option("--quiet", is_flag=True, help="Print only what is wrong.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def doctor(
    ctx: click.Context,
    command_dsn: str | None,
    config: Path | None,
    purge_max_age: float,
    standbys: int,
    standby_lag: float,
    quiet: bool,
    as_json: bool,
) -> None:
    """Check a deployment: consumers and destinations nobody is bound to, legacy bindings left by
    the upgrade, effects waiting for a transport or a queue, dead effects, retention windows that
    cannot hold their margin, purges that have not run, open quarantine, standbys lagging
    (--standbys). Exit status 0 when all is
    well, 1 with warnings only, 2 with problems (for cron and CI)."""
    configured = _configured(config)
    with connect(ctx, command_dsn) as conn:
        report = checks.diagnose(
            conn,
            configured=configured,
            purge_stale_after=datetime.timedelta(seconds=purge_max_age),
            standbys=standbys,
            standby_lag=datetime.timedelta(seconds=standby_lag),
        )
    if report.nothing_checked and report.denied is not None:
        raise report.denied  # the CLI's error handler names the group role that may read all this
    if as_json:
        echo_json(
            {
                "problems": report.problems,
                "warnings": report.warnings,
                "exit_code": report.exit_code,
                "findings": [
                    {
                        "check": f.check,
                        "severity": f.severity,
                        "message": f.message,
                        "fix": f.fix,
                        "details": [jsonable(d) for d in f.details],
                    }
                    for f in report.findings
                ],
            }
        )
    else:
        if report.problems or report.warnings:
            click.echo(f"pginbox doctor: {report.problems} problem(s), {report.warnings} warning(s)")
        else:
            click.echo("pginbox doctor: all checks passed")
        for finding in report.findings:
            if quiet and finding.severity == checks.OK:
                continue
            click.echo(f"{_LABEL[finding.severity]:<8} {finding.check}: {finding.message}")
            if finding.fix and finding.severity != checks.OK:
                click.echo(f"         fix: {finding.fix}")
    ctx.exit(report.exit_code)
