"""Domain fixture and checks shared by the delivery tests (article cases, concurrency, crashes).

The domain is deliberately tiny: `account` rows hold balances and `ledger` gets one row per applied
message. The ledger has NO unique key on purpose: a second application of the same message must show
up as a second row (and a wrong balance), never as an error that would hide it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

BILLING_ACCOUNT = 1
LOYALTY_ACCOUNT = 2
PRODUCER = "orders"

# Safety net only: no statement here should come near it, but a hang must fail, not stall CI.
SAFE_OPTIONS = "-c statement_timeout=60000 -c idle_in_transaction_session_timeout=120000"

DOMAIN_DDL = """
CREATE TABLE account(id int PRIMARY KEY, balance bigint NOT NULL);
INSERT INTO account VALUES (1, 0), (2, 0);

-- one row per applied message; no unique key on purpose (see module docstring)
CREATE TABLE ledger(
  account int NOT NULL REFERENCES account,
  message_id text NOT NULL,
  amount bigint NOT NULL
);

-- handler calls are counted with a sequence: nextval is not rolled back with a failed handler
CREATE SEQUENCE handler_calls;
-- while armed, the handler fails with a permanent error (a broken dependency, later fixed)
CREATE TABLE fail_switch(armed boolean NOT NULL);
INSERT INTO fail_switch VALUES (false);
-- seconds the handler sleeps after its domain writes (pg_terminate_backend mid-handler)
CREATE TABLE handler_delay(seconds float8 NOT NULL);
INSERT INTO handler_delay VALUES (0);

CREATE FUNCTION apply_credit(account_id int, message_id text, amount bigint) RETURNS void
LANGUAGE sql AS $$
  UPDATE account SET balance = balance + apply_credit.amount WHERE id = apply_credit.account_id;
  INSERT INTO ledger(account, message_id, amount)
  VALUES (apply_credit.account_id, apply_credit.message_id, apply_credit.amount);
$$;

CREATE FUNCTION credit_account(account_id int, payload jsonb) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM nextval('handler_calls');
  IF (payload->>'amount')::bigint < 0 THEN
    RAISE EXCEPTION 'negative amount %', payload->>'amount' USING ERRCODE = 'check_violation';
  END IF;
  IF (SELECT armed FROM fail_switch) THEN
    RAISE EXCEPTION 'credit service unavailable' USING ERRCODE = 'object_not_in_prerequisite_state';
  END IF;
  PERFORM apply_credit(account_id, payload->>'id', (payload->>'amount')::bigint);
  PERFORM pg_sleep(seconds) FROM handler_delay WHERE seconds > 0;
END $$;

CREATE FUNCTION credit(payload jsonb) RETURNS void
LANGUAGE sql AS $$ SELECT credit_account(1, payload) $$;

CREATE FUNCTION loyalty_credit(payload jsonb) RETURNS void
LANGUAGE sql AS $$ SELECT credit_account(2, payload) $$;

-- applies the credit, then raises the SQLSTATE named in payload->>'sqlstate'
CREATE FUNCTION raising_credit(payload jsonb) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM nextval('handler_calls');
  PERFORM apply_credit(1, payload->>'id', (payload->>'amount')::bigint);
  RAISE EXCEPTION 'simulated error %', payload->>'sqlstate' USING ERRCODE = payload->>'sqlstate';
END $$;

SELECT inbox.register_handler('billing', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
SELECT inbox.register_handler('loyalty', 'credit', 'loyalty_credit(jsonb)'::regprocedure, 'v1');
SELECT inbox.register_handler('billing', 'raising_credit',
                              'raising_credit(jsonb)'::regprocedure, 'v1');
"""


@dataclass(frozen=True)
class Delivery:
    """One row of inbox.delivery_result."""

    outcome: str
    payload_sha256: str | None
    stored_sha256: str | None
    handler_version: str | None
    processed_at: datetime | None
    quarantine_id: int | None
    attempts: int | None
    reason_code: str | None
    error_message: str | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Delivery:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


def setup_domain(conn: psycopg.Connection[Any]) -> None:
    """Create the domain tables and handlers and register the handlers (superuser or operator)."""
    with conn.transaction():
        conn.execute(DOMAIN_DDL)


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """An autocommit connection with the safety timeouts; transactions are explicit BEGIN/COMMIT."""
    kwargs.setdefault("options", SAFE_OPTIONS)
    return psycopg.connect(dsn, autocommit=True, **kwargs)


def payload(message_id: str, amount: int = 10, account: int = BILLING_ACCOUNT) -> dict[str, Any]:
    return {"id": message_id, "account": account, "amount": amount}


def claim(
    conn: psycopg.Connection[Any],
    message_id: str,
    body: dict[str, Any],
    *,
    consumer: str = "billing",
    producer: str = PRODUCER,
    handler_version: str = "v1",
    tenant: str = "",
) -> Delivery:
    """inbox.claim(): the caller must do its domain change in the same transaction."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT * FROM inbox.claim(%s, %s, %s, %s, %s, %s)",
            (consumer, producer, message_id, Jsonb(body), handler_version, tenant),
        )
        row = cur.fetchone()
    assert row is not None
    return Delivery.from_row(row)


def claim_and_apply(
    conn: psycopg.Connection[Any],
    message_id: str,
    body: dict[str, Any],
    *,
    consumer: str = "billing",
    producer: str = PRODUCER,
    message_type: str = "credit",
    tenant: str = "",
) -> Delivery:
    """inbox.claim_and_apply(): claim + registered handler in one call."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT * FROM inbox.claim_and_apply(%s, %s, %s, %s, %s, %s)",
            (consumer, producer, message_id, message_type, Jsonb(body), tenant),
        )
        row = cur.fetchone()
    assert row is not None
    return Delivery.from_row(row)


def apply_in_caller(conn: psycopg.Connection[Any], body: dict[str, Any], account: int | None = None) -> None:
    """The caller's own domain change (the claim-style API): same transaction as inbox.claim()."""
    conn.execute(
        "SELECT apply_credit(%s, %s, %s)",
        (body["account"] if account is None else account, body["id"], body["amount"]),
    )


def deliver_with_claim(
    conn: psycopg.Connection[Any], body: dict[str, Any], account: int | None = None, **kw: Any
) -> Delivery:
    """One claim-style delivery in its own transaction: BEGIN; claim; change if claimed; COMMIT."""
    with conn.transaction():
        result = claim(conn, body["id"], body, **kw)
        if result.outcome == "claimed":
            apply_in_caller(conn, body, account)
    return result


def balance(conn: psycopg.Connection[Any], account: int = BILLING_ACCOUNT) -> int:
    row = conn.execute("SELECT balance FROM account WHERE id = %s", (account,)).fetchone()
    assert row is not None
    return int(row[0])


def ledger_counts(conn: psycopg.Connection[Any], account: int = BILLING_ACCOUNT) -> dict[str, int]:
    """message_id -> how many times it was applied to the account."""
    rows = conn.execute(
        "SELECT message_id, count(*) FROM ledger WHERE account = %s GROUP BY message_id", (account,)
    ).fetchall()
    return {mid: int(n) for mid, n in rows}


def failed_attempts(conn: psycopg.Connection[Any], message_id: str, consumer: str = "billing") -> int:
    """Permanent failures recorded for an identity (inbox.attempt, superuser read)."""
    row = conn.execute(
        "SELECT coalesce(sum(failed), 0) FROM inbox.attempt WHERE consumer = %s AND message_id = %s",
        (consumer, message_id),
    ).fetchone()
    assert row is not None
    return int(row[0])


def handler_calls(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT last_value, is_called FROM handler_calls").fetchone()
    assert row is not None
    return int(row[0]) if row[1] else 0


def assert_applied_exactly(
    conn: psycopg.Connection[Any], amounts: dict[str, int], account: int = BILLING_ACCOUNT
) -> None:
    """The invariant: every listed message applied exactly once, nothing else applied, and the
    balance equals the sum of the distinct applied messages."""
    counts = ledger_counts(conn, account)
    twice = {mid: n for mid, n in counts.items() if n != 1}
    assert not twice, f"messages applied more than once: {twice}"
    assert set(counts) == set(amounts), (
        f"missing: {sorted(set(amounts) - set(counts))[:10]}, unexpected: {sorted(set(counts) - set(amounts))[:10]}"
    )
    assert balance(conn, account) == sum(amounts.values())


def inbox_rows(
    conn: psycopg.Connection[Any],
    message_id: str,
    *,
    consumer: str = "billing",
    producer: str = PRODUCER,
    tenant: str = "",
) -> list[dict[str, Any]]:
    """The claim rows for an identity (superuser read of the owner-only table)."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT * FROM inbox.message WHERE tenant = %s AND consumer = %s AND producer = %s AND message_id = %s",
            (tenant, consumer, producer, message_id),
        )
        return cur.fetchall()


def canonical_sha256(conn: psycopg.Connection[Any], body: dict[str, Any]) -> str:
    """Hex SHA-256 of jsonb's canonical text, computed by the server without the package."""
    row = conn.execute("SELECT encode(sha256(convert_to(%s::jsonb::text, 'UTF8')), 'hex')", (Jsonb(body),)).fetchone()
    assert row is not None
    return str(row[0])


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_for_lock_wait(observer: psycopg.Connection[Any], waiter_pid: int, blocker_pid: int) -> None:
    """Block until `waiter_pid` waits on a lock `blocker_pid` holds (pg_stat_activity, pg_locks)."""

    def waiting() -> bool:
        row = observer.execute(
            "SELECT a.wait_event_type, %s = ANY(pg_blocking_pids(a.pid)),"
            "       EXISTS (SELECT FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted)"
            "  FROM pg_stat_activity a WHERE a.pid = %s",
            (blocker_pid, waiter_pid),
        ).fetchone()
        return row is not None and row[0] == "Lock" and bool(row[1]) and bool(row[2])

    wait_until(waiting, f"backend {waiter_pid} to wait on a lock held by {blocker_pid}")


def backend_gone(observer: psycopg.Connection[Any], pid: int) -> bool:
    row = observer.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == 0


def hand_to_service(
    conn: psycopg.Connection[Any],
    role: str,
    consumer: str,
    *,
    functions: tuple[str, ...] = (),
    tables: tuple[str, ...] = (),
    sequences: tuple[str, ...] = (),
) -> None:
    """Makes `role` the consumer's service, as a real deployment has it (docs/security.md): it owns
    the domain objects and the handlers, which are SECURITY DEFINER, and it is bound to the
    consumer. An operator's repair or replay then runs a handler with that role's rights (0.3.0);
    a superuser-owned or SECURITY INVOKER handler is refused for those."""
    ident = sql.Identifier(role)
    for table in tables:
        conn.execute(sql.SQL("ALTER TABLE {} OWNER TO {}").format(sql.SQL(table), ident))
    for sequence in sequences:
        conn.execute(sql.SQL("ALTER SEQUENCE {} OWNER TO {}").format(sql.SQL(sequence), ident))
    for function in functions:
        conn.execute(
            sql.SQL(
                "ALTER FUNCTION {0} OWNER TO {1}; ALTER FUNCTION {0} SECURITY DEFINER SET search_path = public, pg_temp"
            ).format(sql.SQL(function), ident)
        )
    conn.execute(
        "SELECT inbox.bind_consumer(%s, %s::regrole, note => 'the service that runs the consumer')", (consumer, role)
    )
