"""Act 3 of `pginbox demo`: the transactional outbox, end to end, against a flaky webhook.

A broker delivers 'order' messages to one consumer, with redeliveries. Half of them go through a
SQL handler (registered with inbox.register_handler, run by inbox.claim_and_apply via
`Inbox.apply`), half through a Python handler (`Inbox.handle`). Each handler makes its domain
change and enqueues its effects with `inbox.enqueue_effect(inbox.effect_id(consumer, producer,
message_id, effect_name), ...)` in the same transaction. Some handler runs fail after enqueueing
(poison messages, a flaky first attempt) and some transactions are rolled back before COMMIT (a
crash): their effects must vanish with them.

The real `pginbox.dispatcher.Dispatcher`, with one `WebhookTransport` per destination (loopback
allowlisted explicitly), delivers the committed effects to a real HTTP server on 127.0.0.1 (the
sink, in a thread). The sink answers 503 to some attempts and, to others, processes the request
and then holds the answer past the transport's timeout: the dispatcher cannot tell whether the
effect happened (ambiguous) and retries with the same key. The sink deduplicates on the
`Idempotency-Key` header, as a destination must.

The proof, from the sink's records and the database: every committed effect reached the sink and
is `delivered`; every request carried exactly one Idempotency-Key, the key of the consumer and the
effect id of the message and effect in its body (inbox.idempotency_key); the sink counted each
effect exactly once; handler runs that rolled back
left no effect; each attempt in inbox.outbox is one request at the sink.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import psycopg
from psycopg.rows import dict_row

from pginbox.brokers.memory import MemoryBroker
from pginbox.brokers.port import Delivery
from pginbox.brokers.wire import Header
from pginbox.client.inbox import Inbox
from pginbox.client.outcomes import Message, Outcome
from pginbox.demo.sink import Sink, SinkRequest
from pginbox.dispatcher import Dispatcher, Effect
from pginbox.errors import OutboxDemoRefused
from pginbox.transports import AmbiguousDelivery, CallableTransport, DeliveryReport, Transport, WebhookTransport

__all__ = ["EFFECTS", "OutboxAct", "OutboxSettings", "run"]

Row = dict[str, Any]

PRODUCER = "shop"
DEST_PREFIX = "pginbox-demo-"
CRM = DEST_PREFIX + "crm"
MAIL = DEST_PREFIX + "mail"
SQL_TYPE = "order.placed"  # handled by the SQL handler (inbox.claim_and_apply)
PY_TYPE = "order.paid"  # handled by the Python handler (Inbox.handle)
# The effects each handler enqueues: (effect name, destination).
EFFECTS = {SQL_TYPE: (("crm.notify", CRM),), PY_TYPE: (("mail.receipt", MAIL), ("crm.notify", CRM))}
SINK_PATHS = {CRM: "/crm", MAIL: "/mail"}

DOMAIN = """
DROP SCHEMA IF EXISTS pginbox_outbox_demo CASCADE;
CREATE SCHEMA pginbox_outbox_demo;
-- One row per applied message: the domain change the effects belong to.
CREATE TABLE pginbox_outbox_demo.order_event (
    consumer text NOT NULL, message_id text NOT NULL, kind text NOT NULL, order_no integer NOT NULL,
    amount integer NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp());
-- The SQL handler: the domain change, its effect, and a refusal of poison orders AFTER the enqueue
-- (the enqueue must roll back with the rest).
CREATE FUNCTION pginbox_outbox_demo.place_order(payload jsonb, ctx inbox.message_context) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pginbox_outbox_demo.order_event (consumer, message_id, kind, order_no, amount)
    VALUES (ctx.consumer, ctx.message_id, 'placed', (payload->>'order')::integer, (payload->>'amount')::integer);
    PERFORM inbox.enqueue_effect(
        inbox.effect_id(ctx.consumer, ctx.producer, ctx.message_id, 'crm.notify', ctx.tenant),
        'pginbox-demo-crm',
        jsonb_build_object('consumer', ctx.consumer, 'message_id', ctx.message_id, 'effect', 'crm.notify',
                           'order', payload->'order', 'amount', payload->'amount'));
    IF (payload->>'poison')::boolean THEN
        RAISE EXCEPTION 'order % names no customer', payload->>'order' USING CONSTRAINT = 'unknown_customer';
    END IF;
END $$;
"""

REGISTER_HANDLER = (
    "SELECT inbox.register_handler(%s, 'order.placed',"
    " 'pginbox_outbox_demo.place_order(jsonb, inbox.message_context)'::regprocedure, 'v1')"
)
CONFIGURE_CONSUMER = "SELECT inbox.configure_consumer(%s, max_attempts => %s)"
CONFIGURE_DESTINATION = (
    "SELECT inbox.configure_destination(%s, max_attempts => 20, base_backoff => '50 milliseconds',"
    " max_backoff => '300 milliseconds')"
)
# Effects of other destinations that a dispatcher started here would claim (and fail: no transport).
FOREIGN_UNDELIVERED = (
    "SELECT destination, count(*) AS n FROM inbox.outbox WHERE status IN ('pending', 'leased')"
    " AND destination NOT LIKE 'pginbox-demo-%' GROUP BY 1 ORDER BY 2 DESC"
)
APPLIED_INSERT = (
    "INSERT INTO pginbox_outbox_demo.order_event (consumer, message_id, kind, order_no, amount)"
    " VALUES (%(consumer)s, %(message_id)s, 'paid', %(order)s, %(amount)s)"
)
ENQUEUE = (
    "SELECT inbox.enqueue_effect(inbox.effect_id(%(consumer)s, %(producer)s, %(message_id)s, %(effect)s),"
    " %(destination)s, %(body)s::jsonb)"
)
CLAIM = "SELECT outcome FROM inbox.claim(%s, %s, %s, %s::jsonb, 'v1')"
# Every effect id this run's messages could produce, computed by the database.
EXPECTED_IDS = (
    "SELECT x.message_id, x.effect, x.effect_id, inbox.idempotency_key(%(consumer)s, '', x.effect_id) AS key"
    " FROM (SELECT m.message_id, m.effect,"
    "              inbox.effect_id(%(consumer)s, %(producer)s, m.message_id, m.effect) AS effect_id"
    "         FROM jsonb_to_recordset(%(pairs)s::jsonb) AS m(message_id text, effect text)) x"
)
PROGRESS = (
    "SELECT count(*) FILTER (WHERE status = 'delivered') AS delivered,"
    " count(*) FILTER (WHERE status = 'dead') AS dead, count(*) AS total"
    " FROM inbox.outbox WHERE effect_id = ANY(%s)"
)
OUTBOX_ROWS = (
    "SELECT effect_id, destination, status, attempts, dead_reason, last_error, last_status_code, payload"
    " FROM inbox.outbox WHERE effect_id = ANY(%s)"
)
INBOX_ROWS = "SELECT message_id, status FROM inbox.message WHERE consumer = %s AND producer = %s"
# Handler runs that raised (recorded outside their rolled-back transactions).
FAILED_RUNS = "SELECT message_id, failed FROM inbox.attempt WHERE consumer = %s AND producer = %s AND failed > 0"
DOMAIN_ROWS = "SELECT message_id, count(*) AS n FROM pginbox_outbox_demo.order_event WHERE consumer = %s GROUP BY 1"


@dataclass(frozen=True)
class OutboxSettings:
    messages: int = 200  # half SQL handler, half Python handler
    workers: int = 3  # consumer threads
    poison_rate: float = 0.06  # handler enqueues, then refuses: rolled back, quarantined
    flaky_rate: float = 0.08  # Python handler fails its first run after enqueueing
    crash_rate: float = 0.06  # Python path: claim + change + enqueue, then ROLLBACK (crash before COMMIT)
    redeliver_rate: float = 0.25  # the broker delivers a copy later (lost ack)
    replay: int = 20  # messages replayed after the effects were delivered
    hold_rate: float = 0.15  # sink: processes, then answers after the client's timeout (ambiguous)
    unavailable_rate: float = 0.15  # sink: 503 without processing
    client_timeout: float = 0.4  # WebhookTransport timeout (every phase)
    hold_seconds: float = 0.9  # how long the sink holds a held answer
    max_attempts: int = 3  # consumer's max_attempts (poison -> quarantine)
    seed: int = 1
    dedup: bool = True  # False: the sink counts every processed request (a broken destination)
    deadline: float = 90.0


class CountingTransport:
    """Delegates to a WebhookTransport and counts its ambiguous outcomes (it raises for those)."""

    def __init__(self, inner: WebhookTransport, counter: Counter[str], lock: threading.Lock) -> None:
        self.inner = inner
        self.counter = counter
        self.lock = lock

    def deliver(self, effect: Any) -> DeliveryReport:
        try:
            report = self.inner.deliver(effect)
        except AmbiguousDelivery:
            with self.lock:
                self.counter["ambiguous"] += 1
            raise
        with self.lock:
            self.counter["answered " + str(report.status_code)] += 1
        return report


# ---------------------------------------------------------------------------------------- the broker


QUEUE = "orders"


@dataclass(frozen=True)
class OrderMessage:
    message_id: str
    message_type: str
    kind: str  # "good" | "flaky" | "poison" | "crash" (good, but its first delivery crashes before COMMIT)
    payload: dict[str, Any]

    def headers(self) -> dict[str, str]:
        """The identity as the wire contract's headers (the in-memory broker carries them)."""
        return {Header.MESSAGE_ID: self.message_id, Header.PRODUCER: PRODUCER, Header.TYPE: self.message_type}


class HandlerRefused(Exception):
    """The Python handler's permanent error (raised after it enqueued its effects)."""


# ---------------------------------------------------------------------------------------- the act


class OutboxAct:
    def __init__(self, dsn: str, settings: OutboxSettings, out: TextIO | None = None) -> None:
        self.dsn = dsn
        self.settings = settings
        self.out = out
        self.consumer = f"shipping-{uuid.uuid4().hex[:8]}"
        self.rng = random.Random(settings.seed)
        self.lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self.transport_stats: Counter[str] = Counter()
        self.errors: list[str] = []
        self.flaky_failed: set[str] = set()
        self.messages: list[OrderMessage] = []
        self.expected: dict[tuple[str, str], str] = {}  # (message_id, effect) -> effect_id
        self.expected_key: dict[str, str] = {}  # effect_id -> the key the sink must see (inbox.idempotency_key)
        self.by_id: dict[str, OrderMessage] = {}
        self.crashed: set[str] = set()
        self.webhooks: list[WebhookTransport] = []
        self.sink = Sink(
            settings.seed, settings.hold_rate, settings.unavailable_rate, settings.hold_seconds, dedup=settings.dedup
        )
        self.dispatcher_stats: dict[str, Any] = {}
        self.elapsed = 0.0

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    # ------------------------------------------------------------------ setup
    def plan(self) -> None:
        s = self.settings
        for i in range(1, s.messages + 1):
            message_type = SQL_TYPE if i % 2 else PY_TYPE
            r = self.rng.random()
            if r < s.poison_rate:
                kind = "poison"
            elif message_type == PY_TYPE and r < s.poison_rate + s.flaky_rate:
                kind = "flaky"
            elif message_type == PY_TYPE and r < s.poison_rate + s.flaky_rate + s.crash_rate:
                kind = "crash"
            else:
                kind = "good"
            payload: dict[str, Any] = {"order": 1000 + i, "amount": self.rng.randrange(5, 500)}
            if kind == "poison":
                payload["poison"] = True
            self.messages.append(OrderMessage(f"o-{i:05d}", message_type, kind, payload))
        # Make sure every fault shows up at least once, whatever the seed.
        for kind, message_type in (("poison", SQL_TYPE), ("poison", PY_TYPE), ("flaky", PY_TYPE), ("crash", PY_TYPE)):
            if not any(m.kind == kind and m.message_type == message_type for m in self.messages):
                idx = next(
                    j for j, m in enumerate(self.messages) if m.kind == "good" and m.message_type == message_type
                )
                m = self.messages[idx]
                payload = {**m.payload, "poison": True} if kind == "poison" else m.payload
                self.messages[idx] = OrderMessage(m.message_id, m.message_type, kind, payload)

    def deliveries(self) -> list[tuple[OrderMessage, bool]]:
        """The broker's stream: every message once, and some again later (redelivered: an ack lost)."""
        first = [(m, False) for m in self.messages]
        copies = [(m, True) for m in self.messages if self.rng.random() < self.settings.redeliver_rate]
        out = list(first)
        for copy in copies:  # a copy comes after its original, somewhere later in the stream
            at = next(i for i, d in enumerate(out) if d[0] is copy[0])
            out.insert(self.rng.randint(at + 1, len(out)), copy)
        return out

    def setup(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as conn:
            foreign = conn.execute(FOREIGN_UNDELIVERED).fetchall()
            if foreign:
                listed = ", ".join(f"{r['destination']} ({r['n']})" for r in foreign[:5])
                raise OutboxDemoRefused(
                    f"act 3 runs an outbox dispatcher, and this database has undelivered effects of other "
                    f"destinations that it would claim: {listed}; run the demo on a database of its own "
                    f"(--dsn), or without act 3 (--act 1 --act 2)"
                )
            conn.execute(DOMAIN)
            conn.execute(REGISTER_HANDLER, (self.consumer,))
            conn.execute(CONFIGURE_CONSUMER, (self.consumer, self.settings.max_attempts))
            for destination in (CRM, MAIL):
                conn.execute(CONFIGURE_DESTINATION, (destination,))
            pairs = [
                {"message_id": m.message_id, "effect": name}
                for m in self.messages
                for name, _dest in EFFECTS[m.message_type]
            ]
            rows = conn.execute(
                EXPECTED_IDS, {"consumer": self.consumer, "producer": PRODUCER, "pairs": json.dumps(pairs)}
            ).fetchall()
            self.expected = {(r["message_id"], r["effect"]): r["effect_id"] for r in rows}
            self.expected_key = {r["effect_id"]: r["key"] for r in rows}

    # ------------------------------------------------------------------ consumers
    def python_handler(self, cur: psycopg.Cursor[Any], msg: Message) -> None:
        message = self.by_id[msg.message_id]
        params = {"consumer": self.consumer, "message_id": msg.message_id, **msg.payload}
        cur.execute(APPLIED_INSERT, params)
        for name, destination in EFFECTS[PY_TYPE]:
            body = {
                "consumer": self.consumer,
                "message_id": msg.message_id,
                "effect": name,
                "order": msg.payload["order"],
                "amount": msg.payload["amount"],
            }
            cur.execute(
                ENQUEUE,
                {
                    "consumer": self.consumer,
                    "producer": PRODUCER,
                    "message_id": msg.message_id,
                    "effect": name,
                    "destination": destination,
                    "body": json.dumps(body),
                },
            )
        refuse = message.kind == "poison"
        if message.kind == "flaky":
            with self.lock:
                refuse = msg.message_id not in self.flaky_failed
                self.flaky_failed.add(msg.message_id)
        if refuse:
            raise HandlerRefused(
                f"order {msg.payload['order']}: "
                + ("names no customer" if message.kind == "poison" else "warehouse busy, try again")
            )

    def crash_before_commit(self, conn: psycopg.Connection[Any], message: OrderMessage) -> bool:
        """BEGIN; claim; the change; enqueue; then the process 'dies': ROLLBACK. True when it got
        as far as the enqueue (the claim was ours)."""
        with conn.transaction(force_rollback=True), conn.cursor() as cur:
            row = cur.execute(
                CLAIM, (self.consumer, PRODUCER, message.message_id, json.dumps(message.payload))
            ).fetchone()
            if row is None or row[0] != "claimed":
                return False
            self.python_handler(cur, Message(PRODUCER, message.message_id, message.message_type, message.payload))
            return True

    def worker(self, broker: MemoryBroker) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            inbox = Inbox(conn, consumer=self.consumer, handler_version="v1")
            while not broker.drained(QUEUE):
                delivery: Delivery | None = broker.receive(QUEUE, timeout=0.05)
                if delivery is None:
                    continue
                nack = False
                try:
                    m = self.by_id[str(delivery.headers[Header.MESSAGE_ID])]
                    with self.lock:
                        crash = m.kind == "crash" and m.message_id not in self.crashed
                        self.crashed.add(m.message_id)
                    if crash and self.crash_before_commit(conn, m):
                        with self.lock:
                            self.stats["crashed before COMMIT"] += 1
                        broker.nack(delivery)  # never acked: the broker redelivers
                        continue
                    message = Message(
                        PRODUCER, m.message_id, m.message_type, m.payload, redelivered=delivery.redelivered
                    )
                    if m.message_type == SQL_TYPE:
                        result = inbox.apply(message)
                    else:
                        result = inbox.handle(message, self.python_handler)
                    with self.lock:
                        self.stats["deliveries"] += 1
                        self.stats["outcome:" + result.outcome.value] += 1
                        if delivery.redelivered:
                            self.stats["redeliveries"] += 1
                    nack = result.outcome is Outcome.FAILED  # redelivered
                except Exception as exc:
                    with self.lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                if nack:
                    broker.nack(delivery)
                else:
                    broker.ack(delivery)

    def consume(self, deliveries: list[tuple[OrderMessage, bool]]) -> None:
        """The stream through the in-memory broker (no visibility timeouts, no races: the redeliveries
        are the planned ones, the nacks and the crashes)."""
        broker = MemoryBroker(rng=random.Random(self.settings.seed), visibility_timeout=self.settings.deadline)
        for message, redelivered in deliveries:
            broker.publish(QUEUE, json.dumps(message.payload).encode(), message.headers(), redelivered=redelivered)
        broker.close(QUEUE)
        threads = [
            threading.Thread(target=self.worker, args=(broker,), name=f"pginbox-demo-consumer-{i}", daemon=True)
            for i in range(self.settings.workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # ------------------------------------------------------------------ dispatching
    def resolver(self) -> Callable[[str], Transport | None]:
        webhooks: dict[str, Transport] = {}
        for destination, path in SINK_PATHS.items():
            webhook = WebhookTransport(
                self.sink.url + path, timeout=self.settings.client_timeout, allow_hosts=["127.0.0.1"]
            )  # loopback: refused unless allowlisted
            self.webhooks.append(webhook)
            webhooks[destination] = CountingTransport(webhook, self.transport_stats, self.lock)

        def drop(effect: Effect) -> None:
            with self.lock:
                self.stats["leftovers drained"] += 1

        leftover = CallableTransport(drop)

        def resolve(destination: str) -> Transport | None:
            if destination in webhooks:
                return webhooks[destination]
            if destination.startswith(DEST_PREFIX):
                return leftover  # an earlier, interrupted demo run left it
            return None  # not the demo's: reported as retryable, left for a dispatcher that knows it

        return resolve

    def wait_delivered(self, ids: list[str], deadline: float) -> None:
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(PROGRESS, (ids,)).fetchone()
                assert row is not None
                if row["delivered"] + row["dead"] == row["total"]:
                    return
                time.sleep(0.05)
        with self.lock:
            self.errors.append(f"effects not delivered within {self.settings.deadline:g} s")

    def committed_ids(self) -> list[str]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute(OUTBOX_ROWS, (list(self.expected.values()),)).fetchall()
        return [str(r[0]) for r in rows]

    # ------------------------------------------------------------------ run
    def run(self) -> bool:
        s = self.settings
        started = time.monotonic()
        self.plan()
        self.by_id = {m.message_id: m for m in self.messages}
        n_sql = sum(m.message_type == SQL_TYPE for m in self.messages)
        kinds = Counter(m.kind for m in self.messages)
        self.say(
            f"\nAct 3: the outbox: handlers enqueue effects, a dispatcher delivers them to a flaky webhook "
            f"(seed {s.seed})"
        )
        self.say(
            f"   consumer '{self.consumer}' gets {s.messages} orders from '{PRODUCER}': {n_sql} '{SQL_TYPE}' "
            f"through a SQL handler (inbox.claim_and_apply),"
        )
        self.say(
            f"   {s.messages - n_sql} '{PY_TYPE}' through a Python handler (Inbox.handle); each enqueues its "
            "effects in its own transaction:"
        )
        self.say("   inbox.enqueue_effect(inbox.effect_id(consumer, producer, message_id, effect), destination, body)")
        self.say(
            f"   faults: {kinds['poison']} poison orders (the handler enqueues, then refuses), {kinds['flaky']} "
            f"refused once, {kinds['crash']} crash before COMMIT once; {s.redeliver_rate:.0%} redelivered, "
            f"{s.replay} replayed at the end"
        )
        self.setup()
        self.sink.start()
        self.say(
            f"   sink: an HTTP server at {self.sink.url} (loopback, allowlisted in the WebhookTransport), "
            f"deduplicating on Idempotency-Key;"
        )
        self.say(
            f"   it answers 503 to {s.unavailable_rate:.0%} of attempts, and holds {s.hold_rate:.0%} past the "
            f"{s.client_timeout:g} s timeout after processing them (ambiguous)"
        )
        dispatcher = Dispatcher(
            self.dsn,
            f"demo-{self.consumer}",
            self.resolver(),
            batch_size=20,
            concurrency_per_destination=8,
            lease=10.0,
            poll_interval=0.5,
        )
        runner = threading.Thread(target=dispatcher.run, name="pginbox-demo-dispatcher", daemon=True)
        try:
            runner.start()
            self.consume(self.deliveries())
            deadline = started + s.deadline
            self.wait_delivered(self.committed_ids(), deadline)
            # A broker replays old messages after their effects went out: duplicates, nothing enqueued.
            replay = self.rng.sample(self.messages, min(s.replay, len(self.messages)))
            self.consume([(m, True) for m in replay])
            self.wait_delivered(self.committed_ids(), deadline)
        finally:
            dispatcher.stop()
            runner.join(timeout=30)
            dispatcher.close()
            for webhook in self.webhooks:
                webhook.close()
            self.sink.stop()
            self.dispatcher_stats = dispatcher.stats.as_dict()
        self.elapsed = time.monotonic() - started
        facts = self.collect()
        self.summarize(facts)
        return self.prove(facts)

    # ------------------------------------------------------------------ report
    def collect(self) -> dict[str, Any]:
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as conn:
            return {
                "outbox": {r["effect_id"]: r for r in conn.execute(OUTBOX_ROWS, (list(self.expected.values()),))},
                "inbox": {r["message_id"]: r["status"] for r in conn.execute(INBOX_ROWS, (self.consumer, PRODUCER))},
                "domain": {r["message_id"]: r["n"] for r in conn.execute(DOMAIN_ROWS, (self.consumer,))},
                "failed_runs": {
                    r["message_id"]: r["failed"] for r in conn.execute(FAILED_RUNS, (self.consumer, PRODUCER))
                },
            }

    def rolled_back(self, facts: dict[str, Any]) -> tuple[int, int]:
        """(handler runs, effects) enqueued and then rolled back: failures the inbox recorded, and
        the crashes before COMMIT."""
        runs = self.stats["crashed before COMMIT"]
        effects = runs * len(EFFECTS[PY_TYPE])
        for message_id, failed in facts["failed_runs"].items():
            runs += failed
            effects += failed * len(EFFECTS[self.by_id[message_id].message_type])
        return runs, effects

    def summarize(self, facts: dict[str, Any]) -> None:
        st, ts = self.stats, self.transport_stats
        requests = self.sink.requests
        answers = Counter(r.answer for r in requests)
        attempts = sum(r["attempts"] for r in facts["outbox"].values())
        held = answers["held"]
        self.say(f"\n   What happened ({self.elapsed:.1f} s)")
        rows = [
            (
                "message deliveries",
                st["deliveries"],
                f"{st['redeliveries']} of them redeliveries (lost acks, nacks, "
                f"the replay), plus {st['crashed before COMMIT']} that crashed before COMMIT",
            ),
            ("applied", st["outcome:applied"], "domain change, claim and effects committed together"),
            ("duplicates absorbed", st["outcome:duplicate"], "redeliveries: the handler did not run, nothing enqueued"),
            (
                "effects rolled back",
                self.rolled_back(facts)[1],
                f"enqueued by {self.rolled_back(facts)[0]} handler runs that then failed or crashed before COMMIT",
            ),
            ("effects committed", len(facts["outbox"]), f"in inbox.outbox for {self.consumer}"),
            ("HTTP attempts", len(requests), f"{attempts} attempts recorded in inbox.outbox"),
            ("503 answers", answers["unavailable"], "retried after the destination's backoff"),
            (
                "ambiguous timeouts",
                ts["ambiguous"],
                f"the sink processed {held} requests and answered too late; retried with the same key",
            ),
            ("duplicates dropped by sink", answers["duplicate"], "same Idempotency-Key again: answered, not acted on"),
            (
                "dispatcher",
                self.dispatcher_stats.get("delivered", 0),
                f"delivered; {self.dispatcher_stats.get('retried', 0)} retried, {self.dispatcher_stats.get('dead', 0)} "
                f"dead, {self.dispatcher_stats.get('fenced', 0)} fenced reports",
            ),
        ]
        if st["leftovers drained"]:
            rows.append(("leftovers drained", st["leftovers drained"], "effects of an earlier, interrupted demo run"))
        for label, value, note in rows:
            self.say(f"   {label:<28} {value:>6}   {note}")

    def prove(self, facts: dict[str, Any]) -> bool:
        """Each check of the outbox promise, printed OK or FAILED; True when all hold."""
        outbox: dict[str, Row] = facts["outbox"]
        processed = {mid for mid, status in facts["inbox"].items() if status == "processed"}
        checks = [
            self._effects_of_processed_messages(facts, processed),
            self._rolled_back_left_nothing(facts, processed),
            self._every_effect_reached_the_sink(outbox),
            self._one_key_per_effect(),
            self._sink_counted_each_once(outbox),
            self._one_request_per_attempt(outbox),
            self._faults_happened(),
        ]
        self.say("\n   The outbox promise, proven from the sink's records and the database (inbox.outbox)")
        for ok, text in checks:
            self.say(f"   {'OK    ' if ok else 'FAILED'} {text}")
        holds = all(ok for ok, _ in checks)
        if holds:
            self.say(
                "   OUTBOX PROMISE HOLDS: every committed effect delivered at least once with one stable key, "
                "acted on once by a deduplicating destination; rolled-back work sent nothing."
            )
        else:
            self.say("   OUTBOX PROMISE BROKEN: see the FAILED lines above.")
        return holds

    def _effect_ids(self, message_ids: set[str], *, of_these: bool) -> set[str]:
        """The effect ids of the messages in `message_ids` (of_these), or of all the others."""
        return {
            self.expected[(m.message_id, name)]
            for m in self.messages
            if (m.message_id in message_ids) == of_these
            for name, _d in EFFECTS[m.message_type]
        }

    def _effects_of_processed_messages(self, facts: dict[str, Any], processed: set[str]) -> tuple[bool, str]:
        domain: dict[str, int] = facts["domain"]
        should = self._effect_ids(processed, of_these=True)
        committed = set(facts["outbox"])
        twice = sorted(mid for mid, n in domain.items() if n != 1)
        ok = committed == should and set(domain) == processed and not twice
        return ok, (
            f"each of the {len(processed)} processed messages has one domain row and its "
            f"{len(should)} effects, in inbox.outbox"
            if ok
            else f"effects missing: {sorted(should - committed)[:3]}; unexpected: "
            f"{sorted(committed - should)[:3]}; domain rows not once: {twice[:3]}"
        )

    def _rolled_back_left_nothing(self, facts: dict[str, Any], processed: set[str]) -> tuple[bool, str]:
        never = self._effect_ids(processed, of_these=False)
        leaked = sorted(never & set(facts["outbox"]))
        rolled_back = self.rolled_back(facts)[1]
        ok = not leaked and rolled_back > 0 and bool(never)
        return ok, (
            f"rolled-back handlers left no effect: {rolled_back} enqueued effects rolled back, "
            f"none of the {len(never)} effects of the {len(facts['inbox']) - len(processed)} quarantined "
            f"messages exists"
            if ok
            else f"effects of messages that never committed: {leaked[:3]} (rolled back: {rolled_back})"
        )

    def _every_effect_reached_the_sink(self, outbox: dict[str, Row]) -> tuple[bool, str]:
        committed = set(outbox)
        by_key: dict[str, list[SinkRequest]] = {}
        for r in self.sink.requests:
            if len(r.keys) == 1:
                by_key.setdefault(r.keys[0], []).append(r)
        processed_at_sink = {k for k, rs in by_key.items() if any(r.answer in ("ok", "held") for r in rs)}
        undelivered = sorted(k for k in committed if outbox[k]["status"] != "delivered")
        missing = sorted(k for k in committed if self.expected_key.get(k) not in processed_at_sink)
        ok = not undelivered and not missing
        stuck = [(k, outbox[k]["status"], outbox[k]["last_error"]) for k in undelivered[:3]]
        return ok, (
            f"every committed effect reached the sink: {len(committed)} of {len(committed)}, "
            f"all 'delivered' in inbox.outbox"
            if ok
            else f"not delivered: {stuck}; never processed by the sink: {missing[:3]}"
        )

    def _one_key_per_effect(self) -> tuple[bool, str]:
        requests = self.sink.requests
        bad_keys = [r for r in requests if len(r.keys) != 1]
        mismatched = []
        keys_per_effect: dict[tuple[str, str], set[str]] = {}
        for r in requests:
            body = r.body if isinstance(r.body, dict) else {}
            identity = (str(body.get("message_id")), str(body.get("effect")))
            keys_per_effect.setdefault(identity, set()).update(r.keys)
            expected_key = self.expected_key.get(self.expected.get(identity, ""))
            if body.get("consumer") != self.consumer or len(r.keys) != 1 or expected_key != r.keys[0]:
                mismatched.append(r)
        multi = [ident for ident, keys in keys_per_effect.items() if len(keys) != 1]
        ok = not bad_keys and not mismatched and not multi and bool(requests)
        return ok, (
            f"each of the {len(requests)} requests carried exactly one Idempotency-Key, the consumer's key "
            "for the effect id of the message and effect in its body: one key per effect on every attempt"
            if ok
            else f"requests without exactly one key: {len(bad_keys)}; key not the body's effect's: "
            f"{len(mismatched)}; effects seen with several keys: {multi[:3]}"
        )

    def _sink_counted_each_once(self, outbox: dict[str, Row]) -> tuple[bool, str]:
        committed = set(outbox)
        counts = {k: self.sink.counted[self.expected_key[k]] for k in committed}
        not_once = sorted((k, n) for k, n in counts.items() if n != 1)
        dropped = sum(r.answer == "duplicate" for r in self.sink.requests)
        ok = not not_once and sum(counts.values()) == len(committed)
        return ok, (
            f"the sink, deduplicating on the key, counted each effect exactly once: {len(committed)} "
            f"effects, {dropped} duplicates dropped"
            if ok
            else f"the sink counted {len(not_once)} effects other than once, e.g. "
            + ", ".join(f"{k[:15]}... x{n}" for k, n in not_once[:3])
        )

    def _one_request_per_attempt(self, outbox: dict[str, Row]) -> tuple[bool, str]:
        attempts = sum(int(r["attempts"]) for r in outbox.values())
        requests = len(self.sink.requests)
        ok = attempts == requests
        return ok, (
            f"each of the {attempts} attempts in inbox.outbox is one request at the sink"
            if ok
            else f"{attempts} attempts in inbox.outbox, {requests} requests at the sink"
        )

    def _faults_happened(self) -> tuple[bool, str]:
        answers = Counter(r.answer for r in self.sink.requests)
        exercised = {
            "ambiguous timeouts": self.transport_stats["ambiguous"],
            "503 answers": answers["unavailable"],
            "redeliveries absorbed": self.stats["outcome:duplicate"],
        }
        ok = all(exercised.values()) and not self.errors
        return ok, (
            "the faults happened: " + ", ".join(f"{n} {label}" for label, n in exercised.items())
            if ok
            else "not exercised or errors: "
            + ", ".join(f"{label} {n}" for label, n in exercised.items())
            + f"; errors: {self.errors[:3]}"
        )


def run(
    dsn: str, *, seed: int | None = None, messages: int = 200, sink_dedup: bool = True, out: TextIO | None = None
) -> bool:
    """Run act 3 against `dsn` (schema inbox deployed); True when every check holds."""
    if seed is None:
        seed = random.SystemRandom().randrange(1, 10**6)
    settings = OutboxSettings(messages=messages, seed=seed, dedup=sink_dedup)
    return OutboxAct(dsn, settings, out).run()
