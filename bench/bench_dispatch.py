"""Dispatch throughput and commit -> delivery latency: pginbox's Dispatcher against pgqueuer.

Both run on the same private cluster (fsync on, PostgreSQL 15), in the same database (`bench`:
schema inbox from sql/, pgqueuer's schema from `pgq install`), in this process, one after the
other, never at the same time.

Throughput (drain): a backlog of N items is committed first, then the consumer drains it; the
rate is N / (time from start to the end): for pginbox the end is run_once() returning (every
completion committed); for pgqueuer it is its last job's handler call, because its drain mode
then takes ~4 s to notice the empty queue and stop (printed as its drain tail, not counted) -
which favours pgqueuer (its last completions are still buffered then).
  pginbox   N effects (inbox.enqueue_effect, destination 'noop'); Dispatcher(...).run_once() with a
            CallableTransport that does nothing. Effects are claimed (claim_effects, in batches),
            delivered by a few tasks per destination, and completed in batches by the
            Dispatcher's reporter thread (inbox.complete_effects, one statement per flush).
  batched   (not the Dispatcher) a loop in this file: claim_effects, then ONE statement completing
            the whole batch (inbox.complete_effects), single-threaded, no overlap of claims and
            reports: the SQL alone. (Until 2026-12-02 this was complete_effect over unnest.)
  pgqueuer  N jobs (Queries.enqueue, lists); PgQueuer instances, each on its own psycopg
            AsyncConnection (PsycopgDriver), run(batch_size=..., mode=drain) with an async
            entrypoint that does nothing: the setup of pgqueuer's own drain benchmark
            (tools/benchmark.py --strategy drain: 5 dequeue tasks, batch size 10), under uvloop
            as there. Completions are logged by its JobStatusLogBuffer.
  Every configuration runs in every round, in a random order per round; each is reported as the
  median over rounds, and the ratio is pginbox's best configuration over pgqueuer's best (each
  median).

Latency: a producer commits one item at a time at a steady rate (default 100/s) while the
consumer runs; latency is from the producer's COMMIT returning to the no-op handler being called
(same process, same clock). pginbox: Dispatcher.run() (LISTEN + idle registration + poll 1 s);
pgqueuer: run() in continuous mode (its per-insert NOTIFY trigger, dequeue_timeout 30 s).

Usage:
    .venv/bin/python bench/bench_dispatch.py [--effects 20000] [--rounds 3] [--rate 100] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from benchlib import ROOT, bench_database

from pginbox.dispatcher import Dispatcher, Effect
from pginbox.transports import CallableTransport

ENQUEUE_BACKLOG = (
    "SELECT count(inbox.enqueue_effect(%s || '-' || g, 'noop', '{\"n\": 1}'::jsonb))"
    " FROM generate_series(%s::integer, %s::integer) AS g"
)
ENQUEUE_ONE = "SELECT inbox.enqueue_effect(%s, 'noop', '{\"n\": 1}'::jsonb)"
DELIVERED = "SELECT count(*) FROM inbox.outbox WHERE status = 'delivered' AND effect_id LIKE %s"
CLAIM_IDS = "SELECT effect_id, lease_token FROM inbox.claim_effects(%s, %s, '30 seconds')"
COMPLETE_BATCH = (
    "SELECT count(*) FILTER (WHERE result = 'delivered')"
    " FROM inbox.complete_effects(%s::text[], %s::bigint[], NULL, NULL, NULL)"
)
RESET_OUTBOX = "TRUNCATE inbox.outbox, inbox.outbox_fenced_report"
PGQ_LEFT = "SELECT count(*) FROM pgqueuer"
PGQ_RESET = "TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics"


def checkpoint(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # pgqueuer's own benchmark runs under uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


# ------------------------------------------------------------------------------------- pginbox


@dataclass(frozen=True)
class PginboxConfig:
    batch_size: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"pginbox batch {self.batch_size}, concurrency {self.concurrency}"


def pginbox_enqueue(dsn: str, prefix: str, n: int, chunk: int = 20_000) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for lo in range(1, n + 1, chunk):
            conn.execute(ENQUEUE_BACKLOG, (prefix, lo, min(n, lo + chunk - 1)))


def pginbox_drain(dsn: str, n: int, config: PginboxConfig, tag: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RESET_OUTBOX)
    pginbox_enqueue(dsn, tag, n)
    checkpoint(dsn)
    transport = CallableTransport(lambda effect: None)
    dispatcher = Dispatcher(
        dsn,
        f"bench-{tag}",
        {"noop": transport},
        batch_size=config.batch_size,
        concurrency_per_destination=config.concurrency,
        extend_leases=False,
    )
    try:
        started = time.time()
        dispatcher.run_once()
        ended = time.time()
    finally:
        dispatcher.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(DELIVERED, (tag + "-%",)).fetchone()
    delivered = row[0] if row else 0
    if delivered != n:
        raise SystemExit(f"pginbox delivered {delivered} of {n}")
    return n / (ended - started)


def batched_reports_drain(dsn: str, n: int, batch_size: int, tag: str) -> float:
    """Not the Dispatcher: a bench-only loop on the same SQL functions that reports a whole claimed
    batch in ONE statement (inbox.complete_effects), single-threaded: the SQL alone."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RESET_OUTBOX)
    pginbox_enqueue(dsn, tag, n)
    checkpoint(dsn)
    done = 0
    started = time.time()
    with psycopg.connect(dsn, autocommit=True) as conn:
        while rows := conn.execute(CLAIM_IDS, ("bench-batched", batch_size)).fetchall():
            for _row in rows:
                pass  # the no-op delivery
            row = conn.execute(COMPLETE_BATCH, ([r[0] for r in rows], [r[1] for r in rows])).fetchone()
            done += row[0] if row else 0
    ended = time.time()
    if done != n:
        raise SystemExit(f"batched reports completed {done} of {n}")
    return n / (ended - started)


def pginbox_latency(dsn: str, rate: float, seconds: float) -> list[float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RESET_OUTBOX)
    committed: dict[str, float] = {}
    delivered: dict[str, float] = {}

    def record(effect: Effect) -> None:
        delivered[effect.effect_id] = time.perf_counter()

    dispatcher = Dispatcher(dsn, "bench-latency", {"noop": CallableTransport(record)})
    runner = threading.Thread(target=dispatcher.run, daemon=True)
    runner.start()
    time.sleep(1.0)  # let it go idle (registered, waiting)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            produce(rate, seconds, lambda i: _pginbox_commit_one(conn, i, committed))
        deadline = time.monotonic() + 10
        while len(delivered) < len(committed) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        dispatcher.stop()
        runner.join(timeout=10)
        dispatcher.close()
    return [delivered[k] - committed[k] for k in committed if k in delivered]


def _pginbox_commit_one(conn: psycopg.Connection[Any], i: int, committed: dict[str, float]) -> None:
    effect_id = f"lat-{i}"
    conn.execute(ENQUEUE_ONE, (effect_id,))  # autocommit: the statement is the transaction
    committed[effect_id] = time.perf_counter()


def produce(rate: float, seconds: float, commit_one: Callable[[int], None]) -> None:
    interval = 1.0 / rate
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        target = start + i * interval
        delay = target - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        commit_one(i)


BATCHED_LABEL = "(bench loop) pginbox SQL, batched reports"

# ------------------------------------------------------------------------------------- pgqueuer


@dataclass(frozen=True)
class PgqConfig:
    workers: int
    batch_size: int

    @property
    def label(self) -> str:
        return f"pgqueuer {self.workers} workers x batch {self.batch_size}"


def pgq_install(dsn: str) -> None:
    pgq = Path(sys.executable).parent / "pgq"
    done = subprocess.run([str(pgq), "--pg-dsn", dsn, "install"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pgq install failed:\n{done.stdout}\n{done.stderr}")


async def _pgq_connection(dsn: str) -> Any:
    from pgqueuer.db import PsycopgDriver

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    return conn, PsycopgDriver(conn)


async def _pgq_enqueue_backlog(dsn: str, n: int, chunk: int = 10_000) -> None:
    from pgqueuer.queries import Queries

    conn, driver = await _pgq_connection(dsn)
    try:
        queries = Queries(driver)
        for lo in range(0, n, chunk):
            size = min(chunk, n - lo)
            await queries.enqueue(["noop"] * size, [b'{"n": 1}'] * size, [0] * size)
    finally:
        await conn.close()


async def _pgq_drain(dsn: str, config: PgqConfig) -> tuple[float, float, int]:
    from pgqueuer import PgQueuer
    from pgqueuer.models import Job
    from pgqueuer.types import QueueExecutionMode

    done = 0
    last_job = 0.0
    managers = []
    conns = []
    for _ in range(config.workers):
        conn, driver = await _pgq_connection(dsn)
        conns.append(conn)
        pgq = PgQueuer(driver)

        @pgq.entrypoint("noop")
        async def noop(job: Job) -> None:
            nonlocal done, last_job
            done += 1
            last_job = time.time()

        managers.append(pgq)
    started = time.time()
    try:
        await asyncio.gather(*(m.run(batch_size=config.batch_size, mode=QueueExecutionMode.drain) for m in managers))
    finally:
        ended = time.time()
        for conn in conns:
            await conn.close()
    DRAIN_TAIL.append(ended - last_job)
    return started, last_job, done


DRAIN_TAIL: list[float] = []  # pgqueuer: seconds from its last job to run() returning (drain detection, flush)


def pgq_drain(dsn: str, n: int, config: PgqConfig) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PGQ_RESET)
    run_async(_pgq_enqueue_backlog(dsn, n))
    checkpoint(dsn)
    # The end is its last job's handler call, not run() returning: pgqueuer's drain mode takes
    # seconds to notice the empty queue and stop (DRAIN_TAIL), which is not delivery work. This
    # favours pgqueuer: its last completions are still in its status buffer at that moment.
    started, ended, done = run_async(_pgq_drain(dsn, config))
    assert isinstance(started, float) and isinstance(ended, float)
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute(PGQ_LEFT).fetchone()
    if done != n or (left and left[0]):
        raise SystemExit(f"pgqueuer ran {done} of {n} jobs, {left and left[0]} left in the queue")
    return n / (ended - started)


async def _pgq_latency(dsn: str, rate: float, seconds: float) -> list[float]:
    from pgqueuer import PgQueuer
    from pgqueuer.models import Job
    from pgqueuer.queries import Queries

    committed: dict[bytes, float] = {}
    delivered: dict[bytes, float] = {}
    consumer_conn, driver = await _pgq_connection(dsn)
    producer_conn, producer_driver = await _pgq_connection(dsn)
    pgq = PgQueuer(driver)

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        assert job.payload is not None
        delivered[job.payload] = time.perf_counter()

    runner = asyncio.create_task(pgq.run())
    await asyncio.sleep(1.0)
    queries = Queries(producer_driver)
    interval = 1.0 / rate
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = start + i * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        key = f"lat-{i}".encode()
        await queries.enqueue("noop", key)  # autocommit
        committed[key] = time.perf_counter()
    deadline = time.monotonic() + 10
    while len(delivered) < len(committed) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    pgq.shutdown.set()
    await asyncio.wait_for(runner, 30)
    await consumer_conn.close()
    await producer_conn.close()
    return [delivered[k] - committed[k] for k in committed if k in delivered]


def pgq_latency(dsn: str, rate: float, seconds: float) -> list[float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PGQ_RESET)
    result: list[float] = run_async(_pgq_latency(dsn, rate, seconds))
    return result


# ------------------------------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--effects", type=int, default=20_000, help="backlog size per drain (both systems)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0, help="latency: items committed per second")
    parser.add_argument("--seconds", type=float, default=5.0, help="latency: how long the producer runs")
    parser.add_argument(
        "--pginbox", default="100x8,200x16,500x32", help="pginbox configurations BATCHxCONCURRENCY, comma-separated"
    )
    parser.add_argument(
        "--pgqueuer",
        default="5x10,5x50,1x100",
        help="pgqueuer configurations WORKERSxBATCH, comma-separated (5x10: its own drain benchmark)",
    )
    parser.add_argument(
        "--batched-reports",
        type=int,
        default=100,
        metavar="BATCH",
        help="also run the bench-only batched-reports loop with this claim size (0: skip)",
    )
    parser.add_argument("--sql-dir", type=Path, default=ROOT / "sql", help="SQL modules to deploy (default: sql/)")
    args = parser.parse_args()

    pginbox_configs = [PginboxConfig(*map(int, c.split("x"))) for c in args.pginbox.split(",")]
    pgq_configs = [PgqConfig(*map(int, c.split("x"))) for c in args.pgqueuer.split(",")]
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    with bench_database(args.sql_dir, prefix="pginbox-bench-dispatch-") as (_cluster, dsn):
        pgq_install(dsn)
        from importlib.metadata import version

        print(
            f"pgqueuer {version('pgqueuer')} (psycopg driver), backlog {args.effects} per drain, {args.rounds} rounds"
        )
        results: dict[str, list[float]] = {}
        for rnd in range(1, args.rounds + 1):
            runs: list[tuple[str, Callable[[], float]]] = [
                (c.label, partial(pginbox_drain, dsn, args.effects, c, f"r{rnd}b{c.batch_size}c{c.concurrency}"))
                for c in pginbox_configs
            ]
            runs += [(c.label, partial(pgq_drain, dsn, args.effects, c)) for c in pgq_configs]
            if args.batched_reports:
                runs.append(
                    (BATCHED_LABEL, partial(batched_reports_drain, dsn, args.effects, args.batched_reports, f"r{rnd}q"))
                )
            random.shuffle(runs)
            for label, fn in runs:
                rate = fn()
                results.setdefault(label, []).append(rate)
                print(f"   round {rnd}: {label:<40} {rate:8.0f} items/s", flush=True)

        print("\nThroughput, no-op deliveries (median over rounds)")
        medians = {label: statistics.median(v) for label, v in results.items()}
        for label, value in medians.items():
            print(f"   {label:<40} {value:8.0f} items/s   (rounds: {', '.join(f'{x:.0f}' for x in results[label])})")
        best_pginbox = max((v, k) for k, v in medians.items() if k.startswith("pginbox batch"))
        best_pgq = max((v, k) for k, v in medians.items() if k.startswith("pgqueuer"))
        default_pgq = medians.get(PgqConfig(5, 10).label)
        print(
            f"   ratio pginbox best / pgqueuer best: {best_pginbox[0] / best_pgq[0]:.2f}x "
            f"({best_pginbox[1]} / {best_pgq[1]})"
        )
        if default_pgq:
            print(
                f"   ratio pginbox best / pgqueuer as in its drain benchmark (5x10): "
                f"{best_pginbox[0] / default_pgq:.2f}x"
            )
        print(
            f"   pgqueuer's drain tail (last job -> run() returned, NOT counted above): median "
            f"{statistics.median(DRAIN_TAIL) * 1000:.0f} ms, max {max(DRAIN_TAIL) * 1000:.0f} ms"
        )
        if BATCHED_LABEL in medians:
            batched = medians[BATCHED_LABEL]
            print(
                f"   not the Dispatcher: batched reports / pgqueuer best: {batched / best_pgq[0]:.2f}x, "
                f"/ pginbox Dispatcher best: {batched / best_pginbox[0]:.2f}x"
            )

        print(f"\nLatency commit -> delivery at {args.rate:g}/s for {args.seconds:g} s (one consumer each)")
        order = [("pginbox", pginbox_latency), ("pgqueuer", pgq_latency)]
        random.shuffle(order)
        lat: dict[str, list[float]] = {}
        for name, measure in order:
            lat[name] = measure(dsn, args.rate, args.seconds)
        for name in ("pginbox", "pgqueuer"):
            samples = lat[name]
            expected = int(args.rate * args.seconds)
            print(
                f"   {name:<9} p50 {percentile(samples, 0.5) * 1000:7.2f} ms   p99 "
                f"{percentile(samples, 0.99) * 1000:7.2f} ms   max {max(samples) * 1000:7.2f} ms   "
                f"({len(samples)} of {expected} delivered)"
            )
        p50 = percentile(lat["pginbox"], 0.5) / percentile(lat["pgqueuer"], 0.5)
        p99 = percentile(lat["pginbox"], 0.99) / percentile(lat["pgqueuer"], 0.99)
        print(f"   ratio pginbox / pgqueuer: p50 {p50:.2f}x, p99 {p99:.2f}x (below 1: pginbox is faster)")


if __name__ == "__main__":
    main()
