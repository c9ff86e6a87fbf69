"""Concurrent deliveries of one message: many workers at once, and two sessions stepped by hand.

Each worker is a thread with its own connection. The unique key on the inbox is what serializes
claims: at READ COMMITTED the loser waits for the winner and then sees a duplicate (or claims, if
the winner rolled back); at REPEATABLE READ the loser's snapshot cannot see the winner, so it must
get SQLSTATE 40001 and retry the whole transaction.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
import psycopg.errors
import pytest
from helpers_inbox import (
    Delivery,
    apply_in_caller,
    assert_applied_exactly,
    balance,
    claim,
    claim_and_apply,
    connect,
    failed_attempts,
    handler_calls,
    inbox_rows,
    payload,
    setup_domain,
    wait_for_lock_wait,
)

Conn = psycopg.Connection[Any]

WORKERS = 16
IDS = [f"m-{i}" for i in range(12)]
FIRST = {"claim": "claimed", "claim_and_apply": "applied"}


@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


def deliver(c: Conn, style: str, body: dict[str, Any]) -> Delivery:
    """One delivery inside the caller's (already open) transaction."""
    if style == "claim":
        result = claim(c, body["id"], body)
        if result.outcome == "claimed":
            apply_in_caller(c, body)
        return result
    return claim_and_apply(c, body["id"], body)


def claim_step(c: Conn, style: str, body: dict[str, Any]) -> Delivery:
    """The step of a delivery that must wait for a concurrent claim: the claim itself.

    In the claim style the domain change is left to `finish_step`, so a wait (or a 40001) observed
    here comes from the inbox and not from the account row both sessions update."""
    if style == "claim":
        return claim(c, body["id"], body)
    return claim_and_apply(c, body["id"], body)


def finish_step(c: Conn, style: str, body: dict[str, Any], result: Delivery) -> None:
    if style == "claim" and result.outcome == "claimed":
        apply_in_caller(c, body)


def run_workers(n: int, work: Callable[[int, threading.Barrier], list[Any]]) -> list[Any]:
    """Run `work(index, barrier)` in n threads; a failing worker breaks the others' barrier."""
    barrier = threading.Barrier(n)

    def guarded(i: int) -> list[Any]:
        try:
            return work(i, barrier)
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(guarded, i) for i in range(n)]
        out: list[Any] = []
        for f in futures:
            out.extend(f.result(timeout=120))
    return out


# --- the same messages delivered concurrently by many workers ----------------------------------


@pytest.mark.parametrize("style", ["claim", "claim_and_apply"])
def test_concurrent_redeliveries_apply_once(db_dsn: str, domain: Conn, style: str) -> None:
    # the winner holds its claim a little while the other workers pile up behind it
    domain.execute("UPDATE handler_delay SET seconds = 0.01")

    def work(_: int, barrier: threading.Barrier) -> list[tuple[str, str]]:
        seen = []
        with connect(db_dsn) as c:
            for mid in IDS:
                body = payload(mid, 10 + int(mid[2:]))
                barrier.wait(timeout=30)  # everybody delivers this id at the same moment
                with c.transaction():
                    result = deliver(c, style, body)
                    if result.outcome == "claimed":
                        c.execute("SELECT pg_sleep(0.01)")
                seen.append((mid, result.outcome))
        return seen

    outcomes = run_workers(WORKERS, work)

    per_id = {mid: Counter(o for m, o in outcomes if m == mid) for mid in IDS}
    for mid, counts in per_id.items():
        assert counts == Counter({FIRST[style]: 1, "duplicate": WORKERS - 1}), (mid, counts)
    assert_applied_exactly(domain, {mid: 10 + int(mid[2:]) for mid in IDS})
    if style == "claim_and_apply":
        assert handler_calls(domain) == len(IDS)


def test_concurrent_repeatable_read_losers_get_40001_then_duplicate(db_dsn: str, domain: Conn) -> None:
    """All snapshots are taken before anyone claims: every loser must get 40001 (never 'failed',
    never a recorded attempt), and its retry of the whole transaction must see a duplicate."""
    body = payload("m-rr", 25)

    def work(_: int, barrier: threading.Barrier) -> list[tuple[str, ...]]:
        history: list[tuple[str, ...]] = []
        with connect(db_dsn) as c:
            c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            c.execute("SELECT balance FROM account WHERE id = 1")  # takes the snapshot
            barrier.wait(timeout=30)
            try:
                history.append(("first", claim_and_apply(c, "m-rr", body).outcome))
                c.execute("COMMIT")
                return history
            except psycopg.errors.SerializationFailure:
                c.execute("ROLLBACK")
                history.append(("first", "40001"))
            c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            history.append(("retry", claim_and_apply(c, "m-rr", body).outcome))
            c.execute("COMMIT")
        return history

    history = run_workers(WORKERS, work)

    assert Counter(history) == Counter(
        {
            ("first", "applied"): 1,
            ("first", "40001"): WORKERS - 1,
            ("retry", "duplicate"): WORKERS - 1,
        }
    )
    assert handler_calls(domain) == 1
    assert failed_attempts(domain, "m-rr") == 0, "a serialization failure is not a handler failure"
    assert_applied_exactly(domain, {"m-rr": 25})


# --- two sessions stepped by hand on one id ----------------------------------------------------


@pytest.mark.parametrize("a_style", ["claim", "claim_and_apply"])
@pytest.mark.parametrize("b_style", ["claim", "claim_and_apply"])
@pytest.mark.parametrize("a_ends", ["COMMIT", "ROLLBACK"])
def test_stepped_read_committed(db_dsn: str, domain: Conn, a_style: str, b_style: str, a_ends: str) -> None:
    body = payload("m-1", 10)
    with connect(db_dsn) as a, connect(db_dsn) as b, ThreadPoolExecutor(1) as pool:
        a.execute("BEGIN")  # READ COMMITTED
        assert deliver(a, a_style, body).outcome == FIRST[a_style]

        b.execute("BEGIN")
        b_result: Future[Delivery] = pool.submit(claim_step, b, b_style, body)
        wait_for_lock_wait(domain, b.info.backend_pid, a.info.backend_pid)
        assert not b_result.done(), "B must wait for A's uncommitted claim"

        a.execute(a_ends)
        result = b_result.result(timeout=10)
        finish_step(b, b_style, body, result)
        b.execute("COMMIT")
        outcome = result.outcome

    if a_ends == "COMMIT":
        assert outcome == "duplicate"
    else:
        assert outcome == FIRST[b_style], "after A rolled back, B must own first processing"
    assert_applied_exactly(domain, {"m-1": 10})
    rows = inbox_rows(domain, "m-1")
    assert len(rows) == 1 and rows[0]["status"] == "processed"


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("b_style", ["claim", "claim_and_apply"])
@pytest.mark.parametrize("b_waits", [True, False], ids=["b-blocked", "a-committed-first"])
def test_stepped_repeatable_read_raises_40001_then_retry_is_duplicate(
    db_dsn: str, domain: Conn, b_style: str, b_waits: bool, isolation: str
) -> None:
    body = payload("m-1", 10)
    with connect(db_dsn) as a, connect(db_dsn) as b, ThreadPoolExecutor(1) as pool:
        b.execute(f"BEGIN ISOLATION LEVEL {isolation}")
        assert balance(b) == 0  # B's snapshot is taken here, before A claims

        a.execute("BEGIN")
        assert deliver(a, "claim", body).outcome == "claimed"
        if b_waits:
            b_result: Future[Delivery] = pool.submit(claim_step, b, b_style, body)
            wait_for_lock_wait(domain, b.info.backend_pid, a.info.backend_pid)
            a.execute("COMMIT")
            with pytest.raises(psycopg.errors.SerializationFailure):
                b_result.result(timeout=10)
        else:
            a.execute("COMMIT")
            with pytest.raises(psycopg.errors.SerializationFailure):
                claim_step(b, b_style, body)
        b.execute("ROLLBACK")

        # the caller retries the whole transaction, with a new snapshot
        b.execute(f"BEGIN ISOLATION LEVEL {isolation}")
        retry = deliver(b, b_style, body)
        b.execute("COMMIT")

    assert retry.outcome == "duplicate"
    assert not retry.attempts
    assert failed_attempts(domain, "m-1") == 0, "a serialization failure is not a handler failure"
    assert handler_calls(domain) == 0
    assert_applied_exactly(domain, {"m-1": 10})


def test_serialization_failure_inside_the_handler_is_reraised(db_dsn: str, domain: Conn) -> None:
    """At REPEATABLE READ the handler's own UPDATE of a row changed since the snapshot raises
    40001: claim_and_apply must re-raise it, not record the message as failed."""
    with connect(db_dsn) as a, connect(db_dsn) as b:
        b.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        assert balance(b) == 0  # snapshot
        assert claim_and_apply(a, "m-a", payload("m-a", 5)).outcome == "applied"  # commits
        with pytest.raises(psycopg.errors.SerializationFailure):
            claim_and_apply(b, "m-b", payload("m-b", 7))
        b.execute("ROLLBACK")
        assert failed_attempts(domain, "m-b") == 0
        assert inbox_rows(domain, "m-b") == []

        b.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        retried = claim_and_apply(b, "m-b", payload("m-b", 7))
        b.execute("COMMIT")
    assert retried.outcome == "applied"
    assert failed_attempts(domain, "m-b") == 0
    assert_applied_exactly(domain, {"m-a": 5, "m-b": 7})
