"""`CallableTransport`: a Python function as a destination."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pginbox.transports.protocol import DeliveryReport

__all__ = ["CallableTransport"]


class CallableTransport:
    """Wraps `fn(effect)`: delivered when it returns, ambiguous (re-raised) when it raises."""

    def __init__(self, fn: Callable[[Any], object]) -> None:
        self.fn = fn

    def deliver(self, effect: Any) -> DeliveryReport:
        result = self.fn(effect)
        if isinstance(result, DeliveryReport):
            return result
        return DeliveryReport(None, None, False, None)
