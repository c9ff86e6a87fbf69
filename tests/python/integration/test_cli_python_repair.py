"""`pginbox quarantine repair ID --python MODULE:FUNCTION` and `pginbox quarantine redeem`: a
quarantined message whose handler is Python, repaired with the consumer's own login (click's
CliRunner, real database; the entries of test_cli.py's fixture). The operator's --dsn is the
superuser; the consumer's login is the service role bound to `billing` that owns its tables.

What is checked: the handler runs as the consumer's login (session_user, its enqueue is the
consumer's), its writes, the claim and the decision commit together, a failing handler leaves
everything as it was but the audit, a grant runs once, and every refusal comes from the database
(an operator's or a stranger's login, another handler, a consumer nobody is bound to, a conflict
entry) before anything is written."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from billing_handlers import credit, credit_async
from click.testing import CliRunner
from conftest import REPO_ROOT
from psycopg.conninfo import conninfo_to_dict
from test_cli import Entries, _apply, cli, fails
from test_cli import entries as entries  # the fixture

from pginbox import Message, RetriesExhausted, RetryPolicy
from pginbox.cli import main
from pginbox.ops import granted_repair as granted

HANDLER = "billing_handlers:credit"
#: a transient error (serialization_failure) raised in the handler's transaction
CONFLICT = "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$"


@pytest.fixture
def service(entries: Entries, conn: psycopg.Connection[Any]) -> str:
    """The consumer's login: the role test_cli's fixture made the billing service (bound, owner of
    acct). Its repair_log records who ran the handler; billing may send to crm."""
    row = conn.execute(
        "SELECT r.rolname FROM inbox.consumer_binding b JOIN pg_roles r ON r.oid = b.role WHERE b.consumer = 'billing'"
    ).fetchone()
    assert row is not None
    role = str(row[0])
    conn.execute("CREATE TABLE repair_log (message_id text NOT NULL, login text NOT NULL)")
    conn.execute(f'ALTER TABLE repair_log OWNER TO "{role}"')
    conn.execute("SELECT inbox.bind_destination('crm', 'billing', 'receipts')")
    params = {k: v for k, v in conninfo_to_dict(entries.dsn).items() if v is not None}
    params["user"] = role
    return " ".join(f"{k}={v}" for k, v in params.items())


def logins_gone(conn: psycopg.Connection[Any], role: str, *, within: float = 5.0) -> bool:
    """True when no backend of `role` is left (within `within` seconds: a backend exits after its
    client closed the connection)."""
    deadline = time.monotonic() + within
    while True:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (role,)).fetchone()
        if row == (0,):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


class KillOnce:
    """Called by a handler with its cursor: terminates that connection's backend the first time,
    does nothing after (the retried transaction runs on a new connection)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.killed: list[int] = []

    def __call__(self, cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> None:
        if not self.killed:
            self.killed.append(cur.connection.info.backend_pid)
            self.conn.execute("SELECT pg_terminate_backend(%s, 5000)", (self.killed[0],))


class ConflictEveryTime:
    """A handler (`handler`, `ahandler` for asyncio) whose transaction fails with a transient error (40001) every
    time it runs; `calls` counts the runs."""

    def __init__(self) -> None:
        self.calls = 0

    def handler(self, cur: psycopg.Cursor[Any], message: Message) -> None:
        self.calls += 1
        cur.execute(CONFLICT)

    async def ahandler(self, cur: psycopg.AsyncCursor[Any], message: Message) -> None:
        self.calls += 1
        await cur.execute(CONFLICT)


def state(conn: psycopg.Connection[Any], quarantine_id: int) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT q.status, (SELECT count(*) FROM repair_log), (SELECT balance FROM acct WHERE id = 2),"
        " (SELECT count(*) FROM inbox.outbox) FROM inbox.quarantine q WHERE q.quarantine_id = %s",
        (quarantine_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_repair_with_a_python_handler_runs_as_the_consumers_login(
    entries: Entries, service: str, conn: psycopg.Connection[Any]
) -> None:
    entry = entries.missing_2
    conn.execute("INSERT INTO acct (id) VALUES (2)")
    result = cli(
        "quarantine",
        "repair",
        str(entry),
        "--note",
        "account 2 exists now",
        "--python",
        HANDLER,
        "--consumer-dsn",
        service,
        "--handler-version",
        "py-v2",
        dsn=entries.dsn,
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"entry {entry}: recovered (the stored payload was applied by {HANDLER}")
    role = conninfo_to_dict(service)["user"]
    assert conn.execute("SELECT message_id, login FROM repair_log").fetchall() == [("m-2", role)]
    assert conn.execute("SELECT balance FROM acct WHERE id = 2").fetchone() == (7,)
    assert conn.execute("SELECT effect_id, consumer FROM inbox.outbox").fetchall() == [("m-2:receipt", "billing")]
    assert _apply(conn, "m-2", {"account": 2, "amount": 7})[0] == "duplicate"

    details = json.loads(cli("quarantine", "show", str(entry), "--json", dsn=entries.dsn).stdout)
    assert details["entry"]["status"] == "recovered" and details["message"]["handler_version"] == "py-v2"
    [decision] = details["decisions"]
    assert (decision["decision"], decision["result"], decision["decided_by"]) == ("repair", "recovered", "postgres")
    assert decision["note"].startswith(f"account 2 exists now [python handler {HANDLER}, run by {role}, grant ")


def test_grant_then_redeem_on_the_consumers_side_a_failure_is_audited(
    entries: Entries, service: str, conn: psycopg.Connection[Any]
) -> None:
    entry = entries.missing_2
    issued = cli(
        "quarantine",
        "repair",
        str(entry),
        "--note",
        "try the Python handler",
        "--python",
        HANDLER,
        "--json",
        dsn=entries.dsn,
    )
    assert issued.exit_code == 0, issued.output
    grant = json.loads(issued.stdout)
    assert grant["consumer"] == "billing" and grant["handler"] == HANDLER and grant["quarantine_id"] == entry
    before = state(conn, entry)

    failed = cli("quarantine", "redeem", str(grant["grant_id"]), "--python", HANDLER, "--json", dsn=service)
    assert failed.exit_code == 1, failed.output
    assert json.loads(failed.stdout) | {"grant_id": 0} == {
        "grant_id": 0,
        "quarantine_id": entry,
        "result": "repair_failed",
        "handler": HANDLER,
        "handler_version": HANDLER,
        "reason_code": "LookupError",
        "error_message": "no account 2",
    }
    assert state(conn, entry) == before  # the handler's writes, the claim and its enqueue rolled back
    fails(
        cli("quarantine", "redeem", str(grant["grant_id"]), "--python", HANDLER, dsn=service),
        "already used",
        "SQLSTATE 55000",
    )
    details = json.loads(cli("quarantine", "show", str(entry), "--json", dsn=entries.dsn).stdout)
    assert [(d["result"], d["reason_code"]) for d in details["decisions"]] == [("repair_failed", "LookupError")]
    assert details["entry"]["status"] == "open" and details["message"]["status"] == "quarantined"

    conn.execute("INSERT INTO acct (id) VALUES (2)")
    again = json.loads(
        cli(
            "quarantine",
            "repair",
            str(entry),
            "--note",
            "account 2 exists now",
            "--python",
            HANDLER,
            "--json",
            dsn=entries.dsn,
        ).stdout
    )
    done = cli("quarantine", "redeem", str(again["grant_id"]), "--python", HANDLER, dsn=service)
    assert done.exit_code == 0, done.output
    assert state(conn, entry)[:3] == ("recovered", 1, 7)


def test_only_the_consumers_own_login_runs_the_handler(
    entries: Entries, service: str, conn: psycopg.Connection[Any], login_role: Callable[..., str]
) -> None:
    entry = entries.missing_2
    conn.execute("INSERT INTO acct (id) VALUES (2)")
    grant = json.loads(
        cli("quarantine", "repair", str(entry), "--note", "n", "--python", HANDLER, "--json", dsn=entries.dsn).stdout
    )["grant_id"]
    before = state(conn, entry)
    # the operator's own login (here a superuser): no superuser exception
    fails(
        cli("quarantine", "redeem", str(grant), "--python", HANDLER, dsn=entries.dsn),
        f"cannot run repair grant {grant}",
        "only a login of a role bound to consumer 'billing'",
        "SQLSTATE 42501",
    )
    # another service's login
    stranger = login_role("inbox_consumer")
    fails(cli("quarantine", "redeem", str(grant), "--python", HANDLER, dsn=stranger), "SQLSTATE 42501")
    # an operator without consumer rights
    operator = login_role("inbox_operator")
    fails(cli("quarantine", "redeem", str(grant), "--python", HANDLER, dsn=operator), "SQLSTATE 42501")
    # the consumer's login, but another handler than the operator chose
    fails(
        cli("quarantine", "redeem", str(grant), "--python", "billing_handlers:credit_async", dsn=service),
        f"is for handler '{HANDLER}'",
        "SQLSTATE 42501",
    )
    fails(
        cli("quarantine", "redeem", str(grant), "--python", "json:dumps", dsn=service),
        f"is for handler '{HANDLER}'",
        "SQLSTATE 42501",
    )
    assert state(conn, entry) == before
    assert cli("quarantine", "redeem", str(grant), "--python", HANDLER, dsn=service).exit_code == 0


def test_grants_the_database_refuses(entries: Entries, service: str, conn: psycopg.Connection[Any]) -> None:
    fails(
        cli("quarantine", "repair", str(entries.conflict), "--note", "n", "--python", HANDLER, dsn=entries.dsn),
        f"cannot grant a repair of entry {entries.conflict}",
        "identity conflict",
        "SQLSTATE 55000",
    )
    fails(
        cli("quarantine", "repair", str(entries.missing_2), "--note", "n", "--python", "not-a-spec", dsn=entries.dsn),
        "module:function",
        "SQLSTATE 22023",
    )
    role = conninfo_to_dict(service)["user"]
    conn.execute("SELECT inbox.unbind_consumer('billing', %s::regrole)", (role,))
    fails(
        cli("quarantine", "repair", str(entries.missing_2), "--note", "n", "--python", HANDLER, dsn=entries.dsn),
        "no live role is bound to consumer 'billing'",
        "SQLSTATE 42501",
    )
    assert conn.execute("SELECT count(*) FROM inbox.repair_grant").fetchone() == (0,)


def test_the_documented_commands(
    entries: Entries,
    service: str,
    conn: psycopg.Connection[Any],
    login_role: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/security.md, "Python handlers: repair grants": the ```sh block run as written, by an
    operator login (inbox_operator, not a superuser) and the billing service's login. The doc's
    entries 2 and 3 and grant 1 are this database's."""
    page = (REPO_ROOT / "docs" / "security.md").read_text()
    section = page[page.index("### Python handlers: repair grants") :]
    block = re.findall(r"```sh\n(.*?)```", section, re.S)[0]
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("pginbox ")]
    assert len(commands) == 3
    conn.execute("INSERT INTO acct (id) VALUES (2), (3)")
    env = {"OPERATOR_DSN": login_role("inbox_operator"), "BILLING_DSN": service}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ids = {"2": str(entries.missing_2), "3": str(entries.missing_3)}
    for command in commands:
        argv = [ids.get(a, a) if i == 2 else os.path.expandvars(a) for i, a in enumerate(command[1:])]
        result = CliRunner().invoke(main, argv, catch_exceptions=True)
        assert result.exit_code == 0, (argv, result.output)
        issued = re.search(r"repair grant (\d+) issued", result.stdout)
        if issued:
            ids["1"] = issued.group(1)
    assert state(conn, entries.missing_2)[0] == "recovered"
    assert conn.execute(
        "SELECT status FROM inbox.quarantine WHERE quarantine_id = %s", (entries.missing_3,)
    ).fetchone() == ("recovered",)
    assert conn.execute("SELECT count(*) FROM repair_log").fetchone() == (2,)
    assert conn.execute("SELECT DISTINCT granted_by FROM inbox.repair_grant").fetchall() == [
        (conninfo_to_dict(env["OPERATOR_DSN"])["user"],)
    ]


def test_the_handler_pginbox_consume_is_configured_with(
    entries: Entries, service: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """--consume-config: the [consume] handler and handler_version of the consumer's own file."""
    config = tmp_path / "consume.toml"
    config.write_text(
        f'[consume]\nurl = "amqp://localhost"\nconsumer = "billing"\nqueue = "billing"\n'
        f'handler = "{HANDLER}"\nhandler_version = "2026.12"\n'
    )
    conn.execute("INSERT INTO acct (id) VALUES (2)")
    result = cli(
        "quarantine",
        "repair",
        str(entries.missing_2),
        "--note",
        "n",
        "--consume-config",
        str(config),
        "--consumer-dsn",
        service,
        dsn=entries.dsn,
    )
    assert result.exit_code == 0, result.output
    assert conn.execute(
        "SELECT handler, handler_version, result FROM inbox.repair_grant WHERE quarantine_id = %s", (entries.missing_2,)
    ).fetchall() == [(HANDLER, "2026.12", "recovered")]
    sql_config = tmp_path / "sql.toml"
    sql_config.write_text('[consume]\nhandler = "sql"\n')
    refused = cli(
        "quarantine",
        "repair",
        str(entries.missing_3),
        "--note",
        "n",
        "--consume-config",
        str(sql_config),
        dsn=entries.dsn,
    )
    assert refused.exit_code == 2 and "names no Python handler" in refused.stderr, refused.output


def test_an_async_handler_runs_on_an_asyncio_connection(
    entries: Entries, service: str, conn: psycopg.Connection[Any]
) -> None:
    """`async def` handlers (what `pginbox consume` runs on its asyncio connection) get an
    AsyncCursor, with the consumer's login; their failure is audited as a sync one's."""
    spec = "billing_handlers:credit_async"
    failed = cli(
        "quarantine",
        "repair",
        str(entries.missing_2),
        "--note",
        "n",
        "--python",
        spec,
        "--consumer-dsn",
        service,
        "--json",
        dsn=entries.dsn,
    )
    assert failed.exit_code == 1, failed.output
    assert json.loads(failed.stdout)["reason_code"] == "LookupError"
    assert state(conn, entries.missing_2)[:2] == ("open", 0)
    conn.execute("INSERT INTO acct (id) VALUES (2)")
    done = cli(
        "quarantine",
        "repair",
        str(entries.missing_2),
        "--note",
        "n",
        "--python",
        spec,
        "--consumer-dsn",
        service,
        dsn=entries.dsn,
    )
    assert done.exit_code == 0, done.output
    role = conninfo_to_dict(service)["user"]
    assert conn.execute("SELECT message_id, login FROM repair_log").fetchall() == [("m-2", role)]
    assert state(conn, entries.missing_2)[:3] == ("recovered", 1, 7)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_connection_lost_inside_the_handler_is_replaced_and_the_repair_runs_once(
    flavour: str, entries: Entries, service: str, conn: psycopg.Connection[Any]
) -> None:
    """The consumer's connection is terminated inside the handler: the transaction is gone with
    it and runs again on a new connection with the same parameters (redeem and redeem_async share
    the rule); the handler's writes commit once, and the replacement connection is closed on
    return."""
    conn.execute("INSERT INTO acct (id) VALUES (2)")
    issued = granted.grant(conn, entries.missing_2, HANDLER, "n")
    kill_once = KillOnce(conn)

    def handler(cur: psycopg.Cursor[Any], message: Message) -> None:
        kill_once(cur)
        credit(cur, message)

    async def ahandler(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
        kill_once(cur)
        await credit_async(cur, message)

    if flavour == "sync":
        with psycopg.connect(service, autocommit=True, prepare_threshold=None) as consumer:
            done = granted.redeem(consumer, issued.grant_id, HANDLER, handler)
    else:
        done = asyncio.run(granted.redeem_async(service, issued.grant_id, HANDLER, ahandler))
    assert len(kill_once.killed) == 1
    assert (done.result, done.quarantine_id) == ("recovered", entries.missing_2)
    role = conninfo_to_dict(service)["user"]
    assert conn.execute("SELECT message_id, login FROM repair_log").fetchall() == [("m-2", role)]
    assert state(conn, entries.missing_2)[:3] == ("recovered", 1, 7)
    assert logins_gone(conn, str(role))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_transient_error_every_time_gives_up_naming_the_grant(
    flavour: str, entries: Entries, service: str, conn: psycopg.Connection[Any]
) -> None:
    """A handler whose transaction fails with a transient error each time: retried up to the
    policy's max_attempts, then RetriesExhausted noting the grant (both flavours); nothing is
    written, the grant is not used, and the entry stays quarantined."""
    conn.execute("INSERT INTO acct (id) VALUES (2)")
    issued = granted.grant(conn, entries.missing_2, HANDLER, "n")
    conflict = ConflictEveryTime()
    policy = RetryPolicy(max_attempts=2, base_delay=0.0)
    with pytest.raises(RetriesExhausted) as caught:
        if flavour == "sync":
            with psycopg.connect(service, autocommit=True, prepare_threshold=None) as consumer:
                granted.redeem(consumer, issued.grant_id, HANDLER, conflict.handler, retry=policy)
        else:
            asyncio.run(granted.redeem_async(service, issued.grant_id, HANDLER, conflict.ahandler, retry=policy))
    assert conflict.calls == 2
    assert caught.value.sqlstate == "40001"
    assert caught.value.__notes__ == [f"pginbox: repair grant {issued.grant_id}"]
    assert state(conn, entries.missing_2)[:2] == ("open", 0)
    with psycopg.connect(service, autocommit=True, prepare_threshold=None) as consumer:
        done = granted.redeem(consumer, issued.grant_id, HANDLER, credit)
    assert done.result == "recovered" and state(conn, entries.missing_2)[:3] == ("recovered", 1, 7)
