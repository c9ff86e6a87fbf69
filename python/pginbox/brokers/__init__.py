"""Brokers, inbound and outbound, behind one port (docs/brokers.md).

    port.py       the port: Broker and Delivery (what `pginbox consume` reads through), SourceConfig
                  (what an inbound adapter is told), Publisher and Outgoing (what the dispatcher's
                  broker destinations publish through)
    wire.py       the wire contract: header names, identity sources per broker, a delivery as a
                  pginbox Message (BadInput), an effect as a broker message, SQLSTATE -> Action
    publish.py    BrokerDestination: a Publisher as a dispatcher destination (Transport)
    memory.py     the in-memory adapter (fast tests, the demo)
    rabbitmq.py   RabbitMQ (aio-pika; extra pginbox[rabbitmq])
    jetstream.py  NATS JetStream (nats-py; extra pginbox[nats])
    redis.py      Redis Streams (redis-py; extra pginbox[redis])

Adapters import the port and the wire contract, never the consumer loop or the dispatcher. An
adapter is done when tests/python/e2e/test_broker_conformance.py passes with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, cast

from pginbox.brokers.port import Broker, Delivery, Outgoing, Publisher, SourceConfig
from pginbox.brokers.wire import BROKERS, BadInput, Header, IdentitySource, parse_message
from pginbox.runtime.loading import load_object

__all__ = [
    "ADAPTERS",
    "BROKERS",
    "BadInput",
    "Broker",
    "Delivery",
    "Header",
    "IdentitySource",
    "Outgoing",
    "Publisher",
    "SourceConfig",
    "make_broker",
    "parse_message",
]

#: broker -> the inbound adapter's class (module:attribute), imported when first used: an adapter
#: needs its extra installed, the others do not.
ADAPTERS: Final = {
    "rabbitmq": "pginbox.brokers.rabbitmq:RabbitMQBroker",
    "nats": "pginbox.brokers.jetstream:JetStreamBroker",
    "redis": "pginbox.brokers.redis:RedisStreamsBroker",
    "kafka": "pginbox.brokers.kafka:KafkaBroker",
    "memory": "pginbox.brokers.memory:MemorySource",
}


def make_broker(config: SourceConfig) -> Broker:
    """The inbound adapter for `config.broker`."""
    adapter = load_object(ADAPTERS[config.broker], "broker adapter")
    broker: Broker = cast(Callable[[SourceConfig], Broker], adapter)(config)
    return broker
