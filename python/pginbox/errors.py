"""Every error pginbox raises itself, in one hierarchy (the driver's own errors, psycopg.Error and
its subclasses, pass through unchanged where the docs say so).

    PginboxError                base; `.sqlstate`: SQLSTATE of the database error behind it, or None
      SchemaVersionError        schema inbox is missing, or of a version this package does not know
      SchemaAccessError         the role may not use schema inbox
      RetriesExhausted          every attempt of a RetryPolicy ended in a transient error
      CommitOutcomeUnknown      the connection was lost during COMMIT and the outcome stayed unknown
      NotDurable                the commit was not confirmed on the standbys in time (durability)
      HandlerProtocolError      the handler broke the rules of Inbox.handle
      OperatorError             an operator command was refused (quarantine, status, ...)
        AmbiguousEffect         an effect id (or prefix) names several effects: pass --consumer or more of it
        ReplayError             a replay command was refused
          ReplayStopped         the replay plan is stopped (SQLSTATE IR001)
      ClaimError                the dispatcher's claims kept failing (also a RuntimeError)
      PoolerError               the work needs a direct connection, not one through a pooler
      AmbiguousDelivery         a transport cannot tell whether the destination acted
      DestinationRefused        the SSRF guard refused a destination address
      BrokerError               a message broker (RabbitMQ, NATS JetStream) could not be used
      BadInput                  a delivery cannot become a message (the consumer dead-letters it)
      ConsumerConfigError       the configuration of `pginbox consume` is incomplete or wrong
      SqitchError               sqitch could not be run or failed
      SqitchScriptError         `pginbox schema sql` could not render the Sqitch project as one script
      ClusterError              the private development cluster could not be used
      DemoError                 `pginbox demo` could not run, or found its invariant broken
        InvariantBroken
        SimulationError
        OutboxDemoRefused

Not here, on purpose: the transaction protocol's internal signals (pginbox.client.protocol.Transient
and CommitUnknown, and the Django handle's _HandlerError, never raised to a caller) and the
exceptions the demo's own handlers raise (they play the part of an application's errors). The
consumer's signal to dead-letter one message is BadInput, below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import psycopg

from pginbox.sqlstates import SQLSTATES

__all__ = [
    "SQLSTATE_NAMES",
    "AmbiguousDelivery",
    "AmbiguousEffect",
    "BadInput",
    "BrokerError",
    "ClaimError",
    "ClusterError",
    "CommitOutcomeUnknown",
    "ConsumerConfigError",
    "DemoError",
    "DestinationRefused",
    "HandlerProtocolError",
    "InvariantBroken",
    "NotDurable",
    "OperatorError",
    "OutboxDemoRefused",
    "PginboxError",
    "PoolerError",
    "ReplayError",
    "ReplayStopped",
    "RetriesExhausted",
    "SchemaAccessError",
    "SchemaNewerWarning",
    "SchemaVersionError",
    "SimulationError",
    "SqitchError",
    "SqitchScriptError",
    "database_error",
    "missing_grant",
    "server_message",
    "with_sqlstate",
]

#: Condition names (PostgreSQL errcodes, plus the package's own) of the SQLSTATEs pginbox knows
#: (pginbox.sqlstates); a message names the condition next to the code.
SQLSTATE_NAMES: Final[Mapping[str, str]] = {code: c.name for code, c in SQLSTATES.items() if len(code) == 5}


def with_sqlstate(message: str, sqlstate: str | None) -> str:
    """`message [SQLSTATE 55000 object_not_in_prerequisite_state]` (the name when it is known)."""
    if not sqlstate:
        return message
    name = SQLSTATE_NAMES.get(sqlstate)
    return f"{message} [SQLSTATE {sqlstate}{' ' + name if name else ''}]"


def server_message(exc: psycopg.Error) -> str:
    """The server's primary message without its 'inbox.fn: ' prefix, with its DETAIL in
    parentheses and its HINT after it: everything the server said, on one line."""
    diag = exc.diag
    text = diag.message_primary or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if text.startswith("inbox.") and ": " in text:
        text = text.split(": ", 1)[1]
    if diag.message_detail:
        text = f"{text.rstrip('.')} ({diag.message_detail.rstrip('.')})"
    if diag.message_hint:
        text = f"{text.rstrip('.')}. {diag.message_hint.rstrip('.')}."
    return text


def database_error(exc: BaseException, *, context: bool = True) -> psycopg.Error | None:
    """The database error behind `exc`: itself, or the nearest in its chain of causes (`raise ...
    from`, __cause__; a SQLAlchemy DBAPIError's `orig` first). With `context`, an error raised
    without `from` while another was being handled leads on to that one (__context__); without it,
    only causes count (Django raises its own classes `from` the driver's, and an error Django raises
    itself is not the driver's)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, psycopg.Error):
            return current
        seen.add(id(current))
        orig = getattr(current, "orig", None)
        if isinstance(orig, BaseException):
            current = orig
        else:
            current = current.__cause__ or (current.__context__ if context else None)
    return None


def missing_grant(exc: psycopg.Error) -> bool:
    """A 42501 that is a grant the role lacks ('permission denied for function repair'), not the
    package's own refusal with its reasons (a binding, a handler's rights)."""
    primary = (exc.diag.message_primary or "") if exc.diag else ""
    return exc.sqlstate == "42501" and primary.startswith("permission denied for ")


class PginboxError(Exception):
    """Base class of the errors pginbox raises itself. `sqlstate`: the SQLSTATE of the database
    error that caused it (also its `__cause__`), None when no database error did."""

    def __init__(self, message: str = "", *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


# ----------------------------------------------------------------------------- the client


class SchemaVersionError(PginboxError):
    """Schema `inbox` is missing from the database, or is of a version this package does not know."""

    def __init__(
        self, message: str, *, found: int | None, supported: frozenset[int], sqlstate: str | None = None
    ) -> None:
        super().__init__(message, sqlstate=sqlstate)
        self.found = found
        self.supported = supported


class SchemaNewerWarning(UserWarning):
    """Schema `inbox` is of a newer release than this package knows, and compatible with it."""


class SchemaAccessError(PginboxError):
    """The role may not use schema `inbox` (it lacks the inbox_consumer grant)."""


class RetriesExhausted(PginboxError):
    """Every attempt allowed by the RetryPolicy ended in a transient error. Nothing was committed
    by the last attempt: nack the delivery (the broker redelivers; the claim keeps it safe).
    The last error is `__cause__` (its SQLSTATE is `sqlstate`, None for a lost connection)."""

    def __init__(self, message: str, *, attempts: int, sqlstate: str | None = None) -> None:
        super().__init__(message, sqlstate=sqlstate)
        self.attempts = attempts


class CommitOutcomeUnknown(PginboxError):
    """The connection was lost during COMMIT and pg_xact_status could not tell, within
    RetryPolicy.resolve_timeout, whether the transaction committed. Do not ack and do not assume:
    nack; a redelivery is safe (a committed claim makes it a duplicate)."""

    def __init__(self, message: str, *, xid: str) -> None:
        super().__init__(message)
        self.xid = xid


class NotDurable(PginboxError):
    """Durability `standby`: the transactions committed on the primary, but the standbys did not
    confirm them (inbox.wait_durable) within the timeout, or the database went away while waiting.
    Do not ack: a failover could still lose them. Nack; the redelivery is safe (a committed claim
    makes it a duplicate, acked once its commit is on the standbys). `results`: what the call
    would have returned; the database error behind it, if any, is `__cause__`."""

    def __init__(self, message: str, *, results: object = None, sqlstate: str | None = None) -> None:
        super().__init__(message, sqlstate=sqlstate)
        self.results = results


class HandlerProtocolError(PginboxError):
    """The handler broke the rules of `Inbox.handle`: it committed or rolled back the transaction
    that holds the claim, or returned after a database error left that transaction failed
    (`reason_code` and `sqlstate` 25P02)."""

    def __init__(self, message: str, *, reason_code: str, sqlstate: str | None = None) -> None:
        super().__init__(message, sqlstate=sqlstate)
        self.reason_code = reason_code


# ----------------------------------------------------------------------------- operator commands


class OperatorError(PginboxError):
    """An operator command was refused or failed; the message is one line that says why, ending
    with the SQLSTATE and its condition name when a database error was behind it."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(with_sqlstate(message, sqlstate), sqlstate=sqlstate)


class AmbiguousEffect(OperatorError):
    """An effect id, or the prefix of one, names several effects (effect ids are unique per
    consumer): `candidates` lists up to 10 of them as (effect_id, consumer)."""

    def __init__(self, message: str, candidates: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.candidates = candidates


class ReplayError(OperatorError):
    """A replay command was refused or failed (see OperatorError)."""


class ReplayStopped(ReplayError):
    """The plan is stopped: the handler registered for its consumer and type is not the pinned one."""


# ----------------------------------------------------------------------------- the dispatcher


class ClaimError(PginboxError, RuntimeError):
    """Dispatcher.run_once() gave up: claims kept failing with a database error (the message says
    which; `sqlstate` is the last one's). Still a RuntimeError, as it was before it joined this
    hierarchy."""


class PoolerError(PginboxError):
    """The work needs one server session across transactions (a session-level advisory lock, LISTEN),
    and the connection goes through a transaction pooler such as PgBouncer."""


class AmbiguousDelivery(PginboxError):
    """The request may have reached the remote: retry with the same idempotency key."""


class DestinationRefused(PginboxError):
    """The SSRF guard refused a destination address."""


# ----------------------------------------------------------------------------- brokers


class BrokerError(PginboxError):
    """A message broker (RabbitMQ, NATS JetStream) could not be reached or refused an operation
    (the message says which broker and what to check)."""


class BadInput(PginboxError):
    """A delivery pginbox cannot process as it is (no identity, body not JSON, a timestamp out of
    range, ...): the consumer dead-letters it with `sqlstate` (always set) and `reason`."""

    sqlstate: str

    def __init__(self, sqlstate: str, reason: str) -> None:
        super().__init__(reason, sqlstate=sqlstate)
        self.reason = reason


class ConsumerConfigError(PginboxError, ValueError):
    """The configuration of `pginbox consume` (TOML [consume] table, PGINBOX_CONSUME_* variables,
    options) is incomplete or wrong: the message names the setting to fix."""


# ----------------------------------------------------------------------------- tooling


class SqitchError(PginboxError):
    """sqitch could not be run or exited with an error; `output` holds what it printed."""

    def __init__(self, message: str, *, output: str = "", returncode: int | None = None) -> None:
        super().__init__(message)
        self.output = output
        self.returncode = returncode


class SqitchScriptError(PginboxError):
    """The Sqitch project cannot be rendered as one SQL script: the message says what to fix."""


class ClusterError(PginboxError):
    """The private cluster could not be created, started, stopped or reached."""


class DemoError(PginboxError):
    """`pginbox demo` could not run, or one of its acts found what it proves broken."""


class InvariantBroken(DemoError):
    """The demo found a message applied twice, or a committed one missing."""


class SimulationError(DemoError):
    """The simulation itself failed (a worker hit an unexpected error, or it ran out of time)."""


class OutboxDemoRefused(DemoError):
    """Act 3 cannot run on this database (its dispatcher would claim effects that are not the demo's)."""
