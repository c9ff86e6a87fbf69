"""Act 4 of `pginbox demo`: two services chained through a real broker (RabbitMQ, NATS JetStream,
Redis Streams).

Service A commits an order and its effect in one transaction (some transactions roll back); the
real Dispatcher publishes the effects through the broker destination (RabbitMQTransport /
JetStreamTransport / RedisStreamsTransport, confirms batched); service B is a pginbox Consumer
(what `pginbox consume` runs) whose SQL handler records the order and enqueues a follow-up
effect. Midway, B is stopped and started again, and a batch of effects is published a second
time, as a publisher whose confirms were lost would: B's inbox (and, on JetStream, the stream's
duplicate window) absorbs them. Both services use the demo's database here (in production B has its own).

The proof: every order committed at A was recorded once at B with one follow-up effect; no
rolled-back order was published; the repeats were counted and absorbed.

A broker that is not reachable (PGINBOX_DEMO_RABBITMQ_URL, default amqp://guest:guest@127.0.0.1:5672/;
PGINBOX_DEMO_NATS_URL, default nats://127.0.0.1:4222; PGINBOX_DEMO_REDIS_URL, default
redis://127.0.0.1:6379/0) is skipped with one line saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from typing import Any, TextIO

import psycopg
from psycopg import sql

__all__ = ["BROKER_URLS", "run"]

BROKER_URLS = {
    "rabbitmq": ("PGINBOX_DEMO_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    "nats": ("PGINBOX_DEMO_NATS_URL", "nats://127.0.0.1:4222"),
    "redis": ("PGINBOX_DEMO_REDIS_URL", "redis://127.0.0.1:6379/0"),
}


def _reachable(url: str) -> bool:
    hostport = url.split("://", 1)[-1].split("@")[-1].split("/")[0]
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def _say(out: TextIO | None, text: str) -> None:
    print(text, file=out, flush=True)


def run(dsn: str, *, orders: int = 200, out: TextIO | None = None) -> bool:
    """Act 4 for each broker: True unless a check failed (a skipped broker is not a failure)."""
    ok = True
    _say(out, "\nAct 4: two services chained through a broker: A -> dispatcher -> broker -> pginbox consume -> B")
    for broker, (variable, default) in BROKER_URLS.items():
        url = os.environ.get(variable, default)
        if not _reachable(url):
            _say(out, f"   {broker}: skipped: no broker at {_safe(url)} (set {variable} to run this part)")
            continue
        try:
            import aio_pika  # noqa: F401
            import nats  # noqa: F401
            import redis  # noqa: F401
        except ImportError:
            _say(
                out,
                f"   {broker}: skipped: the broker extras are not installed "
                "(pip install 'pginbox[rabbitmq,nats,redis]')",
            )
            continue
        ok = _Chain(dsn, broker, url, orders, out).run() and ok
    return ok


def _safe(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.split('@')[-1]}"


class _Chain:
    def __init__(self, dsn: str, broker: str, url: str, orders: int, out: TextIO | None) -> None:
        self.dsn = dsn
        self.broker = broker
        self.url = url
        self.orders = orders
        self.out = out
        self.run_id = uuid.uuid4().hex[:8]
        self.dest = f"pginbox-demo-chain-{self.run_id}"
        self.follow = f"pginbox-demo-followup-{self.run_id}"
        self.consumer = f"pginbox-demo-b-{self.run_id}"
        self.queue = f"pginbox-demo-{self.run_id}"
        self.stream = f"PGINBOX_DEMO_{self.run_id.upper()}"
        self.subject = f"pginbox.demo.{self.run_id}"
        self.schema = f"pginbox_demo4_{self.run_id}"

    def say(self, text: str) -> None:
        _say(self.out, text)

    def setup(self, conn: psycopg.Connection[Any]) -> None:
        s = sql.Identifier(self.schema)
        conn.execute(
            sql.SQL(
                "CREATE SCHEMA {s}; CREATE TABLE {s}.orders(id text PRIMARY KEY, amount int NOT NULL);"
                "CREATE TABLE {s}.received(id text NOT NULL, amount int NOT NULL)"
            ).format(s=s)
        )
        conn.execute(
            sql.SQL("""
            CREATE FUNCTION {s}.order_placed(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
            BEGIN
              INSERT INTO {s}.received VALUES (payload->>'id', (payload->>'amount')::int);
              PERFORM inbox.enqueue_effect('follow-' || (payload->>'id'), {follow}, payload);
            END $$""").format(s=s, follow=sql.Literal(self.follow))
        )
        conn.execute(
            "SELECT inbox.register_handler(%s, 'order_placed', %s::regprocedure, 'v1')",
            (self.consumer, f"{self.schema}.order_placed(jsonb)"),
        )
        conn.execute("SELECT inbox.bind_destination(%s, %s)", (self.follow, self.consumer))
        conn.execute("SELECT inbox.configure_destination(%s, 100, '50 milliseconds', '1 second')", (self.dest,))

    def broker_setup(self, delete: bool = False) -> None:
        async def go() -> None:
            if self.broker == "redis":  # the stream and B's group are created by B; delete what is left
                if delete:
                    import redis.asyncio as aioredis

                    client = aioredis.from_url(self.url)
                    try:
                        await client.delete(self.queue, f"{self.queue}:dead", f"{self.queue}:retry")
                    finally:
                        await client.aclose()
                return
            if self.broker == "rabbitmq":
                import aio_pika

                connection = await aio_pika.connect(self.url, timeout=5)
                try:
                    channel = await connection.channel()
                    if delete:
                        for name in (self.queue, f"{self.queue}.dead"):
                            await channel.queue_delete(name)
                    else:
                        await channel.declare_queue(self.queue, durable=True)
                finally:
                    await connection.close()
                return
            from pginbox.brokers.jetstream import connect_nats

            nc = await connect_nats(self.url)
            try:
                js = nc.jetstream()
                if delete:
                    await js.delete_stream(self.stream)
                else:
                    await js.add_stream(name=self.stream, subjects=[self.subject], duplicate_window=120.0)
            finally:
                await nc.close()

        asyncio.run(go())

    def run(self) -> bool:
        from pginbox.brokers.jetstream import JetStreamTransport
        from pginbox.brokers.publish import BrokerDestination
        from pginbox.brokers.rabbitmq import RabbitMQTransport
        from pginbox.brokers.redis import RedisStreamsTransport
        from pginbox.consumer import Consumer, load_consume_config
        from pginbox.dispatcher import Dispatcher

        transport: BrokerDestination
        if self.broker == "redis":
            transport = RedisStreamsTransport(
                self.url, stream=self.queue, producer="svc-a", message_type="order_placed", destination=self.dest
            )
            source: dict[str, str] = {"stream": self.queue}
            where = f"stream {self.queue}"
        elif self.broker == "rabbitmq":
            transport = RabbitMQTransport(
                self.url, routing_key=self.queue, producer="svc-a", message_type="order_placed", destination=self.dest
            )
            source = {"queue": self.queue}
            where = f"queue {self.queue}"
        else:
            transport = JetStreamTransport(
                self.url, subject=self.subject, producer="svc-a", message_type="order_placed", destination=self.dest
            )
            source = {"stream": self.stream, "subject": self.subject, "durable": self.consumer}
            where = f"stream {self.stream}"
        config = load_consume_config(None, {"url": self.url, "consumer": self.consumer, "prefetch": 20, **source})
        started = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            self.setup(conn)
            self.broker_setup()
            self.say(
                f"   {self.broker} ({_safe(self.url)}, {where}): A commits {self.orders} orders, each with its "
                "effect; every 9th transaction rolls back"
            )
            dispatcher = Dispatcher(
                self.dsn, f"demo-{self.run_id}", {self.dest: transport}, batch_size=50, poll_interval=0.2, lease=10.0
            )
            dispatch_thread = threading.Thread(target=dispatcher.run, daemon=True)
            consumers: list[Consumer] = []

            def start_consumer() -> threading.Thread:
                consumer = Consumer(config, self.dsn, fetch_timeout=0.2)
                consumers.append(consumer)
                thread = threading.Thread(target=lambda: asyncio.run(consumer.run()), daemon=True)
                thread.start()
                return thread

            committed: list[str] = []
            rolled_back: list[str] = []
            try:
                dispatch_thread.start()
                b_thread = start_consumer()
                for i in range(self.orders):
                    oid = f"{self.run_id}-o{i}"  # effect ids are unique per consumer: one per demo run
                    with conn.transaction(force_rollback=i % 9 == 4):
                        conn.execute(
                            sql.SQL("INSERT INTO {}.orders VALUES (%s, %s)").format(sql.Identifier(self.schema)),
                            (oid, i),
                        )
                        conn.execute(
                            "SELECT inbox.enqueue_effect(%s, %s, %s::jsonb)",
                            (oid, self.dest, json.dumps({"id": oid, "amount": i})),
                        )
                    (rolled_back if i % 9 == 4 else committed).append(oid)
                    if i == self.orders // 2:
                        consumers[-1].stop()  # B stops mid-stream (finishing its batch) and starts again
                        b_thread.join(30)
                        b_thread = start_consumer()
                # a publisher whose confirms were lost publishes again, with the same keys
                from pginbox.transports import Effect

                keys: dict[str, str] = dict(
                    conn.execute(
                        "SELECT effect_id, CASE WHEN key_scoped THEN inbox.idempotency_key(consumer, tenant, effect_id)"
                        " ELSE effect_id END FROM inbox.outbox WHERE destination = %s AND effect_id = ANY(%s)",
                        (self.dest, committed[:20]),
                    ).fetchall()
                )
                again = [
                    Effect(
                        oid, self.dest, {"id": oid, "amount": int(oid.rsplit("-o", 1)[1])}, idempotency_key=keys[oid]
                    )
                    for oid in committed[:20]
                ]
                transport.deliver_batch(again)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and self._received_count(conn) < len(committed):
                    time.sleep(0.1)
                time.sleep(0.5)
            finally:
                for consumer in consumers:
                    consumer.stop()
                b_thread.join(30)
                dispatcher.stop()
                dispatch_thread.join(30)
                dispatcher.close()
                transport.close()
                try:
                    self.broker_setup(delete=True)
                except Exception as exc:  # leave it: the names are unique
                    self.say(f"   (could not delete the demo's {where}: {exc})")
            return self.check(conn, committed, rolled_back, consumers, transport, time.monotonic() - started)

    def _received_count(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            sql.SQL("SELECT count(DISTINCT id) FROM {}.received").format(sql.Identifier(self.schema))
        ).fetchone()
        return int(row[0]) if row else 0

    def check(
        self,
        conn: psycopg.Connection[Any],
        committed: list[str],
        rolled_back: list[str],
        consumers: list[Any],
        transport: Any,
        seconds: float,
    ) -> bool:
        rows = conn.execute(
            sql.SQL("SELECT id, count(*) FROM {}.received GROUP BY id").format(sql.Identifier(self.schema))
        ).fetchall()
        got = {r[0]: int(r[1]) for r in rows}
        follow = conn.execute(
            "SELECT count(*), count(DISTINCT effect_id) FROM inbox.outbox WHERE destination = %s", (self.follow,)
        ).fetchone()
        duplicates = sum(c.stats.outcomes.get("duplicate", 0) for c in consumers)
        broker_dropped = getattr(transport, "duplicates", 0)
        checks = [
            (
                "every committed order recorded once at B",
                set(got) == set(committed) and all(n == 1 for n in got.values()),
            ),
            ("one follow-up effect each", follow == (len(committed), len(committed))),
            ("no rolled-back order published", not set(got) & set(rolled_back)),
        ]
        self.say(
            f"      committed {len(committed)}, rolled back {len(rolled_back)}, recorded at B {len(got)}, "
            f"in {seconds:.1f} s; B stopped and restarted once"
        )
        self.say(
            f"      republished 20: {duplicates} absorbed by B's inbox as duplicates, {broker_dropped} dropped by "
            "the broker's duplicate window"
        )
        ok = True
        for label, passed in checks:
            self.say(f"      {'ok' if passed else 'FAILED'}: {label}")
            ok = ok and passed
        self.say(f"   {self.broker}: {'CHAIN HOLDS' if ok else 'CHAIN BROKEN'}")
        return ok
