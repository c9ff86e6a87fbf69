"""`pginbox outbox list | show | redrive | discard` against a real database (click's CliRunner):
whole effect ids with their consumer (effect ids are unique per consumer), `show` by a unique
prefix, `--consumer` where one id is held by several consumers, and a reader's listing without
error texts."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

from pginbox.cli import main

Conn = psycopg.Connection[tuple[Any, ...]]

# Longer than the 40 characters the list used to cut ids to; held by consumers a and b.
LONG_ID = "order-2026-12-03-customer-000123456-confirmation-email-v2"
ERROR_TEXT = "smtp said: mailbox of jane@example.com full"


def cli(*args: str, dsn: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, ["--dsn", dsn, *args], env=env, catch_exceptions=True)


def fails(result: Result, *fragments: str) -> str:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # One 'Error:' line, then what the database added (indented: DETAIL, HINT, SQLSTATE, needs).
    assert lines[0].startswith("Error: ") and all(line.startswith("  ") for line in lines[1:]), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def status(conn: Conn, effect_id: str, consumer: str) -> str:
    row = conn.execute(
        "SELECT status::text FROM inbox.outbox WHERE effect_id = %s AND consumer = %s", (effect_id, consumer)
    ).fetchone()
    assert row is not None
    return str(row[0])


@dataclass
class Effects:
    dsn: str
    conn: Conn


@pytest.fixture
def effects(db_dsn: str, conn: Conn) -> Effects:
    """LONG_ID of consumers a and b, both dead (refused with ERROR_TEXT), and refund-7 of a, pending."""
    conn.execute("SELECT inbox.bind_destination('mail', 'a', 'test'), inbox.bind_destination('mail', 'b', 'test')")
    for effect_id, consumer in ((LONG_ID, "a"), (LONG_ID, "b"), ("refund-7", "a")):
        conn.execute("SELECT inbox.enqueue_effect(%s, 'mail', '{}'::jsonb, consumer => %s)", (effect_id, consumer))
    claimed = conn.execute(
        "SELECT effect_id, lease_token FROM inbox.claim_effects('t', 2, key_aware => true)"
    ).fetchall()
    assert sorted(r[0] for r in claimed) == [LONG_ID, LONG_ID]
    for effect_id, token in claimed:
        assert conn.execute(
            "SELECT inbox.fail_effect(%s, %s, %s, false)", (effect_id, token, ERROR_TEXT)
        ).fetchone() == ("dead",)
    return Effects(db_dsn, conn)


def test_list_prints_whole_ids_and_their_consumer(effects: Effects) -> None:
    result = cli("outbox", "list", dsn=effects.dsn)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["effect_id", "consumer", "destination"]
    assert lines[-1] == "3 of 3 shown (newest first)"
    rows = sorted(tuple(line.split()[:4]) for line in lines[2:-1])
    assert rows == [
        (LONG_ID, "a", "mail", "dead"),
        (LONG_ID, "b", "mail", "dead"),
        ("refund-7", "a", "mail", "pending"),
    ]
    assert f"permanent_failure: {ERROR_TEXT}" in result.stdout

    only_b = cli("outbox", "list", "--json", dsn=effects.dsn, env={"PGINBOX_OUTBOX_LIST_CONSUMER": "b"})
    assert only_b.exit_code == 0, only_b.output
    listed = json.loads(only_b.stdout)["effects"]
    assert [(e["effect_id"], e["consumer"], e["last_error"]) for e in listed] == [(LONG_ID, "b", ERROR_TEXT)]


def test_every_listed_id_can_be_shown(effects: Effects) -> None:
    """What list prints, show finds: the id as listed, with the listed consumer."""
    listing = cli("outbox", "list", dsn=effects.dsn)
    for line in listing.stdout.splitlines()[2:-1]:
        effect_id, consumer = line.split()[:2]
        shown = cli("outbox", "show", effect_id, "--consumer", consumer, "--json", dsn=effects.dsn)
        assert shown.exit_code == 0, shown.output
        details = json.loads(shown.stdout)
        assert (details["effect_id"], details["consumer"]) == (effect_id, consumer)


def test_show_accepts_a_unique_prefix(effects: Effects) -> None:
    shown = cli("outbox", "show", "refund", dsn=effects.dsn)
    assert shown.exit_code == 0, shown.output
    assert "effect_id: refund-7\nconsumer: a\n" in shown.stdout
    # one prefix, two consumers: which one is for the operator to say
    line = fails(cli("outbox", "show", "order-2026-12-03", dsn=effects.dsn), "begins several effect ids", "--consumer")
    assert "'a'" in line and "'b'" in line
    shown = cli("outbox", "show", "order-2026-12-03", "--consumer", "b", "--json", dsn=effects.dsn)
    assert shown.exit_code == 0, shown.output
    assert (json.loads(shown.stdout)["effect_id"], json.loads(shown.stdout)["consumer"]) == (LONG_ID, "b")
    # the whole id held by two consumers
    fails(cli("outbox", "show", LONG_ID, dsn=effects.dsn), "held by several consumers", "pass --consumer")
    # a prefix begins ids only: LIKE wildcards are plain characters
    fails(cli("outbox", "show", "%", dsn=effects.dsn), "no effect '%'")
    fails(cli("outbox", "show", "refund_", dsn=effects.dsn), "no effect 'refund_'")
    fails(cli("outbox", "show", "refund-7", "--consumer", "b", dsn=effects.dsn), "of consumer 'b'")


def test_redrive_and_discard_take_the_consumer(effects: Effects) -> None:
    conn = effects.conn
    fails(cli("outbox", "redrive", LONG_ID, "--note", "mailbox emptied", dsn=effects.dsn), "P0003")
    assert status(conn, LONG_ID, "a") == status(conn, LONG_ID, "b") == "dead"  # nothing written

    redriven = cli("outbox", "redrive", LONG_ID, "--consumer", "a", "--note", "mailbox emptied", dsn=effects.dsn)
    assert redriven.exit_code == 0, redriven.output
    assert f"effect {LONG_ID} of consumer a: pending" in redriven.stdout
    assert (status(conn, LONG_ID, "a"), status(conn, LONG_ID, "b")) == ("pending", "dead")

    discarded = cli(
        "outbox",
        "discard",
        LONG_ID,
        "--note",
        "customer left",
        dsn=effects.dsn,
        env={"PGINBOX_OUTBOX_DISCARD_CONSUMER": "b"},
    )
    assert discarded.exit_code == 0, discarded.output
    assert f"effect {LONG_ID} of consumer b: discarded" in discarded.stdout
    assert (status(conn, LONG_ID, "a"), status(conn, LONG_ID, "b")) == ("pending", "discarded")
    audit = conn.execute(
        "SELECT consumer, note FROM inbox.outbox_redrive UNION ALL "
        "SELECT consumer, note FROM inbox.outbox_discard ORDER BY 1"
    ).fetchall()
    assert audit == [("a", "mailbox emptied"), ("b", "customer left")]


def test_a_reader_lists_and_shows_without_error_texts(effects: Effects, login_role: Callable[..., str]) -> None:
    reader = login_role("inbox_reader")
    listing = cli("outbox", "list", dsn=reader)
    assert listing.exit_code == 0, listing.output
    assert listing.stdout.count("permanent_failure") == 2
    assert "smtp" not in listing.stdout
    as_json = cli("outbox", "list", "--json", dsn=reader)
    assert as_json.exit_code == 0, as_json.output
    assert {e["last_error"] for e in json.loads(as_json.stdout)["effects"]} == {None}
    shown = cli("outbox", "show", LONG_ID, "--consumer", "a", dsn=reader)
    assert shown.exit_code == 0, shown.output
    assert "dead_reason: permanent_failure" in shown.stdout and "smtp" not in shown.stdout
    # A reader may see what a bulk redrive would take, not take it.
    dry = cli("outbox", "redrive", "--all", "--dry-run", "--note", "x", dsn=reader)
    assert dry.exit_code == 0 and "2 dead effects would be redriven" in dry.stdout, dry.output
    refused = cli("outbox", "redrive", "--all", "--note", "x", dsn=reader)
    assert refused.exit_code == 1 and "GRANT inbox_operator TO" in refused.stderr, refused.output


def test_list_is_newest_first_and_says_how_many_it_shows(effects: Effects) -> None:
    conn = effects.conn
    for n in range(5):
        conn.execute("SELECT inbox.enqueue_effect(%s, 'mail', '{}'::jsonb, consumer => 'a')", (f"late-{n}",))
        conn.execute(
            "UPDATE inbox.outbox SET created_at = now() + make_interval(mins => %s) WHERE effect_id = %s",
            (n + 1, f"late-{n}"),
        )
    limited = cli("outbox", "list", "--limit", "2", dsn=effects.dsn)
    assert limited.exit_code == 0, limited.output
    lines = limited.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:-1]] == ["late-4", "late-3"]
    assert lines[-1] == "2 of 8 shown (newest first; --limit 8 or filters for the rest)"
    as_json = json.loads(cli("outbox", "list", "--limit", "2", "--json", dsn=effects.dsn).stdout)
    assert (as_json["shown"], as_json["total"]) == (2, 8)
    dead = cli("outbox", "list", "--status", "dead", "--destination", "mail", dsn=effects.dsn)
    assert dead.stdout.splitlines()[-1] == "2 of 2 shown (newest first)"
    nowhere = cli("outbox", "list", "--destination", "sms", dsn=effects.dsn)
    assert nowhere.stdout.strip() == "no effects to destination 'sms'"


def test_bulk_redrive_by_destination_consumer_reason_and_time(effects: Effects) -> None:
    """Recovery in one command (issue 26): every dead effect matching the filters is redriven, each
    audited like a single redrive; --dry-run changes nothing; no filter at all is refused."""
    conn = effects.conn
    conn.execute("SELECT inbox.bind_destination('sms', 'a', 'test')")
    conn.execute("SELECT inbox.enqueue_effect('text-1', 'sms', '{}'::jsonb, consumer => 'a')")
    conn.execute(
        "UPDATE inbox.outbox SET status = 'dead', dead_reason = 'max_attempts', attempts = 8, "
        "created_at = now() - interval '2 hours' WHERE effect_id = 'text-1'"
    )
    refused = cli("outbox", "redrive", "--note", "x", dsn=effects.dsn)
    assert refused.exit_code == 2 and "pass an effect ID, or filters" in refused.output, refused.output

    dry = cli("outbox", "redrive", "--destination", "mail", "--note", "smtp back", "--dry-run", dsn=effects.dsn)
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.splitlines()[-1] == "2 dead effects would be redriven (--dry-run: nothing changed)"
    assert (status(conn, LONG_ID, "a"), status(conn, LONG_ID, "b")) == ("dead", "dead")

    old = cli("outbox", "redrive", "--until", "now() - interval '1 hour'", "--note", "x", dsn=effects.dsn)
    assert old.exit_code == 1, "--until takes a timestamp, not an expression"
    cutoff = conn.execute("SELECT (now() - interval '1 hour')::text").fetchone()
    assert cutoff is not None
    by_time = cli(
        "outbox",
        "redrive",
        "--until",
        cutoff[0],
        "--dead-reason",
        "max_attempts",
        "--note",
        "sms gateway fixed",
        "--json",
        dsn=effects.dsn,
    )
    assert by_time.exit_code == 0, by_time.output
    done = json.loads(by_time.stdout)
    assert (done["selected"], done["redriven"], done["skipped"]) == (1, 1, 0)
    assert [(e["effect_id"], e["status"], e["attempts"]) for e in done["effects"]] == [("text-1", "pending", 0)]

    one = cli("outbox", "redrive", "--destination", "mail", "--consumer", "a", "--note", "smtp back", dsn=effects.dsn)
    assert one.exit_code == 0, one.output
    assert one.stdout.strip() == "redrove 1 of 1 dead effects; each is audited in inbox.outbox_redrive"
    assert (status(conn, LONG_ID, "a"), status(conn, LONG_ID, "b")) == ("pending", "dead")
    rest = cli("outbox", "redrive", "--all", "--note", "the rest", "--progress", dsn=effects.dsn)
    assert rest.exit_code == 0, rest.output
    assert "redrove 1 of 1 dead effects" in rest.stdout and "redriven 1 of 1 (0 skipped)" in rest.stderr
    audit = conn.execute(
        "SELECT effect_id, consumer, note, attempts, dead_reason FROM inbox.outbox_redrive ORDER BY redrive_id"
    ).fetchall()
    assert audit == [
        ("text-1", "a", "sms gateway fixed", 8, "max_attempts"),
        (LONG_ID, "a", "smtp back", 1, "permanent_failure"),
        (LONG_ID, "b", "the rest", 1, "permanent_failure"),
    ]
    nothing = cli("outbox", "redrive", "--all", "--note", "again", dsn=effects.dsn)
    assert nothing.stdout.strip() == "redrove 0 of 0 dead effects; each is audited in inbox.outbox_redrive"
    mixed = cli("outbox", "redrive", LONG_ID, "--destination", "mail", "--note", "x", dsn=effects.dsn)
    assert mixed.exit_code == 2 and "only --consumer narrows it" in mixed.output
