"""`pginbox doctor` against a real database: a deployment with one of each thing that can be
wrong is reported in plain words with exit 2; fixed, exit 0; warnings only, exit 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
from click.testing import CliRunner, Result

from pginbox.cli import main

Conn = psycopg.Connection[tuple[Any, ...]]


def doctor(dsn: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["doctor", "--dsn", dsn, *args], catch_exceptions=True)


def lines_of(result: Result, label: str) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith(label)]


def test_a_clean_deployment_passes(db_dsn: str) -> None:
    result = doctor(db_dsn)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("pginbox doctor: all checks passed\n")
    assert not lines_of(result, "PROBLEM") and not lines_of(result, "WARNING")


def test_everything_wrong_is_said_in_plain_words(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    # A consumer with a handler and nobody bound; a legacy binding left by the 0.1.0 upgrade.
    conn.execute("CREATE FUNCTION noop(payload jsonb) RETURNS void LANGUAGE sql AS ''")
    conn.execute("SELECT inbox.register_handler('billing', 'credit', 'noop(jsonb)'::regprocedure, 'v1')")
    conn.execute(
        "INSERT INTO inbox.consumer_binding (consumer, role, legacy, note) "
        "VALUES ('shipping', 'inbox_consumer'::regrole, true, 'upgrade')"
    )
    # A destination configured and nobody bound; effects waiting for a transport and a queue; dead ones.
    conn.execute("SELECT inbox.configure_destination('fax', 5, '1 second', '1 minute')")
    conn.execute(
        "SELECT inbox.bind_destination('sms', '*', 't'), inbox.bind_destination('orders', '*', 't'),"
        " inbox.bind_destination('mail', '*', 't')"
    )
    for effect_id, destination in (("s-1", "sms"), ("o-1", "orders"), ("m-1", "mail"), ("m-2", "mail")):
        conn.execute("SELECT inbox.enqueue_effect(%s, %s, '{}'::jsonb)", (effect_id, destination))
    conn.execute(
        "UPDATE inbox.outbox SET deferred_reason = 'no_transport', deferred_at = now(), deferrals = 3 "
        "WHERE effect_id = 's-1'"
    )
    conn.execute(
        "UPDATE inbox.outbox SET deferred_reason = 'unroutable', deferred_at = now(), deferrals = 1 "
        "WHERE effect_id = 'o-1'"
    )
    conn.execute(
        "UPDATE inbox.outbox SET status = 'dead', dead_reason = 'max_attempts', attempts = 8 WHERE destination = 'mail'"
    )
    # A 0.2.0-era policy whose window cannot hold its margin (set_retention_policy refuses it now).
    conn.execute(
        "INSERT INTO inbox.retention_policy VALUES ('billing', '', '10 minutes', '0', '0', '0', '0', '0', "
        "'0', '50 minutes', 'old policy')"
    )

    config = tmp_path / "destinations.toml"
    config.write_text('[destinations.mail]\ncallable = "json:dumps"\n')
    result = doctor(db_dsn, "--config", str(config))
    assert result.exit_code == 2, result.output
    out = result.stdout
    assert out.splitlines()[0] == "pginbox doctor: 4 problem(s), 5 warning(s)", out
    expected = [
        "WARNING  consumers: 1 consumer(s) nobody is bound to: 'billing'",
        "WARNING  legacy bindings: 1 legacy binding(s) left by the upgrade from 0.1.0 ('shipping')",
        "WARNING  destination bindings: 1 destination(s) no consumer is bound to: 'fax'",
        "PROBLEM  dispatcher configuration: no dispatcher has a transport for 1 destination(s) ('sms': 1 effect(s)",
        "PROBLEM  dispatcher configuration: effects wait for destination(s) the given configuration does not have: "
        "'orders'",
        "WARNING  broker routing: the broker cannot route effects yet ('orders' unroutable: 1 effect(s)",
        "PROBLEM  dead effects: 2 dead effect(s), never delivered ('mail': max_attempts 2)",
        "PROBLEM  retention margin: 1 retention window(s) cannot hold their safety margin (billing/*: window 1h, "
        "margin 50m)",
        "WARNING  purge: the purge has not run (never purged: 'billing')",
    ]
    for start in expected:
        assert any(line.startswith(start) for line in out.splitlines()), f"{start!r} not in:\n{out}"
    assert "fix: `pginbox outbox redrive --destination mail --note '...'`" not in out
    assert "then `pginbox outbox redrive --destination mail --note '...'`" in out
    assert "kill -HUP <dispatcher pid>" in out and "pginbox outbox provision" in out

    as_json = json.loads(doctor(db_dsn, "--json").stdout)
    assert (as_json["exit_code"], as_json["problems"]) == (2, 3), "without --config: one problem less"
    dead = next(f for f in as_json["findings"] if f["check"] == "dead effects")
    assert dead["details"] == [{"destination": "mail", "reason": "max_attempts", "effects": 2}]

    # Fix the problems: only warnings remain, exit 1 (cron can tell the two apart).
    conn.execute("DELETE FROM inbox.retention_policy")
    conn.execute("DELETE FROM inbox.outbox WHERE destination IN ('mail', 'sms', 'orders')")
    warned = doctor(db_dsn, "--quiet")
    assert warned.exit_code == 1, warned.output
    assert warned.stdout.splitlines()[0] == "pginbox doctor: 0 problem(s), 3 warning(s)"
    assert not lines_of(warned, "ok "), "--quiet prints only what is wrong"


def test_standbys_lagging_is_a_problem(db_dsn: str) -> None:
    """--standbys 1 on a primary with no standby: the WAL of now is on no standby, exit 2."""
    result = doctor(db_dsn, "--standbys", "1", "--standby-lag", "0.2", "--quiet")
    assert result.exit_code == 2, result.output
    assert any(
        line.startswith(
            "PROBLEM  standbys: fewer than 1 standby(s) flushed the primary's WAL within 0.2 s (0 connected)"
        )
        for line in result.stdout.splitlines()
    ), result.stdout
    assert "docs/failover.md" in result.stdout
    assert "standbys" not in doctor(db_dsn).stdout, "without --standbys nothing is said of standbys"


def test_standbys_with_a_real_standby(tmp_path: Path) -> None:
    """A primary with a streaming standby: caught up, then its walreceiver SIGSTOPped (lagging), then
    resumed. Run as an inbox_operator login, which holds no monitoring right."""
    from helpers_replication import Golden, ReplicatedPair

    golden = Golden("CREATE ROLE doc_ops LOGIN IN ROLE inbox_operator;")
    try:
        pair = ReplicatedPair(golden)
        try:
            ops = pair.primary.dsn("pginbox") + " user=doc_ops"
            with psycopg.connect(pair.primary_dsn(), autocommit=True) as conn:
                conn.execute("CREATE TABLE t(x int)")
                conn.execute("INSERT INTO t VALUES (1)")
            caught_up = doctor(ops, "--standbys", "1", "--quiet")
            assert caught_up.exit_code == 0, caught_up.output
            pair.stop_wal()
            with psycopg.connect(pair.primary_dsn(), autocommit=True) as conn:
                conn.execute("INSERT INTO t VALUES (2)")
            lagging = doctor(ops, "--standbys", "1", "--standby-lag", "0.5", "--quiet")
            assert lagging.exit_code == 2, lagging.output
            assert (
                "PROBLEM  standbys: fewer than 1 standby(s) flushed the primary's WAL within 0.5 s (1 connected)"
                in lagging.stdout
            ), lagging.stdout
            pair.resume_wal()
            again = doctor(ops, "--standbys", "1", "--quiet")
            assert again.exit_code == 0, again.output
        finally:
            pair.destroy()
    finally:
        golden.destroy()
