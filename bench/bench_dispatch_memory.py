"""Resident memory of `pginbox dispatch --once` while it drains a backlog of 200k effects.

A private cluster (fsync on) gets the SQL modules of sql/ and a backlog of N effects (destination
'noop', committed in chunks of 20k) before the dispatcher starts. Then `pginbox dispatch --once`
runs as a subprocess with a Python-callable destination that does nothing (`--callable
noop=MODULE:deliver`, a module written to a temporary directory), and this script samples its
VmRSS from /proc/<pid>/status every 50 ms until it exits, and the delivered count every second.

  start   RSS when the first effect was delivered (imports done, pool and LISTEN connected)
  peak    the highest sample
  end     the last sample before the process exited
  growth  peak - start (target: < 50 MB: the dispatcher streams batches, it never loads the backlog)

Usage:
    .venv/bin/python bench/bench_dispatch_memory.py [--effects 200000] [--batch-size 100] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from benchlib import ROOT, bench_database

ENQUEUE_BACKLOG = (
    "SELECT count(inbox.enqueue_effect('mem-' || g, 'noop', jsonb_build_object('n', g, 'pad', repeat('x', 200))))"
    " FROM generate_series(%s::integer, %s::integer) AS g"
)
COUNTS = "SELECT count(*) FILTER (WHERE status = 'delivered'), count(*) FROM inbox.outbox"
SINK = "def deliver(effect):\n    return None\n"


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def mib(kib: int) -> str:
    return f"{kib / 1024:7.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--effects", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sql-dir", type=Path, default=ROOT / "sql", help="SQL modules to deploy (default: sql/)")
    args = parser.parse_args()

    with (
        bench_database(args.sql_dir, prefix="pginbox-bench-memory-") as (_cluster, dsn),
        tempfile.TemporaryDirectory(prefix="pginbox-bench-sink-") as sink_dir,
    ):
        Path(sink_dir, "bench_noop_sink.py").write_text(SINK, encoding="utf-8")
        started = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for lo in range(1, args.effects + 1, 20_000):
                conn.execute(ENQUEUE_BACKLOG, (lo, min(args.effects, lo + 19_999)))
            conn.execute("VACUUM ANALYZE inbox.outbox")
            conn.execute("CHECKPOINT")
        print(f"backlog: {args.effects} effects committed in {time.monotonic() - started:.1f} s")

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [sink_dir, os.environ.get("PYTHONPATH")])))
        command = [
            str(Path(sys.executable).parent / "pginbox"),
            "dispatch",
            "--once",
            "--dsn",
            dsn,
            "--name",
            "bench-memory",
            "--callable",
            "noop=bench_noop_sink:deliver",
            "--batch-size",
            str(args.batch_size),
            "--concurrency",
            str(args.concurrency),
        ]
        print("running: " + " ".join(command[:3]) + " --dsn ... " + " ".join(command[5:]))
        samples: list[tuple[float, int]] = []
        progress: list[tuple[float, int]] = []  # (time, delivered)
        done = threading.Event()

        def watch_progress(conn: psycopg.Connection[tuple[int, int]]) -> None:
            while not done.wait(1.0):
                row = conn.execute(COUNTS).fetchone()
                if row is not None:
                    progress.append((time.monotonic(), row[0]))

        t0 = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as progress_conn:
            log_path = Path(sink_dir, "dispatch.log")  # its log lines (one per delivery): a file, never a pipe
            log_file = log_path.open("w", encoding="utf-8")
            proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log_file)
            watcher = threading.Thread(target=watch_progress, args=(progress_conn,), daemon=True)
            watcher.start()
            first_delivery: float | None = None
            while proc.poll() is None:
                kib = rss_kib(proc.pid)
                now = time.monotonic()
                if kib is not None:
                    samples.append((now, kib))
                if first_delivery is None and progress and progress[-1][1] > 0:
                    first_delivery = progress[-1][0]
                time.sleep(0.05)
            elapsed = time.monotonic() - t0
            done.set()
            watcher.join()
            log_file.close()
            stderr = log_path.read_text(encoding="utf-8", errors="replace")
            row = progress_conn.execute(COUNTS).fetchone()
        delivered = row[0] if row else 0
        if proc.returncode != 0:
            raise SystemExit(f"pginbox dispatch exited with {proc.returncode}:\n{stderr[-2000:]}")
        if not samples:
            raise SystemExit("no RSS samples")
        # Start: the first sample after the first delivery was seen (imports and connections done).
        after = [kib for t, kib in samples if first_delivery is not None and t >= first_delivery]
        start = after[0] if after else samples[0][1]
        peak = max(kib for _t, kib in samples)
        end = samples[-1][1]
        print(
            f"delivered {delivered} of {args.effects} in {elapsed:.1f} s ({delivered / elapsed:.0f}/s), "
            f"{len(samples)} RSS samples"
        )
        quarter = [samples[int(i * (len(samples) - 1) / 4)][1] for i in range(5)]
        print("   RSS at 0/25/50/75/100% of the run: " + " / ".join(mib(k).strip() for k in quarter))
        print(f"   start  {mib(start)}   (first sample after the first delivery)")
        print(f"   peak   {mib(peak)}")
        print(f"   end    {mib(end)}")
        growth = peak - start
        verdict = "met" if growth < 50 * 1024 else "MISSED"
        print(f"   growth {mib(growth)}   (peak - start; target < 50 MiB: {verdict})")
        if delivered != args.effects:
            raise SystemExit(f"only {delivered} of {args.effects} effects were delivered by dispatch --once")


if __name__ == "__main__":
    main()
