"""docs/grafana/pginbox.json, the Grafana dashboard users import: its import structure, and that it
queries only what the code exports. The catalogue of metrics and labels comes from the real
collectors scraped after real traffic (DatabaseCollector over inbox.metrics(), InboxCollector
after a delivery, a Dispatcher after a delivery, `pginbox consume` after a real RabbitMQ queue),
not from a list kept by hand; alert names come
from docs/alerts/pginbox.rules.yml. The check is shown to fail on a misspelled label, metric,
alert name or a missing view."""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml  # typed by types-PyYAML (dev extras, through django-stubs)
from helpers_brokers import ConsumerThread, Out, channel, wait_for
from helpers_inbox import setup_domain
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pginbox import Inbox, Message, Outcome, RetryPolicy
from pginbox.consumer import Consumer, load_consume_config
from pginbox.dispatcher import CallableTransport, Dispatcher
from pginbox.ops.metrics import DatabaseCollector, InboxCollector

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "docs" / "grafana" / "pginbox.json"
RULES = ROOT / "docs" / "alerts" / "pginbox.rules.yml"

Conn = psycopg.Connection[Any]
Exported = dict[str, set[str]]  # sample name -> label names

#: Labels Prometheus adds to every series it scrapes (not exported by the code).
SCRAPE_LABELS = frozenset({"instance", "job"})
#: The views issue 14 asks for: panel title -> metrics its queries must read.
VIEWS = {
    "Inbox outcomes": {
        "pginbox_first_seen_total",
        "pginbox_duplicates_total",
        "pginbox_identity_conflicts_total",
        "pginbox_client_outcomes_total",
    },
    "Duplicates by producer": {"pginbox_duplicates_total"},
    "Identity conflicts": {"pginbox_identity_conflicts_total"},
    "Quarantine in / out": {"pginbox_quarantined_total", "pginbox_quarantine_decisions_total"},
    "Outbox lag": {"pginbox_outbox_pending_oldest_age_seconds", "pginbox_dispatcher_lag_seconds_bucket"},
    "Purge lag": {"pginbox_purge_lag_seconds"},
    "Dispatcher health": {
        "pginbox_dispatcher_delivered_total",
        "pginbox_dispatcher_dead_total",
        "pginbox_dispatcher_in_flight",
    },
    "Broker consumer": {"pginbox_consumer_messages_total", "pginbox_consumer_dead_letters_total"},
}
PROMETHEUS = {"type": "prometheus", "uid": "${datasource}"}

_METRIC = re.compile(r"\b(pginbox_[a-z0-9_]+)\b")
_SELECTOR = re.compile(r"\b(pginbox_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_LABEL_VALUES = re.compile(r"^label_values\(\s*(pginbox_[a-z0-9_]+)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)$")
_ALERT = re.compile(r"\bPginbox[A-Z][A-Za-z]+\b")


def _scrape(registry: CollectorRegistry, into: Exported) -> None:
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            into[sample.name].update(sample.labels)


@pytest.fixture
def exported(conn: Conn, db_dsn: str) -> Exported:
    """Every sample name the code exports, with its label names, after traffic of every kind."""
    conn.execute("SELECT inbox.configure_metrics(rollup_grace => '0')")
    for statement in [
        "SELECT inbox.claim('billing', 'shop', 'm1', '{\"a\": 1}')",
        "SELECT inbox.claim('billing', 'shop', 'm2', '{\"a\": 2}', produced_at => now())",
        "SELECT inbox.claim('billing', 'shop', 'm1', '{\"a\": 1}')",  # duplicate
        "SELECT inbox.claim('billing', 'shop', 'm2', '{\"a\": 3}')",  # conflict: quarantined
        "SELECT inbox.record_failure('billing', 'crm', 'x1', '{}', 'bad_account')",
    ]:
        conn.execute(statement)
    conn.execute("SELECT inbox.discard(quarantine_id, 'test') FROM inbox.quarantine WHERE kind = 'conflict'")
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
    found: Exported = defaultdict(set)
    database = CollectorRegistry()
    database.register(DatabaseCollector(db_dsn))
    _scrape(database, found)

    # The client side: a delivery whose first attempt meets a real lock timeout (55P03, transient)
    # on a row another session holds, then succeeds once that session lets go.
    setup_domain(conn)
    with psycopg.connect(db_dsn) as holder, psycopg.connect(db_dsn) as c:
        holder.execute("SELECT 1 FROM account WHERE id = 1 FOR UPDATE")
        release = threading.Timer(0.3, holder.rollback)
        release.start()

        def handler(cur: psycopg.Cursor[Any], message: Message) -> None:
            cur.execute("SET LOCAL lock_timeout = '50ms'")
            cur.execute("UPDATE account SET balance = balance + 1 WHERE id = 1")

        inbox = Inbox(c, consumer="billing", retry=RetryPolicy(max_attempts=50, base_delay=0.02, max_delay=0.05))
        delivered = inbox.handle(Message("shop", "g-1", "credit", {"n": 1}), handler)
        release.join()
        assert delivered.outcome == Outcome.APPLIED
        assert inbox.stats.transient_errors.get("55P03", 0) >= 1
        client = CollectorRegistry()
        client.register(InboxCollector(inbox))
        _scrape(client, found)

    conn.execute("SELECT inbox.enqueue_effect('g-effect', 'sink', '{}'::jsonb)")
    transport = CallableTransport(lambda effect: None)
    with Dispatcher(db_dsn, "grafana", {"sink": transport, "hooks": transport}) as dispatcher:
        assert dispatcher.run_once() == 2  # g-effect, and e1 (pending above)
        _scrape(dispatcher.registry, found)

    # `pginbox consume` from a real RabbitMQ queue: one message applied, one dead-lettered (not JSON).
    with channel("rabbitmq") as ch:
        ch.publish([Out("c1", {"id": "c1", "amount": 1}), Out("c2", None, raw_body=b"{not json")])
        config = load_consume_config(None, {"consumer": "billing", **ch.settings()})
        consumer = Consumer(config, db_dsn, fetch_timeout=0.2, max_pause=0.5, database_timeout=1.0)
        with ConsumerThread(consumer):
            wait_for(lambda: ch.pending() == 0, "both messages consumed")
        assert consumer.stats.outcomes.get("applied") == 1 and consumer.stats.outcomes.get("dead_letter") == 1, (
            consumer.stats.outcomes
        )
        _scrape(consumer.registry, found)
    return dict(found)


def alert_names() -> set[str]:
    rules = yaml.safe_load(RULES.read_text())
    return {rule["alert"] for group in rules["groups"] for rule in group["rules"]}


def _targets(panel: dict[str, Any]) -> list[dict[str, Any]]:
    return list(panel.get("targets", []))


def _check_expr(where: str, expr: str, legend: str, exported: Exported) -> list[str]:
    problems: list[str] = []
    metrics = set(_METRIC.findall(expr))
    if not metrics:
        problems.append(f"{where}: queries no pginbox metric: {expr}")
    unknown = sorted(m for m in metrics if m not in exported)
    problems += [f"{where}: metric {m} is not exported by the code" for m in unknown]
    if unknown:
        return problems
    known = [m for m in metrics if m in exported]
    for metric, body in _SELECTOR.findall(expr):
        for label in _MATCHER.findall(body):
            if metric in exported and label not in exported[metric] | SCRAPE_LABELS:
                problems.append(f"{where}: {metric} has no label {label!r} (it has {sorted(exported[metric])})")
    common = set.intersection(*(exported[m] for m in known)) | SCRAPE_LABELS if known else set()
    groupings = [{label.strip() for label in g.split(",") if label.strip()} for g in _GROUPING.findall(expr)]
    for grouping in groupings:
        for label in sorted(grouping - common):
            problems.append(f"{where}: grouping by {label!r}, which not every metric of the query has: {expr}")
    for label in _LEGEND.findall(legend):
        kept = set.intersection(*groupings) if groupings else common
        if label not in kept or label not in common:
            problems.append(f"{where}: legend uses {{{{{label}}}}}, which the query's series do not have")
    return problems


def dashboard_problems(dashboard: dict[str, Any], exported: Exported, alerts: set[str]) -> list[str]:
    """Everything that would break the import or show an empty or wrong panel."""
    problems: list[str] = []
    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        if key not in dashboard:
            problems.append(f"dashboard has no {key!r}")
    if not isinstance(dashboard.get("schemaVersion"), int):
        problems.append("schemaVersion must be an integer")
    if dashboard.get("id") is not None:
        problems.append("id must be null (Grafana assigns it at import)")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    source = variables.get("datasource", {})
    if source.get("type") != "datasource" or source.get("query") != "prometheus":
        problems.append("no datasource variable of type datasource for Prometheus (templating.list)")
    for name, variable in variables.items():
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        found = _LABEL_VALUES.match(str(text))
        if found is None:
            problems.append(f"variable {name}: expected label_values(pginbox_..., label), got {text!r}")
        elif found.group(1) not in exported or found.group(2) not in exported[found.group(1)]:
            problems.append(f"variable {name}: {found.group(1)} has no label {found.group(2)!r}")
        if variable.get("datasource") != PROMETHEUS:
            problems.append(f"variable {name}: datasource must be {PROMETHEUS}")
    ids: set[int] = set()
    titles: dict[str, dict[str, Any]] = {}
    for panel in dashboard.get("panels", []):
        where = f"panel {panel.get('title')!r}"
        if not isinstance(panel.get("id"), int) or panel["id"] in ids:
            problems.append(f"{where}: id missing or not unique")
        ids.add(panel.get("id", -1))
        grid = panel.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y")) or grid["x"] + grid["w"] > 24:
            problems.append(f"{where}: gridPos needs integer h, w, x, y within 24 columns")
        titles[str(panel.get("title"))] = panel
        if panel.get("type") in ("row", "alertlist"):
            continue
        if panel.get("datasource") != PROMETHEUS:
            problems.append(f"{where}: datasource must be {PROMETHEUS}")
        targets = _targets(panel)
        if not targets:
            problems.append(f"{where}: no queries")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            problems.append(f"{where}: refIds missing or repeated")
        for target in targets:
            if target.get("datasource", PROMETHEUS) != PROMETHEUS:
                problems.append(f"{where}: a query's datasource must be {PROMETHEUS}")
            problems += _check_expr(
                f"{where} {target.get('refId')}",
                str(target.get("expr", "")),
                str(target.get("legendFormat", "")),
                exported,
            )
    for title, metrics in VIEWS.items():
        panel = titles.get(title)
        if panel is None:
            problems.append(f"no panel {title!r}")
            continue
        queried = {m for t in _targets(panel) for m in _METRIC.findall(str(t.get("expr", "")))}
        for metric in sorted(metrics - queried):
            problems.append(f"panel {title!r} does not query {metric}")
    named = set(_ALERT.findall(json.dumps(dashboard)))
    problems += [f"alert {name} is not in docs/alerts/pginbox.rules.yml" for name in sorted(named - alerts)]
    return problems


def test_the_dashboard_imports_and_queries_only_what_the_code_exports(exported: Exported) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    problems = dashboard_problems(dashboard, exported, alert_names())
    assert problems == [], "\n".join(problems)
    panels = [p for p in dashboard["panels"] if p["type"] not in ("row", "alertlist")]
    assert len(panels) >= len(VIEWS)
    queried = {m for p in panels for t in p["targets"] for m in _METRIC.findall(t["expr"])}
    # the three collectors each feed it
    assert any(m.startswith("pginbox_client_") for m in queried)
    assert any(m.startswith("pginbox_dispatcher_") for m in queried)
    assert any(m.startswith("pginbox_consumer_") for m in queried)
    assert {"pginbox_database_up", "pginbox_outbox_dead", "pginbox_purge_lag_seconds"} <= queried
    assert len(set(_ALERT.findall(DASHBOARD.read_text()))) >= 10  # panels name the alerts that watch them


def _mutated(dashboard: dict[str, Any], title: str, old: str, new: str, field: str = "expr") -> dict[str, Any]:
    changed = copy.deepcopy(dashboard)
    panel = next(p for p in changed["panels"] if p["title"] == title)
    if field == "title":
        panel["title"] = new
        return changed
    if field == "description":
        assert old in panel["description"]
        panel["description"] = panel["description"].replace(old, new)
        return changed
    target = next(t for t in panel["targets"] if old in t[field])
    target[field] = target[field].replace(old, new, 1)
    return changed


def test_the_check_fails_on_misspellings(exported: Exported) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    alerts = alert_names()
    cases = [
        (("Duplicates by producer", "by (consumer, producer)", "by (consumer, produser)"), "'produser'"),
        (("Outbox pending and dead", 'destination=~"$destination"', 'destinaton=~"$destination"'), "'destinaton'"),
        (("Handler failures by reason", "{{reason_code}}", "{{reason}}", "legendFormat"), "{{reason}}"),
        (("Purge lag", "pginbox_purge_lag_seconds", "pginbox_purge_lag"), "pginbox_purge_lag is not exported"),
        (
            ("Identity conflicts", "PginboxIdentityConflicts", "PginboxIdentityConflict", "description"),
            "alert PginboxIdentityConflict is not",
        ),
        (("Dispatcher health", "Dispatcher health", "Dispatchers", "title"), "no panel 'Dispatcher health'"),
    ]
    for (title, old, new, *field), expected in cases:
        problems = dashboard_problems(_mutated(dashboard, title, old, new, *field), exported, alerts)
        assert any(expected in p for p in problems), (expected, problems)
