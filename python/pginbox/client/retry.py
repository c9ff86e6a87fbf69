"""Which errors are transient, and how long to wait before running the whole transaction again.

Transient: the error says nothing about the message, only about this attempt.

  CONFLICT    SQLSTATE class 40 (40001 serialization_failure, 40P01 deadlock_detected, ...) and
              55P03 lock_not_available (lock_timeout, NOWAIT)
  TIMEOUT     57014 query_canceled (statement_timeout, a cancel request)
  CONNECTION  class 08 (connection exception), class 57 other than 57014 (57P01 admin_shutdown:
              the backend was terminated, ...), and a psycopg.OperationalError without SQLSTATE
              (the server closed the connection, the connection attempt failed)
  RESOURCES   class 53 (out of memory, disk full, too many connections)
  POOLER      42P05 duplicate_prepared_statement and 26000 invalid_sql_statement_name: a prepared
              statement of the client and the server session it was given disagree, which happens
              behind a transaction pooler (PgBouncer) that hands each transaction another server
              session (see pginbox.pooler); the clients stop preparing statements when they see it

The codes and classes are those of the one SQLSTATE table, pginbox.sqlstates. Everything else is
permanent. An exception counts as transient when it, or an exception in its chain of explicit causes
(`raise ... from exc`), is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import psycopg

from pginbox.runtime.backoff import full_jitter
from pginbox.sqlstates import TransientKind, condition

__all__ = ["RetryPolicy", "TransientKind", "classify", "is_transient"]


def _classify_one(exc: BaseException) -> TransientKind | None:
    if not isinstance(exc, psycopg.Error):
        return None
    state = exc.sqlstate
    if state is None:
        return TransientKind.CONNECTION if isinstance(exc, psycopg.OperationalError) else None
    return condition(state).transient


def classify(exc: BaseException) -> TransientKind | None:
    """The kind of transient error `exc` is, or None when it is permanent."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kind = _classify_one(current)
        if kind is not None:
            return kind
        current = current.__cause__
    return None


def is_transient(exc: BaseException) -> bool:
    """True when running the whole transaction again may succeed (see the module docstring)."""
    return classify(exc) is not None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries with jittered exponential back-off.

    max_attempts     attempts per transaction, the first included (1: never retry)
    base_delay       back-off cap before the first retry, doubled for each further retry ...
    max_delay        ... up to this cap; the sleep is uniform in [0, cap] ("full jitter")
    resolve_timeout  how long to keep asking pg_xact_status about a COMMIT whose reply was lost
                     before giving up with CommitOutcomeUnknown
    orphan_grace     after this long 'in progress', the orphaned backend of the lost connection
                     is terminated so that its transaction resolves (it can no longer commit
                     anything its client would hear about)
    """

    max_attempts: int = 5
    base_delay: float = 0.01
    max_delay: float = 1.0
    resolve_timeout: float = 30.0
    orphan_grace: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be at least 1")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy delays must not be negative")
        if self.resolve_timeout < 0 or self.orphan_grace < 0:
            raise ValueError("RetryPolicy.resolve_timeout and orphan_grace must not be negative")

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep before retry number `retry` (1 for the first retry)."""
        return full_jitter(retry, self.base_delay, self.max_delay, rng)
