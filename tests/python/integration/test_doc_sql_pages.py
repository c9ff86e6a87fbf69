"""The ```sql blocks of docs/security.md, docs/metrics.md, docs/retention.md, docs/replay.md and
docs/other-languages.md that no other test runs, run as pasted (psql, as test_doc_sql.py runs
README's) on fresh databases of a private cluster (the blocks name roles, which are cluster-wide).
What a block needs and does not show (the roles it names, the function it alters, a table it reads)
is created first; then the database must hold what the page says the block does.

replay.md §2 and §3 run on test_replay.py's domain, their placeholders ('{...}', `...`) filled in.
other-languages.md's statements take the placeholders `$consumer`, `$payload`, ...: they are bound
as parameters by psycopg, as the example programs bind them, after the page's own setup block.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import PRIVATE_DB, make_cluster, sqitch_project
from helpers_docs import page_blocks
from helpers_inbox import hand_to_service
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from test_doc_sql import psql, query
from test_replay import DOMAIN, FIX, FIX2, Conn, compensations, deliver_history

from pginbox.devtools.cluster import Cluster
from pginbox.schema import sqitch


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = make_cluster(tmp_path_factory.mktemp("doc_sql_pages"))
    try:
        cluster.create_database(PRIVATE_DB)
        sqitch.deploy(cluster.dsn(PRIVATE_DB), project=sqitch_project())
        yield cluster
    finally:
        cluster.destroy()


def database(cluster: Cluster, name: str) -> str:
    cluster.create_database(name, template=PRIVATE_DB)
    return cluster.dsn(name)


def block(page: str, starts: str) -> str:
    (found,) = [b for b in page_blocks(page, "sql") if b.lstrip().startswith(starts)]
    return found


def as_user(dsn: str, user: str) -> str:
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    return make_conninfo("", **{**params, "user": user})


# ------------------------------------------------------------------------------ docs/security.md


def test_security_bindings(cluster: Cluster) -> None:
    dsn = database(cluster, "doc_security")
    roles = ("billing_service", "acme_billing", "old_service")
    psql(cluster, dsn, "".join(f"CREATE ROLE {r} LOGIN; GRANT inbox_consumer TO {r};\n" for r in roles), "roles")
    psql(cluster, dsn, "SELECT inbox.bind_consumer('billing', 'old_service', note => 'before');", "setup")
    where = "docs/security.md, Consumer bindings"
    psql(
        cluster,
        dsn,
        block("docs/security.md", "SELECT inbox.bind_consumer('billing', 'billing_service', note => 'the"),
        where,
    )
    bindings = (
        "SELECT role::regrole::text, tenants, legacy FROM inbox.consumer_binding WHERE consumer = 'billing' ORDER BY 1"
    )
    assert query(dsn, bindings) == [("acme_billing", ["acme"], False), ("billing_service", None, False)]

    # Upgrading from 0.1.0: consumers the upgrade found are bound to inbox_consumer, marked legacy.
    psql(
        cluster,
        dsn,
        """INSERT INTO inbox.consumer_binding (consumer, role, legacy, note)
           VALUES ('billing', 'inbox_consumer'::regrole, true, 'upgrade'),
                  ('shipping', 'inbox_consumer'::regrole, true, 'upgrade');""",
        "legacy bindings",
    )
    out = psql(
        cluster,
        dsn,
        block("docs/security.md", "SELECT inbox.bind_consumer('billing', 'billing_service', note => 'tight"),
        "upgrade",
    )
    assert out[-1] == "shipping", out  # what is left to tighten
    assert query(dsn, bindings) == [("acme_billing", ["acme"], False), ("billing_service", None, False)]


def test_security_definer_handler(cluster: Cluster) -> None:
    dsn = database(cluster, "doc_security_definer")
    psql(
        cluster,
        dsn,
        """DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'billing_service') THEN
               CREATE ROLE billing_service LOGIN; END IF; END $$;
           CREATE SCHEMA app;
           CREATE FUNCTION app.credit(payload jsonb, ctx inbox.message_context) RETURNS void
               LANGUAGE sql AS 'SELECT';""",
        "setup",
    )
    psql(cluster, dsn, block("docs/security.md", "ALTER FUNCTION app.credit"), "docs/security.md, SECURITY DEFINER")
    assert query(
        dsn,
        """SELECT prosecdef, proowner::regrole::text, proconfig, has_schema_privilege('inbox_runner', 'app', 'USAGE')
             FROM pg_proc WHERE oid = 'app.credit(jsonb, inbox.message_context)'::regprocedure""",
    ) == [(True, "billing_service", ["search_path=app, pg_temp"], True)]


# ------------------------------------------------------------------------------ grants (outbox.md, sql-api.md)


def test_grants_to_the_readers_roles(cluster: Cluster) -> None:
    """The GRANT blocks name the reader's own roles: created here, then the blocks run as pasted."""
    dsn = database(cluster, "doc_grants")
    roles = ("my_service", "my_dispatcher", "alice", "grafana")
    psql(cluster, dsn, "".join(f"CREATE ROLE {r} LOGIN;\n" for r in roles), "roles")
    psql(cluster, dsn, block("docs/outbox.md", "GRANT inbox_consumer   TO my_service;"), "outbox.md §3")
    psql(cluster, dsn, block("docs/sql-api.md", "-- doc test: skip (my_service"), "sql-api.md §8")
    memberships = query(
        dsn,
        """SELECT r.rolname, g.rolname FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member
             JOIN pg_roles g ON g.oid = m.roleid
            WHERE r.rolname IN ('my_service', 'my_dispatcher', 'alice', 'grafana') ORDER BY 1, 2""",
    )
    assert memberships == [
        ("alice", "inbox_operator"),
        ("grafana", "inbox_reader"),
        ("my_dispatcher", "inbox_dispatcher"),
        ("my_service", "inbox_consumer"),
    ]


# ------------------------------------------------------------------------------ docs/metrics.md


def test_metrics_query(cluster: Cluster) -> None:
    dsn = database(cluster, "doc_metrics")
    psql(
        cluster,
        dsn,
        """DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'docs_metrics_svc') THEN
               CREATE ROLE docs_metrics_svc LOGIN; CREATE ROLE docs_metrics_reader LOGIN; END IF; END $$;
           GRANT inbox_consumer TO docs_metrics_svc; GRANT inbox_reader TO docs_metrics_reader;
           SELECT inbox.bind_consumer('billing', 'docs_metrics_svc', note => 'docs');
           SET SESSION AUTHORIZATION docs_metrics_svc;
           SELECT inbox.claim('billing', 'shop', 'order-1', '{}');
           SELECT inbox.claim('billing', 'shop', 'order-1', '{}');""",
        "setup",
    )
    out = psql(
        cluster, as_user(dsn, "docs_metrics_reader"), block("docs/metrics.md", "SELECT metric, labels"), "metrics.md"
    )
    assert out[0] == 'pginbox_duplicates_total|{"consumer": "billing", "producer": "shop"}|1', out
    assert "billing|shop|0|1|0|0|0|0|0" in out[1:], out  # metric_summary: the duplicate


# ------------------------------------------------------------------------------ docs/retention.md


def test_retention_policy(cluster: Cluster) -> None:
    dsn = database(cluster, "doc_retention")
    out = psql(cluster, dsn, block("docs/retention.md", "SELECT * FROM inbox.set_retention_policy"), "retention.md")
    assert out[0].split("|")[:2] == ["17 days 01:00:00", "dead_letter_redrive_horizon"], out  # as the block says
    assert query(dsn, "SELECT note FROM inbox.retention_policy_change") == [
        ("sized from the broker config of 2026-12",)
    ]


# ------------------------------------------------------------------------------ docs/replay.md


def test_read_model_rebuilt_elsewhere(cluster: Cluster) -> None:
    dsn = database(cluster, "doc_replay")
    psql(
        cluster,
        dsn,
        """CREATE SCHEMA app;
           CREATE TABLE app.event_store (producer text, message_id text, payload jsonb);
           INSERT INTO app.event_store VALUES ('shop', 'o-1', '{"account": 1, "amount": 10}'),
                  ('shop', 'o-2', '{"account": 1, "amount": 5}'), ('shop', 'o-3', '{"account": 2, "amount": 1}');
           CREATE TABLE app.credits_by_account AS
               SELECT 1 AS account, 10::numeric AS credited, 1::bigint AS messages;""",
        "setup",
    )
    before = query(dsn, "SELECT count(*) FROM inbox.message")
    psql(cluster, dsn, block("docs/replay.md", "BEGIN;\nCREATE TABLE app.credits_by_account_v2"), "replay.md §1")
    assert query(dsn, "SELECT * FROM app.credits_by_account ORDER BY 1") == [(1, 15, 2), (2, 1, 1)]
    assert query(dsn, "SELECT * FROM app.credits_by_account_v1") == [(1, 10, 1)]
    assert query(dsn, "SELECT count(*) FROM inbox.message") == before


# ------------------------------------------------------------------------------ docs/other-languages.md


def bound(statement: str) -> str:
    """$name placeholders as psycopg's named parameters; comments dropped."""
    return re.sub(r"\$([a-z_]+)", r"%(\1)s", re.sub(r"--[^\n]*", "", statement)).strip()


def test_other_languages_statements(cluster: Cluster) -> None:
    dsn = database(cluster, "doc_other_languages")
    setup = block("docs/other-languages.md", "-- once, as a superuser")
    psql(cluster, dsn, setup, "docs/other-languages.md, setup")
    claim = block("docs/other-languages.md", "BEGIN;")
    failure = block("docs/other-languages.md", "SELECT outcome, reason_code FROM inbox.record_failure")
    apply = block("docs/other-languages.md", "SELECT * FROM inbox.claim_and_apply")
    statements = [bound(s) for s in claim.split(";") if bound(s)]
    assert [s.split()[0] for s in statements] == ["BEGIN", "SELECT", "COMMIT"]

    with psycopg.connect(as_user(dsn, "ledger_svc"), autocommit=True) as conn:
        message: dict[str, Any] = {
            "consumer": "ledger",
            "producer": "shop",
            "message_id": "m-1",
            "payload": '{"account": 1, "amount": 10}',
            "produced_at": None,
        }
        outcomes = []
        for _ in range(2):
            begin, select, commit = statements
            conn.execute(begin)
            outcomes.append(conn.execute(select, message).fetchall())
            conn.execute(commit)
        assert outcomes == [[("claimed",)], [("duplicate",)]]

        failed = {**message, "message_id": "m-2", "reason_code": "balance_not_negative", "error_text": "boom"}
        assert conn.execute(bound(failure), failed).fetchall() == [("failed", "balance_not_negative")]

        applied = {**message, "message_id": "m-3", "payload": '{"account": 2, "amount": 8}'}
        row = conn.execute(bound(apply), applied).fetchone()
        assert row is not None and row[0] == "applied"
    assert query(dsn, "SELECT id, balance FROM ledger.account ORDER BY 1") == [(1, 100), (2, 8)]


# ------------------------------------------------------------------------------ docs/replay.md §2, §3
# Run on test_replay.py's domain (billing's handlers owned by its bound service role); the blocks'
# placeholders ('{...}', the items' `...`) are filled in with that test's messages.


@pytest.fixture
def domain(conn: Conn, login_role: Any) -> Conn:
    """test_replay.py's domain fixture: billing's handlers and tables owned by its bound service."""
    conn.execute(DOMAIN)
    service = str(conninfo_to_dict(login_role("inbox_consumer"))["user"])
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA app TO {}, inbox_runner").format(sql.Identifier(service)))
    functions = (FIX, FIX2, "app.credit_v1(jsonb,inbox.message_context)")
    tables = ("app.account", "app.credit_log", "app.compensation", "app.event_store", "app.slow")
    hand_to_service(conn, service, "billing", functions=functions, tables=tables)
    return conn


def test_versioned_projection_block(domain: Conn) -> None:
    code = block("docs/replay.md", "SELECT inbox.versioned_consumer")
    assert code.count("'{...}'") == 1
    service = domain.execute("SELECT role::regrole::text FROM inbox.consumer_binding WHERE consumer = 'billing'")
    (role,) = service.fetchone() or ("",)
    domain.execute(
        """CREATE SCHEMA proj;
           CREATE TABLE proj.orders_v2 (order_id integer PRIMARY KEY);
           CREATE FUNCTION proj.order_placed_v2(p jsonb, ctx inbox.message_context) RETURNS void
               LANGUAGE sql AS 'INSERT INTO proj.orders_v2 VALUES ((p ->> ''order'')::integer)'"""
    )
    domain.execute("SELECT inbox.bind_consumer('orders-projection', %s, note => 'docs')", (role,))
    results = []
    for statement in re.split(r";[ \t]*(?:--[^\n]*)?\n", code.replace("'{...}'", """'{"order": 1042}'""")):
        if re.sub(r"--[^\n]*", "", statement).strip():
            results.append(domain.execute(statement).fetchall())
    assert len(results) == 3 and results[0] == [("orders-projection@v2",)], results
    assert results[2] == [("applied",)], results  # the claim_and_apply
    assert domain.execute("SELECT order_id FROM proj.orders_v2").fetchall() == [(1042,)]


def test_replay_plan_block(domain: Conn) -> None:
    code = block("docs/replay.md", "-- 0. The fix is registered")
    items = deliver_history(domain, 3)
    placeholder = """'[{"producer": "shop", "message_id": "order-1042", "payload": {...}}, ...]'"""
    assert code.count(placeholder) == 1
    domain.execute(code.replace(placeholder, "'" + json.dumps(items) + "'"))
    assert domain.execute("SELECT plan_id, status FROM inbox.replay_plan").fetchall() == [(1, "completed")]
    assert compensations(domain) == Counter({(item["message_id"], "fix-1"): 1 for item in items})
