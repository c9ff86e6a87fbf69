"""Acks after the standby (issue 24): `pginbox consume` (RabbitMQ, SQL handler, batches of 50)
with durability `standby` against the same with `commit`, on a private primary (fsync on) with a
local streaming standby (pg_basebackup -R, asynchronous), in one run.

    commit    ack after COMMIT on the primary
    standby   ack once the standby reports the batch's commit flushed (inbox.wait_durable, one
              statement per batch)
    ratio     standby / commit (target >= 0.7: the wait is per batch, not per message)

Workloads are interleaved over --rounds rounds; the median of each is reported. The machine may be
shared: the figures are for comparison within one run, not absolute.
Usage:  .venv/bin/python bench/bench_failover.py [--messages 5000] [--rounds 3]
RabbitMQ: PGINBOX_BENCH_RABBITMQ_URL (amqp://guest:guest@127.0.0.1:5672/); its queues are deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import psycopg
from bench_brokers import SETUP, Place
from benchlib import bench_database
from psycopg.conninfo import make_conninfo

from pginbox.consumer import Consumer, load_consume_config
from pginbox.devtools.cluster import SERVICE_USER, Cluster


def start_standby(primary: Cluster, directory: Path) -> Cluster:
    """A streaming standby of `primary` (application_name bench_standby), started."""
    directory.mkdir(mode=0o700)
    as_service = ["runuser", "-u", SERVICE_USER, "--"] if os.geteuid() == 0 else []
    if os.geteuid() == 0:
        shutil.chown(directory, SERVICE_USER, SERVICE_USER)
    subprocess.run(
        [
            *as_service,
            str(primary.bindir / "pg_basebackup"),
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(directory),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
        ],
        check=True,
        capture_output=True,
        cwd="/",
    )
    (directory / "postmaster.pid").unlink(missing_ok=True)
    (directory / "pginbox.conf").unlink(missing_ok=True)
    conninfo = make_conninfo(
        host="127.0.0.1", port=str(primary.port), user="postgres", application_name="bench_standby"
    )
    with (directory / "postgresql.auto.conf").open("a") as fh:
        fh.write(f"primary_conninfo = '{conninfo}'\n")
    standby = Cluster(directory)
    standby.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with psycopg.connect(primary.dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'").fetchone()
        if row and row[0] == 1:
            return standby
        time.sleep(0.2)
    raise SystemExit("the standby does not stream")


def consume(dsn: str, n: int, durability: str) -> float:
    place = Place("rabbitmq")
    consumer = f"{durability}_{uuid.uuid4().hex[:6]}"
    asyncio.run(place.preload(n))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT inbox.register_handler(%s, 'credit', 'credit(jsonb)'::regprocedure, 'v1')", (consumer,)
            )
        settings = {
            "url": place.url,
            "consumer": consumer,
            "prefetch": 50,
            "queue": place.name,
            "durability": durability,
        }
        if durability == "standby":
            settings["standby_names"] = "bench_standby"
        worker = Consumer(load_consume_config(None, settings), dsn, fetch_timeout=0.2)
        started = time.perf_counter()
        thread = threading.Thread(target=lambda: asyncio.run(worker.run()), daemon=True)
        thread.start()
        while sum(worker.stats.outcomes.values()) < n:
            time.sleep(0.005)
            if not thread.is_alive():
                raise SystemExit("the consumer stopped early")
        elapsed = time.perf_counter() - started
        worker.stop()
        thread.join(30)
        if worker.stats.not_durable:
            print(f"  ({worker.stats.not_durable} batches not confirmed in time, handed back)")
        return n / elapsed
    finally:
        asyncio.run(place.delete())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"commit": [], "standby": []}
    with bench_database() as (cluster, dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP)
        standby = start_standby(cluster, cluster.datadir.parent / "standby")
        try:
            for round_no in range(1, args.rounds + 1):
                for mode in ("commit", "standby"):
                    rate = consume(dsn, args.messages, mode)
                    results[mode].append(rate)
                    print(f"round {round_no} {mode:8s} {rate:9.0f} msg/s", flush=True)
        finally:
            standby.stop("fast")
    median = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmedian  commit {median['commit']:.0f} msg/s  standby {median['standby']:.0f} msg/s")
    print(f"ratio   standby / commit = {median['standby'] / median['commit']:.2f}  (target >= 0.7)")


if __name__ == "__main__":
    main()
