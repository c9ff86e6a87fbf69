"""Act two of `pginbox demo`: at-least-once delivery, simulated, with faults, and the proof.

A producer sends N credit messages through the in-memory broker (pginbox.brokers.memory, at-least-once): a
delivery leaves the broker only when it is acked; an unacked delivery comes back, flagged as a
redelivery, once its visibility timeout has passed. W worker threads, each with its own
connection, process deliveries through the SQL API (`inbox.record_start` for redeliveries, then
`inbox.claim_and_apply` with a registered SQL handler that credits an account and writes a
ledger row) while a seeded random generator injects faults:

- lost acks: the transaction committed, the ack never reached the broker (redelivered later);
- crashes before COMMIT: the worker's process dies (connection closed), or its backend is
  terminated with pg_terminate_backend in the middle of the handler or just before COMMIT; the
  worker restarts with a new connection and the broker redelivers;
- raced duplicates: the broker hands the same message to a second worker at once;
- transient errors (40001, 40P01, 55P03) raised inside the handler: the worker retries the whole
  transaction with a bounded, jittered backoff;
- poison messages (credits to an account that does not exist): failed, nacked, redelivered, and
  quarantined after max_attempts;
- one message re-sent by the producer with the same id and a different payload (conflict).

Then the invariant is proven from the domain tables, not from the inbox's own bookkeeping: every
message applied exactly once, balances equal to what the producer sent, the conflict and the
poison messages applied nothing. `run()` returns False when it is broken.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pginbox.brokers.memory import MemoryBroker, MemoryHandle
from pginbox.brokers.port import Delivery
from pginbox.brokers.wire import Header
from pginbox.errors import SimulationError
from pginbox.runtime.backoff import jittered

__all__ = ["Produced", "Simulation", "SimulationSettings", "run"]

Row = dict[str, Any]

PRODUCER: Final = "shop"
MESSAGE_TYPE: Final = "credit"
HANDLER_VERSION: Final = "v1"
ACCOUNTS: Final = 20
MISSING_ACCOUNT: Final = 999  # poison messages credit it: the handler refuses (permanent error)

# --------------------------------------------------------------------------- SQL

# The domain of this act, recreated on every run (the consumer name is new on every run too).
DOMAIN: Final = """
DROP SCHEMA IF EXISTS pginbox_sim CASCADE;
CREATE SCHEMA pginbox_sim;
CREATE TABLE pginbox_sim.account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
-- One row per application of a message. No unique key on purpose: a message applied twice must
-- show up as two rows and a wrong balance, not as an error that hides it.
CREATE TABLE pginbox_sim.ledger (
    message_id text NOT NULL,
    account integer NOT NULL,
    amount bigint NOT NULL,
    applied_by text NOT NULL DEFAULT current_setting('application_name'),
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO pginbox_sim.account (id) SELECT generate_series(1, 20);
-- The handler. pginbox_sim.fault is set (SET LOCAL) by the simulated worker to inject faults:
--   transient:<SQLSTATE>  raise a transient error (claim_and_apply re-raises it, the worker retries)
--   stall                 sleep after the domain writes, until the worker's backend is terminated
CREATE FUNCTION pginbox_sim.credit(payload jsonb, ctx inbox.message_context) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    fault text := coalesce(current_setting('pginbox_sim.fault', true), '');
BEGIN
    IF fault LIKE 'transient:%' THEN
        RAISE EXCEPTION 'simulated transient error %', substr(fault, 11) USING ERRCODE = substr(fault, 11);
    END IF;
    UPDATE pginbox_sim.account SET balance = balance + (payload->>'amount')::bigint
     WHERE id = (payload->>'account')::integer;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no account %', payload->>'account' USING CONSTRAINT = 'unknown_account';
    END IF;
    INSERT INTO pginbox_sim.ledger (message_id, account, amount)
    VALUES (ctx.message_id, (payload->>'account')::integer, (payload->>'amount')::bigint);
    IF fault = 'stall' THEN
        PERFORM pg_sleep(10);
    END IF;
END $$;
"""

REGISTER: Final = (
    "SELECT inbox.register_handler(%(consumer)s, 'credit', "
    "'pginbox_sim.credit(jsonb, inbox.message_context)'::regprocedure, %(version)s)"
)
CONFIGURE: Final = "SELECT inbox.configure_consumer(%(consumer)s, max_attempts => %(max_attempts)s)"
SET_FAULT: Final = "SELECT set_config('pginbox_sim.fault', %(fault)s, true)"
APPLY: Final = (
    "SELECT outcome, quarantine_id, attempts, reason_code "
    "FROM inbox.claim_and_apply(%(consumer)s, %(producer)s, %(message_id)s, %(message_type)s, %(payload)s)"
)
RECORD_START: Final = (
    "SELECT outcome, quarantine_id, attempts, reason_code "
    "FROM inbox.record_start(%(consumer)s, %(producer)s, %(message_id)s, message_type => %(message_type)s, "
    "payload => %(payload)s, handler_version => %(version)s)"
)
TERMINATE: Final = "SELECT pg_terminate_backend(%(pid)s)"
# The backend leaves pg_stat_activity after it has rolled back its transaction (pg_terminate_backend's
# own timeout polls every 100 ms: too slow for dozens of kills).
BACKEND_GONE: Final = "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %(pid)s) AS gone"

LEDGER: Final = "SELECT message_id, account, amount FROM pginbox_sim.ledger"
LEDGER_TWICE: Final = """
SELECT message_id, count(*) AS n FROM pginbox_sim.ledger GROUP BY 1 HAVING count(*) > 1 ORDER BY 1
"""
BALANCES: Final = """
SELECT a.id, a.balance, coalesce(l.booked, 0) AS booked
  FROM pginbox_sim.account a
  LEFT JOIN (SELECT account, sum(amount) AS booked FROM pginbox_sim.ledger GROUP BY 1) l ON l.account = a.id
 ORDER BY a.id
"""
INBOX_ROWS: Final = """
SELECT message_id, status::text AS status FROM inbox.message WHERE consumer = %(consumer)s AND producer = %(producer)s
"""
QUARANTINE_ROWS: Final = """
SELECT quarantine_id, message_id, kind, reason_code, status, attempts, crashes, deliveries
  FROM inbox.quarantine WHERE consumer = %(consumer)s AND producer = %(producer)s
 ORDER BY quarantine_id
"""

TRANSIENT_STATES: Final = ("40001", "40P01", "55P03")
TRANSIENT_ERRORS: Final = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected, pg_errors.LockNotAvailable)

# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SimulationSettings:
    messages: int = 3000
    workers: int = 4
    seed: int = 0
    visibility_timeout: float = 0.5  # seconds an unacked delivery stays invisible
    nack_delay: float = 0.02  # a nacked (failed) delivery comes back after this long
    max_attempts: int = 5  # inbox.configure_consumer: failures (or announced redeliveries) before quarantine
    lost_ack_rate: float = 0.02
    crash_rate: float = 0.02
    transient_rate: float = 0.02
    race_rate: float = 0.03
    max_crashes_per_message: int = 2  # keeps crash-loop protection for the poison messages only
    transient_retries: int = 5
    poison: int = 0  # 0: derived from messages
    deadline: float = 600.0  # give up (and fail) after this many seconds

    @property
    def poison_count(self) -> int:
        if self.poison:
            return self.poison
        return max(2, min(6, self.messages // 600))


# --------------------------------------------------------------------------- producer and broker


QUEUE: Final = "credits"
KIND_HEADER: Final = "Pginbox-Demo-Kind"  # what the demo knows about a message (not pginbox's business)


@dataclass(frozen=True)
class Produced:
    """One message the producer sends (the conflicting re-send is a message of its own, same id).
    It travels through the in-memory broker as a broker message: a JSON body and the identity in
    the wire contract's headers (pginbox.brokers.wire)."""

    message_id: str
    payload: Row
    kind: str  # credit | poison | conflict

    def body(self) -> bytes:
        return json.dumps(self.payload).encode()

    def headers(self) -> dict[str, str]:
        return {
            Header.MESSAGE_ID: self.message_id,
            Header.PRODUCER: PRODUCER,
            Header.TYPE: MESSAGE_TYPE,
            KIND_HEADER: self.kind,
        }

    @classmethod
    def of(cls, delivery: Delivery) -> Produced:
        return cls(
            str(delivery.headers[Header.MESSAGE_ID]), json.loads(delivery.body), str(delivery.headers[KIND_HEADER])
        )


def _handle(delivery: Delivery) -> MemoryHandle:
    handle = delivery.raw
    assert isinstance(handle, MemoryHandle)
    return handle


# --------------------------------------------------------------------------- workers


class _Crash(Exception):
    """The simulated consumer process died before COMMIT."""


class _Killer:
    """Terminates a worker's backend from the chaos connection, at most once, and lets the
    worker find out afterwards whether it happened (so no kill can land during COMMIT)."""

    def __init__(self, chaos: _Chaos, pid: int) -> None:
        self._chaos = chaos
        self._pid = pid
        self._lock = threading.Lock()
        self._state = "armed"

    def fire(self) -> None:
        with self._lock:
            if self._state != "armed":
                return
            self._state = "fired"
            self._chaos.terminate(self._pid)

    def disarm(self) -> bool:
        """True when the kill had not happened (and now never will)."""
        with self._lock:
            if self._state == "armed":
                self._state = "disarmed"
                return True
            return False


class _Chaos:
    """The connection that terminates worker backends (pg_terminate_backend)."""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True, application_name="pginbox-sim-chaos")
        self._lock = threading.Lock()

    def terminate(self, pid: int) -> None:
        """Terminate backend `pid` and return once it has exited (its transaction rolled back)."""
        with self._lock:
            self._conn.execute(TERMINATE, {"pid": pid})
            give_up = time.monotonic() + 10
            while True:
                row = self._conn.execute(BACKEND_GONE, {"pid": pid}).fetchone()
                if row is not None and row[0]:
                    return
                if time.monotonic() > give_up:
                    raise RuntimeError(f"backend {pid} did not exit within 10 s of pg_terminate_backend")
                time.sleep(0.001)

    def close(self) -> None:
        self._conn.close()


@dataclass
class _Shared:
    stats: Counter[str] = field(default_factory=Counter)
    crashes_by_tag: Counter[int] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def count(self, *keys: str) -> None:
        with self.lock:
            for key in keys:
                self.stats[key] += 1


class _Worker(threading.Thread):
    def __init__(self, number: int, sim: Simulation) -> None:
        super().__init__(name=f"pginbox-sim-worker-{number}", daemon=True)
        self.number = number
        self.sim = sim
        self.rng = random.Random(sim.settings.seed * 1000 + number)
        self.conn: psycopg.Connection[Row] | None = None

    # ------------------------------------------------------------------ connection
    def connect(self) -> psycopg.Connection[Row]:
        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(
                self.sim.dsn,
                row_factory=dict_row,
                application_name=f"pginbox-sim-w{self.number}",
                options="-c statement_timeout=60000",
            )
        return self.conn

    def restart(self) -> None:
        """After a crash: drop the dead connection; the next delivery gets a new one."""
        if self.conn is not None:
            self.conn.close()
        self.conn = None
        self.sim.shared.count("restarts")

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        shared = self.sim.shared
        broker = self.sim.broker
        try:
            while not shared.stop.is_set():
                delivery = broker.receive(QUEUE, timeout=0.1)
                if delivery is None:
                    if broker.drained(QUEUE):
                        return
                    continue
                self.process(delivery)
        except Exception as exc:  # an unexpected error stops the simulation (and fails it)
            with shared.lock:
                shared.errors.append(f"{self.name}: {type(exc).__name__}: {exc}")
            shared.stop.set()
        finally:
            if self.conn is not None:
                self.conn.close()

    def choose_fault(self, delivery: Delivery) -> str | None:
        settings = self.sim.settings
        shared = self.sim.shared
        roll = self.rng.random()
        if roll < settings.crash_rate:
            with shared.lock:
                tag = _handle(delivery).tag
                if shared.crashes_by_tag[tag] >= settings.max_crashes_per_message:
                    return None
                shared.crashes_by_tag[tag] += 1
            return self.rng.choice(("crash_client_gone", "crash_killed_in_handler", "crash_killed_before_commit"))
        roll -= settings.crash_rate
        if roll < settings.transient_rate:
            return "transient:" + self.rng.choice(TRANSIENT_STATES)
        roll -= settings.transient_rate
        if roll < settings.lost_ack_rate:
            return "lost_ack"
        return None

    def process(self, delivery: Delivery) -> None:
        sim = self.sim
        message = Produced.of(delivery)
        raced = _handle(delivery).raced
        params: Row = {
            "consumer": sim.consumer,
            "producer": PRODUCER,
            "message_id": message.message_id,
            "message_type": MESSAGE_TYPE,
            "payload": Jsonb(message.payload),
            "version": HANDLER_VERSION,
        }
        conn = self.connect()
        if delivery.redelivered:
            # Announce the attempt in its own transaction: a consumer that keeps crashing on this
            # message never records a failure, so this is what ends a crash loop.
            row = conn.execute(RECORD_START, params).fetchone()
            conn.commit()
            assert row is not None
            sim.shared.count("record_start")
            if row["outcome"] == "quarantined":
                sim.shared.count("outcome:quarantined", "crash_loop_quarantined")
                sim.broker.ack(delivery)
                return

        fault = self.choose_fault(delivery)
        for attempt in range(1, sim.settings.transient_retries + 1):
            inject = fault if attempt == 1 else None
            try:
                row = self.attempt(conn, params, inject)
            except _Crash:
                sim.shared.count("crashes", inject or "crash")
                self.restart()
                return  # no ack: the broker redelivers after the visibility timeout
            except TRANSIENT_ERRORS:
                conn.rollback()
                sim.shared.count("transient_retries")
                time.sleep(jittered(attempt, 0.002, 0.1, self.rng))
                continue
            break
        else:
            sim.shared.count("transient_exhausted")
            sim.broker.nack(delivery, sim.settings.nack_delay)
            return

        outcome = str(row["outcome"])
        sim.shared.count(f"outcome:{outcome}", f"outcome:{outcome}:{message.kind}")
        if raced:
            sim.shared.count(f"raced:{outcome}")
        if delivery.redelivered:
            sim.shared.count(f"redelivered:{outcome}")
        if not raced and not delivery.redelivered:
            sim.shared.count(f"first:{outcome}")
        if outcome == "failed":
            sim.broker.nack(delivery, sim.settings.nack_delay)  # a permanent error: the broker retries later
            return
        if fault == "lost_ack":
            sim.shared.count("lost_acks")
            return  # committed, but the broker never hears of it: it redelivers
        sim.broker.ack(delivery)

    def attempt(self, conn: psycopg.Connection[Row], params: Row, fault: str | None) -> Row:
        """One transaction: claim_and_apply, then COMMIT (or a fault)."""
        killer: _Killer | None = None
        try:
            if fault is not None and (fault.startswith("transient:") or fault == "crash_killed_in_handler"):
                conn.execute(SET_FAULT, {"fault": "stall" if fault.startswith("crash") else fault})
            if fault == "crash_killed_in_handler":
                # The handler writes, then stalls; the chaos connection terminates the backend.
                killer = _Killer(self.sim.chaos, conn.info.backend_pid)
                threading.Timer(0.02, killer.fire).start()
            row = conn.execute(APPLY, params).fetchone()
            assert row is not None
            if killer is not None and not killer.disarm():
                raise _Crash  # killed after the statement returned (a duplicate: no stall), before COMMIT
            if fault == "crash_client_gone":
                conn.close()  # the process dies: the server sees the connection drop and rolls back
                raise _Crash
            if fault == "crash_killed_before_commit":
                self.sim.chaos.terminate(conn.info.backend_pid)  # returns once the backend has exited
            conn.commit()
            return row
        except psycopg.OperationalError as exc:
            if isinstance(exc, TRANSIENT_ERRORS):
                raise
            if fault is not None and fault.startswith("crash"):
                raise _Crash from exc
            raise
        finally:
            if killer is not None:
                killer.disarm()


# --------------------------------------------------------------------------- the simulation


@dataclass
class Check:
    ok: bool
    text: str


@dataclass
class _Facts:
    ledger: list[Row]
    twice: list[Row]
    balances: list[Row]
    inbox_rows: dict[str, str]
    quarantine: list[Row]


class Simulation:
    def __init__(self, dsn: str, settings: SimulationSettings, out: TextIO | None = None) -> None:
        self.dsn = dsn
        self.settings = settings
        self.out = out or sys.stdout
        self.consumer = f"sim-{uuid.uuid4().hex[:8]}"
        self.shared = _Shared()
        self.broker = MemoryBroker(
            rng=random.Random(settings.seed),
            visibility_timeout=settings.visibility_timeout,
            race_rate=settings.race_rate,
        )
        self.messages: list[Produced] = []
        self.conflict: Produced | None = None
        self.chaos: _Chaos
        self.elapsed = 0.0
        self._started = time.monotonic()

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    # ------------------------------------------------------------------ setup
    def produce_plan(self) -> None:
        """The producer's messages: N credits (a few of them poison) and one conflicting re-send."""
        rng = random.Random(self.settings.seed + 1)
        n = self.settings.messages
        poison = set(rng.sample(range(n), self.settings.poison_count))
        for i in range(n):
            kind = "poison" if i in poison else "credit"
            account = MISSING_ACCOUNT if kind == "poison" else rng.randint(1, ACCOUNTS)
            payload = {"account": account, "amount": rng.randint(1, 500), "order": f"o-{rng.randrange(10**8):08d}"}
            self.messages.append(Produced(message_id=f"c-{i:06d}", payload=payload, kind=kind))
        candidates = [m for m in self.messages[: max(n // 2, 1)] if m.kind == "credit"]
        original = rng.choice(candidates)
        changed = dict(original.payload, amount=original.payload["amount"] + 1000)
        self.conflict = Produced(message_id=original.message_id, payload=changed, kind="conflict")

    def setup_database(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(DOMAIN)
            conn.execute(REGISTER, {"consumer": self.consumer, "version": HANDLER_VERSION})
            conn.execute(CONFIGURE, {"consumer": self.consumer, "max_attempts": self.settings.max_attempts})

    # ------------------------------------------------------------------ producer
    def producer(self) -> None:
        """Publishes in chunks while the broker's backlog is short (the producer runs alongside the
        consumers), and re-sends the conflicting message once its original was acked."""
        assert self.conflict is not None
        conflict_sent = False
        original_tag: int | None = None  # the broker's tag of the conflict's original, once published
        index = 0
        while not self.shared.stop.is_set():
            if index < len(self.messages) and self.broker.backlog(QUEUE) < 200:
                for message in self.messages[index : index + 100]:
                    tag = self.broker.publish(QUEUE, message.body(), message.headers())
                    if message.message_id == self.conflict.message_id:
                        original_tag = tag
                index = min(index + 100, len(self.messages))
            if (
                not conflict_sent
                and original_tag is not None
                and self.broker.is_acked(QUEUE, original_tag)
                and index >= len(self.messages) // 2
            ):
                self.broker.publish(QUEUE, self.conflict.body(), self.conflict.headers())
                conflict_sent = True
            if conflict_sent and index >= len(self.messages):
                self.broker.close(QUEUE)
                return
            time.sleep(0.005)

    # ------------------------------------------------------------------ progress
    def progress_line(self) -> str:
        s = self.shared.stats
        b = self.broker.stats
        return (
            f"delivered {b['deliveries']:>6} | applied {s['outcome:applied']:>6} | "
            f"duplicates {s['outcome:duplicate']:>5} | failed {s['outcome:failed']:>3} | "
            f"crashes {s['crashes']:>3} | in flight {self.broker.in_flight(QUEUE):>2} | "
            f"unacked {self.broker.unacked(QUEUE):>5} | {time.monotonic() - self._started:5.1f} s"
        )

    def report_progress(self, done: threading.Event) -> None:
        tty = self.out.isatty()
        interval = 0.25 if tty else 2.0
        while not done.wait(interval):
            line = self.progress_line()
            if tty:
                print("\r   " + line, end="", file=self.out, flush=True)
            else:
                self.say("   " + line)
        if tty:
            print("\r   " + self.progress_line(), file=self.out, flush=True)
        else:
            self.say("   " + self.progress_line())

    # ------------------------------------------------------------------ run
    def run(self) -> bool:
        s = self.settings
        self.produce_plan()
        assert self.conflict is not None
        self.say(
            f"\nAct 2: {s.messages} messages, a broker that redelivers, {s.workers} workers, faults (seed {s.seed})"
        )
        self.say(
            f"   producer '{PRODUCER}' sends {s.messages} credit messages to {ACCOUNTS} accounts; "
            f"consumer '{self.consumer}' applies them with inbox.claim_and_apply"
        )
        self.say(
            f"   {s.poison_count} of them are poison (account {MISSING_ACCOUNT} does not exist); "
            f"{self.conflict.message_id} is re-sent later with another amount (a conflict)"
        )
        self.say(
            f"   the broker redelivers what is not acked within {s.visibility_timeout:g} s and races "
            f"{s.race_rate:.0%} of deliveries on a second worker"
        )
        self.say(
            f"   faults per delivery: {s.crash_rate:.0%} crash before COMMIT, {s.transient_rate:.0%} transient "
            f"error, {s.lost_ack_rate:.0%} ack lost after COMMIT; max_attempts {s.max_attempts}"
        )
        self.setup_database()
        self.chaos = _Chaos(self.dsn)
        self._started = time.monotonic()
        done = threading.Event()
        reporter = threading.Thread(target=self.report_progress, args=(done,), daemon=True)
        producer = threading.Thread(target=self._guard(self.producer), name="pginbox-sim-producer", daemon=True)
        workers = [_Worker(i + 1, self) for i in range(s.workers)]
        reporter.start()
        producer.start()
        for worker in workers:
            worker.start()
        deadline = self._started + s.deadline
        try:
            for thread in [producer, *workers]:
                while thread.is_alive():
                    thread.join(timeout=0.2)
                    if time.monotonic() > deadline:
                        self.shared.errors.append(f"the simulation did not finish within {s.deadline:g} s")
                        self.shared.stop.set()
        except KeyboardInterrupt:
            self.shared.stop.set()
            raise
        finally:
            self.elapsed = time.monotonic() - self._started
            done.set()
            reporter.join()
            self.chaos.close()
        facts = self.collect()
        self.summarize(facts)
        ok = self.prove(facts)
        if self.shared.errors:
            raise SimulationError("the simulation stopped early: " + "; ".join(self.shared.errors[:3]))
        return ok

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def guarded() -> None:
            try:
                target()
            except Exception as exc:
                with self.shared.lock:
                    self.shared.errors.append(f"{threading.current_thread().name}: {type(exc).__name__}: {exc}")
                self.shared.stop.set()

        return guarded

    # ------------------------------------------------------------------ report
    def collect(self) -> _Facts:
        """What the database says happened: the domain tables and the consumer's inbox rows."""
        params = {"consumer": self.consumer, "producer": PRODUCER}
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as conn:
            return _Facts(
                ledger=conn.execute(LEDGER).fetchall(),
                twice=conn.execute(LEDGER_TWICE).fetchall(),
                balances=conn.execute(BALANCES).fetchall(),
                inbox_rows={r["message_id"]: r["status"] for r in conn.execute(INBOX_ROWS, params).fetchall()},
                quarantine=conn.execute(QUARANTINE_ROWS, params).fetchall(),
            )

    def poison_entries(self, facts: _Facts) -> dict[str, Row]:
        poison = {m.message_id for m in self.messages if m.kind == "poison"}
        return {
            q["message_id"]: q
            for q in facts.quarantine
            if q["kind"] == "failure" and q["status"] == "open" and q["message_id"] in poison
        }

    def summarize(self, facts: _Facts) -> None:
        s = self.shared.stats
        b = self.broker.stats
        rate = b["deliveries"] / self.elapsed if self.elapsed > 0 else 0.0
        first = b["deliveries"] - b["redeliveries"] - b["raced_copies"]
        crashes = ", ".join(
            f"{label} {s[key]}"
            for key, label in (
                ("crash_client_gone", "process died"),
                ("crash_killed_in_handler", "terminated mid-handler"),
                ("crash_killed_before_commit", "terminated before COMMIT"),
            )
        )
        poison = self.poison_entries(facts)
        reasons = Counter(q["reason_code"] for q in poison.values())
        reason_text = ", ".join(f"{code} x{n}" for code, n in sorted(reasons.items())) or "none"
        self.say(f"\n   What happened ({self.elapsed:.1f} s, {rate:.0f} deliveries/s)")
        rows = [
            (
                "deliveries",
                b["deliveries"],
                f"{first} first, {b['redeliveries']} redelivered, {b['raced_copies']} raced copies "
                f"({b['raced_concurrently']} while the original was in flight)",
            ),
            ("applied", s["outcome:applied"], "first processing: domain change and claim committed together"),
            (
                "duplicates absorbed",
                s["outcome:duplicate"],
                f"{s['raced:duplicate']} raced copies, {s['redelivered:duplicate']} redeliveries, "
                f"{s['first:duplicate']} originals beaten by their raced copy: the handler did not run",
            ),
            ("conflicts quarantined", s["outcome:conflict"], "same id, another payload: nothing applied"),
            ("failures retried", s["outcome:failed"], "permanent handler errors: rolled back, recorded, nacked"),
            (
                "poison messages quarantined",
                len(poison),
                f"of {self.settings.poison_count}, after max_attempts {self.settings.max_attempts} ({reason_text})",
            ),
            ("transient errors retried", s["transient_retries"], "40001/40P01/55P03: the whole transaction again"),
            ("crashes injected", s["crashes"], crashes),
            ("lost acks", s["lost_acks"], "committed, never acked: redelivered, then a duplicate"),
            ("redeliveries announced", s["record_start"], "inbox.record_start before processing a redelivery"),
            ("worker restarts", s["restarts"], "a new connection after each crash"),
        ]
        for label, value, note in rows:
            self.say(f"   {label:<28} {value:>6}   {note}")

    # ------------------------------------------------------------------ the proof
    def prove(self, facts: _Facts) -> bool:
        """Each check of the invariant, printed OK or FAILED; True when all hold."""
        good = {m.message_id: m for m in self.messages if m.kind == "credit"}
        checks = [
            self._no_message_twice(facts),
            self._claims_match_effects(facts),
            self._none_lost(facts, good),
            self._payloads_as_sent(facts, good),
            self._balances_as_sent(facts, good),
            self._conflict_applied_nothing(facts, good),
            self._poison_quarantined(facts),
            self._broker_drained(),
        ]
        self.say("\n   The invariant, proven from the domain tables (pginbox_sim.ledger, pginbox_sim.account)")
        for check in checks:
            self.say(f"   {'OK    ' if check.ok else 'FAILED'} {check.text}")
        ok = all(check.ok for check in checks)
        if ok:
            self.say(
                "   INVARIANT HOLDS: every message applied exactly once, no double credit, "
                "the conflict and the poison messages applied nothing."
            )
            self.say(
                f"   The quarantined messages wait for an operator: pginbox quarantine list --consumer {self.consumer}"
            )
        else:
            self.say("   INVARIANT BROKEN: see the FAILED lines above.")
        return ok

    @staticmethod
    def _no_message_twice(facts: _Facts) -> Check:
        twice = facts.twice
        return Check(
            not twice,
            f"ledger: {len(facts.ledger)} rows, no message id twice"
            if not twice
            else f"ledger: {len(twice)} message ids applied more than once, e.g. "
            + ", ".join(f"{r['message_id']} x{r['n']}" for r in twice[:5]),
        )

    @staticmethod
    def _claims_match_effects(facts: _Facts) -> Check:
        ledger_set = {r["message_id"] for r in facts.ledger}
        processed = {mid for mid, status in facts.inbox_rows.items() if status == "processed"}
        without_effect = sorted(processed - ledger_set)
        without_claim = sorted(ledger_set - processed)
        return Check(
            not without_effect and not without_claim,
            f"each of the {len(processed)} committed claims has its ledger row, and every ledger row its claim"
            if not without_effect and not without_claim
            else f"claims without effect: {without_effect[:5]} ({len(without_effect)}); "
            f"effects without claim: {without_claim[:5]} ({len(without_claim)})",
        )

    @staticmethod
    def _none_lost(facts: _Facts, good: dict[str, Produced]) -> Check:
        missing = sorted(set(good) - {r["message_id"] for r in facts.ledger})
        return Check(
            not missing,
            f"every good message applied: {len(good) - len(missing)} of {len(good)}, none lost"
            if not missing
            else f"{len(missing)} good messages never applied, e.g. {missing[:5]} "
            f"(inbox status: {[facts.inbox_rows.get(m, 'no row') for m in missing[:5]]})",
        )

    @staticmethod
    def _payloads_as_sent(facts: _Facts, good: dict[str, Produced]) -> Check:
        wrong = [
            r["message_id"]
            for r in facts.ledger
            if r["message_id"] in good
            and (r["amount"], r["account"])
            != (good[r["message_id"]].payload["amount"], good[r["message_id"]].payload["account"])
        ]
        stray = sorted({r["message_id"] for r in facts.ledger} - set(good))
        return Check(
            not wrong and not stray,
            "every ledger row carries the payload its message was first sent with"
            if not wrong and not stray
            else f"rows with another payload: {wrong[:5]}; rows of messages that must not apply: {stray[:5]}",
        )

    @staticmethod
    def _balances_as_sent(facts: _Facts, good: dict[str, Produced]) -> Check:
        expected: Counter[int] = Counter()
        for m in good.values():
            expected[int(m.payload["account"])] += int(m.payload["amount"])
        bad_balances = [
            f"account {r['id']}: balance {r['balance']}, ledger {r['booked']}, sent {expected[r['id']]}"
            for r in facts.balances
            if not (r["balance"] == r["booked"] == expected[r["id"]])
        ]
        total = sum(int(r["balance"]) for r in facts.balances)
        return Check(
            not bad_balances,
            f"no double credit: each of the {len(facts.balances)} balances equals its ledger sum and what the "
            f"producer sent (total {total})"
            if not bad_balances
            else "; ".join(bad_balances[:5]),
        )

    def _conflict_applied_nothing(self, facts: _Facts, good: dict[str, Produced]) -> Check:
        assert self.conflict is not None
        conflict = self.conflict
        conflict_entries = [
            q for q in facts.quarantine if q["kind"] == "conflict" and q["message_id"] == conflict.message_id
        ]
        original = good[conflict.message_id]
        conflict_rows = [r for r in facts.ledger if r["message_id"] == conflict.message_id]
        conflict_ok = len(conflict_entries) == 1 and [r["amount"] for r in conflict_rows] == [
            original.payload["amount"]
        ]
        return Check(
            conflict_ok,
            f"conflict {conflict.message_id}: quarantined as entry #{conflict_entries[0]['quarantine_id']} "
            f"({_plural(conflict_entries[0]['deliveries'], 'delivery', 'deliveries')}); "
            f"amount {conflict.payload['amount']} never applied, {original.payload['amount']} applied once"
            if conflict_ok
            else f"conflict {conflict.message_id}: entries {conflict_entries}, ledger rows {conflict_rows}",
        )

    def _poison_quarantined(self, facts: _Facts) -> Check:
        poison = {m.message_id: m for m in self.messages if m.kind == "poison"}
        poison_entries = self.poison_entries(facts)
        poison_applied = sorted(set(poison) & {r["message_id"] for r in facts.ledger})
        poison_open = [mid for mid in poison if mid in poison_entries and facts.inbox_rows.get(mid) == "quarantined"]
        reasons = Counter(poison_entries[mid]["reason_code"] for mid in poison_open)
        poison_ok = not poison_applied and len(poison_open) == len(poison)
        return Check(
            poison_ok,
            f"{len(poison)} poison messages: quarantined, nothing applied (reasons: "
            + ", ".join(f"{code} x{n}" for code, n in sorted(reasons.items()))
            + ")"
            if poison_ok
            else f"poison messages applied: {poison_applied}; quarantined: {len(poison_open)} of {len(poison)}",
        )

    def _broker_drained(self) -> Check:
        unacked = self.broker.unacked(QUEUE)
        return Check(
            unacked == 0 and not self.shared.errors,
            f"broker drained: all {len(self.messages) + 1} messages acked"
            if unacked == 0 and not self.shared.errors
            else f"{unacked} messages never acked; errors: {'; '.join(self.shared.errors) or 'none'}",
        )


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def run(
    dsn: str, *, messages: int = 3000, workers: int = 4, seed: int | None = None, out: TextIO | None = None
) -> bool:
    """Run the simulation against `dsn` (schema inbox deployed); True when the invariant holds."""
    if seed is None:
        seed = random.SystemRandom().randrange(1, 10**6)
    settings = SimulationSettings(messages=messages, workers=workers, seed=seed)
    return Simulation(dsn, settings, out).run()
