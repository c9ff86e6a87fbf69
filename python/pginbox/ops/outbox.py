"""The operator's queries behind `pginbox outbox list | show | redrive | discard`.

inbox_reader may list effects and show them without their payload columns; the payload, redrive
and discard need inbox_operator. Database errors are not translated: the CLI prints them as one
line with their SQLSTATE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from pginbox.errors import AmbiguousEffect, server_message

__all__ = [
    "OUTBOX_STATUSES",
    "AmbiguousEffect",
    "BulkRedrive",
    "EffectDetails",
    "count_effects",
    "discard_effect",
    "find_effect",
    "list_effects",
    "redrive_effect",
    "redrive_many",
    "select_dead",
    "show_effect",
]

Row = dict[str, Any]

#: The labels of enum inbox.effect_status (pinned by test_sql_contract).
OUTBOX_STATUSES: Final = ("pending", "leased", "delivered", "dead", "discarded")

# last_error is an error text: readers (inbox_reader) may not read it (sql/096_reader_grants.sql).
# The queries name it through {last_error}: the column, or NULL for a role without the grant.
LAST_ERROR_READABLE: Final = "SELECT pg_catalog.has_column_privilege('inbox.outbox', 'last_error', 'SELECT')"

# The reason an effect waits without spending attempts (inbox.defer_effects), while it does: it is
# pending and was deferred after its last claim.
_DEFERRED: Final = (
    "CASE WHEN status = 'pending' AND deferred_at >= coalesce(last_attempt_at, '-infinity') THEN deferred_reason END"
)
_OUTBOX_FILTER: Final = """
 WHERE (%(status)s::text IS NULL OR status::text = %(status)s::text)
   AND (%(consumer)s::text IS NULL OR consumer = %(consumer)s::text)
   AND (%(destination)s::text IS NULL OR destination = %(destination)s::text)
"""
# Newest first: what an operator looks for is what just went wrong, not the oldest delivered effect.
OUTBOX_LIST: Final = (
    """
SELECT effect_id, consumer, destination, status::text AS status, attempts, ordering_key, created_at, available_at,
       leased_by, last_status_code, dead_reason::text AS dead_reason, {last_error} AS last_error,
       """
    + _DEFERRED
    + """ AS deferred_reason, deferrals
  FROM inbox.outbox"""
    + _OUTBOX_FILTER
    + """
 ORDER BY created_at DESC, order_seq DESC NULLS LAST, effect_id, consumer
 LIMIT %(limit)s
"""
)
OUTBOX_COUNT: Final = "SELECT count(*) FROM inbox.outbox" + _OUTBOX_FILTER
# The effects an id names: itself, or (when no effect has that id) the ids it begins. At most 11
# (the CLI lists up to 10 candidates of an ambiguous prefix).
OUTBOX_MATCHES: Final = """
(SELECT effect_id, consumer, true AS exact FROM inbox.outbox
  WHERE effect_id = %(effect_id)s AND (%(consumer)s::text IS NULL OR consumer = %(consumer)s::text)
  ORDER BY consumer LIMIT 11)
UNION ALL
(SELECT effect_id, consumer, false FROM inbox.outbox
  WHERE effect_id LIKE %(prefix)s AND effect_id <> %(effect_id)s
    AND (%(consumer)s::text IS NULL OR consumer = %(consumer)s::text)
  ORDER BY effect_id, consumer LIMIT 11)
"""
OUTBOX_SHOW: Final = (
    """
SELECT effect_id, consumer, destination, status::text AS status, attempts, ordering_key, order_seq, blocked,
       created_at, available_at, lease_token, leased_by, lease_expires_at, last_attempt_at, {last_error} AS last_error,
       last_status_code, last_duration_ms, delivered_at, dead_reason::text AS dead_reason, discarded_at,
       """
    + _DEFERRED
    + """ AS deferred_reason, deferred_at, deferrals
  FROM inbox.outbox
 WHERE effect_id = %(effect_id)s AND consumer = %(consumer)s
"""
)
OUTBOX_SHOW_PAYLOAD: Final = """
SELECT payload, headers, last_response_excerpt
  FROM inbox.outbox
 WHERE effect_id = %(effect_id)s AND consumer = %(consumer)s
"""
OUTBOX_REDRIVES: Final = """
SELECT redrive_id, redriven_by, redriven_at, note, attempts, dead_reason::text AS dead_reason,
       {last_error} AS last_error
  FROM inbox.outbox_redrive
 WHERE effect_id = %(effect_id)s AND consumer = %(consumer)s
 ORDER BY redrive_id
"""
OUTBOX_REDRIVE: Final = """
SELECT effect_id, consumer, status::text AS status, attempts
  FROM inbox.redrive_effect(%(effect_id)s, %(note)s, %(consumer)s)
"""
OUTBOX_DISCARDS: Final = """
SELECT discard_id, discarded_by, discarded_at, note, attempts, dead_reason, {last_error} AS last_error
  FROM inbox.outbox_discard
 WHERE effect_id = %(effect_id)s AND consumer = %(consumer)s
 ORDER BY discard_id
"""
OUTBOX_DISCARD: Final = """
SELECT effect_id, consumer, status::text AS status, attempts, ordering_key, discarded_at
  FROM inbox.discard_effect(%(effect_id)s, %(note)s, %(consumer)s)
"""


def _last_error(conn: psycopg.Connection[Any]) -> str:
    """last_error, or NULL for a role that may not read it."""
    row = conn.execute(LAST_ERROR_READABLE).fetchone()
    return "last_error" if row is not None and row[0] else "NULL::text"


def _like_prefix(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


@dataclass
class EffectDetails:
    """One effect (with payload, headers and response excerpt when asked for), its redrives and
    its discards (the audit rows)."""

    effect: Row
    redrives: list[Row]
    discards: list[Row]


def list_effects(
    conn: psycopg.Connection[Any],
    status: str | None,
    limit: int,
    consumer: str | None = None,
    destination: str | None = None,
) -> list[Row]:
    """Effects in `status` (None: every status) of `consumer` (None: every consumer) to
    `destination` (None: every one), newest first. last_error is None for a role that may not read
    it (inbox_reader)."""
    query = OUTBOX_LIST.format(last_error=_last_error(conn))
    params = {"status": status, "consumer": consumer, "destination": destination, "limit": limit}
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()


def count_effects(
    conn: psycopg.Connection[Any], status: str | None, consumer: str | None = None, destination: str | None = None
) -> int:
    """How many effects list_effects would list without its limit."""
    row = conn.execute(OUTBOX_COUNT, {"status": status, "consumer": consumer, "destination": destination}).fetchone()
    return int(row[0]) if row else 0


def find_effect(conn: psycopg.Connection[Any], effect_id: str, consumer: str | None = None) -> tuple[str, str] | None:
    """The (effect_id, consumer) that `effect_id` names: the effect with that id, else the one
    whose id begins with it (a unique prefix, e.g. copied from a narrow terminal); `consumer`
    narrows both. None when nothing matches; AmbiguousEffect when several effects do (effect ids
    are unique per consumer: one id may be held by several consumers)."""
    params = {"effect_id": effect_id, "consumer": consumer, "prefix": _like_prefix(effect_id)}
    rows = [(str(r[0]), str(r[1]), bool(r[2])) for r in conn.execute(OUTBOX_MATCHES, params).fetchall()]
    exact = [(i, c) for i, c, e in rows if e]
    found = exact or [(i, c) for i, c, e in rows if not e]
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    shown = ", ".join(f"{i!r} (consumer {c!r})" for i, c in found[:10]) + (", ..." if len(found) > 10 else "")
    if exact:
        message = f"effect {effect_id!r} is held by several consumers: {shown}; pass --consumer"
    else:
        message = f"{effect_id!r} begins several effect ids: {shown}; pass more of the id" + (
            "" if consumer is not None else " or --consumer"
        )
    raise AmbiguousEffect(message, found[:10])


def show_effect(
    conn: psycopg.Connection[Any], effect_id: str, *, with_payload: bool = False, consumer: str | None = None
) -> EffectDetails | None:
    """One effect (its id or a unique prefix of it, see find_effect) and its audit rows; None when
    there is no such effect. last_error is None for a role that may not read it."""
    found = find_effect(conn, effect_id, consumer)
    if found is None:
        return None
    params = {"effect_id": found[0], "consumer": found[1]}
    last_error = _last_error(conn)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_SHOW.format(last_error=last_error), params).fetchone()
        if row is None:  # purged in between
            return None
        redrives = cur.execute(OUTBOX_REDRIVES.format(last_error=last_error), params).fetchall()
        discards = cur.execute(OUTBOX_DISCARDS.format(last_error=last_error), params).fetchall()
        if with_payload:
            extra = cur.execute(OUTBOX_SHOW_PAYLOAD, params).fetchone()
            row.update(extra or {})
    return EffectDetails(row, redrives, discards)


def redrive_effect(conn: psycopg.Connection[Any], effect_id: str, note: str, consumer: str | None = None) -> Row:
    """inbox.redrive_effect: a dead effect is sent again (attempts reset, audited). `consumer`
    None: the only consumer holding that id (P0003 when several do)."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_REDRIVE, {"effect_id": effect_id, "note": note, "consumer": consumer}).fetchone()
    assert row is not None
    return row


# Dead effects a bulk redrive selects: filters all optional, oldest first (the order they went in).
DEAD_SELECTION: Final = """
SELECT effect_id, consumer, {tenant} AS tenant
  FROM inbox.outbox
 WHERE status = 'dead'
   AND (%(destination)s::text IS NULL OR destination = %(destination)s::text)
   AND (%(consumer)s::text IS NULL OR consumer = %(consumer)s::text)
   AND (%(dead_reason)s::text IS NULL OR dead_reason::text = %(dead_reason)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
 ORDER BY created_at, order_seq NULLS LAST, effect_id, consumer
 LIMIT %(limit)s
"""
OUTBOX_REDRIVE_EXACT: Final = """
SELECT effect_id, consumer, status::text AS status, attempts
  FROM inbox.redrive_effect(%(effect_id)s, %(note)s, %(consumer)s, %(tenant)s)
"""


@dataclass
class BulkRedrive:
    """What a bulk redrive did: `selected` dead effects matched; `redriven` of them were sent again
    (each audited in inbox.outbox_redrive, as a single redrive is); `skipped` were no longer dead
    when their turn came (redriven, discarded or purged meanwhile), with the first reason."""

    selected: int = 0
    redriven: int = 0
    skipped: int = 0
    first_skip: str | None = None
    effects: list[Row] = field(default_factory=list)


def check_may_redrive(conn: psycopg.Connection[Any]) -> None:
    """Raises the database's own 42501 when this role may not redrive (before a bulk redrive
    selects anything, so that a reader is told so instead of 'redrove 0 of 0')."""
    row = conn.execute(
        "SELECT pg_catalog.has_function_privilege('inbox.redrive_effect(text, text, text, text)', 'EXECUTE')"
    ).fetchone()
    if row is not None and not row[0]:
        with conn.transaction(force_rollback=True):
            conn.execute("SELECT inbox.redrive_effect(NULL, NULL)")  # permission denied for function ...


def select_dead(
    conn: psycopg.Connection[Any],
    *,
    destination: str | None = None,
    consumer: str | None = None,
    dead_reason: str | None = None,
    since: str | None = None,
    until: str | None = None,
    limit: int = 10000,
) -> list[Row]:
    """The dead effects matching every filter given (created_at in [since, until)), oldest first;
    tenant None for a role that may not read it (a reader's --dry-run)."""
    params = {
        "destination": destination,
        "consumer": consumer,
        "dead_reason": dead_reason,
        "since": since,
        "until": until,
        "limit": limit,
    }
    readable = conn.execute("SELECT pg_catalog.has_column_privilege('inbox.outbox', 'tenant', 'SELECT')").fetchone()
    query = DEAD_SELECTION.format(tenant="tenant" if readable and readable[0] else "NULL::text")
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()


def redrive_many(
    conn: psycopg.Connection[Any], effects: list[Row], note: str, progress: Callable[[BulkRedrive], None] | None = None
) -> BulkRedrive:
    """inbox.redrive_effect for each selected effect, one transaction each (a failure of one leaves
    the others redriven): the same audit row as a single redrive. `progress` after each."""
    result = BulkRedrive(selected=len(effects))
    for effect in effects:
        params = {
            "effect_id": effect["effect_id"],
            "note": note,
            "consumer": effect["consumer"],
            "tenant": effect["tenant"],
        }
        try:
            with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                row = cur.execute(OUTBOX_REDRIVE_EXACT, params).fetchone()
        except (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.NoDataFound) as exc:
            result.skipped += 1
            result.first_skip = result.first_skip or f"{effect['effect_id']}: {server_message(exc)}"
        else:
            result.redriven += 1
            if row is not None:
                result.effects.append(row)
        if progress is not None:
            progress(result)
    return result


def discard_effect(conn: psycopg.Connection[Any], effect_id: str, note: str, consumer: str | None = None) -> Row:
    """inbox.discard_effect: a dead effect is closed without delivery (audited). `consumer` as for
    redrive_effect."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_DISCARD, {"effect_id": effect_id, "note": note, "consumer": consumer}).fetchone()
    assert row is not None
    return row
