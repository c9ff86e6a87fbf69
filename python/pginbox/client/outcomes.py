"""Typed values of the Python API: the message delivered, the outcome of one delivery, counters.

`Result` mirrors the SQL type `inbox.delivery_result`, with `Outcome` in place of the outcome text
(nobody compares strings), plus what the call spent on retries.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["InboxStats", "Message", "Outcome", "Result"]


class Outcome(enum.Enum):
    """What one delivery came to (`inbox.delivery_result.outcome`)."""

    #: The caller's transaction owns first processing (SQL `inbox.claim`). `Inbox.handle` commits it
    #: and reports APPLIED; CLAIMED never leaves the Python API.
    CLAIMED = "claimed"
    #: First processing: the change and the claim committed together. Ack.
    APPLIED = "applied"
    #: Same identity and payload as a message already processed (or discarded). Ack.
    DUPLICATE = "duplicate"
    #: Same identity, different payload: quarantined for operators, nothing applied. Ack.
    CONFLICT = "conflict"
    #: The handler raised a permanent error: rolled back, attempt recorded. Nack / retry later.
    FAILED = "failed"
    #: The identity sits in quarantine (now or earlier): nothing applied, handler not run. Ack.
    QUARANTINED = "quarantined"
    #: Produced before the consumer's purge watermark: it cannot be told apart from a message whose
    #: inbox row was purged, so it is quarantined (kind 'expired') instead of applied. Ack.
    EXPIRED = "expired"

    @property
    def ack(self) -> bool:
        """True when the broker delivery should be acknowledged: everything but FAILED (and the
        transient CLAIMED)."""
        return self in _ACK


_ACK = frozenset({Outcome.APPLIED, Outcome.DUPLICATE, Outcome.CONFLICT, Outcome.QUARANTINED, Outcome.EXPIRED})


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery from the broker.

    `(tenant, consumer, producer, message_id)` is the identity; `payload` is anything `json.dumps`
    accepts (it becomes jsonb, hashed on the server); `redelivered` is the broker's redelivery flag
    (it makes the call announce the attempt first, so crash loops end in quarantine).
    """

    producer: str
    message_id: str
    message_type: str
    payload: Any
    tenant: str = ""
    produced_at: datetime | None = None
    redelivered: bool = False


@dataclass(frozen=True, slots=True)
class Result:
    """The outcome of one delivery: `inbox.delivery_result` plus what this call spent.

    `retries`: whole-transaction re-runs in this call after transient errors (serialization
    failure, deadlock, lock timeout, statement timeout, lost connection, COMMIT found aborted).
    `lock_wait_seconds`: wall time of the attempts that ended in a concurrency error (SQLSTATE class
    40 or 55P03), from BEGIN to the error, in this call; back-off sleeps are not included.
    In a batch both are the figures of the transaction that carried the message (shared by the
    messages of one chunk). `exception`: the handler's exception when the outcome is FAILED or
    QUARANTINED because of it.
    """

    outcome: Outcome
    payload_sha256: str | None = None
    stored_sha256: str | None = None
    handler_version: str | None = None
    processed_at: datetime | None = None
    quarantine_id: int | None = None
    attempts: int | None = None
    reason_code: str | None = None
    error_message: str | None = None
    retries: int = 0
    lock_wait_seconds: float = 0.0
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def ack(self) -> bool:
        """True when the broker delivery should be acknowledged (see `Outcome.ack`)."""
        return self.outcome.ack


@dataclass(frozen=True, slots=True)
class InboxStats:
    """Cumulative counters of one `Inbox` / `AsyncInbox`, for metrics (a snapshot).

    deliveries            messages that came back with a Result from handle / apply / the batch calls
    outcomes              final outcomes by kind
    retries               whole-transaction re-runs after transient errors
    lock_wait_seconds     wall time of attempts that ended in a concurrency error (class 40, 55P03)
    backoff_seconds       time slept between attempts
    transient_errors      transient errors seen, by SQLSTATE ('connection' when there was none)
    unknown_commits       COMMITs whose reply was lost with the connection
    unknown_committed     ... of which pg_xact_status said 'committed' (the others were aborted
                          and retried, or raised CommitOutcomeUnknown)
    retries_exhausted     calls that gave up after RetryPolicy.max_attempts
    """

    deliveries: int = 0
    outcomes: Mapping[Outcome, int] = field(default_factory=dict)
    retries: int = 0
    lock_wait_seconds: float = 0.0
    backoff_seconds: float = 0.0
    transient_errors: Mapping[str, int] = field(default_factory=dict)
    unknown_commits: int = 0
    unknown_committed: int = 0
    retries_exhausted: int = 0
