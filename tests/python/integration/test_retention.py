"""Retention against real PostgreSQL: the purge, its watermark and the outcome `expired`.

Time passes by writing timestamps directly (as the postgres superuser): inbox.message.processed_at,
inbox.consumer_config.last_active_at and inbox.activity_gap. Every test asserts the invariant:
at most one committed domain transition per identity (the ledger has at most one row per id).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from helpers_inbox import hand_to_service
from helpers_terminal import run_on_a_terminal
from psycopg.conninfo import conninfo_to_dict

from pginbox.cli import main
from pginbox.ops import retention

CONSUMER = "billing"
PRODUCER = "shop"

SETUP = """
CREATE TABLE ledger (message_id text NOT NULL, amount integer NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE sql
    BEGIN ATOMIC
        INSERT INTO ledger (message_id, amount) VALUES (payload ->> 'id', (payload ->> 'amount')::integer);
    END;
GRANT INSERT ON ledger TO PUBLIC;
SELECT inbox.register_handler('billing', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
SELECT inbox.set_retention_policy('billing', '', broker_retention => '7 days', max_offset_rewind => '3 days',
    dead_letter_redrive_horizon => '14 days', producer_retry_horizon => '1 day', outage_allowance => '2 days',
    backup_restore_window => '1 day', planned_replay_horizon => '0', safety_margin => '1 hour',
    note => 'test policy: window 17 days 1 hour');
"""

APPLY = """
SELECT outcome FROM inbox.claim_and_apply(%(consumer)s, %(producer)s, %(id)s, 'credit',
                                          jsonb_build_object('id', %(id)s::text, 'amount', 1), '',
                                          %(produced_at)s::timestamptz)
"""


def _cli_script() -> list[str]:
    script = Path(sys.executable).parent / "pginbox"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pginbox"]


@pytest.fixture
def db(conn: psycopg.Connection[Any], login_role: Callable[..., str]) -> psycopg.Connection[Any]:
    conn.execute(SETUP)
    # billing's service owns the handler: an operator's repair runs it with that role's rights.
    service = str(conninfo_to_dict(login_role("inbox_consumer"))["user"])
    hand_to_service(conn, service, CONSUMER, functions=("credit(jsonb)",), tables=("ledger",))
    return conn


def apply(conn: psycopg.Connection[Any], message_id: str, produced_days_ago: float | None = 0.0) -> str:
    produced = None if produced_days_ago is None else f"now() - interval '{produced_days_ago} days'"
    params = {"consumer": CONSUMER, "producer": PRODUCER, "id": message_id, "produced_at": None}
    if produced is not None:
        params["produced_at"] = conn.execute(f"SELECT {produced}").fetchone()[0]  # type: ignore[index]
    row = conn.execute(APPLY, params).fetchone()
    assert row is not None
    return str(row[0])


def age(conn: psycopg.Connection[Any], days: float, *, active_days: float = 60.0) -> None:
    """Every message of CONSUMER was produced and processed `days` ago; the consumer has been
    active (claiming, no gap) for the last `active_days` days."""
    conn.execute(
        "UPDATE inbox.message SET processed_at = now() - make_interval(secs => %s * 86400),"
        " produced_at = now() - make_interval(secs => %s * 86400) WHERE consumer = %s",
        (days, days, CONSUMER),
    )
    conn.execute("DELETE FROM inbox.activity_gap WHERE consumer = %s", (CONSUMER,))
    conn.execute(
        "INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to)"
        " VALUES (%s, '-infinity', now() - make_interval(secs => %s * 86400))",
        (CONSUMER, active_days),
    )
    conn.execute("UPDATE inbox.consumer_config SET last_active_at = now() WHERE consumer = %s", (CONSUMER,))


def ledger(conn: psycopg.Connection[Any]) -> dict[str, int]:
    return {r[0]: r[1] for r in conn.execute("SELECT message_id, count(*) FROM ledger GROUP BY 1").fetchall()}


def assert_at_most_once(conn: psycopg.Connection[Any]) -> None:
    twice = {k: v for k, v in ledger(conn).items() if v > 1}
    assert not twice, f"applied more than once: {twice}"


def purge_sql(dsn: str, batch_size: int = 5000) -> retention.PurgeReport:
    with psycopg.connect(dsn, autocommit=True) as c:
        return retention.purge_consumer(c, CONSUMER, batch_size=batch_size, wait_timeout=20)


def produced_at_of(conn: psycopg.Connection[Any], message_id: str) -> Any:
    return conn.execute(
        "SELECT produced_at FROM inbox.message WHERE consumer = %s AND message_id = %s", (CONSUMER, message_id)
    ).fetchone()[0]  # type: ignore[index]


# ---------------------------------------------------------------------------- the article's case
def test_inbox_retention_expires_before_a_simulated_redrive(db: psycopg.Connection[Any], db_dsn: str) -> None:
    """Process, purge, redeliver the same message: `expired`, applied once."""
    assert apply(db, "order-1", 0) == "applied"
    assert apply(db, "order-1", 0) == "duplicate"
    age(db, 30)
    produced = produced_at_of(db, "order-1")
    report = purge_sql(db_dsn)
    assert (report.status, report.rows_deleted) == ("purged", 1)
    assert db.execute("SELECT count(*) FROM inbox.message").fetchone() == (0,)

    # The redrive: same identity, same payload, its original produced_at.
    for _ in range(2):
        row = db.execute(
            APPLY, {"consumer": CONSUMER, "producer": PRODUCER, "id": "order-1", "produced_at": produced}
        ).fetchone()
        assert row == ("expired",)
    assert ledger(db) == {"order-1": 1}
    entry = db.execute(
        "SELECT kind, status, reason_code, deliveries, message_type, payload IS NOT NULL FROM inbox.quarantine"
    ).fetchall()
    assert entry == [("expired", "open", "expired", 2, "credit", True)]
    assert db.execute("SELECT status::text FROM inbox.message").fetchall() == [("quarantined",)], (
        "the claim row became the entry's hold"
    )
    status = retention.retention_status(db, CONSUMER)[0]
    assert status["expired_total"] == 2 and status["rows_purged"] == 1 and status["watermark"] > produced
    # The hold catches every later delivery, even one without a produced_at to check (0.2.0).
    assert apply(db, "order-1", None) == "expired"
    assert ledger(db) == {"order-1": 1}
    # A message that never had a hold and comes without produced_at is unprotected (applied).
    assert apply(db, "order-2", None) == "applied"


def test_python_library_reports_expired(db: psycopg.Connection[Any], db_dsn: str) -> None:
    from pginbox import Inbox, Message, Outcome

    assert apply(db, "lib-1", 0) == "applied"
    age(db, 30)
    produced = produced_at_of(db, "lib-1")
    assert purge_sql(db_dsn).rows_deleted == 1
    calls: list[str] = []
    with psycopg.connect(db_dsn) as c:
        inbox = Inbox(c, consumer=CONSUMER, handler_version="v1")
        message = Message(PRODUCER, "lib-1", "credit", {"id": "lib-1", "amount": 1}, produced_at=produced)
        applied = inbox.apply(message)
        handled = inbox.handle(message, lambda cur, msg: calls.append(msg.message_id))
        batch = inbox.apply_batch([message])
    assert applied.outcome is Outcome.EXPIRED and applied.ack and applied.quarantine_id is not None
    assert handled.outcome is Outcome.EXPIRED and calls == []
    assert [r.outcome for r in batch] == [Outcome.EXPIRED]
    assert ledger(db) == {"lib-1": 1}


def test_status_counts_expired_entries(db: psycopg.Connection[Any], db_dsn: str) -> None:
    """`pginbox status` counts open entries of kind expired per consumer, next to conflicts and
    failures (their sum is the open count)."""
    assert apply(db, "st-1", 0) == "applied"
    age(db, 30)
    produced = produced_at_of(db, "st-1")
    assert purge_sql(db_dsn).rows_deleted == 1
    assert db.execute(
        APPLY, {"consumer": CONSUMER, "producer": PRODUCER, "id": "st-1", "produced_at": produced}
    ).fetchone() == ("expired",)
    result = CliRunner().invoke(main, ["status", "--json", "--dsn", db_dsn])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["quarantine"]["open"] == {"conflict": 0, "failure": 0, "expired": 1}
    assert [
        (c["consumer"], c["open"], c["conflicts"], c["failures"], c["expired"]) for c in status["open_by_consumer"]
    ] == [(CONSUMER, 1, 0, 0, 1)]
    text = CliRunner().invoke(main, ["status", "--dsn", db_dsn]).stdout
    assert "  open         1  (conflict 0, failure 0, expired 1)" in text
    header, _, row = text.split("open quarantine entries: 1\n", 1)[1].splitlines()[:3]
    assert header.split() == ["consumer", "open", "conflicts", "failures", "expired", "oldest"]
    assert row.split()[:5] == [CONSUMER, "1", "0", "0", "1"]


def test_operator_decisions_on_an_expired_entry(db: psycopg.Connection[Any], db_dsn: str) -> None:
    assert apply(db, "old-1", 0) == "applied"
    assert apply(db, "old-2", 0) == "applied"
    age(db, 30)
    produced = produced_at_of(db, "old-1")  # a redelivery carries the producer's time again
    assert purge_sql(db_dsn).rows_deleted == 2
    # A genuinely new message produced as long ago (not after anything purged) looks just the same:
    # expired too.
    results: dict[str, Any] = {}
    for mid in ("old-1", "old-2", "never-seen", "never-seen-2"):
        results[mid] = db.execute(
            "SELECT outcome, quarantine_id FROM inbox.claim_and_apply(%s, %s, %s, 'credit',"
            " jsonb_build_object('id', %s::text, 'amount', 1), '', %s)",
            (CONSUMER, PRODUCER, mid, mid, produced),
        ).fetchone()
    assert {k: v[0] for k, v in results.items()} == dict.fromkeys(results, "expired")

    # discard: closed without effect; the identity is discarded, so redeliveries are duplicates
    # (0.2.0, as for an exhausted entry).
    db.execute("SELECT inbox.discard(%s, 'already applied before the purge')", (results["old-1"][1],))
    again = db.execute(
        "SELECT outcome, quarantine_id FROM inbox.claim_and_apply(%s, %s, 'old-1', 'credit',"
        " jsonb_build_object('id', 'old-1', 'amount', 1), '', %s)",
        (CONSUMER, PRODUCER, produced),
    ).fetchone()
    assert again == ("duplicate", None)
    assert db.execute(
        "SELECT status, deliveries FROM inbox.quarantine WHERE quarantine_id = %s", (results["old-1"][1],)
    ).fetchone() == ("discarded", 1)

    # release: the operator says it is new; its next delivery is processed normally, once.
    db.execute("SELECT inbox.release(%s, 'new message, producer clock was wrong')", (results["never-seen"][1],))
    for expected in ("applied", "duplicate"):
        assert db.execute(
            "SELECT outcome FROM inbox.claim_and_apply(%s, %s, 'never-seen', 'credit',"
            " jsonb_build_object('id', 'never-seen', 'amount', 1), '', %s)",
            (CONSUMER, PRODUCER, produced),
        ).fetchone() == (expected,)

    # repair: the operator vouches it is new; it is claimed and applied now, and stays once.
    assert db.execute(
        "SELECT outcome FROM inbox.repair(%s, 'new after all')", (results["never-seen-2"][1],)
    ).fetchone() == ("applied",)
    assert db.execute(
        "SELECT outcome FROM inbox.claim_and_apply(%s, %s, 'never-seen-2', 'credit',"
        " jsonb_build_object('id', 'never-seen-2', 'amount', 1), '', %s)",
        (CONSUMER, PRODUCER, produced),
    ).fetchone() == ("duplicate",)
    # old-2 stays held: nothing applied it a second time.
    assert db.execute(
        "SELECT status FROM inbox.quarantine WHERE quarantine_id = %s", (results["old-2"][1],)
    ).fetchone() == ("open",)
    assert ledger(db) == {"old-1": 1, "old-2": 1, "never-seen": 1, "never-seen-2": 1}


# ---------------------------------------------------------------------------- what the purge keeps
def test_holds_quarantine_and_pending_outbox_survive(db: psycopg.Connection[Any], db_dsn: str) -> None:
    for i in range(6):
        assert apply(db, f"m{i}", 0) == "applied"
    age(db, 30)
    db.execute(
        "INSERT INTO inbox.retention_hold (consumer, tenant, producer, message_id, holder)"
        " VALUES (%s, '', %s, 'm0', 'replay:7')",
        (CONSUMER, PRODUCER),
    )
    # m1: an identity conflict is open on it (the row itself is processed).
    assert db.execute(
        "SELECT outcome FROM inbox.claim(%s, %s, 'm1', '{\"other\": 1}')", (CONSUMER, PRODUCER)
    ).fetchone() == ("conflict",)
    # m2: held by quarantine (failures) — status 'quarantined'.
    db.execute("UPDATE inbox.message SET status = 'quarantined' WHERE message_id = 'm2'")
    # m3: discarded identity.
    db.execute("UPDATE inbox.message SET status = 'discarded' WHERE message_id = 'm3'")
    # m4: processed after the oldest outbox effect not delivered yet was created.
    db.execute("UPDATE inbox.message SET processed_at = now() - interval '25 days' WHERE message_id = 'm4'")
    db.execute("SELECT inbox.enqueue_effect('e-1', 'webhook', '{}')")
    db.execute("UPDATE inbox.outbox SET created_at = now() - interval '26 days'")
    report = purge_sql(db_dsn)
    assert report.rows_deleted == 1
    left = {r[0] for r in db.execute("SELECT message_id FROM inbox.message").fetchall()}
    assert left == {"m0", "m1", "m2", "m3", "m4"}
    # Once the effect is delivered, m4 goes too (the others stay).
    db.execute("UPDATE inbox.outbox SET status = 'delivered', delivered_at = now()")
    db.execute("UPDATE inbox.purge_state SET announced_before = NULL, purged_before = NULL")
    assert purge_sql(db_dsn).rows_deleted == 1
    assert {r[0] for r in db.execute("SELECT message_id FROM inbox.message").fetchall()} == {"m0", "m1", "m2", "m3"}


def test_no_policy_is_never_purged(db: psycopg.Connection[Any], db_dsn: str) -> None:
    db.execute("SELECT inbox.register_handler('other', 'credit', 'credit(jsonb)'::regprocedure, 'v1')")
    db.execute("SELECT inbox.claim_and_apply('other', 'p', 'x', 'credit', '{\"id\": \"x\", \"amount\": 1}')")
    db.execute("UPDATE inbox.message SET processed_at = now() - interval '10 years'")
    with psycopg.connect(db_dsn, autocommit=True) as c:
        report = retention.purge_consumer(c, "other")
    assert report.status == "no_policy" and report.rows_deleted == 0
    assert db.execute("SELECT count(*) FROM inbox.message WHERE consumer = 'other'").fetchone() == (1,)


# ---------------------------------------------------------------------------- active time
def test_consumer_back_from_downtime_does_not_purge(db: psycopg.Connection[Any], db_dsn: str) -> None:
    for i in range(5):
        assert apply(db, f"d{i}", 0) == "applied"
    # Processed 20 days ago (older than the 17-day window in wall time), then the consumer was down
    # for the last 10 days: only 10 active days have passed since.
    age(db, 20, active_days=60)
    db.execute(
        "UPDATE inbox.consumer_config SET last_active_at = now() - interval '10 days' WHERE consumer = %s", (CONSUMER,)
    )
    on_start = purge_sql(db_dsn)
    assert on_start.rows_deleted == 0, "purged on start after downtime"
    assert on_start.status in ("done", "inactive")
    # It resumes: the first claim's heartbeat records the gap.
    assert apply(db, "after-restart", 0) == "applied"
    gaps = db.execute(
        "SELECT gap_to - gap_from > interval '9 days' FROM inbox.activity_gap"
        " WHERE consumer = %s AND gap_from > '-infinity'",
        (CONSUMER,),
    ).fetchall()
    assert gaps == [(True,)]
    assert db.execute(
        "SELECT last_active_at > now() - interval '1 minute' FROM inbox.consumer_config WHERE consumer = %s",
        (CONSUMER,),
    ).fetchone() == (True,)
    right_after = purge_sql(db_dsn)
    assert right_after.rows_deleted == 0, "purged right after the consumer resumed"
    # Eight more active days later (move the gap back), the rows are 17+ active days old: purged.
    db.execute(
        "UPDATE inbox.activity_gap SET gap_from = gap_from - interval '8 days',"
        " gap_to = gap_to - interval '8 days' WHERE consumer = %s AND gap_from > '-infinity'",
        (CONSUMER,),
    )
    db.execute(
        "UPDATE inbox.message SET processed_at = processed_at - interval '8 days',"
        " produced_at = produced_at - interval '8 days' WHERE message_id LIKE 'd%%'"
    )
    later = purge_sql(db_dsn)
    assert later.rows_deleted == 5
    assert_at_most_once(db)


def test_heartbeat_never_waits(db: psycopg.Connection[Any], db_dsn: str) -> None:
    """A claim whose heartbeat row is locked by another claim's open transaction goes on."""
    db.execute(
        "UPDATE inbox.consumer_config SET last_active_at = now() - interval '1 hour' WHERE consumer = %s", (CONSUMER,)
    )
    with psycopg.connect(db_dsn) as first, psycopg.connect(db_dsn) as second:
        first.execute("SET lock_timeout = '2s'")
        second.execute("SET lock_timeout = '2s'")
        assert apply(first, "hb-1", 0) == "applied"  # refreshes the heartbeat, holds the row lock
        assert apply(second, "hb-2", 0) == "applied"  # skips it, does not wait
        second.commit()
        first.commit()
    assert ledger(db) == {"hb-1": 1, "hb-2": 1}


# ---------------------------------------------------------------------------- races
def _old_message(db: psycopg.Connection[Any], message_id: str) -> Any:
    assert apply(db, message_id, 0) == "applied"
    age(db, 30)
    return produced_at_of(db, message_id)


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_redelivery_from_before_the_announcement_sees_the_row(
    db: psycopg.Connection[Any], db_dsn: str, isolation: str
) -> None:
    """A transaction running when the watermark is announced is waited for: it finds the row."""
    produced = _old_message(db, "race-1")
    with psycopg.connect(db_dsn) as redelivery, psycopg.connect(db_dsn, autocommit=True) as purger:
        redelivery.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        redelivery.execute("SELECT 1")  # snapshot taken before the announcement
        assert [r[1] for r in purger.execute("SELECT * FROM inbox.announce_purge(%s)", (CONSUMER,))] == ["announced"]
        batch = purger.execute("SELECT status, rows_deleted FROM inbox.purge_batch(%s)", (CONSUMER,)).fetchall()
        assert batch == [("waiting", 0)], "the purge must wait for the transaction from before"
        row = redelivery.execute(
            APPLY, {"consumer": CONSUMER, "producer": PRODUCER, "id": "race-1", "produced_at": produced}
        ).fetchone()
        assert row == ("duplicate",)
        assert purger.execute("SELECT status FROM inbox.purge_batch(%s)", (CONSUMER,)).fetchall() == [("waiting",)]
        redelivery.commit()
        assert purger.execute("SELECT status, rows_deleted FROM inbox.purge_batch(%s)", (CONSUMER,)).fetchall() == [
            ("purged", 1)
        ]
        purger.execute("SELECT inbox.purge_unlock(%s)", (CONSUMER,))
        redelivery.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        row = redelivery.execute(
            APPLY, {"consumer": CONSUMER, "producer": PRODUCER, "id": "race-1", "produced_at": produced}
        ).fetchone()
        assert row == ("expired",)
        redelivery.commit()
    assert ledger(db) == {"race-1": 1}


def test_redelivery_blocked_by_the_delete_sees_the_watermark(db: psycopg.Connection[Any], db_dsn: str) -> None:
    """A claim that conflicts with a row being deleted waits for the delete, then answers expired."""
    produced = _old_message(db, "race-2")
    with psycopg.connect(db_dsn, autocommit=True) as purger:
        purger.execute("SELECT * FROM inbox.announce_purge(%s)", (CONSUMER,))
        purger.autocommit = False
        assert purger.execute("SELECT status FROM inbox.purge_batch(%s)", (CONSUMER,)).fetchall() == [("purged",)]
        result: list[Any] = []

        def redeliver() -> None:
            with psycopg.connect(db_dsn) as c:
                result.append(
                    c.execute(
                        APPLY, {"consumer": CONSUMER, "producer": PRODUCER, "id": "race-2", "produced_at": produced}
                    ).fetchone()
                )

        t = threading.Thread(target=redeliver)
        t.start()
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and not db.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ).fetchone()[0]  # type: ignore[index]
        ):
            time.sleep(0.02)
        purger.commit()
        t.join(10)
        purger.autocommit = True
        purger.execute("SELECT inbox.purge_unlock(%s)", (CONSUMER,))
    assert result == [("expired",)]
    assert ledger(db) == {"race-2": 1}


def test_purge_racing_live_claim_and_apply(db: psycopg.Connection[Any], db_dsn: str) -> None:
    """Threads redeliver old messages and deliver new ones while the purge runs: every identity is
    applied exactly once; every redelivery of an old one is duplicate or expired."""
    db.execute("""SELECT inbox.claim_and_apply('billing', 'shop', 'old-' || g, 'credit',
                                                jsonb_build_object('id', 'old-' || g, 'amount', 1))
                    FROM generate_series(1, 2000) g""")
    age(db, 30)
    produced = db.execute("SELECT produced_at FROM inbox.message LIMIT 1").fetchone()[0]  # type: ignore[index]
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True) as c:
                i = 0
                while not stop.is_set():
                    old = f"old-{(i * 7 + n * 131) % 2000 + 1}"
                    out = c.execute(
                        APPLY, {"consumer": CONSUMER, "producer": PRODUCER, "id": old, "produced_at": produced}
                    ).fetchone()[0]  # type: ignore[index]
                    new = c.execute(
                        APPLY, {"consumer": CONSUMER, "producer": PRODUCER, "id": f"new-{n}-{i}", "produced_at": None}
                    ).fetchone()[0]  # type: ignore[index]
                    with lock:
                        outcomes[f"old:{out}"] = outcomes.get(f"old:{out}", 0) + 1
                        outcomes[f"new:{new}"] = outcomes.get(f"new:{new}", 0) + 1
                    i += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        report = purge_sql(db_dsn, batch_size=100)
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert report.status == "purged" and report.rows_deleted > 0
    assert set(outcomes) <= {"old:duplicate", "old:expired", "new:applied"}, outcomes
    assert outcomes.get("old:expired", 0) > 0
    counts = ledger(db)
    assert_at_most_once(db)
    assert all(counts.get(f"old-{g}") == 1 for g in range(1, 2001))
    assert sum(1 for k in counts if k.startswith("new-")) == outcomes["new:applied"]


def test_two_purgers_at_once(db: psycopg.Connection[Any], db_dsn: str) -> None:
    assert apply(db, "p-1", 0) == "applied"
    age(db, 30)
    with psycopg.connect(db_dsn, autocommit=True) as first:
        assert first.execute("SELECT inbox.purge_lock(%s)", (CONSUMER,)).fetchone() == (True,)
        with psycopg.connect(db_dsn, autocommit=True) as second:
            assert retention.purge_consumer(second, CONSUMER).status == "busy"
            assert second.execute("SELECT status FROM inbox.purge_batch(%s)", (CONSUMER,)).fetchall() == [("busy",)]
            called = second.execute("CALL inbox.purge(%s)", (CONSUMER,)).fetchone()
            assert called == (0, "busy")
        done = subprocess.run(
            [*_cli_script(), "purge", "--dsn", db_dsn, "--consumer", CONSUMER],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "another purger is running" in done.stdout
        assert db.execute("SELECT count(*) FROM inbox.message").fetchone() == (1,)
        # The lock holder purges (the lock is re-entrant for its session).
        assert retention.purge_consumer(first, CONSUMER).rows_deleted == 1


def test_purge_gives_up_when_an_old_transaction_stays(db: psycopg.Connection[Any], db_dsn: str) -> None:
    assert apply(db, "slow-1", 0) == "applied"
    age(db, 30)
    with psycopg.connect(db_dsn) as idle:
        idle.execute("SELECT 1")  # idle in transaction from before the announcement
        with psycopg.connect(db_dsn, autocommit=True) as c:
            report = retention.purge_consumer(c, CONSUMER, wait_timeout=0.3)
            assert report.status == "timeout" and report.rows_deleted == 0
            with pytest.raises(psycopg.errors.LockNotAvailable, match="still run after"):
                c.execute("CALL inbox.purge(%s, wait_timeout => '0.2 s')", (CONSUMER,))
        done = subprocess.run(
            [*_cli_script(), "purge", "--dsn", db_dsn, "--wait-timeout", "0.3"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 75 and "gave up" in done.stderr
        idle.rollback()
    assert db.execute("SELECT count(*) FROM inbox.message").fetchone() == (1,)


# ---------------------------------------------------------------------------- scheduling
def test_cron_path_pginbox_purge(db: psycopg.Connection[Any], db_dsn: str) -> None:
    for i in range(3):
        assert apply(db, f"c{i}", 0) == "applied"
    age(db, 30)
    done = subprocess.run(
        [*_cli_script(), "purge", "--dsn", db_dsn, "--json", "--batch-size", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert '"rows_deleted": 3' in done.stdout and '"status": "purged"' in done.stdout
    again = subprocess.run(
        [*_cli_script(), "purge", "--dsn", db_dsn], capture_output=True, text=True, timeout=60, check=False
    )
    assert again.returncode == 0 and "nothing to purge" in again.stdout
    missing = subprocess.run(
        [*_cli_script(), "purge", "--dsn", db_dsn, "--consumer", "nobody"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 3 and "no retention policy" in missing.stdout
    # CALL inbox.purge is what pg_cron runs.
    assert apply(db, "c9", 0) == "applied"
    age(db, 30)
    db.execute("UPDATE inbox.purge_state SET announced_before = NULL, purged_before = NULL")
    assert db.execute("CALL inbox.purge(%s, batch_size => 1)", (CONSUMER,)).fetchone() == (1, "purged")


def old_messages(conn: psycopg.Connection[Any], n: int) -> None:
    """n processed messages of CONSUMER, old enough to purge (one applied, the others written
    directly: fast)."""
    assert apply(conn, "old-0", 0) == "applied"  # the consumer's first claim: it is active from now on
    conn.execute(
        "INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version,"
        " processed_at) SELECT %s, '', %s, 'old-' || i, '\\x00', 'v1', now() FROM generate_series(1, %s) i",
        (CONSUMER, PRODUCER, n - 1),
    )
    age(conn, 30)


def messages_left(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM inbox.message").fetchone()
    assert row is not None
    return int(row[0])


def test_purge_shows_progress_on_a_terminal_only(db: psycopg.Connection[Any], db_dsn: str) -> None:
    """Under cron: one summary line, no progress (and nothing at all with --quiet); --progress on
    a pipe: one line per batch; on a terminal: rows, rate and time left drawn in place against the
    rows counted before the purge started."""
    old_messages(db, 2500)
    purge_cmd = [*_cli_script(), "purge", "--dsn", db_dsn, "--consumer", CONSUMER, "--batch-size", "100"]

    cron = subprocess.run([*purge_cmd, "--max-batches", "5"], capture_output=True, text=True, timeout=60, check=False)
    assert cron.returncode == 0, cron.stderr
    assert cron.stderr == ""
    assert cron.stdout.splitlines() == [cron.stdout.splitlines()[0]]
    assert cron.stdout.startswith(f"{CONSUMER}: purged 500 rows in 5 batches")
    assert messages_left(db) == 2000

    quiet = subprocess.run(
        [*purge_cmd, "--max-batches", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PGINBOX_PURGE_QUIET": "1"},
    )
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    assert messages_left(db) == 1800

    logged = subprocess.run(
        [*purge_cmd, "--max-batches", "3", "--progress"], capture_output=True, text=True, timeout=60, check=False
    )
    assert logged.returncode == 0, logged.stderr
    lines = logged.stderr.splitlines()
    assert [line.split(", ")[:2] for line in lines] == [
        [f"{CONSUMER}: {n * 100:,} of ~1,800 rows ({n * 100 * 100 // 1800}%)", f"batch {n}"] for n in (1, 2, 3)
    ]
    assert "\r" not in logged.stderr
    assert messages_left(db) == 1500

    status, shown = run_on_a_terminal([*purge_cmd, "--pause", "0.02"])
    assert status == 0, shown
    assert messages_left(db) == 0
    frames = [frame for frame in shown.split("\r\x1b[K") if frame.strip()]
    drawn = [frame for frame in frames if "rows/s" in frame]
    assert len(drawn) >= 10, shown  # redrawn in place, batch after batch
    assert "1,500 of ~1,500 rows (100%), batch 15," in shown
    assert any("left" in frame and "of ~1,500 rows" in frame for frame in drawn), drawn
    assert frames[-1].strip().startswith(f"{CONSUMER}: purged 1500 rows in 15 batches"), frames[-1]
    with psycopg.connect(db_dsn, autocommit=True) as other:  # the purger's lock was given back
        assert other.execute("SELECT inbox.purge_lock(%s)", (CONSUMER,)).fetchone() == (True,)


def test_a_stop_request_cancels_the_purge_and_keeps_what_it_deleted(db: psycopg.Connection[Any], db_dsn: str) -> None:
    old_messages(db, 1000)
    stop = threading.Event()
    seen: list[retention.PurgeProgress] = []

    def progress(p: retention.PurgeProgress) -> None:
        seen.append(p)
        if p.batches == 2:
            stop.set()

    with psycopg.connect(db_dsn, autocommit=True) as c:
        report = retention.purge_consumer(
            c,
            CONSUMER,
            batch_size=100,
            pause=0.5,
            stop=stop,
            progress=progress,
            estimate=retention.estimate_rows_to_go(c, CONSUMER),
        )
        assert report.status == "purged" and "stopped" in report.details
        assert c.execute("SELECT inbox._purge_lock_held(%s)", (CONSUMER,)).fetchone() == (False,)
    assert report.rows_deleted == 200 == 1000 - messages_left(db)
    assert [(p.batches, p.rows_deleted, p.estimate) for p in seen] == [(1, 100, 1000), (2, 200, 1000)]
    assert report.seconds < 5


def test_retention_show_and_set_cli(db: psycopg.Connection[Any], db_dsn: str) -> None:
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "retention",
            "set",
            "audit",
            "--dsn",
            db_dsn,
            "--broker-retention",
            "3 days",
            "--max-offset-rewind",
            "0",
            "--dead-letter-redrive-horizon",
            "0",
            "--producer-retry-horizon",
            "0",
            "--outage-allowance",
            "1 day",
            "--backup-restore-window",
            "0",
            "--planned-replay-horizon",
            "30 days",
            "--safety-margin",
            "1 hour",
            "--note",
            "replays a month back",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "31 days 01:00:00" in res.output and "planned_replay_horizon" in res.output
    res = runner.invoke(main, ["retention", "show", "--dsn", db_dsn, "--json"])
    assert res.exit_code == 0 and '"dominating_scenario": "planned_replay_horizon"' in res.output
    # Intervals as PostgreSQL prints them, not as Python's timedelta ('31 days, 1:00:00').
    as_pg = db.execute("SELECT retention_window::text FROM inbox.retention_status WHERE consumer = 'audit'").fetchone()
    assert as_pg == ("31 days 01:00:00",)
    assert '"retention_window": "31 days 01:00:00"' in res.output
    shown = runner.invoke(main, ["retention", "show", "--dsn", db_dsn])
    assert shown.exit_code == 0 and "31 days 01:00:00" in shown.output and ", 1:00:00" not in shown.output
    res = runner.invoke(
        main,
        [
            "retention",
            "set",
            "audit",
            "--dsn",
            db_dsn,
            "--broker-retention",
            "-1 day",
            "--max-offset-rewind",
            "0",
            "--dead-letter-redrive-horizon",
            "0",
            "--producer-retry-horizon",
            "0",
            "--outage-allowance",
            "0",
            "--backup-restore-window",
            "0",
            "--planned-replay-horizon",
            "0",
            "--safety-margin",
            "0",
            "--note",
            "x",
        ],
    )
    assert res.exit_code == 1 and "broker_retention must not be negative" in res.output
    assert db.execute("SELECT count(*) FROM inbox.retention_policy_change WHERE consumer = 'audit'").fetchone() == (1,)


@pytest.fixture
def sink_module(tmp_path: Path) -> Iterator[dict[str, str]]:
    (tmp_path / "retention_sink.py").write_text("def deliver(effect):\n    return None\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    yield env


def test_dispatch_purge_every(db: psycopg.Connection[Any], db_dsn: str, sink_module: dict[str, str]) -> None:
    for i in range(3):
        assert apply(db, f"q{i}", 0) == "applied"
    age(db, 30)
    # Outbox housekeeping rides along: delivered effects older than --keep-delivered go, younger stay.
    for effect in ("fx-old", "fx-new"):
        db.execute("SELECT inbox.enqueue_effect(%s, 'sink', '{}')", (effect,))
    once = subprocess.run(
        [
            *_cli_script(),
            "dispatch",
            "--dsn",
            db_dsn,
            "--once",
            "--purge-every",
            "1",
            "--keep-delivered",
            "3600",
            "--callable",
            "sink=retention_sink:deliver",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=sink_module,
    )
    assert once.returncode == 0, once.stderr
    assert db.execute("SELECT count(*) FROM inbox.message").fetchone() == (0,)
    assert db.execute("SELECT effect_id, status::text FROM inbox.outbox ORDER BY 1").fetchall() == [
        ("fx-new", "delivered"),
        ("fx-old", "delivered"),
    ]
    db.execute("UPDATE inbox.outbox SET delivered_at = now() - interval '2 hours' WHERE effect_id = 'fx-old'")
    again = subprocess.run(
        [
            *_cli_script(),
            "dispatch",
            "--dsn",
            db_dsn,
            "--once",
            "--purge-every",
            "1",
            "--keep-delivered",
            "3600",
            "--callable",
            "sink=retention_sink:deliver",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=sink_module,
    )
    assert again.returncode == 0, again.stderr
    assert db.execute("SELECT effect_id FROM inbox.outbox").fetchall() == [("fx-new",)]
    assert "purge outbox" in again.stderr and "rows=1" in again.stderr

    # The daemon: the purger thread runs every second next to the dispatcher.
    assert apply(db, "q9", 0) == "applied"
    age(db, 30)
    db.execute("UPDATE inbox.purge_state SET announced_before = NULL, purged_before = NULL")
    proc = subprocess.Popen(
        [
            *_cli_script(),
            "dispatch",
            "--dsn",
            db_dsn,
            "--purge-every",
            "1",
            "--callable",
            "sink=retention_sink:deliver",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sink_module,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and db.execute("SELECT count(*) FROM inbox.message").fetchone() != (0,):
            time.sleep(0.2)
        assert db.execute("SELECT count(*) FROM inbox.message").fetchone() == (0,)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "purge consumer=billing status=purged rows=1" in err
    assert_at_most_once(db)


PG_CRON = Path("/usr/lib/postgresql/15/lib/pg_cron.so")


@pytest.mark.skipif(not PG_CRON.is_file(), reason="pg_cron is not installed (apt-get install postgresql-15-cron)")
@pytest.mark.slow
def test_pg_cron_runs_the_purge(private_cluster: Any) -> None:
    """`SELECT cron.schedule(..., 'CALL inbox.purge(...)')` as documented, on a cluster of its own
    (pg_cron needs shared_preload_libraries and a restart). pg_cron 1.4 schedules by the minute:
    this test waits up to ~70 s."""
    dsn = private_cluster.dsn("pginbox")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_cron'")
    # pg_cron's own settings are unknown to ALTER SYSTEM until the library is loaded.
    with (private_cluster.datadir / "postgresql.conf").open("a") as conf:
        conf.write("cron.database_name = 'pginbox'\ncron.use_background_workers = on\n")
    private_cluster.stop()
    private_cluster.start()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE EXTENSION pg_cron")
        c.execute(SETUP)
        for i in range(3):
            assert apply(c, f"cron-{i}", 0) == "applied"
        age(c, 30)
        c.execute(
            "SELECT cron.schedule('pginbox-purge-billing', '* * * * *',"
            " $$CALL inbox.purge('billing', max_batches => 200)$$)"
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and c.execute("SELECT count(*) FROM inbox.message").fetchone() != (0,):
            time.sleep(1)
        runs = c.execute("SELECT status, return_message FROM cron.job_run_details").fetchall()
        assert c.execute("SELECT count(*) FROM inbox.message").fetchone() == (0,), runs
        assert any(status == "succeeded" for status, _ in runs), runs
        assert c.execute("SELECT rows_purged FROM inbox.purge_state").fetchone() == (3,)
        assert_at_most_once(c)


def test_intervals_print_as_postgresql_prints_them(db: psycopg.Connection[Any]) -> None:
    from pginbox.cli.output import pg_interval

    texts = [
        "11 days",
        "1 day",
        "00:05:00",
        "1 day 02:00:00",
        "-1 days",
        "-1 days -02:00:00",
        "00:00:00",
        "00:00:00.5",
        "365 days 23:59:59.000001",
        "-00:00:01",
    ]
    rows = db.execute("SELECT v::interval::text, v::interval FROM unnest(%s::text[]) v", (texts,)).fetchall()
    assert [r[0] for r in rows] == texts, "each is PostgreSQL's own spelling"
    assert [pg_interval(r[1]) for r in rows] == texts
