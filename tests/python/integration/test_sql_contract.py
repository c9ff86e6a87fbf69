"""Every rule the Python package copies from SQL, read back from the deployed database.

Each constant is compared with what the catalog says (enum labels from pg_enum, CHECK constraints
from pg_get_constraintdef, argument names from pg_proc) or with what the SQL API does at the
boundary (64 messages pass and 65 are refused, an excerpt comes back cut, a handler's SQLSTATE is
re-raised or recorded). A change on either side fails here, never silently in production. The
sql/ files are not read: the deployed schema is what a client meets.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pginbox import Outcome
from pginbox.client.retry import is_transient
from pginbox.client.shared import failure_reason
from pginbox.ops import retention
from pginbox.ops.outbox import OUTBOX_STATUSES
from pginbox.ops.quarantine import QUARANTINE_KINDS, QUARANTINE_STATUSES
from pginbox.ops.retention import SCENARIOS
from pginbox.ops.status import MESSAGE_STATUSES
from pginbox.sql_limits import CLAIM_LIMIT, EXCERPT_CHARS, LEASE_MAX_SECONDS, MAX_BATCH, REASON_MAX_BYTES, REPORT_LIMIT
from pginbox.transports.effect import idempotency_key

Conn = psycopg.Connection[Any]
CONSUMER = "contract"

# A SQL handler that counts its runs (nextval survives its rollback), then raises the SQLSTATE and
# constraint its payload names, or books the message.
DOMAIN = """
CREATE TABLE contract_ledger (message_id text NOT NULL);
CREATE SEQUENCE contract_calls;
CREATE FUNCTION contract_handler(payload jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('contract_calls');
    IF payload ? 'constraint' THEN
        RAISE EXCEPTION 'contract: %', payload->>'state'
            USING ERRCODE = payload->>'state', CONSTRAINT = payload->>'constraint';
    ELSIF payload ? 'state' THEN
        RAISE EXCEPTION 'contract: %', payload->>'state' USING ERRCODE = payload->>'state';
    END IF;
    INSERT INTO contract_ledger VALUES (ctx.message_id);
END $$;
SELECT inbox.register_handler('contract', 'm', 'contract_handler(jsonb, inbox.message_context)'::regprocedure, 'v1');
"""

APPLY = """
SELECT outcome, reason_code
  FROM inbox.claim_and_apply(%(consumer)s, 'p', %(id)s, 'm', %(payload)s, '', %(produced_at)s)
"""


@pytest.fixture
def db(conn: Conn) -> Conn:
    conn.execute(DOMAIN)
    return conn


def apply(conn: Conn, message_id: str, payload: dict[str, Any], produced_at: Any = None) -> tuple[str, str | None]:
    row = conn.execute(
        APPLY, {"consumer": CONSUMER, "id": message_id, "payload": Jsonb(payload), "produced_at": produced_at}
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def handler_runs(conn: Conn) -> int:
    row = conn.execute("SELECT last_value - (NOT is_called)::int FROM contract_calls").fetchone()
    assert row is not None
    return int(row[0])


def uid() -> str:
    return f"c-{uuid.uuid4().hex[:12]}"


# ----------------------------------------------------------------------------- the catalog


def enum_labels(conn: Conn, type_name: str) -> tuple[str, ...]:
    rows = conn.execute(
        "SELECT e.enumlabel FROM pg_catalog.pg_enum e WHERE e.enumtypid = %s::regtype ORDER BY e.enumsortorder",
        (type_name,),
    ).fetchall()
    return tuple(r[0] for r in rows)


def check_values(conn: Conn, table: str, column: str) -> tuple[str, ...]:
    """The text literals of the CHECK constraint on `table`.`column` (`column IN ('a', 'b')`)."""
    rows = conn.execute(
        "SELECT pg_catalog.pg_get_constraintdef(c.oid) FROM pg_catalog.pg_constraint c"
        "  JOIN pg_catalog.pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)"
        " WHERE c.conrelid = %s::regclass AND c.contype = 'c' AND a.attname = %s AND cardinality(c.conkey) = 1",
        (table, column),
    ).fetchall()
    assert len(rows) == 1, rows
    return tuple(re.findall(r"'((?:[^']|'')*)'::text", rows[0][0]))


def test_statuses_and_kinds_match_the_catalog(conn: Conn) -> None:
    assert enum_labels(conn, "inbox.effect_status") == OUTBOX_STATUSES
    assert enum_labels(conn, "inbox.message_status") == MESSAGE_STATUSES
    assert check_values(conn, "inbox.quarantine", "status") == QUARANTINE_STATUSES
    assert check_values(conn, "inbox.quarantine", "kind") == QUARANTINE_KINDS


def test_retention_scenarios_are_the_policy_arguments(conn: Conn) -> None:
    row = conn.execute(
        "SELECT p.proargnames, p.proargmodes FROM pg_catalog.pg_proc p"
        " WHERE p.oid = 'inbox.set_retention_policy'::regproc"
    ).fetchone()
    assert row is not None
    names, modes = row
    inputs = [n for n, mode in zip(names, modes or ["i"] * len(names), strict=True) if mode in ("i", "b")]
    assert tuple(n for n in inputs if n not in ("consumer", "producer", "note")) == SCENARIOS


# ----------------------------------------------------------------------------- limits, at the boundary


def refused(conn: Conn, query: str, params: Any, sqlstate: str) -> None:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(query, params)
    assert caught.value.sqlstate == sqlstate, caught.value


def test_batch_limit(db: Conn) -> None:
    def batch(n: int) -> Jsonb:
        return Jsonb([{"producer": "p", "message_id": uid(), "message_type": "m", "payload": {}} for _ in range(n)])

    query = "SELECT count(*) FROM inbox.claim_and_apply_batch(%s, %s)"
    assert db.execute(query, (CONSUMER, batch(MAX_BATCH))).fetchone() == (MAX_BATCH,)
    refused(db, query, (CONSUMER, batch(MAX_BATCH + 1)), "54000")


def test_report_limit(conn: Conn) -> None:
    query = (
        "SELECT count(*) FROM inbox.complete_effects(array_fill('fx'::text, ARRAY[%s]),"
        " array_fill(1::bigint, ARRAY[%s]))"
    )
    assert conn.execute(query, (REPORT_LIMIT, REPORT_LIMIT)).fetchone() == (REPORT_LIMIT,)  # all fenced
    refused(conn, query, (REPORT_LIMIT + 1, REPORT_LIMIT + 1), "54000")
    fail = (
        "SELECT count(*) FROM inbox.fail_effects(array_fill('fx'::text, ARRAY[%s]),"
        " array_fill(1::bigint, ARRAY[%s]), array_fill('e'::text, ARRAY[%s]), array_fill(true, ARRAY[%s]))"
    )
    refused(conn, fail, (REPORT_LIMIT + 1,) * 4, "54000")


def test_claim_and_lease_limits(conn: Conn) -> None:
    query = "SELECT count(*) FROM inbox.claim_effects('contract', %s, make_interval(secs => %s), key_aware => true)"
    assert conn.execute(query, (CLAIM_LIMIT, LEASE_MAX_SECONDS)).fetchone() == (0,)
    refused(conn, query, (CLAIM_LIMIT + 1, 30), "22023")
    refused(conn, query, (1, LEASE_MAX_SECONDS + 1), "22023")


def test_excerpts_and_errors_are_cut_where_the_webhook_cuts(conn: Conn) -> None:
    """The dispatcher sends excerpts and errors as they are; SQL keeps EXCERPT_CHARS of them."""
    for effect_id in ("fx-done", "fx-failed"):
        conn.execute("SELECT inbox.enqueue_effect(%s, 'contract-dest', '{}')", (effect_id,))
    claim = "SELECT effect_id, lease_token FROM inbox.claim_effects('contract', 2, key_aware => true)"
    leases = dict(conn.execute(claim).fetchall())
    long = "é" * (EXCERPT_CHARS + 500)
    conn.execute(
        "SELECT inbox.complete_effects(ARRAY[%s], ARRAY[%s::bigint], ARRAY[200], ARRAY[%s], ARRAY[5])",
        ("fx-done", leases["fx-done"], long),
    )
    conn.execute(
        "SELECT inbox.fail_effects(ARRAY[%s], ARRAY[%s::bigint], ARRAY[%s], ARRAY[true], NULL, ARRAY[%s])",
        ("fx-failed", leases["fx-failed"], long, long),
    )
    rows = conn.execute(
        "SELECT effect_id, length(last_response_excerpt), length(last_error) FROM inbox.outbox ORDER BY effect_id"
    ).fetchall()
    assert rows == [("fx-done", EXCERPT_CHARS, None), ("fx-failed", EXCERPT_CHARS, EXCERPT_CHARS)]


@pytest.mark.parametrize(
    ("consumer", "tenant", "effect_id"),
    [
        ("billing", "", "fx_1"),
        ("a", "bc", "d"),
        ("ab", "c", "d"),
        ("", "", ""),
        ("café", "ü", "ключ-€"),
        ("billing@v2", "acme", "fx_" + "f" * 64),
    ],
)
def test_idempotency_key_is_computed_alike(conn: Conn, consumer: str, tenant: str, effect_id: str) -> None:
    """pginbox.transports.effect.idempotency_key (what a destination can check a key with) equals
    inbox.idempotency_key, byte lengths of non-ASCII text included."""
    row = conn.execute("SELECT inbox.idempotency_key(%s, %s, %s)", (consumer, tenant, effect_id)).fetchone()
    assert row is not None and row[0] == idempotency_key(consumer, tenant, effect_id)


def test_reason_code_length(db: Conn) -> None:
    query = (
        "SELECT outcome FROM inbox.record_failure(consumer => %s, producer => 'p', message_id => %s,"
        " payload => '{}', reason_code => %s, error_message => 'e', message_type => 'm')"
    )
    assert db.execute(query, (CONSUMER, uid(), "r" * REASON_MAX_BYTES)).fetchone() == ("failed",)
    assert db.execute(query, (CONSUMER, uid(), "é" * (REASON_MAX_BYTES // 2))).fetchone() == ("failed",)
    refused(db, query, (CONSUMER, uid(), "r" * (REASON_MAX_BYTES + 1)), "22023")


# ----------------------------------------------------------------------------- rules


def raised(conn: Conn, payload: dict[str, Any]) -> psycopg.Error:
    """The error the handler raises for `payload`, called directly (as a Python handler's would be)."""
    try:
        with conn.transaction():
            conn.execute("SELECT contract_handler(%s, NULL)", (Jsonb(payload),))
    except psycopg.Error as exc:
        return exc
    raise AssertionError(f"the handler did not raise for {payload}")


@pytest.mark.parametrize("constraint", [None, "", "c", "x" * 64, "x" * 65, "é" * 32, "é" * 33])
def test_reason_code_rule(db: Conn, constraint: str | None) -> None:
    """A handler error's reason code, recorded by SQL for a SQL handler and derived by Python for a
    Python handler: the constraint it names when 1-64 bytes long, else its SQLSTATE."""
    payload: dict[str, Any] = {"state": "P0001"}
    if constraint is not None:
        payload["constraint"] = constraint
    outcome, sql_reason = apply(db, uid(), payload)
    assert outcome == "failed"
    assert failure_reason(raised(db, payload))[0] == sql_reason


TRANSIENT_PROBES = [
    "40001",
    "40P01",
    "40002",
    "40003",
    "55P03",
    "55000",
    "55006",
    "57014",
    "57P01",
    "57P04",
    "08000",
    "08006",
    "08P01",
    "53000",
    "53100",
    "53200",
    "53300",
    "53400",
    "54000",
    "23505",
    "22023",
    "25P02",
    "42501",
    "P0001",
    "XX000",
]


@pytest.mark.parametrize("state", TRANSIENT_PROBES)
def test_transient_sqlstates(db: Conn, state: str) -> None:
    """SQL re-raises a handler's transient error (the caller retries the whole transaction) and
    records the others; Python's classification must say the same of the same error."""
    try:
        outcome, reason = apply(db, uid(), {"state": state})
        sql_transient = False
        assert (outcome, reason) == ("failed", state)
    except psycopg.Error as exc:
        assert exc.sqlstate == state, exc
        sql_transient = True
    assert is_transient(raised(db, {"state": state})) is sql_transient


# ----------------------------------------------------------------------------- outcome -> ack


def test_ack_means_a_redelivery_would_not_run_the_handler(db: Conn) -> None:
    """Outcome.ack is True exactly for the outcomes after which SQL holds the identity: a
    redelivery of the same message does not run the handler again (so acking loses nothing)."""
    db.execute("SELECT inbox.configure_consumer('contract', max_attempts => 3)")
    seen: dict[Outcome, bool] = {}

    def deliver_twice(message_id: str, payload: dict[str, Any], first: str, produced_at: Any = None) -> None:
        assert apply(db, message_id, payload, produced_at)[0] == first
        before = handler_runs(db)
        apply(db, message_id, payload, produced_at)
        seen[Outcome(first)] = handler_runs(db) > before

    applied = uid()
    deliver_twice(applied, {}, "applied")
    deliver_twice(applied, {}, "duplicate")
    deliver_twice(applied, {"other": 1}, "conflict")
    deliver_twice(uid(), {"state": "P0001"}, "failed")
    held = uid()
    for _ in range(2):
        apply(db, held, {"state": "P0001"})
    deliver_twice(held, {"state": "P0001"}, "quarantined")
    deliver_twice(uid(), {}, "expired", produced_at=expired_produced_at(db))

    assert set(seen) == set(Outcome) - {Outcome.CLAIMED}  # every outcome SQL answers, probed
    for outcome, ran_again in seen.items():
        assert outcome.ack is not ran_again, outcome


def expired_produced_at(conn: Conn) -> Any:
    """A produced_at before the consumer's purge watermark: a policy, a message processed 30 days
    ago by a consumer active all along, and its purge (as test_retention does it)."""
    conn.execute(
        "SELECT inbox.set_retention_policy('contract', '', broker_retention => '1 day',"
        " max_offset_rewind => '0', dead_letter_redrive_horizon => '0', producer_retry_horizon => '0',"
        " outage_allowance => '0', backup_restore_window => '0', planned_replay_horizon => '0',"
        " safety_margin => '1 hour', note => 'contract test')"
    )
    old = uid()
    assert apply(conn, old, {})[0] == "applied"
    conn.execute(
        "UPDATE inbox.message SET processed_at = now() - interval '30 days',"
        " produced_at = now() - interval '30 days' WHERE consumer = 'contract'"
    )
    conn.execute("DELETE FROM inbox.activity_gap WHERE consumer = 'contract'")
    conn.execute(
        "INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to)"
        " VALUES ('contract', '-infinity', now() - interval '60 days')"
    )
    conn.execute("UPDATE inbox.consumer_config SET last_active_at = now() WHERE consumer = 'contract'")
    report = retention.purge_consumer(conn, CONSUMER, wait_timeout=20)
    assert report.status == "purged", report
    # Before what the purge deleted (produced 30 days ago): a copy of anything that old could be a
    # purged message (0.3.0 expires nothing produced after the latest purged produced_at).
    row = conn.execute("SELECT now() - interval '31 days'").fetchone()
    assert row is not None
    return row[0]
