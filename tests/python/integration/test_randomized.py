"""A stateful, seeded, randomized run against the whole protocol (DESIGN.md: "deliver, redeliver,
crash, purge, conflicting payload, timeout, checked for lost, duplicated and unexpected effects").

One consumer whose SQL handler credits a ledger (no unique key: a second application would show)
and enqueues one outbox effect per message. A seeded generator interleaves, step by step:

  new          a first delivery (some poison, some slow)
  redeliver    the same message again (same payload, same produced_at)
  conflict     the same id with a different payload
  crash        the delivery runs in a transaction that dies before COMMIT: rolled back, or the
               backend terminated by pg_terminate_backend from another session
  timeout      a slow handler under a short statement_timeout (57014: nothing committed)
  purge        the retention purge (a five-minute window), every row processed so far aged an hour
  dispatch     a dispatcher pass whose sink sometimes accepts a request and then fails (ambiguous)

At the end the broker redelivers every message it never got a final answer for, the dispatcher
drains the outbox with a well-behaved sink, and the run is checked from the domain tables and the
sink's own records — not from the inbox's bookkeeping:

  - no message is applied twice, and an 'applied' answer was given exactly once per ledger row;
  - nothing was applied that was never produced, nor any poison message, nor a conflicting payload;
  - nothing is lost: every produced message is applied once, or was answered with a final outcome
    that hands it to operators (quarantined, expired) and sits in quarantine;
  - every committed effect reached the sink with its one idempotency key and is counted once by a
    deduplicating sink; effects exist only for applied messages.

PGINBOX_RANDOM_SEED and PGINBOX_RANDOM_STEPS choose the run (the seed is printed on failure).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb

from pginbox.dispatcher import CallableTransport, Dispatcher
from pginbox.transports.effect import delivery_key

Conn = psycopg.Connection[Any]

CONSUMER = "rnd"
PRODUCER = "shop"
FINAL = {"applied", "duplicate", "conflict", "quarantined", "expired"}

DOMAIN = """
CREATE SCHEMA rnd;
CREATE TABLE rnd.ledger (message_id text NOT NULL, amount integer NOT NULL);
CREATE FUNCTION rnd.credit(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF (p ->> 'poison')::boolean THEN
        RAISE EXCEPTION 'poison message %', ctx.message_id USING ERRCODE = 'check_violation';
    END IF;
    IF (p ->> 'slow')::boolean THEN
        PERFORM pg_sleep(0.3);
    END IF;
    INSERT INTO rnd.ledger VALUES (ctx.message_id, (p ->> 'amount')::integer);
    PERFORM inbox.enqueue_effect(inbox.effect_id(ctx.consumer, ctx.producer, ctx.message_id, 'notify', ctx.tenant),
                                 'sink', p);
END
$$;
SELECT inbox.register_handler('rnd', 'credit', 'rnd.credit(jsonb, inbox.message_context)', 'v1');
SELECT inbox.configure_consumer('rnd', max_attempts => 3);
SELECT inbox.configure_destination('sink', max_attempts => 1000, base_backoff => '1 millisecond',
                                   max_backoff => '5 milliseconds');
SELECT inbox.set_retention_policy('rnd', broker_retention => '5 minutes', max_offset_rewind => '0',
    dead_letter_redrive_horizon => '0', producer_retry_horizon => '0', outage_allowance => '0',
    backup_restore_window => '0', planned_replay_horizon => '0', safety_margin => '0',
    note => 'randomized test: purge what is older than five minutes');
"""


@dataclass
class Produced:
    message_id: str
    payload: dict[str, Any]
    produced_at: datetime
    poison: bool


@dataclass
class Sink:
    """Records every request; `flaky` makes some attempts fail after recording (ambiguous)."""

    rng: random.Random
    flaky: bool = True
    requests: list[tuple[str, str]] = field(default_factory=list)  # (idempotency key, message_id)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def deliver(self, effect: Any) -> None:
        with self.lock:
            self.requests.append((delivery_key(effect), effect.payload["message_id"]))
            fail = self.flaky and self.rng.random() < 0.25
        if fail:
            raise TimeoutError("accepted, then the response timed out")

    def dedup_counts(self) -> Counter[str]:
        return Counter(key for key, _ in set(self.requests))


class Run:
    def __init__(self, dsn: str, conn: Conn, seed: int) -> None:
        self.dsn = dsn
        self.admin = conn
        self.rng = random.Random(seed)
        self.worker = self.connect()
        self.produced: dict[str, Produced] = {}
        self.answers: dict[str, list[str]] = defaultdict(list)
        self.conflicting: set[str] = set()
        self.applied_amount: dict[str, int] = {}
        self.sink = Sink(random.Random(seed + 1))
        self.ops: Counter[str] = Counter()

    def connect(self) -> Conn:
        return psycopg.connect(self.dsn, autocommit=True)

    def produce(self) -> Produced:
        n = len(self.produced)
        poison = self.rng.random() < 0.04
        payload: dict[str, Any] = {
            "message_id": f"m{n:05d}",
            "amount": self.rng.randint(1, 100),
            "poison": poison,
            "slow": self.rng.random() < 0.02,
        }
        # Messages reach the consumer an hour after they were produced (a lagging broker), so that
        # the purge's five-minute window can pass over them once their rows are aged (op_purge).
        row = self.admin.execute("SELECT clock_timestamp() - interval '1 hour'").fetchone()
        assert row is not None
        message = Produced(payload["message_id"], payload, row[0], poison)
        self.produced[message.message_id] = message
        return message

    def claim_and_apply(self, conn: Conn, message: Produced, payload: dict[str, Any]) -> str:
        row = conn.execute(
            "SELECT outcome FROM inbox.claim_and_apply(%s, %s, %s, 'credit', %s, '', %s)",
            (CONSUMER, PRODUCER, message.message_id, Jsonb(payload), message.produced_at),
        ).fetchone()
        assert row is not None
        return str(row[0])

    def deliver(self, message: Produced, payload: dict[str, Any] | None = None) -> None:
        try:
            outcome = self.claim_and_apply(self.worker, message, payload or message.payload)
        except (
            pg_errors.SerializationFailure,
            pg_errors.DeadlockDetected,
            pg_errors.LockNotAvailable,
            pg_errors.QueryCanceled,
        ):
            return  # transient: the broker redelivers
        self.answers[message.message_id].append(outcome)
        if outcome == "applied":
            # What was applied is the payload of the delivery that got 'applied': a conflicting
            # payload that arrives before any delivery of the original is, to the inbox, the first.
            self.applied_amount[message.message_id] = (payload or message.payload)["amount"]

    # ---------------------------------------------------------------------------- operations

    def op_new(self) -> None:
        self.deliver(self.produce())

    def op_redeliver(self) -> None:
        if self.produced:
            self.deliver(self.rng.choice(list(self.produced.values())))

    def op_conflict(self) -> None:
        if self.produced:
            message = self.rng.choice(list(self.produced.values()))
            self.conflicting.add(message.message_id)
            self.deliver(message, {**message.payload, "amount": message.payload["amount"] + 1000})

    def op_crash(self) -> None:
        message = (
            self.produce()
            if self.rng.random() < 0.5 or not self.produced
            else self.rng.choice(list(self.produced.values()))
        )
        conn = self.connect()
        try:
            conn.execute("BEGIN")
            self.claim_and_apply(conn, message, message.payload)
            if self.rng.random() < 0.5:
                conn.execute("ROLLBACK")
            else:
                pid = conn.info.backend_pid
                self.admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
                with pytest.raises(psycopg.OperationalError):
                    conn.execute("COMMIT")
        except (pg_errors.QueryCanceled, pg_errors.SerializationFailure):
            pass
        finally:
            conn.close()

    def op_timeout(self) -> None:
        message = self.produce()
        message.payload["slow"] = True
        self.worker.execute("SET statement_timeout = '50ms'")
        try:
            self.deliver(message)
        finally:
            self.worker.execute("RESET statement_timeout")

    def op_purge(self) -> None:
        # An hour passes for the rows processed so far (redeliveries carry their produced_at, which
        # is never changed), and the consumer has been active for a day: they are old enough.
        self.admin.execute(
            "UPDATE inbox.message SET processed_at = processed_at - interval '1 hour' WHERE consumer = %s", (CONSUMER,)
        )
        self.admin.execute("DELETE FROM inbox.activity_gap WHERE consumer = %s", (CONSUMER,))
        self.admin.execute(
            "INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to)"
            " VALUES (%s, '-infinity', now() - interval '1 day')",
            (CONSUMER,),
        )
        with self.connect() as conn:
            conn.execute("CALL inbox.purge('rnd', wait_timeout => '30 seconds')")

    def op_dispatch(self, flaky: bool = True) -> None:
        self.sink.flaky = flaky
        with Dispatcher(
            self.dsn,
            f"rnd-{self.rng.randrange(1 << 30)}",
            {"sink": CallableTransport(self.sink.deliver)},
            batch_size=50,
            lease=30.0,
            poll_interval=0.05,
        ) as dispatcher:
            dispatcher.run_once()

    # ---------------------------------------------------------------------------- the run

    def run(self, steps: int) -> None:
        weights = {"new": 40, "redeliver": 30, "conflict": 3, "crash": 8, "timeout": 2, "purge": 1, "dispatch": 2}
        names = list(weights)
        for _ in range(steps):
            op = self.rng.choices(names, [weights[n] for n in names])[0]
            self.ops[op] += 1
            getattr(self, f"op_{op}")()
        self.ops["purge"] += 1
        self.op_purge()
        # The broker redelivers whatever never got a final answer (at-least-once).
        for message in self.produced.values():
            for _ in range(10):
                if any(a in FINAL for a in self.answers[message.message_id]):
                    break
                self.deliver(message)
        for _ in range(20):
            self.op_dispatch(flaky=False)
            pending = self.admin.execute("SELECT count(*) FROM inbox.outbox WHERE status <> 'delivered'").fetchone()
            if pending == (0,):
                break
            time.sleep(0.05)

    def close(self) -> None:
        self.worker.close()


@pytest.mark.slow
def test_randomized_run_keeps_the_invariant(conn: Conn, db_dsn: str) -> None:
    seed = int(os.environ.get("PGINBOX_RANDOM_SEED", random.SystemRandom().randrange(1 << 32)))
    steps = int(os.environ.get("PGINBOX_RANDOM_STEPS", "600"))
    conn.execute(DOMAIN)
    run = Run(db_dsn, conn, seed)
    try:
        run.run(steps)
    finally:
        run.close()
    context = f"seed={seed} steps={steps} ops={dict(run.ops)}"

    ledger: dict[str, list[int]] = defaultdict(list)
    for message_id, amount in conn.execute("SELECT message_id, amount FROM rnd.ledger").fetchall():
        ledger[message_id].append(amount)
    quarantined = {
        r[0]: r[1]
        for r in conn.execute(
            "SELECT message_id, string_agg(kind, ',') FROM inbox.quarantine WHERE consumer = %s GROUP BY 1", (CONSUMER,)
        ).fetchall()
    }

    # Duplicated or unexpected effects.
    assert set(ledger) <= set(run.produced), f"applied but never produced: {set(ledger) - set(run.produced)}; {context}"
    twice = {m: a for m, a in ledger.items() if len(a) > 1}
    assert not twice, f"applied more than once: {twice}; {context}"
    for message_id, amounts in ledger.items():
        message = run.produced[message_id]
        assert not message.poison, f"poison message {message_id} applied; {context}"
        assert amounts == [run.applied_amount.get(message_id)], (
            f"{message_id} applied with another payload than the one answered 'applied'; {context}"
        )
        if message_id not in run.conflicting:
            assert amounts == [message.payload["amount"]], f"{message_id} applied with another payload; {context}"
        assert run.answers[message_id].count("applied") <= 1, f"{message_id} answered applied twice; {context}"

    # Lost messages: each is applied once, or was handed to operators with a final answer.
    for message_id, message in run.produced.items():
        answers = run.answers[message_id]
        if message_id in ledger:
            continue
        assert message.poison or "expired" in answers or "quarantined" in answers, (
            f"{message_id} neither applied nor handed to operators (answers {answers}); {context}"
        )
        assert message_id in quarantined, f"{message_id} handed over but not in quarantine; {context}"
    # An 'applied' answer always corresponds to a committed ledger row.
    for message_id, answers in run.answers.items():
        if "applied" in answers:
            assert message_id in ledger, f"{message_id} answered applied but not in the ledger; {context}"

    # The outbox: one effect per applied message, each delivered with its one key, counted once.
    effects = {
        r[0]: r[1] for r in conn.execute("SELECT effect_id, payload ->> 'message_id' FROM inbox.outbox").fetchall()
    }
    expected = {
        conn.execute("SELECT inbox.effect_id(%s, %s, %s, 'notify')", (CONSUMER, PRODUCER, m)).fetchone()[0]: m  # type: ignore[index]
        for m in ledger
    }
    # The key the sink sees is the one claim_effects returns for the effect (scoped since 0.3.0).
    expected_keys = {
        conn.execute("SELECT inbox.idempotency_key(%s, '', %s)", (CONSUMER, e)).fetchone()[0]: m  # type: ignore[index]
        for e, m in expected.items()
    }
    # The purge may not delete effects (delivered effects stay until purge_delivered_effects).
    assert effects == expected, f"effects do not match applied messages; {context}"
    keys_by_message = defaultdict(set)
    for key, message_id in run.sink.requests:
        keys_by_message[message_id].add(key)
    wrong_key = {m: keys_by_message[m] for k, m in expected_keys.items() if keys_by_message[m] != {k}}
    assert not wrong_key, f"a message reached the sink without its one key: {wrong_key}; {context}"
    assert run.sink.dedup_counts() == Counter(list(expected_keys)), f"deduplicated sink counts differ; {context}"
    delivered = conn.execute("SELECT count(*) FROM inbox.outbox WHERE status = 'delivered'").fetchone()
    assert delivered == (len(expected),), f"not every effect delivered; {context}"
    # Sanity: the run exercised what it claims to.
    assert run.ops["purge"] >= 1 and len(run.produced) > 100, context
    purged = conn.execute("SELECT sum(rows_purged) FROM inbox.purge_state WHERE consumer = %s", (CONSUMER,)).fetchone()
    assert purged is not None and (purged[0] or 0) > 0, f"the purge deleted nothing; {context}"
    assert any("expired" in a or "duplicate" in a for a in run.answers.values()), context
    print(
        json.dumps(
            {
                "seed": seed,
                "ops": dict(run.ops),
                "messages": len(run.produced),
                "applied": len(ledger),
                "requests": len(run.sink.requests),
                "answers": dict(Counter(a for answers in run.answers.values() for a in answers)),
            }
        )
    )
