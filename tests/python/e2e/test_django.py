"""pginbox.integrations.django against a real PostgreSQL, in the real (minimal) Django project of
tests/django_project: settings with ATOMIC_REQUESTS, an app `ledger` with models, a migration and
views, run through Django's own request handling (django.test.Client) where views are involved.

Django connects as a LOGIN role of its own (granted inbox_consumer, bound to consumers `billing` and
`shop-api`, the owner of the app's tables through `migrate`), not as a superuser. No Django
component is replaced: the ORM, atomic(), the connection handling and the URL dispatch are Django's.

The invariant checked throughout: at most one committed ledger entry per message.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import django
import psycopg
import pytest
from conftest import REPO_ROOT, create_database, drop_database, dsn_for
from helpers_library import CommitDroppingProxy
from helpers_pgbouncer import PgBouncer
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pginbox import HandlerProtocolError, Message, Outcome, PginboxError, RetryPolicy

DJANGO_PROJECT = REPO_ROOT / "tests" / "django_project"
FAST_RETRY = RetryPolicy(max_attempts=5, base_delay=0.005, max_delay=0.05)


def doc_block(lang: str, index: int = 0) -> str:
    """The `index`-th ```lang block of docs/django.md."""
    page = (REPO_ROOT / "docs" / "django.md").read_text()
    return str(re.findall(rf"```{lang}\n(.*?)```", page, re.S)[index])


@dataclass(frozen=True)
class DjangoDb:
    admin_dsn: str  # the superuser, for checks
    role: str  # the Django app's LOGIN role
    proxy: CommitDroppingProxy  # alias "lossy" goes through it
    bouncer: PgBouncer  # alias "pooled" goes through it (transaction mode, one server connection)


@pytest.fixture(scope="module")
def djdb(pg_base: str, template_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DjangoDb]:
    """A database for the Django project (schema inbox deployed, the app's role bound), Django set
    up on it and `migrate` run as the app's role."""
    suffix = uuid.uuid4().hex[:10]
    name, role = f"t_django_{suffix}", f"t_django_app_{suffix}"
    create_database(pg_base, name, template=template_db)
    admin_dsn = dsn_for(pg_base, name)
    ident = sql.Identifier(role)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        admin.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(ident))  # for migrate
        admin.execute(doc_block("sql").replace("shop_app", role).encode())  # docs/django.md §3, as written
        admin.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    proxy = CommitDroppingProxy(admin_dsn)
    bouncer = PgBouncer(pg_base, tmp_path_factory.mktemp("django_pgbouncer"), pool_size=1).start()
    params = conninfo_to_dict(admin_dsn)
    os.environ.update(
        DJANGO_SETTINGS_MODULE="djproject.settings",
        PGINBOX_DJANGO_HOST=str(params["host"]),
        PGINBOX_DJANGO_PORT=str(params["port"]),
        PGINBOX_DJANGO_NAME=name,
        PGINBOX_DJANGO_USER=role,
        PGINBOX_DJANGO_LOSSY_PORT=str(proxy.port),
        PGINBOX_DJANGO_POOLED_PORT=str(bouncer.port),
    )
    sys.path.insert(0, str(DJANGO_PROJECT))
    django.setup()
    from django.core.management import call_command
    from django.db import connections
    from ledger.models import Account

    try:
        call_command("migrate", verbosity=0)
        Account.objects.create(id=1, balance=0)
        yield DjangoDb(admin_dsn, role, proxy, bouncer)
    finally:
        connections.close_all()
        proxy.close()
        bouncer.stop()
        drop_database(pg_base, name)
        with psycopg.connect(dsn_for(pg_base, "postgres"), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))


@pytest.fixture
def admin(djdb: DjangoDb) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(djdb.admin_dsn, autocommit=True) as conn:
        yield conn


def uid() -> str:
    return f"m-{uuid.uuid4().hex[:12]}"


def message(message_id: str, amount: int = 10, **kw: Any) -> Message:
    return Message("orders", message_id, "credit", {"account": 1, "amount": amount}, **kw)


def entries(admin: psycopg.Connection[Any], message_id: str) -> int:
    row = admin.execute("SELECT count(*) FROM ledger_entry WHERE message_id = %s", (message_id,)).fetchone()
    assert row is not None
    return int(row[0])


def attempts(admin: psycopg.Connection[Any], message_id: str) -> tuple[int, str | None] | None:
    row = admin.execute(
        "SELECT failed, reason_code FROM inbox.attempt WHERE consumer = 'billing' AND message_id = %s", (message_id,)
    ).fetchone()
    return None if row is None else (int(row[0]), row[1])


def test_handle_runs_orm_code_with_nested_atomic_blocks_in_the_claims_transaction(
    djdb: DjangoDb, admin: psycopg.Connection[Any]
) -> None:
    """get_or_create, update_or_create and an explicit atomic() inside the handler: savepoints in
    the claim's transaction (pginbox.Inbox on Django's connection failed them all with "can't
    change 'autocommit' now"). An inner block that fails and is caught rolls back alone."""
    from django.db import IntegrityError, transaction
    from ledger.models import Account, Entry

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing", handler_version="v1")
    m = message(uid(), 7)
    calls: list[str] = []

    def handler(msg: Message) -> None:
        calls.append(msg.message_id)
        account, _ = Account.objects.select_for_update().get_or_create(id=1)
        Account.objects.update_or_create(id=2, defaults={"balance": 0})
        with transaction.atomic():
            account.balance += msg.payload["amount"]
            account.save(update_fields=["balance"])
            Entry.objects.create(account=account, message_id=msg.message_id, amount=7, reference=msg.message_id)
        try:
            with transaction.atomic():  # the same reference again: fails, rolled back to its savepoint
                Entry.objects.create(account=account, message_id=msg.message_id, amount=1, reference=msg.message_id)
        except IntegrityError:
            pass

    first = inbox.handle(m, handler)
    again = inbox.handle(m, handler)
    assert (first.outcome, again.outcome) == (Outcome.APPLIED, Outcome.DUPLICATE)
    assert first.ack and again.ack
    assert calls == [m.message_id]
    assert entries(admin, m.message_id) == 1


def test_a_failing_handler_is_rolled_back_and_recorded_outside_its_work(
    djdb: DjangoDb, admin: psycopg.Connection[Any]
) -> None:
    """The handler's writes roll back with the claim; the failure is recorded in a transaction of
    its own (reason: the violated constraint), and quarantine comes at max_attempts (3)."""
    from ledger.models import Entry

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing", handler_version="v1")
    taken = uid()
    assert (
        inbox.handle(
            message(taken),
            lambda msg: Entry.objects.create(account_id=1, message_id=msg.message_id, amount=1, reference=taken),
        ).outcome
        is Outcome.APPLIED
    )
    m = message(uid())

    def duplicate_reference(msg: Message) -> None:
        Entry.objects.create(account_id=1, message_id=msg.message_id, amount=5)  # written first ...
        Entry.objects.create(account_id=1, message_id=msg.message_id, amount=5, reference=taken)  # ... then fails

    results = [inbox.handle(m, duplicate_reference) for _ in range(3)]
    assert [r.outcome for r in results] == [Outcome.FAILED, Outcome.FAILED, Outcome.QUARANTINED]
    assert results[0].reason_code == "ledger_entry_reference_key" and not results[0].ack
    assert type(results[0].exception).__name__ == "IntegrityError"
    assert entries(admin, m.message_id) == 0
    assert attempts(admin, m.message_id) == (3, "ledger_entry_reference_key")
    with pytest.raises(ValueError, match="boom"):
        inbox.handle(message(uid()), lambda msg: (_ for _ in ()).throw(ValueError("boom")), raise_on_failure=True)


def test_a_handler_that_swallows_a_database_error_fails_instead_of_committing_nothing(
    djdb: DjangoDb, admin: psycopg.Connection[Any]
) -> None:
    """Caught outside a savepoint, a database error marks Django's block for rollback, which would
    then end without a COMMIT and without an error: recorded as failure 25P02 instead."""
    from django.db import IntegrityError
    from ledger.models import Entry

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing", handler_version="v1")
    taken = uid()
    inbox.handle(
        message(taken),
        lambda msg: Entry.objects.create(account_id=1, message_id=msg.message_id, amount=1, reference=taken),
    )
    m = message(uid())

    def swallow(msg: Message) -> None:
        Entry.objects.create(account_id=1, message_id=msg.message_id, amount=1)
        with contextlib.suppress(IntegrityError):
            Entry.objects.create(account_id=1, message_id=msg.message_id, amount=1, reference=taken)

    result = inbox.handle(m, swallow)
    assert result.outcome is Outcome.FAILED and result.reason_code == "25P02"
    assert isinstance(result.exception, HandlerProtocolError)
    assert entries(admin, m.message_id) == 0


def test_handle_refuses_to_run_inside_an_outer_atomic_block(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    from django.db import transaction

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing")
    m = message(uid())
    with transaction.atomic(), pytest.raises(PginboxError, match=r"inside transaction\.atomic"):
        inbox.handle(m, lambda msg: None)
    assert admin.execute("SELECT count(*) FROM inbox.message WHERE message_id = %s", (m.message_id,)).fetchone() == (0,)


def test_views_under_atomic_requests(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    """Through Django's request handling, ATOMIC_REQUESTS=True: the view marked
    non_atomic_requests handles (its 2xx is the ack); the same view in the request's transaction
    is refused before anything is claimed."""
    from django.test import Client

    client = Client()
    body: dict[str, Any] = {"producer": "orders", "id": uid(), "payload": {"account": 1, "amount": 3}}
    first = client.post("/webhook", json.dumps(body), content_type="application/json")
    again = client.post("/webhook", json.dumps(body), content_type="application/json")
    assert (first.status_code, first.json()) == (200, {"outcome": "applied"})
    assert (again.status_code, again.json()) == (200, {"outcome": "duplicate"})
    assert entries(admin, body["id"]) == 1
    other = {**body, "id": uid()}
    with pytest.raises(PginboxError, match="ATOMIC_REQUESTS"):
        client.post("/webhook-in-request-transaction", json.dumps(other), content_type="application/json")
    assert entries(admin, other["id"]) == 0


def test_a_producer_view_enqueues_in_the_request_transaction(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    from django.db import transaction
    from django.test import Client
    from ledger.models import Order

    from pginbox.integrations.django import DjangoInbox, enqueue

    client = Client()
    order = uid()
    created = client.post("/orders", json.dumps({"order": order, "amount": 12}), content_type="application/json")
    retried = client.post("/orders", json.dumps({"order": order, "amount": 12}), content_type="application/json")
    assert (created.status_code, retried.status_code) == (201, 200)
    rows = admin.execute(
        "SELECT effect_id, destination, payload, consumer FROM inbox.outbox WHERE effect_id = %s",
        (f"order-{order}:crm",),
    ).fetchall()
    assert rows == [(f"order-{order}:crm", "crm", {"order": order, "amount": 12}, "shop-api")]
    # rolled back with the block it was enqueued in
    with pytest.raises(RuntimeError), transaction.atomic():
        Order.objects.create(id="rolled-back", amount=1)
        assert enqueue("rolled-back:crm", "crm", {}, consumer="shop-api") is True
        raise RuntimeError("the request failed")
    # outside any block it would commit apart from the write it belongs to: refused
    with pytest.raises(PginboxError, match=r"transaction\.atomic"):
        enqueue("alone:crm", "crm", {}, consumer="shop-api")
    with pytest.raises(PginboxError, match=r"transaction\.atomic"):
        DjangoInbox(consumer="shop-api").enqueue("alone:crm", "crm", {})
    assert admin.execute(
        "SELECT count(*) FROM inbox.outbox WHERE effect_id IN ('rolled-back:crm', 'alone:crm')"
    ).fetchone() == (0,)


def test_claim_in_the_callers_atomic_block(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    from django.db import transaction
    from ledger.models import Entry

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing")
    m = message(uid())
    with transaction.atomic():
        claim = inbox.claim(m)
        assert claim.outcome is Outcome.CLAIMED
        Entry.objects.create(account_id=1, message_id=m.message_id, amount=1)
    with transaction.atomic():
        assert inbox.claim(m).outcome is Outcome.DUPLICATE
    with pytest.raises(PginboxError, match=r"transaction\.atomic"):
        inbox.claim(message(uid()))
    assert entries(admin, m.message_id) == 1


def test_transient_errors_rerun_the_whole_transaction(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    """A serialization failure raised by the server, then the handler's own backend terminated:
    each re-runs the claim and the handler (on a new connection after the second), never recorded."""
    from django.db import connection
    from ledger.models import Entry

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing", retry=FAST_RETRY)
    m = message(uid())
    calls: list[int] = []

    def flaky(msg: Message) -> None:
        calls.append(1)
        Entry.objects.create(account_id=1, message_id=msg.message_id, amount=1)
        with connection.cursor() as cur:
            if len(calls) == 1:
                cur.execute("DO $$BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END$$")
            if len(calls) == 2:
                cur.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    result = inbox.handle(m, flaky)
    assert result.outcome is Outcome.APPLIED and result.retries == 2
    assert len(calls) == 3
    assert entries(admin, m.message_id) == 1
    assert attempts(admin, m.message_id) in (None, (0, None))


def test_a_worker_survives_its_connection_being_closed_between_messages(
    djdb: DjangoDb, admin: psycopg.Connection[Any]
) -> None:
    """The server ends the idle connection of a long-running worker (a restart, a failover, an
    idle timeout): the next handle starts on a new connection."""
    from django.db import connection
    from ledger.models import Entry

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing", retry=FAST_RETRY)

    def write(msg: Message) -> None:
        Entry.objects.create(account_id=1, message_id=msg.message_id, amount=1)

    assert inbox.handle(message(uid()), write).outcome is Outcome.APPLIED
    pid = connection.connection.info.backend_pid
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    m = message(uid())
    assert inbox.handle(m, write).outcome is Outcome.APPLIED
    assert connection.connection.info.backend_pid != pid
    assert entries(admin, m.message_id) == 1


def test_a_commit_whose_answer_is_lost_is_resolved(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    """The proxy forwards COMMIT, waits for the server's answer and drops the connection: the
    commit happened, Django never heard it. pg_xact_status says committed: APPLIED, not retried,
    and the redelivery is a duplicate."""
    from ledger.models import Entry

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing", retry=FAST_RETRY, using="lossy")

    def write(msg: Message) -> None:
        Entry.objects.using("lossy").create(account_id=1, message_id=msg.message_id, amount=1)

    assert inbox.handle(message(uid()), write).outcome is Outcome.APPLIED  # schema check done
    m = message(uid())
    djdb.proxy.arm()
    result = inbox.handle(m, write)
    assert djdb.proxy.dropped.is_set()
    assert result.outcome is Outcome.APPLIED and result.retries == 0
    assert inbox.handle(m, write).outcome is Outcome.DUPLICATE
    assert entries(admin, m.message_id) == 1


def test_a_redelivered_crash_loop_ends_in_quarantine(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    """redelivered=True announces each attempt before the handler runs (inbox.record_start): a
    handler that kills its worker every time is quarantined at max_attempts without running."""
    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing")
    m = message(uid(), redelivered=True)
    runs: list[int] = []

    def crash(msg: Message) -> None:
        runs.append(1)
        raise KeyboardInterrupt  # the worker "dies" in the handler

    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            inbox.handle(m, crash)
    result = inbox.handle(m, crash)
    assert result.outcome is Outcome.QUARANTINED
    assert len(runs) == 2


def prepared(alias: str) -> list[str]:
    """The statements prepared on the server session of Django's connection `alias`."""
    from django.db import connections

    with connections[alias].cursor() as cur:
        cur.execute("SELECT statement FROM pg_catalog.pg_prepared_statements ORDER BY prepare_time")
        return [str(row[0]) for row in cur.fetchall()]


def credit_orm(msg: Message) -> None:
    from django.db.models import F
    from ledger.models import Account, Entry

    Account.objects.filter(id=1).update(balance=F("balance") + msg.payload["amount"])
    Entry.objects.create(account_id=1, message_id=msg.message_id, amount=msg.payload["amount"])


@pytest.mark.parametrize("pipeline", [None, True], ids=["default", "pipeline"])
def test_handle_prepares_its_claim_and_nothing_of_djangos(
    djdb: DjangoDb, admin: psycopg.Connection[Any], pipeline: bool | None
) -> None:
    """Django leaves prepare_threshold at None (for poolers): DjangoInbox still prepares its claim,
    once per connection, as pginbox.Inbox does, and only the claim: the ORM's statements stay
    unprepared, and the connection's threshold is Django's again after each message. Pipelined or
    not (the default to this local server: not)."""
    from django.db import connection

    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing", handler_version="v1", pipeline=pipeline)
    ids = [uid() for _ in range(7)]
    assert [inbox.handle(message(i), credit_orm).outcome for i in ids] == [Outcome.APPLIED] * 7
    assert inbox.handle(message(ids[0]), credit_orm).outcome is Outcome.DUPLICATE
    statements = prepared("default")
    assert len(statements) == 1 and "inbox.claim(" in statements[0], statements
    assert connection.connection.prepare_threshold is None
    assert [entries(admin, i) for i in ids] == [1] * 7


def test_a_project_that_turned_prepared_statements_off_gets_none(
    djdb: DjangoDb, admin: psycopg.Connection[Any]
) -> None:
    """OPTIONS {"prepare_threshold": None}, said in the settings: DjangoInbox prepares nothing."""
    from pginbox.integrations.django import DjangoInbox

    inbox = DjangoInbox(consumer="billing", handler_version="v1", using="unprepared")

    def write(msg: Message) -> None:
        from django.db import connections

        with connections["unprepared"].cursor() as cur:
            cur.execute(
                "INSERT INTO ledger_entry (account_id, message_id, amount, reference) VALUES (1, %s, 1, %s)",
                (msg.message_id, msg.message_id),
            )

    ids = [uid() for _ in range(6)]
    assert [inbox.handle(message(i), write).outcome for i in ids] == [Outcome.APPLIED] * 6
    assert prepared("unprepared") == []
    assert [entries(admin, i) for i in ids] == [1] * 6


def test_behind_pgbouncer_nothing_is_prepared_and_nothing_fails(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    """Alias "pooled" goes through PgBouncer in transaction mode with one server connection, on
    which another client prepared statements under psycopg's names (_pg3_0 ...): a prepared claim
    would collide with them (42P05) or miss its own on another session (26000). DjangoInbox sees the
    pooler at its first use and prepares nothing: every message applied at the first try."""
    from django.db import connections

    from pginbox.integrations.django import DjangoInbox

    # the app's role: PgBouncer keeps a pool per database and user
    with psycopg.connect(make_conninfo(djdb.bouncer.route(djdb.admin_dsn), user=djdb.role), autocommit=True) as other:
        for i in range(8):
            other.execute(sql.SQL("PREPARE {} AS SELECT 1").format(sql.Identifier(f"_pg3_{i}")))
    inbox = DjangoInbox(consumer="billing", handler_version="v1", using="pooled", retry=FAST_RETRY)

    def write(msg: Message) -> None:
        with connections["pooled"].cursor() as cur:
            cur.execute(
                "INSERT INTO ledger_entry (account_id, message_id, amount, reference) VALUES (1, %s, 1, %s)",
                (msg.message_id, msg.message_id),
            )

    ids = [uid() for _ in range(8)]
    results = [inbox.handle(message(i), write) for i in ids]
    assert [(r.outcome, r.retries) for r in results] == [(Outcome.APPLIED, 0)] * 8
    assert [entries(admin, i) for i in ids] == [1] * 8
    assert [attempts(admin, i) for i in ids] == [None] * 8


def test_doc_handle_example(djdb: DjangoDb, admin: psycopg.Connection[Any]) -> None:
    """docs/django.md §4, run as written."""
    before = admin.execute("SELECT balance FROM ledger_account WHERE id = 1").fetchone()
    admin.execute("DELETE FROM inbox.message WHERE message_id = 'evt-1'")
    exec(compile(doc_block("python", 0), "docs/django.md §4", "exec"), {"__name__": "doc"})
    assert entries(admin, "evt-1") == 1
    after = admin.execute("SELECT balance FROM ledger_account WHERE id = 1").fetchone()
    assert before is not None and after == (before[0] + 10,)


def test_doc_views_are_the_test_projects_views() -> None:
    """docs/django.md §5 shows ledger/views.py as it is (test_views_under_atomic_requests and
    test_a_producer_view_enqueues_in_the_request_transaction run it through Django)."""
    assert doc_block("python", 1) == (DJANGO_PROJECT / "ledger" / "views.py").read_text()


def test_doc_release_step_deploys_a_fresh_database(djdb: DjangoDb, pg_base: str) -> None:
    """docs/django.md §2, run as written in the project's directory, on an empty database:
    `pginbox deploy` as the superuser, then `manage.py migrate` as the app's role."""
    name = f"t_django_release_{uuid.uuid4().hex[:10]}"
    create_database(pg_base, name)
    try:
        with psycopg.connect(dsn_for(pg_base, name), autocommit=True) as admin:
            admin.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(djdb.role)))
        bin_dir = str(Path(sys.executable).parent)
        env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
            "PGINBOX_DEPLOY_DSN": dsn_for(pg_base, name),
            "PGINBOX_DJANGO_NAME": name,
        }
        env.pop("PGINBOX_DJANGO_LOSSY_PORT", None)
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", doc_block("sh")],
            cwd=DJANGO_PROJECT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        with psycopg.connect(dsn_for(pg_base, name), autocommit=True) as admin:
            assert admin.execute("SELECT release FROM inbox.schema_release()").fetchone() == ("0.3.0",)
            owners = admin.execute(
                "SELECT tablename, tableowner FROM pg_tables WHERE tablename LIKE 'ledger_%' ORDER BY 1"
            ).fetchall()
            assert owners == [(t, djdb.role) for t in ("ledger_account", "ledger_entry", "ledger_order")]
    finally:
        drop_database(pg_base, name)


def test_the_trap_pginbox_inbox_on_djangos_connection_fails_nested_atomic(
    djdb: DjangoDb, admin: psycopg.Connection[Any]
) -> None:
    """Why the integration exists (issue 25): pginbox.Inbox handed Django's psycopg connection
    switches its autocommit around BEGIN, and the handler's atomic() (get_or_create opens one)
    fails with "can't change 'autocommit' now": the message is recorded as failed, nothing applied.
    DjangoInbox applies the same handler."""
    from django.db import connection, transaction
    from ledger.models import Account, Entry

    from pginbox import Inbox
    from pginbox.integrations.django import DjangoInbox

    def handler(msg: Message) -> None:
        account, _ = Account.objects.get_or_create(id=1)  # exists: no atomic() ...
        with transaction.atomic():  # ... but this (and get_or_create of a new row) opens one
            Entry.objects.create(account=account, message_id=msg.message_id, amount=1)

    connection.ensure_connection()
    trapped = message(uid())
    result = Inbox(connection.connection, consumer="billing").handle(trapped, lambda cur, msg: handler(msg))
    assert result.outcome is Outcome.FAILED
    assert "autocommit" in str(result.exception)
    assert entries(admin, trapped.message_id) == 0
    m = message(uid())
    assert DjangoInbox(consumer="billing").handle(m, handler).outcome is Outcome.APPLIED
    assert entries(admin, m.message_id) == 1
