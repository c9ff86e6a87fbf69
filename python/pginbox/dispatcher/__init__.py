"""The outbox dispatcher (`pginbox dispatch`)."""

from pginbox.dispatcher.loop import (
    CHANNEL,
    CallableTransport,
    ClaimError,
    DeliveryReport,
    Dispatcher,
    DispatcherStats,
    Effect,
    HealthServer,
    Transport,
    TransportResolver,
)

__all__ = [
    "CHANNEL",
    "CallableTransport",
    "ClaimError",
    "DeliveryReport",
    "Dispatcher",
    "DispatcherStats",
    "Effect",
    "HealthServer",
    "Transport",
    "TransportResolver",
]
