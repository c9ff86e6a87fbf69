"""`pginbox consume`: RabbitMQ and NATS JetStream deliveries into schema inbox (docs/brokers.md).

    config.py     ConsumeConfig, load_consume_config: [consume] TOML, PGINBOX_CONSUME_*, options
    core.py       Consumer: batches, verdicts, dead letters, delays, reconnects, health
    rabbitmq.py   RabbitMQBroker (aio-pika; extra pginbox[rabbitmq])
    jetstream.py  JetStreamBroker (nats-py; extra pginbox[nats])
"""

from pginbox.consumer.config import ConsumeConfig, IdentitySource, load_consume_config
from pginbox.consumer.core import Broker, Consumer, Delivery, load_handler, retry_delay

__all__ = [
    "Broker",
    "ConsumeConfig",
    "Consumer",
    "Delivery",
    "IdentitySource",
    "load_consume_config",
    "load_handler",
    "retry_delay",
]
