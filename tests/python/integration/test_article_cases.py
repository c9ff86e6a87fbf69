"""The article's delivery cases, one session at a time, against a real PostgreSQL.

Every test builds its own domain (account + ledger + handlers) in its fresh database and checks the
invariant on the domain itself: each message applied at most once, and a rolled-back attempt leaves
nothing behind and stays retryable.
"""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg.errors
import pytest
from helpers_inbox import (
    LOYALTY_ACCOUNT,
    Delivery,
    apply_in_caller,
    assert_applied_exactly,
    balance,
    canonical_sha256,
    claim,
    claim_and_apply,
    connect,
    deliver_with_claim,
    failed_attempts,
    handler_calls,
    inbox_rows,
    ledger_counts,
    payload,
    setup_domain,
)
from psycopg.rows import dict_row

Conn = psycopg.Connection[Any]


class SimulatedCrash(Exception):
    """Stands for the consumer process dying inside its transaction."""


@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


def quarantine_entry(conn: Conn, quarantine_id: int | None) -> dict[str, Any]:
    """An entry of inbox.quarantine, payload included (superuser read)."""
    assert quarantine_id is not None
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT * FROM inbox.quarantine WHERE quarantine_id = %s", (quarantine_id,))
        entry = cur.fetchone()
    assert entry is not None, f"no quarantine entry {quarantine_id}"
    return entry


# --- same message delivered sequentially twice ------------------------------------------------


def test_sequential_redelivery_claim_style(domain: Conn) -> None:
    body = payload("m-1", 10)
    first = deliver_with_claim(domain, body)
    second = deliver_with_claim(domain, body)

    assert first.outcome == "claimed"
    assert first.stored_sha256 is None
    assert first.payload_sha256 == canonical_sha256(domain, body)
    assert second.outcome == "duplicate"
    assert second.stored_sha256 == second.payload_sha256 == first.payload_sha256
    assert second.handler_version == "v1"
    assert second.processed_at is not None and second.processed_at == first.processed_at
    assert_applied_exactly(domain, {"m-1": 10})
    rows = inbox_rows(domain, "m-1")
    assert len(rows) == 1 and rows[0]["status"] == "processed"


def test_sequential_redelivery_claim_and_apply(domain: Conn) -> None:
    body = payload("m-1", 10)
    first = claim_and_apply(domain, "m-1", body)
    second = claim_and_apply(domain, "m-1", body)

    assert first.outcome == "applied"
    assert first.payload_sha256 == canonical_sha256(domain, body)
    assert first.handler_version == "v1"
    assert second.outcome == "duplicate"
    assert second.stored_sha256 == first.payload_sha256
    assert handler_calls(domain) == 1, "the handler must not run for a duplicate"
    assert_applied_exactly(domain, {"m-1": 10})


def test_redelivery_with_reordered_keys_is_a_duplicate(domain: Conn) -> None:
    """The hash is of jsonb's canonical text: key order and whitespace on the wire do not matter."""
    first = claim_and_apply(domain, "m-1", payload("m-1", 10))
    with domain.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT * FROM inbox.claim_and_apply('billing', 'orders', 'm-1', 'credit',"
            ' \'{ "amount" : 10,  "account": 1, "id": "m-1" }\'::jsonb)'
        )
        row = cur.fetchone()
    assert row is not None
    assert first.outcome == "applied"
    assert Delivery.from_row(row).outcome == "duplicate"
    assert_applied_exactly(domain, {"m-1": 10})


# --- crash before the inbox insert -------------------------------------------------------------


def test_crash_before_claim_leaves_nothing(domain: Conn) -> None:
    body = payload("m-1", 10)
    with pytest.raises(SimulatedCrash), domain.transaction():
        # work the consumer did before it reached the claim, then it dies
        domain.execute("UPDATE account SET balance = balance + 999 WHERE id = 1")
        raise SimulatedCrash
    assert inbox_rows(domain, "m-1") == []
    assert_applied_exactly(domain, {})

    assert deliver_with_claim(domain, body).outcome == "claimed"
    assert_applied_exactly(domain, {"m-1": 10})


# --- exception after the claim, before the domain update ---------------------------------------


@pytest.mark.parametrize("how", ["exception", "explicit_rollback"])
def test_exception_after_claim_rolls_the_claim_back(domain: Conn, how: str) -> None:
    body = payload("m-1", 10)
    if how == "exception":
        with pytest.raises(SimulatedCrash), domain.transaction():
            assert claim(domain, "m-1", body).outcome == "claimed"
            raise SimulatedCrash
    else:
        domain.execute("BEGIN")
        assert claim(domain, "m-1", body).outcome == "claimed"
        domain.execute("ROLLBACK")

    assert inbox_rows(domain, "m-1") == [], "a rolled-back claim must leave no inbox row"
    assert_applied_exactly(domain, {})

    redelivery = deliver_with_claim(domain, body)
    assert redelivery.outcome == "claimed", "the rolled-back attempt must stay retryable"
    assert deliver_with_claim(domain, body).outcome == "duplicate"
    assert_applied_exactly(domain, {"m-1": 10})


def test_domain_error_after_claim_rolls_the_claim_back(domain: Conn) -> None:
    """The domain update itself fails (a real SQL error): claim and update go together."""
    body = payload("m-1", 10)
    with pytest.raises(psycopg.errors.ForeignKeyViolation), domain.transaction():
        assert claim(domain, "m-1", body).outcome == "claimed"
        apply_in_caller(domain, {**body, "account": 42})  # no such account
    assert inbox_rows(domain, "m-1") == []
    assert deliver_with_claim(domain, body).outcome == "claimed"
    assert_applied_exactly(domain, {"m-1": 10})


# --- commit succeeds, acknowledgement lost -----------------------------------------------------


@pytest.mark.parametrize("style", ["claim", "claim_and_apply"])
def test_ack_lost_after_commit(db_dsn: str, domain: Conn, style: str) -> None:
    body = payload("m-1", 10)
    # the consumer commits, then dies before acking: its connection simply goes away
    with connect(db_dsn) as consumer:
        if style == "claim":
            assert deliver_with_claim(consumer, body).outcome == "claimed"
        else:
            assert claim_and_apply(consumer, "m-1", body).outcome == "applied"

    # the broker redelivers to a fresh consumer
    with connect(db_dsn) as restarted:
        for _ in range(3):
            if style == "claim":
                again = deliver_with_claim(restarted, body)
            else:
                again = claim_and_apply(restarted, "m-1", body)
            assert again.outcome == "duplicate"
            assert again.stored_sha256 == again.payload_sha256
    assert_applied_exactly(domain, {"m-1": 10})
    assert handler_calls(domain) == (1 if style == "claim_and_apply" else 0)


# --- same id, different payload ----------------------------------------------------------------


@pytest.mark.parametrize("style", ["claim", "claim_and_apply"])
def test_same_id_different_payload_is_a_conflict(domain: Conn, style: str) -> None:
    original, tampered = payload("m-1", 10), payload("m-1", 1000)
    if style == "claim":
        assert deliver_with_claim(domain, original).outcome == "claimed"
        conflict = deliver_with_claim(domain, tampered)
    else:
        assert claim_and_apply(domain, "m-1", original).outcome == "applied"
        conflict = claim_and_apply(domain, "m-1", tampered)

    original_hash = canonical_sha256(domain, original)
    tampered_hash = canonical_sha256(domain, tampered)
    assert conflict.outcome == "conflict"
    assert conflict.payload_sha256 == tampered_hash
    assert conflict.stored_sha256 == original_hash
    assert conflict.quarantine_id is not None
    assert_applied_exactly(domain, {"m-1": 10})
    assert handler_calls(domain) == (1 if style == "claim_and_apply" else 0)

    entry = quarantine_entry(domain, conflict.quarantine_id)
    assert entry["kind"] == "conflict" and entry["status"] == "open"
    assert (entry["consumer"], entry["producer"], entry["message_id"]) == (
        "billing",
        "orders",
        "m-1",
    )
    assert entry["stored_sha256"].hex() == original_hash
    assert entry["payload_sha256"].hex() == tampered_hash
    assert entry["payload"] == tampered, "the operator needs the conflicting payload"

    # the original, redelivered, is still a plain duplicate; the processed claim is untouched
    assert deliver_with_claim(domain, original).outcome == "duplicate"
    rows = inbox_rows(domain, "m-1")
    assert len(rows) == 1 and rows[0]["status"] == "processed"
    assert_applied_exactly(domain, {"m-1": 10})


# --- the same id under two consumers -----------------------------------------------------------


@pytest.mark.parametrize("style", ["claim", "claim_and_apply"])
def test_same_id_under_two_consumers_applies_to_both(domain: Conn, style: str) -> None:
    body = payload("m-1", 10)
    for round_no in range(2):  # second round: both are duplicates
        if style == "claim":
            a = deliver_with_claim(domain, body, consumer="billing")
            b = deliver_with_claim(domain, body, account=LOYALTY_ACCOUNT, consumer="loyalty")
            first = "claimed"
        else:
            a = claim_and_apply(domain, "m-1", body, consumer="billing")
            b = claim_and_apply(domain, "m-1", body, consumer="loyalty")
            first = "applied"
        if round_no == 0:
            assert (a.outcome, b.outcome) == (first, first)
        else:
            assert (a.outcome, b.outcome) == ("duplicate", "duplicate")
    assert_applied_exactly(domain, {"m-1": 10})
    assert_applied_exactly(domain, {"m-1": 10}, account=LOYALTY_ACCOUNT)
    assert len(inbox_rows(domain, "m-1", consumer="billing")) == 1
    assert len(inbox_rows(domain, "m-1", consumer="loyalty")) == 1


def test_same_id_from_two_producers_or_tenants_are_distinct(domain: Conn) -> None:
    body = payload("m-1", 10)
    assert deliver_with_claim(domain, body, producer="orders").outcome == "claimed"
    assert deliver_with_claim(domain, body, producer="refunds").outcome == "claimed"
    assert deliver_with_claim(domain, body, tenant="acme").outcome == "claimed"
    assert deliver_with_claim(domain, body, tenant="acme").outcome == "duplicate"
    assert ledger_counts(domain) == {"m-1": 3}
    assert balance(domain) == 30


# --- handler failures --------------------------------------------------------------------------


def test_handler_fails_then_succeeds_on_redelivery(domain: Conn) -> None:
    body = payload("m-1", 10)
    domain.execute("UPDATE fail_switch SET armed = true")
    failed = claim_and_apply(domain, "m-1", body)

    assert failed.outcome == "failed"
    assert failed.attempts == 1
    assert failed.reason_code == "55000"
    assert failed.error_message is not None and "credit service unavailable" in failed.error_message
    assert handler_calls(domain) == 1
    assert_applied_exactly(domain, {})  # the handler's writes rolled back
    assert not [r for r in inbox_rows(domain, "m-1") if r["status"] == "processed"], (
        "a failed handler must never leave a processed claim behind"
    )
    assert failed_attempts(domain, "m-1") >= 1, "the failed attempt must be recorded"

    domain.execute("UPDATE fail_switch SET armed = false")  # the dependency is back
    retried = claim_and_apply(domain, "m-1", body)
    assert retried.outcome == "applied"
    # attempts is reported on failed and quarantined outcomes only: the first-claim path reads no attempt row
    assert retried.attempts is None
    assert handler_calls(domain) == 2
    assert_applied_exactly(domain, {"m-1": 10})
    assert claim_and_apply(domain, "m-1", body).outcome == "duplicate"
    assert handler_calls(domain) == 2


def test_failure_inside_callers_transaction_keeps_the_transaction_usable(domain: Conn) -> None:
    """The handler runs in a subtransaction: its failure does not abort the caller's transaction."""
    with domain.transaction():
        domain.execute("UPDATE account SET balance = balance + 1 WHERE id = 2")
        assert claim_and_apply(domain, "bad", payload("bad", -5)).outcome == "failed"
        assert claim_and_apply(domain, "good", payload("good", 7)).outcome == "applied"
    assert_applied_exactly(domain, {"good": 7})
    assert balance(domain, LOYALTY_ACCOUNT) == 1
    assert failed_attempts(domain, "bad") >= 1
    assert inbox_rows(domain, "bad") == []


def test_permanent_failure_is_quarantined_after_max_attempts(domain: Conn) -> None:
    body = payload("m-neg", -5)
    results = [claim_and_apply(domain, "m-neg", body) for _ in range(5)]

    assert [r.outcome for r in results] == ["failed"] * 4 + ["quarantined"]
    assert [r.attempts for r in results] == [1, 2, 3, 4, 5]
    assert all(r.reason_code == "23514" for r in results)
    assert results[0].error_message is not None and "negative amount" in results[0].error_message
    assert results[-1].quarantine_id is not None
    assert handler_calls(domain) == 5

    later = claim_and_apply(domain, "m-neg", body)
    assert later.outcome == "quarantined"
    assert later.quarantine_id == results[-1].quarantine_id
    assert handler_calls(domain) == 5, "a quarantined identity must not run the handler again"
    # the plain claim API also refuses it
    assert deliver_with_claim(domain, body).outcome == "quarantined"
    assert_applied_exactly(domain, {})

    entry = quarantine_entry(domain, later.quarantine_id)
    assert (entry["kind"], entry["status"], entry["message_id"]) == ("failure", "open", "m-neg")
    assert entry["attempts"] == 5 and entry["reason_code"] == "23514"
    rows = inbox_rows(domain, "m-neg")
    assert [r["status"] for r in rows] == ["quarantined"]


def test_max_attempts_is_per_consumer(domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', '{}', 2)")
    body = payload("m-neg", -5)
    outcomes = [claim_and_apply(domain, "m-neg", body).outcome for _ in range(3)]
    assert outcomes == ["failed", "quarantined", "quarantined"]
    assert handler_calls(domain) == 2


# Transient errors are the caller's to retry with the whole transaction; anything else is the
# message's fault. The contract's transient list: 40001, 40P01, 55P03, 57014, class 08, 57P, 53.
TRANSIENT = ["40001", "40P01", "55P03", "57014", "08006", "57P01", "53200"]
PERMANENT = ["P0001", "22012", "23505", "55000", "42P01"]


@pytest.mark.parametrize("sqlstate", TRANSIENT)
def test_transient_handler_error_is_reraised_not_recorded(domain: Conn, sqlstate: str) -> None:
    body = {**payload("m-1", 10), "sqlstate": sqlstate}
    with pytest.raises(psycopg.Error) as raised:
        claim_and_apply(domain, "m-1", body, message_type="raising_credit")
    assert raised.value.sqlstate == sqlstate
    assert not domain.broken
    assert inbox_rows(domain, "m-1") == []
    assert failed_attempts(domain, "m-1") == 0, "a transient error is not a handler failure"
    assert_applied_exactly(domain, {})
    # the retry (with a handler that now works) applies once
    applied = claim_and_apply(domain, "m-1", body)
    assert applied.outcome == "applied" and applied.attempts is None
    assert_applied_exactly(domain, {"m-1": 10})


@pytest.mark.parametrize("sqlstate", PERMANENT)
def test_permanent_handler_error_is_recorded(domain: Conn, sqlstate: str) -> None:
    body = {**payload("m-1", 10), "sqlstate": sqlstate}
    failed = claim_and_apply(domain, "m-1", body, message_type="raising_credit")
    assert (failed.outcome, failed.reason_code, failed.attempts) == ("failed", sqlstate, 1)
    assert failed.error_message == f"simulated error {sqlstate}"
    assert inbox_rows(domain, "m-1") == []
    assert failed_attempts(domain, "m-1") == 1
    assert_applied_exactly(domain, {})
