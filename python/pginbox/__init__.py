"""pginbox: thin Python client for the SQL-first inbox package (PostgreSQL schema `inbox`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from pginbox.aio import AsyncHandler, AsyncInbox
from pginbox.errors import (
    CommitOutcomeUnknown,
    HandlerProtocolError,
    PginboxError,
    RetriesExhausted,
    SchemaAccessError,
    SchemaVersionError,
)
from pginbox.inbox import Handler, Inbox
from pginbox.outcomes import InboxStats, Message, Outcome, Result
from pginbox.retry import RetryPolicy, TransientKind, is_transient

try:
    __version__ = version("pginbox")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "AsyncHandler",
    "AsyncInbox",
    "CommitOutcomeUnknown",
    "Handler",
    "HandlerProtocolError",
    "Inbox",
    "InboxStats",
    "Message",
    "Outcome",
    "PginboxError",
    "Result",
    "RetriesExhausted",
    "RetryPolicy",
    "SchemaAccessError",
    "SchemaVersionError",
    "TransientKind",
    "__version__",
    "is_transient",
]
