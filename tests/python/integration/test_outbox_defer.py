"""Deployment-order incidents of the outbox (issue 26): a destination with no transport configured
is deferred (inbox.defer_effects, sql/125_outbox_defer.sql) — pending, no attempt spent, the
reason visible in `outbox list`, the dispatcher's health and metrics — instead of going dead; only
the lease's holder may defer it. The broker cases (RabbitMQ unroutable, JetStream without a
stream) are in test_broker_transports.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from helpers_paths import pythonpath
from prometheus_client import generate_latest

from pginbox.cli import main
from pginbox.dispatcher import CallableTransport, Dispatcher

Conn = psycopg.Connection[tuple[Any, ...]]
DEFER = "SELECT * FROM inbox.defer_effects(%s::text[], %s::bigint[], %s::text[], %s::text[], %s::interval)"


def enqueue(conn: Conn, effect_id: str, destination: str) -> None:
    conn.execute("SELECT inbox.enqueue_effect(%s, %s, '{}'::jsonb)", (effect_id, destination))


def row(conn: Conn, effect_id: str) -> tuple[Any, ...]:
    found = conn.execute(
        "SELECT status::text, attempts, deferred_reason, deferrals, last_error, dead_reason::text "
        "FROM inbox.outbox WHERE effect_id = %s",
        (effect_id,),
    ).fetchone()
    assert found is not None
    return tuple(found)


def test_a_destination_without_transport_waits_visibly_and_spends_no_attempt(conn: Conn, db_dsn: str) -> None:
    conn.execute("SELECT inbox.configure_destination('sms', 2, '10 milliseconds', '20 milliseconds')")
    enqueue(conn, "s-1", "sms")
    enqueue(conn, "k-1", "sink")
    delivered: list[str] = []
    sink = CallableTransport(lambda effect: delivered.append(effect.effect_id))
    with Dispatcher(db_dsn, "only-sink", {"sink": sink}, defer_after=1.0) as dispatcher:
        for _ in range(4):  # twice max_attempts: still pending
            dispatcher.run_once()
            conn.execute("UPDATE inbox.outbox SET available_at = now() WHERE effect_id = 's-1'")
        assert delivered == ["k-1"]
        status, attempts, reason, deferrals, error, dead = row(conn, "s-1")
        assert (status, attempts, reason, deferrals, dead) == ("pending", 0, "no_transport", 4, None)
        assert error == "no transport for destination 'sms' in dispatcher only-sink"
        health = dispatcher.health()[1]
        assert health["counters"]["deferred"] == 4 and health["counters"]["dead"] == 0
        assert health["deferring"] == {"sms": "no_transport"}
        metrics = generate_latest(dispatcher.registry).decode()
        assert 'pginbox_dispatcher_deferred_total{destination="sms"} 4.0' in metrics
        assert 'pginbox_dispatcher_delivered_total{destination="sink"} 1.0' in metrics
        assert 'pginbox_dispatcher_dead_total{destination="sink"} 0.0' in metrics, "every series from the start"

    listing = CliRunner().invoke(main, ["outbox", "list", "--status", "pending", "--dsn", db_dsn])
    assert listing.exit_code == 0, listing.output
    line = next(x for x in listing.stdout.splitlines() if x.startswith("s-1 "))
    assert "deferred no_transport x4: no transport for destination 'sms'" in line, line
    shown = json.loads(CliRunner().invoke(main, ["outbox", "show", "s-1", "--json", "--dsn", db_dsn]).stdout)
    assert (shown["deferred_reason"], shown["deferrals"], shown["attempts"]) == ("no_transport", 4, 0)

    # The transport is configured: the next dispatcher delivers it, with its attempts intact.
    with Dispatcher(db_dsn, "with-sms", {"sink": sink, "sms": sink}) as dispatcher:
        conn.execute("UPDATE inbox.outbox SET available_at = now() WHERE effect_id = 's-1'")
        assert dispatcher.run_once() == 1
    assert delivered == ["k-1", "s-1"] and row(conn, "s-1")[:2] == ("delivered", 1)
    after = CliRunner().invoke(main, ["outbox", "list", "--dsn", db_dsn])
    assert "deferred" not in after.stdout, "a delivered effect is no longer shown as deferred"


def test_only_the_lease_holder_defers_and_bad_input_is_refused(conn: Conn, login_role: Callable[..., str]) -> None:
    holder_dsn, other_dsn, reader_dsn = (
        login_role("inbox_dispatcher"),
        login_role("inbox_dispatcher"),
        login_role("inbox_reader"),
    )
    enqueue(conn, "h-1", "mail")
    with psycopg.connect(holder_dsn, autocommit=True) as holder, psycopg.connect(other_dsn, autocommit=True) as other:
        claimed = holder.execute(
            "SELECT effect_id, lease_token, attempts FROM inbox.claim_effects('h', 1, key_aware => true)"
        ).fetchall()
        assert [(c[0], c[2]) for c in claimed] == [("h-1", 1)]
        token = claimed[0][1]
        args = (["h-1"], [token], ["no_transport"], ["not configured"], "5 seconds")
        fenced = other.execute(DEFER, args).fetchall()
        assert [(r[3], r[4]) for r in fenced] == [("fenced", "not_lease_holder")]
        assert row(conn, "h-1")[:2] == ("leased", 1)
        for bad, state, fragment in [
            ((["h-1"], [token], ["Not A Code"], ["x"], "5 seconds"), "22023", "reason must be a code"),
            ((["h-1"], [token], [None], ["x"], "5 seconds"), "22004", "reason must be a code"),
            ((["h-1"], [token], ["no_transport"], ["x"], "0"), "22023", "retry_after must be between"),
            ((["h-1"], [token], ["a", "b"], ["x"], "5 seconds"), "22023", "reasons has 2 elements"),
            ((["h-1"], [token], ["no_transport"], [" "], "5 seconds"), "22023", "error must say what went wrong"),
        ]:
            with pytest.raises(psycopg.Error) as refused:
                holder.execute(DEFER, bad)
            assert refused.value.sqlstate == state and fragment in str(refused.value), (bad, refused.value)
        assert row(conn, "h-1")[:2] == ("leased", 1), "nothing written by a refused call"
        done = holder.execute(DEFER, args).fetchall()
        assert [r[3] for r in done] == ["pending"]
        again = holder.execute(DEFER, args).fetchall()
        assert [(r[3], r[4]) for r in again] == [("fenced", "not_leased")], "a lease is deferred once"
    assert row(conn, "h-1")[:4] == ("pending", 0, "no_transport", 1)
    available = conn.execute("SELECT available_at - now() FROM inbox.outbox WHERE effect_id = 'h-1'").fetchone()
    assert available is not None and 3 < available[0].total_seconds() <= 5
    with psycopg.connect(reader_dsn, autocommit=True) as reader:
        assert reader.execute("SELECT deferred_reason, deferrals FROM inbox.outbox").fetchall() == [("no_transport", 1)]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute(DEFER, args)


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_sighup_reloads_destinations_without_dropping_leases(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    """A destination added to --config reaches a running dispatcher on SIGHUP: its deferred effect
    is delivered, while a delivery in flight during the reload finishes on its lease."""
    sink = tmp_path / "sink"
    config = tmp_path / "destinations.toml"
    config.write_text('[destinations.sink]\ncallable = "_dispatch_sink:slow_record"\n')
    enqueue(conn, "a-1", "sink")
    enqueue(conn, "b-1", "later")
    env = {
        **os.environ,
        "PGINBOX_TEST_SINK": str(sink),
        "PYTHONPATH": pythonpath(),
    }
    script = Path(sys.executable).parent / "pginbox"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "pginbox"]
    log = tmp_path / "dispatch.log"
    with open(log, "w") as err, open(tmp_path / "dispatch.out", "w") as out:
        proc = subprocess.Popen(
            [
                *command,
                "--dsn",
                db_dsn,
                "dispatch",
                "--name",
                "reloading",
                "--config",
                str(config),
                "--defer-after",
                "1",
                "--poll-interval",
                "0.2",
            ],
            stdout=out,
            stderr=err,
            env=env,
        )
    try:
        _wait(lambda: _lines(Path(str(sink) + ".started")) == ["a-1"], "a-1 in flight")
        _wait(lambda: row(conn, "b-1")[2:4] == ("no_transport", 1), "b-1 deferred")
        assert row(conn, "a-1")[0] == "leased" and _lines(sink) == [], "a-1 still in flight"
        config.write_text(config.read_text() + '[destinations.later]\ncallable = "_dispatch_sink:record"\n')
        proc.send_signal(signal.SIGHUP)
        _wait(lambda: sorted(_lines(sink)) == ["a-1", "b-1"], "both delivered")
        _wait(lambda: row(conn, "b-1")[0] == "delivered" and row(conn, "a-1")[0] == "delivered", "reports")
        assert proc.poll() is None, "SIGHUP does not stop the dispatcher"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "reloaded dispatcher=reloading destinations=later,sink added=later removed=-" in text, text[-3000:]
    assert "report_fenced" not in text, "the lease of the delivery in flight was kept"
    assert row(conn, "a-1")[:2] == ("delivered", 1) and row(conn, "b-1")[:4] == ("delivered", 1, "no_transport", 1)
    assert _lines(sink).count("a-1") == 1


def test_dispatch_once_says_which_destinations_are_not_ready(conn: Conn, db_dsn: str) -> None:
    enqueue(conn, "w-1", "sms")
    result = CliRunner().invoke(main, ["--dsn", db_dsn, "dispatch", "--once", "--callable", "sink=json:dumps"])
    assert result.exit_code == 0, result.output
    assert "deferred=1" in result.stdout and "dead=0" in result.stdout
    assert (
        "pginbox dispatch: effects wait, no attempt spent, for destinations not ready: sms (no_transport)"
        in result.stderr
    ), result.stderr
    assert row(conn, "w-1")[:3] == ("pending", 0, "no_transport")
