"""The operator's queries behind `pginbox outbox list | show | redrive | discard`.

inbox_reader may list effects and show them without their payload columns; the payload, redrive
and discard need inbox_operator. Database errors are not translated: the CLI prints them as one
line with their SQLSTATE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

__all__ = ["OUTBOX_STATUSES", "EffectDetails", "discard_effect", "list_effects", "redrive_effect", "show_effect"]

Row = dict[str, Any]

#: The labels of enum inbox.effect_status (pinned by test_sql_contract).
OUTBOX_STATUSES: Final = ("pending", "leased", "delivered", "dead", "discarded")

OUTBOX_LIST: Final = """
SELECT effect_id, destination, status::text AS status, attempts, ordering_key, created_at, available_at,
       leased_by, last_status_code, dead_reason::text AS dead_reason, last_error
  FROM inbox.outbox
 WHERE %(status)s::text IS NULL OR status::text = %(status)s::text
 ORDER BY created_at, order_seq NULLS LAST, effect_id
 LIMIT %(limit)s
"""
OUTBOX_SHOW: Final = """
SELECT effect_id, destination, status::text AS status, attempts, ordering_key, order_seq, blocked, created_at,
       available_at, lease_token, leased_by, lease_expires_at, last_attempt_at, last_error, last_status_code,
       last_duration_ms, delivered_at, dead_reason::text AS dead_reason, discarded_at
  FROM inbox.outbox
 WHERE effect_id = %(effect_id)s
"""
OUTBOX_SHOW_PAYLOAD: Final = """
SELECT payload, headers, last_response_excerpt FROM inbox.outbox WHERE effect_id = %(effect_id)s
"""
OUTBOX_REDRIVES: Final = """
SELECT redrive_id, redriven_by, redriven_at, note, attempts, dead_reason::text AS dead_reason, last_error
  FROM inbox.outbox_redrive
 WHERE effect_id = %(effect_id)s
 ORDER BY redrive_id
"""
OUTBOX_REDRIVE: Final = """
SELECT effect_id, status::text AS status, attempts FROM inbox.redrive_effect(%(effect_id)s, %(note)s)
"""
OUTBOX_DISCARDS: Final = """
SELECT discard_id, discarded_by, discarded_at, note, attempts, dead_reason, last_error
  FROM inbox.outbox_discard
 WHERE effect_id = %(effect_id)s
 ORDER BY discard_id
"""
OUTBOX_DISCARD: Final = """
SELECT effect_id, status::text AS status, attempts, ordering_key, discarded_at
  FROM inbox.discard_effect(%(effect_id)s, %(note)s)
"""


@dataclass
class EffectDetails:
    """One effect (with payload, headers and response excerpt when asked for), its redrives and
    its discards (the audit rows)."""

    effect: Row
    redrives: list[Row]
    discards: list[Row]


def list_effects(conn: psycopg.Connection[Any], status: str | None, limit: int) -> list[Row]:
    """Effects in `status` (None: every status), oldest first."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(OUTBOX_LIST, {"status": status, "limit": limit}).fetchall()


def show_effect(conn: psycopg.Connection[Any], effect_id: str, *, with_payload: bool = False) -> EffectDetails | None:
    """One effect and its audit rows; None when there is no such effect."""
    params = {"effect_id": effect_id}
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_SHOW, params).fetchone()
        if row is None:
            return None
        redrives = cur.execute(OUTBOX_REDRIVES, params).fetchall()
        discards = cur.execute(OUTBOX_DISCARDS, params).fetchall()
        if with_payload:
            extra = cur.execute(OUTBOX_SHOW_PAYLOAD, params).fetchone()
            row.update(extra or {})
    return EffectDetails(row, redrives, discards)


def redrive_effect(conn: psycopg.Connection[Any], effect_id: str, note: str) -> Row:
    """inbox.redrive_effect: a dead effect is sent again (attempts reset, audited)."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_REDRIVE, {"effect_id": effect_id, "note": note}).fetchone()
    assert row is not None
    return row


def discard_effect(conn: psycopg.Connection[Any], effect_id: str, note: str) -> Row:
    """inbox.discard_effect: a dead effect is closed without delivery (audited)."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(OUTBOX_DISCARD, {"effect_id": effect_id, "note": note}).fetchone()
    assert row is not None
    return row
