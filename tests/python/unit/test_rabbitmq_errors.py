"""Which exceptions of aio-pika/aiormq the RabbitMQ adapter reads as a lost connection.

aiormq rejects the pending operations of a connection or channel that closed without a reason
with a bare `Exception` (aiormq.base.FutureStore.reject_all). A consumer acking at that moment
died with "Error: Exception" instead of reconnecting (the RabbitMQ chain test under crashes, when
its TCP proxy cut every connection)."""

from __future__ import annotations

import asyncio

import aiormq.exceptions
import pytest

from pginbox.brokers.rabbitmq import _unless_broker_failure, _why


@pytest.mark.parametrize(
    "exc",
    [
        Exception(),
        aiormq.exceptions.AMQPConnectionError("cut"),
        ConnectionResetError(),
        asyncio.InvalidStateError(),
    ],
    ids=["bare-exception", "amqp-connection", "reset", "invalid-state"],
)
def test_a_lost_connection_is_a_broker_failure(exc: Exception) -> None:
    _unless_broker_failure(exc)  # does not raise: the caller turns it into BrokerError


@pytest.mark.parametrize("exc", [ValueError("bad"), KeyError("k"), TypeError()], ids=["value", "key", "type"])
def test_a_programming_error_is_not(exc: Exception) -> None:
    with pytest.raises(type(exc)):
        _unless_broker_failure(exc)


def test_the_bare_rejection_says_what_happened() -> None:
    assert _why(Exception()) == "the connection closed under the operation"
    assert _why(ConnectionResetError("peer")) == "ConnectionResetError: peer"
