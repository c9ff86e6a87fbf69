"""`pginbox demo --act 3`: the outbox act, run as a real subprocess against a test database (a real
dispatcher, a real HTTP sink on loopback), its verdict checked against the database; and the
proof catching a destination that counts twice, a leaked effect and a wrong key."""

from __future__ import annotations

import io
import json
import re
import subprocess

import psycopg
from test_demo import counted, run_demo

from pginbox.demo import act3_outbox as demo_outbox
from pginbox.demo.sink import SinkRequest

PROOF_LINES = (
    "processed messages has one domain row and its",
    "rolled-back handlers left no effect",
    "every committed effect reached the sink",
    "carried exactly one Idempotency-Key, the consumer's key for the effect id of the message and effect in its body",
    "the sink, deduplicating on the key, counted each effect exactly once",
    "attempts in inbox.outbox is one request at the sink",
    "the faults happened",
    "OUTBOX PROMISE HOLDS",
)


def act3(db_dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_demo("--act", "3", "--seed", "11", "--outbox-messages", "80", "--dsn", db_dsn, *args)


def test_act3_proves_the_outbox_promise(db_dsn: str) -> None:
    result = act3(db_dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Act 3:" in out and "Act 1:" not in out and "Act 2:" not in out
    for line in PROOF_LINES:
        assert line in out, f"{line!r} missing from:\n{out}"
    assert "FAILED" not in out
    committed = counted(out, "effects committed")
    assert counted(out, "ambiguous timeouts") >= 1
    assert counted(out, "503 answers") >= 1
    assert counted(out, "duplicates dropped by sink") >= 1
    assert counted(out, "duplicates absorbed") >= 1
    assert counted(out, "effects rolled back") >= 1

    # The database agrees: every effect of the run delivered, after more attempts than effects
    # (the retries), one domain row per applied message, no effect for a quarantined message.
    consumer = re.search(r"consumer '(shipping-[0-9a-f]+)'", out)
    assert consumer
    with psycopg.connect(db_dsn) as conn:
        events = conn.execute(
            "SELECT count(*), count(DISTINCT message_id) FROM pginbox_outbox_demo.order_event WHERE consumer = %s",
            (consumer.group(1),),
        ).fetchone()
        applied = conn.execute(
            "SELECT count(*) FROM inbox.message WHERE consumer = %s AND status = 'processed'", (consumer.group(1),)
        ).fetchone()
        outbox = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'delivered'), sum(attempts) FROM inbox.outbox"
            " WHERE payload->>'consumer' = %s",
            (consumer.group(1),),
        ).fetchone()
        leaked = conn.execute(
            "SELECT count(*) FROM inbox.outbox o JOIN inbox.message m ON m.consumer = o.payload->>'consumer'"
            " AND m.message_id = o.payload->>'message_id' WHERE m.consumer = %s AND m.status <> 'processed'",
            (consumer.group(1),),
        ).fetchone()
    assert applied is not None and events == (applied[0], applied[0])
    assert outbox is not None and outbox[0] == outbox[1] == committed
    assert outbox[2] > committed
    assert leaked == (0,)


def test_act3_fails_when_the_sink_counts_twice(db_dsn: str) -> None:
    """A destination that does not deduplicate on Idempotency-Key books an effect again when the
    dispatcher retries after an ambiguous timeout: the proof must say so, and exit 1."""
    result = act3(db_dsn, "--sink-no-dedup")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"FAILED the sink counted \d+ effects other than once, e\.g\. fx_[0-9a-f]+\.\.\. x[2-9]", out), out
    assert "OUTBOX PROMISE BROKEN" in out
    assert "OUTBOX PROMISE HOLDS" not in out
    assert "outbox promise is broken" in result.stderr
    assert "Traceback" not in result.stderr
    # Everything else still holds: the failure is the destination's double count alone.
    assert len(re.findall(r"^\s+FAILED ", out, re.MULTILINE)) == 1, out


def test_act3_refuses_a_database_with_foreign_effects(db_dsn: str) -> None:
    """Its dispatcher would claim other destinations' effects: act 3 refuses before anything runs."""
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SELECT inbox.enqueue_effect('fx-foreign-1', 'billing', '{}')")
    result = act3(db_dsn)
    assert result.returncode == 1
    assert "undelivered effects of other destinations that it would claim: billing (1)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute(
            "SELECT status::text, attempts FROM inbox.outbox WHERE effect_id = 'fx-foreign-1'"
        ).fetchone()
        schema = conn.execute("SELECT to_regnamespace('pginbox_outbox_demo') IS NULL").fetchone()
    assert row == ("pending", 0)
    assert schema == (True,)


def test_the_proof_catches_a_leaked_effect_and_a_wrong_key(db_dsn: str) -> None:
    out = io.StringIO()
    act = demo_outbox.OutboxAct(db_dsn, demo_outbox.OutboxSettings(messages=40, seed=5), out)
    assert act.run() is True, out.getvalue()

    # An effect of a message whose handler never committed appears in the outbox ...
    poison = next(m for m in act.messages if m.kind == "poison")
    name, destination = demo_outbox.EFFECTS[poison.message_type][0]
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT inbox.enqueue_effect(%s, %s, %s::jsonb)",
            (act.expected[(poison.message_id, name)], destination, json.dumps({"leaked": True})),
        )
    # ... and the sink got one attempt of an effect under another key.
    first = act.sink.requests[0]
    act.sink.requests.append(SinkRequest(first.path, ("fx_other",), first.body, "duplicate"))

    out.seek(0)
    out.truncate()
    assert act.prove(act.collect()) is False
    text = out.getvalue()
    assert "FAILED effects of messages that never committed: ['fx_" in text
    assert "FAILED effects missing: []; unexpected: ['fx_" in text
    assert re.search(
        r"FAILED requests without exactly one key: 0; key not the body's effect's: 1; "
        r"effects seen with several keys: \[\('o-\d+', '[a-z.]+'\)\]",
        text,
    ), text
    attempts = re.search(r"FAILED (\d+) attempts in inbox.outbox, (\d+) requests at the sink", text)
    assert attempts and int(attempts.group(2)) == int(attempts.group(1)) + 1, text
    assert "OUTBOX PROMISE BROKEN" in text
