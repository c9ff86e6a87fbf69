"""Metrics: `pginbox metrics serve` scraped over real HTTP as a role with inbox_reader only,
`pginbox stats --json`, the InboxCollector after a real serialization-failure retry, a database
that cannot be reached, and the alert rules (every metric they name is served)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import yaml  # typed by types-PyYAML (dev extras, through django-stubs)
from helpers_inbox import SAFE_OPTIONS, setup_domain
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import IsolationLevel
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool

from pginbox import Inbox, Message, Outcome, RetryPolicy
from pginbox.consumer import Consumer, load_consume_config
from pginbox.ops.metrics import DatabaseCollector, InboxCollector

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "docs" / "alerts" / "pginbox.rules.yml"
PGINBOX = [sys.executable, "-m", "pginbox"]

Conn = psycopg.Connection[Any]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Prometheus text format -> {(sample name, labels): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(found: Samples, name: str, **labels: str) -> float:
    return found[(name, frozenset(labels.items()))]


@contextlib.contextmanager
def login_role(conn: Conn, db_dsn: str, group: str) -> Iterator[str]:
    """The conninfo of a new login role in `group` only (cluster-wide: dropped afterwards)."""
    role = f"metrics_{group}_{uuid.uuid4().hex[:8]}"
    conn.execute(f'CREATE ROLE "{role}" LOGIN IN ROLE {group}')
    try:
        yield make_conninfo(db_dsn, user=role)
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


@pytest.fixture
def reader_dsn(conn: Conn, db_dsn: str) -> Iterator[str]:
    """A login role with inbox_reader only."""
    with login_role(conn, db_dsn, "inbox_reader") as dsn:
        yield dsn


def traffic(conn: Conn) -> None:
    """Committed claims: 2 first-seen (shop), 1 duplicate, 1 conflict, 1 failure 'bad_account'."""
    conn.execute("SELECT inbox.configure_metrics(rollup_grace => '0')")
    for sql in [
        "SELECT inbox.claim('billing', 'shop', 'm1', '{\"a\": 1}')",
        "SELECT inbox.claim('billing', 'shop', 'm2', '{\"a\": 2}', produced_at => now())",
        "SELECT inbox.claim('billing', 'shop', 'm1', '{\"a\": 1}')",
        "SELECT inbox.claim('billing', 'shop', 'm2', '{\"a\": 3}')",
        "SELECT inbox.record_failure('billing', 'crm', 'x1', '{}', 'bad_account')",
    ]:
        conn.execute(sql)


def start_serve(dsn: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [*PGINBOX, "metrics", "serve", "--port", "0", "--dsn", dsn],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    match = re.search(r"serving (http://\S+)", line)
    if not match:
        proc.kill()
        _, rest = proc.communicate()
        raise AssertionError(f"no 'serving' line: {line!r} {rest}")
    return proc, match.group(1)


def test_metrics_serve_over_http(conn: Conn, reader_dsn: str) -> None:
    traffic(conn)
    proc, url = start_serve(reader_dsn)
    try:
        response = httpx.get(url, timeout=30)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        found = samples(response.text)
        shop = {"consumer": "billing", "producer": "shop"}
        assert value(found, "pginbox_database_up") == 1
        assert value(found, "pginbox_first_seen_total", **shop) == 2
        assert value(found, "pginbox_duplicates_total", **shop) == 1
        assert value(found, "pginbox_identity_conflicts_total", **shop) == 1
        assert value(found, "pginbox_unprotected_deliveries_total", **shop) == 1
        assert (
            value(
                found, "pginbox_handler_failures_total", consumer="billing", producer="crm", reason_code="bad_account"
            )
            == 1
        )
        assert value(found, "pginbox_quarantine_open", consumer="billing", kind="conflict") == 1
        # A second scrape counts nothing twice; a new duplicate is there at once (no grace for events).
        conn.execute("SELECT inbox.claim('billing', 'shop', 'm1', '{\"a\": 1}')")
        again = samples(httpx.get(url, timeout=30).text)
        assert value(again, "pginbox_first_seen_total", **shop) == 2
        assert value(again, "pginbox_duplicates_total", **shop) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err


def test_stats_json(conn: Conn, db_dsn: str) -> None:
    traffic(conn)
    done = subprocess.run(
        [*PGINBOX, "stats", "--json", "--dsn", db_dsn],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    shop = next(e for e in summary["by_producer"] if e["producer"] == "shop")
    assert (shop["first_seen"], shop["duplicates"], shop["conflicts"], shop["quarantined"]) == (2, 1, 1, 1)
    assert summary["failures_by_reason"] == [
        {"consumer": "billing", "producer": "crm", "reason_code": "bad_account", "failures": 1}
    ]
    assert summary["quarantine_open"] == [{"consumer": "billing", "kind": "conflict", "open": 1}]
    assert summary["inbox"]["metrics_counting_enabled"] == 1
    text = subprocess.run(
        [*PGINBOX, "stats", "--dsn", db_dsn], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
    )
    assert text.returncode == 0 and "bad_account" in text.stdout and "billing" in text.stdout


def test_stats_needs_the_reader_role(conn: Conn, db_dsn: str) -> None:
    """A consumer may not read metrics: one clear line with the SQLSTATE, no traceback, and the
    group role that may (issue 26)."""
    with login_role(conn, db_dsn, "inbox_consumer") as consumer_dsn:
        done = subprocess.run(
            [*PGINBOX, "stats", "--dsn", consumer_dsn],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )
    assert done.returncode != 0
    first, *rest = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    assert first == "Error: permission denied for function metrics [SQLSTATE 42501 insufficient_privilege]"
    assert len(rest) == 1 and rest[0].startswith("  needs: the inbox_reader group role"), rest
    assert "GRANT inbox_reader TO " in rest[0]


def test_database_collector_reports_an_outage() -> None:
    collector = DatabaseCollector("host=127.0.0.1 port=1 dbname=x user=x", timeout=2)
    registry = CollectorRegistry()
    registry.register(collector)
    found = samples(generate_latest(registry).decode())
    assert value(found, "pginbox_database_up") == 0
    assert collector.last_error is not None
    assert not any(name.startswith("pginbox_first_seen") for name, _ in found)


def test_inbox_collector_after_a_real_retry(db_dsn: str, conn: Conn) -> None:
    """Two Inboxes at REPEATABLE READ credit one account row after both read it: one gets a real
    40001 and re-runs; the collector exports the retry and its lock wait."""
    setup_domain(conn)
    barrier = threading.Barrier(2, timeout=20)
    first: set[int] = set()
    lock = threading.Lock()
    inboxes: list[Inbox] = []

    def handler(cur: psycopg.Cursor[Any], m: Message) -> None:
        cur.execute("SELECT balance FROM account WHERE id = 1")
        with lock:
            wait = threading.get_ident() not in first
            first.add(threading.get_ident())
        if wait:
            barrier.wait()
        cur.execute("UPDATE account SET balance = balance + 1 WHERE id = 1")

    def run(message_id: str) -> Outcome:
        with psycopg.connect(db_dsn, options=SAFE_OPTIONS) as c:
            c.isolation_level = IsolationLevel.REPEATABLE_READ
            inbox = Inbox(c, consumer="billing", retry=RetryPolicy(max_attempts=5, base_delay=0.005, max_delay=0.05))
            with lock:
                inboxes.append(inbox)
            return inbox.handle(Message("shop", message_id, "credit", {"n": message_id}), handler).outcome

    threads_out: list[Outcome] = []
    workers = [threading.Thread(target=lambda i=i: threads_out.append(run(f"r{i}"))) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert threads_out == [Outcome.APPLIED, Outcome.APPLIED]
    registry = CollectorRegistry()
    for inbox in inboxes:
        registry.register(InboxCollector(inbox, consumer=f"billing-{id(inbox)}"))
    found = samples(generate_latest(registry).decode())
    retries = sum(v for (name, _), v in found.items() if name == "pginbox_client_retries_total")
    errors = sum(
        v
        for (name, labels), v in found.items()
        if name == "pginbox_client_transient_errors_total" and ("sqlstate", "40001") in labels
    )
    lock_wait = sum(v for (name, _), v in found.items() if name == "pginbox_client_lock_wait_seconds_total")
    assert retries >= 1 and errors == retries
    assert lock_wait > 0
    applied = sum(
        v
        for (name, labels), v in found.items()
        if name == "pginbox_client_outcomes_total" and ("outcome", "applied") in labels
    )
    assert applied == 2
    assert conn.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (2,)


def rule_metric_names() -> set[str]:
    rules = yaml.safe_load(RULES.read_text())
    names: set[str] = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] and rule["expr"] and rule["labels"]["severity"]
            names.update(re.findall(r"\bpginbox_[a-z0-9_]+\b", rule["expr"]))
    return names


def test_alert_rules_name_only_served_metrics(conn: Conn, db_dsn: str) -> None:
    """Every metric an alert expression names is served by DatabaseCollector + InboxCollector,
    once the database has something of each kind: traffic, a dead and a pending effect, a fenced
    report, an expired delivery, a purge."""
    traffic(conn)
    conn.execute("""
        INSERT INTO inbox.outbox (effect_id, destination, payload, payload_sha256, status)
        VALUES ('e1', 'hooks', '{}', '\\x00', 'pending'), ('e2', 'hooks', '{}', '\\x00', 'dead');
        INSERT INTO inbox.outbox_fenced_report (effect_id, lease_token, report) VALUES ('e1', 7, 'complete');
        INSERT INTO inbox.quarantine (consumer, tenant, producer, message_id, kind, reason_code, handler_version)
        VALUES ('billing', '', 'shop', 'old', 'expired', 'expired', 'v1');
        SELECT inbox.set_retention_policy('billing', '', '7 days', '1 day', '0', '0', '0', '0', '0', '1 day', 'test');
        INSERT INTO inbox.purge_state (consumer, producer, purged_before, last_purge_at, rows_purged)
        VALUES ('billing', '', now() - interval '8 days', now(), 5);
    """)
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(db_dsn))
    with psycopg.connect(db_dsn) as c:
        registry.register(InboxCollector(Inbox(c, consumer="billing")))
        served = {name for name, _ in samples(generate_latest(registry).decode())}
    # The consumer process's own metrics (PginboxConsumerHalted), served by `pginbox consume`.
    settings = {"consumer": "billing", "url": "memory://rules", "queue": "rules"}
    consumer = Consumer(load_consume_config(None, settings), db_dsn)
    served |= {name for name, _ in samples(generate_latest(consumer.registry).decode())}
    used = rule_metric_names()
    assert "pginbox_consumer_halted" in used
    assert len(used) >= 15
    assert used <= served, f"alert rules name metrics that are not served: {sorted(used - served)}"


def test_metrics_doc_lists_every_served_metric(conn: Conn, db_dsn: str) -> None:
    """docs/metrics.md names every family inbox.metrics() can serve (read from the SQL source)."""
    source = (ROOT / "sql" / "095_metrics.sql").read_text()
    families = set(re.findall(r"'(pginbox_[a-z0-9_]+)'", source))
    collectors = ROOT / "python" / "pginbox" / "ops" / "metrics.py"
    families |= set(re.findall(r'"(pginbox_[a-z0-9_]+)"', collectors.read_text()))
    doc = (ROOT / "docs" / "metrics.md").read_text()
    missing = sorted(f for f in families if f not in doc)
    assert not missing, f"docs/metrics.md does not mention {missing}"
    assert len(families) >= 25
    assert os.path.exists(RULES)


def test_rollup_only_at_read_committed(conn: Conn) -> None:
    """At REPEATABLE READ an older snapshot could fold rows twice: the explicit rollup refuses with
    25000, and inbox.metrics() reads without folding (the events still count)."""
    traffic(conn)
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    with pytest.raises(psycopg.errors.InvalidTransactionState, match="READ COMMITTED"):
        conn.execute("SELECT inbox.metrics_rollup()")
    conn.execute("ROLLBACK")
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    row = conn.execute(
        "SELECT value FROM inbox.metrics() WHERE metric = 'pginbox_duplicates_total' AND labels ->> 'producer' = 'shop'"
    ).fetchone()
    conn.execute("COMMIT")
    assert row == (1.0,)
    assert conn.execute("SELECT count(*) FROM inbox.metric_event").fetchone() == (2,)  # duplicate + failure
    conn.execute("SELECT count(*) FROM inbox.metrics()")  # READ COMMITTED: folds them
    assert conn.execute("SELECT count(*) FROM inbox.metric_event").fetchone() == (0,)


def test_metrics_configure_and_rollup_commands(conn: Conn, db_dsn: str) -> None:
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*PGINBOX, "metrics", *argv, "--dsn", db_dsn],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )

    done = run("configure", "--no-counting", "--grace", "1 minute", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) | {"updated_at": None, "updated_by": None} == {
        "counting": False,
        "rollup_grace": "00:01:00",
        "rollup_batch": 500000,
        "updated_at": None,
        "updated_by": None,
    }
    conn.execute("SELECT inbox.claim('billing', 'shop', 'm1', '{}')")
    conn.execute("SELECT inbox.claim('billing', 'shop', 'm1', '{}')")
    assert conn.execute("SELECT count(*) FROM inbox.metric_event").fetchone() == (0,)  # counting is off
    bad = run("configure", "--batch", "5")
    first, *rest = bad.stderr.strip().splitlines()
    assert bad.returncode != 0 and "[SQLSTATE 22023 invalid_parameter_value]" in first
    assert rest == ["  HINT: It bounds the work of one call; the rollup lag metric says when it falls behind."], rest
    conn.execute("UPDATE inbox.message SET processed_at = processed_at - interval '2 minutes'")
    done = run("rollup")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "folded 1 rows and events"


def test_database_collector_over_a_pool(conn: Conn, db_dsn: str) -> None:
    """The collector borrows a pool connection per scrape and gives it back idle."""
    traffic(conn)
    with ConnectionPool(db_dsn, min_size=1, max_size=1, open=True) as pool:
        registry = CollectorRegistry()
        registry.register(DatabaseCollector(pool))
        for expected in (1, 2):
            found = samples(generate_latest(registry).decode())
            assert value(found, "pginbox_database_up") == 1
            assert value(found, "pginbox_duplicates_total", consumer="billing", producer="shop") == expected
            conn.execute("SELECT inbox.claim('billing', 'shop', 'm1', '{\"a\": 1}')")
        with pool.connection() as c:
            assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_dispatcher_serves_the_database_metrics_when_asked(conn: Conn, db_dsn: str) -> None:
    """`pginbox dispatch --health-port P --database-metrics`: one /metrics with the dispatcher's
    own counters and inbox.metrics(); without the flag, only the dispatcher's."""
    traffic(conn)
    for flag in (["--database-metrics"], []):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [
                *PGINBOX,
                "--dsn",
                db_dsn,
                "dispatch",
                "--health-port",
                str(port),
                *flag,
                "--callable",
                "sink=builtins:print",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.1)
            assert response.status_code == 200
            found = samples(response.text)
            assert any(name.startswith("pginbox_dispatcher_") for name, _ in found)
            if flag:
                assert value(found, "pginbox_database_up") == 1
                assert value(found, "pginbox_duplicates_total", consumer="billing", producer="shop") == 1
            else:
                assert not any(name == "pginbox_database_up" for name, _ in found)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)


def _stats(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*PGINBOX, "stats", *args, "--dsn", dsn], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done


def test_stats_is_honest_about_the_row_estimate(conn: Conn, db_dsn: str) -> None:
    """4,000 rows and no ANALYZE yet: stats says there is no estimate (JSON null), not 0; --count
    counts them (also for a reader); after ANALYZE the estimate comes with its time."""
    conn.execute("ALTER TABLE inbox.message SET (autovacuum_enabled = false)")  # no ANALYZE behind our back
    conn.execute(
        "INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version)"
        " SELECT 'billing', '', 'shop', 'm-' || i, '\\x00', 'v1' FROM generate_series(1, 4000) i"
    )
    assert conn.execute("SELECT reltuples FROM pg_class WHERE oid = 'inbox.message'::regclass").fetchone() == (-1,)

    before = json.loads(_stats(db_dsn, "--json").stdout)["inbox"]
    assert before["inbox_rows_estimate"] is None and before["inbox_rows_estimate_at"] is None
    assert "inbox_rows" not in before
    text = _stats(db_dsn).stdout
    assert "inbox_rows_estimate: no estimate (inbox.message not analyzed yet" in text
    assert "inbox_rows_estimate: 0" not in text
    # The exported gauge has no sample either (0.1.0 exported 0: an empty inbox).
    estimate = "SELECT value FROM inbox.metrics() WHERE metric = 'pginbox_inbox_rows_estimate'"
    assert conn.execute(estimate).fetchall() == []
    with login_role(conn, db_dsn, "inbox_reader") as reader_dsn:
        counted = json.loads(_stats(reader_dsn, "--json", "--count").stdout)["inbox"]
        assert counted["inbox_rows"] == 4000 and counted["inbox_rows_estimate"] is None
        assert "inbox_rows: 4000 (counted)" in _stats(reader_dsn, "--count").stdout

    conn.execute("ANALYZE inbox.message")
    after = json.loads(_stats(db_dsn, "--json").stdout)["inbox"]
    assert after["inbox_rows_estimate"] == 4000
    assert conn.execute(estimate).fetchall() == [(4000,)]
    analyzed = datetime.datetime.fromisoformat(after["inbox_rows_estimate_at"])
    assert abs((datetime.datetime.now(datetime.UTC) - analyzed).total_seconds()) < 60
    assert "inbox_rows_estimate: 4000 (ANALYZE/VACUUM at " in _stats(db_dsn).stdout
