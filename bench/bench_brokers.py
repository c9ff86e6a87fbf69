"""Broker throughput: `pginbox consume` and the broker destinations against baselines measured in
the same run, on the same broker and database (a private cluster, fsync on). Brokers: RabbitMQ,
NATS JetStream, Redis Streams.

  consume (--parts consume), per broker, messages per second from a preloaded queue / stream:
    hand       a hand-written per-message consumer running the article's statements, one
               transaction per message (BEGIN; INSERT .. ON CONFLICT DO NOTHING RETURNING; UPDATE
               account; UPDATE consumer_inbox SET processed_at; COMMIT), then ack (Redis: XACK, one
               round trip after each commit); broker prefetch 50 (Redis: XREADGROUP COUNT 50)
    pginbox50  pginbox.consumer.Consumer, SQL handler, prefetch 50 (claim_and_apply_batch)
    pginbox1   the same with prefetch 1 (claim_and_apply per message)
    ratios     pginbox50 / hand (target >= 3), pginbox1 / hand (target >= 1.0)

  dispatch (--parts dispatch), per broker, effects per second through the Dispatcher, both with
  --concurrency deliveries in flight per destination (default 1: one publisher):
    confirm1   the broker transport used one effect at a time: each publish waits for its own
               confirm / PubAck / XADD reply (what a dispatcher callable does)
    batched    deliver_batch: a batch published, its confirms awaited together
    ratio      batched / confirm1 (target >= 3)

Workloads are interleaved over --rounds rounds; the median of each is reported.
Usage:  .venv/bin/python bench/bench_brokers.py [--messages 5000] [--effects 5000] [--rounds 3]
        [--brokers rabbitmq,nats,redis] [--parts consume,dispatch]
Brokers: PGINBOX_BENCH_RABBITMQ_URL (amqp://guest:guest@127.0.0.1:5672/), PGINBOX_BENCH_NATS_URL
(nats://127.0.0.1:4222), PGINBOX_BENCH_REDIS_URL (redis://127.0.0.1:6379/0); the queues, streams
and keys it creates are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import aio_pika
import nats
import psycopg
import redis.asyncio as aioredis
from benchlib import bench_database

from pginbox.brokers.jetstream import JetStreamTransport
from pginbox.brokers.rabbitmq import RabbitMQTransport
from pginbox.brokers.redis import RedisStreamsTransport
from pginbox.brokers.wire import Header
from pginbox.consumer import Consumer, load_consume_config
from pginbox.dispatcher import Dispatcher
from pginbox.transports import DeliveryReport

URLS = {
    "rabbitmq": os.environ.get("PGINBOX_BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    "nats": os.environ.get("PGINBOX_BENCH_NATS_URL", "nats://127.0.0.1:4222"),
    "redis": os.environ.get("PGINBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
}

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
"""

ARTICLE = (
    "INSERT INTO consumer_inbox (consumer_name, producer_name, message_id, payload_sha256, handler_version) "
    "VALUES (%s, %s, %s, encode(sha256(%s::bytea), 'hex'), 'v1') ON CONFLICT DO NOTHING RETURNING message_id",
    "UPDATE account SET balance = balance + %s WHERE id = %s",
    "UPDATE consumer_inbox SET processed_at = now() WHERE consumer_name = %s AND producer_name = %s "
    "AND message_id = %s",
)


# ----------------------------------------------------------------------------- broker plumbing


class Place:
    """A queue (RabbitMQ) or a stream + subject (NATS) of one measurement."""

    def __init__(self, broker: str) -> None:
        self.broker = broker
        self.url = URLS[broker]
        self.name = f"bench_{uuid.uuid4().hex[:8]}"
        self.stream = self.name.upper()
        self.subject = f"{self.name}.in"

    async def create(self) -> None:
        if self.broker == "redis":
            return  # XADD creates the stream; consumers create their group
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                await (await conn.channel()).declare_queue(self.name, durable=True)
            finally:
                await conn.close()
            return
        nc = await nats.connect(self.url)
        try:
            await nc.jetstream().add_stream(name=self.stream, subjects=[self.subject])
        finally:
            await nc.close()

    async def delete(self) -> None:
        if self.broker == "redis":
            r = aioredis.from_url(self.url)
            try:
                await r.delete(self.name, f"{self.name}:dead", f"{self.name}:retry")
            finally:
                await r.aclose()
            return
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel()
                for q in (self.name, f"{self.name}.dead"):
                    await ch.queue_delete(q)
            finally:
                await conn.close()
            return
        nc = await nats.connect(self.url)
        try:
            await nc.jetstream().delete_stream(self.stream)
        finally:
            await nc.close()

    async def preload(self, n: int) -> None:
        await self.create()
        bodies = [(f"m{i}", json.dumps({"account": i % 1000 + 1, "amount": 1}).encode()) for i in range(n)]
        if self.broker == "redis":
            r = aioredis.from_url(self.url)
            try:
                for start in range(0, n, 500):
                    async with r.pipeline(transaction=False) as pipe:
                        for mid, body in bodies[start : start + 500]:
                            fields: dict[Any, Any] = {
                                Header.BODY: body,
                                Header.MESSAGE_ID: mid,
                                Header.TYPE: "credit",
                                Header.PRODUCER: "shop",
                            }
                            pipe.xadd(self.name, fields)
                        await pipe.execute()
            finally:
                await r.aclose()
            return
        if self.broker == "rabbitmq":
            conn = await aio_pika.connect(self.url)
            try:
                ch = await conn.channel(publisher_confirms=True)
                for start in range(0, n, 500):
                    await asyncio.gather(
                        *(
                            ch.default_exchange.publish(
                                aio_pika.Message(
                                    body,
                                    message_id=mid,
                                    type="credit",
                                    app_id="shop",
                                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                                ),
                                routing_key=self.name,
                            )
                            for mid, body in bodies[start : start + 500]
                        )
                    )
            finally:
                await conn.close()
            return
        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            for start in range(0, n, 500):
                await asyncio.gather(
                    *(
                        js.publish(
                            self.subject,
                            body,
                            headers={"Nats-Msg-Id": mid, "Pginbox-Type": "credit", "Pginbox-Producer": "shop"},
                        )
                        for mid, body in bodies[start : start + 500]
                    )
                )
        finally:
            await nc.close()


# ----------------------------------------------------------------------------- consume


async def hand_written(place: Place, dsn: str, n: int, consumer: str) -> float:
    """The article's statements per message, ack after COMMIT."""
    conn = await psycopg.AsyncConnection.connect(dsn)
    done = 0
    started = time.perf_counter()

    async def one(mid: str, body: bytes) -> None:
        payload = json.loads(body)
        async with conn.transaction():
            cur = await conn.execute(ARTICLE[0], (consumer, "shop", mid, body))
            if await cur.fetchone() is not None:
                await conn.execute(ARTICLE[1], (payload["amount"], payload["account"]))
                await conn.execute(ARTICLE[2], (consumer, "shop", mid))

    try:
        if place.broker == "redis":
            r = aioredis.from_url(place.url)
            try:
                await r.xgroup_create(place.name, consumer, id="0", mkstream=True)
                while done < n:
                    reply: Any = await r.xreadgroup(consumer, "hand", {place.name: ">"}, count=50, block=5000)
                    for _stream, entries in reply or []:
                        for entry_id, fields in entries:
                            await one(fields[Header.MESSAGE_ID.encode()].decode(), fields[Header.BODY.encode()])
                            await r.xack(place.name, consumer, entry_id)
                            done += 1
            finally:
                await r.aclose()
        elif place.broker == "rabbitmq":
            amqp = await aio_pika.connect(place.url)
            try:
                ch = await amqp.channel()
                await ch.set_qos(prefetch_count=50)
                q = await ch.declare_queue(place.name, durable=True)
                async with q.iterator() as it:
                    async for message in it:
                        await one(message.message_id or "", message.body)
                        await message.ack()
                        done += 1
                        if done >= n:
                            break
            finally:
                await amqp.close()
        else:
            nc = await nats.connect(place.url)
            try:
                sub = await nc.jetstream().pull_subscribe(place.subject, durable=consumer, stream=place.stream)
                while done < n:
                    for message in await sub.fetch(50, timeout=5):
                        await one((message.headers or {})["Nats-Msg-Id"], message.data)
                        await message.ack()
                        done += 1
            finally:
                await nc.close()
    finally:
        await conn.close()
    return n / (time.perf_counter() - started)


def pginbox_consume(place: Place, dsn: str, n: int, consumer: str, prefetch: int) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT inbox.register_handler(%s, 'credit', 'credit(jsonb)'::regprocedure, 'v1')", (consumer,))
    source = (
        {"queue": place.name}
        if place.broker == "rabbitmq"
        else {"stream": place.name}
        if place.broker == "redis"
        else {"stream": place.stream, "subject": place.subject, "durable": consumer}
    )
    config = load_consume_config(None, {"url": place.url, "consumer": consumer, "prefetch": prefetch, **source})
    worker = Consumer(config, dsn, fetch_timeout=0.2)
    started = time.perf_counter()
    thread = threading.Thread(target=lambda: asyncio.run(worker.run()), daemon=True)
    thread.start()
    while sum(worker.stats.outcomes.values()) < n:
        time.sleep(0.005)
        if not thread.is_alive():
            raise SystemExit("the consumer stopped early")
    elapsed = time.perf_counter() - started
    worker.stop()
    thread.join(30)
    return n / elapsed


def measure_consume(broker: str, dsn: str, n: int, kind: str) -> float:
    place = Place(broker)
    consumer = f"{kind}_{uuid.uuid4().hex[:6]}"
    asyncio.run(place.preload(n))
    try:
        if kind == "hand":
            return asyncio.run(hand_written(place, dsn, n, consumer))
        return pginbox_consume(place, dsn, n, consumer, 50 if kind == "pginbox50" else 1)
    finally:
        asyncio.run(place.delete())


# ----------------------------------------------------------------------------- dispatch


class OneAtATime:
    """The broker transport without deliver_batch: each effect's publish waits for its confirm."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def deliver(self, effect: Any) -> DeliveryReport:
        report: DeliveryReport = self.inner.deliver(effect)
        return report


def measure_dispatch(broker: str, dsn: str, n: int, kind: str, concurrency: int) -> float:
    place = Place(broker)
    asyncio.run(place.create())
    destination = f"bench-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(
            "SELECT inbox.enqueue_effect(%s || g, %s, jsonb_build_object('n', g)) FROM generate_series(1, %s) g",
            (destination, destination, n),
        )
    transport: Any = (
        RabbitMQTransport(place.url, routing_key=place.name, destination=destination)
        if broker == "rabbitmq"
        else RedisStreamsTransport(place.url, stream=place.name, destination=destination)
        if broker == "redis"
        else JetStreamTransport(place.url, subject=place.subject, destination=destination)
    )
    chosen = transport if kind == "batched" else OneAtATime(transport)
    try:
        with Dispatcher(
            dsn,
            f"bench-{kind}",
            {destination: chosen},
            batch_size=200,
            poll_interval=0.1,
            concurrency_per_destination=concurrency,
        ) as d:
            started = time.perf_counter()
            d.run_once()
            elapsed = time.perf_counter() - started
            if d.stats.delivered != n:
                raise SystemExit(f"{kind}: delivered {d.stats.delivered} of {n}")
        return n / elapsed
    finally:
        transport.close()
        asyncio.run(place.delete())


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--effects", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--brokers", default="rabbitmq,nats,redis")
    parser.add_argument("--parts", default="consume,dispatch")
    parser.add_argument("--concurrency", type=int, default=1, help="dispatch: deliveries in flight per destination")
    args = parser.parse_args()
    brokers = [b for b in args.brokers.split(",") if b]
    parts = [p for p in args.parts.split(",") if p]
    results: dict[str, list[float]] = {}
    with bench_database() as (_cluster, dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP)
        plan: list[tuple[str, Callable[[], float]]] = []
        for broker in brokers:
            if "consume" in parts:
                for kind in ("hand", "pginbox50", "pginbox1"):
                    plan.append(
                        (f"{broker} consume {kind}", lambda b=broker, k=kind: measure_consume(b, dsn, args.messages, k))
                    )
            if "dispatch" in parts:
                for kind in ("confirm1", "batched"):
                    plan.append(
                        (
                            f"{broker} dispatch {kind}",
                            lambda b=broker, k=kind: measure_dispatch(b, dsn, args.effects, k, args.concurrency),
                        )
                    )
        for round_no in range(1, args.rounds + 1):
            for label, fn in plan:
                rate = fn()
                results.setdefault(label, []).append(rate)
                print(f"round {round_no}: {label:32s} {rate:10.0f} /s", flush=True)
    median = {label: statistics.median(v) for label, v in results.items()}
    print(
        f"\nmedians over {args.rounds} round(s) (messages {args.messages}, effects {args.effects}, "
        f"dispatch concurrency {args.concurrency}):"
    )
    for label, rate in median.items():
        print(f"  {label:32s} {rate:10.0f} /s")
    print("ratios:")
    for broker in brokers:
        if "consume" in parts:
            hand = median[f"{broker} consume hand"]
            print(
                f"  {broker}: pginbox consume prefetch 50 / hand-written = "
                f"{median[f'{broker} consume pginbox50'] / hand:.2f}  (target >= 3)"
            )
            print(
                f"  {broker}: pginbox consume prefetch 1 / hand-written  = "
                f"{median[f'{broker} consume pginbox1'] / hand:.2f}  (target >= 1.0)"
            )
        if "dispatch" in parts:
            print(
                f"  {broker}: dispatch batched confirms / one confirm each = "
                f"{median[f'{broker} dispatch batched'] / median[f'{broker} dispatch confirm1']:.2f}  "
                "(target >= 3)"
            )


if __name__ == "__main__":
    main()
