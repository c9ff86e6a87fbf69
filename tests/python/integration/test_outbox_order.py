"""Commit order of effects that share an ordering key, with real concurrent transactions.

A sequence number taken at insert is not commit order: T1 can enqueue first and commit last. The
outbox numbers keyed effects at commit (a deferred constraint trigger) under a transaction-level
advisory lock on the key, so same-key transactions are numbered in the order they commit, and the
dispatcher only ever claims the head of a key. These cases need two sessions, so they live here
and not in tests/pgtap/065_outbox.sql.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from helpers_inbox import connect, wait_for_lock_wait

Conn = psycopg.Connection[Any]


@pytest.fixture
def outbox(conn: Conn) -> Conn:
    # A stand-in for "a sequence number assigned at insert", to show what it would have said.
    conn.execute("CREATE SEQUENCE insert_order")
    return conn


@pytest.fixture
def sessions(db_dsn: str) -> Iterator[tuple[Conn, Conn]]:
    with connect(db_dsn) as t1, connect(db_dsn) as t2:
        yield t1, t2


def enqueue(c: Conn, effect_id: str, key: str | None = "K", take_insert_number: bool = False) -> None:
    c.execute("SELECT inbox.enqueue_effect(%s, 'hook', '{}', ordering_key => %s)", (effect_id, key))
    if take_insert_number:
        c.execute("CREATE TEMP TABLE IF NOT EXISTS my_insert_number (effect_id text, n bigint)")
        c.execute("INSERT INTO my_insert_number SELECT %s, nextval('insert_order')", (effect_id,))


def insert_number(c: Conn) -> int:
    row = c.execute("SELECT n FROM my_insert_number").fetchone()
    assert row is not None
    return int(row[0])


def order_seq(c: Conn, effect_id: str) -> int:
    row = c.execute("SELECT order_seq FROM inbox.outbox WHERE effect_id = %s", (effect_id,)).fetchone()
    assert row is not None and row[0] is not None, f"{effect_id} has no order_seq"
    return int(row[0])


def claim(c: Conn, dispatcher: str = "d1") -> list[tuple[str, int]]:
    rows = c.execute(
        "SELECT effect_id, lease_token FROM inbox.claim_effects(%s, 10, key_aware => true)", (dispatcher,)
    ).fetchall()
    return [(str(r[0]), int(r[1])) for r in rows]


def complete(c: Conn, effect_id: str, token: int) -> None:
    row = c.execute("SELECT inbox.complete_effect(%s, %s)", (effect_id, token)).fetchone()
    assert row == (True,)


def test_out_of_order_commit_is_delivered_in_commit_order(outbox: Conn, sessions: tuple[Conn, Conn]) -> None:
    t1, t2 = sessions
    t1.execute("BEGIN")
    enqueue(t1, "first-in", take_insert_number=True)  # T1 enqueues first ...
    t2.execute("BEGIN")
    enqueue(t2, "second-in", take_insert_number=True)
    t2.execute("COMMIT")  # ... but T2 commits first

    # Only T2's effect is visible, numbered and the head of K: it goes out first.
    [(effect, token)] = claim(outbox)
    assert effect == "second-in"
    complete(outbox, effect, token)

    t1.execute("COMMIT")
    assert order_seq(outbox, "second-in") < order_seq(outbox, "first-in"), "order_seq must follow commit order"
    [(effect, token)] = claim(outbox)
    assert effect == "first-in"
    complete(outbox, effect, token)

    # A number taken at insert would have put first-in before second-in: the opposite of the order
    # in which they became visible and were delivered. A dispatcher ordering by it would have
    # delivered second-in (number 2) while number 1 was still invisible: out of order.
    assert insert_number(t1) < insert_number(t2)


def test_both_committed_the_later_committer_waits_for_the_head(outbox: Conn, sessions: tuple[Conn, Conn]) -> None:
    t1, t2 = sessions
    t1.execute("BEGIN")
    enqueue(t1, "t1")
    t2.execute("BEGIN")
    enqueue(t2, "t2")
    t2.execute("COMMIT")
    t1.execute("COMMIT")
    # Both are visible now; t2 committed first, so it is the head and t1 waits behind it.
    [(effect, token)] = claim(outbox)
    assert effect == "t2"
    assert claim(outbox, "d2") == [], "one effect per key at a time: t1 waits until t2 is delivered"
    complete(outbox, effect, token)
    assert [e for e, _ in claim(outbox, "d2")] == ["t1"]


def test_a_numbered_key_makes_the_next_same_key_commit_wait(outbox: Conn, db_dsn: str) -> None:
    with connect(db_dsn) as t1, connect(db_dsn) as t2, connect(db_dsn) as t3, connect(db_dsn) as observer:
        t1.execute("BEGIN")
        enqueue(t1, "early")
        # Number now instead of at commit: T1 holds K's lock until it ends.
        t1.execute("SET CONSTRAINTS inbox.outbox_order_at_commit IMMEDIATE")
        t2.execute("BEGIN")
        enqueue(t2, "late")
        t3.execute("BEGIN")
        enqueue(t3, "other-key", key="L")
        t3.execute("COMMIT")  # another key does not wait

        t2_pid = t2.info.backend_pid
        with ThreadPoolExecutor(max_workers=1) as pool:
            committing = pool.submit(t2.execute, "COMMIT")
            wait_for_lock_wait(observer, t2_pid, t1.info.backend_pid)
            assert not committing.done(), "T2's commit must wait for T1, which holds K's number"
            t1.execute("COMMIT")
            committing.result(timeout=30)
    assert order_seq(outbox, "early") < order_seq(outbox, "late")


def test_transactions_sharing_keys_in_opposite_order_do_not_deadlock(outbox: Conn, db_dsn: str) -> None:
    rounds = 150
    barrier = threading.Barrier(2)

    def work(keys: list[str], tag: str) -> int:
        with connect(db_dsn) as c:
            barrier.wait(timeout=30)
            for i in range(rounds):
                c.execute("BEGIN")
                for key in keys:
                    enqueue(c, f"{tag}-{i}-{key}", key=key)
                c.execute("COMMIT")  # raises DeadlockDetected if the two commits lock A and B crosswise
        return rounds

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = [pool.submit(work, ["A", "B", "C"], "ab"), pool.submit(work, ["C", "B", "A"], "ba")]
        assert sum(f.result(timeout=120) for f in done) == 2 * rounds
    row = outbox.execute(
        "SELECT count(*), count(order_seq), count(DISTINCT order_seq) FROM inbox.outbox WHERE ordering_key IS NOT NULL"
    ).fetchone()
    assert row == (6 * rounds, 6 * rounds, 6 * rounds)
    # Within each key, numbers follow commit order: a transaction's effects are numbered together.
    for key in ("A", "B", "C"):
        tags = [
            r[0]
            for r in outbox.execute(
                "SELECT split_part(effect_id, '-', 2)::int FROM inbox.outbox"
                " WHERE ordering_key = %s AND effect_id LIKE 'ab-%%' ORDER BY order_seq",
                (key,),
            )
        ]
        assert tags == sorted(tags), f"one session's transactions must be numbered in the order they committed ({key})"


def test_uncommitted_keyed_effect_neither_shows_nor_blocks_others(outbox: Conn, sessions: tuple[Conn, Conn]) -> None:
    t1, _ = sessions
    enqueue(outbox, "committed-k")  # committed, numbered: the head of K
    t1.execute("BEGIN")
    enqueue(t1, "pending-k")
    enqueue(t1, "pending-keyless", key=None)
    assert [e for e, _ in claim(outbox)] == ["committed-k"]
    t1.execute("ROLLBACK")
    left = outbox.execute("SELECT count(*) FROM inbox.outbox").fetchone()
    assert left == (1,), "a rolled-back enqueue leaves nothing"


def blocked(c: Conn, effect_id: str) -> bool:
    row = c.execute("SELECT blocked FROM inbox.outbox WHERE effect_id = %s", (effect_id,)).fetchone()
    assert row is not None
    return bool(row[0])


def test_a_claim_does_not_set_aside_behind_a_head_being_delivered(outbox: Conn, db_dsn: str) -> None:
    enqueue(outbox, "head")
    [(effect, token)] = claim(outbox)
    assert effect == "head"
    enqueue(outbox, "next")  # after the claim: not set aside yet
    with connect(db_dsn) as dispatcher:
        dispatcher.execute("BEGIN")
        complete(dispatcher, "head", token)  # delivered, not committed yet: the row is locked
        # Another claim sees "next" behind a head it cannot lock: it neither waits nor sets it aside.
        assert claim(outbox, "d2") == []
        assert not blocked(outbox, "next")
        dispatcher.execute("COMMIT")
    assert [e for e, _ in claim(outbox, "d2")] == ["next"]


def test_a_delivery_waits_for_a_claim_setting_its_successor_aside(outbox: Conn, db_dsn: str) -> None:
    enqueue(outbox, "head")
    [(effect, token)] = claim(outbox)
    enqueue(outbox, "next")  # after the claim: not set aside yet
    with connect(db_dsn) as claimer, connect(db_dsn) as dispatcher, ThreadPoolExecutor(max_workers=1) as pool:
        claimer.execute("BEGIN")
        assert claim(claimer, "d2") == []  # sets "next" aside, holding a share lock on "head"
        assert blocked(claimer, "next")
        completing = pool.submit(complete, dispatcher, effect, token)
        wait_for_lock_wait(outbox, dispatcher.info.backend_pid, claimer.info.backend_pid)
        claimer.execute("COMMIT")
        completing.result(timeout=30)
    assert not blocked(outbox, "next"), "the delivery saw the set-aside successor and unblocked it"
    assert [e for e, _ in claim(outbox, "d3")] == ["next"]
