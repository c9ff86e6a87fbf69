"""Replay after a handler change (docs/replay.md), against a real PostgreSQL and real processes.

The three policies of the article, each as a workflow: no reapplication (a read model rebuilt
elsewhere, the inbox untouched), versioned projection (the version is part of the consumer
identity), and compensated migration (a replay plan). For the plan: the article's case "handler
version changes during a replay plan" end to end, a second run and two concurrent runners, a
runner killed (SIGKILL) or terminated (pg_terminate_backend) mid-plan then resumed, a payload
that does not match the stored hash, and the retention holds.

The invariant, asserted from the domain tables: each replay operation is applied at most once
(exactly once when the plan ran to the end), and never with a handler version the operator did
not choose. The domain log tables have no unique key, so a double application would show.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from helpers_inbox import hand_to_service
from helpers_terminal import frames, run_on_a_terminal
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pginbox.cli import main
from pginbox.ops import replay

Conn = psycopg.Connection[Any]

# The domain: accounts credited by messages of consumer 'billing'. Handler credit_v1 had a bug (no
# bonus); the compensation handlers credit_fix (fix-1) and credit_fix2 (fix-2) add the missing bonus
# and log each application in compensation (no unique key: a double application would show).
DOMAIN = """
CREATE SCHEMA app;
CREATE TABLE app.account (id integer PRIMARY KEY, balance numeric NOT NULL DEFAULT 0);
CREATE TABLE app.credit_log (message_id text NOT NULL, version text NOT NULL, amount numeric NOT NULL);
CREATE TABLE app.compensation (message_id text NOT NULL, version text NOT NULL, bonus numeric NOT NULL,
                               operator text NOT NULL DEFAULT current_user);
CREATE TABLE app.event_store (producer text NOT NULL, message_id text NOT NULL, payload jsonb NOT NULL);
CREATE TABLE app.slow (seconds float8 NOT NULL);
INSERT INTO app.slow VALUES (0);
INSERT INTO app.account (id) SELECT g FROM generate_series(1, 5) g;
CREATE FUNCTION app.credit_v1(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE app.account SET balance = balance + (p ->> 'amount')::numeric WHERE id = (p ->> 'account')::integer;
    INSERT INTO app.credit_log VALUES (ctx.message_id, ctx.handler_version, (p ->> 'amount')::numeric);
END
$$;
CREATE FUNCTION app.credit_fix(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p ? 'poison' THEN
        RAISE EXCEPTION 'cannot compensate %', ctx.message_id USING ERRCODE = 'check_violation';
    END IF;
    UPDATE app.account SET balance = balance + (p ->> 'bonus')::numeric WHERE id = (p ->> 'account')::integer;
    INSERT INTO app.compensation (message_id, version, bonus) VALUES (ctx.message_id, ctx.handler_version,
                                                                      (p ->> 'bonus')::numeric);
    PERFORM pg_sleep(seconds) FROM app.slow WHERE seconds > 0;
END
$$;
CREATE FUNCTION app.credit_fix2(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE app.account SET balance = balance + (p ->> 'bonus')::numeric WHERE id = (p ->> 'account')::integer;
    INSERT INTO app.compensation (message_id, version, bonus) VALUES (ctx.message_id, ctx.handler_version,
                                                                      (p ->> 'bonus')::numeric);
END
$$;
"""

FIX = "app.credit_fix(jsonb,inbox.message_context)"
FIX2 = "app.credit_fix2(jsonb,inbox.message_context)"
# The CLI runner's backend in this test's database.
RUNNER = "pg_stat_activity WHERE application_name = 'pginbox-cli' AND datname = current_database()"


def message(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "producer": "shop",
        "message_id": f"m-{n:03d}",
        "tenant": "",
        "payload": {"account": 1 + n % 5, "amount": 10, "bonus": 1, **extra},
    }


def deliver_history(conn: Conn, count: int, consumer: str = "billing", **extra: Any) -> list[dict[str, Any]]:
    """Registers credit_v1 and delivers `count` messages through it; returns them as plan items."""
    conn.execute(
        "SELECT inbox.register_handler(%s, 'credit', 'app.credit_v1(jsonb,inbox.message_context)', 'v1')", (consumer,)
    )
    items = [message(n, **extra) for n in range(1, count + 1)]
    for item in items:
        conn.execute(
            "INSERT INTO app.event_store VALUES (%s, %s, %s)",
            (item["producer"], item["message_id"], json.dumps(item["payload"])),
        )
        row = conn.execute(
            "SELECT outcome FROM inbox.claim_and_apply(%s, %s, %s, 'credit', %s)",
            (consumer, item["producer"], item["message_id"], json.dumps(item["payload"])),
        ).fetchone()
        assert row == ("applied",)
    return items


def inbox_snapshot(conn: Conn, consumer: str = "billing") -> list[str]:
    """The consumer's inbox rows, every column, as text (byte-identical comparison)."""
    rows = conn.execute(
        "SELECT m::text FROM inbox.message m WHERE m.consumer = %s ORDER BY m.message_id", (consumer,)
    ).fetchall()
    return [r[0] for r in rows]


def compensations(conn: Conn) -> Counter[tuple[str, str]]:
    rows = conn.execute("SELECT message_id, version FROM app.compensation").fetchall()
    return Counter((r[0], r[1]) for r in rows)


def per_message(conn: Conn) -> Counter[str]:
    return Counter(r[0] for r in conn.execute("SELECT message_id FROM app.compensation").fetchall())


def new_plan(conn: Conn, items: list[dict[str, Any]], name: str = "bonus-fix", version: str = "fix-1") -> int:
    conn.execute(f"SELECT inbox.register_handler('billing', 'credit', '{FIX}', %s)", (version,))
    plan_id = replay.create_plan(conn, name, "billing", "credit", FIX, version, "v1 forgot the bonus")
    assert replay.add_items(conn, plan_id, items) == len(items)
    return plan_id


def old_enough_to_purge(conn: Conn) -> None:
    """A five-minute retention window (the shortest that holds the clock tolerance), and every
    processed row of billing an hour old, with billing active for a day: all of them may go."""
    conn.execute("""SELECT inbox.set_retention_policy('billing', broker_retention => '5 minutes',
                        max_offset_rewind => '0', dead_letter_redrive_horizon => '0', producer_retry_horizon => '0',
                        outage_allowance => '0', backup_restore_window => '0', planned_replay_horizon => '0',
                        safety_margin => '0', note => 'test: purge everything older than five minutes')""")
    conn.execute(
        "UPDATE inbox.message SET processed_at = processed_at - interval '1 hour',"
        " produced_at = produced_at - interval '1 hour' WHERE consumer = 'billing'"
    )
    conn.execute("DELETE FROM inbox.activity_gap WHERE consumer = 'billing'")
    conn.execute(
        "INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to) VALUES ('billing', '-infinity',"
        " now() - interval '1 day')"
    )
    conn.execute("UPDATE inbox.consumer_config SET last_active_at = now() WHERE consumer = 'billing'")


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def cli(*argv: str, input: str | None = None) -> Any:
    return CliRunner().invoke(main, list(argv), input=input, catch_exceptions=True)


def pginbox_command() -> list[str]:
    script = Path(sys.executable).parent / "pginbox"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pginbox"]


@pytest.fixture
def domain(conn: Conn, login_role: Callable[..., str]) -> Conn:
    """The domain, owned by billing's service role as a deployment has it: a replay plan runs its
    handler with that role's rights, through inbox_runner (docs/replay.md)."""
    conn.execute(DOMAIN)
    service = str(conninfo_to_dict(login_role("inbox_consumer"))["user"])
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA app TO {}, inbox_runner").format(sql.Identifier(service)))
    hand_to_service(
        conn,
        service,
        "billing",
        functions=(FIX, FIX2, "app.credit_v1(jsonb,inbox.message_context)"),
        tables=("app.account", "app.credit_log", "app.compensation", "app.event_store", "app.slow"),
    )
    return conn


# --------------------------------------------------------------------------- policy 1: no reapplication


def test_no_reapplication_rebuilds_a_read_model_elsewhere(domain: Conn) -> None:
    """The recipe of docs/replay.md: a new read model filled from the domain table; nothing in the
    inbox changes (every inbox table compared before and after)."""
    deliver_history(domain, 12)
    tables = [
        r[0]
        for r in domain.execute(
            "SELECT c.oid::regclass::text FROM pg_class c WHERE c.relnamespace = 'inbox'::regnamespace "
            "AND c.relkind = 'r' ORDER BY 1"
        ).fetchall()
    ]
    before = {
        t: domain.execute(f"SELECT coalesce(array_agg(x::text ORDER BY x::text), '{{}}') FROM {t} x").fetchone()
        for t in tables
    }

    # The recipe: a new read model, filled from the event store (or the domain tables), swapped in.
    domain.execute("""
        CREATE TABLE app.credits_by_account_v2 AS
        SELECT (e.payload ->> 'account')::integer AS account, sum((e.payload ->> 'amount')::numeric) AS credited,
               count(*) AS messages
          FROM app.event_store e
         GROUP BY 1
    """)
    rebuilt = domain.execute("SELECT sum(credited), sum(messages) FROM app.credits_by_account_v2").fetchone()
    assert rebuilt == (120, 12)
    after = {
        t: domain.execute(f"SELECT coalesce(array_agg(x::text ORDER BY x::text), '{{}}') FROM {t} x").fetchone()
        for t in tables
    }
    assert after == before
    # The history is still a duplicate for the consumer: rebuilding did not reopen redelivery.
    item = message(1)
    row = domain.execute(
        "SELECT outcome FROM inbox.claim_and_apply('billing', 'shop', 'm-001', 'credit', %s)",
        (json.dumps(item["payload"]),),
    ).fetchone()
    assert row == ("duplicate",)


# --------------------------------------------------------------------------- policy 2: versioned projection


def test_versioned_projection_consumes_the_history_again_under_a_new_identity(domain: Conn) -> None:
    domain.execute("""
        CREATE TABLE app.projection (version text NOT NULL, message_id text NOT NULL, amount numeric NOT NULL);
        CREATE FUNCTION app.project_v1(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE sql AS
            $$INSERT INTO app.projection VALUES ('v1', ctx.message_id, (p ->> 'amount')::numeric)$$;
        CREATE FUNCTION app.project_v2(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE sql AS
            $$INSERT INTO app.projection VALUES ('v2', ctx.message_id, (p ->> 'amount')::numeric + 1)$$;
    """)

    def versioned(version: str) -> str:
        row = domain.execute("SELECT inbox.versioned_consumer('orders-projection', %s)", (version,)).fetchone()
        assert row is not None
        return str(row[0])

    v1, v2 = versioned("v1"), versioned("v2")
    assert (v1, v2) == ("orders-projection@v1", "orders-projection@v2")
    domain.execute(
        "SELECT inbox.register_handler(%s, 'credit', 'app.project_v1(jsonb,inbox.message_context)', 'v1')", (v1,)
    )
    history = [message(n) for n in range(1, 8)]

    def deliver(consumer: str, item: dict[str, Any]) -> str:
        row = domain.execute(
            "SELECT outcome FROM inbox.claim_and_apply(%s, %s, %s, 'credit', %s)",
            (consumer, item["producer"], item["message_id"], json.dumps(item["payload"])),
        ).fetchone()
        assert row is not None
        return str(row[0])

    assert [deliver(v1, m) for m in history] == ["applied"] * 7
    v1_rows = inbox_snapshot(domain, v1)

    domain.execute(
        "SELECT inbox.register_handler(%s, 'credit', 'app.project_v2(jsonb,inbox.message_context)', 'v2')", (v2,)
    )
    assert [deliver(v2, m) for m in history] == ["applied"] * 7, "v2 consumes the same history as new messages"
    assert inbox_snapshot(domain, v1) == v1_rows, "v1's inbox rows are untouched"
    assert [deliver(v1, m) for m in history[:3]] == ["duplicate"] * 3, "a redelivery is a duplicate for v1"
    assert [deliver(v2, m) for m in history[:3]] == ["duplicate"] * 3, "a redelivery is a duplicate for v2"
    counts = Counter(r for r in domain.execute("SELECT version, message_id FROM app.projection").fetchall())
    assert set(counts.values()) == {1} and len(counts) == 14, "each version applied each message exactly once"

    with pytest.raises(psycopg.errors.InvalidParameterValue):
        domain.execute("SELECT inbox.versioned_consumer('orders@projection', 'v2')")


# --------------------------------------------------------------------------- policy 3: the article's case


def test_handler_version_changes_during_a_replay_plan(domain: Conn, db_dsn: str) -> None:
    """The registered handler changes mid-plan (another session, while the runner is inside an
    item): the plan stops after that item, nothing is applied with the new version until an
    operator accepts it, then the plan resumes; every operation is applied exactly once."""
    items = deliver_history(domain, 10)
    original_rows = inbox_snapshot(domain)
    plan_id = new_plan(domain, items)
    domain.execute("UPDATE app.slow SET seconds = 0.3")

    outcome: dict[str, Any] = {}

    def runner() -> None:
        with psycopg.connect(db_dsn, autocommit=True, application_name="replay-runner") as conn:
            conn.add_notice_handler(lambda d: outcome.setdefault("notices", []).append((d.severity, d.sqlstate)))
            try:
                outcome["result"] = replay.run_plan(conn, plan_id, max_items=100)
            except replay.ReplayError as exc:
                outcome["error"] = exc

    thread = threading.Thread(target=runner)
    thread.start()
    # Wait until the runner sleeps inside the handler of its third item, then register fix-2.
    wait_until(
        lambda: (
            domain.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = 'replay-runner' AND wait_event = 'PgSleep'"
            ).fetchone()
            == (1,)
        ),
        what="the runner inside a handler",
    )
    time.sleep(0.65)  # into the third item
    with psycopg.connect(db_dsn, autocommit=True) as other:
        other.execute(f"SELECT inbox.register_handler('billing', 'credit', '{FIX2}', 'fix-2')")
    thread.join(60)
    assert not thread.is_alive()

    error = outcome.get("error")
    assert isinstance(error, replay.ReplayStopped) and error.sqlstate == "IR001", outcome
    assert ("WARNING", "IR001") in outcome.get("notices", []), "the stopping call warns with SQLSTATE IR001"
    applied_before_stop = compensations(domain)
    assert 1 <= len(applied_before_stop) < 10
    assert {v for (_, v) in applied_before_stop} == {"fix-1"}, "before the stop only the pinned version ran"
    status = replay.plan_status(domain, plan_id)[0].row
    assert (status["status"], status["pin_matches"]) == ("stopped_version_changed", False)
    assert status["applied"] == len(applied_before_stop)

    # Nothing is applied with fix-2 until accepted: a run is refused with IR001, twice.
    for _ in range(2):
        with pytest.raises(replay.ReplayStopped) as refused:
            replay.run_plan(domain, plan_id)
        assert refused.value.sqlstate == "IR001"
    assert compensations(domain) == applied_before_stop
    # Accepting a pair other than the registered one is refused (IR002).
    with pytest.raises(replay.ReplayError) as mismatch:
        replay.accept_version(domain, plan_id, FIX, "fix-1", "go back")
    assert mismatch.value.sqlstate == "IR002"

    accepted = replay.accept_version(domain, plan_id, FIX2, "fix-2", "reviewed fix-2, it compensates the same way")
    assert accepted == "open"
    result = replay.run_plan(domain, plan_id, max_items=3, until_done=True)
    assert (result.status, result.pending, result.applied, result.failed) == ("completed", 0, 10, 0)

    done = compensations(domain)
    assert set(per_message(domain).values()) == {1} and len(per_message(domain)) == 10, "each operation once"
    assert {k: v for k, v in done.items() if k[1] == "fix-1"} == applied_before_stop
    assert sum(v for k, v in done.items() if k[1] == "fix-2") == 10 - len(applied_before_stop)
    assert domain.execute("SELECT sum(balance) FROM app.account").fetchone() == (110,)
    assert inbox_snapshot(domain) == original_rows, "the original inbox rows are byte-identical"
    decisions = [
        r[0]
        for r in domain.execute(
            "SELECT decision FROM inbox.replay_decision WHERE plan_id = %s ORDER BY decision_id", (plan_id,)
        ).fetchall()
    ]
    assert decisions == ["create", "add_items", "stopped_version_changed", "accept_version", "completed"]
    assert domain.execute("SELECT count(*) FROM inbox.retention_hold").fetchone() == (0,), "holds go at completion"


def test_running_twice_and_two_concurrent_runners_apply_each_operation_once(domain: Conn, db_dsn: str) -> None:
    items = deliver_history(domain, 30)
    plan_id = new_plan(domain, items)
    domain.execute("UPDATE app.slow SET seconds = 0.005")
    errors: list[BaseException] = []

    def runner() -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True) as conn:
                replay.run_plan(conn, plan_id, max_items=4, until_done=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=runner) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # The loser may find the plan completed; nothing else may go wrong.
    assert all(isinstance(e, replay.ReplayError) and e.sqlstate == "55000" for e in errors), errors
    assert set(per_message(domain).values()) == {1} and len(per_message(domain)) == 30

    with pytest.raises(replay.ReplayError) as again:
        replay.run_plan(domain, plan_id)
    assert again.value.sqlstate == "55000", "a completed plan does not run again"
    assert set(per_message(domain).values()) == {1} and len(per_message(domain)) == 30
    # The operation ids are claimed in inbox.message under the plan's consumer, once each.
    claimed = domain.execute(
        "SELECT count(*), count(DISTINCT message_id) FROM inbox.message WHERE consumer = %s", (f"replay:{plan_id}",)
    ).fetchone()
    assert claimed == (30, 30)


@pytest.mark.parametrize("how", ["sigkill-client", "terminate-backend"])
def test_runner_killed_mid_plan_then_resumed_applies_each_once(domain: Conn, db_dsn: str, how: str) -> None:
    items = deliver_history(domain, 16)
    plan_id = new_plan(domain, items)
    domain.execute("UPDATE app.slow SET seconds = 0.15")
    with subprocess.Popen(
        [*pginbox_command(), "replay", "run", str(plan_id), "--max-items", "1", "--until-done", "--dsn", db_dsn],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        wait_until(lambda: len(per_message(domain)) >= 3, what="three items applied")
        if how == "sigkill-client":
            proc.kill()
        else:
            # Inside a handler (pg_sleep): the item's transaction dies with the backend.
            wait_until(
                lambda: domain.execute(f"SELECT count(*) FROM {RUNNER} AND wait_event = 'PgSleep'").fetchone() == (1,),
                what="the runner inside a handler",
            )
            terminated = domain.execute(
                f"SELECT pg_terminate_backend(pid) FROM {RUNNER} AND wait_event = 'PgSleep'"
            ).fetchall()
            assert terminated == [(True,)]
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    if how == "terminate-backend":
        assert "terminat" in stderr.lower() or "connection" in stderr.lower(), stderr
    # A killed client's backend finishes (and commits) the statement it was running: wait for it.
    wait_until(
        lambda: domain.execute(f"SELECT count(*) FROM {RUNNER}").fetchone() == (0,), what="the runner's backend to end"
    )
    partial = per_message(domain)
    assert 3 <= len(partial) < 16 and set(partial.values()) == {1}
    status = replay.plan_status(domain, plan_id)[0].row
    assert status["applied"] == len(partial), "the plan's count is the domain's: committed together"

    domain.execute("UPDATE app.slow SET seconds = 0")
    resumed = cli("replay", "run", str(plan_id), "--max-items", "5", "--until-done", "--json", "--dsn", db_dsn)
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.output)["totals"] == {"pending": 0, "applied": 16, "failed": 0, "skipped": 0}
    assert set(per_message(domain).values()) == {1} and len(per_message(domain)) == 16, "each applied exactly once"
    assert domain.execute("SELECT sum(balance) FROM app.account").fetchone() == (176,)


# --------------------------------------------------------------------------- selection and holds


def test_a_payload_that_does_not_match_the_stored_hash_is_refused(domain: Conn) -> None:
    items = deliver_history(domain, 3)
    domain.execute(f"SELECT inbox.register_handler('billing', 'credit', '{FIX}', 'fix-1')")
    plan_id = replay.create_plan(domain, "p", "billing", "credit", FIX, "fix-1", "bonus")
    forged = [items[0], {**items[1], "payload": {**items[1]["payload"], "amount": 1000}}]
    with pytest.raises(replay.ReplayError) as refused:
        replay.add_items(domain, plan_id, forged)
    assert refused.value.sqlstate == "IR003"
    assert "item 2" in str(refused.value) and "m-002" in str(refused.value)
    assert domain.execute("SELECT count(*) FROM inbox.replay_item").fetchone() == (0,), "nothing of the call is kept"
    assert domain.execute("SELECT count(*) FROM inbox.retention_hold").fetchone() == (0,)
    with pytest.raises(replay.ReplayError) as unknown:
        replay.add_items(domain, plan_id, [message(99)])
    assert unknown.value.sqlstate == "P0002"
    # The right payloads are accepted; adding them again adds nothing.
    assert replay.add_items(domain, plan_id, items) == 3
    assert replay.add_items(domain, plan_id, items) == 0


def test_hash_exclude_keys_apply_to_the_check(domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', hash_exclude_keys => ARRAY['trace'])")
    items = deliver_history(domain, 2, trace="t-1")
    domain.execute(f"SELECT inbox.register_handler('billing', 'credit', '{FIX}', 'fix-1')")
    plan_id = replay.create_plan(domain, "p", "billing", "credit", FIX, "fix-1", "bonus")
    retraced = [{**i, "payload": {**i["payload"], "trace": "t-2"}} for i in items]
    assert replay.add_items(domain, plan_id, retraced) == 2


def test_holds_keep_the_identities_while_the_plan_needs_them(domain: Conn) -> None:
    items = deliver_history(domain, 6)
    plan_id = new_plan(domain, items[:4])
    holds = domain.execute(
        "SELECT consumer, tenant, producer, message_id, holder FROM inbox.retention_hold ORDER BY message_id"
    ).fetchall()
    assert holds == [("billing", "", "shop", i["message_id"], f"replay:{plan_id}") for i in items[:4]]
    old_enough_to_purge(domain)
    held_rows = inbox_snapshot(domain)[:4]

    def purge() -> None:
        domain.execute("CALL inbox.purge('billing')")

    purge()
    assert inbox_snapshot(domain) == held_rows, "the purge kept exactly the held identities, unchanged"
    result = replay.run_plan(domain, plan_id, until_done=True)
    assert (result.status, result.applied) == ("completed", 4)
    assert domain.execute("SELECT count(*) FROM inbox.retention_hold").fetchone() == (0,), "holds go at completion"
    purge()
    assert inbox_snapshot(domain) == [], "without the holds the same rows are purged"


def test_cancel_skips_pending_items_and_removes_the_holds(domain: Conn) -> None:
    items = deliver_history(domain, 4)
    plan_id = new_plan(domain, items)
    assert replay.run_plan(domain, plan_id, max_items=1).applied == 1
    before = inbox_snapshot(domain)
    assert replay.cancel_plan(domain, plan_id, "not needed after all") == "cancelled"
    assert domain.execute("SELECT count(*) FROM inbox.retention_hold").fetchone() == (0,)
    assert inbox_snapshot(domain) == before, "cancelling deletes no inbox row"
    counts = domain.execute(
        "SELECT status, reason_code, count(*) FROM inbox.replay_item GROUP BY 1, 2 ORDER BY 1"
    ).fetchall()
    assert counts == [("applied", None, 1), ("skipped", "cancelled", 3)]
    with pytest.raises(replay.ReplayError) as refused:
        replay.run_plan(domain, plan_id)
    assert refused.value.sqlstate == "55000"
    assert len(per_message(domain)) == 1


def test_a_failing_item_rolls_back_and_the_plan_goes_on(domain: Conn) -> None:
    items = deliver_history(domain, 5)
    # A sixth message whose payload makes the compensation raise.
    bad = {
        "producer": "shop",
        "message_id": "m-bad",
        "tenant": "",
        "payload": {"account": 1, "amount": 10, "bonus": 1, "poison": True},
    }
    domain.execute(
        "SELECT inbox.claim_and_apply('billing', 'shop', 'm-bad', 'credit', %s)", (json.dumps(bad["payload"]),)
    )
    plan_id = new_plan(domain, [*items[:2], bad, *items[2:]])
    result = replay.run_plan(domain, plan_id, max_items=100)
    assert (result.status, result.applied, result.failed, result.pending) == ("completed", 5, 1, 0)
    row = domain.execute(
        "SELECT status, reason_code, error_message FROM inbox.replay_item WHERE message_id = 'm-bad'"
    ).fetchone()
    assert row == ("failed", "23514", "cannot compensate m-bad")
    assert "m-bad" not in per_message(domain), "the failed item's writes rolled back"
    assert domain.execute(
        "SELECT count(*) FROM inbox.message WHERE consumer = %s", (f"replay:{plan_id}",)
    ).fetchone() == (5,), "and its operation id was not claimed"


# --------------------------------------------------------------------------- the CLI


def test_cli_workflow(domain: Conn, db_dsn: str) -> None:
    items = deliver_history(domain, 4)
    domain.execute(f"SELECT inbox.register_handler('billing', 'credit', '{FIX}', 'fix-1')")
    created = cli(
        "replay",
        "create",
        "cli-plan",
        "--consumer",
        "billing",
        "--message-type",
        "credit",
        "--handler",
        FIX,
        "--handler-version",
        "fix-1",
        "--note",
        "bonus",
        "--dsn",
        db_dsn,
    )
    assert created.exit_code == 0, created.output
    lines = "\n".join(json.dumps(i) for i in items) + "\n"
    added = cli("replay", "add", "cli-plan", "-", "--json", "--dsn", db_dsn, input=lines)
    assert added.exit_code == 0, added.output
    assert json.loads(added.output)["added"] == 4
    bad = cli(
        "replay", "add", "cli-plan", "--dsn", db_dsn, input=json.dumps({**items[0], "payload": {"other": 1}}) + "\n"
    )
    assert bad.exit_code == 1 and "IR003" in bad.output.splitlines()[0], bad.output
    assert all(line.startswith("  ") for line in bad.output.strip().splitlines()[1:]), bad.output

    ran = cli("replay", "run", "cli-plan", "--max-items", "2", "--dsn", db_dsn)
    assert ran.exit_code == 0 and "applied 2" in ran.output, ran.output
    domain.execute(f"SELECT inbox.register_handler('billing', 'credit', '{FIX2}', 'fix-2')")
    stopped = cli("replay", "run", "cli-plan", "--until-done", "--dsn", db_dsn)
    assert stopped.exit_code == 3 and "IR001" in stopped.output, stopped.output
    status = cli("replay", "status", "cli-plan", "--json", "--dsn", db_dsn)
    plan = json.loads(status.output)["plans"][0]
    assert (plan["status"], plan["pending"], plan["applied"]) == ("stopped_version_changed", 2, 2)
    assert [d["decision"] for d in plan["decisions"]][-1] == "stopped_version_changed"
    accepted = cli(
        "replay",
        "accept-version",
        "cli-plan",
        "--handler",
        FIX2,
        "--handler-version",
        "fix-2",
        "--note",
        "reviewed",
        "--dsn",
        db_dsn,
    )
    assert accepted.exit_code == 0, accepted.output
    done = cli("replay", "run", "cli-plan", "--until-done", "--dsn", db_dsn)
    assert done.exit_code == 0 and "completed" in done.output, done.output
    # Idempotent for cron: running a completed plan again succeeds and says so.
    again = cli("replay", "run", "cli-plan", "--until-done", "--dsn", db_dsn)
    assert again.exit_code == 0, again.output
    assert "already completed at " in again.output and "nothing to run" in again.output, again.output
    again_json = json.loads(cli("replay", "run", "cli-plan", "--json", "--dsn", db_dsn).output)
    assert (again_json["already_completed"], again_json["applied_now"], again_json["applied"]) == (True, 0, 4)
    listing = cli("replay", "status", "--dsn", db_dsn)
    assert "cli-plan" in listing.output and "completed" in listing.output
    cancelled = cli("replay", "cancel", "cli-plan", "--note", "late", "--dsn", db_dsn)
    assert cancelled.exit_code == 1 and "55000" in cancelled.output, cancelled.output
    assert set(per_message(domain).values()) == {1} and len(per_message(domain)) == 4


def test_cli_run_counts_this_runs_failed_and_skipped_items_by_reason(domain: Conn, db_dsn: str) -> None:
    """`replay run` says why: this run's skipped items per reason, explained, and its failed items
    per reason code; a later run does not count the earlier run's items again."""
    items = deliver_history(domain, 4)
    bad = {
        "producer": "shop",
        "message_id": "m-bad",
        "tenant": "",
        "payload": {"account": 1, "amount": 10, "bonus": 1, "poison": True},
    }
    domain.execute(
        "SELECT inbox.claim_and_apply('billing', 'shop', 'm-bad', 'credit', %s)", (json.dumps(bad["payload"]),)
    )
    plan_id = new_plan(domain, [])  # registers fix-1
    # Processed with the pinned version already (fix-1 is the registered handler now): skipped.
    same = {
        "producer": "shop",
        "message_id": "m-same",
        "tenant": "",
        "payload": {"account": 2, "amount": 1, "bonus": 1},
    }
    domain.execute(
        "SELECT inbox.claim_and_apply('billing', 'shop', 'm-same', 'credit', %s)", (json.dumps(same["payload"]),)
    )
    assert replay.add_items(domain, plan_id, [items[0], same, items[1], bad, items[2], items[3]]) == 6

    first = cli("replay", "run", str(plan_id), "--max-items", "3", "--dsn", db_dsn)
    assert first.exit_code == 0, first.output
    lines = first.stdout.splitlines()
    assert "this run applied 2, failed 0, skipped 1 (1 call(s))" in lines[0]
    assert lines[1:] == [
        "  skipped same_version: 1 (the message was processed with the pinned version already: it has that "
        "version's effect)"
    ]
    assert first.stderr == ""  # no progress when stderr is not a terminal

    second = cli("replay", "run", str(plan_id), "--max-items", "1", "--until-done", "--json", "--dsn", db_dsn)
    assert second.exit_code == 0, second.output
    this_run = json.loads(second.stdout)["this_run"]
    assert (this_run["applied"], this_run["failed"], this_run["skipped"]) == (2, 1, 0)
    assert this_run["failed_by_reason"] == {"23514": 1}
    assert this_run["skipped_by_reason"] == []  # m-same was skipped by the first run, not this one
    assert json.loads(second.stdout)["totals"] == {"pending": 0, "applied": 4, "failed": 1, "skipped": 1}
    assert set(per_message(domain).values()) == {1} and len(per_message(domain)) == 5  # m-same's own + 4


def test_cli_run_shows_progress_on_a_terminal_only(domain: Conn, db_dsn: str) -> None:
    items = deliver_history(domain, 6)
    plan_id = new_plan(domain, items)
    domain.execute("UPDATE app.slow SET seconds = 0.05")
    command = [*pginbox_command(), "replay", "run", str(plan_id), "--max-items", "1", "--dsn", db_dsn]

    quiet = subprocess.run([*command, "--quiet"], capture_output=True, text=True, timeout=60, check=False)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    logged = subprocess.run([*command, "--progress"], capture_output=True, text=True, timeout=60, check=False)
    assert logged.returncode == 0, logged.stderr
    assert logged.stderr.startswith(f"replay plan {plan_id}: 1 of 5 items (20%), call 1, "), logged.stderr
    assert "\r" not in logged.stderr and len(logged.stderr.splitlines()) == 1

    status, shown = run_on_a_terminal([*command, "--until-done"])
    assert status == 0, shown
    drawn = frames(shown)
    progress = [f for f in drawn if f.startswith(f"replay plan {plan_id}: ") and " items" in f and "call" in f]
    assert [p.split(", ")[0] for p in progress if "items/s" in p] == [
        f"replay plan {plan_id}: {n} of 4 items ({n * 100 // 4}%)" for n in (1, 2, 3, 4)
    ], drawn
    assert any("left" in p for p in progress), progress
    assert "\r\x1b[K" in shown
    assert drawn[-1].startswith(f"replay plan {plan_id}: completed; this run applied 4"), drawn
    assert set(per_message(domain).values()) == {1} and len(per_message(domain)) == 6


def test_a_hold_taken_while_the_purge_runs_keeps_the_row(domain: Conn, db_dsn: str) -> None:
    """The race between add_replay_items and purge_batch: the item's transaction starts after the
    purge's announcement (so the purge does not wait for it) and holds the row's lock, with its
    hold uncommitted, when the purge deletes. The purge must leave that row alone instead of
    waiting for the lock and then deleting a row whose hold has committed meanwhile."""
    items = deliver_history(domain, 2)
    domain.execute(f"SELECT inbox.register_handler('billing', 'credit', '{FIX}', 'fix-1')")
    plan_id = replay.create_plan(domain, "race", "billing", "credit", FIX, "fix-1", "hold during a purge")
    old_enough_to_purge(domain)
    with (
        psycopg.connect(db_dsn, autocommit=True) as older,
        psycopg.connect(db_dsn, autocommit=True) as adder,
        psycopg.connect(db_dsn, autocommit=True) as purger,
    ):
        older.execute("BEGIN")
        older.execute("SELECT 1")  # a transaction from before the announcement: the purge waits for it
        purger.execute("SELECT * FROM inbox.announce_purge('billing')")
        status = purger.execute("SELECT status FROM inbox.purge_batch('billing')").fetchone()
        assert status == ("waiting",)
        adder.execute("BEGIN")
        adder.execute("SELECT inbox.add_replay_items(%s, %s)", (plan_id, json.dumps(items[:1])))
        older.execute("COMMIT")
        purger.execute("SET lock_timeout = '5s'")  # before the fix the delete waited here, then deleted
        rows = purger.execute("SELECT status, rows_deleted FROM inbox.purge_batch('billing')").fetchall()
        assert rows == [("purged", 1)], "only the row nobody was holding is deleted"
        adder.execute("COMMIT")
    assert [r.split(",")[3] for r in inbox_snapshot(domain)] == [items[0]["message_id"]]
    assert domain.execute("SELECT holder FROM inbox.retention_hold").fetchall() == [(f"replay:{plan_id}",)]
