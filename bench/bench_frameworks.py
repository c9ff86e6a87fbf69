"""Celery and FastStream through pginbox against the same framework's hand-written handler running
the article's statements, in the same run, on the same broker (RabbitMQ) and database (a private
cluster, fsync on). The machine may be shared: compare ratios of one run, not absolute figures.

  celery hand        a `celery worker -P solo` running a hand-written acks_late task: the
                     article's statements in one transaction (INSERT .. ON CONFLICT DO NOTHING
                     RETURNING; UPDATE account; UPDATE consumer_inbox SET processed_at)
  celery pginbox     the same worker running an inbox_task (claim, UPDATE account)
  faststream hand    a FastStream RabbitBroker subscriber, manual ack: the article's statements,
                     then msg.ack()
  faststream pginbox inbox_subscriber (claim, UPDATE account; ack through pginbox's adapter)
  ratios             pginbox / hand per framework (target >= 0.8)

Messages are preloaded; the rate is (n - 1) / (last commit - first commit), read from the
database (processed_at), so that worker start-up is not counted. Workloads are interleaved over
--rounds rounds; the median of each is reported.
Usage:  .venv/bin/python bench/bench_frameworks.py [--messages 2000] [--rounds 3]
Broker: PGINBOX_BENCH_RABBITMQ_URL (amqp://guest:guest@127.0.0.1:5672/); its queues are deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import aio_pika
import psycopg
from _celery_bench_app import ARTICLE
from benchlib import bench_database
from celery import Celery
from faststream import AckPolicy
from faststream.rabbit import RabbitBroker, RabbitMessage, RabbitQueue
from psycopg_pool import AsyncConnectionPool

from pginbox import AsyncInbox, Message
from pginbox.integrations.celery import identity
from pginbox.integrations.faststream import close, inbox_subscriber

URL = os.environ.get("PGINBOX_BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
SETUP = """
CREATE TABLE account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO account (id) SELECT g FROM generate_series(1, 1000) g;
CREATE TABLE consumer_inbox (
  consumer_name text NOT NULL, producer_name text NOT NULL, message_id text NOT NULL,
  payload_sha256 text NOT NULL, received_at timestamptz NOT NULL DEFAULT now(),
  processed_at timestamptz, handler_version text NOT NULL,
  PRIMARY KEY (consumer_name, producer_name, message_id));
"""


def rate(conn: psycopg.Connection[Any], kind: str, run: str, n: int, timeout: float = 600.0) -> float:
    """Messages per second of run `run` once its n messages are processed."""
    if kind == "hand":
        query = (
            "SELECT count(*), extract(epoch FROM max(processed_at) - min(processed_at)) FROM consumer_inbox "
            "WHERE producer_name = %s AND processed_at IS NOT NULL"
        )
    else:
        query = (
            "SELECT count(*), extract(epoch FROM max(processed_at) - min(processed_at)) FROM inbox.message "
            "WHERE consumer = 'bench' AND producer = %s"
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute(query, (run,)).fetchone()
        assert row is not None
        if row[0] >= n:
            return (n - 1) / max(float(row[1]), 1e-6)
        time.sleep(0.2)
    raise SystemExit(f"{kind} {run}: timed out")


async def delete_queues(*names: str) -> None:
    amqp = await aio_pika.connect(URL)
    try:
        for name in names:
            for delete in ("queue_delete", "exchange_delete"):  # Celery declares an exchange per queue
                ch = await amqp.channel()
                with contextlib.suppress(Exception):
                    await getattr(ch, delete)(name)
    finally:
        await amqp.close()


# ----------------------------------------------------------------------------- celery


def celery_run(conn: psycopg.Connection[Any], dsn: str, kind: str, n: int) -> float:
    queue, run = f"bench_celery_{uuid.uuid4().hex[:8]}", f"shop-{uuid.uuid4().hex[:8]}"
    sender = Celery("bench_sender", broker=URL)
    sender.conf.task_default_queue = queue
    with sender.producer_or_acquire() as producer:
        for i in range(n):
            payload = {"account": 1 + i % 1000, "amount": 1}
            if kind == "hand":
                sender.send_task("bench.hand", args=(payload, f"m{i}", run), producer=producer)
            else:
                ident = identity(message_id=f"m{i}", producer=run, message_type="bench.pginbox")
                sender.send_task("bench.pginbox", args=(payload,), kwargs={"pginbox": ident}, producer=producer)
    env = {
        **os.environ,
        "PGINBOX_BENCH_BROKER": URL,
        "PGINBOX_BENCH_QUEUE": queue,
        "PGINBOX_DSN": dsn,
        "PYTHONPATH": str(HERE),
    }
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "_celery_bench_app",
            "worker",
            "-P",
            "solo",
            "-Q",
            queue,
            "-n",
            f"{queue}@localhost",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "WARNING",
        ],
        cwd=HERE,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return rate(conn, kind, run, n)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        asyncio.run(delete_queues(queue, f"{queue}.dead"))


# ----------------------------------------------------------------------------- faststream


async def preload(queue: str, run: str, n: int) -> None:
    amqp = await aio_pika.connect(URL)
    try:
        ch = await amqp.channel(publisher_confirms=True)
        await ch.declare_queue(queue, durable=True)
        for start in range(0, n, 500):
            await asyncio.gather(
                *(
                    ch.default_exchange.publish(
                        aio_pika.Message(
                            json.dumps({"account": 1 + i % 1000, "amount": 1}).encode(),
                            message_id=f"m{i}",
                            app_id=run,
                            type="credit",
                            content_type="application/json",
                        ),
                        routing_key=queue,
                    )
                    for i in range(start, min(n, start + 500))
                )
            )
    finally:
        await amqp.close()


def faststream_run(conn: psycopg.Connection[Any], dsn: str, kind: str, n: int) -> float:
    queue, run = f"bench_fs_{uuid.uuid4().hex[:8]}", f"shop-{uuid.uuid4().hex[:8]}"
    asyncio.run(preload(queue, run, n))
    stop = threading.Event()

    async def main() -> None:
        broker = RabbitBroker(URL, logger=None)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False)
        await pool.open()
        target = RabbitQueue(queue, durable=True)
        if kind == "hand":
            hconn = await psycopg.AsyncConnection.connect(dsn)
            lock = asyncio.Lock()  # one connection, as pginbox's pool of one

            @broker.subscriber(target, ack_policy=AckPolicy.MANUAL)
            async def hand(body: dict[str, Any], msg: RabbitMessage) -> None:
                raw = msg.raw_message
                async with lock, hconn.transaction():
                    cur = await hconn.execute(ARTICLE[0], ("bench", raw.app_id, raw.message_id, raw.body))
                    if await cur.fetchone() is not None:
                        await hconn.execute(ARTICLE[1], (body["amount"], body["account"]))
                        await hconn.execute(ARTICLE[2], ("bench", raw.app_id, raw.message_id))
                await msg.ack()

        else:

            async def make() -> AsyncInbox:
                return AsyncInbox(pool, consumer="bench")

            async def credit(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
                await cur.execute(ARTICLE[1], (message.payload["amount"], message.payload["account"]))

            inbox_subscriber(broker, target, url=URL, inbox=make)(credit)
        async with broker:
            await broker.start()
            while not stop.is_set():
                await asyncio.sleep(0.1)
        await close(broker)
        await pool.close()
        if kind == "hand":
            await hconn.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    try:
        return rate(conn, kind, run, n)
    finally:
        stop.set()
        thread.join(60)
        asyncio.run(delete_queues(queue, f"{queue}.dead"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frameworks", default="celery,faststream")
    args = parser.parse_args()
    frameworks = [f for f in args.frameworks.split(",") if f]
    results: dict[str, list[float]] = {}
    with bench_database() as (_cluster, dsn), psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SETUP)
        runners = {"celery": celery_run, "faststream": faststream_run}
        for round_no in range(1, args.rounds + 1):
            for framework in frameworks:
                for kind in ("hand", "pginbox"):
                    label = f"{framework} {kind}"
                    value = runners[framework](conn, dsn, kind, args.messages)
                    results.setdefault(label, []).append(value)
                    print(f"round {round_no}: {label:20s} {value:8.0f} /s", flush=True)
    median = {label: statistics.median(v) for label, v in results.items()}
    print(f"\nmedians over {args.rounds} round(s), {args.messages} messages each:")
    for label, value in median.items():
        print(f"  {label:20s} {value:8.0f} /s")
    print("ratios:")
    for framework in frameworks:
        ratio = median[f"{framework} pginbox"] / median[f"{framework} hand"]
        print(f"  {framework}: pginbox / hand-written = {ratio:.2f}  (target >= 0.8)")


if __name__ == "__main__":
    main()
