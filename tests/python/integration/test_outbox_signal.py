"""The outbox wake-up signal, with real LISTEN connections and commits.

An enqueue sends NOTIFY inbox_outbox only when a dispatcher is registered idle
(inbox.dispatcher_idle) at the moment it enqueues (0.2.0; at its commit in 0.1.0, through a
deferred trigger per effect), and the first such transaction deletes the registrations, so one
transaction per idle period pays for NOTIFY (which serializes commits). NOTIFY and the deletion
take effect at commit, so these cases cannot be seen inside pgTAP's rolled-back transaction.
The one race this leaves — a dispatcher registering after the enqueue and before its commit — is
covered by the dispatcher's early claims after registering, shown with a real dispatcher below.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from helpers_inbox import connect

from pginbox.dispatcher import CallableTransport, Dispatcher

Conn = psycopg.Connection[Any]
CHANNEL = "inbox_outbox"
QUIET = 0.3  # seconds to wait for a notification that must not come


@pytest.fixture
def listener(db_dsn: str) -> Iterator[Conn]:
    with connect(db_dsn) as c:
        c.execute("LISTEN inbox_outbox")
        yield c


def notifications(listener: Conn, timeout: float = QUIET) -> list[tuple[str, str]]:
    return [(n.channel, n.payload) for n in listener.notifies(timeout=timeout)]


def enqueue(c: Conn, effect_id: str, due_in_seconds: float = 0) -> bool:
    row = c.execute(
        "SELECT inbox.enqueue_effect(%s, 'hook', '{}', available_at => now() + make_interval(secs => %s))",
        (effect_id, due_in_seconds),
    ).fetchone()
    assert row is not None
    return bool(row[0])


def idle(c: Conn, dispatcher: str, is_idle: bool = True) -> None:
    c.execute("SELECT inbox.dispatcher_idle(%s, %s)", (dispatcher, is_idle))


def waiters(c: Conn) -> list[str]:
    return [r[0] for r in c.execute("SELECT dispatcher FROM inbox.outbox_waiter ORDER BY 1")]


def test_no_dispatcher_idle_no_notify(conn: Conn, listener: Conn) -> None:
    assert enqueue(conn, "e1")
    assert notifications(listener) == []


def test_an_idle_dispatcher_is_woken_once_per_idle_period(conn: Conn, listener: Conn) -> None:
    idle(conn, "d1")
    idle(conn, "d2")
    assert enqueue(conn, "e1")
    assert notifications(listener, timeout=5) == [(CHANNEL, "")]
    assert waiters(conn) == [], "the waking enqueue deleted the registrations"
    assert enqueue(conn, "e2")
    assert notifications(listener) == [], "nobody is idle any more: no second NOTIFY"


def test_repeats_and_later_effects_wake_nobody(conn: Conn, listener: Conn) -> None:
    assert enqueue(conn, "e1")
    idle(conn, "d1")
    assert not enqueue(conn, "e1")  # a repeat is a no-op
    assert enqueue(conn, "later", due_in_seconds=3600)  # the dispatcher's poll finds it when due
    assert notifications(listener) == []
    assert waiters(conn) == ["d1"]


def test_a_rolled_back_enqueue_sends_nothing_and_keeps_the_registration(conn: Conn, listener: Conn) -> None:
    idle(conn, "d1")
    conn.execute("BEGIN")
    assert enqueue(conn, "e1")
    conn.execute("ROLLBACK")
    assert notifications(listener) == []
    assert waiters(conn) == ["d1"], "the dispatcher is still registered: the next enqueue wakes it"
    assert enqueue(conn, "e2")
    assert notifications(listener, timeout=5) == [(CHANNEL, "")]


def test_a_dispatcher_idle_between_an_enqueue_and_its_commit_finds_the_effect_by_its_early_claims(
    conn: Conn, listener: Conn, db_dsn: str
) -> None:
    """The missed-signal window: the enqueue looked at the waiter table before the dispatcher
    registered, and commits after the dispatcher's catch-up claim. No NOTIFY comes; the dispatcher's
    claims after short, doubling waits (20 ms, 40 ms, ...) find the effect long before its poll
    interval (here 30 s) would."""
    delivered: list[tuple[str, float]] = []
    dispatcher = Dispatcher(
        db_dsn,
        "race",
        {"hook": CallableTransport(lambda effect: delivered.append((effect.effect_id, time.monotonic())))},
        poll_interval=30.0,
    )
    with connect(db_dsn) as producer, ThreadPoolExecutor(max_workers=1) as pool:
        producer.execute("BEGIN")
        assert enqueue(producer, "in-the-window")  # nobody is idle yet: no signal will be sent
        running = pool.submit(dispatcher.run)
        try:
            deadline = time.monotonic() + 10
            while waiters(conn) != ["race"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert waiters(conn) == ["race"], "the dispatcher registered idle (after its catch-up claim)"
            time.sleep(0.1)
            producer.execute("COMMIT")
            committed = time.monotonic()
            deadline = committed + 10
            while not delivered and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            dispatcher.stop()
            running.result(timeout=30)
            dispatcher.close()
    assert [effect_id for effect_id, _ in delivered] == ["in-the-window"]
    assert delivered[0][1] - committed < 2.0, "found by an early claim, not by the 30 s poll"
    assert notifications(listener) == [], "no NOTIFY: the enqueue saw nobody idle"


def test_nobody_waits_for_a_transaction_that_is_waking_the_dispatchers(conn: Conn, listener: Conn, db_dsn: str) -> None:
    idle(conn, "d1")
    with connect(db_dsn) as waker, connect(db_dsn) as other, ThreadPoolExecutor(max_workers=1) as pool:
        waker.execute("BEGIN")
        assert enqueue(waker, "woken-by")
        # The enqueue deleted d1's registration and holds its row lock until it commits.

        # Another enqueue skips the locked registration instead of waiting (and does not notify).
        assert pool.submit(enqueue, other, "concurrent").result(timeout=10)
        # The dispatcher itself neither waits to unregister nor to register again.
        pool.submit(idle, other, "d1", False).result(timeout=10)
        pool.submit(idle, other, "d1", True).result(timeout=10)
        assert notifications(listener) == []

        waker.execute("COMMIT")
    assert notifications(listener, timeout=5) == [(CHANNEL, "")]
    assert waiters(conn) == []


def test_claiming_unregisters_an_idle_dispatcher(conn: Conn) -> None:
    idle(conn, "d1")
    assert conn.execute("SELECT count(*) FROM inbox.claim_effects('d1', key_aware => true)").fetchone() == (0,)
    assert waiters(conn) == ["d1"], "a claim that finds nothing leaves the registration"
    assert enqueue(conn, "e1")
    assert waiters(conn) == [], "the enqueue woke d1"
    idle(conn, "d1")  # e.g. d1 registered again before its catch-up poll
    assert conn.execute("SELECT count(*) FROM inbox.claim_effects('d1', key_aware => true)").fetchone() == (1,)
    assert waiters(conn) == [], "a dispatcher that claimed work is not idle"
