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

Usage:  .venv/bin/python bench/bench_proxy.py [--seconds 5] [--rounds 2] [--clients 2] [--no-sync-commit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

import psycopg
from benchlib import ROOT, SERVICE_ROLE, bench_database, create_service_role, deploy_sql, run_pgbench

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=2)
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
            "clients": args.clients,
            "synchronous_commit": "off" if args.no_sync_commit else "on",
            "seconds": args.seconds,
            "rounds": args.rounds,
        }
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
