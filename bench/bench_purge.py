"""Purge speed, and what the purge costs live claims, against baselines measured in the same run
(issue: retention). Target: the purge deletes >= 50k rows/s while concurrent claim_and_apply
throughput stays >= 0.9x of the same run without purge.

Each round, on a private cluster (fsync on):
  base     pgbench claim_and_apply (as bench/bench_claim.py 'apply') for --seconds, no purge
  purge    the same pgbench run while `pginbox.ops.retention.purge_consumer` deletes processed rows that
           are 30 days old (--rows are loaded before each round) with a commit per batch; the purge
           is stopped when pgbench ends, so both overlap for the whole run
The purge index is measured both ways, in turn: a btree on (consumer, processed_at) (what
sql/070_retention.sql ships) and a BRIN on processed_at: claim throughput without purge, purge
rows/s, and claims under purge. Medians over --rounds interleaved rounds.

--heartbeat-ab instead measures the claims' retention heartbeat: bench/bench_claim.py's 'apply' and
'claim' workloads on two clusters, one deployed from sql/ and one from a copy of sql/ without the
heartbeat lines, interleaved rounds, 8 clients (ratios with / without).

Usage:  .venv/bin/python bench/bench_purge.py [--seconds 10] [--rounds 2] [--rows 1000000] [--clients 4] [--pause 0.05]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import threading
from pathlib import Path

import psycopg
from bench_claim import ACCOUNTS, SCRIPTS, SETUP, run_pgbench
from benchlib import ROOT, bench_database

from pginbox.devtools.cluster import Cluster, find_bindir
from pginbox.ops import retention

POLICY = """
SELECT inbox.set_retention_policy('bench', '', broker_retention => '7 days', max_offset_rewind => '3 days',
    dead_letter_redrive_horizon => '14 days', producer_retry_horizon => '1 day', outage_allowance => '2 days',
    backup_restore_window => '1 day', planned_replay_horizon => '0', safety_margin => '1 hour', note => 'bench');
"""

LOAD = [
    """
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, produced_at,
                           received_at, processed_at)
SELECT 'bench', '', 'old', %(round)s || '-' || g, '\\x00', 'v1', now() - interval '30 days',
       now() - interval '30 days', now() - interval '30 days' + g * interval '1 ms'
  FROM generate_series(1, %(rows)s) g
""",
    "DELETE FROM inbox.activity_gap WHERE consumer = 'bench'",
    "INSERT INTO inbox.activity_gap VALUES ('bench', '-infinity', now() - interval '60 days')",
    "UPDATE inbox.consumer_config SET last_active_at = now() WHERE consumer = 'bench'",
]

APPLY = """
\\set aid random(1, {accounts})
\\set mid random(1, 1152921504606846976)
SELECT outcome FROM inbox.claim_and_apply('bench', 'shop', :client_id::text || '-' || :mid::text, 'credit',
                                          jsonb_build_object('account', :aid::integer, 'amount', 1));
"""

INDEXES = {
    "btree": "CREATE INDEX message_purge_idx ON inbox.message (consumer, processed_at)",
    "brin": "CREATE INDEX message_purge_idx ON inbox.message USING brin (processed_at)",
}


def start_pgbench(cluster: Cluster, clients: int, seconds: int) -> tuple[subprocess.Popen[str], str]:
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(APPLY.format(accounts=ACCOUNTS))
        path = f.name
    Path(path).chmod(0o644)
    cmd = [
        str(find_bindir() / "pgbench"),
        "-n",
        "-M",
        "prepared",
        "-c",
        str(clients),
        "-j",
        str(clients),
        "-T",
        str(seconds),
        "-P",
        "1",
        "--max-tries=20",
        "-f",
        path,
        "-h",
        "127.0.0.1",
        "-p",
        str(cluster.port),
        "-U",
        "postgres",
        "bench",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), path


def finish_pgbench(proc: subprocess.Popen[str], path: str) -> tuple[float, list[float]]:
    """(tps of the whole run, tps of each second from pgbench -P 1)."""
    out, err = proc.communicate()
    Path(path).unlink()
    if proc.returncode != 0:
        raise SystemExit(f"pgbench failed:\n{out}\n{err}")
    per_second = [float(line.split()[3]) for line in err.splitlines() if line.startswith("progress: ")]
    for line in out.splitlines():
        if line.startswith("tps = ") and "without initial connection time" in line:
            return float(line.split()[2]), per_second
    raise SystemExit(f"no tps in pgbench output:\n{out}")


def run_round(
    cluster: Cluster, dsn: str, args: argparse.Namespace, tag: str, rnd: int, with_purge: bool
) -> dict[str, float]:
    """Figures of one pgbench run (with the purge running alongside when with_purge)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM inbox.purge_state")
        conn.execute("UPDATE inbox.consumer_config SET purge_watermark = NULL")
        conn.execute(LOAD[0], {"round": f"{tag}{rnd}{'p' if with_purge else 'b'}", "rows": args.rows})
        for statement in LOAD[1:]:
            conn.execute(statement)
        conn.execute("VACUUM ANALYZE inbox.message")
    proc, path = start_pgbench(cluster, args.clients, args.seconds)
    stop = threading.Event()
    report: retention.PurgeReport | None = None
    if with_purge:
        timer = threading.Timer(args.seconds, stop.set)
        timer.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            report = retention.purge_consumer(
                conn,
                "bench",
                batch_size=args.batch_size,
                max_batches=10_000_000,
                wait_timeout=60,
                pause=args.pause,
                stop=stop,
            )
        timer.cancel()
    tps, per_second = finish_pgbench(proc, path)
    out: dict[str, float] = {"claims_per_s": tps}
    for second, value in enumerate(per_second):
        out[f"second {second + 1}"] = value
    if report is not None:
        out["purged_rows"] = report.rows_deleted
        out["purge_seconds"] = report.seconds
        out["purge_rows_per_s"] = report.rows_deleted / report.seconds if report.seconds else 0.0
    return out


HEARTBEAT = re.compile(
    r"\n *(-- Retention's heartbeat[^\n]*\n)? *IF settings\.last_active_at IS NULL OR "
    r"settings\.last_active_at < now\(\) - '60 seconds'::interval THEN\n"
    r" *PERFORM inbox\._heartbeat\([^)]*\);\n *END IF;"
)


def heartbeat_ab(seconds: int, rounds: int) -> None:
    """Claim throughput with and without the heartbeat lines of sql/030 and sql/040."""
    with tempfile.TemporaryDirectory(prefix="pginbox-no-heartbeat-") as tmp:
        removed = 0
        for module in sorted((ROOT / "sql").glob("*.sql")):
            text, n = HEARTBEAT.subn("", module.read_text())
            removed += n
            (Path(tmp) / module.name).write_text(text)
        if removed != 3:
            raise SystemExit(f"expected 3 heartbeat blocks in sql/, found {removed}")
        with (
            bench_database(prefix="pginbox-bench-hb-") as (with_cluster, with_dsn),
            bench_database(sql_dir=Path(tmp), prefix="pginbox-bench-nohb-") as (without_cluster, without_dsn),
        ):
            clusters = {"with": with_cluster, "without": without_cluster}
            for dsn in (with_dsn, without_dsn):
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(SETUP % {"accounts": ACCOUNTS})  # type: ignore[arg-type]
                    conn.execute("VACUUM ANALYZE")
            samples: dict[tuple[str, str], list[float]] = {}
            for rnd in range(rounds):
                for workload in ("apply", "claim"):
                    for name in ("with", "without") if rnd % 2 == 0 else ("without", "with"):
                        tps = run_pgbench(
                            clusters[name], "bench", SCRIPTS[workload].format(accounts=ACCOUNTS), 8, seconds
                        )
                        samples.setdefault((workload, name), []).append(tps)
                        print(f"round {rnd + 1}: {workload} {name} heartbeat {tps:.0f} tps", flush=True)
    for workload in ("apply", "claim"):
        with_hb = statistics.median(samples[(workload, "with")])
        without_hb = statistics.median(samples[(workload, "without")])
        print(
            f"{workload}: with heartbeat {with_hb:.0f}/s, without {without_hb:.0f}/s, ratio {with_hb / without_hb:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10, help="duration of each pgbench run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1_000_000, help="old processed rows loaded before each run")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--pause", type=float, default=0.05, help="purge: sleep after each batch, seconds")
    parser.add_argument("--indexes", default="btree,brin", help="purge indexes to measure, in turn")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--heartbeat-ab", action="store_true", help="measure the claims' heartbeat instead")
    args = parser.parse_args()
    if args.heartbeat_ab:
        heartbeat_ab(args.seconds, args.rounds)
        return

    results: dict[str, dict[str, float]] = {}
    with bench_database(prefix="pginbox-bench-purge-") as (cluster, dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP % {"accounts": ACCOUNTS})  # type: ignore[arg-type]
            conn.execute(POLICY)
            conn.execute(
                "SELECT inbox.claim_and_apply('bench', 'shop', 'warm-up', 'credit', '{\"account\": 1, \"amount\": 1}')"
            )
        for index in args.indexes.split(","):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("DROP INDEX IF EXISTS inbox.message_purge_idx")
                conn.execute(INDEXES[index])
            samples: dict[str, list[float]] = {}
            pairs: list[float] = []
            during: list[float] = []
            for rnd in range(args.rounds):
                base = run_round(cluster, dsn, args, index, rnd, False)
                purge = run_round(cluster, dsn, args, index, rnd, True)
                # Claims over the seconds the purge ran (all of them when it outlived pgbench: a
                # purge that finished early must not flatter the ratio), against the same seconds
                # of the run without purge.
                overlap = max(1, min(args.seconds, int(purge["purge_seconds"])))
                seconds = [f"second {i + 1}" for i in range(overlap)]
                mean_purge = statistics.mean(purge.get(k, purge["claims_per_s"]) for k in seconds)
                mean_base = statistics.mean(base.get(k, base["claims_per_s"]) for k in seconds)
                pairs.append(mean_purge / mean_base)
                during.append(mean_purge)
                for name, got in (("base", base), ("purge", purge)):
                    for key, value in got.items():
                        if not key.startswith("second "):
                            samples.setdefault(f"{name}:{key}", []).append(value)
                    print(
                        f"{index} round {rnd + 1} {name:5s}: "
                        + " ".join(f"{k}={v:.0f}" for k, v in got.items() if not k.startswith("second ")),
                        flush=True,
                    )
                print(
                    f"{index} round {rnd + 1} claims during the {overlap} s of purge: {mean_purge:.0f}/s, "
                    f"same seconds without: {mean_base:.0f}/s, ratio {pairs[-1]:.2f}",
                    flush=True,
                )
            med = {k: statistics.median(v) for k, v in samples.items()}
            med["purge:claims_per_s_during"] = statistics.median(during)
            med["claims under purge / base"] = statistics.median(pairs)
            results[index] = med
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*), count(DISTINCT (producer, message_id)) FROM inbox.message").fetchone()
            assert row is not None and row[0] == row[1]

    print()
    print(
        f"medians over {args.rounds} rounds of {args.seconds}s, {args.clients} clients, "
        f"{args.rows} old rows per run, batch {args.batch_size}, pause {args.pause}s:"
    )
    for index, med in results.items():
        print(f"  index {index}:")
        print(f"    claims/s without purge   {med['base:claims_per_s']:10.0f}")
        print(f"    claims/s during purge    {med['purge:claims_per_s_during']:10.0f}   (the seconds the purge ran)")
        ratio = med["claims under purge / base"]
        print(f"    claims under purge/base  {ratio:10.2f}x  target >= 0.9: {'met' if ratio >= 0.9 else 'MISSED'}")
        rate = med["purge:purge_rows_per_s"]
        print(f"    purge rows/s             {rate:10.0f}   target >= 50000: {'met' if rate >= 50000 else 'MISSED'}")
    if len(results) == 2:
        a, b = results["brin"], results["btree"]
        print(f"  claims without purge, brin / btree: {a['base:claims_per_s'] / b['base:claims_per_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "args": vars(args) | {"json": None}}, indent=2))


if __name__ == "__main__":
    main()
