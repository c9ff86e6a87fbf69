"""`pginbox consume`: deliveries from RabbitMQ, NATS JetStream or Redis Streams into schema inbox."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import click

from pginbox.cli.context import State, database, dsn_option
from pginbox.sql_limits import MAX_BATCH

__all__ = ["consume"]


@click.command()
@dsn_option
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="TOML file with a [consume] table (options and PGINBOX_CONSUME_* variables win over it).",
)
@click.option(
    "--url",
    default=None,
    help="Broker URL: amqp://... (RabbitMQ), nats://... (NATS JetStream), redis://... (Redis Streams), "
    "kafka://host:port[,host:port] (Kafka).",
)
@click.option("--consumer", default=None, help="The pginbox consumer name.")
@click.option("--queue", default=None, help="RabbitMQ queue.")
@click.option("--stream", default=None, help="NATS JetStream stream, or Redis stream key.")
@click.option("--subject", default=None, help="NATS: filter subject of the durable consumer.")
@click.option("--topic", default=None, help="Kafka: the topic (offsets stored in the database, docs/kafka.md).")
@click.option(
    "--offset-reset",
    type=click.Choice(["earliest", "latest"]),
    default=None,
    help="Kafka: where a partition with no stored offset starts [default: earliest].",
)
@click.option(
    "--durable",
    default=None,
    help="NATS durable consumer / Redis or Kafka consumer group [default: the consumer name].",
)
@click.option(
    "--claim-idle",
    type=click.FloatRange(0.05, None),
    default=None,
    help="Seconds an unacked delivery is held before the broker hands it out again (NATS ack_wait, "
    "Redis XAUTOCLAIM idle time) [default: 30].",
)
@click.option("--consumer-name", default=None, help="Redis: this process's name in the group [default: host-pid-id].")
@click.option("--handler", default=None, help="'sql' (registered SQL handlers) or MODULE:FUNCTION [default: sql].")
@click.option("--handler-version", default=None, help="Recorded by Python handlers.")
@click.option(
    "--prefetch",
    type=click.IntRange(1, MAX_BATCH),
    default=None,
    help="Messages claimed per transaction [default: 50].",
)
@click.option(
    "--retry-delay",
    type=click.FloatRange(0.001, None),
    default=None,
    help="First redelivery delay of a failed message, seconds [default: 1].",
)
@click.option(
    "--max-retry-delay",
    type=click.FloatRange(0.001, None),
    default=None,
    help="Longest redelivery delay, seconds [default: 300].",
)
@click.option(
    "--dead-letter",
    default=None,
    help="Dead letter queue (RabbitMQ), subject (NATS) or stream (Redis) "
    "[default: QUEUE.dead / pginbox.dead.DURABLE / STREAM:dead].",
)
@click.option("--producer", default=None, help="Where the producer is read: PROPERTY, header:NAME or const:VALUE.")
@click.option("--message-id", default=None, help="Where the message id is read.")
@click.option("--message-type", default=None, help="Where the message type is read.")
@click.option("--produced-at", default=None, help="Where produced_at is read.")
@click.option("--tenant", default=None, help="Where the tenant is read.")
@click.option(
    "--durability",
    type=click.Choice(["commit", "standby"]),
    default=None,
    help="When a batch is acked: after COMMIT (commit, the default), or once the standbys have it "
    "(standby; docs/failover.md).",
)
@click.option(
    "--min-standbys",
    type=click.IntRange(1, 64),
    default=None,
    help="durability standby: how many standbys must have the commit [default: 1].",
)
@click.option(
    "--standby-names",
    default=None,
    help="durability standby: the standbys that count, application names separated by commas [default: any].",
)
@click.option(
    "--standby-wait",
    type=click.Choice(["flush", "apply"]),
    default=None,
    help="durability standby: the standbys flushed (flush, the default) or also replayed (apply) the WAL.",
)
@click.option(
    "--durability-timeout",
    type=click.FloatRange(0, 3600),
    default=None,
    help="durability standby: seconds to wait before the batch is handed back unacked [default: 10].",
)
@click.option(
    "--health-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve GET /healthz and GET /metrics on this port (0: any free port, logged).",
)
@click.option("--health-host", default=None, help="Address the health endpoint binds to [default: 127.0.0.1].")
@click.pass_context
def consume(ctx: click.Context, /, command_dsn: str | None, config: Path | None, **options: Any) -> None:
    """Consume a RabbitMQ queue, a NATS JetStream stream, a Redis stream or a Kafka topic into schema inbox: one
    transaction per batch, ack after COMMIT, failed messages redelivered after a growing delay, bad
    input to the dead letter, a configuration or rights error halts (SIGTERM/SIGINT: finish the
    batch, exit 0). See docs/brokers.md."""
    from pginbox.consumer import Consumer, load_consume_config
    from pginbox.runtime.health import HealthServer

    dsn = database(ctx, command_dsn)
    settings = load_consume_config(config, options)
    state = ctx.find_object(State)
    logging.basicConfig(
        level=logging.DEBUG if state is not None and state.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    consumer = Consumer(settings, dsn)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, consumer.stop)
        health = None
        if settings.health_port is not None:
            health = HealthServer(consumer, settings.health_host, settings.health_port).start()
        try:
            await consumer.run()
        finally:
            if health is not None:
                health.close()

    asyncio.run(main())
    stats = consumer.stats.as_dict()
    outcomes = stats.pop("outcomes")
    click.echo(
        " ".join(
            [*(f"{k}={'-' if v is None else v}" for k, v in stats.items()), *(f"{k}={v}" for k, v in outcomes.items())]
        )
    )
