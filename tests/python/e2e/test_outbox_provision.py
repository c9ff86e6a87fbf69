"""`pginbox outbox provision` against the real RabbitMQ and NATS JetStream: --check finds the queue
and the stream a configuration needs missing (exit 2), provision creates them, a second run finds
them; then the dispatcher's transports deliver instead of deferring."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import nats
import nats.js.errors
import pytest
from click.testing import CliRunner, Result
from helpers_brokers import NATS_URL, RABBIT_URL, require

from pginbox.brokers.jetstream import JetStreamTransport
from pginbox.brokers.rabbitmq import RabbitMQTransport
from pginbox.cli import main
from pginbox.transports import Effect

pytestmark = pytest.mark.timeout(90)


def provision(config: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["outbox", "provision", "--config", str(config), *args], catch_exceptions=True)


@pytest.fixture
def names() -> Iterator[dict[str, str]]:
    require("rabbitmq")
    require("nats")
    tag = uuid.uuid4().hex[:10]
    found = {"queue": f"t_prov_{tag}", "subject": f"t_prov_{tag}.events", "stream": f"T_PROV_{tag.upper()}"}
    yield found

    async def clean() -> None:
        connection = await aio_pika.connect(RABBIT_URL)
        async with connection:
            await (await connection.channel()).queue_delete(found["queue"])
        nc = await nats.connect(NATS_URL)
        try:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await nc.jetstream().delete_stream(found["stream"])
        finally:
            await nc.close()

    asyncio.run(clean())


def test_provision_creates_what_the_configuration_needs(names: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "destinations.toml"
    config.write_text(
        f'[destinations.orders]\nurl = "{RABBIT_URL}"\nrouting_key = "{names["queue"]}"\n\n'
        f'[destinations.events]\nurl = "{NATS_URL}"\nsubject = "{names["subject"]}"\nstream = "{names["stream"]}"\n\n'
        '[destinations.feed]\nurl = "redis://127.0.0.1:6379/0"\nstream = "t_prov_feed"\n\n'
        '[destinations.hook]\ncallable = "json:dumps"\n'
    )
    missing = provision(config, "--check", "--json")
    assert missing.exit_code == 2, missing.output
    by_name = {d["destination"]: d for d in json.loads(missing.stdout)["destinations"]}
    assert {n: d["status"] for n, d in by_name.items()} == {
        "events": "missing",
        "feed": "skipped",
        "hook": "skipped",
        "orders": "missing",
    }
    # Before provisioning, the brokers cannot route: the transports defer (no attempt spent).
    rabbit = RabbitMQTransport(RABBIT_URL, routing_key=names["queue"], destination="orders")
    jet = JetStreamTransport(NATS_URL, subject=names["subject"], destination="events", timeout=2.0)
    try:
        assert rabbit.deliver_batch([Effect("p1", "orders", {})])[0].defer == "unroutable"
        assert jet.deliver_batch([Effect("p1", "events", {})])[0].defer == "no_stream"

        created = provision(config)
        assert created.exit_code == 0, created.output
        rows = {line.split()[0]: line for line in created.stdout.splitlines()[2:]}
        assert "created" in rows["orders"] and f"queue '{names['queue']}'" in rows["orders"]
        assert "created" in rows["events"] and f"stream {names['stream']}" in rows["events"]

        again = provision(config, "--check")
        assert again.exit_code == 0, again.output
        rows = {line.split()[0]: line for line in again.stdout.splitlines()[2:]}
        assert "present" in rows["orders"] and "present" in rows["events"]

        assert rabbit.deliver_batch([Effect("p2", "orders", {})])[0].delivered
        assert jet.deliver_batch([Effect("p2", "events", {})])[0].delivered
    finally:
        rabbit.close()
        jet.close()


def test_provision_reports_an_unreachable_broker(tmp_path: Path) -> None:
    config = tmp_path / "destinations.toml"
    config.write_text('[destinations.orders]\nurl = "amqp://guest:guest@127.0.0.1:1/"\nrouting_key = "q"\n')
    result = provision(config, "--timeout", "1")
    assert result.exit_code == 1, result.output
    assert "failed" in result.stdout and "orders" in result.stdout
