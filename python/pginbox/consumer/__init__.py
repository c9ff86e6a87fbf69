"""`pginbox consume`: broker deliveries into schema inbox (docs/brokers.md).

    config.py     ConsumeConfig, load_consume_config: [consume] TOML, PGINBOX_CONSUME_*, options
    core.py       Consumer: the loop (batches, verdicts, dead letters, delays, halts, reconnects,
                  health)

The brokers themselves are adapters behind the port in pginbox.brokers (RabbitMQ, NATS
JetStream, Redis Streams, in-memory); this package imports the port, never an adapter by name.
"""

from pginbox.brokers.port import Broker, Delivery
from pginbox.brokers.wire import IdentitySource
from pginbox.consumer.config import ConsumeConfig, load_consume_config
from pginbox.consumer.core import Consumer, load_handler, retry_delay

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
