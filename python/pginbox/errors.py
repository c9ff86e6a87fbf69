"""Exceptions shared by the pginbox modules."""

from __future__ import annotations

__all__ = [
    "CommitOutcomeUnknown",
    "HandlerProtocolError",
    "PginboxError",
    "RetriesExhausted",
    "SchemaAccessError",
    "SchemaVersionError",
]


class PginboxError(Exception):
    """Base class of the errors pginbox raises itself (not the driver's)."""


class SchemaVersionError(PginboxError):
    """Schema `inbox` is missing from the database, or is of a version this package does not know."""

    def __init__(self, message: str, *, found: int | None, supported: frozenset[int]) -> None:
        super().__init__(message)
        self.found = found
        self.supported = supported


class SchemaAccessError(PginboxError):
    """The role may not use schema `inbox` (it lacks the inbox_consumer grant)."""


class RetriesExhausted(PginboxError):
    """Every attempt allowed by the RetryPolicy ended in a transient error. Nothing was committed
    by the last attempt: nack the delivery (the broker redelivers; the claim keeps it safe).
    The last error is `__cause__`."""

    def __init__(self, message: str, *, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class CommitOutcomeUnknown(PginboxError):
    """The connection was lost during COMMIT and pg_xact_status could not tell, within
    RetryPolicy.resolve_timeout, whether the transaction committed. Do not ack and do not assume:
    nack; a redelivery is safe (a committed claim makes it a duplicate)."""

    def __init__(self, message: str, *, xid: str) -> None:
        super().__init__(message)
        self.xid = xid


class HandlerProtocolError(PginboxError):
    """The handler broke the rules of `Inbox.handle`: it committed or rolled back the transaction
    that holds the claim, or returned after a database error left that transaction failed."""

    def __init__(self, message: str, *, reason_code: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code
