"""`pginbox demo --act 4`: the broker chain runs against the real brokers, and is skipped with a
line saying so when they are not reachable."""

from __future__ import annotations

import os
import socket

import psycopg
import pytest
from helpers_brokers import NATS_URL, RABBIT_URL, REDIS_URL, require
from test_demo import run_demo

pytestmark = pytest.mark.timeout(180)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_act4_runs_on_every_broker(db_dsn: str) -> None:
    require("rabbitmq")
    require("nats")
    require("redis")
    env = {
        **os.environ,
        "PGINBOX_DEMO_RABBITMQ_URL": RABBIT_URL,
        "PGINBOX_DEMO_NATS_URL": NATS_URL,
        "PGINBOX_DEMO_REDIS_URL": REDIS_URL,
    }
    result = run_demo("--act", "4", "--dsn", db_dsn, env=env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "rabbitmq: CHAIN HOLDS" in out and "nats: CHAIN HOLDS" in out and "redis: CHAIN HOLDS" in out
    assert out.count("ok: every committed order recorded once at B") == 3
    assert "FAILED" not in out and "skipped" not in out
    # RabbitMQ and Redis: the inbox absorbs republishes
    assert out.count("20 absorbed by B's inbox as duplicates") == 2
    assert "20 dropped by the broker's duplicate window" in out  # JetStream: the stream drops them first
    # the database agrees: one follow-up effect per committed order, for each broker's run
    with psycopg.connect(db_dsn) as conn:
        rows = conn.execute(
            "SELECT destination, count(*), count(DISTINCT effect_id) FROM inbox.outbox "
            "WHERE destination LIKE 'pginbox-demo-followup-%' GROUP BY destination"
        ).fetchall()
    assert len(rows) == 3 and all(n == distinct == 178 for _, n, distinct in rows), rows


def test_act4_skipped_without_brokers(db_dsn: str) -> None:
    env = {
        **os.environ,
        "PGINBOX_DEMO_RABBITMQ_URL": f"amqp://guest:guest@127.0.0.1:{closed_port()}/",
        "PGINBOX_DEMO_NATS_URL": f"nats://127.0.0.1:{closed_port()}",
        "PGINBOX_DEMO_REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0",
    }
    result = run_demo("--act", "4", "--dsn", db_dsn, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rabbitmq: skipped: no broker at amqp://127.0.0.1:" in result.stdout
    assert "nats: skipped: no broker at nats://127.0.0.1:" in result.stdout
    assert "redis: skipped: no broker at redis://127.0.0.1:" in result.stdout
    assert "guest:guest" not in result.stdout  # no credentials printed
    assert "CHAIN" not in result.stdout
