"""pginbox.integrations.faststream with real FastStream apps (RabbitBroker, NatsBroker,
RedisBroker, started on the running brokers, in a thread with an event loop of its own; not
FastStream's in-memory TestClient): every outcome and its settlement, growing retries ending in
quarantine, undecodable bodies and missing identities dead-lettered (never left unacked), a
database refusing work (handed back, never acked), messages published the way pginbox's own
destinations publish them (helpers_brokers.Channel).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers_brokers import Channel, Out, channel, wait_for
from helpers_celery import grant_domain
from helpers_inbox import ledger_counts, setup_domain
from helpers_paths import TESTS_DIR
from psycopg_pool import AsyncConnectionPool

from pginbox import AsyncInbox, Message, RetryPolicy
from pginbox.integrations.faststream import close, inbox_subscriber, subscriptions

pytestmark = pytest.mark.timeout(180)
Conn = psycopg.Connection[tuple[Any, ...]]
BROKERS = ("rabbitmq", "nats", "redis")


async def credit(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
    p = message.payload
    await cur.execute("SELECT nextval('handler_calls')")
    if p["amount"] < 0:
        raise ValueError(f"negative amount {p['amount']}")
    await cur.execute("SELECT apply_credit(1, %s, %s)", (message.message_id, p["amount"]))


def inbox_factory(dsn: str) -> Callable[[], Any]:
    async def make() -> AsyncInbox:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            dsn, min_size=1, max_size=2, open=False, kwargs={"options": "-c lock_timeout=300"}
        )
        await pool.open()
        return AsyncInbox(pool, consumer="billing", retry=RetryPolicy(max_attempts=2, max_delay=0.1))

    return make


def build(ch: Channel, dsn: str, **settings: Any) -> tuple[Any, Any]:
    """The FastStream broker and its inbox subscriber for `ch` (called in the app's loop)."""
    options: dict[str, Any] = {
        "inbox": inbox_factory(dsn),
        "url": ch.url,
        "retry_delay": 0.2,
        "max_retry_delay": 2.0,
        "outage_pause": 0.3,
        "halt_recheck": 0.5,
        **settings,
    }
    if ch.broker == "rabbitmq":
        from faststream.rabbit import RabbitBroker, RabbitQueue

        rabbit = RabbitBroker(ch.url)
        sub = inbox_subscriber(rabbit, RabbitQueue(ch.name, durable=True), **options)(credit)
        return rabbit, sub
    if ch.broker == "nats":
        from faststream.nats import JStream, NatsBroker, PullSub

        nats_broker = NatsBroker(ch.url)
        sub = inbox_subscriber(
            nats_broker,
            ch.subject,
            stream=JStream(ch.stream, declare=False),
            durable=ch.name,
            pull_sub=PullSub(batch_size=10, timeout=0.2),
            dead_letter=ch.dead_subject,
            **options,
        )(credit)
        return nats_broker, sub
    from faststream.redis import RedisBroker, StreamSub

    redis_broker = RedisBroker(ch.url)
    sub = inbox_subscriber(
        redis_broker, stream=StreamSub(ch.stream, group="billing", consumer="c1", polling_interval=100), **options
    )(credit)
    return redis_broker, sub


@contextlib.contextmanager
def app(ch: Channel, dsn: str, **settings: Any) -> Iterator[None]:
    """A FastStream app consuming `ch`, running until the block ends."""
    ready = threading.Event()
    failed: list[BaseException] = []
    state: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        state["loop"], state["stop"] = asyncio.get_running_loop(), stop
        broker, _ = build(ch, dsn, **settings)
        async with broker:
            await broker.start()
            ready.set()
            await stop.wait()
        (subscription,) = subscriptions(broker)
        await close(broker)
        if subscription.inbox is not None and subscription.inbox._pool is not None:
            await subscription.inbox._pool.close()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            failed.append(exc)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "the FastStream app did not start"
    assert not failed, failed
    try:
        yield
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(20)
        assert not thread.is_alive(), "the FastStream app did not stop"
        assert not failed, failed


@pytest.mark.parametrize("broker", BROKERS)
def test_outcomes_retries_and_dead_letters(
    broker: str, conn: Conn, db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    setup_domain(conn)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    caplog.set_level("INFO", logger="pginbox.faststream")
    with channel(broker) as ch, app(ch, db_dsn):
        ch.publish(
            [
                Out("m1", {"amount": 10}),  # applied
                Out("m1", {"amount": 10}, nats_msg_id="m1-again"),  # duplicate
                Out("m1", {"amount": 99}),  # conflict
                Out("neg", {"amount": -1}),  # failed twice, then quarantined
                Out("x", {"amount": 1}, producer=None),  # 22004
                Out("j", None, raw_body=b"{not json"),  # 22P02: FastStream never decodes it
                Out("d", None, raw_body=b"[" * 100_000 + b"]" * 100_000),  # 22P02: nested 100,000 deep
                Out(
                    "f",
                    {"amount": 1},
                    timestamp=datetime.datetime(2200, 1, 1, tzinfo=datetime.UTC),
                    produced_at="2200-01-01T00:00:00+00:00",
                ),  # 22008: out of range
                Out("m2", {"amount": 20}),  # applied
            ]
        )

        def settled() -> bool:
            row = conn.execute(
                "SELECT count(*) FROM inbox.quarantine WHERE consumer = 'billing' AND message_id = 'neg'"
            ).fetchone()
            return ledger_counts(conn).get("m2") == 1 and row == (1,)

        wait_for(settled, "m2 applied, neg quarantined", timeout=60)
        wait_for(lambda: ch.pending() == 0, "everything settled", timeout=30)
        time.sleep(0.5)
        assert ch.pending() == 0
        dead = ch.dead_letters()  # (read once: reading RabbitMQ's takes them)
    assert ledger_counts(conn) == {"m1": 1, "m2": 1}
    assert Counter(str(h.get("Pginbox-Sqlstate")) for h, _ in dead) == Counter({"22004": 1, "22P02": 2, "22008": 1})
    assert b"{not json" in [body for h, body in dead if h.get("Pginbox-Sqlstate") == "22P02"]
    kinds = sorted(r[0] for r in conn.execute("SELECT kind FROM inbox.quarantine WHERE consumer = 'billing'"))
    assert len(kinds) == 2 and "conflict" in kinds, kinds
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("message_failed")]
    assert [("retry_in=0.2" in failed[0]), ("retry_in=0.4" in failed[1])] == [True, True], failed
    events = " ".join(r.getMessage() for r in caplog.records)
    assert "message_conflict" in events and "message_quarantined" in events


@pytest.mark.parametrize("broker", BROKERS)
def test_database_refusing_work_is_handed_back(
    broker: str, conn: Conn, db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """lock_timeout on every attempt (55P03, transient): handed back after a pause, never acked,
    never dead-lettered; applied once when the lock goes, not counted as a crash."""
    setup_domain(conn)
    caplog.set_level("INFO", logger="pginbox.faststream")
    with channel(broker) as ch, psycopg.connect(db_dsn) as locker:
        locker.execute("LOCK TABLE account IN ACCESS EXCLUSIVE MODE")
        with app(ch, db_dsn):
            ch.publish([Out("locked", {"amount": 7})])

            def handed_back() -> bool:
                return sum("database_unavailable" in r.getMessage() for r in caplog.records) >= 3

            wait_for(handed_back, "three hand-backs", timeout=60)
            assert ledger_counts(conn) == {}
            assert ch.pending() == 1
            locker.rollback()
            wait_for(lambda: ledger_counts(conn).get("locked") == 1, "applied after the lock", timeout=30)
            wait_for(lambda: ch.pending() == 0, "acked", timeout=30)
        assert ch.dead_letters() == []
    assert ledger_counts(conn) == {"locked": 1}
    row = conn.execute("SELECT count(*) FROM inbox.quarantine WHERE consumer = 'billing'").fetchone()
    assert row == (0,)


@pytest.mark.parametrize("broker", BROKERS)
def test_sigkill_mid_message_redelivered_and_applied_once(broker: str, conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    """The app is SIGKILLed while the handler's transaction is open: nothing committed; the
    message comes back (RabbitMQ at once, NATS after ack_wait, Redis after claim_idle, added again
    by the subscriber), marked redelivered (announced: one start), and is applied once."""
    setup_domain(conn)
    mark = tmp_path / "mark"
    with channel(broker) as ch:
        if broker == "rabbitmq":
            ch.publish([])  # declares the queue
        env = {
            **os.environ,
            "PGINBOX_FS_BROKER": broker,
            "PGINBOX_FS_URL": ch.url,
            "PGINBOX_FS_NAME": ch.name,
            "PGINBOX_FS_STREAM": ch.stream,
            "PGINBOX_DSN": db_dsn,
        }

        def start(log: Path, with_mark: bool) -> subprocess.Popen[bytes]:
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, str(TESTS_DIR / "_faststream_app.py")],
                    env={**env, "PGINBOX_FS_MARK": str(mark) if with_mark else ""},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            wait_for(lambda: "pginbox-fs-ready" in log.read_text(errors="replace"), "the app started", timeout=60)
            return proc

        first = start(tmp_path / "first.log", True)
        try:
            ch.publish([Out("slow", {"amount": 5, "sleep": 8}), Out("after", {"amount": 6})])
            wait_for(mark.exists, "the handler running", timeout=60)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        finally:
            if first.poll() is None:
                first.kill()
        assert ledger_counts(conn).get("slow") is None
        second = start(tmp_path / "second.log", False)
        try:
            wait_for(lambda: ledger_counts(conn) == {"slow": 1, "after": 1}, "both applied", timeout=90)
            wait_for(lambda: ch.pending() == 0, "everything acked", timeout=30)
            time.sleep(0.5)
        finally:
            second.send_signal(signal.SIGKILL)
            second.wait(10)
        assert ledger_counts(conn) == {"slow": 1, "after": 1}
        started = conn.execute(
            "SELECT started FROM inbox.attempt WHERE consumer = 'billing' AND message_id = 'slow'"
        ).fetchone()
        assert started is not None and started[0] >= 1, started  # the redelivery was announced


@pytest.mark.parametrize("broker", BROKERS)
def test_rights_error_halts_without_ack_until_fixed(
    broker: str,
    conn: Conn,
    db_dsn: str,
    login_role: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rule 6: the login role is not bound to the consumer (42501 / 42704): the message is handed
    back, never acked, never dead-lettered, with a consumer_halted line saying what to fix; once
    the binding exists, it is applied."""
    setup_domain(conn)
    role_dsn = login_role("inbox_consumer")
    role = grant_domain(conn, role_dsn)
    caplog.set_level("INFO", logger="pginbox.faststream")
    with channel(broker) as ch, app(ch, role_dsn):
        ch.publish([Out("h1", {"amount": 3})])

        def halted() -> bool:
            return sum("consumer_halted" in r.getMessage() for r in caplog.records) >= 2

        wait_for(halted, "two halts", timeout=60)
        assert ledger_counts(conn) == {}
        assert ch.pending() == 1
        line = next(r.getMessage() for r in caplog.records if "consumer_halted" in r.getMessage())
        assert "fix=" in line and ("42501" in line or "42704" in line), line
        conn.execute("SELECT inbox.bind_consumer('billing', %s::regrole)", (role,))
        wait_for(lambda: ledger_counts(conn) == {"h1": 1}, "applied once bound", timeout=30)
        wait_for(lambda: ch.pending() == 0, "acked", timeout=30)
        assert ch.dead_letters() == []
