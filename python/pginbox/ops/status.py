"""What `pginbox status` reports besides Sqitch: messages by status, quarantine entries by status
and kind, open entries by consumer; and the schema check of the operator commands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import dict_row

from pginbox.errors import OperatorError, SchemaVersionError
from pginbox.ops.json_values import jsonable
from pginbox.ops.quarantine import QUARANTINE_KINDS, QUARANTINE_STATUSES, refused
from pginbox.schema.compat import KNOWN_SCHEMA_VERSION, SCHEMA_RELEASE, check_release

__all__ = ["MESSAGE_STATUSES", "InboxStatus", "check_schema", "inbox_status", "parse_sqitch_status"]

Row = dict[str, Any]

#: The labels of enum inbox.message_status (pinned by test_sql_contract).
MESSAGE_STATUSES: Final = ("processed", "quarantined", "discarded")

SCHEMA_PRESENT: Final = "SELECT to_regnamespace('inbox') IS NOT NULL AS deployed"

MESSAGE_COUNTS: Final = """
SELECT m.status::text AS status, count(*) AS n
  FROM inbox.message m
 GROUP BY 1
 ORDER BY 1
"""

QUARANTINE_COUNTS: Final = """
SELECT q.status, q.kind, count(*) AS n
  FROM inbox.quarantine q
 GROUP BY 1, 2
 ORDER BY 1, 2
"""

OPEN_BY_CONSUMER: Final = """
SELECT q.consumer, count(*) AS open, count(*) FILTER (WHERE q.kind = 'conflict') AS conflicts,
       count(*) FILTER (WHERE q.kind = 'failure') AS failures, count(*) FILTER (WHERE q.kind = 'expired') AS expired,
       min(q.created_at) AS oldest,
       now() - min(q.created_at) AS oldest_age
  FROM inbox.quarantine q
 WHERE q.status = 'open'
 GROUP BY q.consumer
 ORDER BY q.consumer
"""


def check_schema(conn: psycopg.Connection[Any]) -> int:
    """The deployed schema version; OperatorError when inbox is missing or of a release this
    package cannot work with (pginbox.schema.compat)."""
    try:
        row = conn.execute(SCHEMA_PRESENT).fetchone()
        if row is None or not row[0]:
            raise OperatorError("schema inbox is not deployed in this database: run `pginbox deploy --dsn <dsn>`")
        release_row = conn.execute(SCHEMA_RELEASE).fetchone()
    except psycopg.Error as exc:
        raise refused(exc, "read the schema version") from exc
    try:
        return check_release(release_row, "this database").version
    except SchemaVersionError as exc:
        raise OperatorError(str(exc)) from None


@dataclass
class InboxStatus:
    deployed: bool
    schema_version: int | None = None
    release: str | None = None
    #: Why this package cannot work with the deployed schema (missing, older, breaking), or None.
    incompatible: str | None = None
    messages: dict[str, int] = field(default_factory=dict)
    quarantine: dict[str, dict[str, int]] = field(default_factory=dict)
    open_by_consumer: list[Row] = field(default_factory=list)
    problem: str | None = None

    @property
    def open_entries(self) -> int:
        return sum(self.quarantine.get("open", {}).values())

    def as_json(self) -> Row:
        return dict(
            jsonable(
                {
                    "deployed": self.deployed,
                    "schema_version": self.schema_version,
                    "release": self.release,
                    "client_schema_version": KNOWN_SCHEMA_VERSION,
                    "incompatible": self.incompatible,
                    "messages": self.messages,
                    "quarantine": self.quarantine,
                    "open_entries": self.open_entries,
                    "open_by_consumer": self.open_by_consumer,
                    "problem": self.problem,
                }
            )
        )


def inbox_status(conn: psycopg.Connection[Any]) -> InboxStatus:
    """Counts of inbox.message by status and of inbox.quarantine by status and kind."""
    try:
        row = conn.execute(SCHEMA_PRESENT).fetchone()
    except psycopg.Error as exc:
        raise refused(exc, "inspect the database") from exc
    if row is None or not row[0]:
        return InboxStatus(deployed=False)
    result = InboxStatus(deployed=True)
    try:
        release_row = conn.execute(SCHEMA_RELEASE).fetchone()
        if release_row is not None:
            result.schema_version, result.release = release_row[0], release_row[1]
        try:
            check_release(release_row, "this database")
        except SchemaVersionError as exc:
            result.incompatible = str(exc)
        with conn.cursor(row_factory=dict_row) as cur:
            messages = cur.execute(MESSAGE_COUNTS).fetchall()
            quarantine = cur.execute(QUARANTINE_COUNTS).fetchall()
            result.open_by_consumer = cur.execute(OPEN_BY_CONSUMER).fetchall()
    except pg_errors.InsufficientPrivilege:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            conn.rollback()
        result.problem = "no privilege to read schema inbox (connect as a member of inbox_reader or inbox_operator)"
        return result
    except psycopg.Error as exc:
        raise refused(exc, "read schema inbox") from exc
    # Every status, zeros included, so that scripts find each key.
    result.messages = dict.fromkeys(MESSAGE_STATUSES, 0)
    for message_row in messages:
        result.messages[message_row["status"]] = int(message_row["n"])
    # Every kind, zeros included (scripts read them).
    result.quarantine = {status: dict.fromkeys(QUARANTINE_KINDS, 0) for status in QUARANTINE_STATUSES}
    for q_row in quarantine:
        result.quarantine.setdefault(q_row["status"], {})[q_row["kind"]] = int(q_row["n"])
    for consumer_row in result.open_by_consumer:
        for key in ("open", "conflicts", "failures", "expired"):
            consumer_row[key] = int(consumer_row[key])
    return result


def parse_sqitch_status(output: str) -> Row:
    """The deployed and undeployed changes out of `sqitch status --show-changes` output."""
    deployed: list[Row] = []
    undeployed: list[str] = []
    section = None
    for raw in output.splitlines():
        line = raw.strip()
        if line.startswith("# Changes:"):
            section = "deployed"
            continue
        if line.startswith("Undeployed change"):
            section = "undeployed"
            continue
        if section == "deployed" and line.startswith("#") and " - " in line:
            parts = [p.strip() for p in line.lstrip("#").split(" - ")]
            deployed.append(
                {
                    "change": parts[0],
                    "deployed_at": parts[1] if len(parts) > 1 else None,
                    "by": parts[2] if len(parts) > 2 else None,
                }
            )
        elif section == "undeployed" and line.startswith("*"):
            undeployed.append(line.lstrip("* ").strip())
        elif section == "deployed" and line == "#":
            section = None
    return {
        "deployed_changes": deployed,
        "undeployed_changes": undeployed,
        "up_to_date": "Nothing to deploy" in output,
    }
