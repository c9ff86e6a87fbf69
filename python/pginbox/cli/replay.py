"""`pginbox replay create | add | run | status | accept-version | cancel`: replay plans (compensated
migration), see docs/replay.md.

    pginbox replay create NAME --consumer C --message-type T --handler 'f(jsonb)' --handler-version V --note N
    pginbox replay create NAME --consumer C --message-type T --python MODULE:FUNCTION --handler-version V --note N
    pginbox replay add PLAN [FILE|-]              items as JSON lines {producer, message_id, tenant?, payload}
    pginbox replay run PLAN [--max-items N] [--until-done] [--progress/--no-progress] [--quiet]
    pginbox replay run PLAN --python MODULE:FUNCTION --dsn <the consumer's DSN> [--max-items N]
    pginbox replay status [PLAN] [--json]
    pginbox replay accept-version PLAN --handler 'f(jsonb)' --handler-version V --note N
    pginbox replay cancel PLAN --note N

PLAN is a plan name or id. A run that finds the plan stopped (the registered handler changed)
exits with status 3 and one line saying so. `replay run` shows its progress per call on a terminal
(items done, rate, time left; never under cron) and ends with this run's failed and skipped items
counted by reason, each skip reason explained.

A plan created with --python is approved for that Python handler, handler(cursor, message): the
consumer's own login (--dsn) runs it with `replay run PLAN --python MODULE:FUNCTION`, one item per
transaction (sql/122_python_replay.sql); --consume-config takes the handler (and version) from the
[consume] table `pginbox consume` runs with.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, TextIO, cast

import click

from pginbox.cli.context import connect, database, dsn_option
from pginbox.cli.output import echo_json, fmt, table
from pginbox.cli.progress import Render, duration, progress_for_stderr
from pginbox.cli.python_handler import configured_handler, consume_config_option, load_python_handler
from pginbox.consumer.core import is_async_handler
from pginbox.ops import python_replay, replay
from pginbox.ops.json_values import jsonable
from pginbox.ops.status import check_schema

__all__ = ["replay_group"]

EXIT_STOPPED = 3


@click.group(name="replay")
def replay_group() -> None:
    """Replay plans: re-run processed messages through a pinned handler version, each once."""


@replay_group.command(name="create")
@click.argument("name")
@click.option("--consumer", required=True, help="The consumer whose processed messages are replayed.")
@click.option("--message-type", required=True, help="The message type (selects the registered handler).")
@click.option("--handler", metavar="REGPROCEDURE", default=None, help="Registered handler, e.g. 'app.credit(jsonb)'.")
@click.option(
    "--python",
    "python_handler",
    metavar="MODULE:FUNCTION",
    default=None,
    help="Approve the plan for this Python handler, handler(cursor, message), instead of a registered SQL "
    "handler: the consumer's own login runs it (replay run PLAN --python ...).",
)
@consume_config_option()
@click.option("--handler-version", default=None, help="The handler version the plan is pinned to.")
@click.option("--note", required=True, help="Why: goes into the audit trail (inbox.replay_decision).")
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def replay_create(
    ctx: click.Context,
    name: str,
    consumer: str,
    message_type: str,
    handler: str | None,
    python_handler: str | None,
    consume_config: Path | None,
    handler_version: str | None,
    note: str,
    command_dsn: str | None,
    as_json: bool,
) -> None:
    """Create a plan pinned to the handler and version registered for CONSUMER and MESSAGE_TYPE, or
    (--python) approved for a Python handler and version."""
    python_handler, handler_version = configured_handler(consume_config, python_handler, handler_version)
    if (handler is None) == (python_handler is None):
        raise click.UsageError("name the handler: --handler REGPROCEDURE (SQL) or --python MODULE:FUNCTION")
    if handler_version is None:
        raise click.UsageError("Missing option '--handler-version'.")
    with connect(ctx, command_dsn) as conn:
        if python_handler is not None:
            plan_id = python_replay.create_plan(
                conn, name, consumer, message_type, python_handler, handler_version, note
            )
        else:
            assert handler is not None
            plan_id = replay.create_plan(conn, name, consumer, message_type, handler, handler_version, note)
    if as_json:
        echo_json({"plan_id": plan_id, "plan_name": name, "status": "open"})
        return
    if python_handler is not None:
        click.echo(
            f"replay plan {plan_id} ({name}) created, approved for the Python handler {python_handler} version "
            f"{handler_version}. The consumer's own login runs it: pginbox replay run {plan_id} --python "
            f"{python_handler} --dsn <the consumer's DSN>"
        )
        return
    click.echo(f"replay plan {plan_id} ({name}) created, pinned to {handler} version {handler_version}")


@replay_group.command(name="add")
@click.argument("plan")
@click.argument("items_file", type=click.File("r", encoding="utf-8"), default="-", metavar="[FILE|-]")
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def replay_add(ctx: click.Context, plan: str, items_file: TextIO, command_dsn: str | None, as_json: bool) -> None:
    """Add items from JSON lines (FILE, or stdin): {"producer", "message_id", "tenant"?, "payload"}.

    Each payload must be the one the consumer processed (checked against the stored hash)."""
    with connect(ctx, command_dsn) as conn:
        plan_id = replay.resolve_plan(conn, plan)
        added = replay.add_items(conn, plan_id, replay.read_items(items_file))
    if as_json:
        echo_json({"plan_id": plan_id, "added": added})
        return
    click.echo(f"replay plan {plan_id}: {added} item(s) added")


def run_progress_line(result: replay.RunResult, elapsed: float) -> str:
    """`replay plan 7: 300 of 1,000 items (30%), call 3, 120 items/s, about 6s left, 2s elapsed`."""
    done = result.done_now
    total = result.pending_at_start
    shown = f"{done:,} of {total:,} items ({min(100 * done // total, 100)}%)" if total else f"{done:,} items"
    parts = [f"replay plan {result.plan_id}: {shown}", f"call {result.calls}"]
    if result.failed_now or result.skipped_now:
        parts.append(f"{result.failed_now} failed, {result.skipped_now} skipped")
    if done and elapsed > 0:
        rate = done / elapsed
        parts.append(f"{rate:,.0f} items/s")
        if total:
            parts.append(f"about {duration(max(total - done, 0) / rate)} left")
    parts.append(f"{duration(elapsed)} elapsed")
    return ", ".join(parts)


def _render(result: replay.RunResult) -> Render:
    return lambda elapsed: run_progress_line(result, elapsed)


def reason_lines(result: replay.RunResult, plan: str) -> list[str]:
    """This run's failed and skipped items by reason, each skip reason explained."""
    lines = [
        f"  failed {code}: {n} ({replay.FAILED_REASON}; `pginbox replay status {plan}` lists them)"
        for code, n in result.failed_by_reason.items()
    ]
    lines += [f"  skipped {code}: {n} ({replay.explain_skip(code)})" for code, n in result.skipped_by_reason.items()]
    return lines


@replay_group.command(name="run")
@click.argument("plan")
@click.option(
    "--max-items",
    type=click.IntRange(1, 10000),
    default=100,
    show_default=True,
    help="Items per call (one transaction each).",
)
@click.option("--until-done", is_flag=True, help="Call again until no item is pending.")
@click.option(
    "--progress/--no-progress",
    "show_progress",
    default=None,
    help="Show items done, rate and time left on stderr after each call [default: when stderr is a terminal].",
)
@click.option("--quiet", is_flag=True, help="No progress and no summary; errors still go to stderr (cron).")
@click.option(
    "--python",
    "python_handler",
    metavar="MODULE:FUNCTION",
    default=None,
    help="Run a plan approved for this Python handler, handler(cursor, message), with the consumer's own "
    "login (--dsn), one item per transaction, until no item is pending (or --max-items items).",
)
@consume_config_option("The TOML file `pginbox consume` runs with: its [consume] handler is the default of --python.")
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def replay_run(
    ctx: click.Context,
    plan: str,
    max_items: int,
    until_done: bool,
    show_progress: bool | None,
    quiet: bool,
    python_handler: str | None,
    consume_config: Path | None,
    command_dsn: str | None,
    as_json: bool,
) -> None:
    """Run pending items, each exactly once, with your rights. Exit status 3 when the plan is stopped.
    Ends with this run's applied, failed and skipped items, the failed and skipped ones by reason.

    With --python MODULE:FUNCTION (a plan approved for that handler) the consumer's own login (--dsn)
    runs the handler, one item per transaction; a failed item is recorded and the plan goes on."""
    python_handler = configured_handler(consume_config, python_handler, None)[0]
    if python_handler is not None:
        source = ctx.get_parameter_source("max_items")
        limit = max_items if source is not None and source.name != "DEFAULT" and not until_done else None
        _run_python(ctx, plan, python_handler, limit, quiet=quiet, as_json=as_json, command_dsn=command_dsn)
        return
    progress = progress_for_stderr(show_progress, quiet)
    with connect(ctx, command_dsn) as conn:
        plan_id = replay.resolve_plan(conn, plan)
        if _already_completed(conn, plan_id, quiet=quiet, as_json=as_json):
            return  # idempotent: a cron job that runs a finished plan again succeeds
        try:
            if progress is not None:
                progress.begin(_render(replay.RunResult(plan_id, "open", 0, 0, 0, 0, 0, 0, 0, 0)))
            result = replay.run_plan(
                conn,
                plan_id,
                max_items=max_items,
                until_done=until_done,
                progress=None if progress is None else lambda r: progress.show(_render(r)),
            )
        except replay.ReplayStopped as exc:
            if progress is not None:
                progress.close()
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(EXIT_STOPPED)
        except replay.ReplayError as exc:
            # Completed by another run between the check above and this one: still nothing to do.
            if exc.sqlstate == "55000" and _already_completed(conn, plan_id, quiet=quiet, as_json=as_json):
                return
            raise
        finally:
            if progress is not None:
                progress.close()
    _echo_run(result, plan, quiet=quiet, as_json=as_json)


def _echo_run(result: replay.RunResult, plan: str, *, quiet: bool, as_json: bool) -> None:
    """What a (SQL handler) run did: JSON, nothing (quiet), or a line and the reasons."""
    if as_json:
        echo_json(result.as_json())
        return
    if quiet:
        return
    click.echo(
        f"replay plan {result.plan_id}: {result.status}; this run applied {result.applied_now}, "
        f"failed {result.failed_now}, skipped {result.skipped_now} ({result.calls} call(s)); totals: "
        f"pending {result.pending}, applied {result.applied}, failed {result.failed}, skipped {result.skipped}"
    )
    for line in reason_lines(result, plan):
        click.echo(line)


def _python_plan_id(conn: Any, plan: str) -> int:
    """A plan id as given, or the id of a plan name (the consumer's login may not read plan names)."""
    if plan.isascii() and plan.isdigit() and len(plan) <= 18:
        return int(plan)
    try:
        return replay.resolve_plan(conn, plan)
    except replay.ReplayError as exc:
        if exc.sqlstate == "42501":
            raise click.UsageError(
                f"name the plan by its id with --python: this login may not read plan names ({plan!r})"
            ) from None
        raise


def _run_python(
    ctx: click.Context,
    plan: str,
    spec: str,
    max_items: int | None,
    *,
    quiet: bool,
    as_json: bool,
    command_dsn: str | None,
) -> None:
    handler = load_python_handler(spec)
    is_async = is_async_handler(handler)
    run: python_replay.PythonRun | None = None
    with connect(ctx, command_dsn) as conn:
        check_schema(conn)
        plan_id = _python_plan_id(conn, plan)
        if not is_async:
            run = python_replay.run_plan(conn, plan_id, spec, cast(python_replay.Handler, handler), max_items=max_items)
    if run is None:
        # An `async def` handler gets an AsyncCursor on an asyncio connection, as `pginbox consume` runs it.
        run = asyncio.run(
            python_replay.run_plan_async(
                database(ctx, command_dsn),
                plan_id,
                spec,
                cast(python_replay.AsyncHandler, handler),
                max_items=max_items,
            )
        )
    if as_json:
        echo_json(run.as_json())
    elif not quiet:
        click.echo(
            f"replay plan {plan_id}: {run.status}; this run applied {run.applied_now}, failed {run.failed_now}, "
            f"skipped {run.skipped_now} with the Python handler {spec}"
        )
        for item_no, code, text in run.failures:
            click.echo(f"  item {item_no} failed ({code}): {text}")


def _already_completed(conn: Any, plan_id: int, *, quiet: bool, as_json: bool) -> bool:
    """True (and says so) when the plan is completed: running it again is not an error."""
    statuses = replay.plan_status(conn, plan_id)
    if not statuses or statuses[0].row["status"] != "completed":
        return False
    row = statuses[0].row
    if as_json:
        echo_json(
            {
                "plan_id": plan_id,
                "status": "completed",
                "already_completed": True,
                "applied_now": 0,
                "failed_now": 0,
                "skipped_now": 0,
                "pending": row["pending"],
                "applied": row["applied"],
                "failed": row["failed"],
                "skipped": row["skipped"],
                "finished_at": jsonable(row)["finished_at"],
            }
        )
    elif not quiet:
        click.echo(
            f"replay plan {plan_id}: already completed at {fmt(row['finished_at'])}; nothing to run; "
            f"totals: applied {row['applied']}, failed {row['failed']}, skipped {row['skipped']}"
        )
    return True


@replay_group.command(name="status")
@click.argument("plan", required=False)
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def replay_status(ctx: click.Context, plan: str | None, command_dsn: str | None, as_json: bool) -> None:
    """Progress of all plans, or of PLAN with its audit trail and failed/skipped items."""
    with connect(ctx, command_dsn) as conn:
        plan_id = replay.resolve_plan(conn, plan) if plan is not None else None
        statuses = replay.plan_status(conn, plan_id)
    if as_json:
        plans = []
        for s in statuses:
            entry = jsonable(s.row)
            if plan_id is not None:
                entry["decisions"] = [jsonable(d) for d in s.decisions]
                entry["failed_or_skipped"] = [jsonable(p) for p in s.problems]
            plans.append(entry)
        echo_json({"plans": plans})
        return
    if not statuses:
        click.echo("no replay plans")
        return
    if plan_id is None:
        rows = [
            [
                s.row["plan_id"],
                s.row["plan_name"],
                s.row["status"],
                s.row["consumer"],
                s.row["message_type"],
                s.row["handler_version"],
                s.row["pending"],
                s.row["applied"],
                s.row["failed"],
                s.row["skipped"],
                "yes" if s.row["pin_matches"] else "NO",
            ]
            for s in statuses
        ]
        click.echo(
            table(
                [
                    "plan",
                    "name",
                    "status",
                    "consumer",
                    "type",
                    "version",
                    "pending",
                    "applied",
                    "failed",
                    "skipped",
                    "pin ok",
                ],
                rows,
            )
        )
        return
    s = statuses[0]
    for key, value in s.row.items():
        click.echo(f"{key}: {fmt(value)}")
    click.echo("audit trail (inbox.replay_decision):")
    for d in s.decisions:
        pin = f" {d['handler']} {d['handler_version']}" if d["handler"] else ""
        click.echo(
            f"  {d['decided_at']:%Y-%m-%d %H:%M:%S} {d['decision']} by {d['decided_by']}{pin}"
            f"{' items=' + str(d['items']) if d['items'] is not None else ''}: {fmt(d['note'])}"
        )
    for p in s.problems:
        click.echo(
            f"  item {p['item_no']} {p['status']} ({p['reason_code']}): {p['producer']}/{p['message_id']} "
            f"tenant {p['tenant']!r} {fmt(p['error_message'])}"
        )


@replay_group.command(name="accept-version")
@click.argument("plan")
@click.option("--handler", required=True, metavar="REGPROCEDURE", help="The handler now registered.")
@click.option("--handler-version", required=True, help="The version now registered.")
@click.option("--note", required=True, help="Why: goes into the audit trail.")
@dsn_option
@click.pass_context
def replay_accept_version(
    ctx: click.Context, plan: str, handler: str, handler_version: str, note: str, command_dsn: str | None
) -> None:
    """Re-pin a stopped plan to the handler and version now registered; it runs again."""
    with connect(ctx, command_dsn) as conn:
        plan_id = replay.resolve_plan(conn, plan)
        status = replay.accept_version(conn, plan_id, handler, handler_version, note)
    click.echo(f"replay plan {plan_id}: {status}, pinned to {handler} version {handler_version}")


@replay_group.command(name="cancel")
@click.argument("plan")
@click.option("--note", required=True, help="Why: goes into the audit trail.")
@dsn_option
@click.pass_context
def replay_cancel(ctx: click.Context, plan: str, note: str, command_dsn: str | None) -> None:
    """Cancel a plan: pending items are skipped, its retention holds go; applied items stay applied."""
    with connect(ctx, command_dsn) as conn:
        plan_id = replay.resolve_plan(conn, plan)
        status = replay.cancel_plan(conn, plan_id, note)
    click.echo(f"replay plan {plan_id}: {status}")
