"""Python client throughput against hand-written psycopg code, measured in the same run (issue 3).

Starts a private cluster (fsync on), deploys sql/*.sql with psql, and runs each workload with
--workers threads sharing one psycopg_pool.ConnectionPool of --workers connections; each message
takes a connection from the pool. Messages per second, medians over interleaved rounds:

  article       hand-written psycopg issuing the article's statements: BEGIN; INSERT INTO
                consumer_inbox ... ON CONFLICT DO NOTHING RETURNING; UPDATE account; UPDATE
                consumer_inbox SET processed_at; COMMIT (payload hash computed in Python)
  handle        Inbox.handle with a Python handler running the same UPDATE account (default
                pipeline=None: the server is local, so BEGIN is a round trip of its own)
  handle_pl     the same with Inbox(pipeline=True): BEGIN and inbox.claim in one round trip,
                psycopg pipeline mode (the default to a server on another machine)
  apply         Inbox.apply: inbox.claim_and_apply with a PL/pgSQL handler running that UPDATE
  handle_batch  Inbox.handle_batch, --batch messages per call, same Python handler
  apply_batch   Inbox.apply_batch, --batch messages per call

Targets (issue 3): handle / article >= 1.0, apply_batch / handle >= 3.0. CPU per message is
reported too (this process's CPU time; the pool's backends' CPU time from /proc), because on a
busy machine it is steadier than messages per second.
Usage:  .venv/bin/python bench/bench_python.py [--seconds 8] [--rounds 3] [--workers 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from benchlib import ROOT, bench_database
from psycopg_pool import ConnectionPool

from pginbox import Inbox, Message, Outcome

ACCOUNTS = 100_000

SETUP = """
CREATE TABLE account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO account (id) SELECT g FROM generate_series(1, 100000) g;
CREATE TABLE consumer_inbox (
  consumer_name text NOT NULL, producer_name text NOT NULL, message_id text NOT NULL,
  payload_sha256 text NOT NULL, received_at timestamptz NOT NULL DEFAULT now(),
  processed_at timestamptz, handler_version text NOT NULL,
  PRIMARY KEY (consumer_name, producer_name, message_id));
CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  UPDATE account SET balance = balance + (payload->>'amount')::bigint WHERE id = (payload->>'account')::integer;
END $$;
SELECT inbox.register_handler('bench', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
"""

ARTICLE_CLAIM = """
INSERT INTO consumer_inbox (consumer_name, producer_name, message_id, payload_sha256, handler_version)
VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING message_id
"""
ARTICLE_DONE = """
UPDATE consumer_inbox SET processed_at = now()
 WHERE consumer_name = %s AND producer_name = %s AND message_id = %s
"""
UPDATE_ACCOUNT = "UPDATE account SET balance = balance + %s WHERE id = %s"


def credit(cur: psycopg.Cursor[Any], message: Message) -> None:
    cur.execute(UPDATE_ACCOUNT, (message.payload["amount"], message.payload["account"]))


def backend_cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the given server processes (Linux /proc), 0 where unreadable."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class Workload:
    """Runs `step(worker, rng, serial) -> messages done` in `workers` threads for `seconds`;
    returns messages per second and the client's and the pool backends' CPU per message."""

    def __init__(self, workers: int, seconds: float, backend_pids: list[int]) -> None:
        self.workers = workers
        self.seconds = seconds
        self.runs = 0  # part of every message id: each run delivers new messages
        self.backend_pids = backend_pids

    def run(self, step: Callable[[int, random.Random, int], int]) -> tuple[float, float, float]:
        self.runs += 1
        counts = [0] * self.workers
        errors: list[BaseException] = []
        start = threading.Barrier(self.workers + 1)
        stop = threading.Event()

        def worker(w: int) -> None:
            rng = random.Random(w)
            serial = self.runs * 1_000_000_000
            try:
                start.wait()
                while not stop.is_set():
                    counts[w] += step(w, rng, serial)
                    serial += 1
            except BaseException as exc:  # reported below
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(self.workers)]
        for t in threads:
            t.start()
        start.wait()
        began = time.perf_counter()
        client0 = time.process_time()
        server0 = backend_cpu_seconds(self.backend_pids)
        time.sleep(self.seconds)
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - began
        client = time.process_time() - client0
        server = backend_cpu_seconds(self.backend_pids) - server0
        if errors:
            raise errors[0]
        done = max(sum(counts), 1)
        return sum(counts) / elapsed, client / done * 1e6, server / done * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=50, help="messages per apply_batch / handle_batch call")
    parser.add_argument("--only", nargs="*", help="run only these workloads")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--sql-dir", type=Path, default=ROOT / "sql", help="SQL modules to deploy (sorted *.sql)")
    args = parser.parse_args()

    run_id = uuid.uuid4().hex[:8]
    applied_counter = {"n": 0}
    lock = threading.Lock()

    with bench_database(args.sql_dir, prefix="pginbox-bench-py-") as (_cluster, dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP)
            # 0.2.0: the consumer is bound to the role that runs it, as in production (an unbound
            # superuser takes the slower refusal path of the authorization check before its bypass).
            conn.execute(
                "DO $$ BEGIN"
                " IF to_regprocedure('inbox.bind_consumer(text, regrole, text[], text)') IS NOT NULL THEN"
                " PERFORM inbox.bind_consumer('bench', current_user::regrole, note => 'benchmark');"
                " END IF; END $$"
            )
            conn.execute("VACUUM ANALYZE")

        with ConnectionPool(dsn, min_size=args.workers, max_size=args.workers, open=False) as pool:
            pool.wait()
            inbox = Inbox(pool, consumer="bench", handler_version="v1")
            inbox_pl = Inbox(pool, consumer="bench", handler_version="v1", pipeline=True)
            inbox.check_schema()
            inbox_pl.check_schema()
            pids: list[int] = []
            held = [pool.getconn() for _ in range(args.workers)]
            pids = [c.info.backend_pid for c in held]
            for c in held:
                pool.putconn(c)
            load = Workload(args.workers, args.seconds, pids)

            def message(w: int, rng: random.Random, serial: int, tag: str, k: int = 0) -> Message:
                return Message(
                    "shop",
                    f"{run_id}-{tag}-{w}-{serial}-{k}",
                    "credit",
                    {"account": rng.randint(1, ACCOUNTS), "amount": 1},
                )

            def count_applied(results: list[Any]) -> int:
                n = sum(1 for r in results if r.outcome is Outcome.APPLIED)
                if n != len(results):
                    raise SystemExit(f"unexpected outcomes: {[r.outcome for r in results][:5]}")
                with lock:
                    applied_counter["n"] += n
                return n

            def article(w: int, rng: random.Random, serial: int) -> int:
                m = message(w, rng, serial, "article")
                digest = hashlib.sha256(
                    json.dumps(m.payload, sort_keys=True, separators=(",", ":")).encode()
                ).hexdigest()
                with pool.connection() as conn:
                    row = conn.execute(ARTICLE_CLAIM, ("bench", m.producer, m.message_id, digest, "v1")).fetchone()
                    if row is not None:
                        conn.execute(UPDATE_ACCOUNT, (m.payload["amount"], m.payload["account"]))
                        conn.execute(ARTICLE_DONE, ("bench", m.producer, m.message_id))
                    conn.commit()
                with lock:
                    applied_counter["n"] += 1
                return 1

            def handle(w: int, rng: random.Random, serial: int) -> int:
                return count_applied([inbox.handle(message(w, rng, serial, "handle"), credit)])

            def handle_pl(w: int, rng: random.Random, serial: int) -> int:
                return count_applied([inbox_pl.handle(message(w, rng, serial, "handle_pl"), credit)])

            def apply(w: int, rng: random.Random, serial: int) -> int:
                return count_applied([inbox.apply(message(w, rng, serial, "apply"))])

            def apply_batch(w: int, rng: random.Random, serial: int) -> int:
                batch = [message(w, rng, serial, "apply_batch", k) for k in range(args.batch)]
                return count_applied(inbox.apply_batch(batch))

            def handle_batch(w: int, rng: random.Random, serial: int) -> int:
                batch = [message(w, rng, serial, "handle_batch", k) for k in range(args.batch)]
                return count_applied(inbox.handle_batch(batch, credit))

            workloads: dict[str, Callable[[int, random.Random, int], int]] = {
                "article": article,
                "handle": handle,
                "handle_pl": handle_pl,
                "apply": apply,
                "handle_batch": handle_batch,
                "apply_batch": apply_batch,
            }
            if args.only:
                workloads = {k: v for k, v in workloads.items() if k in args.only}
            samples: dict[str, list[float]] = {name: [] for name in workloads}
            cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in workloads}
            for rnd in range(args.rounds):
                for name, step in workloads.items():
                    rate, client_us, server_us = load.run(step)
                    samples[name].append(rate)
                    cpu[name].append((client_us, server_us))
                    print(
                        f"round {rnd + 1}: {name:13s} {rate:9.0f} msgs/s   CPU per message: "
                        f"client {client_us:5.0f} us, server {server_us:5.0f} us",
                        flush=True,
                    )
            stats = inbox.stats

        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT (SELECT sum(balance) FROM account),"
                " (SELECT count(*) FROM inbox.message) + (SELECT count(*) FROM consumer_inbox)"
            ).fetchone()
            assert row is not None
            if not (row[0] == row[1] == applied_counter["n"]):
                raise SystemExit(
                    f"invariant broken: balance sum {row[0]}, claims {row[1]}, applied {applied_counter['n']}"
                )

    med = {name: statistics.median(v) for name, v in samples.items()}
    ratios: dict[str, float] = {}
    if "handle" in med and "article" in med:
        ratios["handle / article"] = med["handle"] / med["article"]
    if "handle_pl" in med and "article" in med:
        ratios["handle_pl / article"] = med["handle_pl"] / med["article"]
    if "apply_batch" in med and "handle" in med:
        ratios["apply_batch / handle"] = med["apply_batch"] / med["handle"]
    if "apply" in med and "article" in med:
        ratios["apply / article"] = med["apply"] / med["article"]
    if "handle_batch" in med and "handle" in med:
        ratios["handle_batch / handle"] = med["handle_batch"] / med["handle"]
    targets = {"handle / article": 1.0, "handle_pl / article": 1.0, "apply_batch / handle": 3.0}
    print()
    print(
        f"medians over {args.rounds} rounds of {args.seconds:g}s, {args.workers} worker threads, "
        f"one pool of {args.workers} connections, batch {args.batch}:"
    )
    for name, value in med.items():
        client_us = statistics.median(c for c, _ in cpu[name])
        server_us = statistics.median(s for _, s in cpu[name])
        print(
            f"  {name:13s} {value:9.0f} msgs/s   CPU per message: client {client_us:5.0f} us, "
            f"server backends {server_us:5.0f} us"
        )
    print("ratios:")
    for name, value in ratios.items():
        target = targets.get(name)
        verdict = "" if target is None else (f"  target >= {target}: " + ("met" if value >= target else "MISSED"))
        print(f"  {name:22s} {value:5.2f}x{verdict}")
    print(
        f"checked: balance sum = claims = applied = {applied_counter['n']}; "
        f"Inbox retries {stats.retries}, lock wait {stats.lock_wait_seconds:.3f}s"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"medians": med, "ratios": ratios, "args": vars(args) | {"json": None}}, indent=2, default=str)
        )


if __name__ == "__main__":
    main()
