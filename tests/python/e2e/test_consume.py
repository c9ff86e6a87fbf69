"""`pginbox consume`, the loop (pginbox.consumer) against a real database: a database that refuses
connections, SIGTERM with /healthz and /metrics, Python handlers (async, plain, one that forgets
to await), the configuration. What every broker adapter must do is in test_broker_conformance.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import psycopg
import pytest
from helpers_brokers import ADAPTERS, ConsumerThread, Out, channel, make_consumer, wait_for
from helpers_inbox import ledger_counts, setup_domain
from helpers_proxy import TcpProxy

from pginbox.client.outcomes import Message
from pginbox.consumer import load_consume_config
from pginbox.consumer.config import safe_url

pytestmark = pytest.mark.timeout(120)


def credit(mid: str, amount: int = 10) -> dict[str, Any]:
    return {"id": mid, "amount": amount}


@pytest.mark.parametrize("broker", ADAPTERS)
def test_database_refusing_connections_loses_nothing(broker: str, conn: psycopg.Connection[Any], db_dsn: str) -> None:
    setup_domain(conn)
    # two announced starts would quarantine a message as a crash loop: an outage must not
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    params = psycopg.conninfo.conninfo_to_dict(db_dsn)
    with channel(broker) as ch, TcpProxy(str(params.get("host") or "127.0.0.1"), int(params["port"] or 5432)) as proxy:
        proxy_dsn = psycopg.conninfo.make_conninfo(db_dsn, host="127.0.0.1", port=str(proxy.port))
        proxy.refuse = True
        consumer = make_consumer(ch, proxy_dsn, prefetch=10)
        ch.publish([Out(f"d{i}", credit(f"d{i}")) for i in range(10)])
        with ConsumerThread(consumer):
            if broker == "kafka":
                # Kafka: no partition is read before its stored offset is known (inbox.kafka_acquire)
                wait_for(lambda: consumer.stats.database_outages >= 1, "the outage seen")
                time.sleep(1.0)
                assert consumer.stats.consumed == 0
            else:
                # every message handed back (and redelivered) three times while the database is down
                wait_for(lambda: consumer.stats.handed_back >= 30, "batches handed back while the database is down")
            assert ledger_counts(conn) == {}
            proxy.refuse = False
            wait_for(lambda: sum(ledger_counts(conn).values()) == 10, "every message applied after the outage")
            wait_for(lambda: ch.pending() == 0, "every message acked")
        assert ledger_counts(conn) == {f"d{i}": 1 for i in range(10)}
        assert consumer.stats.database_outages >= 1
        assert broker == "kafka" or consumer.stats.redeliveries >= 20
        assert consumer.stats.outcomes == {"applied": 10}, consumer.stats.outcomes
        row = conn.execute("SELECT count(*) FROM inbox.quarantine").fetchone()
        assert row is not None and row[0] == 0


@pytest.mark.parametrize("broker", ["redis"])
def test_sigterm_finishes_the_batch_and_health(broker: str, conn: psycopg.Connection[Any], db_dsn: str) -> None:
    setup_domain(conn)
    conn.execute("UPDATE handler_delay SET seconds = 0.002")
    total = 300
    with channel(broker) as ch:
        ch.publish([Out(f"s{i}", credit(f"s{i}")) for i in range(total)])
        env = {
            **os.environ,
            "PGINBOX_DSN": db_dsn,
            "PGINBOX_CONSUME_CONSUMER": "billing",
            "PGINBOX_CONSUME_PREFETCH": "20",
            **{f"PGINBOX_CONSUME_{k.upper()}": str(v) for k, v in ch.settings().items()},
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "pginbox", "consume", "--health-port", "0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            port = None
            deadline = time.monotonic() + 20
            assert proc.stderr is not None
            while port is None and time.monotonic() < deadline:
                line = proc.stderr.readline()
                if "health_listening" in line:
                    port = int(line.rsplit("port=", 1)[1].split()[0])
            assert port is not None, "no health_listening line"
            wait_for(lambda: sum(ledger_counts(conn).values()) >= 40, "some messages applied")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                health = json.loads(r.read())
            assert r.status == 200 and health["healthy"] and health["consumer"] == "billing"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                metrics = r.read().decode()
            assert 'pginbox_consumer_messages_total{outcome="applied"}' in metrics
            assert "pginbox_consumer_batch_size_bucket" in metrics
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err
        assert "applied=" in out
        applied = ledger_counts(conn)
        assert all(n == 1 for n in applied.values())
        assert 0 < len(applied) < total
        # everything applied was acked: what the broker still holds is exactly the rest
        wait_for(
            lambda: ch.pending() == total - len(applied), "the broker holding exactly the unapplied rest", timeout=10
        )
        # a second run takes the rest, nothing twice
        consumer = make_consumer(ch, db_dsn)
        with ConsumerThread(consumer):
            wait_for(lambda: sum(ledger_counts(conn).values()) == total, "the rest applied")
            wait_for(lambda: ch.pending() == 0, "every message acked")
        assert ledger_counts(conn) == {f"s{i}": 1 for i in range(total)}


async def python_credit(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
    """A Python handler (handler = "test_consume:python_credit"): the domain change in the claim's
    transaction; a negative amount is refused (FAILED)."""
    if message.payload["amount"] < 0:
        raise ValueError("negative amount")
    await cur.execute("SELECT apply_credit(1, %s, %s)", (message.payload["id"], message.payload["amount"]))


@pytest.mark.parametrize("broker", ["memory", "rabbitmq"])
def test_python_handler_batches(broker: str, conn: psycopg.Connection[Any], db_dsn: str) -> None:
    setup_domain(conn)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    with channel(broker) as ch:
        ch.publish([Out(f"p{i}", credit(f"p{i}")) for i in range(40)] + [Out("bad", credit("bad", -1))])
        consumer = make_consumer(
            ch, db_dsn, handler="test_consume:python_credit", prefetch=20, retry_delay=0.1, max_retry_delay=0.2
        )
        with ConsumerThread(consumer):
            wait_for(lambda: consumer.stats.outcomes.get("quarantined", 0) == 1, "the refused message quarantined")
            wait_for(lambda: ch.pending() == 0, "every message acked")
        assert ledger_counts(conn) == {f"p{i}": 1 for i in range(40)}
        assert consumer.stats.outcomes == {"applied": 40, "failed": 1, "quarantined": 1}, consumer.stats.outcomes
        assert consumer.stats.transactions < 41


def test_bad_configuration_is_refused_before_connecting(tmp_path: Any) -> None:
    from pginbox.errors import ConsumerConfigError

    with pytest.raises(ConsumerConfigError, match="no broker url"):
        load_consume_config(None, {"consumer": "billing"})
    with pytest.raises(ConsumerConfigError, match="needs a queue"):
        load_consume_config(None, {"url": "amqp://h/", "consumer": "billing"})
    with pytest.raises(ConsumerConfigError, match="needs a stream"):
        load_consume_config(None, {"url": "nats://h:4222", "consumer": "billing"})
    with pytest.raises(ConsumerConfigError, match="expected amqp") as wrong_scheme:
        load_consume_config(None, {"url": "mqtt://svc:s3cret@h", "consumer": "billing"})
    assert "s3cret" not in str(wrong_scheme.value)  # a refused URL is named without its credentials
    assert safe_url("amqp://svc:p@ss@rabbit:5672/vhost@eu?x=1") == "amqp://rabbit:5672/vhost@eu?x=1"
    assert safe_url("nats://nats.internal:4222") == "nats://nats.internal:4222"
    with pytest.raises(ConsumerConfigError, match="header:NAME"):
        load_consume_config(None, {"url": "amqp://h/", "consumer": "b", "queue": "q", "producer": "app"})
    with pytest.raises(ConsumerConfigError, match="prefetch"):
        load_consume_config(None, {"url": "amqp://h/", "consumer": "b", "queue": "q", "prefetch": 65})
    toml = tmp_path / "c.toml"
    toml.write_text('[consume]\nurl = "amqp://h/"\nconsumer = "b"\nqueue = "q"\nqeue = "typo"\n')
    with pytest.raises(ConsumerConfigError, match="unknown"):
        load_consume_config(toml)
    toml.write_text('[consume]\nurl = "amqp://h/"\nconsumer = "b"\nqueue = "q"\nprefetch = 5\n')
    config = load_consume_config(toml, {"prefetch": 7, "queue": None})
    assert (config.prefetch, config.queue, config.dead_letter_target) == (7, "q", "q.dead")
    # the CLI: an option's environment variable wins over the file, the option over both
    env = {**os.environ, "PGINBOX_DSN": "host=127.0.0.1 port=1", "PGINBOX_CONSUME_PREFETCH": "99"}
    done = subprocess.run(
        [sys.executable, "-m", "pginbox", "consume", "--config", str(toml)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "prefetch" in done.stderr
    # Redis Streams: a stream, the group defaults to the consumer name, dead letters to <stream>:dead
    config = load_consume_config(None, {"url": "redis://127.0.0.1:6379/0", "consumer": "b", "stream": "orders"})
    assert (config.broker, config.durable, config.dead_letter_target) == ("redis", "b", "orders:dead")
    with pytest.raises(ConsumerConfigError, match="needs a stream"):
        load_consume_config(None, {"url": "rediss://h:6380", "consumer": "billing"})
    # a position in the stream is not an identity
    with pytest.raises(ConsumerConfigError, match="position in the stream"):
        load_consume_config(None, {"url": "nats://h:4222", "consumer": "b", "stream": "S", "message_id": "sequence"})
    with pytest.raises(ConsumerConfigError, match="expected one of"):
        load_consume_config(None, {"url": "redis://h", "consumer": "b", "stream": "s", "message_id": "entry_id"})


# ---------------------------------------------------------------------------------------------- handlers


def plain_credit(cur: psycopg.Cursor[Any], message: Message) -> None:
    """A plain def handler: it gets a plain cursor, and its write commits with the claim."""
    cur.execute("SELECT apply_credit(1, %s, %s)", (message.payload["id"], message.payload["amount"]))


async def returns_unawaited(cur: psycopg.AsyncCursor[Any], message: Message) -> Any:
    """Returns the coroutine of its statement instead of awaiting it: the statement never runs."""
    return cur.execute("SELECT apply_credit(1, %s, %s)", (message.payload["id"], message.payload["amount"]))


def sync_returns_coroutine(cur: psycopg.Cursor[Any], message: Message) -> Any:
    async def later() -> None:
        return None

    return later()


@pytest.mark.parametrize("prefetch", [1, 10])
def test_handlers_plain_def_works_and_an_unawaited_coroutine_fails(
    prefetch: int, conn: psycopg.Connection[Any], db_dsn: str
) -> None:
    setup_domain(conn)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    with channel("memory") as ch:
        ch.publish([Out(f"p{i}", credit(f"p{i}")) for i in range(3)])
        consumer = make_consumer(ch, db_dsn, handler="test_consume:plain_credit", prefetch=prefetch)
        with ConsumerThread(consumer):
            wait_for(lambda: ch.pending() == 0, "applied")
        assert ledger_counts(conn) == {f"p{i}": 1 for i in range(3)}
        assert consumer.stats.outcomes == {"applied": 3}
        for name in ("returns_unawaited", "sync_returns_coroutine"):
            ch.publish([Out(f"{name}-{prefetch}", credit("u"))])
            consumer = make_consumer(ch, db_dsn, handler=f"test_consume:{name}", prefetch=prefetch, retry_delay=0.05)
            stats = consumer.stats
            with ConsumerThread(consumer):
                wait_for(lambda: stats.outcomes.get("quarantined", 0) == 1, "quarantined")  # noqa: B023
            # failed, never applied: the claim did not commit without its write
            assert consumer.stats.outcomes == {"failed": 1, "quarantined": 1}, consumer.stats.outcomes
        assert ledger_counts(conn) == {f"p{i}": 1 for i in range(3)}
        rows = conn.execute("SELECT reason_code FROM inbox.quarantine WHERE message_id LIKE '%return%'").fetchall()
        reasons = {r[0] for r in rows}
        assert reasons == {"handler_returned_awaitable"}, reasons


def test_wire_contract_refuses_what_it_cannot_read() -> None:
    """A delivery becomes a Message, or BadInput with the SQLSTATE the dead letter carries."""
    from pginbox.brokers.port import Delivery
    from pginbox.brokers.wire import DEFAULT_SOURCES, BadInput, IdentitySource, parse_message

    sources = {k: IdentitySource.parse(v, k, "redis") for k, v in DEFAULT_SOURCES["redis"].items()}
    ok = {"Pginbox-Producer": "shop", "Pginbox-Message-Id": "m1", "Pginbox-Type": "credit"}

    def state(body: bytes = b"{}", /, **headers: object) -> str | None:
        try:
            parse_message(Delivery(body, {}, {**ok, **headers}, False), sources)
        except BadInput as bad:
            return bad.sqlstate
        return None

    assert state() is None and state(b"[" * 100_000 + b"]" * 100_000) == "22P02"
    assert state(b"[" * 300 + b"]" * 300) == "22P02" and state(b"[" * 150 + b"]" * 150) is None
    assert state(b'{"x": NaN}') == "22P02" and state(b"\xff") == "22P02"
    assert state(**{"Pginbox-Message-Id": b"m\xff"}) == "22021" and state(**{"Pginbox-Message-Id": "m\x00"}) == "22021"
    assert state(**{"Pginbox-Message-Id": True}) == "22023" and state(**{"Pginbox-Message-Id": ""}) == "22004"
    assert state(**{"Pginbox-Produced-At": "1999-12-31T23:59:59Z"}) == "22008"
    assert state(**{"Pginbox-Produced-At": "2200-01-01T00:00:00Z"}) == "22008"
    assert state(**{"Pginbox-Produced-At": "2026-01-01T00:00:00Z"}) is None
    assert state(**{"Pginbox-Produced-At": "yesterday"}) == "22007"
    # NATS: Pginbox-Message-Id, else what pginbox 0.2 wrote (Nats-Msg-Id)
    nats_sources = {k: IdentitySource.parse(v, k, "nats") for k, v in DEFAULT_SOURCES["nats"].items()}
    old = parse_message(
        Delivery(b"{}", {}, {"Pginbox-Producer": "shop", "Nats-Msg-Id": "e1", "Pginbox-Type": "t"}, False), nats_sources
    )
    assert old.message_id == "e1"


def test_log_lines_escape_control_characters() -> None:
    from pginbox.runtime.log import kv

    line = kv("dead_letter", message_id="a\nforged_event x=1\r\x1b[2J", ok="plain")
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line == 'dead_letter message_id="a\\nforged_event x=1\\r\\x1b[2J" ok=plain'
