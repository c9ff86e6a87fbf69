"""`pginbox purge` and `pginbox retention show | set`.

Exit codes of `pginbox purge` (for cron): 0 purged, nothing to purge, or another purger is
running (busy); 1 an error (one line on stderr); 2 bad usage; 3 a named consumer has no retention
policy; 75 (EX_TEMPFAIL) transactions from before the announcement outlived --wait-timeout
(nothing more was deleted: run it again later).

Progress (rows deleted, rate, time left against an estimate counted before the purge starts) is
drawn in place on stderr when stderr is a terminal, never under cron; --progress forces it (one
line per batch when stderr is not a terminal), --no-progress and --quiet turn it off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import click
import psycopg

from pginbox.cli.context import SHARD_DSN, State, connect, dsn_option, mask_dsn
from pginbox.cli.output import echo_json, pg_interval, table
from pginbox.cli.progress import Progress, Render, duration, progress_for_stderr
from pginbox.ops import retention

EXIT_NO_POLICY = 3
EXIT_TIMEOUT = 75


def _text(value: object) -> object:
    if value is None:
        return None
    if isinstance(value, timedelta):
        return pg_interval(value)  # as PostgreSQL prints it: '11 days', not '11 days, 0:00:00'
    return str(value)


def progress_line(p: retention.PurgeProgress) -> str:
    """`billing: 12,000 of ~40,000 rows (30%), batch 120, 5,230 rows/s, about 5s left, 2s elapsed`."""
    if p.estimate is not None and p.estimate > 0:
        done = f"{p.rows_deleted:,} of ~{p.estimate:,} rows ({min(100 * p.rows_deleted // p.estimate, 100)}%)"
    else:
        done = f"{p.rows_deleted:,} rows"
    if p.batches:
        stage = f"batch {p.batches}"
    else:
        stage = "starting" if p.seconds < 1 else "waiting for transactions from before the announcement"
    parts = [f"{p.consumer}: {done}", stage]
    if p.rate is not None:
        parts.append(f"{p.rate:,.0f} rows/s")
    if p.seconds_left is not None:
        parts.append(f"about {duration(p.seconds_left)} left")
    parts.append(f"{duration(p.seconds)} elapsed")
    return ", ".join(parts)


def _render(p: retention.PurgeProgress) -> Render:
    """The line of `p`, its clock moved on to the time it is drawn (the ticker redraws it)."""
    return lambda elapsed: progress_line(dataclasses.replace(p, seconds=elapsed))


@click.command(name="purge")
@dsn_option
@click.option(
    "--consumer", metavar="NAME", default=None, help="Only this consumer [default: every consumer with a policy]."
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100000),
    default=5000,
    show_default=True,
    help="Rows deleted per transaction.",
)
@click.option(
    "--max-batches",
    type=click.IntRange(1, 10_000_000),
    default=1000,
    show_default=True,
    help="Stop after this many batches per consumer (the next run goes on).",
)
@click.option(
    "--wait-timeout",
    type=click.FloatRange(0, 86400),
    default=300.0,
    show_default=True,
    help="Longest wait for transactions from before the announcement, seconds.",
)
@click.option(
    "--pause",
    type=click.FloatRange(0, 60),
    default=0.0,
    show_default=True,
    help="Sleep this long after each batch (leaves CPU to the claims on a busy machine), seconds.",
)
@click.option(
    "--progress/--no-progress",
    "show_progress",
    default=None,
    help="Show rows deleted, rate and time left on stderr [default: when stderr is a terminal].",
)
@click.option("--quiet", is_flag=True, help="No progress and no summary unless something went wrong (cron).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option(
    "--shard-dsn",
    "shard_dsns",
    multiple=True,
    type=SHARD_DSN,
    metavar="DSN",
    help="Purge these shard databases instead of --dsn, one after the other over one connection at "
    "a time (repeatable; docs/scaling.md). A shard that fails is reported; the others go on.",
)
@click.pass_context
def purge_command(
    ctx: click.Context,
    command_dsn: str | None,
    consumer: str | None,
    batch_size: int,
    max_batches: int,
    wait_timeout: float,
    pause: float,
    show_progress: bool | None,
    quiet: bool,
    as_json: bool,
    shard_dsns: tuple[str, ...],
) -> None:
    """Delete processed inbox rows older than each consumer's retention window (for cron). On a
    terminal it shows its progress; under cron it prints one summary line per consumer."""
    options = {"batch_size": batch_size, "max_batches": max_batches, "wait_timeout": wait_timeout, "pause": pause}
    if shard_dsns:
        _purge_shards(ctx, shard_dsns, consumer, options, show_progress=show_progress, quiet=quiet, as_json=as_json)
        return
    progress = progress_for_stderr(show_progress, quiet)
    try:
        with connect(ctx, command_dsn) as conn:
            reports = _purge_all(conn, consumer, progress, **options)
    finally:
        if progress is not None:
            progress.close()
    if as_json:
        echo_json({"consumers": [r.as_dict() for r in reports]})
    else:
        _echo_reports(reports, wait_timeout, quiet=quiet)
    if status := _exit_status(reports, consumer):
        ctx.exit(status)


def _echo_reports(reports: list[retention.PurgeReport], wait_timeout: float, *, quiet: bool, prefix: str = "") -> None:
    """One line per consumer (with quiet: only the timeouts), each after `prefix`."""
    if not reports and not quiet:
        click.echo(f"{prefix}no consumer has a retention policy: nothing is ever purged (pginbox retention set ...)")
    for report in reports:
        if quiet and report.status != "timeout":
            continue
        click.echo(f"{prefix}{report.consumer}: {_report_line(report, wait_timeout)}", err=report.status == "timeout")


def _exit_status(reports: list[retention.PurgeReport], consumer: str | None) -> int:
    """EXIT_TIMEOUT, else EXIT_NO_POLICY for a named consumer without a policy, else 0."""
    if any(r.status == "timeout" for r in reports):
        return EXIT_TIMEOUT
    if consumer is not None and any(r.status == "no_policy" for r in reports):
        return EXIT_NO_POLICY
    return 0


def _report_line(report: retention.PurgeReport, wait_timeout: float) -> str:
    return {
        "purged": f"purged {report.rows_deleted} rows in {report.batches} batches ({report.seconds}s); "
        f"watermark {report.watermark}",
        "done": f"nothing to purge; watermark {report.watermark}",
        "busy": "another purger is running for this consumer: nothing done",
        "no_policy": "no retention policy: its rows are never purged (pginbox retention set ...)",
        "inactive": "not active for a whole retention window yet (or down now): nothing is old enough",
        "timeout": f"gave up after {wait_timeout}s waiting for transactions from before the announcement; "
        f"deleted {report.rows_deleted} rows; run it again later",
    }[report.status]


def _purge_shards(
    ctx: click.Context,
    shard_dsns: tuple[str, ...],
    consumer: str | None,
    options: dict[str, Any],
    *,
    show_progress: bool | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """`purge --shard-dsn ...`: each shard in turn, one connection open at a time; lines and JSON
    name the shard (its connection string, password masked). A shard that cannot be purged (down,
    not deployed) is reported and the next one goes on; the exit status says the worst: 1 a shard
    failed, 75 a timeout, 3 a named consumer without a policy on some shard."""
    state = ctx.find_object(State)
    results: list[dict[str, Any]] = []
    every_report: list[retention.PurgeReport] = []
    failed = False
    for dsn in shard_dsns:
        shard = mask_dsn(dsn)
        progress = progress_for_stderr(show_progress, quiet)
        try:
            with connect(ctx, dsn) as conn:
                reports = _purge_all(conn, consumer, progress, **options)
        except (psycopg.Error, click.ClickException) as exc:
            failed = True
            problem = " ".join(str(exc).split())
            problem = state.redact(problem) if state is not None else problem
            results.append({"shard": shard, "error": problem})
            if not as_json:
                click.echo(f"{shard}: not purged: {problem}", err=True)
            continue
        finally:
            if progress is not None:
                progress.close()
        results.append({"shard": shard, "consumers": [r.as_dict() for r in reports]})
        every_report += reports
        if not as_json:
            _echo_reports(reports, float(options["wait_timeout"]), quiet=quiet, prefix=f"{shard}: ")
    if as_json:
        echo_json({"shards": results})
    if failed:
        ctx.exit(1)
    if status := _exit_status(every_report, consumer):
        ctx.exit(status)


def _purge_all(
    conn: Any, consumer: str | None, progress: Progress | None, **options: Any
) -> list[retention.PurgeReport]:
    """retention.purge, one consumer after the other, with the progress drawn (and the rows to go
    counted first) when it is shown."""
    if progress is None:
        return retention.purge(conn, consumer, **options)
    names = [consumer] if consumer is not None else [r[0] for r in conn.execute(retention.POLICY_CONSUMERS)]
    reports = []
    for name in names:
        estimate = retention.estimate_rows_to_go(conn, name)
        progress.begin(_render(retention.PurgeProgress(name, 0, 0, 0.0, estimate)))
        reports.append(
            retention.purge_consumer(
                conn, name, progress=lambda p: progress.show(_render(p)), estimate=estimate, **options
            )
        )
        progress.clear()
    return reports


@click.group(name="retention")
def retention_group() -> None:
    """Retention policies (named failure scenarios) and where the purge stands."""


@retention_group.command(name="show")
@dsn_option
@click.option("--consumer", metavar="NAME", default=None, help="Only this consumer.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def retention_show(ctx: click.Context, command_dsn: str | None, consumer: str | None, as_json: bool) -> None:
    """Window, dominating scenario, watermark and purge lag per consumer and producer."""
    with connect(ctx, command_dsn) as conn:
        rows = retention.retention_status(conn, consumer)
    if as_json:
        echo_json(
            {"policies": [{k: _text(v) if not isinstance(v, int) else v for k, v in row.items()} for row in rows]}
        )
        return
    if not rows:
        click.echo(
            "no retention policy"
            + (f" for consumer {consumer}" if consumer else "")
            + ": nothing is ever purged (pginbox retention set ...)"
        )
        return
    headers = [
        "consumer",
        "producer",
        "window",
        "dominated by",
        "watermark",
        "purge lag",
        "purged",
        "expired",
        "last purge",
    ]
    table_rows: list[list[Any]] = [
        [
            r["consumer"],
            r["producer"] or "*",
            _text(r["retention_window"]),
            r["dominating_scenario"],
            _text(r["watermark"]),
            _text(r["purge_lag"]),
            int(r["rows_purged"]),
            int(r["expired_total"]),
            _text(r["last_purge_at"]),
        ]
        for r in rows
    ]
    click.echo(table(headers, table_rows))


F = TypeVar("F", bound=Callable[..., Any])


def _scenario_option(name: str) -> Callable[[F], F]:
    flag = "--" + name.replace("_", "-")
    return click.option(
        flag,
        name,
        required=True,
        metavar="INTERVAL",
        help=f"{name.replace('_', ' ')} (a PostgreSQL interval, '0' = does not apply).",
    )


@retention_group.command(name="set")
@click.argument("consumer")
@dsn_option
@click.option("--producer", default="", show_default=True, help="Producer ('' = every producer of the consumer).")
@_scenario_option("broker_retention")
@_scenario_option("max_offset_rewind")
@_scenario_option("dead_letter_redrive_horizon")
@_scenario_option("producer_retry_horizon")
@_scenario_option("outage_allowance")
@_scenario_option("backup_restore_window")
@_scenario_option("planned_replay_horizon")
@_scenario_option("safety_margin")
@click.option("--note", required=True, help="Why (goes into the audit trail).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def retention_set(
    ctx: click.Context,
    /,
    consumer: str,
    command_dsn: str | None,
    producer: str,
    note: str,
    as_json: bool,
    **scenarios: str,
) -> None:
    """Set a consumer's retention policy: every scenario explicitly (audited)."""
    with connect(ctx, command_dsn) as conn:
        window, dominating = retention.set_policy(conn, consumer, producer, scenarios, note)
    if as_json:
        echo_json(
            {
                "consumer": consumer,
                "producer": producer,
                "retention_window": pg_interval(window),
                "dominating_scenario": dominating,
            }
        )
        return
    click.echo(
        f"{consumer}{'/' + producer if producer else ''}: retention window {pg_interval(window)} "
        f"(dominated by {dominating})"
    )
