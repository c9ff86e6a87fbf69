"""`pginbox consume` from Kafka (issue 23), on a private Tansu broker: offsets stored in the batch's
transaction with the claims; a SIGKILL mid-batch skips nothing and applies nothing twice; two
consumers racing on a partition are fenced (IRK01) instead of committing twice; an offset rewind
reads everything again and re-applies nothing; failures are retried with a growing delay on their
partition only, quarantined at max_attempts; bad input goes to the dead-letter topic with its
SQLSTATE; produced_at comes from CreateTime.

What Tansu lacks (tests/python/helpers_kafka.py): idempotent producers (not used), persistence (no
broker restart here), correct ListOffsets (a partition's end is computed from what the test
produced).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers_brokers import ConsumerThread, wait_for
from helpers_inbox import ledger_counts, setup_domain
from helpers_kafka import Tansu, start_tansu
from helpers_paths import pythonpath

from pginbox.client.outcomes import Message
from pginbox.consumer import Consumer, load_consume_config

pytestmark = pytest.mark.timeout(180)
Conn = psycopg.Connection[tuple[Any, ...]]
PARTITIONS = 4


@pytest.fixture(scope="module")
def tansu() -> Iterator[Tansu]:
    yield from start_tansu()


def topic_name() -> str:
    return f"orders-{uuid.uuid4().hex[:8]}"


def record(mid: str, amount: int = 10, *, key: str | None = None, **headers: str) -> dict[str, Any]:
    return {
        "value": json.dumps({"id": mid, "amount": amount}).encode(),
        "key": key or mid,
        "headers": {"Pginbox-Producer": "shop", "Pginbox-Message-Id": mid, "Pginbox-Type": "credit", **headers},
    }


def settings(broker: Tansu, topic: str, **extra: Any) -> dict[str, Any]:
    # a group per test: a group that members of an earlier test left keeps rebalancing a while
    return {"url": broker.url, "consumer": "billing", "topic": topic, "durable": f"group-{topic}", **extra}


def make(broker: Tansu, topic: str, dsn: str, *, handler: Any = None, **extra: Any) -> Consumer:
    config = load_consume_config(None, settings(broker, topic, **extra))
    return Consumer(config, dsn, handler=handler, fetch_timeout=0.2, max_pause=0.5, database_timeout=2.0)


def stored(conn: Conn, topic: str) -> dict[int, int]:
    rows = conn.execute(
        "SELECT partition_id, next_offset FROM inbox.kafka_offset WHERE consumer = 'billing' AND topic = %s "
        "AND next_offset IS NOT NULL",
        (topic,),
    ).fetchall()
    return {int(p): int(n) for p, n in rows}


def ends(produced: list[tuple[int, int]]) -> dict[int, int]:
    """Each partition's end offset, from what was produced (Tansu's ListOffsets is wrong)."""
    out: dict[int, int] = {}
    for partition, offset in produced:
        out[partition] = max(out.get(partition, 0), offset + 1)
    return out


def test_offsets_stored_with_the_claims(tansu: Tansu, conn: Conn, db_dsn: str) -> None:
    setup_domain(conn)
    topic = topic_name()
    tansu.create_topic(topic, PARTITIONS)
    ids = [f"m{i}" for i in range(40)]
    produced = tansu.produce(topic, [record(m) for m in ids])
    assert len({p for p, _ in produced}) > 1, "the records spread over several partitions"
    consumer = make(tansu, topic, db_dsn, prefetch=10)
    with ConsumerThread(consumer):
        wait_for(lambda: sum(ledger_counts(conn).values()) == len(ids), "every record applied")
        wait_for(lambda: stored(conn, topic) == ends(produced), "the offsets stored")
    assert ledger_counts(conn) == dict.fromkeys(ids, 1)
    # a clean stop released the partitions, and the group's committed offsets are the hint
    assert conn.execute("SELECT bool_and(released) FROM inbox.kafka_offset WHERE topic = %s", (topic,)).fetchone() == (
        True,
    )
    assert consumer.stats.outcomes == {"applied": len(ids)}
    # produced_at: the records' CreateTime
    row = conn.execute("SELECT min(produced_at) FROM inbox.message WHERE consumer = 'billing'").fetchone()
    assert row is not None and row[0] is not None
    assert abs((datetime.datetime.now(datetime.UTC) - row[0]).total_seconds()) < 120

    # The same ids again (a producer that resent them): duplicates, nothing applied twice.
    produced += tansu.produce(topic, [record(m) for m in ids[:10]])
    consumer = make(tansu, topic, db_dsn, prefetch=10)
    with ConsumerThread(consumer):
        wait_for(lambda: stored(conn, topic) == ends(produced), "the offsets past the repeats")
    assert consumer.stats.outcomes == {"duplicate": 10}
    assert ledger_counts(conn) == dict.fromkeys(ids, 1)


def test_rewind_reads_everything_again_and_applies_nothing(tansu: Tansu, conn: Conn, db_dsn: str) -> None:
    """An operator rewinds the stored offsets to 0 (inbox.kafka_reset_offsets): everything is read
    again, all duplicates, nothing re-applied. Rewound while the consumer runs, its next batch's
    store is fenced (IRK01), rolls back, and it acquires the partitions again at 0. The group's
    committed offset (the broker's) is only a hint: rewinding it alone changes nothing."""
    setup_domain(conn)
    topic = topic_name()
    tansu.create_topic(topic, PARTITIONS)
    ids = [f"r{i}" for i in range(30)]
    produced = tansu.produce(topic, [record(m) for m in ids])
    consumer = make(tansu, topic, db_dsn, prefetch=8)
    with ConsumerThread(consumer):
        wait_for(lambda: stored(conn, topic) == ends(produced), "everything consumed")
    # stopped: the next start acquires the rewound offsets
    assert conn.execute("SELECT inbox.kafka_reset_offsets('billing', %s, 0)", (topic,)).fetchone() == (
        len(ends(produced)),
    )
    consumer = make(tansu, topic, db_dsn, prefetch=8)
    with ConsumerThread(consumer):
        wait_for(lambda: consumer.stats.outcomes.get("duplicate", 0) == len(ids), "everything read again")
        wait_for(lambda: stored(conn, topic) == ends(produced), "the offsets back at the end")
        # running: the rewind fences the owner at its next batch (one more record brings one)
        conn.execute("SELECT inbox.kafka_reset_offsets('billing', %s, 0)", (topic,))
        produced += tansu.produce(topic, [record("r-late")])
        wait_for(lambda: consumer.stats.outcomes.get("duplicate", 0) >= 2 * len(ids), "everything read again")
        wait_for(lambda: stored(conn, topic) == ends(produced), "the offsets back at the end")
    assert ledger_counts(conn) == dict.fromkeys([*ids, "r-late"], 1)
    assert consumer.stats.outcomes.get("applied") == 1

    # The broker's committed offsets rewound to 0: a hint, never read back.
    asyncio.run(_commit_group(tansu, topic, f"group-{topic}", dict.fromkeys(ends(produced), 0)))
    consumer = make(tansu, topic, db_dsn, prefetch=8)
    with ConsumerThread(consumer):
        wait_for(lambda: consumer.health()[1]["broker_connected"], "connected")
        time.sleep(2.0)
    assert consumer.stats.consumed == 0


async def _commit_group(broker: Tansu, topic: str, group: str, offsets: dict[int, int]) -> None:
    from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped]

    c = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in offsets]
        c.assign(tps)
        await c.commit({TopicPartition(topic, p): o for p, o in offsets.items()})
    finally:
        await c.stop()


def slow_credit(cur: psycopg.Cursor[Any], message: Message) -> None:
    """handler = "test_kafka:slow_credit" (in a `pginbox consume` subprocess)."""
    cur.execute("SELECT apply_credit(1, %s, %s), pg_sleep(0.01)", (message.payload["id"], message.payload["amount"]))


def test_sigkill_mid_batch_skips_nothing_applies_nothing_twice(tansu: Tansu, conn: Conn, db_dsn: str) -> None:
    setup_domain(conn)
    topic = topic_name()
    tansu.create_topic(topic, PARTITIONS)
    ids = [f"k{i}" for i in range(300)]
    produced = tansu.produce(topic, [record(m) for m in ids])
    env = {
        **os.environ,
        "PGINBOX_DSN": db_dsn,
        "PYTHONPATH": pythonpath(),
        **{
            f"PGINBOX_CONSUME_{k.upper()}": str(v)
            for k, v in settings(tansu, topic, handler="test_kafka:slow_credit", prefetch=20).items()
        },
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "pginbox", "consume"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: sum(ledger_counts(conn).values()) >= 40, "some records applied", timeout=60)
        wait_for(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pginbox-consume:billing' "
                    "AND xact_start IS NOT NULL"
                ).fetchone()
                != (0,)
            ),
            "a batch in progress",
            interval=0.001,
        )
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    done = sum(ledger_counts(conn).values())
    assert 0 < done < len(ids)
    before = stored(conn, topic)
    assert conn.execute(
        "SELECT bool_and(NOT released) FROM inbox.kafka_offset WHERE topic = %s", (topic,)
    ).fetchone() == (True,), "a killed owner released nothing"
    consumer = make(tansu, topic, db_dsn, handler=slow_credit, prefetch=20)
    with ConsumerThread(consumer):
        wait_for(lambda: sum(ledger_counts(conn).values()) == len(ids), "every record applied", timeout=90)
        wait_for(lambda: stored(conn, topic) == ends(produced), "the offsets at the end")
    assert ledger_counts(conn) == dict.fromkeys(ids, 1)
    # What the dead process had read past its stored offsets came back marked redelivered, and
    # was announced (inbox.record_start: one start each), not re-applied.
    assert consumer.stats.redeliveries > 0
    assert sum(before.values()) <= done
    assert consumer.stats.outcomes.get("applied", 0) == len(ids) - done


class Gate:
    """A handler that blocks the first batch until released (to hold a transaction open)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.proceed = False
        self.calls = 0

    async def __call__(self, cur: psycopg.AsyncCursor[Any], message: Message) -> None:
        self.calls += 1
        await cur.execute("SELECT apply_credit(1, %s, %s)", (message.payload["id"], message.payload["amount"]))
        while not self.proceed:
            await asyncio.sleep(0.02)


def test_two_consumers_racing_on_a_partition_are_fenced(tansu: Tansu, conn: Conn, db_dsn: str) -> None:
    """Consumer A holds a batch of partition 0 open; the partition is acquired by B meanwhile (the
    generation advances, as a rebalance does: here by inbox.kafka_acquire from a second member).
    A's store is refused (IRK01): its whole transaction rolls back, claims and writes included;
    the records are applied once, by whoever owns the partition after."""
    setup_domain(conn)
    topic = topic_name()
    tansu.create_topic(topic, 1)
    ids = [f"f{i}" for i in range(5)]
    produced = tansu.produce(topic, [record(m, partition=0) if False else {**record(m), "partition": 0} for m in ids])
    gate = Gate()
    a = make(tansu, topic, db_dsn, handler=gate, prefetch=10)
    with ConsumerThread(a):
        wait_for(lambda: gate.calls >= 1, "A's batch in its transaction")
        # B takes the partition over (what a rebalance's assignment does), reading what is stored.
        row = conn.execute(
            "SELECT generation, next_offset FROM inbox.kafka_acquire('billing', %s, %s, 'B')", ([topic], [0])
        ).fetchone()
        assert row is not None and row[1] is None, "nothing stored yet: A's batch is still open"
        gate.proceed = True
        wait_for(lambda: a.stats.outcomes.get("applied", 0) == len(ids), "A applied them after acquiring again")
        wait_for(lambda: stored(conn, topic) == ends(produced), "the offset stored")
    assert ledger_counts(conn) == dict.fromkeys(ids, 1)
    # A's first batch was fenced and rolled back; A acquired the partition again and re-read it.
    assert a.stats.transactions >= 2


def test_two_group_members_share_the_partitions(tansu: Tansu, conn: Conn, db_dsn: str) -> None:
    """Two consumers of one group on 4 partitions, the second started and stopped mid-way
    (rebalances): every record applied exactly once, the offsets at the topic's end."""
    setup_domain(conn)
    topic = topic_name()
    tansu.create_topic(topic, PARTITIONS)
    ids = [f"g{i}" for i in range(200)]
    produced = tansu.produce(topic, [record(m) for m in ids[:100]])
    a = make(tansu, topic, db_dsn, handler=slow_credit, prefetch=10)
    with ConsumerThread(a):
        wait_for(lambda: sum(ledger_counts(conn).values()) >= 20, "A started")
        b = make(tansu, topic, db_dsn, handler=slow_credit, prefetch=10)
        with ConsumerThread(b):
            produced += tansu.produce(topic, [record(m) for m in ids[100:]])
            wait_for(lambda: sum(ledger_counts(conn).values()) >= 150, "both at work", timeout=90)
        wait_for(lambda: sum(ledger_counts(conn).values()) == len(ids), "every record applied", timeout=90)
        wait_for(lambda: stored(conn, topic) == ends(produced), "the offsets at the end", timeout=30)
    assert ledger_counts(conn) == dict.fromkeys(ids, 1)


def test_failures_retry_on_their_partition_then_quarantine(tansu: Tansu, conn: Conn, db_dsn: str) -> None:
    """A record whose handler fails comes back after a growing delay, its partition paused; the
    other partitions go on; at max_attempts it is quarantined and its partition moves on."""
    setup_domain(conn)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    topic = topic_name()
    tansu.create_topic(topic, 2)
    bad = {
        "value": json.dumps({"id": "bad", "amount": 1, "sqlstate": "P0001"}).encode(),
        "partition": 0,
        "headers": {"Pginbox-Producer": "shop", "Pginbox-Message-Id": "bad", "Pginbox-Type": "raising_credit"},
    }
    records = (
        [bad]
        + [{**record(f"p0-{i}"), "partition": 0} for i in range(3)]
        + [{**record(f"p1-{i}"), "partition": 1} for i in range(20)]
    )
    produced = tansu.produce(topic, records)
    consumer = make(tansu, topic, db_dsn, prefetch=5, retry_delay=0.3, max_retry_delay=1.0)
    with ConsumerThread(consumer):
        wait_for(lambda: consumer.stats.outcomes.get("quarantined", 0) == 1, "quarantined at max_attempts")
        wait_for(lambda: stored(conn, topic) == ends(produced), "both partitions at their end")
    counts = ledger_counts(conn)
    assert {k: v for k, v in counts.items() if k != "bad"} == {
        **{f"p0-{i}": 1 for i in range(3)},
        **{f"p1-{i}": 1 for i in range(20)},
    }
    assert consumer.stats.outcomes.get("failed", 0) == 2 and consumer.stats.retried == 2
    assert conn.execute(
        "SELECT count(*) FROM inbox.quarantine WHERE consumer = 'billing' AND message_id = 'bad'"
    ).fetchone() == (1,)


def test_bad_input_to_the_dead_letter_topic(tansu: Tansu, conn: Conn, db_dsn: str) -> None:
    setup_domain(conn)
    topic = topic_name()
    tansu.create_topic(topic, 1)
    tansu.create_topic(f"{topic}.dead", 1)
    records = [
        {**record("ok-1"), "partition": 0},
        {
            "value": b"{not json",
            "partition": 0,
            "headers": {"Pginbox-Producer": "shop", "Pginbox-Message-Id": "nj", "Pginbox-Type": "credit"},
        },
        {"value": b'{"id": "x"}', "partition": 0, "headers": {"Pginbox-Producer": "shop", "Pginbox-Type": "credit"}},
        {**record("ok-2"), "partition": 0},
    ]
    produced = tansu.produce(topic, records)
    consumer = make(tansu, topic, db_dsn, prefetch=10)
    with ConsumerThread(consumer):
        wait_for(lambda: stored(conn, topic) == ends(produced), "past the bad records")
    assert ledger_counts(conn) == {"ok-1": 1, "ok-2": 1}
    dead = tansu.read_all(f"{topic}.dead", expect=2)
    states = Counter(dict(r.headers)["Pginbox-Sqlstate"].decode() for r in dead)
    assert states == Counter({"22P02": 1, "22004": 1})
    origins = sorted(dict(r.headers)["Pginbox-Original"].decode() for r in dead)
    assert origins == [f"{topic}:0:1", f"{topic}:0:2"]


def test_position_as_identity_is_an_explicit_opt_in(tansu: Tansu) -> None:
    from pginbox.errors import ConsumerConfigError

    with pytest.raises(ConsumerConfigError, match="position"):
        load_consume_config(None, settings(tansu, "t", message_id="offset"))
    config = load_consume_config(None, settings(tansu, "t", message_id="position"))
    assert config.sources["message_id"].name == "position"


def test_destination_keys_headers_and_batched_reports(tansu: Tansu, conn: Conn, db_dsn: str) -> None:
    """The dispatcher's Kafka destination: the ordering key as the record key (one key, one
    partition, order kept), the idempotency key in Pginbox-Message-Id, acks=all, one batch's
    reports awaited together (no idempotent producer: Tansu refuses InitProducerId). A consumer
    downstream applies each once and answers a resend `duplicate`."""
    from pginbox.transports.config import transport_from_options
    from pginbox.transports.effect import Effect

    setup_domain(conn)
    topic = topic_name()
    tansu.create_topic(topic, PARTITIONS)
    transport: Any = transport_from_options(
        "orders", {"url": tansu.url, "topic": topic, "producer": "shop", "message_type": "credit"}
    )
    effects = [
        Effect(
            f"e{i}",
            "orders",
            {"id": f"e{i}", "amount": 1},
            ordering_key=f"customer-{i % 3}",
            idempotency_key=f"ik-e{i}",
        )
        for i in range(30)
    ]
    try:
        reports = transport.deliver_batch(effects)
        assert all(r.delivered for r in reports), [r.error for r in reports if not r.delivered]
        assert all(r.delivered for r in transport.deliver_batch(effects[:5]))  # a resend, same keys
    finally:
        transport.close()
    records = tansu.read_all(topic, expect=35)
    assert len(records) == 35
    by_key: dict[bytes, set[int]] = {}
    order: dict[bytes, list[str]] = {}
    for r in records:
        by_key.setdefault(r.key, set()).add(r.partition)
        order.setdefault(r.key, []).append(json.loads(r.value)["id"])
        assert dict(r.headers)["Pginbox-Message-Id"].decode() == f"ik-{json.loads(r.value)['id']}"
    assert all(len(p) == 1 for p in by_key.values()), "one key, one partition"
    for key, seen in order.items():
        first = seen[: len(seen) - sum(1 for e in effects[:5] if e.ordering_key == key.decode())]
        assert first == [e.effect_id for e in effects if e.ordering_key == key.decode()], "commit order per key"
    consumer = make(tansu, topic, db_dsn, prefetch=16)
    with ConsumerThread(consumer):
        wait_for(lambda: consumer.stats.consumed == 35, "every record consumed")
        wait_for(lambda: sum(stored(conn, topic).values()) == 35, "offsets at the end")
    assert consumer.stats.outcomes == {"applied": 30, "duplicate": 5}


def test_docs_kafka_examples(tmp_path: Any, conn: Conn) -> None:
    """Every example of docs/kafka.md: the [consume] table and the destination load as the page
    says; the SQL blocks run in order and leave what the page describes."""
    import re
    from pathlib import Path

    from conftest import REPO_ROOT

    from pginbox.transports import load_config

    page = (Path(REPO_ROOT) / "docs" / "kafka.md").read_text()
    tomls = re.findall(r"```toml\n(.*?)```", page, re.S)
    sqls = re.findall(r"```sql\n(.*?)```", page, re.S)
    assert len(tomls) == 2 and len(sqls) == 2
    path = tmp_path / "consume.toml"
    path.write_text(tomls[0])
    config = load_consume_config(path)
    assert (config.broker, config.topic, config.durable, config.dead_letter_target) == (
        "kafka",
        "orders",
        "billing",
        "orders.dead",
    )
    assert config.sources["produced_at"].describe() == "header Pginbox-Produced-At, else create_time"
    path = tmp_path / "destinations.toml"
    path.write_text(tomls[1])
    transports: dict[str, Any] = load_config(path, environ={}, use_entry_points=False)
    try:
        assert type(transports["shipments"]).__name__ == "KafkaTransport"
        assert transports["shipments"].topic == "shop.shipments"
    finally:
        for t in transports.values():
            t.close()
    results = []
    for block in sqls:
        for statement in [s for s in re.split(r";[ \t]*(?:--[^\n]*)?\n", block) if s.strip()]:
            results.append(conn.execute(statement).fetchall())
    assert results[0] == [("orders", 0, 1, None, True)]
    assert results[2] == [(0, 42, 1, False)]
    assert results[3] == [(1,)] and results[4] == [(1,)]
    assert conn.execute("SELECT partition_id, next_offset FROM inbox.kafka_offset ORDER BY 1").fetchall() == [
        (0, 0),
        (2, 100),
    ]
