"""What a destination implements: `Transport.deliver(effect) -> DeliveryReport`.

delivered            error is None (status_code/response_excerpt describe the remote answer)
retryable failure    error set, retryable=True  (the dispatcher backs off and retries)
permanent failure    error set, retryable=False (the effect goes dead, visible to operators)
ambiguous outcome    deliver() RAISES: the destination may have acted; the dispatcher retries
                     with the SAME idempotency key
deferred             error set, defer = a reason code (DeliveryReport.deferred): the destination
                     is not ready yet (no transport configured, the broker cannot route yet);
                     the effect waits without spending an attempt (inbox.defer_effects)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["BatchTransport", "DeliveryReport", "Transport", "TransportResolver"]


@dataclass(frozen=True)
class DeliveryReport:
    """What a transport learned. `error` None: the destination accepted the effect. Otherwise a
    failure, retried (same effect id) when `retryable`, else the effect goes dead."""

    status_code: int | None = None
    response_excerpt: str | None = None
    retryable: bool = True
    error: str | None = None
    #: A reason code (no_transport, unroutable, no_stream): not an attempt, the effect waits.
    defer: str | None = None

    @property
    def delivered(self) -> bool:
        return self.error is None

    @classmethod
    def deferred(cls, reason: str, error: str) -> DeliveryReport:
        """Nothing was sent because the destination is not ready yet (a deployment-order
        incident): the effect goes back to pending without spending an attempt."""
        return cls(None, None, True, error or reason, reason)

    @classmethod
    def ok(cls, status_code: int | None = None, response_excerpt: str | None = None) -> DeliveryReport:
        return cls(status_code, response_excerpt, True, None)

    @classmethod
    def failed(
        cls, error: str, *, retryable: bool, status_code: int | None = None, response_excerpt: str | None = None
    ) -> DeliveryReport:
        return cls(status_code, response_excerpt, retryable, error or "failed")


@runtime_checkable
class Transport(Protocol):
    """Delivers one effect. Returns a DeliveryReport when the outcome is known; raises when it is
    ambiguous (timeout, connection reset after sending): the effect is retried with the same id."""

    def deliver(self, effect: Any) -> DeliveryReport: ...


@runtime_checkable
class BatchTransport(Protocol):
    """A transport that also delivers many effects in one go (the broker transports: one batch
    of publisher confirms instead of a round trip per effect). One report per effect, in order;
    an ambiguous outcome is a retryable failure report (never raised for the whole batch)."""

    def deliver(self, effect: Any) -> DeliveryReport: ...

    def deliver_batch(self, effects: Sequence[Any]) -> list[DeliveryReport]: ...


#: destination name -> its transport, or None when this dispatcher does not deliver it.
TransportResolver = Callable[[str], Transport | None]
