"""`pginbox stats` and `pginbox metrics serve | rollup | configure`.

pginbox stats [--count] [--json]                a readable summary of inbox.metrics()
pginbox metrics serve [--port 9188] [--host 127.0.0.1]
                                                Prometheus text format at /metrics
pginbox metrics rollup [--max-rows N]           fold new first deliveries and events now (cron)
pginbox metrics configure [--counting/--no-counting] [--grace 5min] [--batch N]
"""

from __future__ import annotations

import datetime
import signal
import threading
from collections import defaultdict
from typing import Any, Final

import click
from prometheus_client import CollectorRegistry

from pginbox.cli.context import connect, database, dsn_option
from pginbox.cli.output import echo_json, table
from pginbox.ops.metrics import (
    DatabaseCollector,
    MetricRow,
    RowEstimate,
    configure,
    count_messages,
    fetch_metrics,
    message_rows_estimate,
    rollup,
    serve,
)

__all__ = ["metrics_group", "stats"]

# Columns of the per-producer table: metric name -> column.
_BY_PRODUCER: Final = {
    "pginbox_first_seen_total": "first_seen",
    "pginbox_duplicates_total": "duplicates",
    "pginbox_identity_conflicts_total": "conflicts",
    "pginbox_handler_failures_total": "failures",
    "pginbox_quarantined_total": "quarantined",
    "pginbox_quarantine_recovered_total": "recovered",
    "pginbox_unprotected_deliveries_total": "unprotected",
    "pginbox_expired_deliveries_total": "expired",
}
# Per consumer and policy producer ('' = the consumer's default policy).
_RETENTION: Final = {
    "pginbox_retention_window_seconds": "retention_window_seconds",
    "pginbox_purge_lag_seconds": "purge_lag_seconds",
    "pginbox_purge_last_run_timestamp_seconds": "last_purge_at",
    "pginbox_purged_rows_total": "rows_purged",
}


def summarize(rows: list[MetricRow]) -> dict[str, Any]:
    """The rows of inbox.metrics() as one JSON-able summary (what `pginbox stats --json` prints)."""
    producers: dict[tuple[str, str], dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    quarantine_open: dict[tuple[str, str], dict[str, Any]] = {}
    outbox: dict[str, dict[str, Any]] = defaultdict(dict)
    storage: dict[str, int] = {}
    retention: dict[tuple[str, str], dict[str, Any]] = {}
    oldest: dict[tuple[str, str], float] = {}
    inbox: dict[str, Any] = {}
    for row in rows:
        lab = row.labels
        column = _BY_PRODUCER.get(row.metric)
        if column is not None:
            key = (lab.get("consumer", ""), lab.get("producer", ""))
            entry = producers.setdefault(
                key, {"consumer": key[0], "producer": key[1]} | dict.fromkeys(_BY_PRODUCER.values(), 0)
            )
            entry[column] += int(row.value)
        retention_column = _RETENTION.get(row.metric)
        if retention_column is not None:
            key = (lab.get("consumer", ""), lab.get("producer", ""))
            ret = retention.setdefault(
                key, {"consumer": key[0], "producer": key[1]} | dict.fromkeys(_RETENTION.values())
            )
            ret[retention_column] = (
                datetime.datetime.fromtimestamp(row.value, datetime.UTC).isoformat()
                if retention_column == "last_purge_at"
                else row.value
            )
        if row.metric == "pginbox_inbox_oldest_age_seconds":
            oldest[(lab.get("consumer", ""), lab.get("producer", ""))] = round(row.value, 3)
        if row.metric == "pginbox_handler_failures_total":
            failures.append(
                {
                    "consumer": lab.get("consumer"),
                    "producer": lab.get("producer"),
                    "reason_code": lab.get("reason_code"),
                    "failures": int(row.value),
                }
            )
        elif row.metric == "pginbox_quarantine_open":
            quarantine_open[(lab["consumer"], lab["kind"])] = {
                "consumer": lab["consumer"],
                "kind": lab["kind"],
                "open": int(row.value),
            }
        elif row.metric == "pginbox_outbox_pending":
            outbox[lab["destination"]]["pending"] = int(row.value)
        elif row.metric == "pginbox_outbox_pending_oldest_age_seconds":
            outbox[lab["destination"]]["oldest_pending_age_seconds"] = round(row.value, 3)
        elif row.metric == "pginbox_outbox_dead":
            outbox[lab["destination"]]["dead"] = int(row.value)
        elif row.metric == "pginbox_relation_size_bytes":
            storage[lab["relation"]] = int(row.value)
        elif not lab and row.metric.startswith(("pginbox_inbox_", "pginbox_metrics_", "pginbox_purge_")):
            inbox[row.metric.removeprefix("pginbox_")] = row.value
    for key, age in oldest.items():
        if key in producers:
            producers[key]["oldest_age_seconds"] = age
    return {
        "by_producer": sorted(producers.values(), key=lambda e: (e["consumer"], e["producer"])),
        "retention": [retention[k] for k in sorted(retention)],
        "failures_by_reason": sorted(failures, key=lambda e: (e["consumer"], e["producer"], e["reason_code"])),
        "quarantine_open": [quarantine_open[k] for k in sorted(quarantine_open)],
        "outbox": [
            {"destination": d} | {"pending": 0, "oldest_pending_age_seconds": None, "dead": 0} | outbox[d]
            for d in sorted(outbox)
        ],
        "storage_bytes": dict(sorted(storage.items())),
        "inbox": inbox,
    }


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return str(datetime.timedelta(seconds=round(seconds)))


def _honest_row_count(summary: dict[str, Any], estimate: RowEstimate, counted: int | None) -> None:
    """inbox.metrics() says 0 rows before inbox.message's first ANALYZE: the summary says there is
    no estimate yet (null), or when the estimate was made, or (--count) the counted rows."""
    inbox = summary["inbox"]
    inbox["inbox_rows_estimate"] = estimate.rows
    inbox["inbox_rows_estimate_at"] = None if estimate.as_of is None else estimate.as_of.isoformat()
    if counted is not None:
        inbox["inbox_rows"] = counted


def _rows_line(inbox: dict[str, Any]) -> list[str]:
    if "inbox_rows" in inbox:
        lines = [f"  inbox_rows: {inbox['inbox_rows']} (counted)"]
    else:
        lines = []
    if inbox["inbox_rows_estimate"] is None:
        lines.append(
            "  inbox_rows_estimate: no estimate (inbox.message not analyzed yet: run ANALYZE inbox.message, "
            "or pass --count)"
        )
    else:
        at = inbox["inbox_rows_estimate_at"]
        when = f"ANALYZE/VACUUM at {at[:19].replace('T', ' ')}" if at else "time of the estimate unknown"
        lines.append(f"  inbox_rows_estimate: {inbox['inbox_rows_estimate']} ({when})")
    return lines


@click.command(name="stats")
@dsn_option
@click.option(
    "--count",
    "count_rows",
    is_flag=True,
    help="Count the rows of inbox.message exactly (reads the whole table) besides the estimate.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def stats(ctx: click.Context, command_dsn: str | None, count_rows: bool, as_json: bool) -> None:
    """Summary of the inbox metrics: first-seen, duplicates, conflicts, failures, quarantine, outbox.
    The row count of inbox.message is PostgreSQL's estimate, with its time (none before the first
    ANALYZE); --count counts."""
    with connect(ctx, command_dsn) as conn:
        summary = summarize(fetch_metrics(conn))
        _honest_row_count(summary, message_rows_estimate(conn), count_messages(conn) if count_rows else None)
    if as_json:
        echo_json(summary)
        return
    columns = ["consumer", "producer", *_BY_PRODUCER.values()]
    click.echo("Messages by consumer and producer (first_seen trails by the rollup grace):")
    click.echo(
        table(
            [*columns, "oldest"],
            [[*(e[c] for c in columns), _age(e.get("oldest_age_seconds"))] for e in summary["by_producer"]],
        )
        if summary["by_producer"]
        else "  none yet"
    )
    if summary["failures_by_reason"]:
        click.echo("\nHandler failures by reason code:")
        click.echo(
            table(
                ["consumer", "producer", "reason_code", "failures"],
                [
                    [e["consumer"], e["producer"], e["reason_code"], e["failures"]]
                    for e in summary["failures_by_reason"]
                ],
            )
        )
    if summary["retention"]:
        click.echo("\nRetention (producer '' = the consumer's default policy):")
        click.echo(
            table(
                ["consumer", "producer", "window", "purge_lag", "last_purge_at", "rows_purged"],
                [
                    [
                        e["consumer"],
                        e["producer"],
                        _age(e["retention_window_seconds"]),
                        _age(e["purge_lag_seconds"]),
                        e["last_purge_at"],
                        None if e["rows_purged"] is None else int(e["rows_purged"]),
                    ]
                    for e in summary["retention"]
                ],
            )
        )
    click.echo("\nOpen quarantine:")
    click.echo(
        table(["consumer", "kind", "open"], [[e["consumer"], e["kind"], e["open"]] for e in summary["quarantine_open"]])
        if summary["quarantine_open"]
        else "  none"
    )
    click.echo("\nOutbox (committed, not delivered):")
    click.echo(
        table(
            ["destination", "pending", "oldest", "dead"],
            [
                [e["destination"], e["pending"], _age(e["oldest_pending_age_seconds"]), e["dead"]]
                for e in summary["outbox"]
            ],
        )
        if summary["outbox"]
        else "  nothing pending"
    )
    click.echo("\nInbox:")
    for name, value in summary["inbox"].items():
        if name.startswith("inbox_rows"):
            continue
        shown = _age(value) if name.endswith("_seconds") else f"{value:g}"
        click.echo(f"  {name}: {shown}")
    for line in _rows_line(summary["inbox"]):
        click.echo(line)
    for relation, size in summary["storage_bytes"].items():
        click.echo(f"  size of inbox.{relation}: {size / 1048576:.1f} MiB")


@click.group(name="metrics")
def metrics_group() -> None:
    """Prometheus metrics: serve them, roll them up, configure counting."""


@metrics_group.command(name="serve")
@dsn_option
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=9188,
    show_default=True,
    help="Port to listen on (0: any free port, printed).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.pass_context
def metrics_serve(ctx: click.Context, command_dsn: str | None, port: int, host: str) -> None:
    """Serve inbox.metrics() in Prometheus text format at http://HOST:PORT/metrics until stopped."""
    dsn = database(ctx, command_dsn)
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(dsn))
    server, _ = serve(registry, port=port, host=host)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    click.echo(f"serving http://{host}:{server.server_port}/metrics", err=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
        server.server_close()


@metrics_group.command(name="rollup")
@dsn_option
@click.option(
    "--max-rows",
    type=click.IntRange(1000, 100_000_000),
    default=None,
    help="Bound of this call (default: the configured rollup batch).",
)
@click.pass_context
def metrics_rollup(ctx: click.Context, command_dsn: str | None, max_rows: int | None) -> None:
    """Fold new first deliveries and counted events into the totals (inbox_operator; for cron)."""
    with connect(ctx, command_dsn) as conn:
        folded = rollup(conn, max_rows)
    click.echo(f"folded {folded} rows and events")


@metrics_group.command(name="configure")
@dsn_option
@click.option("--counting/--no-counting", default=None, help="Count duplicates and failures (default: keep).")
@click.option("--grace", default=None, help="Rollup grace, a PostgreSQL interval such as '5 minutes'.")
@click.option("--batch", type=int, default=None, help="Rows and events one rollup call folds at most.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def metrics_configure(
    ctx: click.Context,
    command_dsn: str | None,
    counting: bool | None,
    grace: str | None,
    batch: int | None,
    as_json: bool,
) -> None:
    """Set the metric settings (inbox_operator); options left out keep their value."""
    with connect(ctx, command_dsn) as conn:
        values = configure(conn, counting=counting, grace=grace, batch=batch)
    if as_json:
        echo_json({k: (v.isoformat() if isinstance(v, datetime.datetime) else v) for k, v in values.items()})
        return
    click.echo(
        f"counting {'on' if values['counting'] else 'off'}, rollup grace {values['rollup_grace']}, "
        f"rollup batch {values['rollup_batch']}"
    )
