"""Broker destinations of the dispatcher (pginbox.brokers.rabbitmq / .jetstream / .redis) against the real
brokers: what a published effect carries, batched confirms, unroutable and missing streams as
deferrals (no attempt spent), republished effects absorbed, and the TOML / environment configuration."""

from __future__ import annotations

import asyncio
import hashlib
import json
import textwrap
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import nats
import psycopg
import pytest
from helpers_brokers import NATS_URL, RABBIT_URL, Channel, channel, wait_for
from prometheus_client import generate_latest

from pginbox.brokers.jetstream import JetStreamTransport
from pginbox.brokers.rabbitmq import RabbitMQTransport
from pginbox.dispatcher import Dispatcher
from pginbox.transports import CallableTransport, Effect, load_config
from pginbox.transports.config import destination_type
from pginbox.transports.effect import idempotency_key

pytestmark = pytest.mark.timeout(90)
Conn = psycopg.Connection[tuple[Any, ...]]


def enqueue(conn: Conn, ids: list[str], destination: str, ordering_key: str | None = None) -> None:
    with conn.transaction():
        for effect_id in ids:
            conn.execute(
                "SELECT inbox.enqueue_effect(%s, %s, %s::jsonb, %s::jsonb, %s)",
                (
                    effect_id,
                    destination,
                    json.dumps({"id": effect_id}),
                    json.dumps({"Pginbox-Type": "credit"}),
                    ordering_key,
                ),
            )


def statuses(conn: Conn) -> dict[str, tuple[str, int, str | None]]:
    rows = conn.execute("SELECT effect_id, status::text, attempts, last_error FROM inbox.outbox").fetchall()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


class CountingBatches:
    """Wraps a BatchTransport, counting deliver_batch calls and effects."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batches: list[int] = []

    def deliver(self, effect: Any) -> Any:
        self.batches.append(1)
        return self.inner.deliver(effect)

    def deliver_batch(self, effects: Any) -> Any:
        self.batches.append(len(effects))
        return self.inner.deliver_batch(effects)


def rabbit_messages(queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    async def read() -> list[aio_pika.abc.AbstractIncomingMessage]:
        conn = await aio_pika.connect(RABBIT_URL)
        try:
            ch = await conn.channel()
            q = await ch.declare_queue(queue, durable=True)
            out = []
            while (m := await q.get(no_ack=True, fail=False)) is not None:
                out.append(m)
            return out
        finally:
            await conn.close()

    return asyncio.run(read())


def test_rabbitmq_destination(conn: Conn, db_dsn: str) -> None:
    with channel("rabbitmq") as ch:
        asyncio.run(ch._publish([]))  # declares the queue
        transport = RabbitMQTransport(RABBIT_URL, routing_key=ch.name, producer="shop", destination="orders")
        counting = CountingBatches(transport)
        ids = [f"e{i}" for i in range(60)]
        enqueue(conn, ids[:59], "orders")
        enqueue(conn, ids[59:], "orders", ordering_key="cust-7")
        try:
            with Dispatcher(db_dsn, "d1", {"orders": counting}, batch_size=100) as dispatcher:
                dispatcher.run_once()
        finally:
            transport.close()
        assert {s for s, _, _ in statuses(conn).values()} == {"delivered"}
        messages = rabbit_messages(ch.name)
        keys = {idempotency_key("", "", effect_id): effect_id for effect_id in ids}
        assert sorted(keys.get(m.message_id or "", "") for m in messages) == sorted(ids), "message_id: the key"
        sample = next(m for m in messages if m.message_id == idempotency_key("", "", "e59"))
        assert sample.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert sample.app_id == "shop" and sample.type == "credit" and sample.timestamp is not None
        assert (sample.headers or {}).get("Pginbox-Ordering-Key") == "cust-7"
        assert json.loads(sample.body) == {"id": "e59"}
        # confirms were batched: fewer publish batches than effects
        assert sum(counting.batches) == 60 and len(counting.batches) < 60, counting.batches


def test_rabbitmq_unroutable_waits_without_spending_attempts(conn: Conn, db_dsn: str) -> None:
    """Until the consuming service declares its queue, RabbitMQ answers unroutable (mandatory): the
    effects are deferred (inbox.defer_effects), pending with no attempt spent and the reason shown,
    and delivered once the queue exists. They used to go dead after max_attempts (issue 26)."""
    name = f"t_{uuid.uuid4().hex[:10]}"
    transport = RabbitMQTransport(RABBIT_URL, routing_key=name, destination="orders")
    conn.execute("SELECT inbox.configure_destination('orders', 2, '10 milliseconds', '20 milliseconds')")
    enqueue(conn, ["u1", "u2"], "orders")
    try:
        reports = transport.deliver_batch([Effect("u1", "orders", {}), Effect("u2", "orders", {})])
        assert all(not r.delivered and r.defer == "unroutable" and "unroutable" in (r.error or "") for r in reports)
        with Dispatcher(db_dsn, "d1", {"orders": transport}, batch_size=10, defer_after=1.0) as dispatcher:
            for _ in range(3):  # more rounds than max_attempts (2): none is spent
                assert dispatcher.run_once() == 2
                conn.execute("UPDATE inbox.outbox SET available_at = now() WHERE destination = 'orders'")
            assert dispatcher.stats.deferred == 6 and dispatcher.stats.dead == 0
            rows = conn.execute(
                "SELECT status::text, attempts, deferred_reason, deferrals, last_error "
                "FROM inbox.outbox WHERE destination = 'orders'"
            ).fetchall()
            assert [r[:4] for r in rows] == [("pending", 0, "unroutable", 3)] * 2, rows
            assert all("no queue bound for routing key" in r[4] for r in rows)
            metrics = generate_latest(dispatcher.registry).decode()
            assert 'pginbox_dispatcher_deferred_total{destination="orders"} 6.0' in metrics
            assert 'pginbox_dispatcher_dead_total{destination="orders"} 0.0' in metrics

            async def declare() -> None:
                connection = await aio_pika.connect(RABBIT_URL)
                async with connection:
                    await (await connection.channel()).declare_queue(name, durable=True)

            asyncio.run(declare())  # the consuming service is deployed
            conn.execute("UPDATE inbox.outbox SET available_at = now() WHERE destination = 'orders'")
            assert dispatcher.run_once() == 2
        assert {s for s, _, _ in statuses(conn).values()} == {"delivered"}
        assert len(rabbit_messages(name)) == 2
    finally:
        transport.close()

        async def delete() -> None:
            connection = await aio_pika.connect(RABBIT_URL)
            async with connection:
                await (await connection.channel()).queue_delete(name)

        asyncio.run(delete())


def test_jetstream_destination_and_duplicates(conn: Conn, db_dsn: str) -> None:
    with channel("nats") as ch:
        transport = JetStreamTransport(NATS_URL, subject=ch.subject, producer="shop", destination="events")
        counting = CountingBatches(transport)
        ids = [f"n{i}" for i in range(40)]
        enqueue(conn, ids, "events")
        try:
            with Dispatcher(db_dsn, "d1", {"events": counting}, batch_size=100) as dispatcher:
                dispatcher.run_once()
            assert {s for s, _, _ in statuses(conn).values()} == {"delivered"}
            assert sum(counting.batches) == 40 and len(counting.batches) < 40
            # a republish (a confirm lost in transit) is dropped by the stream's duplicate window
            again = transport.deliver_batch(
                [Effect("n3", "events", {"id": "n3"}, idempotency_key=idempotency_key("", "", "n3"))]
            )
            assert again[0].delivered and transport.duplicates == 1
        finally:
            transport.close()

        async def read() -> list[Any]:
            nc = await nats.connect(NATS_URL)
            try:
                js = nc.jetstream()
                info = await js.stream_info(ch.stream)
                return [await js.get_msg(ch.stream, seq) for seq in range(1, info.state.messages + 1)]
            finally:
                await nc.close()

        stored = asyncio.run(read())
        assert len(stored) == 40
        headers = stored[0].headers or {}
        # the scoped key (anonymous enqueue: consumer '' and tenant '') in Pginbox-Message-Id, and
        # Nats-Msg-Id = that key and the body's hash (the window drops only a true repeat)
        assert headers["Pginbox-Message-Id"] in {idempotency_key("", "", i) for i in ids}
        assert headers["Nats-Msg-Id"] == f"{headers['Pginbox-Message-Id']}:{hashlib.sha256(stored[0].data).hexdigest()}"
        assert headers["Pginbox-Producer"] == "shop"
        assert headers["Pginbox-Type"] == "credit" and "Pginbox-Produced-At" in headers


def test_jetstream_without_stream_is_deferred() -> None:
    transport = JetStreamTransport(NATS_URL, subject="pginbox.no.stream.here", destination="events", timeout=2.0)
    try:
        report = transport.deliver_batch([Effect("x1", "events", {})])[0]
    finally:
        transport.close()
    assert not report.delivered and report.retryable and report.error
    assert report.defer == "no_stream", report  # waits for `pginbox outbox provision`, no attempt spent


def test_channel_helper_cleans_up() -> None:
    ch = Channel("rabbitmq")
    ch.delete()


def sink(effect: Any) -> None:
    pass


def factory(level: str = "info") -> Any:
    return CallableTransport(lambda effect: None) if level == "debug" else None


def test_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "dest.toml"
    config.write_text(
        textwrap.dedent(f"""
        [destinations.orders]
        url = "{RABBIT_URL}"
        routing_key = "orders"
        producer = "shop"

        [destinations.events]
        url = "{NATS_URL}"
        subject = "shop.events"

        [destinations.audit]
        callable = "test_broker_transports:sink"

        [destinations.made]
        factory = "test_broker_transports:factory"
        level = "debug"

        [destinations.hook]
        url = "https://example.com/hook"
    """)
    )
    transports = load_config(
        config,
        environ={"PGINBOX_DEST_LATE_CALLABLE": "test_broker_transports:sink", "PGINBOX_DEST_ORDERS_PRODUCER": "shop2"},
        use_entry_points=False,
    )
    try:
        assert isinstance(transports["orders"], RabbitMQTransport) and transports["orders"].producer == "shop2"
        assert isinstance(transports["events"], JetStreamTransport)
        assert isinstance(transports["audit"], CallableTransport)
        assert isinstance(transports["made"], CallableTransport)
        assert isinstance(transports["late"], CallableTransport)
        assert type(transports["hook"]).__name__ == "WebhookTransport"
    finally:
        for t in transports.values():
            close = getattr(t, "close", None)
            if callable(close) and isinstance(t, RabbitMQTransport | JetStreamTransport):
                close()
    assert destination_type("x", {"url": "amqps://h/"}) == "rabbitmq"
    with pytest.raises(ValueError, match="type must be one of"):
        destination_type("x", {"type": "mqtt"})
    with pytest.raises(ValueError, match="needs subject"):
        load_config(None, environ={"PGINBOX_DEST_EV_URL": NATS_URL}, use_entry_points=False)
    with pytest.raises(ValueError, match="module:function"):
        load_config(None, environ={"PGINBOX_DEST_BAD_CALLABLE": "nocolon"}, use_entry_points=False)
    with pytest.raises(ValueError, match="unknown option"):
        bad = tmp_path / "bad.toml"
        bad.write_text(f'[destinations.o]\nurl = "{RABBIT_URL}"\nroutng_key = "x"\n')
        load_config(bad, environ={}, use_entry_points=False)


def test_jetstream_window_drops_only_true_repeats(conn: Conn, db_dsn: str) -> None:
    """Within the stream's duplicate window: the same key with the same body is dropped by the
    stream; the same key with another body reaches the consumer, which quarantines it as a
    conflict (before, Nats-Msg-Id was the id alone and the stream dropped the conflict)."""
    from helpers_brokers import ConsumerThread, make_consumer
    from helpers_inbox import ledger_counts, setup_domain

    setup_domain(conn)
    with channel("nats") as ch:
        transport = JetStreamTransport(NATS_URL, subject=ch.subject, producer="orders", destination="credits")
        try:
            first = Effect("c1", "credits", {"id": "c1", "amount": 10}, {"Pginbox-Type": "credit"})
            again = Effect("c1", "credits", {"id": "c1", "amount": 10}, {"Pginbox-Type": "credit"})
            changed = Effect("c1", "credits", {"id": "c1", "amount": 99}, {"Pginbox-Type": "credit"})
            reports = transport.deliver_batch([first]) + transport.deliver_batch([again, changed])
            assert all(r.delivered for r in reports) and transport.duplicates == 1
        finally:
            transport.close()
        consumer = make_consumer(ch, db_dsn)
        with ConsumerThread(consumer):
            wait_for(lambda: sum(consumer.stats.outcomes.values()) == 2 and ch.pending() == 0, "both consumed")
        assert consumer.stats.outcomes == {"applied": 1, "conflict": 1}, consumer.stats.outcomes
        assert ledger_counts(conn) == {"c1": 1}


def test_redis_destination(conn: Conn, db_dsn: str) -> None:
    """Effects XADDed with the key in Pginbox-Message-Id, a batch in one pipelined round trip, and
    consumed back by `pginbox consume` from the same stream; the key is idempotency_key(effect)."""
    import redis
    from helpers_brokers import ConsumerThread, make_consumer
    from helpers_inbox import ledger_counts, setup_domain

    from pginbox.brokers.redis import RedisStreamsTransport

    setup_domain(conn)
    with channel("redis") as ch:
        transport = RedisStreamsTransport(ch.url, stream=ch.stream, producer="orders", destination="credits")
        counting = CountingBatches(transport)
        ids = [f"r{i}" for i in range(30)]
        with conn.transaction():
            for effect_id in ids:
                conn.execute(
                    "SELECT inbox.enqueue_effect(%s, 'credits', %s::jsonb, %s::jsonb)",
                    (effect_id, json.dumps({"id": effect_id, "amount": 1}), json.dumps({"Pginbox-Type": "credit"})),
                )
        try:
            with Dispatcher(db_dsn, "d1", {"credits": counting}, batch_size=100) as dispatcher:
                dispatcher.run_once()
            assert {s for s, _, _ in statuses(conn).values()} == {"delivered"}
            assert sum(counting.batches) == 30 and len(counting.batches) < 30, counting.batches
            scoped = Effect(
                "e", "credits", {"id": "k", "amount": 1}, {"Pginbox-Type": "credit"}, idempotency_key="scoped-key"
            )
            keyed = transport.deliver_batch([scoped])
            assert keyed[0].delivered
        finally:
            transport.close()
        r = redis.Redis.from_url(ch.url)
        try:
            entries: Any = r.xrange(ch.stream)
        finally:
            r.close()
        fields = [{bytes(k).decode(): bytes(v).decode() for k, v in f.items()} for _, f in entries]
        # the scoped key (anonymous enqueue: consumer '' and tenant ''), delivery_key(effect)
        assert sorted(f["Pginbox-Message-Id"] for f in fields) == sorted(
            [*(idempotency_key("", "", i) for i in ids), "scoped-key"]
        )
        assert {f["Pginbox-Producer"] for f in fields} == {"orders"}
        assert {f["Pginbox-Type"] for f in fields} == {"credit"}
        consumer = make_consumer(ch, db_dsn)
        with ConsumerThread(consumer):
            wait_for(lambda: ch.pending() == 0 and sum(consumer.stats.outcomes.values()) == 31, "consumed")
        assert ledger_counts(conn) == {**dict.fromkeys(ids, 1), "k": 1}
