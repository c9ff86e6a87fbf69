"""Destinations for the outbox dispatcher: HTTP(S) webhooks and Python callables.

    effect.py     Effect: one claimed effect (the only one), EffectLike
    protocol.py   Transport (what a destination implements), DeliveryReport
    webhook.py    WebhookTransport
    ssrf.py       the SSRF guard every webhook connection goes through
    callable.py   CallableTransport: a Python function as a destination
    config.py     load_config: destinations from TOML, the environment and entry points
  Broker destinations (RabbitMQ, NATS JetStream, Redis Streams) are adapters of the broker port:
  pginbox.brokers.rabbitmq.RabbitMQTransport, .jetstream.JetStreamTransport,
  .redis.RedisStreamsTransport (each a pginbox.brokers.publish.BrokerDestination).

A transport delivers one effect and reports what happened:

    transport.deliver(effect) -> DeliveryReport(status_code, response_excerpt, retryable, error)

  delivered            error is None (status_code/response_excerpt describe the remote answer)
  retryable failure    error set, retryable=True  (the dispatcher backs off and retries)
  permanent failure    error set, retryable=False (the effect goes dead, visible to operators)
  ambiguous outcome    deliver() RAISES (AmbiguousDelivery for webhooks): the request may have
                       reached the remote (timeout or connection lost after sending); the
                       dispatcher retries with the SAME idempotency key.

Webhooks, the SSRF guard and the configuration (TOML, PGINBOX_DEST_<NAME>_* variables, entry
points) are described in their modules.
"""

from pginbox.errors import AmbiguousDelivery, DestinationRefused
from pginbox.transports.callable import CallableTransport
from pginbox.transports.config import ENTRY_POINT_GROUP, load_config
from pginbox.transports.effect import Effect, EffectLike, delivery_key
from pginbox.transports.protocol import BatchTransport, DeliveryReport, Transport, TransportResolver
from pginbox.transports.webhook import DEFAULT_RETRY_ON, WebhookTransport

__all__ = [
    "DEFAULT_RETRY_ON",
    "ENTRY_POINT_GROUP",
    "AmbiguousDelivery",
    "BatchTransport",
    "CallableTransport",
    "DeliveryReport",
    "DestinationRefused",
    "Effect",
    "EffectLike",
    "Transport",
    "TransportResolver",
    "WebhookTransport",
    "delivery_key",
    "load_config",
]
