"""The proxy's hop (issue 28): calls through the PL/Proxy routing layer against direct calls, in one
run, on one private cluster (fsync on) holding four shard databases and the proxy database.

Workloads (pgbench -M prepared, --clients clients, as a LOGIN role holding only inbox_consumer and
bound to consumer 'bench' on every shard: the proxy connects to the shards as that role too):

  direct        inbox.claim_and_apply on shard 0, one message per call (a SQL handler inserting
                one booking row), tenants spread over 64 names
  proxy         the same call on the proxy database, routed to the tenant's shard (four shards)
  batch-direct  inbox.claim_and_apply_batch of 50 messages (64 tenants) on shard 0
  batch-proxy   the same batch on the proxy: split over the four shards, one call each, in parallel
  hop           the hop alone: a PL/Proxy function routed like claim_and_apply that runs SELECT 1 on
                the tenant's shard (its latency is what the proxy adds to a call, at best)

Workloads are interleaved over --rounds rounds; each ratio is the median of its per-round ratios
(with their range). Targets: proxy / direct >= 0.8, batch-proxy / batch-direct >= 0.8.
All databases share the machine's cores: see docs/scaling.md for what that means on separate hosts.

CPU per call (steadier than calls/s on a shared machine): each workload again, one session calling
in a loop for --cpu-seconds, with the CPU time (/proc/<pid>/stat) of the session's backend (the
"entry": the shard for direct calls, the proxy for routed ones) and of the backends PL/Proxy opened
on the shards, per call, interleaved over --rounds rounds (medians); plus batch-direct with 1 message,
which with the batch of 50 gives a shard's fixed cost per claim_and_apply_batch call and its cost
per message (a proxied batch pays the fixed cost once per shard it touches). From
these, "separate_machines" predicts each ratio when every shard and the proxy have their own
cores: the shards' CPU bounds the throughput, the proxy's CPU is its own (docs/scaling.md).

Usage:  .venv/bin/python bench/bench_proxy.py [--seconds 5] [--rounds 2] [--clients 2] [--cpu-seconds 3]
                                              [--no-sync-commit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import psycopg
from benchlib import ROOT, SERVICE_ROLE, bench_database, create_service_role, deploy_sql, run_pgbench
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from pginbox.schema.sqitch import pinned_pgoptions

SHARDS = 4
TENANTS = 64

SHARD_SETUP = """
CREATE TABLE public.booking (tenant text NOT NULL, message_id text NOT NULL, amount integer NOT NULL);
CREATE FUNCTION public.book(payload jsonb, ctx inbox.message_context) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO public.booking VALUES (ctx.tenant, ctx.message_id, (payload->>'amount')::integer);
END $$;
SELECT inbox.register_handler('bench', 'booked', 'public.book(jsonb, inbox.message_context)', 'v1');
"""

ONE = f"""\\set t random(0, {TENANTS - 1})
SELECT r.outcome FROM inbox.claim_and_apply('bench', 'orders', pg_catalog.gen_random_uuid()::text, 'booked',
       '{{"amount": 1}}'::jsonb, 'tenant-' || :t) r;
"""

HOP_FUNCTION = """
CREATE FUNCTION public.bench_hop(tenant text) RETURNS integer
LANGUAGE plproxy AS $$
    CLUSTER 'inbox_shards';
    RUN ON inbox.tenant_partition(tenant);
    SELECT 1 AS bench_hop;
$$;
GRANT EXECUTE ON FUNCTION public.bench_hop(text) TO inbox_consumer;
"""

HOP = f"""\\set t random(0, {TENANTS - 1})
SELECT public.bench_hop('tenant-' || :t);
"""

BATCH = f"""SELECT count(*) FROM inbox.claim_and_apply_batch('bench', (
  SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
           'producer', 'orders', 'message_id', pg_catalog.gen_random_uuid()::text, 'message_type', 'booked',
           'payload', '{{"amount": 1}}'::jsonb, 'tenant', 'tenant-' || (g % {TENANTS})))
    FROM pg_catalog.generate_series(1, 50) g));
"""


TICKS = os.sysconf("SC_CLK_TCK")

ONE_CALL = "SELECT r.outcome FROM inbox.claim_and_apply('bench', 'orders', %s, 'booked', '{\"amount\": 1}', %s) r"
BATCH_CALL = "SELECT count(*) FROM inbox.claim_and_apply_batch('bench', %s)"
HOP_CALL = "SELECT public.bench_hop(%s)"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a server process (Linux /proc), 0 where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def batch_of(size: int) -> Jsonb:
    return Jsonb(
        [
            {
                "producer": "orders",
                "message_id": str(uuid.uuid4()),
                "message_type": "booked",
                "payload": {"amount": 1},
                "tenant": f"tenant-{g % TENANTS}",
            }
            for g in range(size)
        ]
    )


def cpu_per_call(dsn: str, monitor_dsn: str, kind: str, size: int, seconds: float) -> dict[str, float]:
    """One session calling `kind` in a loop for `seconds`: microseconds per call of wall time and of
    CPU in the session's backend (entry), in the backends PL/Proxy opened on the shards (shards:
    every other backend of the service role) and in this client."""

    def call(conn: psycopg.Connection[tuple[object, ...]], i: int) -> None:
        tenant = f"tenant-{i % TENANTS}"
        if kind == "one":
            conn.execute(ONE_CALL, (str(uuid.uuid4()), tenant)).fetchall()
        elif kind == "hop":
            conn.execute(HOP_CALL, (tenant,)).fetchall()
        else:
            conn.execute(BATCH_CALL, (batch_of(size),)).fetchall()

    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(monitor_dsn, autocommit=True) as mon:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        pid = int(row[0])
        for i in range(4 * TENANTS if kind != "batch" else 8):  # warm: PL/Proxy's connections, plan caches
            call(conn, i)
        others = [
            int(r[0])
            for r in mon.execute(
                "SELECT pid FROM pg_catalog.pg_stat_activity WHERE usename = %s AND pid <> %s", (SERVICE_ROLE, pid)
            ).fetchall()
        ]
        before = {p: cpu_seconds(p) for p in [pid, *others]}
        client0, wall0, calls = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - wall0 < seconds:
            call(conn, calls)
            calls += 1
        wall = time.perf_counter() - wall0
        client = time.process_time() - client0
        entry = cpu_seconds(pid) - before[pid]
        shards = sum(cpu_seconds(p) - before[p] for p in others)
    return {
        "wall": round(1e6 * wall / calls),
        "entry": round(1e6 * entry / calls),
        "shards": round(1e6 * shards / calls),
        "client": round(1e6 * client / calls),
        "calls": calls,
    }


def deploy_proxy(dsn: str) -> None:
    env = {**os.environ, "PGOPTIONS": pinned_pgoptions(os.environ.get("PGOPTIONS"))}
    for change in ("proxy_roles", "proxy_cluster", "proxy_routing", "proxy_operator"):
        done = subprocess.run(
            [
                "psql",
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                dsn,
                "-f",
                str(ROOT / "proxy" / "deploy" / f"{change}.sql"),
            ],
            check=False,
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode != 0:
            raise SystemExit(f"deploying proxy/{change} failed:\n{done.stderr}")


def separate_machines(cpu: dict[str, dict[str, float]]) -> dict[str, object]:
    """What the CPU per call predicts when the proxy and each shard have their own cores (one
    shard's CPU bounds its throughput; the proxy's CPU is spent elsewhere).

    throughput_ratio_per_shard: calls a shard serves through the proxy / direct, from the shards'
    CPU per call alone (the proxy adds work on the shard: its unprepared remote query; here also four
    shard databases' backends sharing two cores, which separate machines do not: a lower bound).
    batch_throughput_ratio: the cluster's batches of 50 through the proxy over SHARDS shards / batches
    of 50 on one database (each shard does its part; their CPU is summed over SHARDS machines).
    batch_fixed_us: a shard's fixed CPU per claim_and_apply_batch call (from the 1- and 50-message
    batches), paid once per shard a proxied batch touches.
    proxy_cores_per_1000_calls_s: proxy CPU to route 1,000 calls a second (the entry backend)."""
    per_message = (cpu["batch-direct"]["entry"] - cpu["batch-direct-1"]["entry"]) / 49
    fixed = cpu["batch-direct-1"]["entry"] - per_message
    return {
        "throughput_ratio_per_shard": round(cpu["direct"]["entry"] / max(cpu["proxy"]["shards"], 1), 3),
        "latency_us_direct_plus_hop": round(cpu["direct"]["wall"] + cpu["hop"]["wall"]),
        "batch_throughput_ratio": round(
            SHARDS * cpu["batch-direct"]["entry"] / max(cpu["batch-proxy"]["shards"], 1), 3
        ),
        "batch_fixed_us": round(fixed),
        "batch_per_message_us": round(per_message),
        "proxy_cores_per_1000_calls_s": round(cpu["proxy"]["entry"] / 1000, 3),
        "proxy_cores_per_1000_batches_s": round(cpu["batch-proxy"]["entry"] / 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--cpu-seconds", type=float, default=3.0, help="per workload of the CPU-per-call phase")
    parser.add_argument(
        "--no-sync-commit",
        action="store_true",
        help="synchronous_commit = off on the cluster: the commits' WAL flushes (noisy on a shared disk) "
        "out of the figures, what is left is the CPU of the calls and the hop",
    )
    args = parser.parse_args()

    with bench_database(prefix="pginbox-bench-proxy-") as (cluster, dsn0):
        shard_dbs = ["bench"] + [f"shard{i}" for i in range(1, SHARDS)]
        for name in shard_dbs[1:]:
            cluster.create_database(name)
            deploy_sql(cluster.dsn(name))
        for i, name in enumerate(shard_dbs):
            with psycopg.connect(cluster.dsn(name), autocommit=True) as conn:
                conn.execute(SHARD_SETUP)  # type: ignore[arg-type]
            create_service_role(cluster.dsn(name), grants="GRANT INSERT ON public.booking TO {role}", create=(i == 0))
        if args.no_sync_commit:
            with psycopg.connect(cluster.dsn("postgres"), autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET synchronous_commit = off")
                conn.execute("SELECT pg_reload_conf()")
        cluster.create_database("proxy")
        deploy_proxy(cluster.dsn("proxy"))
        with psycopg.connect(cluster.dsn("proxy"), autocommit=True) as conn:
            dsns = [f"host=127.0.0.1 port={cluster.port} dbname={name}" for name in shard_dbs]
            conn.execute("SELECT inbox.configure_shards(%s)", (dsns,))
            conn.execute(HOP_FUNCTION)  # type: ignore[arg-type]
        del dsn0

        workloads = {
            "direct": (ONE, "bench"),
            "proxy": (ONE, "proxy"),
            "batch-direct": (BATCH, "bench"),
            "batch-proxy": (BATCH, "proxy"),
            "hop": (HOP, "proxy"),
        }
        tps: dict[str, list[float]] = {name: [] for name in workloads}
        for _ in range(args.rounds):
            for name, (script, db) in workloads.items():
                tps[name].append(run_pgbench(cluster, script, args.clients, args.seconds, db=db, user=SERVICE_ROLE))

        svc = {db: make_conninfo(cluster.dsn(db), user=SERVICE_ROLE) for db in ("bench", "proxy")}
        monitor = cluster.dsn("postgres")
        cpu_workloads = {
            "direct": ("bench", "one", 1),
            "proxy": ("proxy", "one", 1),
            "hop": ("proxy", "hop", 1),
            "batch-direct": ("bench", "batch", 50),
            "batch-proxy": ("proxy", "batch", 50),
            "batch-direct-1": ("bench", "batch", 1),
        }
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in cpu_workloads}
        for _ in range(args.rounds):  # interleaved like the throughput rounds; medians below
            for name, (db, kind, size) in cpu_workloads.items():
                samples[name].append(cpu_per_call(svc[db], monitor, kind, size, args.cpu_seconds))
        cpu = {
            name: {field: round(statistics.median(s[field] for s in runs)) for field in runs[0]}
            for name, runs in samples.items()
        }

        def ratios(a: str, b: str) -> list[float]:
            return [x / y for x, y in zip(tps[a], tps[b], strict=True)]

        one, batch = ratios("proxy", "direct"), ratios("batch-proxy", "batch-direct")
        report = {
            "calls_per_second": {name: round(statistics.median(v), 1) for name, v in tps.items()},
            "messages_per_second": {
                "direct": round(statistics.median(tps["direct"])),
                "proxy": round(statistics.median(tps["proxy"])),
                "batch-direct": round(statistics.median(tps["batch-direct"]) * 50),
                "batch-proxy": round(statistics.median(tps["batch-proxy"]) * 50),
            },
            "latency_us_per_call": {name: round(1e6 * args.clients / statistics.median(v)) for name, v in tps.items()},
            "proxy/direct": [round(statistics.median(one), 3), [round(min(one), 3), round(max(one), 3)]],
            "batch-proxy/batch-direct": [
                round(statistics.median(batch), 3),
                [round(min(batch), 3), round(max(batch), 3)],
            ],
            "cpu_us_per_call": cpu,
            "separate_machines": separate_machines(cpu),
            "clients": args.clients,
            "synchronous_commit": "off" if args.no_sync_commit else "on",
            "seconds": args.seconds,
            "rounds": args.rounds,
        }
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
