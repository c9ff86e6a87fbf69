"""The operator's queries behind `pginbox quarantine list | show | repair | discard | release`.

Every statement is a named constant below; values travel as bind parameters, identifiers are
never formatted into SQL. Database errors of the quarantine decisions are translated into
`OperatorError`: one sentence that says what is wrong (entry 7 is already discarded, a conflict
entry can only be discarded, ...) plus the SQLSTATE and its condition name.

Payloads are sensitive: they are read only when asked for (`show_entry(..., with_payload=True)`),
which needs the inbox_operator role (inbox_reader cannot read that column).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, LiteralString

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import dict_row

from pginbox.errors import OperatorError, missing_grant, server_message
from pginbox.ops.json_values import jsonable

__all__ = [
    "ACTIONS",
    "QUARANTINE_KINDS",
    "QUARANTINE_STATUSES",
    "Action",
    "Decision",
    "EntryDetails",
    "OperatorError",
    "QuarantineList",
    "decide",
    "list_entries",
    "refused",
    "show_entry",
]

Row = dict[str, Any]
Action = Literal["repair", "discard", "release"]

#: The decisions an operator can make on an entry (inbox.quarantine_decision.decision).
ACTIONS: Final[tuple[Action, ...]] = ("repair", "discard", "release")
#: inbox.quarantine.status and .kind (CHECK constraints; pinned by test_sql_contract).
QUARANTINE_STATUSES: Final = ("open", "recovered", "discarded", "released")
QUARANTINE_KINDS: Final = ("conflict", "failure", "expired")

# --------------------------------------------------------------------------- SQL

# The columns of an entry (everything but the payload). Error texts and payload hashes are the
# operators' to read (0.2.0): for a reader they come back NULL (see _for_readers).
_ENTRY_COLUMNS = """
       q.quarantine_id, q.consumer, q.tenant, q.producer, q.message_id, q.kind, q.message_type,
       encode(q.payload_sha256, 'hex') AS payload_sha256, encode(q.stored_sha256, 'hex') AS stored_sha256,
       q.payload_ref, q.reason_code, q.error_message, q.attempts, q.crashes, q.deliveries,
       q.first_failure_at, q.last_failure_at, q.handler_version, q.status, q.created_at, q.last_seen_at,
       q.decided_at, q.decided_by"""

# May this session read error texts and payload hashes (an operator), or only reason codes (a reader)?
READS_DIAGNOSTICS: Final = "SELECT pg_catalog.has_column_privilege('inbox.quarantine', 'error_message', 'SELECT')"

_OPERATOR_ONLY: Final[tuple[tuple[LiteralString, LiteralString], ...]] = (
    ("encode(q.payload_sha256, 'hex') AS payload_sha256", "NULL::text AS payload_sha256"),
    ("encode(q.stored_sha256, 'hex') AS stored_sha256", "NULL::text AS stored_sha256"),
    ("q.error_message", "NULL::text AS error_message"),
    ("d.error_message", "NULL::text AS error_message"),
    ("a.error_message", "NULL::text AS error_message"),
    ("encode(a.payload_sha256, 'hex') AS payload_sha256", "NULL::text AS payload_sha256"),
    ("encode(m.payload_sha256, 'hex') AS payload_sha256", "NULL::text AS payload_sha256"),
)


def _for_readers(statement: LiteralString) -> LiteralString:
    """`statement` with the operator-only columns read as NULL."""
    for column, blank in _OPERATOR_ONLY:
        statement = statement.replace(column, blank)
    return statement


# %(status)s / %(consumer)s NULL: no filter. The values are known when the statement is planned,
# so the planner folds the unused branch away.
LIST_ENTRIES: Final = """
SELECT q.quarantine_id, q.consumer, q.tenant, q.producer, q.message_id, q.kind, q.message_type,
       q.reason_code, q.attempts, q.crashes, q.deliveries, q.status, q.created_at, q.last_seen_at,
       q.decided_at, q.decided_by, now() - q.created_at AS age
  FROM inbox.quarantine q
 WHERE (%(consumer)s::text IS NULL OR q.consumer = %(consumer)s::text)
   AND (%(status)s::text IS NULL OR q.status = %(status)s::text)
 ORDER BY q.quarantine_id
 LIMIT %(limit)s
"""

COUNT_ENTRIES: Final = """
SELECT count(*) AS total
  FROM inbox.quarantine q
 WHERE (%(consumer)s::text IS NULL OR q.consumer = %(consumer)s::text)
   AND (%(status)s::text IS NULL OR q.status = %(status)s::text)
"""

SHOW_ENTRY: Final = f"SELECT {_ENTRY_COLUMNS}\n  FROM inbox.quarantine q\n WHERE q.quarantine_id = %(id)s"

SHOW_PAYLOAD: Final = """
SELECT q.payload, q.payload_bytes
  FROM inbox.quarantine q
 WHERE q.quarantine_id = %(id)s
"""

SHOW_DECISIONS: Final = """
SELECT d.decision_id, d.decided_at, d.decided_by, d.decision, d.result, d.note, d.reason_code, d.error_message
  FROM inbox.quarantine_decision d
 WHERE d.quarantine_id = %(id)s
 ORDER BY d.decided_at, d.decision_id
"""

SHOW_ATTEMPT: Final = """
SELECT a.started, a.failed, a.last_started_at, a.first_failure_at, a.last_failure_at, a.reason_code,
       a.error_message, a.handler_version, a.message_type, encode(a.payload_sha256, 'hex') AS payload_sha256
  FROM inbox.attempt a
 WHERE a.consumer = %(consumer)s AND a.tenant = %(tenant)s AND a.producer = %(producer)s
   AND a.message_id = %(message_id)s
"""

SHOW_MESSAGE: Final = """
SELECT m.status::text AS status, encode(m.payload_sha256, 'hex') AS payload_sha256, m.handler_version,
       m.produced_at, m.received_at, m.processed_at
  FROM inbox.message m
 WHERE m.consumer = %(consumer)s AND m.tenant = %(tenant)s AND m.producer = %(producer)s
   AND m.message_id = %(message_id)s
"""

# The state of an entry, read again when a decision is refused (to say why) or after it.
ENTRY_STATE: Final = """
SELECT q.quarantine_id, q.kind, q.status, q.decided_at, q.decided_by
  FROM inbox.quarantine q
 WHERE q.quarantine_id = %(id)s
"""

# discard and release return the whole inbox.quarantine row: pick the columns, never the payload.
DISCARD: Final = """
SELECT r.quarantine_id, r.kind, r.status, r.decided_at, r.decided_by
  FROM inbox.discard(%(id)s, %(note)s) r
"""

RELEASE: Final = """
SELECT r.quarantine_id, r.kind, r.status, r.decided_at, r.decided_by
  FROM inbox.release(%(id)s, %(note)s) r
"""

REPAIR: Final = """
SELECT r.outcome, r.handler_version, r.attempts, r.reason_code, r.error_message
  FROM inbox.repair(%(id)s, %(note)s) r
"""

_DECISION_SQL: Final[Mapping[str, str]] = {"discard": DISCARD, "release": RELEASE, "repair": REPAIR}

# --------------------------------------------------------------------------- errors


def refused(exc: psycopg.Error, what: str) -> OperatorError:
    """The OperatorError for a database error every operator query can meet: schema missing, no
    privilege; else `what` failed, in the server's words."""
    state = exc.sqlstate
    if isinstance(exc, pg_errors.UndefinedTable | pg_errors.InvalidSchemaName | pg_errors.UndefinedFunction):
        return OperatorError("schema inbox is not deployed in this database: run `pginbox deploy`", sqlstate=state)
    if isinstance(exc, pg_errors.InsufficientPrivilege) and missing_grant(exc):
        # The CLI's error handler adds the group role that holds the grant (pginbox.cli.errors).
        return OperatorError(f"permission denied to {what}", sqlstate=state)
    return OperatorError(f"{what} failed: {server_message(exc)}", sqlstate=state)


# --------------------------------------------------------------------------- list / show


@dataclass
class QuarantineList:
    entries: list[Row]
    total: int
    consumer: str | None
    status: str | None
    limit: int

    def as_json(self) -> Row:
        entries = []
        for entry in self.entries:
            item = dict(entry)
            item["age_seconds"] = item.pop("age").total_seconds() if item.get("age") is not None else None
            entries.append(item)
        return dict(
            jsonable(
                {
                    "filter": {"consumer": self.consumer, "status": self.status or "all", "limit": self.limit},
                    "total": self.total,
                    "shown": len(self.entries),
                    "entries": entries,
                }
            )
        )


def list_entries(
    conn: psycopg.Connection[Any], *, consumer: str | None = None, status: str | None = "open", limit: int = 50
) -> QuarantineList:
    """Quarantine entries, oldest first. `status` None: every status."""
    if status is not None and status not in QUARANTINE_STATUSES:
        raise OperatorError(f"unknown status {status!r}: one of {', '.join(QUARANTINE_STATUSES)}")
    params = {"consumer": consumer, "status": status, "limit": limit}
    try:
        with conn.cursor(row_factory=dict_row) as cur:
            entries = cur.execute(LIST_ENTRIES, params).fetchall()
            count_row = cur.execute(COUNT_ENTRIES, params).fetchone()
    except psycopg.Error as exc:
        raise refused(exc, "read inbox.quarantine") from exc
    total = int(count_row["total"]) if count_row else len(entries)
    return QuarantineList(entries=entries, total=total, consumer=consumer, status=status, limit=limit)


@dataclass
class EntryDetails:
    entry: Row
    decisions: list[Row]
    attempt: Row | None
    message: Row | None
    payload: Any = None
    payload_bytes: bytes | None = None
    with_payload: bool = False

    def as_json(self) -> Row:
        result: Row = {
            "entry": self.entry,
            "decisions": self.decisions,
            "attempt": self.attempt,
            "message": self.message,
        }
        if self.with_payload:
            result["payload"] = self.payload
            result["payload_bytes_base64"] = self.payload_bytes
        return dict(jsonable(result))


def show_entry(conn: psycopg.Connection[Any], quarantine_id: int, *, with_payload: bool = False) -> EntryDetails:
    """Every field of an entry, its audit trail, its attempt record and inbox row (and payload)."""
    try:
        reads_diagnostics = conn.execute(READS_DIAGNOSTICS).fetchone() == (True,)
        show: Callable[[LiteralString], LiteralString] = (lambda s: s) if reads_diagnostics else _for_readers
        with conn.cursor(row_factory=dict_row) as cur:
            entry = cur.execute(show(SHOW_ENTRY), {"id": quarantine_id}).fetchone()
            if entry is None:
                raise OperatorError(
                    f"entry {quarantine_id} does not exist (see `pginbox quarantine list --status all`)"
                )
            decisions = cur.execute(show(SHOW_DECISIONS), {"id": quarantine_id}).fetchall()
            identity = {k: entry[k] for k in ("consumer", "tenant", "producer", "message_id")}
            attempt = cur.execute(show(SHOW_ATTEMPT), identity).fetchone()
            message = cur.execute(show(SHOW_MESSAGE), identity).fetchone()
    except psycopg.Error as exc:
        raise refused(exc, "read inbox.quarantine") from exc
    details = EntryDetails(entry=entry, decisions=decisions, attempt=attempt, message=message)
    if with_payload:
        try:
            with conn.cursor(row_factory=dict_row) as cur:
                payload_row = cur.execute(SHOW_PAYLOAD, {"id": quarantine_id}).fetchone()
        except pg_errors.InsufficientPrivilege as exc:
            raise OperatorError(
                "permission denied to read payloads: they are sensitive and readable by inbox_operator only",
                sqlstate=exc.sqlstate,
            ) from exc
        except psycopg.Error as exc:
            raise refused(exc, "read the payload") from exc
        details.with_payload = True
        if payload_row is not None:
            details.payload = payload_row["payload"]
            details.payload_bytes = payload_row["payload_bytes"]
    return details


# --------------------------------------------------------------------------- decisions


@dataclass
class Decision:
    """What a repair / discard / release came to."""

    action: str
    quarantine_id: int
    result: str  # recovered | discarded | released | repair_failed
    entry_status: str
    kind: str | None = None
    decided_by: str | None = None
    decided_at: dt.datetime | None = None
    handler_version: str | None = None
    reason_code: str | None = None
    error_message: str | None = None
    extra: Row = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.result != "repair_failed"

    def as_json(self) -> Row:
        return dict(
            jsonable(
                {
                    "action": self.action,
                    "quarantine_id": self.quarantine_id,
                    "ok": self.ok,
                    "result": self.result,
                    "entry_status": self.entry_status,
                    "kind": self.kind,
                    "decided_by": self.decided_by,
                    "decided_at": self.decided_at,
                    "handler_version": self.handler_version,
                    "reason_code": self.reason_code,
                    "error_message": self.error_message,
                }
            )
        )


def _decision_error(
    conn: psycopg.Connection[Any], action: str, quarantine_id: int, exc: psycopg.Error
) -> OperatorError:
    """One clear sentence for a refused decision."""
    state = exc.sqlstate
    if isinstance(exc, pg_errors.NoDataFound):
        return OperatorError(f"entry {quarantine_id} does not exist", sqlstate=state)
    if isinstance(exc, pg_errors.InsufficientPrivilege) and missing_grant(exc):
        return OperatorError(
            f"permission denied to {action} entry {quarantine_id}: decisions need the inbox_operator role",
            sqlstate=state,
        )
    if isinstance(exc, pg_errors.InsufficientPrivilege):
        # The package's own refusal (a handler that would run with more rights than the consumer,
        # a binding): its message, DETAIL and HINT say what to do.
        return OperatorError(f"cannot {action} entry {quarantine_id}: {server_message(exc)}", sqlstate=state)
    if isinstance(exc, pg_errors.NullValueNotAllowed | pg_errors.InvalidParameterValue):
        return OperatorError(f"cannot {action} entry {quarantine_id}: {server_message(exc)}", sqlstate=state)
    if isinstance(exc, pg_errors.ObjectNotInPrerequisiteState):
        # Say why from the entry itself rather than from the wording of the server's message.
        state_row = None
        try:
            with conn.cursor(row_factory=dict_row) as cur:
                state_row = cur.execute(ENTRY_STATE, {"id": quarantine_id}).fetchone()
        except psycopg.Error:
            state_row = None
        if state_row is not None and state_row["status"] != "open":
            by = f" by {state_row['decided_by']}" if state_row["decided_by"] else ""
            at = f" at {state_row['decided_at']:%Y-%m-%d %H:%M:%S%z}" if state_row["decided_at"] else ""
            return OperatorError(
                f"entry {quarantine_id} is already {state_row['status']} ({action} refused; decided{by}{at}; "
                f"see `pginbox quarantine show {quarantine_id}`)",
                sqlstate=state,
            )
        if state_row is not None and state_row["kind"] == "conflict" and action in ("repair", "release"):
            return OperatorError(
                f"a conflict entry can only be discarded: entry {quarantine_id}'s message id was already applied "
                "once with another payload (discard it; if the second payload is a new intent, the producer "
                "sends it with a new message id)",
                sqlstate=state,
            )
        return OperatorError(f"cannot {action} entry {quarantine_id}: {server_message(exc)}", sqlstate=state)
    if isinstance(exc, pg_errors.UndefinedObject):
        return OperatorError(f"cannot {action} entry {quarantine_id}: {server_message(exc)}", sqlstate=state)
    return refused(exc, f"{action} entry {quarantine_id}")


def decide(conn: psycopg.Connection[Any], action: Action, quarantine_id: int, note: str) -> Decision:
    """Run inbox.repair / inbox.discard / inbox.release on an entry, committed on return.

    A repair whose handler fails again is not an error: it returns a Decision with result
    'repair_failed' (the entry stays open, the failure is in the audit trail)."""
    if action not in _DECISION_SQL:
        raise OperatorError(f"unknown decision {action!r}")
    params = {"id": quarantine_id, "note": note}
    try:
        with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(_DECISION_SQL[action], params).fetchone()
            after = cur.execute(ENTRY_STATE, {"id": quarantine_id}).fetchone()
    except psycopg.Error as exc:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            conn.rollback()
        raise _decision_error(conn, action, quarantine_id, exc) from exc
    assert row is not None and after is not None
    if action == "repair":
        result = "recovered" if row["outcome"] == "applied" else "repair_failed"
        return Decision(
            action=action,
            quarantine_id=quarantine_id,
            result=result,
            entry_status=after["status"],
            kind=after["kind"],
            decided_by=after["decided_by"],
            decided_at=after["decided_at"],
            handler_version=row["handler_version"],
            reason_code=row["reason_code"],
            error_message=row["error_message"],
        )
    return Decision(
        action=action,
        quarantine_id=quarantine_id,
        result=row["status"],
        entry_status=after["status"],
        kind=row["kind"],
        decided_by=row["decided_by"],
        decided_at=row["decided_at"],
    )
