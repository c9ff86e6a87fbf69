"""Metrics cost (issue: retention, replay and metrics), ratios from one run on a private cluster:

  counting  claim throughput (pgbench -M prepared, 8 clients, inbox.claim_and_apply with a
            PL/pgSQL handler, 20% of deliveries duplicates of already processed messages) with
            duplicate/failure counting on vs off (inbox.configure_metrics), interleaved rounds,
            medians. A scraper reads inbox.metrics() every --scrape-every seconds in both modes,
            as Prometheus would. Target: on >= 0.95x off. Also the cluster's CPU per message
            (/proc), which other load on a shared machine disturbs less than throughput.
  read      time of one `SELECT * FROM inbox.metrics()` on a 10k-row vs a --rows-row inbox
            (10M by default; built with INSERT ... SELECT generate_series, 4 consumers x 8 producers,
            processed_at spread over 30 days; one rollup folds them first), idle and with 2,000 new
            first deliveries folded by each read, the two databases read in turn. Target: about
            the same.

Usage:  .venv/bin/python bench/bench_metrics.py [--seconds 10] [--rounds 3] [--rows 10000000] [--json FILE]
        (--skip-counting / --skip-read run one half)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from benchlib import bench_database

from pginbox.devtools.cluster import Cluster, find_bindir

ACCOUNTS = 100_000
DUPLICATE_POOL = 50_000

SETUP = """
CREATE TABLE account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO account (id) SELECT g FROM generate_series(1, %(accounts)s) g;
CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  UPDATE account SET balance = balance + (payload->>'amount')::bigint WHERE id = (payload->>'account')::integer;
END $$;
SELECT inbox.register_handler('bench', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
-- The messages the duplicates repeat: processed once, long ago.
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, processed_at)
SELECT 'bench', '', 'shop', 'dup-' || g,
       inbox.payload_hash(jsonb_build_object('account', g %% %(accounts)s + 1, 'amount', 1)), 'v1',
       now() - interval '1 day'
  FROM generate_series(1, %(pool)s) g;
"""

# One delivery in five repeats an already processed message (same payload: a duplicate).
CLAIM_SCRIPT = """
\\set k random(1, 5)
\\set d random(1, {pool})
\\set aid random(1, {accounts})
\\set mid random(1, 1152921504606846976)
SELECT outcome FROM inbox.claim_and_apply('bench', 'shop',
  CASE WHEN :k = 1 THEN 'dup-' || :d ELSE :client_id::text || '-' || :mid::text END, 'credit',
  CASE WHEN :k = 1 THEN jsonb_build_object('account', :d % {accounts} + 1, 'amount', 1)
       ELSE jsonb_build_object('account', :aid::integer, 'amount', 1) END);
"""

# The synthetic inbox for the read test.
FILL = """
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, produced_at,
                           processed_at, received_at)
SELECT 'consumer-' || mod(g, 4), '', 'producer-' || mod(g, 8), 'm-' || g, '\\x00', 'v1',
       CASE WHEN mod(g, 10) = 0 THEN NULL ELSE now() - interval '30 days' END,
       now() - interval '30 days' + (g::double precision / %(rows)s) * interval '29 days',
       now() - interval '30 days' + (g::double precision / %(rows)s) * interval '29 days'
  FROM generate_series(1, %(rows)s) g;
INSERT INTO inbox.quarantine (consumer, tenant, producer, message_id, kind, reason_code, handler_version, deliveries)
SELECT 'consumer-' || mod(g, 4), '', 'producer-' || mod(g, 8), 'q-' || g,
       CASE WHEN mod(g, 2) = 0 THEN 'conflict' ELSE 'failure' END, 'reason-' || mod(g, 3), 'v1', 1 + mod(g, 3)
  FROM generate_series(1, 200) g;
INSERT INTO inbox.outbox (effect_id, destination, payload, payload_sha256)
SELECT 'e-' || g, 'hook-' || mod(g, 3), '{}', '\\x00' FROM generate_series(1, 100) g;
"""
# 2,000 new first deliveries, committed (the read databases run with rollup grace 0): what a read
# folds between two scrapes.
NEW_ROWS = """
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, processed_at)
SELECT 'consumer-' || mod(g, 4), '', 'producer-' || mod(g, 8), 'n-' || %(batch)s || '-' || g, '\\x00', 'v1', now()
  FROM generate_series(1, 2000) g;
"""


def server_cpu_seconds(cluster: Cluster) -> float:
    """CPU (user + system) the cluster has used so far: the postmaster, its live children, and the
    children that exited (the postmaster's cutime/cstime), from Linux /proc."""
    postmaster = int((Path(cluster.datadir) / "postmaster.pid").read_text().split()[0])
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(fields[1])
        if pid == postmaster:
            ticks += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        elif ppid == postmaster:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def pgbench(cluster: Cluster, script: str, clients: int, seconds: int) -> tuple[float, int, float]:
    """(tps, transactions, server CPU seconds) of one pgbench -M prepared run on database bench."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
    Path(f.name).chmod(0o644)
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
        "-f",
        f.name,
        "-h",
        "127.0.0.1",
        "-p",
        str(cluster.port),
        "-U",
        "postgres",
        "bench",
    ]
    cpu0 = server_cpu_seconds(cluster)
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    time.sleep(0.5)  # the postmaster reaps the exited backends (their CPU moves to its cutime)
    cpu = server_cpu_seconds(cluster) - cpu0
    Path(f.name).unlink()
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    done = re.search(r"number of transactions actually processed: (\d+)", out.stdout)
    if out.returncode != 0 or not tps or not done:
        raise SystemExit(f"pgbench failed:\n{out.stdout}\n{out.stderr}")
    return float(tps.group(1)), int(done.group(1)), cpu


class Scraper(threading.Thread):
    """Reads inbox.metrics() every `every` seconds until stopped (like Prometheus)."""

    def __init__(self, dsn: str, every: float) -> None:
        super().__init__(daemon=True)
        self.dsn, self.every, self.reads = dsn, every, 0
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.wait(self.every):
                conn.execute("SELECT count(*) FROM inbox.metrics()").fetchone()
                self.reads += 1


def counting_bench(cluster: Cluster, dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SETUP % {"accounts": ACCOUNTS, "pool": DUPLICATE_POOL})
        conn.execute("VACUUM ANALYZE")
    script = CLAIM_SCRIPT.format(pool=DUPLICATE_POOL, accounts=ACCOUNTS)
    samples: dict[str, list[float]] = {"on": [], "off": []}
    cpu_us: dict[str, list[float]] = {"on": [], "off": []}
    for rnd in range(args.rounds):
        for mode in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SELECT inbox.configure_metrics(counting => %s)", (mode == "on",))
            scraper = Scraper(dsn, args.scrape_every)
            scraper.start()
            tps, done, cpu = pgbench(cluster, script, args.clients, args.seconds)
            scraper.stop.set()
            scraper.join()
            samples[mode].append(tps)
            cpu_us[mode].append(cpu / done * 1e6)
            print(
                f"round {rnd + 1}: counting {mode:3s} {tps:8.0f} msgs/s, server CPU {cpu / done * 1e6:6.1f} us/msg"
                f"  ({scraper.reads} scrapes)",
                flush=True,
            )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT inbox.configure_metrics(counting => true, rollup_grace => '0')")
        dup = conn.execute("SELECT value FROM inbox.metrics() WHERE metric = 'pginbox_duplicates_total'").fetchone()
        pairs = conn.execute("SELECT count(*), count(DISTINCT (producer, message_id)) FROM inbox.message").fetchone()
    assert pairs is not None and pairs[0] == pairs[1]
    med = {mode: statistics.median(v) for mode, v in samples.items()}
    cpu_med = {mode: statistics.median(v) for mode, v in cpu_us.items()}
    return {
        "medians": med,
        "ratio": med["on"] / med["off"],
        "cpu_us_per_msg": cpu_med,
        "cpu_ratio": cpu_med["off"] / cpu_med["on"],
        "duplicates_counted": dup[0] if dup else None,
    }


def timed_reads(dsns: dict[str, str], n: int, with_new_rows: bool) -> dict[str, tuple[float, int]]:
    """Median milliseconds of one inbox.metrics() read per database, the databases read in turn (so
    that both see the same load on the machine), and the rows a read returned."""
    times: dict[str, list[float]] = {label: [] for label in dsns}
    rows: dict[str, int] = {}
    conns = {label: psycopg.connect(dsn, autocommit=True) for label, dsn in dsns.items()}
    try:
        for conn in conns.values():  # warm up: the first read of a session plans everything
            conn.execute("SELECT * FROM inbox.metrics()").fetchall()
        for i in range(n):
            for label, conn in conns.items():
                if with_new_rows:
                    conn.execute(NEW_ROWS % {"batch": f"'{int(time.time() * 1e6)}-{i}'"})
                started = time.perf_counter()
                rows[label] = len(conn.execute("SELECT * FROM inbox.metrics()").fetchall())
                times[label].append((time.perf_counter() - started) * 1000)
    finally:
        for conn in conns.values():
            conn.close()
    return {label: (statistics.median(times[label]), rows[label]) for label in dsns}


def read_bench(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dsns: dict[str, str] = {}
    for label, rows in (("10k", 10_000), ("large", args.rows)):
        db = f"read_{label}"
        with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {db} TEMPLATE bench_empty")
        dsn = dsns[label] = cluster.dsn(db)
        started = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(FILL % {"rows": rows})
            conn.execute("VACUUM ANALYZE inbox.message")
            filled = time.perf_counter() - started
            # The rows are older than the deploy-time cursor: start the rollup at the beginning.
            conn.execute("UPDATE inbox.metric_rollup_state SET processed_cursor = '-infinity'")
            conn.execute("SELECT inbox.configure_metrics(rollup_grace => '0')")
            t0 = time.perf_counter()
            conn.execute("SELECT inbox.metrics_rollup(100000000)")
            first_rollup = time.perf_counter() - t0
            total = conn.execute("SELECT sum(value) FROM inbox.metric_total WHERE metric = 'first_seen'").fetchone()
            size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('inbox.message'))").fetchone()
        assert total is not None and total[0] == rows, (total, rows)
        out[label] = {"rows": rows, "size": size[0] if size else None, "fill_s": filled, "first_rollup_s": first_rollup}
        print(
            f"{label:5s}: {rows} rows ({out[label]['size']}), filled in {filled:.0f}s, first rollup "
            f"{first_rollup:.1f}s",
            flush=True,
        )
    for mode, with_new_rows in (("read_ms", False), ("read_with_2000_new_rows_ms", True)):
        for label, (ms, series) in timed_reads(dsns, args.reads, with_new_rows).items():
            out[label][mode] = ms
            out[label]["series"] = series
    for label in dsns:
        fig = out[label]
        print(
            f"{label:5s}: one read {fig['read_ms']:.2f} ms idle, {fig['read_with_2000_new_rows_ms']:.2f} ms folding"
            f" 2000 new rows ({fig['series']} series)",
            flush=True,
        )
        with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE read_{label}")
    out["ratio_idle"] = out["large"]["read_ms"] / out["10k"]["read_ms"]
    out["ratio_with_new_rows"] = out["large"]["read_with_2000_new_rows_ms"] / out["10k"]["read_with_2000_new_rows_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10, help="duration of each pgbench run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of on/off; medians are reported")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--scrape-every", type=float, default=2.0, help="seconds between metric reads during pgbench")
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows of the large inbox")
    parser.add_argument("--reads", type=int, default=30, help="timed reads per database and mode (median)")
    parser.add_argument("--skip-counting", action="store_true")
    parser.add_argument("--skip-read", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    figures: dict[str, Any] = {}
    with bench_database() as (cluster, dsn):
        with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as admin:
            admin.execute("CREATE DATABASE bench_empty TEMPLATE bench")
        if not args.skip_counting:
            figures["counting"] = counting_bench(cluster, dsn, args)
        if not args.skip_read:
            figures["read"] = read_bench(cluster, args)

    print()
    if "counting" in figures:
        c = figures["counting"]
        print(
            f"counting: medians over {args.rounds} rounds of {args.seconds}s, {args.clients} clients, "
            f"20% duplicates: on {c['medians']['on']:.0f} msgs/s, off {c['medians']['off']:.0f} msgs/s"
        )
        print(
            f"  on / off {c['ratio']:.3f}x  target >= 0.95: {'met' if c['ratio'] >= 0.95 else 'MISSED'}"
            f"  (duplicates counted: {c['duplicates_counted']:.0f})"
        )
        cpu = c["cpu_us_per_msg"]
        print(
            f"  server CPU per message: on {cpu['on']:.1f} us, off {cpu['off']:.1f} us: CPU-bound throughput"
            f" on / off = {c['cpu_ratio']:.3f}x (less sensitive to other load on the machine)"
        )
    if "read" in figures:
        r = figures["read"]
        print(
            f"read: inbox.metrics() on {r['large']['rows']} rows vs 10k rows: idle {r['large']['read_ms']:.2f} ms vs "
            f"{r['10k']['read_ms']:.2f} ms ({r['ratio_idle']:.2f}x); folding 2000 new rows "
            f"{r['large']['read_with_2000_new_rows_ms']:.2f} ms vs {r['10k']['read_with_2000_new_rows_ms']:.2f} ms "
            f"({r['ratio_with_new_rows']:.2f}x)"
        )
    if args.json:
        args.json.write_text(json.dumps(figures | {"args": vars(args) | {"json": None}}, indent=2, default=str))


if __name__ == "__main__":
    main()
