"""Upgrading in place: a database deployed at the last release, holding real traffic, is deployed to
HEAD with `sqitch deploy` while a client keeps claiming. Nothing it remembered or owed is lost:
every identity is still a duplicate, every pending or leased effect is delivered once, quarantine
entries, audit rows, the purge watermark and a replay plan in progress carry on, and the result is
the schema a fresh build from sql/ makes. Reverting to the release keeps the data too.

Run twice: on this checkout (HEAD), and on a *rework drill* — a copy of the project in which
`sqitch rework` changed three functions changes after the tag, the way every release after the
first ships a fix — so the upgrade path is exercised even when HEAD is the release itself.
A third test shows what this guards against: a released script edited in place (the layout before
v0.1.0) is refused by sync_deploy.py --check, and a database deployed before the edit does not
pick it up, which the catalog comparison catches. The last one cancels the concurrent build of the
claim key (change message_key) halfway and deploys again.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import REPO_ROOT, create_database, drop_database, dsn_for
from helpers_schema import (
    assert_same_lines,
    build_from_sql_sources,
    dump_diff,
    last_tag,
    plan_entries,
    schema_dump,
)
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pginbox.schema import sqitch

Conn = psycopg.Connection[Any]

CONSUMER = "billing"
PRODUCER = "shop"
PROJECT_FILES = ("sqitch.plan", "sqitch.conf", "sqitch.lock")
PROJECT_DIRS = ("deploy", "revert", "verify", "sql")
SYNC_DEPLOY = REPO_ROOT / "python" / "tools" / "sync_deploy.py"

# The domain. credit() applies a payment and enqueues a notification effect in the same transaction;
# note() applies without an effect (the messages the purge forgets); credit_fix() is the replay
# plan's compensation. The log tables have no unique key: a double application would show.
DOMAIN = """
CREATE SCHEMA app;
CREATE TABLE app.ledger (message_id text NOT NULL, amount integer NOT NULL);
CREATE TABLE app.compensation (message_id text NOT NULL);
CREATE FUNCTION app.credit(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p ? 'poison' THEN
        RAISE EXCEPTION 'cannot credit %', ctx.message_id USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO app.ledger VALUES (ctx.message_id, (p ->> 'amount')::integer);
    PERFORM inbox.enqueue_effect(inbox.effect_id(ctx.consumer, ctx.producer, ctx.message_id, 'notify', ctx.tenant),
                                 'notifications', p);
END
$$;
CREATE FUNCTION app.note(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE sql
    BEGIN ATOMIC
        INSERT INTO app.ledger VALUES (ctx.message_id, (p ->> 'amount')::integer);
    END;
CREATE FUNCTION app.credit_fix(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE sql
    BEGIN ATOMIC
        INSERT INTO app.compensation VALUES (ctx.message_id);
    END;
"""

APPLY = """SELECT outcome FROM inbox.claim_and_apply(%s, %s, %s, %s, %s::jsonb, '', %s::timestamptz)"""


@dataclass
class Roles:
    """LOGIN roles granted only the documented group roles, as a deployment would have them."""

    service: str
    operator: str
    dispatcher: str

    def all(self) -> tuple[str, str, str]:
        return (self.service, self.operator, self.dispatcher)


@dataclass
class Released:
    """What the database held at the release, to be checked after the upgrade."""

    applied: list[str]
    quarantine: list[tuple[Any, ...]]
    decisions: list[tuple[Any, ...]]
    attempts: list[tuple[Any, ...]]
    effects: set[str]
    delivered: set[str]
    leased: set[str]
    watermark: Any
    purged: list[str]
    plan_id: int
    plan_items: int
    compensated: int
    registrations: int


@dataclass
class Client:
    """A consumer that keeps claiming (new messages and redeliveries) while the upgrade runs."""

    dsn: str
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: Counter[str] = field(default_factory=Counter)
    applied: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    def run(self) -> None:
        n = 0
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                message_id = f"live-{n // 2}"  # every id twice: a first delivery, then its redelivery
                n += 1
                try:
                    row = conn.execute(
                        APPLY, (CONSUMER, PRODUCER, message_id, "credit", json.dumps({"amount": 1}), None)
                    ).fetchone()
                except psycopg.Error as exc:
                    self.errors.append(f"{message_id}: {exc.sqlstate} {exc}")
                    continue
                assert row is not None
                self.outcomes[row[0]] += 1
                if row[0] == "applied":
                    self.applied.append(message_id)

    def __enter__(self) -> Client:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while sum(self.outcomes.values()) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)  # a few claims against the upgraded schema
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=30)


# ---------------------------------------------------------------------------- projects


def copy_project(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        shutil.copy2(REPO_ROOT / name, dest / name)
    for name in PROJECT_DIRS:
        shutil.copytree(REPO_ROOT / name, dest / name)
    return dest


def run_tool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, check=False)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{path.name}: {old!r} not found once"
    path.write_text(text.replace(old, new))


def sqitch_in(project: Path, *args: str) -> None:
    result = subprocess.run(["sqitch", *args], cwd=project, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"sqitch {' '.join(args)}:\n{result.stdout}\n{result.stderr}"


def rework(project: Path, change: str, source: str, old: str, new: str) -> None:
    """What docs/releasing.md tells a developer to do: sqitch rework, edit sql/, regenerate deploy/,
    and make the revert script restore the released version."""
    tag = last_tag(project).lstrip("@")
    sqitch_in(project, "rework", change, "-n", f"rework drill: {change}")
    edit(project / "sql" / source, old, new)
    result = run_tool(SYNC_DEPLOY, "--root", project)
    assert result.returncode == 0, result.stderr
    released = (project / "deploy" / f"{change}@{tag}.sql").read_text()
    (project / "revert" / f"{change}.sql").write_text(f"-- Revert pginbox:{change} to @{tag}\n" + released)


def rework_drill(dest: Path) -> Path:
    project = copy_project(dest)
    if not plan_entries(project)[-1].startswith("@"):
        # Changes were reworked since the release: a second rework needs a tag in between.
        sqitch_in(project, "tag", "drill-base", "-n", "rework drill: what HEAD has since the release")
    first_delivery = "    -- The first delivery, inline: it is the path every message takes once.\n"
    rework(project, "claim", "030_claim.sql", first_delivery, "    PERFORM 1;  -- rework drill\n" + first_delivery)
    rework(
        project,
        "outbox",
        "065_outbox.sql",
        "CREATE OR REPLACE FUNCTION inbox.enqueue_effect(\n",
        "-- (rework drill)\nCREATE OR REPLACE FUNCTION inbox.enqueue_effect(\n",
    )
    version_source = (project / "sql" / "999_version.sql").read_text()
    current = int(re.search(r"    RETURN (\d+);\n", version_source).group(1))  # type: ignore[union-attr]
    rework(project, "version", "999_version.sql", f"    RETURN {current};\n", f"    RETURN {current + 1};\n")
    release = re.search(r"'(\d+\.\d+\.\d+)'::text", version_source).group(1)  # type: ignore[union-attr]
    edit(project / "sql" / "999_version.sql", f"'{release}'::text", f"'{release}-drill'::text")
    assert run_tool(SYNC_DEPLOY, "--root", project).returncode == 0
    check = run_tool(SYNC_DEPLOY, "--check", "--root", project)
    assert check.returncode == 0, f"the drill is not a valid release:\n{check.stderr}"
    return project


@pytest.fixture(params=["head", "rework-drill"])
def project(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return REPO_ROOT if request.param == "head" else rework_drill(tmp_path / "drill")


# ---------------------------------------------------------------------------- databases and roles


@pytest.fixture
def fresh_db(pg_base: str) -> Iterator[tuple[str, str]]:
    """(name, dsn) of an empty database; dropped afterwards, with the LOGIN roles named after it."""
    name = f"t_upgrade_{time.monotonic_ns() % 10**9}"
    create_database(pg_base, name)
    try:
        yield name, dsn_for(pg_base, name)
    finally:
        drop_database(pg_base, name)
        with psycopg.connect(dsn_for(pg_base, "postgres"), autocommit=True) as conn:
            for role in roles_for(name).all():
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def roles_for(name: str) -> Roles:
    return Roles(f"{name}_svc", f"{name}_ops", f"{name}_dsp")


@pytest.fixture
def roles(fresh_db: tuple[str, str]) -> Roles:
    return roles_for(fresh_db[0])


def as_role(dsn: str, role: str) -> str:
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["user"] = role
    return make_conninfo("", **params)


def create_roles(dsn: str, roles: Roles) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for role, group in zip(roles.all(), ("inbox_consumer", "inbox_operator", "inbox_dispatcher"), strict=True):
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(sql.Identifier(role), sql.Identifier(group)))
        conn.execute(DOMAIN)
        conn.execute(
            sql.SQL("GRANT USAGE ON SCHEMA app TO {0}; GRANT INSERT ON app.ledger, app.compensation TO {0}").format(
                sql.Identifier(roles.service)
            )
        )
        conn.execute(
            sql.SQL("GRANT USAGE ON SCHEMA app TO {0}; GRANT INSERT ON app.compensation TO {0}").format(
                sql.Identifier(roles.operator)
            )
        )


# ---------------------------------------------------------------------------- traffic at the release


def apply(
    conn: Conn, message_id: str, payload: dict[str, Any], message_type: str = "credit", produced_at: Any = None
) -> str:
    row = conn.execute(
        APPLY, (CONSUMER, PRODUCER, message_id, message_type, json.dumps(payload), produced_at)
    ).fetchone()
    assert row is not None
    return str(row[0])


def traffic_at_release(dsn: str, roles: Roles) -> Released:
    """Applied, duplicates, a conflict, failures, quarantine (failure and crash loop), an operator
    decision, delivered / leased / pending effects, a purge watermark and a replay plan in progress."""
    svc = as_role(dsn, roles.service)
    ops = as_role(dsn, roles.operator)
    dsp = as_role(dsn, roles.dispatcher)
    with psycopg.connect(ops, autocommit=True) as op:
        op.execute(
            "SELECT inbox.register_handler(%s, 'credit', 'app.credit(jsonb, inbox.message_context)', 'v1')", (CONSUMER,)
        )
        op.execute(
            "SELECT inbox.register_handler(%s, 'note', 'app.note(jsonb, inbox.message_context)', 'v1')", (CONSUMER,)
        )
        op.execute("SELECT inbox.configure_consumer(%s, max_attempts => 2)", (CONSUMER,))
        op.execute(
            """SELECT inbox.set_retention_policy(%s, '', broker_retention => '7 days',
                      max_offset_rewind => '0', dead_letter_redrive_horizon => '0', producer_retry_horizon => '1 day',
                      outage_allowance => '1 day', backup_restore_window => '0', planned_replay_horizon => '0',
                      safety_margin => '1 hour', note => 'upgrade test')""",
            (CONSUMER,),
        )
    with psycopg.connect(svc, autocommit=True) as conn:
        applied = [f"m-{i}" for i in range(40)]
        assert [apply(conn, m, {"amount": 10}) for m in applied] == ["applied"] * 40
        assert [apply(conn, m, {"amount": 10}) for m in applied[:10]] == ["duplicate"] * 10
        assert apply(conn, "m-0", {"amount": 999}) == "conflict"
        assert apply(conn, "poison-1", {"poison": True}) == "failed"
        assert apply(conn, "poison-1", {"poison": True}) == "quarantined"
        assert apply(conn, "poison-2", {"poison": True}) == "failed"
        for _ in range(2):
            row = conn.execute(
                "SELECT outcome FROM inbox.record_start(%s, %s, 'crash-1', payload => '{}')", (CONSUMER, PRODUCER)
            ).fetchone()
        assert row == ("quarantined",)
        old = [f"old-{i}" for i in range(10)]
        produced = conn.execute("SELECT now() - interval '30 days'").fetchone()
        assert produced is not None
        assert [apply(conn, m, {"amount": 1}, "note", produced[0]) for m in old] == ["applied"] * 10
    with psycopg.connect(dsn, autocommit=True) as admin:
        # The old notes were processed 30 days ago by a consumer active all along: the purge forgets them.
        admin.execute(
            "UPDATE inbox.message SET processed_at = now() - interval '30 days'"
            " WHERE consumer = %s AND message_id LIKE 'old-%%'",
            (CONSUMER,),
        )
        admin.execute("DELETE FROM inbox.activity_gap WHERE consumer = %s", (CONSUMER,))
        admin.execute(
            "INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to)"
            " VALUES (%s, '-infinity', now() - interval '60 days')",
            (CONSUMER,),
        )
    with psycopg.connect(ops, autocommit=True) as op:
        entry = op.execute("SELECT quarantine_id FROM inbox.quarantine WHERE message_id = 'crash-1'").fetchone()
        assert entry is not None
        op.execute("SELECT inbox.discard(%s, 'upgrade test: a crash loop we do not retry')", (entry[0],))
        op.execute("CALL inbox.purge(%s, wait_timeout => '20 seconds')", (CONSUMER,))
    with psycopg.connect(svc, autocommit=True) as conn:
        # A delivery older than the watermark, quarantined as expired by the release: 0.1.0 kept no
        # claim row for it, so the upgrade must add the hold (else a redelivery without produced_at
        # would be applied, and a discard would let the next delivery in).
        assert apply(conn, "old-9", {"amount": 1}, "note", produced[0]) == "expired"
    with psycopg.connect(ops, autocommit=True) as op:
        op.execute(
            "SELECT inbox.register_handler(%s, 'credit-fix', 'app.credit_fix(jsonb, inbox.message_context)', 'fix-1')",
            (CONSUMER,),
        )
        plan = op.execute(
            "SELECT plan_id FROM inbox.create_replay_plan('upgrade-plan', %s, 'credit-fix',"
            " 'app.credit_fix(jsonb, inbox.message_context)', 'fix-1', 'upgrade test')",
            (CONSUMER,),
        ).fetchone()
        assert plan is not None
        items = [{"producer": PRODUCER, "message_id": m, "payload": {"amount": 10}} for m in applied[1:11]]
        op.execute("SELECT inbox.add_replay_items(%s, %s)", (plan[0], json.dumps(items)))
        op.execute("SELECT inbox.run_replay_plan(%s, 3)", (plan[0],))
    with psycopg.connect(dsp, autocommit=True) as dispatcher:
        claimed = dispatcher.execute(
            "SELECT effect_id, lease_token FROM inbox.claim_effects('old-dispatcher', 10, '1 second')"
        ).fetchall()
        assert len(claimed) == 10
        for effect_id, token in claimed[:5]:
            dispatcher.execute("SELECT inbox.complete_effect(%s, %s, 200)", (effect_id, token))
    with psycopg.connect(dsn, autocommit=True) as admin:
        return snapshot(
            admin, applied + old, plan[0], delivered={e for e, _ in claimed[:5]}, leased={e for e, _ in claimed[5:]}
        )


def snapshot(conn: Conn, applied: list[str], plan_id: int, delivered: set[str], leased: set[str]) -> Released:
    def rows(statement: str) -> list[tuple[Any, ...]]:
        return conn.execute(statement).fetchall()

    state = conn.execute("SELECT watermark FROM inbox.purge_state WHERE consumer = %s", (CONSUMER,)).fetchone()
    purged = [
        r[0]
        for r in rows(
            "SELECT m FROM unnest(ARRAY(SELECT 'old-' || g FROM generate_series(0, 9) g)) m"
            " WHERE NOT EXISTS (SELECT 1 FROM inbox.message WHERE message_id = m)"
        )
    ]
    plan = conn.execute("SELECT count(*) FROM inbox.replay_item WHERE plan_id = %s", (plan_id,)).fetchone()
    compensated = conn.execute("SELECT count(*) FROM app.compensation").fetchone()
    registrations = conn.execute("SELECT count(*) FROM inbox.handler_registration").fetchone()
    assert state is not None and state[0] is not None, "the purge announced no watermark"
    assert purged, "the purge forgot nothing: the watermark test would prove nothing"
    assert plan is not None and compensated is not None and registrations is not None
    assert compensated[0] == 3, "the replay plan should be in progress (3 of 10 applied)"
    return Released(
        applied=applied,
        quarantine=rows(
            "SELECT quarantine_id, message_id, kind, status, reason_code, attempts FROM inbox.quarantine ORDER BY 1"
        ),
        decisions=rows(
            "SELECT decision_id, quarantine_id, decision, result, note FROM inbox.quarantine_decision ORDER BY 1"
        ),
        attempts=rows("SELECT message_id, started, failed, reason_code FROM inbox.attempt ORDER BY 1"),
        effects={r[0] for r in rows("SELECT effect_id FROM inbox.outbox")},
        delivered=delivered,
        leased=leased,
        watermark=state[0],
        purged=purged,
        plan_id=plan_id,
        plan_items=plan[0],
        compensated=compensated[0],
        registrations=registrations[0],
    )


# ---------------------------------------------------------------------------- checks after the upgrade


def check_nothing_lost(dsn: str, roles: Roles, released: Released, client: Client) -> None:
    admin = psycopg.connect(dsn, autocommit=True)
    svc = psycopg.connect(as_role(dsn, roles.service), autocommit=True)
    with admin, svc:
        # The client never failed, and what it applied is applied once, like everything before.
        assert not client.errors, f"the client failed during the upgrade: {client.errors[:5]}"
        assert client.outcomes["applied"] > 0 and client.outcomes["duplicate"] > 0
        ledger: Counter[str] = Counter(
            dict(admin.execute("SELECT message_id, count(*) FROM app.ledger GROUP BY 1").fetchall())
        )
        twice = {m: n for m, n in ledger.items() if n > 1}
        assert not twice, f"applied more than once: {twice}"
        assert set(client.applied) <= set(ledger)
        # Every identity is still remembered: its redelivery is a duplicate (the purged ones: expired).
        remembered = [m for m in released.applied if m not in released.purged]
        outcomes = Counter(
            apply(svc, m, {"amount": 10 if m.startswith("m-") else 1}, "credit" if m.startswith("m-") else "note")
            for m in remembered
        )
        assert outcomes == Counter({"duplicate": len(remembered)}), outcomes
        old_produced = admin.execute("SELECT now() - interval '30 days'").fetchone()
        assert old_produced is not None
        assert apply(svc, released.purged[0], {"amount": 1}, "note", old_produced[0]) == "expired"
        assert admin.execute("SELECT watermark FROM inbox.purge_state WHERE consumer = %s", (CONSUMER,)).fetchone() == (
            released.watermark,
        )
        # Quarantine, its audit trail, attempts and registrations survived as they were.
        after = snapshot_rows(admin)
        assert after["quarantine"][: len(released.quarantine)] == released.quarantine
        assert after["decisions"] == released.decisions
        assert after["attempts"] == released.attempts
        assert apply(svc, "poison-1", {"poison": True}) == "quarantined"
        # The expired entry from the release holds its identity, with or without produced_at, and a
        # discard makes its redeliveries duplicates (never applied).
        assert apply(svc, "old-9", {"amount": 1}, "note") == "expired"
        assert apply(svc, "old-9", {"amount": 1}, "note", old_produced[0]) == "expired"
        entry = admin.execute(
            "SELECT quarantine_id FROM inbox.quarantine WHERE message_id = 'old-9' AND kind = 'expired'"
        ).fetchone()
        assert entry is not None
        admin.execute("SELECT inbox.discard(%s, 'upgrade test: expired, never apply')", (entry[0],))
        assert apply(svc, "old-9", {"amount": 1}, "note") == "duplicate"
        assert admin.execute("SELECT count(*) FROM app.ledger WHERE message_id = 'old-9'").fetchone() == (1,)
        assert apply(svc, "m-0", {"amount": 999}) == "conflict"
    deliver_everything(dsn, roles, released)
    finish_replay_plan(dsn, roles, released)


def snapshot_rows(conn: Conn) -> dict[str, list[tuple[Any, ...]]]:
    return {
        "quarantine": conn.execute(
            "SELECT quarantine_id, message_id, kind, status, reason_code, attempts FROM inbox.quarantine ORDER BY 1"
        ).fetchall(),
        "decisions": conn.execute(
            "SELECT decision_id, quarantine_id, decision, result, note FROM inbox.quarantine_decision ORDER BY 1"
        ).fetchall(),
        "attempts": conn.execute(
            "SELECT message_id, started, failed, reason_code FROM inbox.attempt"
            " WHERE message_id NOT LIKE 'live-%' ORDER BY 1"
        ).fetchall(),
    }


def deliver_everything(dsn: str, roles: Roles, released: Released) -> None:
    """A dispatcher of the new version drains the outbox: each effect enqueued at the release is
    delivered exactly once (the leased ones after their lease expired), none of the delivered ones again."""
    time.sleep(1.1)  # the leases taken at the release expire
    deliveries: Counter[str] = Counter()
    with psycopg.connect(as_role(dsn, roles.dispatcher), autocommit=True) as conn:
        for _ in range(100):
            batch = conn.execute("SELECT effect_id, lease_token FROM inbox.claim_effects('new-dispatcher', 100)")
            rows = batch.fetchall()
            if not rows:
                break
            for effect_id, token in rows:
                assert conn.execute("SELECT inbox.complete_effect(%s, %s, 200)", (effect_id, token)).fetchone() == (
                    True,
                )
                deliveries[effect_id] += 1
    with psycopg.connect(dsn, autocommit=True) as admin:
        statuses: dict[str, str] = dict(admin.execute("SELECT effect_id, status::text FROM inbox.outbox").fetchall())
    owed = released.effects - released.delivered
    assert set(deliveries) >= owed, f"never delivered: {sorted(owed - set(deliveries))[:5]}"
    assert not (set(deliveries) & released.delivered), "an effect delivered at the release was delivered again"
    assert max(deliveries.values()) == 1
    assert released.leased <= set(deliveries)
    assert {e: s for e, s in statuses.items() if s != "delivered"} == {}


def finish_replay_plan(dsn: str, roles: Roles, released: Released) -> None:
    with psycopg.connect(as_role(dsn, roles.operator), autocommit=True) as op:
        row = op.execute("SELECT status, pending FROM inbox.run_replay_plan(%s, 100)", (released.plan_id,)).fetchone()
        assert row == ("completed", 0)
    with psycopg.connect(dsn, autocommit=True) as admin:
        rows = admin.execute("SELECT message_id, count(*) FROM app.compensation GROUP BY 1").fetchall()
        per_message: Counter[str] = Counter(dict(rows))
    assert len(per_message) == released.plan_items and set(per_message.values()) == {1}


def data_counts(dsn: str) -> dict[str, int]:
    counts = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in (
            "message",
            "attempt",
            "quarantine",
            "quarantine_decision",
            "outbox",
            "handler",
            "handler_registration",
            "purge_state",
            "replay_plan",
            "replay_item",
            "retention_hold",
        ):
            row = conn.execute(sql.SQL("SELECT count(*) FROM inbox.{}").format(sql.Identifier(table))).fetchone()
            assert row is not None
            counts[table] = int(row[0])
    return counts


# ---------------------------------------------------------------------------- the tests


def test_upgrade_from_the_release_while_a_client_claims(
    pg_base: str, fresh_db: tuple[str, str], roles: Roles, project: Path
) -> None:
    name, dsn = fresh_db
    tag = last_tag(REPO_ROOT)
    sqitch.deploy(dsn, to_change=tag, project=project)
    create_roles(dsn, roles)
    released = traffic_at_release(dsn, roles)

    with Client(as_role(dsn, roles.service)) as client:
        sqitch.deploy(dsn, project=project)
    sqitch.verify(dsn, project=project)
    check_nothing_lost(dsn, roles, released, client)

    # The upgraded schema is the one sql/ describes.
    fresh = f"{name}_fresh"
    create_database(pg_base, fresh)
    try:
        build_from_sql_sources(dsn_for(pg_base, fresh), project / "sql")
        assert_same_lines(
            schema_dump(dsn_for(pg_base, fresh)),
            schema_dump(dsn),
            "schema inbox",
            ("fresh build from sql/", f"deployed at {tag}, upgraded to HEAD"),
        )
    finally:
        drop_database(pg_base, fresh)

    # Back to the release: the data stays, and the schema is the release's.
    before = data_counts(dsn)
    sqitch.revert(dsn, to_change=tag, project=project)
    assert data_counts(dsn) == before
    at_release = f"{name}_release"
    create_database(pg_base, at_release)
    try:
        sqitch.deploy(dsn_for(pg_base, at_release), to_change=tag, project=project)
        assert_same_lines(
            schema_dump(dsn_for(pg_base, at_release)),
            schema_dump(dsn),
            "schema inbox",
            (f"fresh deploy to {tag}", f"reverted to {tag}"),
        )
    finally:
        drop_database(pg_base, at_release)
    with psycopg.connect(as_role(dsn, roles.service), autocommit=True) as svc:
        assert apply(svc, "m-1", {"amount": 10}) == "duplicate"
    sqitch.deploy(dsn, project=project)
    assert data_counts(dsn) == before


def test_a_released_script_edited_in_place_is_caught(pg_base: str, fresh_db: tuple[str, str], tmp_path: Path) -> None:
    """The layout before v0.1.0: a fix edited into a deployed change. Sqitch does not redeploy it, so a
    database deployed before the edit keeps the old function while verify passes; the release check
    refuses the edit and the catalog comparison of the upgrade test shows the difference."""
    name, dsn = fresh_db
    tag = last_tag(REPO_ROOT)
    sqitch.deploy(dsn, to_change=tag, project=REPO_ROOT)

    edited = copy_project(tmp_path / "edited")
    # `schema` (the core tables) is released and, being a tables change, never reworked.
    comment = "COMMENT ON TABLE inbox.message IS 'Claimed message identities"
    for path in (edited / "sql" / "020_schema.sql", edited / "deploy" / "schema.sql"):
        edit(path, comment, comment + " (a fix, edited in place)")
    check = run_tool(SYNC_DEPLOY, "--check", "--root", edited)
    assert check.returncode == 1 and "deploy/schema.sql was released and has been edited" in check.stderr

    sqitch.deploy(dsn, project=edited)  # nothing to deploy: Sqitch knows the change already
    sqitch.verify(dsn, project=edited)  # and verify passes
    fresh = f"{name}_fresh"
    create_database(pg_base, fresh)
    try:
        build_from_sql_sources(dsn_for(pg_base, fresh), edited / "sql")
        expected, upgraded = schema_dump(dsn_for(pg_base, fresh)), schema_dump(dsn)
    finally:
        drop_database(pg_base, fresh)
    assert expected != upgraded
    assert "(a fix, edited in place)" in dump_diff(expected, upgraded, "sql/", "upgraded")


def test_an_interrupted_build_of_the_claim_key_is_taken_over_by_the_next_deploy(fresh_db: tuple[str, str]) -> None:
    """message_key builds the new claim key with CREATE INDEX CONCURRENTLY, outside a transaction: a
    build cancelled halfway leaves an invalid index behind. Deploying again drops it, builds the key
    and swaps it in; every identity is still there and still a unique key."""
    _, dsn = fresh_db
    changes = plan_entries(REPO_ROOT)
    before = changes[changes.index("message_key") - 1]
    sqitch.deploy(dsn, to_change=before, project=REPO_ROOT)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version)"
            " SELECT 'c' || g % 3, '', 'p', gen_random_uuid()::text, sha256(g::text::bytea), 'v1'"
            " FROM generate_series(1, 3000) g"
        )

    # A transaction holding a lock on the table makes the build wait; the build is then cancelled.
    with (
        psycopg.connect(dsn) as holder,
        psycopg.connect(dsn, autocommit=True) as builder,
        psycopg.connect(dsn, autocommit=True) as watcher,
    ):
        holder.execute("LOCK TABLE inbox.message IN ROW EXCLUSIVE MODE")
        pid = builder.info.backend_pid
        failure: list[BaseException] = []

        def build() -> None:
            try:
                builder.execute(
                    "CREATE UNIQUE INDEX CONCURRENTLY message_key_building"
                    " ON inbox.message (message_id, consumer, tenant, producer)"
                )
            except psycopg.errors.QueryCanceled as exc:
                failure.append(exc)

        thread = threading.Thread(target=build)
        thread.start()
        deadline = time.monotonic() + 30
        waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
        while watcher.execute(waiting, (pid,)).fetchone() != (True,):
            assert time.monotonic() < deadline, "the concurrent build never waited for the lock holder"
            time.sleep(0.05)
        watcher.execute("SELECT pg_cancel_backend(%s)", (pid,))
        thread.join(30)
        holder.rollback()
    assert failure, "the build was not cancelled"
    with psycopg.connect(dsn) as conn:
        assert conn.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'inbox.message_key_building'::regclass"
        ).fetchone() == (False,)

    sqitch.deploy(dsn, project=REPO_ROOT)
    sqitch.verify(dsn, project=REPO_ROOT)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('inbox.message_key_building')").fetchone() == (None,)
        assert conn.execute(
            "SELECT pg_get_constraintdef(c.oid), i.indisvalid, i.indisunique FROM pg_constraint c"
            " JOIN pg_index i ON i.indexrelid = c.conindid"
            " WHERE c.conrelid = 'inbox.message'::regclass AND c.contype = 'p'"
        ).fetchone() == ("PRIMARY KEY (message_id, consumer, tenant, producer)", True, True)
        assert conn.execute("SELECT count(*), count(DISTINCT message_id) FROM inbox.message").fetchone() == (3000, 3000)
        # The key still refuses a second row for an identity (a claim's ON CONFLICT relies on it).
        row = conn.execute("SELECT consumer, tenant, producer, message_id FROM inbox.message LIMIT 1").fetchone()
        assert row is not None
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(
                "INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256,"
                " handler_version) VALUES (%s, %s, %s, %s, '\\x00', 'v1')",
                row,
            )
