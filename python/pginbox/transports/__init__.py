"""Destinations of the outbox dispatcher: HTTP(S) webhooks and Python callables."""

from pginbox.transports.webhook import (
    DEFAULT_RETRY_ON,
    ENTRY_POINT_GROUP,
    AmbiguousDelivery,
    CallableTransport,
    DeliveryReport,
    DestinationRefused,
    Effect,
    EffectLike,
    Transport,
    WebhookTransport,
    load_config,
)

__all__ = [
    "DEFAULT_RETRY_ON",
    "ENTRY_POINT_GROUP",
    "AmbiguousDelivery",
    "CallableTransport",
    "DeliveryReport",
    "DestinationRefused",
    "Effect",
    "EffectLike",
    "Transport",
    "WebhookTransport",
    "load_config",
]
