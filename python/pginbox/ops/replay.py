"""Replay plans (compensated migration) from Python: the queries behind `pginbox replay ...`.

A replay plan re-runs messages a consumer already processed through a pinned handler and version,
each under its own operation id, exactly once (see docs/replay.md). This module is a thin layer
over the SQL API: every statement is a named constant below, values travel as bind parameters.

Database errors become `ReplayError`: one sentence plus the SQLSTATE. A plan that stops because
the registered handler changed raises `ReplayStopped` (SQLSTATE IR001), whether the stop was
detected by this run (the call returned status stopped_version_changed) or earlier.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pginbox.errors import ReplayError, ReplayStopped, missing_grant, server_message

__all__ = [
    "PlanStatus",
    "ReplayError",
    "ReplayStopped",
    "RunResult",
    "accept_version",
    "add_items",
    "cancel_plan",
    "create_plan",
    "explain_skip",
    "plan_status",
    "read_items",
    "resolve_plan",
    "run_plan",
]

Row = dict[str, Any]

#: Items sent per inbox.add_replay_items call (the SQL limit is 10000).
ADD_CHUNK: Final = 500
#: SQLSTATE of a plan stopped because the registered handler changed.
SQLSTATE_VERSION_CHANGED: Final = "IR001"

# --------------------------------------------------------------------------- SQL

CREATE_PLAN: Final = """
SELECT p.plan_id FROM inbox.create_replay_plan(%(name)s, %(consumer)s, %(message_type)s, %(handler)s::regprocedure,
                                              %(version)s, %(note)s) p
"""
ADD_ITEMS: Final = "SELECT inbox.add_replay_items(%(plan_id)s, %(items)s) AS added"
RUN_PLAN: Final = "SELECT r.* FROM inbox.run_replay_plan(%(plan_id)s, %(max_items)s) r"
# In the run's own transaction, after RUN_PLAN: the items it failed or skipped, by reason. Every
# item a run finishes gets finished_at = now() (its transaction's start) and finished_by =
# session_user, so earlier runs' items are left out.
RUN_REASONS: Final = """
SELECT i.status, coalesce(i.reason_code, '') AS reason_code, count(*) AS items
  FROM inbox.replay_item i
 WHERE i.plan_id = %(plan_id)s AND i.status IN ('failed', 'skipped')
   AND i.finished_at = now() AND i.finished_by = session_user
 GROUP BY 1, 2
 ORDER BY 1, 2
"""
ACCEPT_VERSION: Final = """
SELECT p.status FROM inbox.accept_replay_version(%(plan_id)s, %(handler)s::regprocedure, %(version)s, %(note)s) p
"""
CANCEL_PLAN: Final = "SELECT p.status FROM inbox.cancel_replay_plan(%(plan_id)s, %(note)s) p"
RESOLVE_PLAN: Final = """
SELECT p.plan_id FROM inbox.replay_plan p
 WHERE p.plan_name = %(name)s OR p.plan_id = %(plan_id)s::bigint
 ORDER BY p.plan_name = %(name)s DESC
 LIMIT 1
"""
PLAN_STATUS: Final = """
SELECT s.plan_id, s.plan_name, s.consumer, s.message_type, s.handler, s.handler_version, s.status, s.total, s.pending,
       s.applied, s.failed, s.skipped, s.registered_handler, s.registered_version, s.pin_matches, s.created_at,
       s.created_by, s.stopped_at, s.finished_at
  FROM inbox.replay_status s
 WHERE %(plan_id)s::bigint IS NULL OR s.plan_id = %(plan_id)s::bigint
 ORDER BY s.plan_id
"""
PLAN_DECISIONS: Final = """
SELECT d.decision_id, d.decision, d.decided_by, d.decided_at, d.note, d.handler, d.handler_version,
       d.previous_handler, d.previous_version, d.items
  FROM inbox.replay_decision d
 WHERE d.plan_id = %(plan_id)s
 ORDER BY d.decision_id
"""
FAILED_ITEMS: Final = """
SELECT i.item_no, i.tenant, i.producer, i.message_id, i.status, i.reason_code, i.error_message
  FROM inbox.replay_item i
 WHERE i.plan_id = %(plan_id)s AND i.status IN ('failed', 'skipped')
 ORDER BY i.item_no
"""


# --------------------------------------------------------------------------- errors


def _error(exc: psycopg.Error, what: str) -> ReplayError:
    state = exc.sqlstate
    if state == "42501" and missing_grant(exc):
        return ReplayError(
            f"permission denied to {what}: replay plans need the inbox_operator role "
            "(inbox_reader may read inbox.replay_status)",
            sqlstate=state,
        )
    if state in ("3F000", "42P01") or (state == "42883" and "inbox." in str(exc) and "does not exist" in str(exc)):
        return ReplayError("replay plans are not deployed in this database: run `pginbox deploy`", sqlstate=state)
    if state in ("22P02", "42883") and what.startswith(("create replay plan", "accept a new version")):
        # The handler is cast to regprocedure: PostgreSQL's words ("expected a left parenthesis",
        # "function x does not exist") do not say which argument, nor its form.
        return ReplayError(
            f"{what}: --handler must name an existing function with its argument types, e.g. "
            f"'billing.credit(jsonb)' ({server_message(exc)})",
            sqlstate=state,
        )
    cls = ReplayStopped if state == SQLSTATE_VERSION_CHANGED else ReplayError
    return cls(f"{what}: {server_message(exc)}", sqlstate=state)


def _execute_one(
    conn: psycopg.Connection[Any],
    query: str,
    params: Mapping[str, Any],
    what: str,
    error: Callable[[psycopg.Error, str], ReplayError] = _error,
) -> Row:
    """Runs one statement in its own transaction; returns its one row. A database error raises
    error(exc, what) [default: _error, the SQL plans' translation]."""
    try:
        with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(query, params).fetchone()
    except psycopg.Error as exc:
        raise error(exc, what) from exc
    assert row is not None
    return row


# --------------------------------------------------------------------------- results


#: What each reason_code of a skipped item means (docs/replay.md, "Failures, skips and completion").
SKIP_REASONS: Final = {
    "same_version": "the message was processed with the pinned version already: it has that version's effect",
    "duplicate": "its operation id was claimed already (an earlier run or another runner applied it): "
    "the handler did not run",
    "not_processed": "the original message is no longer processed (changed behind the API)",
    "message_missing": "the original message is gone (deleted behind the API)",
    "cancelled": "the plan was cancelled",
}
#: What a failed item's reason_code is.
FAILED_REASON: Final = (
    "the handler raised (reason: its constraint name or SQLSTATE); the item's writes rolled back "
    "and this plan does not retry it: fix the cause, then put it in a new plan"
)


def explain_skip(reason_code: str) -> str:
    return SKIP_REASONS.get(reason_code, "see docs/replay.md")


@dataclass(frozen=True)
class RunResult:
    """What run_plan came to: this run's counts (all calls) and the plan's totals after it.
    `failed_by_reason` / `skipped_by_reason`: this run's failed and skipped items per reason_code
    (earlier runs' left out); `pending_at_start`: the items pending when the run began."""

    plan_id: int
    status: str
    calls: int
    applied_now: int
    failed_now: int
    skipped_now: int
    pending: int
    applied: int
    failed: int
    skipped: int
    failed_by_reason: dict[str, int] = field(default_factory=dict)
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    pending_at_start: int | None = None

    @property
    def done_now(self) -> int:
        return self.applied_now + self.failed_now + self.skipped_now

    def as_json(self) -> Row:
        return {
            "plan_id": self.plan_id,
            "status": self.status,
            "calls": self.calls,
            "this_run": {
                "applied": self.applied_now,
                "failed": self.failed_now,
                "skipped": self.skipped_now,
                "failed_by_reason": dict(self.failed_by_reason),
                "skipped_by_reason": [
                    {"reason_code": code, "items": n, "meaning": explain_skip(code)}
                    for code, n in self.skipped_by_reason.items()
                ],
            },
            "totals": {
                "pending": self.pending,
                "applied": self.applied,
                "failed": self.failed,
                "skipped": self.skipped,
            },
        }


@dataclass(frozen=True)
class PlanStatus:
    row: Row
    decisions: list[Row]
    problems: list[Row]


# --------------------------------------------------------------------------- API


def resolve_plan(conn: psycopg.Connection[Any], plan: str | int) -> int:
    """The plan_id of a plan given by name or id."""
    try:
        text = str(plan)
        plan_id = int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None
        row = conn.execute(RESOLVE_PLAN, {"name": text, "plan_id": plan_id}).fetchone()
    except psycopg.Error as exc:
        raise _error(exc, "find the plan") from exc
    if row is None:
        raise ReplayError(f"no replay plan {str(plan)!r} (`pginbox replay status` lists them)", sqlstate="P0002")
    return int(row[0])


def create_plan(
    conn: psycopg.Connection[Any], name: str, consumer: str, message_type: str, handler: str, version: str, note: str
) -> int:
    """inbox.create_replay_plan; returns the new plan_id."""
    params = _plan_params(name, consumer, message_type, handler, version, note)
    return int(_execute_one(conn, CREATE_PLAN, params, f"create replay plan {name!r}")["plan_id"])


def _plan_params(name: str, consumer: str, message_type: str, handler: str, version: str, note: str) -> Row:
    """The bind parameters of a new plan: CREATE_PLAN's, and pginbox.ops.python_replay_async's
    CREATE_SQL (a plan for a Python handler)."""
    return {
        "name": name,
        "consumer": consumer,
        "message_type": message_type,
        "handler": handler,
        "version": version,
        "note": note,
    }


def read_items(lines: Iterable[str]) -> Iterator[Row]:
    """Items from JSON lines ({producer, message_id, tenant?, payload}); blank lines are skipped."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReplayError(f"line {number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise ReplayError(f"line {number}: expected a JSON object {{producer, message_id, tenant?, payload}}")
        yield item


def add_items(conn: psycopg.Connection[Any], plan_id: int, items: Iterable[Row], *, chunk: int = ADD_CHUNK) -> int:
    """inbox.add_replay_items in chunks, one transaction each; returns how many were added.

    A refused item (payload that does not hash to the stored hash, an identity the consumer never
    processed, ...) fails its chunk; earlier chunks stay added, and adding them again is a no-op."""
    added = 0
    batch: list[Row] = []

    def flush() -> int:
        row = _execute_one(
            conn, ADD_ITEMS, {"plan_id": plan_id, "items": Jsonb(batch)}, f"add items to replay plan {plan_id}"
        )
        return int(row["added"])

    for item in items:
        batch.append(item)
        if len(batch) >= chunk:
            added += flush()
            batch = []
    if batch:
        added += flush()
    return added


def _run_call(conn: psycopg.Connection[Any], plan_id: int, max_items: int) -> tuple[Row, list[Row]]:
    """One inbox.run_replay_plan call and the reasons of the items it failed or skipped, in one
    transaction."""
    params = {"plan_id": plan_id, "max_items": max_items}
    try:
        with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(RUN_PLAN, params).fetchone()
            reasons = cur.execute(RUN_REASONS, params).fetchall()
    except psycopg.Error as exc:
        raise _error(exc, f"run replay plan {plan_id}") from exc
    assert row is not None
    return row, reasons


def run_plan(
    conn: psycopg.Connection[Any],
    plan_id: int,
    *,
    max_items: int = 100,
    until_done: bool = False,
    progress: Callable[[RunResult], None] | None = None,
) -> RunResult:
    """inbox.run_replay_plan, one transaction per call; with until_done, call again while items are
    pending and the last call made progress. Raises ReplayStopped when the plan stops. `progress`
    is called after each call with the run so far."""
    calls = applied = failed = skipped = 0
    failed_by: dict[str, int] = {}
    skipped_by: dict[str, int] = {}
    pending_at_start: int | None = None
    while True:
        row, reasons = _run_call(conn, plan_id, max_items)
        calls += 1
        applied += row["applied_now"]
        failed += row["failed_now"]
        skipped += row["skipped_now"]
        for reason in reasons:
            into = failed_by if reason["status"] == "failed" else skipped_by
            into[reason["reason_code"]] = into.get(reason["reason_code"], 0) + int(reason["items"])
        done_now = row["applied_now"] + row["failed_now"] + row["skipped_now"]
        if pending_at_start is None:
            pending_at_start = int(row["pending"]) + done_now
        if row["status"] == "stopped_version_changed":
            raise ReplayStopped(
                f"replay plan {plan_id} stopped: the handler registered for its consumer and message type changed "
                f"({applied} applied in this run before the stop); nothing more is applied until an operator runs "
                "`pginbox replay accept-version` (or cancels the plan)",
                sqlstate=SQLSTATE_VERSION_CHANGED,
            )
        result = RunResult(
            plan_id=plan_id,
            status=row["status"],
            calls=calls,
            applied_now=applied,
            failed_now=failed,
            skipped_now=skipped,
            pending=row["pending"],
            applied=row["applied"],
            failed=row["failed"],
            skipped=row["skipped"],
            failed_by_reason=dict(sorted(failed_by.items())),
            skipped_by_reason=dict(sorted(skipped_by.items())),
            pending_at_start=pending_at_start,
        )
        if progress is not None:
            progress(result)
        if not until_done or row["pending"] == 0 or done_now == 0 or row["status"] != "open":
            return result


def accept_version(conn: psycopg.Connection[Any], plan_id: int, handler: str, version: str, note: str) -> str:
    """inbox.accept_replay_version; returns the plan's status."""
    params = {"plan_id": plan_id, "handler": handler, "version": version, "note": note}
    return str(_execute_one(conn, ACCEPT_VERSION, params, f"accept a new version for replay plan {plan_id}")["status"])


def cancel_plan(conn: psycopg.Connection[Any], plan_id: int, note: str) -> str:
    """inbox.cancel_replay_plan; returns the plan's status."""
    return str(
        _execute_one(conn, CANCEL_PLAN, {"plan_id": plan_id, "note": note}, f"cancel replay plan {plan_id}")["status"]
    )


def plan_status(conn: psycopg.Connection[Any], plan_id: int | None = None) -> list[PlanStatus]:
    """Progress of one plan (with its audit trail and failed/skipped items) or of all plans."""
    try:
        with conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(PLAN_STATUS, {"plan_id": plan_id}).fetchall()
            result = []
            for row in rows:
                decisions: list[Row] = []
                problems: list[Row] = []
                if plan_id is not None:
                    decisions = cur.execute(PLAN_DECISIONS, {"plan_id": row["plan_id"]}).fetchall()
                    problems = cur.execute(FAILED_ITEMS, {"plan_id": row["plan_id"]}).fetchall()
                result.append(PlanStatus(row=row, decisions=decisions, problems=problems))
    except psycopg.Error as exc:
        raise _error(exc, "read replay status") from exc
    return result
