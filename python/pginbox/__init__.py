"""pginbox: thin Python client for the SQL-first inbox package (PostgreSQL schema `inbox`)."""

from __future__ import annotations

from pginbox._version import __version__
from pginbox.client.async_inbox import AsyncHandler, AsyncInbox
from pginbox.client.durability import Durability
from pginbox.client.inbox import Handler, Inbox
from pginbox.client.outcomes import InboxStats, Message, Outcome, Result
from pginbox.client.retry import RetryPolicy, TransientKind, is_transient
from pginbox.errors import (
    CommitOutcomeUnknown,
    HandlerProtocolError,
    NotDurable,
    PginboxError,
    PoolerError,
    RetriesExhausted,
    SchemaAccessError,
    SchemaVersionError,
)

__all__ = [
    "AsyncHandler",
    "AsyncInbox",
    "CommitOutcomeUnknown",
    "Durability",
    "Handler",
    "HandlerProtocolError",
    "Inbox",
    "InboxStats",
    "Message",
    "NotDurable",
    "Outcome",
    "PginboxError",
    "PoolerError",
    "Result",
    "RetriesExhausted",
    "RetryPolicy",
    "SchemaAccessError",
    "SchemaVersionError",
    "TransientKind",
    "__version__",
    "is_transient",
]
