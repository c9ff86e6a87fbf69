"""Survive a failover (issue 24): every message the broker considers acked has its effect on the
promoted database.

A private primary and a streaming standby (helpers_replication), RabbitMQ (127.0.0.1:5672, a queue
of the test's own), `pginbox consume` in a subprocess at full speed (SQL handler, batches of 50)
connected with libpq multi-host and target_session_attrs=read-write. Mid-stream the standby is
made to lag (its walreceiver SIGSTOPped: the primary, asynchronous, goes on committing), the
primary is SIGKILLed (postmaster and every server process), the standby's walreceiver is killed
(the WAL in flight is lost) and the standby promoted. The consumer reconnects to it by itself.
Then, with the consumer stopped, the count:

    acked     = published - what is still in the queue (RabbitMQ deleted the others: acked)
    effects   = ledger rows on the promoted database
    lost      = acked - effects

With durability `commit` (ack after COMMIT on the primary) the loss is there: the test fails if
it is not, so the check demonstrably can fail. With durability `standby` (ack once the standby
flushed the commit, inbox.wait_durable) the loss is zero, over repeated runs; the consumer counts
the batches the standby did not confirm (handed back, not acked), and notices the failover (a new
WAL timeline: pginbox_consumer_failovers_total, log line failover_detected).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
import pytest
from helpers_brokers import RABBIT_URL, Channel, Out, require, wait_for
from helpers_replication import Golden, ReplicatedPair

pytestmark = pytest.mark.timeout(300)

SETUP = """
CREATE TABLE ledger(message_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());  -- no unique key
CREATE FUNCTION failover_credit(payload jsonb) RETURNS void LANGUAGE sql AS $$
  INSERT INTO ledger(message_id) VALUES (payload->>'id');
$$;
SELECT inbox.register_handler('billing', 'credit', 'failover_credit(jsonb)'::regprocedure, 'v1');
"""

MESSAGES = 8000


@pytest.fixture(scope="module")
def golden() -> Iterator[Golden]:
    require("rabbitmq")
    g = Golden(SETUP)
    try:
        yield g
    finally:
        g.destroy()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def count(dsn: str, query: str = "SELECT count(*) FROM ledger") -> int:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=3) as conn:
        row = conn.execute(query).fetchone()
        assert row is not None
        return int(row[0])


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def _drain(queue: str) -> list[str]:
    """The message ids still in the queue (the consumer is stopped: its unacked ones are back)."""
    conn = await aio_pika.connect(RABBIT_URL)
    try:
        ch = await conn.channel()
        q = await ch.declare_queue(queue, durable=True)
        ids: list[str] = []
        while (m := await q.get(no_ack=True, fail=False)) is not None:
            ids.append(str(m.message_id))
        return ids
    finally:
        await conn.close()


def run_failover(golden: Golden, durability: str, tmp_path: Path) -> dict[str, Any]:
    pair = ReplicatedPair(golden)
    ch = Channel("rabbitmq")
    proc: subprocess.Popen[bytes] | None = None
    try:
        ids = [f"m{i:05d}-{uuid.uuid4().hex[:6]}" for i in range(MESSAGES)]
        ch.publish([Out(message_id=i, payload={"id": i}) for i in ids])
        health = free_port()
        settings = {
            "consumer": "billing",
            "url": RABBIT_URL,
            "queue": ch.name,
            "prefetch": 50,
            "durability": durability,
        }
        if durability == "standby":
            settings.update({"standby_names": "standby1", "durability_timeout": 1.0})
        env = {
            **os.environ,
            "PGINBOX_DSN": pair.dsn(),
            **{f"PGINBOX_CONSUME_{k.upper()}": str(v) for k, v in settings.items()},
        }
        log = (tmp_path / "consume.log").open("w")  # a file: a full pipe would block its logging
        proc = subprocess.Popen(
            [sys.executable, "-m", "pginbox", "consume", "--health-port", str(health)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        primary = pair.primary_dsn()
        wait_for(lambda: count(primary) >= 500, "the consumer to apply 500 messages", timeout=60)
        before_lag = metrics(health)
        pair.stop_wal()
        lag_start = count(primary)
        if durability == "commit":
            wait_for(lambda: count(primary) >= lag_start + 400, "400 commits while the standby lags", timeout=30)
        else:
            # a batch committed on the primary, the standby does not confirm it: handed back, and
            # its redeliveries are duplicates whose acks wait for the same commit
            wait_for(
                lambda: (
                    count(primary) > lag_start and metrics(health).get("pginbox_consumer_not_durable_total", 0) >= 2
                ),
                "a commit the standby does not confirm, handed back twice",
                timeout=30,
            )
        committed_on_primary = count(primary)
        pair.crash_primary()
        pair.promote()
        promoted = pair.standby_dsn()
        wait_for(
            lambda: metrics(health).get("pginbox_consumer_failovers_total", 0) >= 1,
            "the consumer to notice the failover",
            timeout=60,
        )
        if durability == "commit":
            # it goes on with the new primary
            after = count(promoted)
            wait_for(lambda: count(promoted) >= after + 200, "the consumer to apply on the new primary", timeout=60)
        final = metrics(health)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
        stderr = (tmp_path / "consume.log").read_text()
        assert proc.returncode == 0, stderr[-3000:]
        remaining = set(asyncio.run(_drain(ch.name)))
        with psycopg.connect(promoted, autocommit=True) as conn:
            rows = [r[0] for r in conn.execute("SELECT message_id FROM ledger").fetchall()]
        effects = set(rows)
        acked = set(ids) - remaining
        return {
            "acked": acked,
            "lost": acked - effects,
            "effects": effects,
            "duplicates": len(rows) - len(effects),
            "strangers": effects - set(ids),
            "committed_on_primary": committed_on_primary,
            "before_lag": before_lag,
            "metrics": final,
            "stderr": stderr,
        }
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        ch.delete()
        pair.destroy()


def test_ack_after_commit_loses_acked_messages_in_a_failover(golden: Golden, tmp_path: Path) -> None:
    """The control run: durability `commit` acks what the standby never got; the count shows it."""
    started = time.monotonic()
    r = run_failover(golden, "commit", tmp_path)
    print(
        f"commit: acked={len(r['acked'])} lost={len(r['lost'])} effects={len(r['effects'])} "
        f"in {time.monotonic() - started:.1f} s"
    )
    assert r["duplicates"] == 0 and not r["strangers"]
    assert r["metrics"].get("pginbox_consumer_failovers_total") == 1
    assert "failover_detected" in r["stderr"] and "from_timeline=1" in r["stderr"] and "to_timeline=2" in r["stderr"]
    assert len(r["lost"]) > 0, (
        "durability commit lost nothing: the failover did not open a window; the test proves nothing"
    )


@pytest.mark.parametrize("run", [1, 2])
def test_ack_after_standby_loses_nothing_in_a_failover(golden: Golden, run: int, tmp_path: Path) -> None:
    started = time.monotonic()
    r = run_failover(golden, "standby", tmp_path)
    m = r["metrics"]
    print(
        f"standby run {run}: acked={len(r['acked'])} lost={len(r['lost'])} effects={len(r['effects'])} "
        f"not_durable={m.get('pginbox_consumer_not_durable_total')} in {time.monotonic() - started:.1f} s"
    )
    assert len(r["acked"]) >= 500, "too little was acked before the failover for the run to mean anything"
    assert r["committed_on_primary"] > len(r["acked"]), "the primary committed nothing the standby lacked"
    assert not r["lost"], f"{len(r['lost'])} acked messages have no effect on the promoted database"
    assert r["duplicates"] == 0 and not r["strangers"]
    # the wait engaged: the batches committed while the standby lagged were handed back, not acked
    assert m.get("pginbox_consumer_not_durable_total", 0) >= 1
    assert m.get("pginbox_consumer_failovers_total") == 1
    assert "commit_not_durable" in r["stderr"] and "failover_detected" in r["stderr"]


async def _drain_ids(queue: str) -> list[str]:
    conn = await aio_pika.connect(RABBIT_URL)
    try:
        ch = await conn.channel()
        q = await ch.declare_queue(queue, durable=True)
        ids: list[str] = []
        while (m := await q.get(no_ack=True, fail=False)) is not None:
            ids.append(str(m.message_id))
        await q.delete(if_unused=False, if_empty=False)
        return ids
    finally:
        await conn.close()


def test_dispatcher_delivers_again_what_the_failover_took_back(golden: Golden, tmp_path: Path) -> None:
    """The outbox side: effects committed (and on the standby) before the standby lagged; the
    dispatcher delivers them to RabbitMQ and reports complete_effect on the primary only; the
    primary dies, the standby is promoted, the dispatcher reconnects by itself: every effect on
    the surviving database is delivered, at least once, with its one key; the completions the
    failover took back show up as deliveries again (the dispatcher's at-least-once at work)."""
    effects = 1500
    pair = ReplicatedPair(golden)
    queue = f"t_{uuid.uuid4().hex[:10]}"
    proc: subprocess.Popen[bytes] | None = None
    try:
        with psycopg.connect(pair.primary_dsn(), autocommit=True) as conn:
            conn.execute("SELECT inbox.configure_destination('failover', 1000, '50 milliseconds', '500 milliseconds')")
            with conn.transaction():
                conn.execute(
                    "SELECT inbox.enqueue_effect('fx-' || i, 'failover', jsonb_build_object('i', i)) "
                    "FROM generate_series(1, %s) i",
                    (effects,),
                )
            row = conn.execute("SELECT inbox.wait_durable(timeout => '10 seconds')").fetchone()
            assert row is not None and row[0] is True, "the standby did not get the effects"
        dest = tmp_path / "dest.toml"
        dest.write_text(
            f'[destinations.failover]\nurl = "{RABBIT_URL}"\nrouting_key = "{queue}"\nproducer = "svc"\ntimeout = 3.0\n'
        )
        asyncio.run(_declare(queue))
        pair.stop_wal()  # from now on the standby misses every complete_effect
        health = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGINBOX_")}
        log = (tmp_path / "dispatch.log").open("w")  # a file: a full pipe would block its logging
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pginbox",
                "dispatch",
                "--dsn",
                pair.dsn(),
                "--config",
                str(dest),
                "--name",
                "failover",
                "--lease",
                "3",
                "--poll-interval",
                "0.2",
                "--health-port",
                str(health),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        primary = pair.primary_dsn()
        delivered = "SELECT count(*) FROM inbox.outbox WHERE status = 'delivered'"
        wait_for(lambda: count(primary, delivered) >= 300, "300 deliveries reported on the primary", timeout=60)
        pair.crash_primary()
        pair.promote()
        promoted = pair.standby_dsn()
        wait_for(lambda: count(promoted, delivered) == effects, "every effect delivered on the new primary", timeout=60)
        final = metrics(health)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
        stderr = (tmp_path / "dispatch.log").read_text()
        received = asyncio.run(_drain_ids(queue))
        with psycopg.connect(promoted, autocommit=True) as conn:
            query = "SELECT inbox.idempotency_key(consumer, tenant, effect_id) FROM inbox.outbox"
            keys = {r[0] for r in conn.execute(query).fetchall()}
        assert len(keys) == effects
        missing = keys - set(received)
        again = len(received) - len(set(received))
        print(f"dispatcher: effects={effects} received={len(received)} delivered again={again}")
        assert not missing, f"{len(missing)} effects of the surviving database were never delivered"
        assert set(received) <= keys
        assert again > 0, "no completion was taken back by the failover: the run proves nothing"
        assert final.get("pginbox_dispatcher_failovers_total") == 1, stderr[-2000:]
        assert "failover_detected" in stderr
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        pair.destroy()


async def _declare(queue: str) -> None:
    conn = await aio_pika.connect(RABBIT_URL)
    try:
        ch = await conn.channel()
        await ch.declare_queue(queue, durable=True)
    finally:
        await conn.close()
