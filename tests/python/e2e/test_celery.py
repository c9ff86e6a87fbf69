"""pginbox.integrations.celery with a real Celery worker (a `celery worker` subprocess) on the
running RabbitMQ and Redis: outcomes and their acknowledgement, growing retries ending in
quarantine, dead letters (bad identity, undecodable bodies, unknown tasks), a database that
refuses work (never acked), a SIGKILL of the worker mid-task (redelivered, applied once), and a
few hundred preloaded messages through `-P solo` without the event loop's 10 s ack stall.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from helpers_brokers import wait_for
from helpers_celery import broker_url, delete, drain, grant_domain, new_queue, publish_raw, waiting, worker
from helpers_inbox import ledger_counts, setup_domain

from pginbox import Message
from pginbox.integrations.celery import InboxTask, identity, inbox_task

pytestmark = pytest.mark.timeout(240)
Conn = psycopg.Connection[tuple[Any, ...]]
BROKERS = ("rabbitmq", "redis")


def _never(cur: Any, message: Message) -> None:
    raise AssertionError("the producer side never runs the handler")


def producer_task(url: str, queue: str) -> tuple[Celery, InboxTask]:
    """The sending side: the same task name, registered in an app that only sends."""
    app = Celery("pginbox_celery_producer", broker=url)
    app.conf.update(task_default_queue=queue, broker_transport_options={"confirm_publish": True})

    def no_inbox() -> Any:
        raise AssertionError("the producer side never makes an Inbox")

    return app, inbox_task(app, inbox=no_inbox, name="billing.credit")(_never)


@pytest.fixture(params=BROKERS)
def celery_queue(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    url = broker_url(request.param)
    queue = new_queue()
    try:
        yield url, queue
    finally:
        delete(url, queue, f"{queue}.dead")


def handler_calls(conn: Conn) -> int:
    row = conn.execute("SELECT last_value FROM handler_calls").fetchone()
    assert row is not None
    return int(row[0])


def test_outcomes_retries_and_dead_letters(
    celery_queue: tuple[str, str], conn: Conn, db_dsn: str, tmp_path: Path
) -> None:
    url, queue = celery_queue
    setup_domain(conn)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    app, task = producer_task(url, queue)
    task.send({"amount": 10}, message_id="m1", producer="shop")  # applied
    task.send({"amount": 10}, message_id="m1", producer="shop")  # duplicate
    task.send({"amount": 99}, message_id="m1", producer="shop")  # conflict
    task.send({"amount": -1}, message_id="neg", producer="shop")  # failed x2, then quarantined
    task.apply_async(args=({"amount": 5},))  # no identity: dead letter 22004
    publish_raw(
        url, queue, b"{not json", {"task": "billing.credit", "id": "raw-1", "lang": "py"}, "application/json"
    )  # undecodable: dead letter 22P02
    app.send_task("billing.nope", args=({"amount": 1},), queue=queue)  # unknown task: 42704
    task.send({"amount": 20}, message_id="m2", producer="shop")  # applied, after the bad ones
    with worker(url, queue, db_dsn, tmp_path / "worker.log") as w:

        def settled() -> bool:
            row = conn.execute(
                "SELECT count(*) FROM inbox.quarantine WHERE consumer = 'billing' AND message_id = 'neg'"
            ).fetchone()
            return ledger_counts(conn).get("m2") == 1 and row is not None and row[0] == 1

        wait_for(settled, "m2 applied and neg quarantined", timeout=60)
        wait_for(lambda: len(drain_once(url, queue, seen)) >= 3, "three dead letters", timeout=30)
        time.sleep(1.0)  # anything still to come would come now
        log = w.text()
    assert ledger_counts(conn) == {"m1": 1, "m2": 1}, log[-3000:]
    states = sorted(str(h.get("Pginbox-Sqlstate")) for h, _ in seen)
    assert states == ["22004", "22P02", "42704"], (seen, log[-3000:])
    raw = next(body for h, body in seen if h.get("Pginbox-Sqlstate") == "22P02")
    assert raw == b"{not json"
    assert all(h.get("Pginbox-Reason") and h.get("Pginbox-Original") for h, _ in seen)
    # the failed message ran once per attempt: 2 failures, then quarantined at attempt 3
    rows = conn.execute(
        "SELECT kind, attempts FROM inbox.quarantine WHERE consumer = 'billing' ORDER BY message_id"
    ).fetchall()
    assert ("conflict" in {r[0] for r in rows}) and len(rows) == 2, rows
    assert "message_conflict" in log and "message_quarantined" in log
    # gaps of the failed message's attempts: countdown 0.3 s, then 0.6 s (never a hot loop)
    failed = [line for line in log.splitlines() if "message_failed" in line and "neg" in line]
    assert [("retry_in=0.3" in failed[0]), ("retry_in=0.6" in failed[1])] == [True, True], failed
    assert waiting(url, queue) == 0


seen: list[tuple[dict[str, Any], bytes]] = []


def drain_once(url: str, queue: str, into: list[tuple[dict[str, Any], bytes]]) -> list[tuple[dict[str, Any], bytes]]:
    into.extend(drain(url, f"{queue}.dead"))
    return into


@pytest.fixture(autouse=True)
def _clear_seen() -> None:
    seen.clear()


def test_database_refusing_work_is_never_acked(
    celery_queue: tuple[str, str], conn: Conn, db_dsn: str, tmp_path: Path
) -> None:
    """A lock held on the table the handler writes: lock_timeout (55P03, transient) every attempt,
    retries exhausted: the message is handed back (rejected with requeue) again and again, never
    acked, never dead-lettered; applied once when the lock goes, and not counted as a crash."""
    url, queue = celery_queue
    setup_domain(conn)
    _, task = producer_task(url, queue)
    with psycopg.connect(db_dsn) as locker:
        locker.execute("LOCK TABLE account IN ACCESS EXCLUSIVE MODE")
        task.send({"amount": 7}, message_id="locked", producer="shop")
        with worker(url, queue, db_dsn, tmp_path / "worker.log") as w:
            wait_for(lambda: w.text().count("database_unavailable") >= 3, "three hand-backs", timeout=60)
            assert ledger_counts(conn) == {}
            locker.rollback()
            wait_for(lambda: ledger_counts(conn).get("locked") == 1, "applied after the lock", timeout=30)
            time.sleep(1.0)
    assert ledger_counts(conn) == {"locked": 1}
    assert drain(url, f"{queue}.dead") == []
    row = conn.execute(
        "SELECT count(*) FROM inbox.quarantine WHERE consumer = 'billing' AND message_id = 'locked'"
    ).fetchone()
    assert row == (0,)
    assert waiting(url, queue) == 0


def test_sigkill_mid_task_redelivered_and_applied_once(
    celery_queue: tuple[str, str], conn: Conn, db_dsn: str, tmp_path: Path
) -> None:
    url, queue = celery_queue
    setup_domain(conn)
    _, task = producer_task(url, queue)
    mark = tmp_path / "mark"
    task.send({"amount": 5, "sleep": 8}, message_id="slow", producer="shop")
    task.send({"amount": 6}, message_id="after", producer="shop")
    w1 = worker(url, queue, db_dsn, tmp_path / "worker1.log", mark)
    with w1 as first:
        wait_for(mark.exists, "the handler running", timeout=60)
        first.kill()  # mid-task: the claim and the ledger row are not committed
    assert ledger_counts(conn) == {}
    mark.unlink()
    # the second worker: the payload no longer sleeps on its redelivery (the mark is taken)
    with worker(url, queue, db_dsn, tmp_path / "worker2.log") as second:
        wait_for(lambda: ledger_counts(conn) == {"slow": 1, "after": 1}, "both applied", timeout=90)
        time.sleep(1.0)
        log = second.text()
    assert ledger_counts(conn) == {"slow": 1, "after": 1}, log[-3000:]
    assert waiting(url, queue) == 0
    started = conn.execute(
        "SELECT started FROM inbox.attempt WHERE consumer = 'billing' AND message_id = 'slow'"
    ).fetchone()
    assert started is not None and started[0] >= 1, started  # the redelivery was announced


def test_send_puts_the_business_id_in_the_message(celery_queue: tuple[str, str]) -> None:
    """The identity travels in the task's kwargs under the wire contract's names; Celery's task
    id is not it."""
    url, queue = celery_queue
    _, task = producer_task(url, queue)
    sent = task.send({"amount": 1}, message_id="order-17", producer="shop", tenant="acme")
    (message,) = drain_task_messages(url, queue)
    args, kwargs, _ = json.loads(message)
    assert args == [{"amount": 1}]
    ident = kwargs["pginbox"]
    assert ident["Pginbox-Message-Id"] == "order-17" != sent.id
    assert ident["Pginbox-Producer"] == "shop"
    assert ident["Pginbox-Type"] == "billing.credit"
    assert ident["Pginbox-Tenant"] == "acme"


def drain_task_messages(url: str, queue: str) -> list[bytes]:
    return [body for _, body in drain(url, queue)]


def test_rights_error_is_never_acked_until_fixed(
    celery_queue: tuple[str, str], conn: Conn, db_dsn: str, tmp_path: Path, login_role: Callable[..., str]
) -> None:
    """The worker's login role is not bound to the consumer (42501 / 42704): consumer_halted with
    what to fix, rejected with requeue again and again, never acked nor dead-lettered; applied
    once the binding exists."""
    url, queue = celery_queue
    setup_domain(conn)
    role_dsn = login_role("inbox_consumer")
    role = grant_domain(conn, role_dsn)
    _, task = producer_task(url, queue)
    task.send({"amount": 3}, message_id="h1", producer="shop")
    with worker(url, queue, role_dsn, tmp_path / "worker.log") as w:
        wait_for(lambda: w.text().count("consumer_halted") >= 2, "two halts", timeout=60)
        assert ledger_counts(conn) == {}
        line = next(x for x in w.text().splitlines() if "consumer_halted" in x)
        assert "fix=" in line and ("42501" in line or "42704" in line), line
        conn.execute("SELECT inbox.bind_consumer('billing', %s::regrole)", (role,))
        wait_for(lambda: ledger_counts(conn) == {"h1": 1}, "applied once bound", timeout=30)
        time.sleep(1.0)
    assert ledger_counts(conn) == {"h1": 1}
    assert drain(url, f"{queue}.dead") == []
    assert waiting(url, queue) == 0


def test_solo_worker_acks_each_task_without_stalling(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    """Under `-P solo` a task runs inside kombu's socket reader, which the event loop calls after
    taking its queued callbacks: an ack queued there waited for the poll's 10 s timeout whenever
    no other frame came, i.e. as soon as every prefetched message (2 here) was done. The commits
    of 300 preloaded messages then showed 10 s gaps, and the last message stayed unacked for
    10 s. DeadLetteringConsumer sends the ack when the task ends."""
    url, queue = broker_url("rabbitmq"), new_queue()
    try:
        setup_domain(conn)
        _, task = producer_task(url, queue)
        n = 300
        with task.app.producer_or_acquire() as producer:
            for i in range(n):
                ident = identity(message_id=f"s{i}", producer="shop", message_type="billing.credit")
                task.apply_async(args=({"amount": 1},), kwargs={"pginbox": ident}, producer=producer)
        with worker(url, queue, db_dsn, tmp_path / "worker.log") as w:
            wait_for(lambda: len(ledger_counts(conn)) == n, f"{n} messages applied", timeout=120)
            # the last ack went with its task, not at the loop's next poll timeout: a SIGKILL
            # 2 s later leaves nothing unacked to come back to the queue
            time.sleep(2.0)
            w.kill()
            log = w.text()
        requeued = waiting(url, queue)
        stamps = [
            float(r[0])
            for r in conn.execute(
                "SELECT extract(epoch FROM processed_at) FROM inbox.message"
                " WHERE consumer = 'billing' AND producer = 'shop' ORDER BY processed_at"
            )
        ]
    finally:
        delete(url, queue, f"{queue}.dead")
    assert len(stamps) == n
    gaps = sorted((b - a for a, b in itertools.pairwise(stamps)), reverse=True)
    assert gaps[0] < 5.0, (gaps[:5], log[-3000:])
    assert requeued == 0, log[-3000:]
