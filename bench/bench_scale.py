"""The cost curve of a large inbox (issue 11): claim_and_apply throughput and bytes per remembered
identity with inbox.message at 10k, 1M and 10M rows.

One private cluster (fsync on), one database per size, each holding that many remembered
identities with random UUID message ids (as real producers send), inserted through the primary
key in random order as claims would, with processed_at rising as in a live inbox (so the indexes
are as full as a live inbox's, not as a fresh CREATE INDEX would make them), then VACUUM ANALYZE.
Bytes per identity = the table with its indexes and TOAST (pg_total_relation_size) / rows,
measured after the load; the heap and each index are shown apart.

Throughput: pgbench (-M prepared, 8 clients) runs inbox.claim_and_apply with a new random UUID
per message and a one-row business UPDATE as the handler, as a LOGIN role bound to the consumer
(authorization on). Each round runs every size once, in random order; the rows a run claimed are
deleted and vacuumed away after it, so each database keeps its size. The ratios are medians of
the per-round ratios to the smallest size.

Usage:  .venv/bin/python bench/bench_scale.py [--sizes 10000,1000000,10000000] [--seconds 10] [--rounds 3]
            [--shared-buffers 2GB]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

import psycopg
from benchlib import ROOT, SERVICE_ROLE, bench_database, create_service_role, run_pgbench
from psycopg import sql

ACCOUNTS = 100_000
LOAD_CHUNK = 500_000

SETUP = """
CREATE TABLE account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO account (id) SELECT g FROM generate_series(1, %(accounts)s) g;
CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  UPDATE account SET balance = balance + 1 WHERE id = (payload->>'account')::integer;
END $$;
SELECT inbox.register_handler('bench', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
"""

GRANTS = "GRANT SELECT, UPDATE ON account TO {role};"

# What one claim_and_apply leaves behind, per identity: the claim row as the claim path writes it
# (payload hash, handler version, timestamps), one per transaction's processed_at. processed_at
# rises through the whole load, chunk after chunk, as it does in a live inbox (until 2026-12-03
# every chunk started again at the same time: the purge index then split its pages in the middle,
# not at its right end, and took up to 47 bytes per identity where a live inbox's takes about 32).
LOAD = """
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,
                           produced_at, received_at, processed_at)
SELECT 'bench', '', 'shop', gen_random_uuid()::text,
       sha256(convert_to(jsonb_build_object('account', g %% 1000, 'amount', 1)::text, 'UTF8')), 'v1',
       t, t, t
  FROM generate_series(%(first)s, %(last)s) g,
       LATERAL (SELECT now() - interval '1 day' + g * interval '1 millisecond' AS t) ts
"""

SCRIPT = """
\\set aid random(1, {accounts})
SELECT outcome FROM inbox.claim_and_apply('bench', 'shop', gen_random_uuid()::text, 'credit',
                                          jsonb_build_object('account', :aid::integer, 'amount', 1));
"""


def deploy_into(cluster_dsn: str, db: str) -> str:
    """A copy of the deployed `bench` database (CREATE DATABASE .. TEMPLATE bench)."""
    with psycopg.connect(cluster_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}" TEMPLATE bench')  # type: ignore[arg-type]
    return cluster_dsn.replace("dbname=bench", f"dbname={db}")


def sizes_of(dsn: str) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), pg_relation_size('inbox.message'), pg_relation_size('inbox.message_pkey'),"
            " pg_relation_size('inbox.message_purge_idx'), pg_total_relation_size('inbox.message')"
            " FROM inbox.message"
        ).fetchone()
    assert row is not None
    rows = max(int(row[0]), 1)
    return {
        "rows": rows,
        "heap": row[1] / rows,
        "pkey": row[2] / rows,
        "purge_idx": row[3] / rows,
        "total": row[4] / rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,1000000,10000000", help="rows in inbox.message, comma-separated")
    parser.add_argument("--seconds", type=int, default=10, help="duration of each pgbench run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--shared-buffers",
        metavar="SIZE",
        help="shared_buffers of the cluster (e.g. 2GB; default: PostgreSQL's 128MB, in which the "
        "1 GB primary key of 10M identities does not fit)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    with bench_database() as (cluster, dsn):
        if args.shared_buffers:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("ALTER SYSTEM SET shared_buffers = {}").format(sql.Literal(args.shared_buffers)))
            cluster.stop("fast")
            cluster.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            settings = conn.execute(
                "SELECT current_setting('shared_buffers'), current_setting('max_wal_size')"
            ).fetchone()
        assert settings is not None
        print(f"cluster: shared_buffers {settings[0]}, max_wal_size {settings[1]}", flush=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP % {"accounts": ACCOUNTS})  # type: ignore[arg-type]
        create_service_role(dsn, "bench", GRANTS)
        dbs: dict[int, str] = {}
        footprint: dict[int, dict[str, float]] = {}
        for size in sizes:
            db = f"scale_{size}"
            dbs[size] = deploy_into(dsn, db)
            started = time.monotonic()
            with psycopg.connect(dbs[size], autocommit=True) as conn:
                for done in range(0, size, LOAD_CHUNK):
                    last = min(done + LOAD_CHUNK, size)
                    conn.execute(LOAD % {"first": done + 1, "last": last})  # type: ignore[arg-type]
                conn.execute("VACUUM ANALYZE")
            footprint[size] = sizes_of(dbs[size])
            print(
                f"loaded {size:>10,} identities in {time.monotonic() - started:6.1f}s: "
                f"{footprint[size]['total']:.0f} bytes each (heap {footprint[size]['heap']:.0f}, "
                f"primary key {footprint[size]['pkey']:.0f}, purge index {footprint[size]['purge_idx']:.0f})",
                flush=True,
            )
        subprocess.run(["psql", "-X", "-q", "-d", dsn, "-c", "CHECKPOINT"], check=True)

        samples: dict[int, list[float]] = {size: [] for size in sizes}
        pair: dict[int, list[float]] = {size: [] for size in sizes}
        script = SCRIPT.format(accounts=ACCOUNTS)
        for rnd in range(args.rounds):
            got: dict[int, float] = {}
            for size in random.sample(sizes, len(sizes)):
                db = f"scale_{size}"
                with psycopg.connect(dbs[size], autocommit=True) as conn:
                    mark = conn.execute("SELECT clock_timestamp()").fetchone()
                assert mark is not None
                tps = run_pgbench(cluster, script, args.clients, args.seconds, db=db, user=SERVICE_ROLE)
                with psycopg.connect(dbs[size], autocommit=True) as conn:
                    conn.execute("DELETE FROM inbox.message WHERE received_at >= %s", (mark[0],))
                    conn.execute("VACUUM inbox.message")
                    conn.execute("CHECKPOINT")
                got[size] = tps
                samples[size].append(tps)
                print(f"round {rnd + 1}: {size:>10,} rows {tps:8.0f} msgs/s", flush=True)
            for size in sizes:
                pair[size].append(got[size] / got[sizes[0]])

    med = {size: statistics.median(v) for size, v in samples.items()}
    ratio = {size: statistics.median(v) for size, v in pair.items()}
    print()
    print(f"medians over {args.rounds} rounds of {args.seconds}s, {args.clients} clients (claim_and_apply, UUID ids):")
    print(
        f"  {'rows':>12s} {'msgs/s':>9s} {'vs smallest':>12s} {'bytes/identity':>15s} {'heap':>6s} {'pkey':>6s} "
        f"{'purge':>6s}"
    )
    for size in sizes:
        f = footprint[size]
        print(
            f"  {size:>12,} {med[size]:9.0f} {ratio[size]:11.2f}x {f['total']:15.0f} {f['heap']:6.0f} "
            f"{f['pkey']:6.0f} {f['purge_idx']:6.0f}"
        )
    largest, smallest = sizes[-1], sizes[0]
    print(
        f"targets: throughput at {largest:,} >= 0.8x at {smallest:,}: "
        f"{'met' if ratio[largest] >= 0.8 else 'MISSED'} ({ratio[largest]:.2f}x); "
        f"bytes per identity <= 200: {'met' if footprint[largest]['total'] <= 200 else 'MISSED'} "
        f"({footprint[largest]['total']:.0f})"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "msgs_per_s": med,
                    "ratio_to_smallest": ratio,
                    "footprint": footprint,
                    "args": vars(args) | {"json": None},
                    "root": str(ROOT),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
