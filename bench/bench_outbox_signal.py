"""Cost of the outbox wake-up signal on commit throughput, and the wake-up latency it buys.

NOTIFY takes a cluster-wide lock at commit and holds it through the commit's WAL flush, so
transactions that notify commit one at a time. inbox.enqueue_effect therefore notifies only when
a dispatcher is registered idle (inbox.dispatcher_idle): one probe of the (usually empty) waiter
table per enqueue, and the first enqueue that finds a waiter deletes the registrations and queues
one NOTIFY: one notifying transaction per idle period.

Every workload runs the same transaction with pgbench (-M prepared, 8 clients by default) on a
private cluster with fsync on, as a LOGIN role holding only inbox_consumer, bound to consumer
'bench' and destination 'webhook' (authorization on, as in production):
    BEGIN; UPDATE account (one row); <record the effect>; COMMIT
  plain          the effect inserted into a plain outbox table (primary key, one partial index
                 for the pending effects): the baseline
  enqueue        inbox.enqueue_effect as shipped, no dispatcher idle (a busy system)
  notify-always  inbox.enqueue_effect, then pg_notify in every transaction
  signal-idle    as shipped, while a dispatcher re-registers idle the moment each wake-up
                 arrives and never works: every idle period ends with one NOTIFY (worst case)
  signal-drain   as shipped, while a real dispatcher loop claims and completes the effects
                 (it also loads the server, so this ratio includes its work, not only the signal)
A listener counts the notifications each run sent.

Then the wake-up latency: one dispatcher waits idle (LISTEN, poll timeout 1 s), a client commits
one effect at a time, and the time from the COMMIT's return to the claim's return is measured.

Each round runs every workload next to a baseline run of its own, in random order (the outbox
is emptied and a checkpoint taken before each run); the median of the per-pair ratios is
reported, which keeps a busy machine's drift out of the ratio. The CPU cost of the signal check
is also measured directly: microseconds per effect in one session, without commits (plain insert
vs inbox.enqueue_effect).
Usage:
    .venv/bin/python bench/bench_outbox_signal.py [--seconds 6] [--rounds 5] [--clients 8]
        [--only enqueue notify-always signal-idle signal-drain] [--wakeups 300 (0: not measured)]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from benchlib import SERVICE_ROLE, bench_database, create_service_role, run_pgbench

ACCOUNTS = 100_000

# The baseline's plain outbox table and the destination the enqueues go to (bench_cpu_ab.py uses
# them too).
OUTBOX_SETUP = """
CREATE SCHEMA bench;
CREATE TABLE bench.plain_outbox (
    effect_id text NOT NULL, consumer text NOT NULL, destination text NOT NULL, payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}', ordering_key text, status text NOT NULL DEFAULT 'pending',
    attempts integer NOT NULL DEFAULT 0, available_at timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (effect_id, consumer));
CREATE INDEX plain_outbox_due ON bench.plain_outbox (available_at) WHERE status = 'pending';
SELECT inbox.bind_destination('webhook', 'bench', 'benchmark');
"""
SETUP = (
    """
CREATE TABLE account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO account (id) SELECT g FROM generate_series(1, %(accounts)s) g;
"""
    + OUTBOX_SETUP
)

GRANTS = """
GRANT SELECT, UPDATE ON account TO {role};
GRANT USAGE ON SCHEMA bench TO {role};
GRANT INSERT ON bench.plain_outbox TO {role};
"""

RECORD = {
    "plain": "INSERT INTO bench.plain_outbox (effect_id, consumer, destination, payload)"
    " VALUES (:client_id::text || '-' || :fid::text, 'bench', 'webhook',"
    " jsonb_build_object('account', :aid::integer, 'amount', 1));",
    "enqueue": "SELECT inbox.enqueue_effect(:client_id::text || '-' || :fid::text, 'webhook',"
    " jsonb_build_object('account', :aid::integer, 'amount', 1), consumer => 'bench');",
}
RECORD["notify-always"] = RECORD["enqueue"] + "\nSELECT pg_notify('inbox_outbox', '');"
RECORD["signal-idle"] = RECORD["enqueue"]
RECORD["signal-drain"] = RECORD["enqueue"]

SCRIPT = """
\\set aid random(1, {accounts})
\\set fid random(1, 1152921504606846976)
BEGIN;
UPDATE account SET balance = balance + 1 WHERE id = :aid;
{record}
COMMIT;
"""


class Background:
    """A loop run in a thread until stop(); `count` is what the loop reports."""

    def __init__(self, loop: Callable[[threading.Event, list[int]], None]) -> None:
        self._stop = threading.Event()
        self._count = [0]
        self._error: BaseException | None = None

        def guarded() -> None:
            try:
                loop(self._stop, self._count)
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=guarded, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._error is not None:
            raise self._error
        return self._count[0]


def listener(dsn: str) -> Callable[[threading.Event, list[int]], None]:
    """Counts the notifications on channel inbox_outbox (and keeps the queue drained)."""

    def loop(stop: threading.Event, count: list[int]) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("LISTEN inbox_outbox")
            while not stop.is_set():
                for _ in conn.notifies(timeout=0.2):
                    count[0] += 1

    return loop


def lazy_dispatcher(dsn: str) -> Callable[[threading.Event, list[int]], None]:
    """Worst case for the throttle: registers idle again the moment a wake-up arrives, never works."""

    def loop(stop: threading.Event, count: list[int]) -> None:
        with psycopg.connect(dsn, autocommit=True) as listen, psycopg.connect(dsn, autocommit=True) as work:
            listen.execute("LISTEN inbox_outbox")
            while not stop.is_set():
                work.execute("SELECT inbox.dispatcher_idle('bench-lazy', true)")
                for _ in listen.notifies(timeout=0.2, stop_after=1):
                    count[0] += 1
            work.execute("SELECT inbox.dispatcher_idle('bench-lazy', false)")

    return loop


class Dispatcher:
    """The dispatcher protocol: claim while there is work (a claim that gets something unregisters
    the dispatcher). When a claim finds nothing: register idle; claim once more (catch-up: what
    committed before the registration sent no signal); then wait for a notification, claiming
    again after each wait, with waits growing from `settle` seconds up to the poll timeout (an
    enqueuing transaction that looked for idle dispatchers just before the registration and
    became visible just after the catch-up claim sent no signal either: its commit is found by
    one of the early claims)."""

    def __init__(self, dsn: str, name: str, batch: int = 100, poll_timeout: float = 1.0, settle: float = 0.02) -> None:
        self.listen = psycopg.connect(dsn, autocommit=True)
        self.work = psycopg.connect(dsn, autocommit=True)
        self.listen.execute("LISTEN inbox_outbox")
        self.name = name
        self.batch = batch
        self.poll_timeout = poll_timeout
        self.settle = settle
        self.idle_wait = settle

    def close(self) -> None:
        self.work.execute("SELECT inbox.dispatcher_idle(%s, false)", (self.name,))  # on shutdown
        self.listen.close()
        self.work.close()

    def claim_and_complete(self, on_claim: Callable[[list[str]], None] | None = None) -> int:
        rows = self.work.execute(
            "SELECT effect_id, lease_token FROM inbox.claim_effects(%s, %s)", (self.name, self.batch)
        ).fetchall()
        if rows and on_claim is not None:
            on_claim([r[0] for r in rows])
        if rows:
            self.work.execute(
                "SELECT count(inbox.complete_effect(e, t, 200)) FROM unnest(%s::text[], %s::bigint[]) AS c(e, t)",
                ([r[0] for r in rows], [r[1] for r in rows]),
            )
        return len(rows)

    def wait(self, timeout: float) -> bool:
        return any(True for _ in self.listen.notifies(timeout=timeout, stop_after=1))

    def step(self, on_claim: Callable[[list[str]], None] | None = None) -> int:
        done = self.claim_and_complete(on_claim)
        if done:
            self.idle_wait = self.settle
            return done
        if self.idle_wait == self.settle:  # just went idle
            self.work.execute("SELECT inbox.dispatcher_idle(%s, true)", (self.name,))
            done = self.claim_and_complete(on_claim)  # catch-up
            if done:
                return done  # claim_effects unregistered us
        if self.wait(self.idle_wait):
            self.idle_wait = self.settle
        else:
            self.idle_wait = min(self.idle_wait * 2, self.poll_timeout)
        return 0


def draining_dispatcher(dsn: str) -> Callable[[threading.Event, list[int]], None]:
    def loop(stop: threading.Event, count: list[int]) -> None:
        dispatcher = Dispatcher(dsn, "bench-drain")
        try:
            while not stop.is_set():
                count[0] += dispatcher.step()
        finally:
            dispatcher.close()

    return loop


def measure_wakeup(dsn: str, samples: int) -> list[float]:
    """Milliseconds from an enqueue's COMMIT returning to an idle dispatcher's claim returning."""
    claimed: dict[str, float] = {}
    arrived = threading.Condition()

    def on_claim(ids: list[str]) -> None:
        now = time.perf_counter()
        with arrived:
            for effect_id in ids:
                claimed[effect_id] = now
            arrived.notify_all()

    stop = threading.Event()
    run_id = time.time_ns()
    dispatcher = Dispatcher(dsn, "bench-latency")

    def run() -> None:
        while not stop.is_set():
            dispatcher.step(on_claim)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    latencies: list[float] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as producer:
            for i in range(samples):
                time.sleep(random.uniform(0.01, 0.03))  # the dispatcher is idle again, blocked in LISTEN
                effect_id = f"wake-{run_id}-{i}"
                producer.execute("BEGIN")
                producer.execute("SELECT inbox.enqueue_effect(%s, 'webhook', '{}', consumer => 'bench')", (effect_id,))
                producer.execute("COMMIT")
                committed = time.perf_counter()
                with arrived:
                    if not arrived.wait_for(functools.partial(claimed.__contains__, effect_id), timeout=5):
                        raise SystemExit(f"{effect_id} was not claimed within 5 s")
                latencies.append(max(claimed[effect_id] - committed, 0.0) * 1000)
    finally:
        stop.set()
        thread.join(timeout=10)
        dispatcher.close()
    return latencies


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def cpu_per_call(dsn: str, workload: str, calls: int, repeats: int) -> float:
    """Microseconds per effect in one session, `calls` effects in one statement (one commit's fsync
    spread over many calls): the CPU cost. The median of `repeats` batches."""
    statement = {
        "plain": "INSERT INTO bench.plain_outbox (effect_id, consumer, destination, payload)"
        " SELECT 'cpu-' || %s || '-' || g, 'bench', 'webhook', jsonb_build_object('n', g)"
        " FROM generate_series(1, %s) g",
        "enqueue": "SELECT count(inbox.enqueue_effect('cpu-' || %s || '-' || g, 'webhook', jsonb_build_object('n', g),"
        " consumer => 'bench')) FROM generate_series(1, %s) g",
    }[workload]
    timings = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for r in range(repeats):
            conn.execute("TRUNCATE inbox.outbox, bench.plain_outbox")
            start = time.perf_counter()
            conn.execute(statement, (r, calls))  # type: ignore[arg-type]
            timings.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=6, help="duration of each pgbench run")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each pairs every workload with a baseline run")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--wakeups", type=int, default=300, help="samples of the wake-up latency")
    parser.add_argument("--cpu-calls", type=int, default=20000, help="enqueues per batch of the CPU measurement")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    all_workloads = ["enqueue", "notify-always", "signal-idle", "signal-drain"]
    parser.add_argument(
        "--only",
        nargs="+",
        choices=all_workloads,
        default=all_workloads,
        help="workloads to pair with the baseline (default: all)",
    )
    args = parser.parse_args()

    workloads = [name for name in all_workloads if name in args.only]
    tps: dict[str, list[float]] = {name: [] for name in ["plain", *workloads]}
    pair_ratios: dict[str, list[float]] = {name: [] for name in workloads}
    notifies: dict[str, list[float]] = {name: [] for name in ["plain", *workloads]}
    with bench_database() as (cluster, dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP % {"accounts": ACCOUNTS})  # type: ignore[arg-type]
            create_service_role(dsn, "bench", GRANTS)
            conn.execute("VACUUM ANALYZE")
        helpers: dict[str, Callable[[threading.Event, list[int]], None]] = {
            "signal-idle": lazy_dispatcher(dsn),
            "signal-drain": draining_dispatcher(dsn),
        }

        def run(name: str) -> float:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("TRUNCATE inbox.outbox, inbox.outbox_waiter, bench.plain_outbox")
                conn.execute("CHECKPOINT")
            listening = Background(listener(dsn))
            helper = Background(helpers[name]) if name in helpers else None
            time.sleep(0.3)
            result = run_pgbench(
                cluster,
                SCRIPT.format(accounts=ACCOUNTS, record=RECORD[name]),
                args.clients,
                args.seconds,
                user=SERVICE_ROLE,
                max_tries=None,
            )
            delivered = helper.stop() if helper else 0
            sent = listening.stop()
            tps[name].append(result)
            notifies[name].append(sent / (result * args.seconds))
            extra = f", dispatcher delivered {delivered}" if name == "signal-drain" else ""
            print(f"  {name:14s} {result:8.0f} tps, {sent:7d} notifications{extra}", flush=True)
            return result

        # Each workload runs next to a baseline run, in random order: the machine's drift
        # (other load, checkpoints, autovacuum) hits both halves of a pair alike.
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}:", flush=True)
            for name in workloads:
                order = random.sample(["plain", name], 2)
                got = {n: run(n) for n in order}
                pair_ratios[name].append(got[name] / got["plain"])

        print("CPU per enqueue (one session, no commit in the measurement):", flush=True)
        cpu: dict[str, list[float]] = {"plain": [], "enqueue": []}
        for _ in range(3):
            for name in cpu:
                cpu[name].append(cpu_per_call(dsn, name, args.cpu_calls, 3))
        cpu_med = {name: statistics.median(v) for name, v in cpu.items()}
        with psycopg.connect(dsn, autocommit=True) as conn:
            # The CPU measurement left its last batch pending: a dispatcher would work through
            # those before it reached the first effect whose wake-up is timed.
            conn.execute("TRUNCATE inbox.outbox, inbox.outbox_waiter, bench.plain_outbox")
        latencies = measure_wakeup(dsn, args.wakeups) if args.wakeups else []

    med = {name: statistics.median(v) for name, v in tps.items()}
    ratios = {f"{name} / plain": statistics.median(v) for name, v in pair_ratios.items()}
    wake = (
        {"p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99), "max_ms": max(latencies)}
        if latencies
        else {}
    )
    print()
    print(f"{args.rounds} rounds of {args.seconds}s runs, {args.clients} clients, fsync on; medians:")
    for name in ["plain", *workloads]:
        share = 100 * statistics.median(notifies[name])
        print(f"  {name:14s} {med[name]:8.0f} tps   notifying transactions: {share:6.2f}%")
    print("ratios (median of the per-round pairs workload / baseline run next to it; [min..max]):")
    for name, value in ratios.items():
        spread = f"[{min(pair_ratios[name.split()[0]]):.3f}..{max(pair_ratios[name.split()[0]]):.3f}]"
        verdict = ("  target >= 0.80: " + ("met" if value >= 0.80 else "MISSED")) if name == "enqueue / plain" else ""
        print(f"  {name:22s} {value:5.3f}x {spread}{verdict}")
    extra_us = cpu_med["enqueue"] - cpu_med["plain"]
    print(
        f"CPU per effect: plain insert {cpu_med['plain']:.2f} us, enqueue_effect {cpu_med['enqueue']:.2f} us "
        f"({extra_us:+.2f} us: checks, authorization, the waiter probe)"
    )
    if wake:
        print(f"wake-up latency of an idle dispatcher, commit -> claimed ({len(latencies)} samples):")
        print(f"  p50 {wake['p50_ms']:6.2f} ms  target <= 10: {'met' if wake['p50_ms'] <= 10 else 'MISSED'}")
        print(f"  p99 {wake['p99_ms']:6.2f} ms  target <= 50: {'met' if wake['p99_ms'] <= 50 else 'MISSED'}")
        print(f"  max {wake['max_ms']:6.2f} ms")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "medians": med,
                    "ratios": ratios,
                    "pair_ratios": pair_ratios,
                    "notifying_share": notifies,
                    "cpu_us_per_enqueue": cpu_med,
                    "wakeup": wake,
                    "args": vars(args) | {"json": None},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
