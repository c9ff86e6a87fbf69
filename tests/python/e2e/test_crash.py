"""Interrupted execution: a client killed with SIGKILL before and after COMMIT, a backend terminated
in the middle of its handler, and the server stopped with `pg_ctl stop -m immediate` under load.

What must hold each time: what the server acknowledged as committed is applied exactly once and
stays so across redeliveries; what was not committed leaves nothing and is applied by a redelivery.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from helpers_inbox import (
    SAFE_OPTIONS,
    Delivery,
    apply_in_caller,
    assert_applied_exactly,
    backend_gone,
    balance,
    claim,
    claim_and_apply,
    connect,
    failed_attempts,
    handler_calls,
    inbox_rows,
    ledger_counts,
    payload,
    setup_domain,
    wait_until,
)
from helpers_paths import TESTS_DIR

from pginbox.devtools.cluster import Cluster

Conn = psycopg.Connection[Any]

CHILD = TESTS_DIR / "_crash_child.py"
FIRST = {"claim": "claimed", "claim_and_apply": "applied"}


@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


def deliver(c: Conn, style: str, body: dict[str, Any]) -> Delivery:
    """One delivery in its own transaction (claim: BEGIN … COMMIT; claim_and_apply: one call)."""
    if style == "claim":
        with c.transaction():
            result = claim(c, body["id"], body)
            if result.outcome == "claimed":
                apply_in_caller(c, body)
        return result
    return claim_and_apply(c, body["id"], body)


def backend_state(observer: Conn, pid: int) -> str | None:
    row = observer.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return None if row is None else str(row[0])


# --- the client process SIGKILLed before / after COMMIT ----------------------------------------


@pytest.mark.parametrize("style", ["claim", "claim_and_apply"])
@pytest.mark.parametrize("phase", ["before_commit", "after_commit"])
def test_client_sigkilled(db_dsn: str, domain: Conn, style: str, phase: str) -> None:
    body = payload("m-1", 10)
    with subprocess.Popen(
        [sys.executable, str(CHILD), db_dsn, style, phase, "m-1", "10"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=CHILD.parent,
    ) as child:
        try:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], 30)
            assert ready, "the child never reported"
            line = child.stdout.readline()
            assert len(line.split()) == 3, f"unexpected output from the child: {line!r}"
            reported_phase, pid_text, outcome = line.split()
            assert reported_phase == phase
            assert outcome == FIRST[style]
            pid = int(pid_text)
            expected_state = "idle in transaction" if phase == "before_commit" else "idle"
            assert backend_state(domain, pid) == expected_state
            if phase == "before_commit":  # its writes exist, uncommitted
                assert inbox_rows(domain, "m-1") == [] and balance(domain) == 0

            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=10) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
    # the server notices the dead client and ends its backend (rolling back what was open)
    wait_until(lambda: backend_gone(domain, pid), f"backend {pid} of the killed client to exit")

    if phase == "before_commit":
        assert inbox_rows(domain, "m-1") == [], "an uncommitted claim must not survive its client"
        assert_applied_exactly(domain, {})
        with connect(db_dsn) as redelivery:
            assert deliver(redelivery, style, body).outcome == FIRST[style]
    with connect(db_dsn) as redelivery:
        assert deliver(redelivery, style, body).outcome == "duplicate"
    assert_applied_exactly(domain, {"m-1": 10})


# --- pg_terminate_backend in the middle of the handler -----------------------------------------


@pytest.mark.parametrize("in_transaction", [False, True], ids=["autocommit", "explicit-tx"])
def test_backend_terminated_mid_handler(db_dsn: str, domain: Conn, in_transaction: bool) -> None:
    body = payload("m-1", 10)
    domain.execute("UPDATE handler_delay SET seconds = 60")  # the handler sleeps after its writes

    with connect(db_dsn) as victim, ThreadPoolExecutor(1) as pool:
        pid = victim.info.backend_pid

        def run() -> Delivery:
            if in_transaction:
                with victim.transaction():
                    return claim_and_apply(victim, "m-1", body)
            return claim_and_apply(victim, "m-1", body)

        def sleeping_in_handler() -> bool:
            row = domain.execute("SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            return row is not None and row[0] == "PgSleep"

        future = pool.submit(run)
        wait_until(sleeping_in_handler, "the handler to reach pg_sleep")
        # its writes exist but are not committed
        assert inbox_rows(domain, "m-1") == []
        assert balance(domain) == 0

        terminated = domain.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
        assert terminated == (True,)
        with pytest.raises(psycopg.OperationalError):
            future.result(timeout=10)
        assert victim.closed or victim.broken
    wait_until(lambda: backend_gone(domain, pid), "the terminated backend to exit")

    assert inbox_rows(domain, "m-1") == []
    assert_applied_exactly(domain, {})

    domain.execute("UPDATE handler_delay SET seconds = 0")
    with connect(db_dsn) as fresh:
        redelivered = claim_and_apply(fresh, "m-1", body)
        assert redelivered.outcome == "applied"
        assert failed_attempts(domain, "m-1") == 0, "a terminated backend is not a handler failure"
        assert claim_and_apply(fresh, "m-1", body).outcome == "duplicate"
    assert handler_calls(domain) == 2
    assert_applied_exactly(domain, {"m-1": 10})


# --- pg_ctl stop -m immediate under load -------------------------------------------------------

LOAD_IDS = 2000
LOAD_REDELIVERIES = 600
LOAD_WORKERS = 6


def amount_of(message_id: str) -> int:
    return 1 + int(message_id[2:]) % 97


def test_immediate_stop_under_load(private_cluster: Cluster) -> None:
    dsn = private_cluster.dsn("pginbox")
    # a commit the client saw succeed must survive a server crash whatever the cluster's defaults
    options = SAFE_OPTIONS + " -c synchronous_commit=on"
    with psycopg.connect(dsn, autocommit=True) as admin:
        setup_domain(admin)

    rng = random.Random(20240611)
    ids = [f"m-{i}" for i in range(LOAD_IDS)]
    deliveries = ids + rng.choices(ids, k=LOAD_REDELIVERIES)
    rng.shuffle(deliveries)

    lock = threading.Lock()
    cursor = iter(deliveries)
    committed: dict[str, list[str]] = defaultdict(list)  # id -> outcomes whose commit succeeded
    unknown: set[str] = set()  # in flight when the server went away: commit outcome unknown
    done = Counter[str]()

    def worker(i: int) -> None:
        style = "claim" if i % 2 == 0 else "claim_and_apply"
        try:
            c = connect(dsn, options=options)
        except psycopg.OperationalError:
            return
        with c:
            while True:
                with lock:
                    mid = next(cursor, None)
                if mid is None:
                    with lock:
                        done["exhausted"] += 1
                    return
                try:
                    result = deliver(c, style, payload(mid, amount_of(mid)))
                except psycopg.OperationalError:
                    with lock:
                        unknown.add(mid)
                        done["crashed"] += 1
                    return
                with lock:
                    committed[mid].append(result.outcome)

    def committed_count() -> int:
        with lock:
            return sum(len(v) for v in committed.values())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(LOAD_WORKERS)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: committed_count() >= len(deliveries) * 0.4, "40% of the load", 90)
        private_cluster.stop(mode="immediate")
    finally:
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert done["crashed"] >= 1 and committed_count() < len(deliveries), (
        f"the stop must hit the run mid-way: {done}, {committed_count()} of {len(deliveries)}"
    )

    private_cluster.start()
    dsn = private_cluster.dsn("pginbox")  # the port may have changed
    with psycopg.connect(dsn, autocommit=True) as c:
        counts = ledger_counts(c)
        twice = {mid: n for mid, n in counts.items() if n > 1}
        assert not twice, f"applied more than once after the crash: {twice}"
        lost = {mid for mid in committed if mid not in counts}
        assert not lost, f"committed (acknowledged) but not applied after recovery: {sorted(lost)[:10]}"
        unexplained = set(counts) - set(committed) - unknown
        assert not unexplained, f"applied without any delivery committing it: {sorted(unexplained)[:10]}"
        firsts = {mid: o for mid, o in committed.items() if sum(x in FIRST.values() for x in o) > 1}
        assert not firsts, f"two deliveries both owned first processing: {firsts}"
        assert balance(c) == sum(amount_of(mid) for mid in counts)
        processed = c.execute(
            "SELECT count(*) FROM inbox.message WHERE consumer = 'billing' AND status = 'processed'"
        ).fetchone()
        assert processed == (len(counts),)

    # the broker redelivers everything; afterwards every id is applied exactly once
    redelivered: dict[str, str] = {}

    def redeliver(part: list[str]) -> None:
        with connect(dsn, options=options) as c:
            for mid in part:
                redelivered[mid] = claim_and_apply(c, mid, payload(mid, amount_of(mid))).outcome

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(redeliver, [ids[k::4] for k in range(4)]))

    expected = {mid: ("duplicate" if mid in counts else "applied") for mid in ids}
    assert redelivered == expected
    with psycopg.connect(dsn, autocommit=True) as c:
        assert_applied_exactly(c, {mid: amount_of(mid) for mid in ids})
