"""The broker port's conformance suite: every adapter runs it (the in-memory one and each real
broker: RabbitMQ, NATS JetStream, Redis Streams on loopback), against a real database. An adapter
is done when it passes. The rules (docs/brokers.md, "The contract"):

 1. ack only after COMMIT: while a batch's transaction is open, none of its messages is settled
 2. every outcome's broker action: applied, duplicate, conflict, quarantined, expired -> ack (the
    conflict, the quarantine and the expiry logged with the identity); failed -> back later
 3. failed -> delivered again after a growing delay, never in a hot loop, quarantined at max_attempts
 4. crash-loop markers: a delivery a dead consumer held comes back marked redelivered; a message
    that kills every consumer ends in quarantine
 5. bad input (a malformed body, a body nested 100,000 deep, a 30 MB body, a missing identity, a
    timestamp out of range) -> the dead letter with its SQLSTATE; the consumer keeps going
 6. a permanent configuration or rights error (42501, 42704, a dropped handler: 42883) -> the
    consumer halts visibly: unhealthy, no ack, no dead letter, a log line saying what to fix; it
    resumes by itself once fixed; it never drains the queue
 7. one bad message never holds back the good ones in its batch
 8. SIGKILL mid-batch loses nothing (the in-memory broker lives in the process: there the consumer
    dies by an exception mid-batch instead); SIGTERM finishes the batch

Kafka runs on a private Tansu (helpers_kafka): "pending" is what lies past the group's committed
offset, the hint the consumer commits after each COMMIT (its position lives in the database,
docs/kafka.md). Tansu, like Kafka's default message.max.bytes, takes no 30 MB record: that case is
left out there, as on NATS.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, ClassVar

import psycopg
import pytest
from helpers_brokers import (
    ADAPTERS,
    REAL,
    Channel,
    ConsumerThread,
    Out,
    channel,
    make_consumer,
    subprocess_env,
    wait_for,
)
from helpers_inbox import ledger_counts, setup_domain

from pginbox.client.outcomes import Message

pytestmark = pytest.mark.timeout(180)
Conn = psycopg.Connection[tuple[Any, ...]]


def credit(mid: str, amount: int = 10) -> dict[str, Any]:
    return {"id": mid, "amount": amount}


def dead_states(ch: Channel) -> Counter[str]:
    return Counter(str(h.get("Pginbox-Sqlstate")) for h, _ in ch.dead_letters())


# ------------------------------------------------------------------------------------------------ 2, 5, 7


@pytest.mark.parametrize("broker", ADAPTERS)
def test_outcomes_and_bad_input(broker: str, conn: Conn, db_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """Rules 2, 5 and 7: one batch holds every outcome and every kind of bad input; the good
    messages around the bad ones are applied, each bad one is dead-lettered with its SQLSTATE."""
    setup_domain(conn)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    # a purge watermark: a first delivery produced before it is `expired`
    conn.execute(
        "INSERT INTO inbox.consumer_config (consumer, purge_watermark) VALUES ('billing', '2021-01-01') "
        "ON CONFLICT (consumer) DO UPDATE SET purge_watermark = excluded.purge_watermark"
    )
    conn.execute(
        "INSERT INTO inbox.retention_policy VALUES ('billing', 'orders', '1 day', '1 day', '1 day', "
        "'1 day', '1 day', '1 day', '1 day', '1 day', 'test')"
    )
    # (0.3.0: expired only up to the latest produced_at a purge deleted)
    conn.execute(
        "INSERT INTO inbox.purge_state (consumer, producer, watermark, purged_produced_max) "
        "VALUES ('billing', 'orders', '2021-01-01', '2021-01-01')"
    )
    with channel(broker) as ch:
        deep = b"[" * 100_000 + b"]" * 100_000
        big = json.dumps({"id": "big", "amount": 1, "pad": "x" * 30_000_000}).encode()
        messages = [
            Out("m1", credit("m1")),  # applied
            Out("m1", credit("m1"), nats_msg_id="m1-after-the-window"),  # duplicate
            Out("m1", credit("m1", 99)),  # conflict (JetStream lets it through)
            Out("old", credit("old"), produced_at="2020-06-01T00:00:00+00:00"),  # expired
            Out("neg", credit("neg", -5)),  # failed, then quarantined
            Out("x", credit("x"), producer=None),  # 22004: no producer
            Out("j1", None, raw_body=b"{not json"),  # 22P02
            Out("d1", None, raw_body=deep),  # 22P02: nested 100,000 deep
            Out(
                "f1",
                credit("f1"),
                timestamp=datetime.datetime(2200, 1, 1, tzinfo=datetime.UTC),
                produced_at="2200-01-01T00:00:00+00:00",
            ),  # 22008: out of range
            Out("m2", credit("m2")),  # applied, after the bad ones
        ]
        expected_dead = {"22004": 1, "22P02": 2, "22008": 1}
        if len(big) <= ch.max_body:
            messages.insert(5, Out("big", None, raw_body=big))  # 54000: over max_payload_bytes
            expected_dead["54000"] = 1
        ch.publish(messages)
        consumer = make_consumer(ch, db_dsn, retry_delay=0.2, max_retry_delay=0.4, prefetch=20)
        with caplog.at_level(logging.WARNING, logger="pginbox.consumer"), ConsumerThread(consumer):
            wait_for(
                lambda: consumer.stats.outcomes.get("quarantined", 0) == 1,
                "the failing message quarantined",
                timeout=75,
            )
            wait_for(lambda: ch.pending() == 0, "every message settled")
        outcomes = dict(consumer.stats.outcomes)
        assert outcomes == {
            "applied": 2,
            "duplicate": 1,
            "conflict": 1,
            "expired": 1,
            "failed": 1,
            "quarantined": 1,
            "dead_letter": sum(expected_dead.values()),
        }, outcomes
        assert ledger_counts(conn) == {"m1": 1, "m2": 1}
        assert dead_states(ch) == Counter(expected_dead)
        assert all(h.get("Pginbox-Reason") for h, _ in ch.dead_letters())
        # the conflict, the expiry and the quarantine, each logged with the identity
        lines = [r.getMessage() for r in caplog.records]
        for event, mid in (("message_conflict", "m1"), ("message_expired", "old"), ("message_quarantined", "neg")):
            assert any(
                line.startswith(event) and f"message_id={mid}" in line and "producer=orders" in line for line in lines
            ), (event, lines)
    if broker == "nats":  # the 30 MB body: refused by the server (max_payload) before any consumer sees it
        with channel("nats") as ch, pytest.raises(Exception, match=r"(?i)payload"):
            ch.publish([Out("big", None, raw_body=big)])


# ------------------------------------------------------------------------------------------------ 3


class Attempts:
    """A Python handler that always fails and records when it ran."""

    times: ClassVar[list[float]] = []

    @classmethod
    async def handler(cls, cur: psycopg.AsyncCursor[Any], message: Message) -> None:
        cls.times.append(time.monotonic())
        raise ValueError("the service refuses it")


@pytest.mark.parametrize("broker", ADAPTERS)
def test_failed_comes_back_later_with_a_growing_delay(broker: str, conn: Conn, db_dsn: str) -> None:
    setup_domain(conn)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 4)")
    Attempts.times = []
    with channel(broker) as ch:
        ch.publish([Out("f", credit("f"))])
        consumer = make_consumer(ch, db_dsn, handler=Attempts.handler, retry_delay=0.4, max_retry_delay=1.6)
        with ConsumerThread(consumer):
            wait_for(
                lambda: consumer.stats.outcomes.get("quarantined", 0) == 1, "quarantined at max_attempts", timeout=60
            )
            wait_for(lambda: ch.pending() == 0, "the quarantined message acked")
            time.sleep(0.5)  # nothing comes back after the quarantine
        assert len(Attempts.times) == 4, Attempts.times  # never a hot loop: one run per attempt
        gaps = [b - a for a, b in zip(Attempts.times, Attempts.times[1:], strict=False)]
        assert gaps[0] >= 0.4 * 0.95 and gaps[1] >= 0.8 * 0.95 and gaps[2] >= 1.6 * 0.95, gaps
        assert gaps[2] > gaps[0], gaps
        assert consumer.stats.outcomes == {"failed": 3, "quarantined": 1}, consumer.stats.outcomes


# ------------------------------------------------------------------------------------------------ 4


class Crash(BaseException):
    """Not an Exception: it goes through AsyncInbox and the consumer like a process crash."""


async def crashing_handler(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
    raise Crash(message.message_id)


@pytest.mark.parametrize("broker", [*ADAPTERS, "rabbitmq-quorum"])
def test_crash_loop_markers_end_in_quarantine(broker: str, conn: Conn, db_dsn: str) -> None:
    setup_domain(conn)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    with channel(broker) as ch:
        ch.publish([Out("boom", credit("boom"))])
        crashes = 0
        for _ in range(6):
            consumer = make_consumer(ch, db_dsn, handler=crashing_handler, prefetch=1, claim_idle=1.0)
            runner = ConsumerThread(consumer).__enter__()

            def over(runner: ConsumerThread = runner, consumer: Any = consumer) -> bool:
                return not runner.alive or consumer.stats.outcomes.get("quarantined", 0) == 1

            wait_for(over, "a crash or the quarantine", timeout=30)
            if runner.alive:
                runner.stop()
                break
            assert isinstance(runner.error, Crash)
            crashes += 1
        else:
            raise AssertionError("the crash loop never ended in quarantine")
        assert 1 <= crashes <= 3
        wait_for(lambda: ch.pending() == 0, "the quarantined message acked")
        row = conn.execute("SELECT count(*) FROM inbox.quarantine WHERE message_id = 'boom'").fetchone()
        assert row is not None and row[0] == 1
        assert ledger_counts(conn) == {}


# ------------------------------------------------------------------------------------------------ 6, 7

HALTS = {
    # a role bound to 'billing' for tenant 'acme' only; one message of another tenant in the batch
    "42501": (
        ["SELECT inbox.bind_consumer('billing', %(role)s, ARRAY['acme'])"],
        "SELECT inbox.bind_consumer('billing', %(role)s, ARRAY['acme', 'globex'])",
        "bind_consumer",
    ),
    # nobody bound to the consumer name (a forgotten bind_consumer on a new database)
    "42704": ([], "SELECT inbox.bind_consumer('billing', %(role)s)", "bind_consumer"),
    # the registered handler was dropped
    "42883": (
        [
            "SELECT inbox.bind_consumer('billing', %(role)s)",
            "CREATE FUNCTION gone(payload jsonb) RETURNS void LANGUAGE sql AS 'SELECT credit($1)'",
            "SELECT inbox.register_handler('billing', 'credit', 'gone(jsonb)'::regprocedure, 'v2')",
            "DROP FUNCTION gone(jsonb)",
        ],
        "SELECT inbox.register_handler('billing', 'credit', 'credit(jsonb)'::regprocedure, 'v3') "
        "WHERE %(role)s::text IS NOT NULL",
        "register",
    ),
}


@pytest.mark.parametrize("sqlstate", sorted(HALTS))
@pytest.mark.parametrize("broker", ADAPTERS)
def test_configuration_errors_halt_and_never_drain(
    broker: str, sqlstate: str, conn: Conn, db_dsn: str, login_role: Any, caplog: pytest.LogCaptureFixture
) -> None:
    setup_domain(conn)
    dsn = login_role("inbox_consumer")
    role = psycopg.conninfo.conninfo_to_dict(dsn)["user"]
    conn.execute(
        "GRANT SELECT, UPDATE ON account TO {0}; GRANT INSERT ON ledger TO {0}; "
        "GRANT USAGE ON SEQUENCE handler_calls TO {0}; GRANT SELECT ON fail_switch, handler_delay TO {0}".format(
            psycopg.sql.Identifier(str(role)).as_string(conn)
        )
    )
    broken, fix, says = HALTS[sqlstate]
    for statement in broken:
        conn.execute(statement, {"role": role} if "%(role)s" in statement else None)
    tenant_of = {"bad": "globex"} if sqlstate == "42501" else {}
    good = [f"g{i}" for i in range(5)]
    with channel(broker) as ch:
        ch.publish(
            [
                Out(mid, credit(mid), tenant=tenant_of.get(mid, "acme" if sqlstate == "42501" else None))
                for mid in [*good[:2], "bad", *good[2:]]
            ]
        )
        consumer = make_consumer(ch, dsn, prefetch=10, halt_recheck=1.0)
        with caplog.at_level(logging.WARNING, logger="pginbox.consumer"), ConsumerThread(consumer):
            wait_for(lambda: consumer.halted is not None, "the consumer halted", timeout=30)
            halted = consumer.halted
            assert halted is not None and halted["sqlstate"] == sqlstate, halted
            healthy, details = consumer.health()
            assert not healthy and details["halted"]["sqlstate"] == sqlstate
            time.sleep(2.5)  # two rechecks: still halted, nothing drained, nothing dead-lettered
            assert consumer.halted is not None
            if sqlstate == "42501":  # rule 7: the good messages of the batch went through
                assert ledger_counts(conn) == dict.fromkeys(good, 1)
                # Kafka has no per-record ack: the stored offset stops at the held record, and the
                # three applied behind it will be read again as duplicates
                assert ch.pending() == (4 if broker == "kafka" else 1)
            else:
                assert ledger_counts(conn) == {}
                assert ch.pending() == 6
            assert not ch.dead_letters() and consumer.stats.dead_letters == 0
            line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("consumer_halted"))
            assert f"sqlstate={sqlstate}" in line and says in line, line
            conn.execute(fix, {"role": role})
            wait_for(lambda: consumer.halted is None and ch.pending() == 0, "the consumer resumed", timeout=30)
            assert consumer.health()[0]
        assert sum(ledger_counts(conn).values()) == 6


# ------------------------------------------------------------------------------------------------ 1


class Gate:
    """A plain (def) Python handler that holds its transaction open on message 'hold' until let go."""

    entered = threading.Event()
    release = threading.Event()

    @classmethod
    def handler(cls, cur: psycopg.Cursor[Any], message: Message) -> None:
        cur.execute("SELECT apply_credit(1, %s, %s)", (message.payload["id"], message.payload["amount"]))
        if message.message_id == "hold":
            cls.entered.set()
            assert cls.release.wait(30)


@pytest.mark.parametrize("broker", ADAPTERS)
def test_ack_only_after_commit(broker: str, conn: Conn, db_dsn: str) -> None:
    """While a batch's transaction is open, none of its messages is settled; after the COMMIT,
    all are. (A plain def handler: it gets a plain cursor and its writes commit.)"""
    setup_domain(conn)
    Gate.entered.clear()
    Gate.release.clear()
    with channel(broker) as ch:
        ids = ["a1", "a2", "hold", "a3"]
        ch.publish([Out(mid, credit(mid)) for mid in ids])
        consumer = make_consumer(ch, db_dsn, handler=Gate.handler, prefetch=10)
        with ConsumerThread(consumer):
            assert Gate.entered.wait(30)
            time.sleep(0.3)
            assert ch.pending() == 4, "a message was settled before its transaction committed"
            assert ledger_counts(conn) == {}
            Gate.release.set()
            wait_for(lambda: ch.pending() == 0, "every message settled after the COMMIT")
        assert ledger_counts(conn) == dict.fromkeys(ids, 1)
        assert consumer.stats.outcomes == {"applied": 4} and consumer.stats.transactions == 1


# ------------------------------------------------------------------------------------------------ 8


def slow_credit(cur: psycopg.Cursor[Any], message: Message) -> None:
    """handler = "test_broker_conformance:slow_credit" (in a `pginbox consume` subprocess)."""
    cur.execute("SELECT apply_credit(1, %s, %s), pg_sleep(0.01)", (message.payload["id"], message.payload["amount"]))


class MidBatchCrash:
    calls = 0

    @classmethod
    async def handler(cls, cur: psycopg.AsyncCursor[Any], message: Message) -> None:
        await cur.execute("SELECT apply_credit(1, %s, %s)", (message.payload["id"], message.payload["amount"]))
        cls.calls += 1
        if cls.calls == 25:  # in the middle of a batch, its transaction open
            raise Crash("the process dies")


@pytest.mark.parametrize("broker", ADAPTERS)
def test_crash_mid_batch_loses_nothing(broker: str, conn: Conn, db_dsn: str) -> None:
    setup_domain(conn)
    total = 200
    ids = [f"k{i}" for i in range(total)]
    with channel(broker) as ch:
        ch.publish([Out(mid, credit(mid)) for mid in ids])
        if broker in REAL:
            env = subprocess_env(ch, db_dsn, handler="test_broker_conformance:slow_credit", prefetch=20, claim_idle=2.0)
            proc = subprocess.Popen(
                [sys.executable, "-m", "pginbox", "consume"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_for(lambda: sum(ledger_counts(conn).values()) >= 30, "some messages applied")
                # mid-batch: its transaction open
                wait_for(
                    lambda: (
                        conn.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                            "'pginbox-consume:billing' AND xact_start IS NOT NULL"
                        ).fetchone()
                        != (0,)
                    ),
                    "a batch in progress",
                    interval=0.001,
                )
                os.kill(proc.pid, signal.SIGKILL)
            finally:
                proc.wait(10)
        else:
            MidBatchCrash.calls = 0
            consumer = make_consumer(ch, db_dsn, handler=MidBatchCrash.handler, prefetch=20)
            runner = ConsumerThread(consumer).__enter__()
            runner.join(30)
            assert isinstance(runner.error, Crash)
        done = sum(ledger_counts(conn).values())
        assert 0 < done < total
        consumer = make_consumer(ch, db_dsn, handler=slow_credit, prefetch=20, claim_idle=2.0)
        with ConsumerThread(consumer):
            wait_for(lambda: sum(ledger_counts(conn).values()) == total, "every message applied", timeout=90)
            wait_for(lambda: ch.pending() == 0, "every message settled")
        assert ledger_counts(conn) == dict.fromkeys(ids, 1)


@pytest.mark.parametrize("broker", REAL)
def test_sigterm_finishes_the_batch(broker: str, conn: Conn, db_dsn: str) -> None:
    setup_domain(conn)
    total = 200
    with channel(broker) as ch:
        ch.publish([Out(f"s{i}", credit(f"s{i}")) for i in range(total)])
        env = subprocess_env(ch, db_dsn, handler="test_broker_conformance:slow_credit", prefetch=20)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pginbox", "consume"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: sum(ledger_counts(conn).values()) >= 30, "some messages applied")
            proc.send_signal(signal.SIGTERM)
            _out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err
        applied = ledger_counts(conn)
        assert all(n == 1 for n in applied.values()) and 0 < len(applied) < total
        # everything applied was acked: what the broker still holds is exactly the rest
        wait_for(
            lambda: ch.pending() == total - len(applied), "the broker holding exactly the unapplied rest", timeout=15
        )
