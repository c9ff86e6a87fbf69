"""pginbox: thin Python client for the SQL-first inbox package (PostgreSQL schema `inbox`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

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

try:
    __version__ = version("pginbox")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

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
