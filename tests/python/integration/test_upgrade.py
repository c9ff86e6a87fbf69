"""Upgrading in place, from every release: a database deployed at a release tag of sqitch.plan
(each one, oldest first; a new tag is picked up by itself), holding real traffic written for that
release's API, is deployed to HEAD with `sqitch deploy` while a client keeps claiming. Nothing it
remembered or owed is lost: every identity is still a duplicate (or, forgotten by the purge,
expired), every pending or leased effect is delivered once, quarantine entries, bindings, audit
rows, the purge watermark and a replay plan in progress carry on, and the result is the schema a
fresh build from sql/ makes. Reverting to the release keeps the data too.

The traffic at a release is chosen by the API version the release reports (inbox.schema_release()):
the newest traffic written for a version it serves. A release that breaks the clients of that
version fails the test until traffic is written for it.

Each tag runs twice: on this checkout (HEAD), and on a *rework drill* — a copy of the project in
which `sqitch rework` changed three functions changes after the last tag, the way every release
after the first ships a fix — so the upgrade path is exercised even when HEAD is the release itself.
A third test shows what this guards against: a released script edited in place (the layout before
v0.1.0) is refused by sync_deploy.py --check, and a database deployed before the edit does not
pick it up, which the catalog comparison catches. The last one cancels the concurrent build of the
claim key (change message_key) halfway and deploys again.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
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
    release_tags,
    schema_dump,
)
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from pginbox.schema import sqitch
from pginbox.transports.effect import idempotency_key

pytestmark = pytest.mark.slow  # every test deploys released tags with sqitch

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
CREATE TABLE app.ledger (consumer text NOT NULL, tenant text NOT NULL, message_id text NOT NULL,
                         amount integer NOT NULL);
CREATE TABLE app.compensation (message_id text NOT NULL);
CREATE FUNCTION app.credit(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p ? 'poison' THEN
        RAISE EXCEPTION 'cannot credit %', ctx.message_id USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO app.ledger VALUES (ctx.consumer, ctx.tenant, ctx.message_id, (p ->> 'amount')::integer);
    PERFORM inbox.enqueue_effect(inbox.effect_id(ctx.consumer, ctx.producer, ctx.message_id, 'notify', ctx.tenant),
                                 'notifications', p);
END
$$;
CREATE FUNCTION app.note(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE sql
    BEGIN ATOMIC
        INSERT INTO app.ledger VALUES (ctx.consumer, ctx.tenant, ctx.message_id, (p ->> 'amount')::integer);
    END;
CREATE FUNCTION app.credit_fix(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE sql
    BEGIN ATOMIC
        INSERT INTO app.compensation VALUES (ctx.message_id);
    END;
"""

APPLY = """SELECT outcome FROM inbox.claim_and_apply(%s, %s, %s, %s, %s::jsonb, %s, %s::timestamptz)"""
# How old the notes the purge forgets were when they were produced and processed.
LONG_AGO = datetime.timedelta(days=30)


@dataclass
class Roles:
    """LOGIN roles granted only the documented group roles, as a deployment would have them.
    tenant_service acts for one tenant only where the release has bindings (0.2.0 and later)."""

    service: str
    operator: str
    dispatcher: str
    tenant_service: str

    def all(self) -> tuple[str, str, str, str]:
        return (self.service, self.operator, self.dispatcher, self.tenant_service)


@dataclass(frozen=True)
class Delivery:
    """One message as a role delivers it through claim_and_apply."""

    role: str
    consumer: str
    message_id: str
    message_type: str = "credit"
    amount: int = 10
    tenant: str = ""
    producer: str = PRODUCER

    def payload(self) -> dict[str, Any]:
        return {"poison": True} if self.message_id.startswith("poison-") else {"amount": self.amount}


@dataclass(frozen=True)
class Refusal:
    """A call the release refuses (a binding it lacks): the upgraded schema must refuse it too."""

    role: str
    statement: str
    params: tuple[Any, ...]
    sqlstate: str


# An effect: (effect_id, consumer). Effects enqueued before 0.2.0 belong to consumer ''.
EffectKey = tuple[str, str]


@dataclass
class Released:
    """What the database held at the release, to be checked after the upgrade."""

    remembered: list[Delivery]  # processed (or discarded) at the release: a redelivery is a duplicate
    purged: list[Delivery]  # forgotten by the purge: a redelivery produced long ago is expired
    held: list[Delivery]  # open quarantine entries of kind expired: their identity is held
    quarantined: dict[Delivery, int]  # held by open quarantine entries of failures: their ids
    conflicts: list[Delivery]  # the same identity with another payload
    fresh: list[Delivery]  # never delivered: applied after the upgrade
    refusals: list[Refusal]
    kept: dict[str, tuple[str, list[tuple[str, ...]]]]  # table: (query, its rows at the release)
    watermarks: dict[str, Any]
    effects: dict[EffectKey, Any]  # every effect at the release, with its payload
    delivered: set[EffectKey]
    leases: dict[EffectKey, int]  # leased at the release and not reported: their lease tokens
    plan_id: int
    plan_items: int
    tables: list[str]  # the tables whose row counts a revert to the release keeps


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
                        APPLY, (CONSUMER, PRODUCER, message_id, "credit", json.dumps({"amount": 1}), "", None)
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
    claim_line = "    -- The claim, as on every delivery path (inbox._claim_core).\n"
    rework(project, "claim", "030_claim.sql", claim_line, "    PERFORM 1;  -- rework drill\n" + claim_line)
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
    return Roles(f"{name}_svc", f"{name}_ops", f"{name}_dsp", f"{name}_acme")


@pytest.fixture
def roles(fresh_db: tuple[str, str]) -> Roles:
    return roles_for(fresh_db[0])


def as_role(dsn: str, role: str) -> str:
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["user"] = role
    return make_conninfo("", **params)


def create_roles(dsn: str, roles: Roles) -> None:
    groups = ("inbox_consumer", "inbox_operator", "inbox_dispatcher", "inbox_consumer")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for role, group in zip(roles.all(), groups, strict=True):
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(sql.Identifier(role), sql.Identifier(group)))
        conn.execute(DOMAIN)
        for role in (roles.service, roles.tenant_service):
            conn.execute(
                sql.SQL("GRANT USAGE ON SCHEMA app TO {0}; GRANT INSERT ON app.ledger, app.compensation TO {0}").format(
                    sql.Identifier(role)
                )
            )
        conn.execute(
            sql.SQL("GRANT USAGE ON SCHEMA app TO {0}; GRANT INSERT ON app.compensation TO {0}").format(
                sql.Identifier(roles.operator)
            )
        )


class Sessions:
    """Autocommit connections to one database, one per role (no role: the dsn's own, a superuser)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conns: dict[str, Conn] = {}

    def __call__(self, role: str | None = None) -> Conn:
        key = role or ""
        if key not in self.conns:
            self.conns[key] = psycopg.connect(self.dsn if role is None else as_role(self.dsn, role), autocommit=True)
        return self.conns[key]

    def __enter__(self) -> Sessions:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self.conns.values():
            conn.close()


def deliver(s: Sessions, d: Delivery, produced_at: Any = None) -> str:
    row = (
        s(d.role)
        .execute(
            APPLY,
            (d.consumer, d.producer, d.message_id, d.message_type, json.dumps(d.payload()), d.tenant, produced_at),
        )
        .fetchone()
    )
    assert row is not None
    return str(row[0])


def deliver_all(s: Sessions, deliveries: list[Delivery], produced_at: Any = None) -> list[str]:
    return [deliver(s, d, produced_at) for d in deliveries]


def refused_with(s: Sessions, refusal: Refusal) -> str | None:
    try:
        s(refusal.role).execute(refusal.statement, refusal.params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def open_entry(conn: Conn, d: Delivery, kind: str) -> int | None:
    """The open quarantine entry of a kind that holds the delivery's identity."""
    rows = conn.execute(
        "SELECT quarantine_id FROM inbox.quarantine WHERE consumer = %s AND tenant = %s"
        " AND producer = %s AND message_id = %s AND kind = %s AND status = 'open'",
        (d.consumer, d.tenant, d.producer, d.message_id, kind),
    ).fetchall()
    assert len(rows) <= 1, f"{d}: {len(rows)} open entries"
    return int(rows[0][0]) if rows else None


def long_ago(conn: Conn) -> Any:
    row = conn.execute("SELECT now() - %s::interval", (LONG_AGO,)).fetchone()
    assert row is not None
    return row[0]


def frozen_rows(conn: Conn, query: str) -> list[tuple[str, ...]]:
    """The rows of a query as comparable, hashable tuples (jsonb, arrays and bytea included)."""
    return [
        tuple(json.dumps(value, sort_keys=True, default=str) for value in row) for row in conn.execute(query).fetchall()
    ]


# ---------------------------------------------------------------------------- traffic at a release

# What must survive the upgrade unchanged: per table of the release, the columns whose values must
# stay. After the upgrade every row the release had must still be there with these values (rows may
# be added: live claims, holds made by the upgrade). Columns that live traffic moves (heartbeats,
# timestamps of new activity) are left out.
KEPT_V1 = {
    "message": "consumer, tenant, producer, message_id, payload_sha256, handler_version, status, produced_at,"
    " processed_at",
    "attempt": "consumer, tenant, producer, message_id, started, failed, reason_code, error_message, payload_sha256",
    "quarantine": "quarantine_id, consumer, tenant, producer, message_id, kind, message_type, payload_sha256, payload,"
    " reason_code, attempts, crashes, status, decided_by",
    "quarantine_decision": "decision_id, quarantine_id, decision, result, decided_by, note",
    "handler": "consumer, message_type, handler::text, handler_version",
    "handler_registration": "registration_id, consumer, message_type, handler, handler_version, registered_by",
    "consumer_config": "consumer, max_attempts, hash_exclude_keys, store_payloads, purge_watermark",
    "retention_policy": "consumer, producer, broker_retention, producer_retry_horizon, outage_allowance, safety_margin,"
    " note",
    "retention_policy_change": "change_id, consumer, producer, retention_window, note",
    "purge_state": "consumer, producer, watermark, purged_before, rows_purged",
    "retention_hold": "consumer, tenant, producer, message_id, holder",
    "outbox": "effect_id, destination, payload, headers, ordering_key, status, attempts",
    "replay_plan": "plan_id, plan_name, consumer, message_type, handler::text, handler_version, status",
    "replay_item": "plan_id, item_no, tenant, producer, message_id, operation_id, payload, status",
    "replay_decision": "decision_id, plan_id, decision, decided_by, note, handler, handler_version, items",
}
KEPT_V2 = KEPT_V1 | {
    "quarantine": KEPT_V1["quarantine"] + ", recorded_by",
    "outbox": KEPT_V1["outbox"] + ", consumer",
    "consumer_binding": "consumer, pg_get_userbyid(role), tenants, legacy, bound_by, note",
    "destination_binding": "destination, consumer, bound_by, note",
    "binding_change": "change_id, action, consumer, role_name, tenants, destination, detail, changed_by, note",
    "security_settings": "strict_consumers, anonymous_enqueue, max_effect_delay",
}

# The tables whose row counts a revert to the release and a deploy back keep (those it has).
COUNTED = (
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
    "consumer_binding",
    "destination_binding",
)


def configure(op: Conn, consumers: tuple[str, ...]) -> None:
    for consumer in consumers:
        op.execute(
            "SELECT inbox.register_handler(%s, 'credit', 'app.credit(jsonb, inbox.message_context)', 'v1')", (consumer,)
        )
    op.execute("SELECT inbox.register_handler(%s, 'note', 'app.note(jsonb, inbox.message_context)', 'v1')", (CONSUMER,))
    op.execute("SELECT inbox.configure_consumer(%s, max_attempts => 2)", (CONSUMER,))
    op.execute(
        """SELECT inbox.set_retention_policy(%s, '', broker_retention => '7 days',
                  max_offset_rewind => '0', dead_letter_redrive_horizon => '0', producer_retry_horizon => '1 day',
                  outage_allowance => '1 day', backup_restore_window => '0', planned_replay_horizon => '0',
                  safety_margin => '1 hour', note => 'upgrade test')""",
        (CONSUMER,),
    )


def billing_traffic(s: Sessions, role: str) -> tuple[list[Delivery], list[Delivery], list[Delivery], list[Delivery]]:
    """The billing consumer's traffic, the same in every release: applied, duplicates, a conflict,
    failures (one quarantined), a crash loop, and notes produced and processed long ago.
    Returns (applied, old notes, quarantined, conflicts)."""
    applied = [Delivery(role, CONSUMER, f"m-{i}") for i in range(40)]
    assert deliver_all(s, applied) == ["applied"] * 40
    assert deliver_all(s, applied[:10]) == ["duplicate"] * 10
    conflict = Delivery(role, CONSUMER, "m-0", amount=999)
    assert deliver(s, conflict) == "conflict"
    poison = Delivery(role, CONSUMER, "poison-1")
    assert deliver_all(s, [poison, poison]) == ["failed", "quarantined"]
    assert deliver(s, Delivery(role, CONSUMER, "poison-2")) == "failed"
    for _ in range(2):
        row = (
            s(role)
            .execute("SELECT outcome FROM inbox.record_start(%s, %s, 'crash-1', payload => '{}')", (CONSUMER, PRODUCER))
            .fetchone()
        )
    assert row == ("quarantined",)
    old = [Delivery(role, CONSUMER, f"old-{i}", "note", amount=1) for i in range(10)]
    assert deliver_all(s, old, long_ago(s())) == ["applied"] * 10
    return applied, old, [poison], [conflict]


def purge_the_old_notes(s: Sessions, roles: Roles) -> None:
    """The old notes were processed long ago by a consumer active all along: the purge forgets them
    (after an operator discarded the crash loop)."""
    admin = s()
    admin.execute(
        "UPDATE inbox.message SET processed_at = now() - %s::interval WHERE consumer = %s AND message_id LIKE 'old-%%'",
        (LONG_AGO, CONSUMER),
    )
    admin.execute("DELETE FROM inbox.activity_gap WHERE consumer = %s", (CONSUMER,))
    admin.execute(
        "INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to)"
        " VALUES (%s, '-infinity', now() - interval '60 days')",
        (CONSUMER,),
    )
    op = s(roles.operator)
    entry = op.execute("SELECT quarantine_id FROM inbox.quarantine WHERE message_id = 'crash-1'").fetchone()
    assert entry is not None
    op.execute("SELECT inbox.discard(%s, 'upgrade test: a crash loop we do not retry')", (entry[0],))
    op.execute("CALL inbox.purge(%s, wait_timeout => '20 seconds')", (CONSUMER,))


def start_replay_plan(s: Sessions, roles: Roles, applied: list[Delivery]) -> int:
    """A compensation of 10 applied messages, 3 of them run at the release."""
    op = s(roles.operator)
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
    items = [{"producer": d.producer, "message_id": d.message_id, "payload": d.payload()} for d in applied[1:11]]
    op.execute("SELECT inbox.add_replay_items(%s, %s)", (plan[0], json.dumps(items)))
    op.execute("SELECT inbox.run_replay_plan(%s, 3)", (plan[0],))
    compensated = s().execute("SELECT count(*) FROM app.compensation").fetchone()
    assert compensated == (3,), "the replay plan should be in progress (3 of 10 applied)"
    return int(plan[0])


def effect_key(row: dict[str, Any]) -> EffectKey:
    """Before 0.2.0 an effect had no consumer column; the upgrade gives those effects consumer ''."""
    return (row["effect_id"], row.get("consumer", ""))


def lease_effects(s: Sessions, roles: Roles) -> tuple[set[EffectKey], dict[EffectKey, int]]:
    """An old dispatcher leases 10 effects for a second and reports 5 of them delivered.
    Returns (delivered, the other 5 with their lease tokens)."""
    dispatcher = s(roles.dispatcher)
    with dispatcher.cursor(row_factory=dict_row) as cur:
        claimed = cur.execute("SELECT * FROM inbox.claim_effects('old-dispatcher', 10, '1 second')").fetchall()
    assert len(claimed) == 10
    for row in claimed[:5]:
        reported = dispatcher.execute(
            "SELECT inbox.complete_effect(%s, %s, 200)", (row["effect_id"], row["lease_token"])
        ).fetchone()
        assert reported == (True,)
    return {effect_key(r) for r in claimed[:5]}, {effect_key(r): r["lease_token"] for r in claimed[5:]}


def traffic_v1(dsn: str, roles: Roles) -> Released:
    """The 0.1.0 API: no bindings (any member of inbox_consumer acts as any consumer), effects
    without an owner, an expired delivery that leaves no claim row (the upgrade adds its hold)."""
    with Sessions(dsn) as s:
        configure(s(roles.operator), (CONSUMER,))
        applied, old, quarantined, conflicts = billing_traffic(s, roles.service)
        purge_the_old_notes(s, roles)
        # A delivery older than the watermark, quarantined as expired: 0.1.0 keeps no claim row for
        # it, so the upgrade must add the hold (else a redelivery without produced_at would be
        # applied, and a discard would let the next delivery in).
        held = [old[9]]
        assert deliver(s, old[9], long_ago(s())) == "expired"
        plan_id = start_replay_plan(s, roles, applied)
        delivered, leases = lease_effects(s, roles)
        return snapshot(
            s,
            KEPT_V1,
            remembered=applied,
            old=old,
            held=held,
            quarantined=quarantined,
            conflicts=conflicts,
            fresh=[Delivery(roles.service, CONSUMER, "fresh-1")],
            refusals=[],
            plan_id=plan_id,
            delivered=delivered,
            leases=leases,
        )


def traffic_v2(dsn: str, roles: Roles) -> Released:
    """The 0.2.0 API: a fresh database binds nothing. Consumers bound to their roles (shipping for
    one tenant only), a binding made and taken back, destinations bound per consumer, effects owned
    by their consumer (two consumers enqueue the same effect id), anonymous enqueue off, expired
    deliveries holding their identity (one hold open, one discarded), a replay plan whose handler
    runs with the consumer's rights."""
    with Sessions(dsn) as s:
        op = s(roles.operator)
        op.execute(
            "SELECT inbox.bind_consumer(%s, %s::regrole, note => 'upgrade test: billing')", (CONSUMER, roles.service)
        )
        op.execute(
            "SELECT inbox.bind_consumer('shipping', %s::regrole, ARRAY['acme'], 'upgrade test: acme only')",
            (roles.tenant_service,),
        )
        op.execute(
            "SELECT inbox.bind_consumer('shipping', %s::regrole, note => 'upgrade test: by mistake')", (roles.service,)
        )
        op.execute(
            "SELECT inbox.unbind_consumer('shipping', %s::regrole, 'upgrade test: billing does not ship')",
            (roles.service,),
        )
        for destination, consumer in (
            ("notifications", CONSUMER),
            ("notifications", "shipping"),
            ("payments", CONSUMER),
        ):
            op.execute("SELECT inbox.bind_destination(%s, %s, 'upgrade test')", (destination, consumer))
        configure(op, (CONSUMER, "shipping"))

        applied, old, quarantined, conflicts = billing_traffic(s, roles.service)
        shipped = [Delivery(roles.tenant_service, "shipping", f"s-{i}", tenant="acme") for i in range(10)]
        assert deliver_all(s, shipped) == ["applied"] * 10
        assert deliver_all(s, shipped[:3]) == ["duplicate"] * 3
        # The same effect id under two consumers: two effects.
        enqueue = "SELECT inbox.enqueue_effect(%s, %s, %s::jsonb, consumer => %s)"
        for role, effect_id, destination, consumer in (
            (roles.service, "receipt-1", "notifications", CONSUMER),
            (roles.tenant_service, "receipt-1", "notifications", "shipping"),
            (roles.service, "payment-1", "payments", CONSUMER),
        ):
            assert s(role).execute(
                enqueue, (effect_id, destination, json.dumps({"by": consumer}), consumer)
            ).fetchone() == (True,)
        assert s().execute("SELECT count(*) FROM inbox.outbox WHERE effect_id = 'receipt-1'").fetchone() == (2,)

        purge_the_old_notes(s, roles)
        # Expired deliveries hold their identity: one left open, one discarded (a duplicate since).
        moment = long_ago(s())
        assert deliver_all(s, [old[8], old[9]], moment) == ["expired", "expired"]
        entry = (
            s(roles.operator)
            .execute("SELECT quarantine_id FROM inbox.quarantine WHERE message_id = 'old-8' AND kind = 'expired'")
            .fetchone()
        )
        assert entry is not None
        s(roles.operator).execute("SELECT inbox.discard(%s, 'upgrade test: expired, never apply')", (entry[0],))
        assert deliver_all(s, [old[8], old[9]]) == ["duplicate", "expired"]

        # The compensation runs with billing's rights: SECURITY DEFINER, owned by its role.
        s().execute(
            sql.SQL(
                "ALTER FUNCTION app.credit_fix(jsonb, inbox.message_context) SECURITY DEFINER"
                " SET search_path = app, pg_temp; ALTER FUNCTION app.credit_fix(jsonb,"
                " inbox.message_context) OWNER TO {}"
            ).format(sql.Identifier(roles.service))
        )
        plan_id = start_replay_plan(s, roles, applied)
        delivered, leases = lease_effects(s, roles)

        apply_as = "SELECT inbox.claim_and_apply(%s, %s, %s, 'credit', '{\"amount\": 1}', %s)"
        refusals = [
            # shipping's role for another tenant, billing's role for shipping (bound, then unbound)
            Refusal(roles.tenant_service, apply_as, ("shipping", PRODUCER, "r-1", "globex"), "42501"),
            Refusal(roles.service, apply_as, ("shipping", PRODUCER, "r-2", "acme"), "42501"),
            # a destination bound to billing only; an effect that belongs to no consumer
            Refusal(roles.tenant_service, enqueue, ("r-3", "payments", "{}", "shipping"), "42501"),
            Refusal(roles.service, "SELECT inbox.enqueue_effect('r-4', 'notifications', '{}')", (), "22004"),
        ]
        assert [refused_with(s, r) for r in refusals] == [r.sqlstate for r in refusals]
        fresh = [
            Delivery(roles.service, CONSUMER, "fresh-1"),
            Delivery(roles.tenant_service, "shipping", "fresh-1", tenant="acme"),
        ]
        return snapshot(
            s,
            KEPT_V2,
            remembered=[*applied, *shipped],
            old=old,
            held=[old[9]],
            quarantined=quarantined,
            conflicts=conflicts,
            fresh=fresh,
            refusals=refusals,
            plan_id=plan_id,
            delivered=delivered,
            leases=leases,
        )


# The traffic written for each API version (inbox.schema_version()). A release runs the newest
# one its version serves: a later, compatible release is covered by the traffic of the version
# whose clients it serves, until traffic is written for its own additions.
TRAFFIC: dict[int, Callable[[str, Roles], Released]] = {1: traffic_v1, 2: traffic_v2}


def traffic_for(dsn: str) -> Callable[[str, Roles], Released]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT version, release, breaking_since FROM inbox.schema_release()").fetchone()
    assert row is not None
    version, release, breaking_since = row
    api = max(v for v in TRAFFIC if v <= version)
    if breaking_since > api:
        pytest.fail(f"release {release} (API {version}) breaks clients of API {api}: write traffic_v{version}")
    return TRAFFIC[api]


def snapshot(
    s: Sessions,
    kept: dict[str, str],
    *,
    remembered: list[Delivery],
    old: list[Delivery],
    held: list[Delivery],
    quarantined: list[Delivery],
    conflicts: list[Delivery],
    fresh: list[Delivery],
    refusals: list[Refusal],
    plan_id: int,
    delivered: set[EffectKey],
    leases: dict[EffectKey, int],
) -> Released:
    admin = s()
    gone = {
        r[0]
        for r in admin.execute(
            "SELECT m FROM unnest(%s::text[]) m WHERE NOT EXISTS"
            " (SELECT 1 FROM inbox.message WHERE consumer = %s AND message_id = m)",
            ([d.message_id for d in old], CONSUMER),
        )
    }
    purged = [d for d in old if d.message_id in gone and d not in held]
    remembered = [*remembered, *(d for d in old if d.message_id not in gone and d not in held)]
    assert purged, "the purge forgot nothing: the watermark test would prove nothing"
    watermarks = dict(admin.execute("SELECT consumer, watermark FROM inbox.purge_state").fetchall())
    assert watermarks.get(CONSUMER) is not None, "the purge announced no watermark"
    with admin.cursor(row_factory=dict_row) as cur:
        effects = {effect_key(r): r["payload"] for r in cur.execute("SELECT * FROM inbox.outbox")}
    items = admin.execute("SELECT count(*) FROM inbox.replay_item WHERE plan_id = %s", (plan_id,)).fetchone()
    assert items is not None
    quarantine_ids = {}
    for d in quarantined:
        entry = open_entry(admin, d, "failure")
        assert entry is not None, d
        quarantine_ids[d] = entry
    queries = {table: f"SELECT {columns} FROM inbox.{table}" for table, columns in kept.items()}
    tables = [t for t in COUNTED if admin.execute("SELECT to_regclass(%s)", (f"inbox.{t}",)).fetchone() != (None,)]
    return Released(
        remembered=remembered,
        purged=purged,
        held=held,
        quarantined=quarantine_ids,
        conflicts=conflicts,
        fresh=fresh,
        refusals=refusals,
        kept={table: (query, frozen_rows(admin, query)) for table, query in queries.items()},
        watermarks=watermarks,
        effects=effects,
        delivered=delivered,
        leases=leases,
        plan_id=plan_id,
        plan_items=int(items[0]),
        tables=tables,
    )


# ---------------------------------------------------------------------------- checks after the upgrade


def check_nothing_lost(dsn: str, roles: Roles, released: Released, client: Client) -> None:
    with Sessions(dsn) as s:
        admin = s()
        # Every row the release held is still there as it was (before anything below changes it).
        for table, (query, rows) in released.kept.items():
            missing = Counter(rows) - Counter(frozen_rows(admin, query))
            assert not missing, (
                f"inbox.{table}: rows of the release lost or changed by the upgrade: {list(missing)[:3]}"
            )
        # The client never failed, and claimed against both schemas.
        assert not client.errors, f"the client failed during the upgrade: {client.errors[:5]}"
        assert client.outcomes["applied"] > 0 and client.outcomes["duplicate"] > 0
        # Every identity is still remembered: its redelivery is a duplicate; the purged ones, produced
        # before the watermark, are expired; quarantine keeps what it holds.
        outcomes = Counter(deliver_all(s, released.remembered))
        assert outcomes == Counter({"duplicate": len(released.remembered)}), outcomes
        moment = long_ago(admin)
        assert deliver_all(s, released.purged, moment) == ["expired"] * len(released.purged)
        watermarks = dict(admin.execute("SELECT consumer, watermark FROM inbox.purge_state").fetchall())
        assert {c: watermarks.get(c) for c in released.watermarks} == released.watermarks
        # What the release purged is bounded for the exact expiry of 0.3.0: by its watermark, or by the
        # time of the upgrade when that is earlier; the purged deliveries above are expired by it.
        bounds = dict(
            admin.execute(
                "SELECT consumer, purged_produced_max FROM inbox.purge_state WHERE rows_purged > 0"
            ).fetchall()
        )
        assert bounds, "the release purged nothing: the watermark went untested"
        for consumer, bound in bounds.items():
            assert bound is not None and bound <= watermarks[consumer], (consumer, bound)
        # A quarantined identity stays with the entry that held it at the release.
        for d, entry_id in released.quarantined.items():
            assert deliver(s, d) == "quarantined", d
            assert open_entry(admin, d, "failure") == entry_id, d
        assert deliver_all(s, released.conflicts) == ["conflict"] * len(released.conflicts)
        # An expired entry of the release holds its identity, with or without produced_at, and a
        # discard makes its redeliveries duplicates (never applied).
        for d in released.held:
            assert [deliver(s, d), deliver(s, d, moment)] == ["expired", "expired"], d
            entry = open_entry(admin, d, "expired")
            assert entry is not None, d
            s(roles.operator).execute("SELECT inbox.discard(%s, 'upgrade test: expired, never apply')", (entry,))
            assert deliver(s, d) == "duplicate", d
        # What a binding of the release refused, it still refuses; new messages are applied.
        assert [refused_with(s, r) for r in released.refusals] == [r.sqlstate for r in released.refusals]
        assert deliver_all(s, released.fresh) == ["applied"] * len(released.fresh)
        # Nothing was applied twice, and what the client applied is there.
        ledger: Counter[tuple[str, str, str]] = Counter()
        for consumer, tenant, message_id, n in admin.execute(
            "SELECT consumer, tenant, message_id, count(*) FROM app.ledger GROUP BY 1, 2, 3"
        ):
            ledger[(consumer, tenant, message_id)] = n
        twice = {k: n for k, n in ledger.items() if n > 1}
        assert not twice, f"applied more than once: {twice}"
        assert {(CONSUMER, "", m) for m in client.applied} <= set(ledger)
        for d in [*released.remembered, *released.purged, *released.held, *released.fresh]:
            assert ledger[(d.consumer, d.tenant, d.message_id)] == 1, d
    deliver_everything(dsn, roles, released)
    finish_replay_plan(dsn, roles, released)


def deliver_everything(dsn: str, roles: Roles, released: Released) -> None:
    """Dispatchers drain the outbox: each effect enqueued at the release is delivered exactly once
    with its payload (the leased ones after their lease expired), none of the delivered ones again,
    and the old dispatcher's late report on its expired lease is refused. A dispatcher of the
    release (claim_effects without key_aware) is given only the effects of the release, which keep
    their bare id as key; the new one sends inbox.idempotency_key for the effects enqueued since:
    no effect is ever sent under two keys."""
    time.sleep(1.1)  # the leases taken at the release expire
    deliveries: Counter[EffectKey] = Counter()
    payloads: dict[EffectKey, Any] = {}
    keys: dict[EffectKey, str] = {}
    notices: list[str] = []

    def drain(conn: psycopg.Connection[Any], name: str, key_aware: bool) -> None:
        for _ in range(100):
            with conn.cursor(row_factory=dict_row) as cur:
                rows = cur.execute(
                    "SELECT * FROM inbox.claim_effects(%s, 100, key_aware => %s)", (name, key_aware)
                ).fetchall()
            if not rows:
                return
            for row in rows:
                reported = conn.execute(
                    "SELECT inbox.complete_effect(%s, %s, 200)", (row["effect_id"], row["lease_token"])
                ).fetchone()
                assert reported == (True,)
                deliveries[effect_key(row)] += 1
                payloads[effect_key(row)] = row["payload"]
                keys[effect_key(row)] = row["idempotency_key"]

    with psycopg.connect(as_role(dsn, roles.dispatcher), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        drain(conn, "dispatcher-of-the-release", key_aware=False)
        old_style = set(deliveries)
        drain(conn, "new-dispatcher", key_aware=True)
        for (effect_id, _), token in released.leases.items():
            assert conn.execute("SELECT inbox.complete_effect(%s, %s, 200)", (effect_id, token)).fetchone() == (
                False,
            ), f"a report on the lease {effect_id} held at the release was accepted"
    with psycopg.connect(dsn, autocommit=True) as admin:
        undelivered = admin.execute(
            "SELECT effect_id, status::text FROM inbox.outbox WHERE status <> 'delivered'"
        ).fetchall()
        rows = admin.execute("SELECT effect_id, consumer, tenant, key_scoped FROM inbox.outbox").fetchall()
        tenants = {(r[0], r[1]): r[2] for r in rows}
        scoped = {(r[0], r[1]) for r in rows if r[3]}
    owed = released.effects.keys() - released.delivered
    assert set(deliveries) >= owed, f"never delivered: {sorted(owed - set(deliveries))[:5]}"
    assert not (set(deliveries) & released.delivered), "an effect delivered at the release was delivered again"
    assert max(deliveries.values()) == 1
    assert set(released.leases) <= set(deliveries)
    assert {k: payloads[k] for k in owed} == {k: released.effects[k] for k in owed}
    assert undelivered == []
    # The keys: effects committed before the upgrade (the release's, and the client's until the
    # outbox change) keep their id; the new ones are scoped to consumer and tenant.
    assert not (set(released.effects) & scoped), "an effect of the release changed its key"
    assert not (old_style & scoped), "a key-unaware claim was given an effect keyed since 0.3.0"
    for k, key in keys.items():
        expected = idempotency_key(k[1], tenants[k], k[0]) if k in scoped else k[0]
        assert key == expected, (k, key)
    assert scoped & set(deliveries), "the traffic after the upgrade enqueued no effect: the new keys went untested"
    assert any("wait for a dispatcher that sends their idempotency_key" in n for n in notices), notices


def finish_replay_plan(dsn: str, roles: Roles, released: Released) -> None:
    """The plan started at the release goes on after the upgrade steps of 0.3.0 (docs/security.md,
    "Upgrading to 0.3.0"): its handler runs through inbox_runner with its owner's rights only, so
    until it is a SECURITY DEFINER function of the consumer's role that inbox_runner may call, the
    run is refused before any item runs."""
    with (
        psycopg.connect(as_role(dsn, roles.operator), autocommit=True) as op,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match=r"inbox\.run_replay_plan"),
    ):
        op.execute("SELECT inbox.run_replay_plan(%s, 100)", (released.plan_id,))
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL(
                "ALTER FUNCTION app.credit_fix(jsonb, inbox.message_context) SECURITY DEFINER"
                " SET search_path = app, pg_temp; ALTER FUNCTION app.credit_fix(jsonb,"
                " inbox.message_context) OWNER TO {}; GRANT USAGE ON SCHEMA app TO inbox_runner"
            ).format(sql.Identifier(roles.service))
        )
    with psycopg.connect(as_role(dsn, roles.operator), autocommit=True) as op:
        row = op.execute("SELECT status, pending FROM inbox.run_replay_plan(%s, 100)", (released.plan_id,)).fetchone()
        assert row == ("completed", 0)
    with psycopg.connect(dsn, autocommit=True) as admin:
        rows = admin.execute("SELECT message_id, count(*) FROM app.compensation GROUP BY 1").fetchall()
        per_message: Counter[str] = Counter(dict(rows))
    assert len(per_message) == released.plan_items and set(per_message.values()) == {1}


def data_counts(dsn: str, tables: list[str]) -> dict[str, int]:
    counts = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in tables:
            row = conn.execute(sql.SQL("SELECT count(*) FROM inbox.{}").format(sql.Identifier(table))).fetchone()
            assert row is not None
            counts[table] = int(row[0])
    return counts


# ---------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("tag", release_tags(), ids=lambda tag: str(tag).lstrip("@"))
def test_upgrade_from_a_release_while_a_client_claims(
    pg_base: str, fresh_db: tuple[str, str], roles: Roles, project: Path, tag: str
) -> None:
    name, dsn = fresh_db
    sqitch.deploy(dsn, to_change=tag, project=project)
    create_roles(dsn, roles)
    released = traffic_for(dsn)(dsn, roles)

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
    before = data_counts(dsn, released.tables)
    sqitch.revert(dsn, to_change=tag, project=project)
    assert data_counts(dsn, released.tables) == before
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
    with Sessions(dsn) as s:
        assert deliver(s, released.remembered[1]) == "duplicate"
    sqitch.deploy(dsn, project=project)
    assert data_counts(dsn, released.tables) == before


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
