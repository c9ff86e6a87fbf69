"""CPU per transaction of the claim paths, this checkout against an earlier revision, in one session.

pgbench's ratios (bench_claim.py) move with the machine's commit latency and noise; this measures
what a change did to the server's CPU. One private cluster holds two databases: `base`, built from
sql/ of --base (git archive), and `head`, built from this checkout's sql/. Each gets the benchmark
schema of bench_claim.py, the LOGIN role bound to consumer 'bench' (authorization on), and
--rows remembered identities with random UUID ids (VACUUM ANALYZE after the load). Then, as that
role, procedures that make one call per transaction and COMMIT after each (so per-transaction
costs count; synchronous_commit off, so the disk does not):
  apply        inbox.claim_and_apply, one message (a new random UUID) and the credit handler
  claim        inbox.claim, one message (a new random UUID), no handler
  duplicate    inbox.claim of one of 100 identities claimed already, same payload: 'duplicate'
  batch        inbox.claim_and_apply_batch, 50 messages
  claim_batch  inbox.claim_batch, 50 messages (no handlers)
  enqueue      UPDATE account (one row), then inbox.enqueue_effect (consumer 'bench', destination
               'webhook', bound to both), as bench_outbox_signal.py's transaction
  plain        the same transaction inserting into a plain outbox table (bench_outbox_signal.py's
               baseline; the same in both databases: a check of the noise)
The backend's CPU time (/proc/<pid>/schedstat) over each run is divided by the calls; the runs of
base and head alternate, and the medians of --runs runs are reported.

Usage:  .venv/bin/python bench/bench_cpu_ab.py [--base b2ab4df] [--rows 1000000] [--runs 7]
            [--only apply claim duplicate batch claim_batch enqueue plain]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from bench_claim import GRANTS, SETUP
from bench_outbox_signal import OUTBOX_SETUP
from benchlib import ROOT, SERVICE_ROLE, create_service_role, deploy_sql

from pginbox.devtools.cluster import Cluster

# One call per transaction. The batches differ only in the function and its last argument.
BATCH = """
CREATE PROCEDURE bench_{name}(n integer) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. n LOOP
        PERFORM count(*) FROM inbox.{function}('bench', (
            SELECT jsonb_agg(jsonb_build_object('producer', 'shop', 'message_id', gen_random_uuid()::text,
                                                'message_type', 'credit',
                                                'payload', jsonb_build_object('account', 1 + (i * 50 + g) % 100000,
                                                                              'amount', 1)) ORDER BY g)
              FROM generate_series(1, 50) g){extra});
        COMMIT;
    END LOOP;
END $$;
"""
# One transaction of bench_outbox_signal.py's: an account UPDATE, then the effect recorded.
OUTBOX_CALL = """
CREATE PROCEDURE bench_{name}(n integer) LANGUAGE plpgsql AS $$
DECLARE
    run text := gen_random_uuid()::text;
    payload jsonb;
BEGIN
    FOR i IN 1 .. n LOOP
        payload := jsonb_build_object('account', 1 + (i * 7919) % 100000, 'amount', 1);
        UPDATE account SET balance = balance + 1 WHERE id = 1 + (i * 7919) % 100000;
        {record};
        COMMIT;
    END LOOP;
END $$;
"""
PROCEDURES = (
    """
CREATE PROCEDURE bench_apply(n integer) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. n LOOP
        PERFORM inbox.claim_and_apply('bench', 'shop', gen_random_uuid()::text, 'credit',
                                      jsonb_build_object('account', 1 + (i * 7919) % 100000, 'amount', 1));
        COMMIT;
    END LOOP;
END $$;
"""
    + """
CREATE PROCEDURE bench_claim(n integer) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. n LOOP
        PERFORM inbox.claim('bench', 'shop', gen_random_uuid()::text,
                            jsonb_build_object('account', 1 + (i * 7919) % 100000, 'amount', 1), 'v1');
        COMMIT;
    END LOOP;
END $$;
CREATE PROCEDURE bench_duplicate(n integer) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. n LOOP  -- the warm-up claims the 100 identities; every later call is a duplicate
        PERFORM inbox.claim('bench', 'shop', 'dup-' || i % 100, jsonb_build_object('account', i % 100, 'amount', 1),
                            'v1');
        COMMIT;
    END LOOP;
END $$;
"""
    + BATCH.format(name="batch", function="claim_and_apply_batch", extra="")
    + BATCH.format(name="claim_batch", function="claim_batch", extra=", 'v1'")
    + OUTBOX_SETUP
    + OUTBOX_CALL.format(
        name="enqueue",
        record="PERFORM inbox.enqueue_effect(run || '-' || i, 'webhook', payload, consumer => 'bench')",
    )
    + OUTBOX_CALL.format(
        name="plain",
        record="INSERT INTO bench.plain_outbox (effect_id, consumer, destination, payload)"
        " VALUES (run || '-' || i, 'bench', 'webhook', payload)",
    )
    + """
GRANT USAGE ON SCHEMA bench TO {role};
GRANT SELECT, INSERT ON bench.plain_outbox TO {role};
GRANT EXECUTE ON PROCEDURE bench_apply(integer), bench_claim(integer), bench_duplicate(integer), bench_batch(integer),
                           bench_claim_batch(integer),
                           bench_enqueue(integer), bench_plain(integer) TO {role};
"""
)

LOAD = """
INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,
                           produced_at, received_at, processed_at)
SELECT 'bench', '', 'shop', gen_random_uuid()::text, sha256(g::text::bytea), 'v1', t, t, t
  FROM generate_series(1, %(rows)s) g, LATERAL (SELECT now() - interval '1 day' AS t) ts
"""

WORKLOADS = {
    "apply": ("bench_apply", 3000),
    "claim": ("bench_claim", 3000),
    "duplicate": ("bench_duplicate", 3000),
    "batch": ("bench_batch", 300),
    "claim_batch": ("bench_claim_batch", 300),
    "enqueue": ("bench_enqueue", 5000),
    "plain": ("bench_plain", 5000),
}


def backend_cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="b2ab4df", help="git revision to compare this checkout with")
    parser.add_argument("--rows", type=int, default=1_000_000, help="identities in inbox.message before the runs")
    parser.add_argument("--runs", type=int, default=7, help="runs of each workload per database")
    parser.add_argument(
        "--only", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS), help="workloads to run (default: all)"
    )
    args = parser.parse_args()
    workloads = {name: WORKLOADS[name] for name in args.only}

    with tempfile.TemporaryDirectory(prefix="pginbox-bench-ab-") as tmp:
        Path(tmp).chmod(0o755)
        base_sql = Path(tmp) / "base"
        base_sql.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "sql"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base_sql)], input=archive.stdout, check=True)
        cluster = Cluster(Path(tmp) / "data")
        cluster.ensure()
        cluster.start()
        try:
            for db, sql_dir in (("base", base_sql / "sql"), ("head", ROOT / "sql")):
                cluster.create_database(db)
                dsn = cluster.dsn(db)
                deploy_sql(dsn, sql_dir)
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute(SETUP % {"accounts": 100_000})  # type: ignore[arg-type]
                create_service_role(dsn, "bench", GRANTS + PROCEDURES, create=db == "base")
                with psycopg.connect(dsn, autocommit=True) as c:
                    started = time.monotonic()
                    c.execute(LOAD, {"rows": args.rows})
                    c.execute("VACUUM ANALYZE")
                    print(
                        f"{db}: sql/ of {args.base if db == 'base' else 'this checkout'}, "
                        f"{args.rows:,} identities loaded in {time.monotonic() - started:.0f}s",
                        flush=True,
                    )
            sessions = {}
            for db in ("base", "head"):
                c = psycopg.connect(cluster.dsn(db).replace("user=postgres", f"user={SERVICE_ROLE}"), autocommit=True)
                c.execute("SET synchronous_commit = off")
                row = c.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                sessions[db] = (c, int(row[0]))
            samples: dict[tuple[str, str], list[float]] = {}
            for name, (procedure, calls) in workloads.items():
                for c, _ in sessions.values():
                    c.execute(f"CALL {procedure}(%s)", (calls // 10,))  # type: ignore[arg-type]  # warm up
                for _ in range(args.runs):
                    for db, (c, pid) in sessions.items():
                        before = backend_cpu_ns(pid)
                        c.execute(f"CALL {procedure}(%s)", (calls,))  # type: ignore[arg-type]
                        samples.setdefault((name, db), []).append((backend_cpu_ns(pid) - before) / calls / 1000)
            for c, _ in sessions.values():
                c.close()
        finally:
            cluster.stop("fast")

    print(f"\nbackend CPU per transaction, median of {args.runs} runs (min..max), {args.rows:,} identities:")
    print(f"  {'workload':12s} {'base ' + args.base:>26s} {'this checkout':>26s} {'change':>8s}")
    for name in workloads:
        base, head = samples[(name, "base")], samples[(name, "head")]
        mb, mh = statistics.median(base), statistics.median(head)
        print(
            f"  {name:12s} {mb:9.1f} us ({min(base):5.1f}..{max(base):5.1f})"
            f" {mh:9.1f} us ({min(head):5.1f}..{max(head):5.1f}) {100 * (mh / mb - 1):+7.1f}%"
        )


if __name__ == "__main__":
    main()
