"""Act 1 of `pginbox demo`: every outcome of the inbox, shown on a real database.

It builds a small billing domain in its own schema `pginbox_demo` (recreated on every run), and
delivers messages the way a broker does: redelivered, raced by two workers, sent again with another
payload, rejected by the handler, killed mid-flight. Every step prints what happened and why; the
last step proves the invariant from the domain tables: no message was applied twice, none that
committed was lost.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pginbox.errors import InvariantBroken

__all__ = ["OutcomesAct"]

Row = dict[str, Any]

DOMAIN = """
DROP SCHEMA IF EXISTS pginbox_demo CASCADE;
CREATE SCHEMA pginbox_demo;
CREATE TABLE pginbox_demo.account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
CREATE TABLE pginbox_demo.ledger (message_id text NOT NULL, account integer NOT NULL, amount bigint NOT NULL);
INSERT INTO pginbox_demo.account (id) VALUES (1), (2);
-- The business change of one 'credit' message. It refuses negative amounts (a permanent error).
CREATE FUNCTION pginbox_demo.credit(payload jsonb, ctx inbox.message_context) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF (payload->>'amount')::bigint < 0 THEN
        RAISE EXCEPTION 'negative amount %', payload->>'amount' USING CONSTRAINT = 'negative_amount';
    END IF;
    UPDATE pginbox_demo.account SET balance = balance + (payload->>'amount')::bigint
     WHERE id = (payload->>'account')::integer;
    INSERT INTO pginbox_demo.ledger VALUES (ctx.message_id, (payload->>'account')::integer,
                                            (payload->>'amount')::bigint);
END $$;
-- Version 2 of the handler: a negative amount is a refund, booked as such.
CREATE FUNCTION pginbox_demo.credit_v2(payload jsonb, ctx inbox.message_context) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pginbox_demo.account SET balance = balance + (payload->>'amount')::bigint
     WHERE id = (payload->>'account')::integer;
    INSERT INTO pginbox_demo.ledger VALUES (ctx.message_id, (payload->>'account')::integer,
                                            (payload->>'amount')::bigint);
END $$;
-- The billing service owns its tables and handlers, which run with its rights (SECURITY DEFINER):
-- an operator's repair then runs a handler with the service's rights, never the operator's, and
-- only for a consumer bound to the service's role (docs/security.md). inbox_runner, which holds no
-- rights, calls the handlers of operator decisions: it needs USAGE on their schema.
DO $$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pginbox_demo_service') THEN
        CREATE ROLE pginbox_demo_service NOLOGIN;
    END IF;
END $$;
GRANT USAGE ON SCHEMA pginbox_demo TO pginbox_demo_service, inbox_runner;
ALTER TABLE pginbox_demo.account OWNER TO pginbox_demo_service;
ALTER TABLE pginbox_demo.ledger OWNER TO pginbox_demo_service;
ALTER FUNCTION pginbox_demo.credit(jsonb, inbox.message_context) OWNER TO pginbox_demo_service;
ALTER FUNCTION pginbox_demo.credit(jsonb, inbox.message_context)
    SECURITY DEFINER SET search_path = pginbox_demo, pg_temp;
ALTER FUNCTION pginbox_demo.credit_v2(jsonb, inbox.message_context) OWNER TO pginbox_demo_service;
ALTER FUNCTION pginbox_demo.credit_v2(jsonb, inbox.message_context)
    SECURITY DEFINER SET search_path = pginbox_demo, pg_temp;
"""

APPLY = "SELECT * FROM inbox.claim_and_apply(%(consumer)s, 'shop', %(id)s, 'credit', %(payload)s::jsonb)"


class OutcomesAct:
    """Act 1: every outcome of the inbox, one delivery at a time, on a small billing domain."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.consumer = f"billing-{uuid.uuid4().hex[:8]}"
        self.step_no = 0
        self.conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row)

    # ------------------------------------------------------------------ printing
    def step(self, title: str, why: str) -> None:
        self.step_no += 1
        print(f"\n{self.step_no}. {title}")
        print(f"   {why}")

    def show(self, label: str, row: Row) -> None:
        extra = []
        attempts = row.get("attempts")
        crashed = 0
        if row.get("quarantine_id") and row.get("outcome") == "quarantined":
            # Say what the entry counted: failed attempts plus starts that crashed (record_start's
            # count before it), not the call's own counter (0 once the message is quarantined).
            entry = self.conn.execute(
                "SELECT attempts, crashes FROM inbox.quarantine WHERE quarantine_id = %s", (row["quarantine_id"],)
            ).fetchone()
            if entry is not None:
                crashed = int(entry["crashes"])
                attempts = int(entry["attempts"]) + crashed
        if attempts is not None:
            extra.append(f"attempts={attempts}" + (f", crashed={crashed}" if crashed else ""))
        if row.get("reason_code"):
            extra.append(f"reason={row['reason_code']}")
        if row.get("quarantine_id"):
            extra.append(f"quarantine #{row['quarantine_id']}")
        tail = f"  ({', '.join(extra)})" if extra else ""
        print(f"   {label:<44} -> {row['outcome']}{tail}")

    def balance(self, account: int = 1) -> int:
        row = self.conn.execute("SELECT balance FROM pginbox_demo.account WHERE id = %s", (account,)).fetchone()
        assert row is not None
        return int(row["balance"])

    # ------------------------------------------------------------------ actions
    def apply(self, message_id: str, payload: Row, conn: psycopg.Connection[Row] | None = None) -> Row:
        row = (
            (conn or self.conn)
            .execute(APPLY, {"consumer": self.consumer, "id": message_id, "payload": json.dumps(payload)})
            .fetchone()
        )
        assert row is not None
        return row

    def run(self) -> None:
        print("pginbox demo: at-least-once delivery in, at most one committed change out")
        print(f"consumer '{self.consumer}' credits accounts; producer 'shop' sends 'credit' messages")
        print("\nAct 1: every outcome, one delivery at a time")
        self.conn.execute(DOMAIN)
        self.conn.execute(
            "SELECT inbox.register_handler(%s, 'credit', 'pginbox_demo.credit(jsonb, inbox.message_context)'"
            "::regprocedure, 'v1')",
            (self.consumer,),
        )
        self.conn.execute("SELECT inbox.configure_consumer(%s, max_attempts => 3)", (self.consumer,))
        self.conn.execute(
            "SELECT inbox.bind_consumer(%s, 'pginbox_demo_service', note => 'the demo''s billing service')",
            (self.consumer,),
        )

        self.step("First delivery", "claim_and_apply claims the id and runs the handler in one transaction.")
        self.show("m-1 credit account 1 with 10", self.apply("m-1", {"account": 1, "amount": 10}))
        print(f"   balance of account 1: {self.balance()}")

        self.step(
            "The ack was lost: the broker redelivers m-1",
            "Same id, same payload hash: a duplicate. The handler does not run again.",
        )
        self.show("m-1 again", self.apply("m-1", {"account": 1, "amount": 10}))
        self.show("m-1 again, keys in another order", self.apply("m-1", {"amount": 10, "account": 1}))
        print(f"   balance of account 1: {self.balance()} (still 10)")

        self.race()
        self.conflict()
        self.failure_and_repair()
        self.rolled_back_claim()
        self.crash_loop()
        self.batch()
        self.invariant()

    def race(self) -> None:
        self.step(
            "Two workers get m-2 at the same time",
            "Worker A claims m-2 and is still in its transaction; worker B's claim waits on the unique key.",
        )
        with (
            psycopg.connect(self.dsn, row_factory=dict_row) as a,
            psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as b,
        ):
            row_a = self.apply("m-2", {"account": 1, "amount": 5}, conn=a)
            self.show("worker A: m-2 (not committed yet)", row_a)
            result: dict[str, Row] = {}
            worker_b = threading.Thread(
                target=lambda: result.update(b=self.apply("m-2", {"account": 1, "amount": 5}, conn=b))
            )
            worker_b.start()
            time.sleep(0.3)
            print(f"   worker B is {'waiting' if worker_b.is_alive() else 'done (unexpected)'}; A commits")
            a.commit()
            worker_b.join()
            self.show("worker B: m-2", result["b"])
        print(f"   balance of account 1: {self.balance()} (10 + 5)")

    def conflict(self) -> None:
        self.step(
            "The producer reuses id m-1 for a different payload",
            "Same id, different hash: a producer contract violation. Quarantined, nothing applied.",
        )
        self.show("m-1 credit account 1 with 99", self.apply("m-1", {"account": 1, "amount": 99}))
        print(f"   balance of account 1: {self.balance()} (unchanged)")

    def failure_and_repair(self) -> None:
        self.step(
            "The handler rejects m-3 (negative amount)",
            "A permanent error: the handler's writes and the claim roll back, the attempt is recorded. "
            "After max_attempts (3 here) the message moves to quarantine.",
        )
        for n in range(1, 5):
            self.show(f"m-3 credit -7, delivery {n}", self.apply("m-3", {"account": 1, "amount": -7}))
        entry = self.conn.execute(
            "SELECT quarantine_id, reason_code, attempts, status FROM inbox.quarantine "
            "WHERE consumer = %s AND message_id = 'm-3'",
            (self.consumer,),
        ).fetchone()
        assert entry is not None
        print(
            f"   quarantine #{entry['quarantine_id']}: reason {entry['reason_code']}, "
            f"{entry['attempts']} attempts, {entry['status']}"
        )

        self.step(
            "An operator ships handler v2 (negative = refund) and repairs m-3",
            "repair runs the stored payload through the current handler; every decision is audited.",
        )
        self.conn.execute(
            "SELECT inbox.register_handler(%s, 'credit', 'pginbox_demo.credit_v2(jsonb, inbox.message_context)'"
            "::regprocedure, 'v2')",
            (self.consumer,),
        )
        repaired = self.conn.execute(
            "SELECT * FROM inbox.repair(%s, 'refunds are valid since v2')", (entry["quarantine_id"],)
        ).fetchone()
        assert repaired is not None
        self.show(f"repair quarantine #{entry['quarantine_id']}", repaired)
        audit = self.conn.execute(
            "SELECT decision, result, decided_by, note FROM inbox.quarantine_decision WHERE quarantine_id = %s",
            (entry["quarantine_id"],),
        ).fetchall()
        for a in audit:
            print(f"   audit: {a['decision']} -> {a['result']} by {a['decided_by']}: {a['note']}")
        self.show("m-3 redelivered after the repair", self.apply("m-3", {"account": 1, "amount": -7}))
        print(f"   balance of account 1: {self.balance()} (15 - 7)")

    def rolled_back_claim(self) -> None:
        self.step(
            "inbox.claim in your own transaction, and the process fails after the claim",
            "The claim rolls back with the transaction, so the redelivery is processed, not skipped.",
        )
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            row = conn.execute(
                "SELECT * FROM inbox.claim(%s, 'shop', 'm-4', '{\"account\": 2, \"amount\": 3}', 'v2')",
                (self.consumer,),
            ).fetchone()
            assert row is not None
            self.show("m-4 claim", row)
            conn.rollback()
            print("   ...crash before the UPDATE: ROLLBACK")
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            row = conn.execute(
                "SELECT * FROM inbox.claim(%s, 'shop', 'm-4', '{\"account\": 2, \"amount\": 3}', 'v2')",
                (self.consumer,),
            ).fetchone()
            assert row is not None
            self.show("m-4 redelivered: claim", row)
            conn.execute("UPDATE pginbox_demo.account SET balance = balance + 3 WHERE id = 2")
            conn.execute("INSERT INTO pginbox_demo.ledger VALUES ('m-4', 2, 3)")
            conn.commit()
        print(f"   balance of account 2: {self.balance(2)}")

    def crash_loop(self) -> None:
        self.step(
            "m-5 kills its consumer every time",
            "A crash records nothing, so the consumer calls inbox.record_start (own transaction) for each "
            "redelivery. After max_attempts attempts the message is quarantined without running again.",
        )
        for n in range(1, 4):
            row = self.conn.execute(
                "SELECT * FROM inbox.record_start(%s, 'shop', 'm-5', message_type => 'credit', "
                'payload => \'{"account": 2, "amount": 1}\')',
                (self.consumer,),
            ).fetchone()
            assert row is not None
            self.show(f"m-5 redelivery {n}: record_start", row)
        self.show("m-5 delivered again", self.apply("m-5", {"account": 2, "amount": 1}))

    def batch(self) -> None:
        self.step(
            "A batch of 6 messages in one call and one transaction",
            "claim_and_apply_batch isolates each message: one bad message does not sink the others.",
        )
        messages = [
            {
                "producer": "shop",
                "message_id": f"b-{i}",
                "message_type": "credit",
                "payload": {"account": 2, "amount": i},
            }
            for i in range(1, 5)
        ]
        messages.append(messages[0])  # a duplicate inside the batch
        messages.append(
            {"producer": "shop", "message_id": "m-1", "message_type": "credit", "payload": {"account": 1, "amount": 10}}
        )
        rows = self.conn.execute(
            "SELECT ordinal, message_id, outcome, attempts, reason_code, quarantine_id "
            "FROM inbox.claim_and_apply_batch(%s, %s::jsonb)",
            (self.consumer, json.dumps(messages)),
        ).fetchall()
        for r in rows:
            self.show(f"[{r['ordinal']}] {r['message_id']}", r)

    def invariant(self) -> None:
        self.step(
            "The invariant, checked from the domain tables",
            "For one consumer and one producer intent: at most one committed change.",
        )
        dupes = self.conn.execute(
            "SELECT message_id, count(*) AS n FROM pginbox_demo.ledger GROUP BY 1 HAVING count(*) > 1"
        ).fetchall()
        check = self.conn.execute(
            "SELECT a.id, a.balance, coalesce(sum(l.amount), 0) AS booked FROM pginbox_demo.account a "
            "LEFT JOIN pginbox_demo.ledger l ON l.account = a.id GROUP BY a.id ORDER BY a.id"
        ).fetchall()
        counts = self.conn.execute(
            "SELECT status, count(*) AS n FROM inbox.message WHERE consumer = %s GROUP BY 1 ORDER BY 1",
            (self.consumer,),
        ).fetchall()
        for c in check:
            print(f"   account {c['id']}: balance {c['balance']}, sum of ledger {c['booked']}")
        print("   inbox rows: " + ", ".join(f"{c['status']} {c['n']}" for c in counts))
        ok = not dupes and all(c["balance"] == c["booked"] for c in check)
        expected = {1: 10 + 5 - 7, 2: 3 + 1 + 2 + 3 + 4}
        ok = ok and all(c["balance"] == expected[c["id"]] for c in check)
        if not ok:
            raise InvariantBroken(f"invariant broken in act 1: duplicates {dupes}, balances {check}")
        print("   OK: every message applied at most once; every committed one exactly once.")
