"""Replay plans with a Python handler: `pginbox replay create ... --python MODULE:FUNCTION` by an
operator, `pginbox replay run PLAN --python MODULE:FUNCTION` by the consumer's own login (click's
CliRunner and real processes, real database; the billing consumer of test_cli.py's fixture, whose
service role owns its tables).

What is checked: the handler runs as the consumer's login, one item per transaction, with the
item's claim; each item's domain effect happens exactly once (replay_log has no unique key), also
when the runner is SIGKILLed inside an item and run again; a failing item is recorded and the plan
goes on; every refusal comes from the database (an operator's, a superuser's or a stranger's
login, another handler, a plan of a SQL handler, a consumer nobody is bound to, a completed plan)
before anything is written; the commands of docs/replay.md run as written."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from billing_handlers import recredit, recredit_async
from click.testing import CliRunner
from conftest import REPO_ROOT
from helpers_paths import pythonpath
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Jsonb
from test_cli import Entries, cli, fails
from test_cli import entries as entries  # the fixture
from test_cli_python_repair import ConflictEveryTime, KillOnce, logins_gone
from test_cli_python_repair import service as service  # the fixture: the billing service's login

from pginbox import Message, RetriesExhausted, RetryPolicy
from pginbox.cli import main
from pginbox.ops import python_replay

HANDLER = "billing_handlers:recredit"
CLAIM = "SELECT inbox.claim('billing', 'shop', %s, %s, handler_version => %s)"
SLOW = "billing_handlers:recredit_slow"


def claim_as_service(service: str, message_id: str, payload: dict[str, Any], version: str = "py-v1") -> dict[str, Any]:
    """Claim a message as the billing service (as if its handler `version` had processed it); the
    replay item that names it."""
    with psycopg.connect(service, autocommit=True) as svc:
        svc.execute(CLAIM, (message_id, Jsonb(payload), version))
    return {"producer": "shop", "message_id": message_id, "payload": payload}


def items_file(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


def create_plan(name: str, *how: str, dsn: str) -> Any:
    """`pginbox replay create NAME` of billing's credit messages; `how` names the handler."""
    return cli(
        "replay",
        "create",
        name,
        "--consumer",
        "billing",
        "--message-type",
        "credit",
        *how,
        "--note",
        "n",
        "--json",
        dsn=dsn,
    )


@pytest.fixture
def operator(login_role: Callable[..., str]) -> str:
    """A login of an inbox_operator (not a superuser): creates the plans."""
    return login_role("inbox_operator")


@pytest.fixture
def history(entries: Entries, service: str, conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Six messages the billing service processed with its Python handler, version py-v1 (r-6:
    py-v2 already), as replay items; replay_log is the replay handler's domain table."""
    role = conninfo_to_dict(service)["user"]
    conn.execute("CREATE TABLE replay_log (message_id text NOT NULL, login text NOT NULL)")
    conn.execute(f'ALTER TABLE replay_log OWNER TO "{role}"')
    return [
        claim_as_service(service, f"r-{n}", {"account": 1, "amount": n}, "py-v2" if n == 6 else "py-v1")
        for n in range(1, 7)
    ]


def logged(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute("SELECT message_id, count(*) FROM replay_log GROUP BY 1").fetchall()
    return {m: int(n) for m, n in rows}


def new_plan(
    operator: str, items: list[dict[str, Any]], *, handler: str = HANDLER, name: str = "py-fix", tmp_path: Path
) -> int:
    created = create_plan(name, "--python", handler, "--handler-version", "py-v2", dsn=operator)
    assert created.exit_code == 0, created.output
    plan_id = int(json.loads(created.stdout)["plan_id"])
    lines = items_file(tmp_path / f"{name}.jsonl", items)
    added = cli("replay", "add", str(plan_id), str(lines), dsn=operator)
    assert added.exit_code == 0, added.output
    return plan_id


def test_a_python_plan_runs_as_the_consumers_login(
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    tmp_path: Path,
) -> None:
    plan_id = new_plan(operator, history, tmp_path=tmp_path)
    result = cli("replay", "run", str(plan_id), "--python", HANDLER, "--json", dsn=service)
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)
    assert run["status"] == "completed" and run["handler"] == HANDLER
    assert (run["this_run"]["applied"], run["this_run"]["failed"], run["this_run"]["skipped"]) == (5, 0, 1)
    role = conninfo_to_dict(service)["user"]
    assert logged(conn) == {f"r-{n}": 1 for n in range(1, 6)}, "r-6 was processed by py-v2 already: skipped"
    assert conn.execute("SELECT DISTINCT login FROM replay_log").fetchall() == [(role,)]
    rows = conn.execute(
        "SELECT status, finished_by, count(*) FROM inbox.replay_item WHERE plan_id = %s GROUP BY 1, 2 ORDER BY 1",
        (plan_id,),
    ).fetchall()
    assert rows == [("applied", role, 5), ("skipped", role, 1)]
    status = json.loads(cli("replay", "status", str(plan_id), "--json", dsn=operator).stdout)["plans"][0]
    assert (status["handler"], status["handler_version"], status["status"], status["pin_matches"]) == (
        HANDLER,
        "py-v2",
        "completed",
        True,
    )
    operator_role = conninfo_to_dict(operator)["user"]
    assert [(d["decision"], d["decided_by"], d["handler"]) for d in status["decisions"]] == [
        ("create", operator_role, HANDLER),
        ("add_items", operator_role, HANDLER),
        ("completed", role, HANDLER),
    ]
    # Run again: the plan is done, refused with the reason.
    fails(cli("replay", "run", str(plan_id), "--python", HANDLER, dsn=service), "already completed", "SQLSTATE 55000")
    assert logged(conn) == {f"r-{n}": 1 for n in range(1, 6)}


def test_a_failing_item_is_recorded_and_the_plan_goes_on(
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    tmp_path: Path,
) -> None:
    items = [history[0], claim_as_service(service, "r-neg", {"account": 1, "amount": -3}), history[1]]
    plan_id = new_plan(operator, items, tmp_path=tmp_path)
    result = cli("replay", "run", str(plan_id), "--python", HANDLER, dsn=service)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"replay plan {plan_id}: completed; this run applied 2, failed 1, skipped 0 with the Python handler {HANDLER}",
        f"  item {plan_item(conn, plan_id, 'r-neg')} failed (ValueError): negative amount in r-neg",
    ]
    assert logged(conn) == {"r-1": 1, "r-2": 1}, "the failed item's writes rolled back"
    assert conn.execute(
        "SELECT status, reason_code, error_message FROM inbox.replay_item WHERE plan_id = %s AND message_id = 'r-neg'",
        (plan_id,),
    ).fetchone() == ("failed", "ValueError", "negative amount in r-neg")
    claimed = conn.execute("SELECT count(*) FROM inbox.message WHERE consumer = %s", (f"replay:{plan_id}",)).fetchone()
    assert claimed == (2,), "the failed item's operation id rolled back with it"


def one_value(conn: psycopg.Connection[Any], query: str, params: tuple[object, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def plan_item(conn: psycopg.Connection[Any], plan_id: int, message_id: str) -> int:
    query = "SELECT item_no FROM inbox.replay_item WHERE plan_id = %s AND message_id = %s"
    return int(one_value(conn, query, (plan_id, message_id)))


def test_refusals_come_from_the_database_before_anything_is_written(
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    login_role: Callable[..., str],
    tmp_path: Path,
    entries: Entries,
) -> None:
    plan_id = new_plan(operator, history, tmp_path=tmp_path)
    # the operator's own logins (a superuser here, and an inbox_operator): no superuser exception
    fails(
        cli("replay", "run", str(plan_id), "--python", HANDLER, dsn=entries.dsn),
        f"cannot run replay plan {plan_id}",
        "only a login of a role bound to consumer 'billing'",
        "SQLSTATE 42501",
    )
    fails(cli("replay", "run", str(plan_id), "--python", HANDLER, dsn=operator), "SQLSTATE 42501")
    # another service's login
    fails(cli("replay", "run", str(plan_id), "--python", HANDLER, dsn=login_role("inbox_consumer")), "SQLSTATE 42501")
    # the consumer's login, but another handler than the one approved
    fails(
        cli("replay", "run", str(plan_id), "--python", "billing_handlers:credit", dsn=service),
        f"is approved for handler '{HANDLER}'",
        "SQLSTATE 42501",
    )
    # the SQL runner: a Python plan runs in the consumer's login only
    fails(
        cli("replay", "run", str(plan_id), dsn=operator),
        f"runs the Python handler '{HANDLER}'",
        "SQLSTATE 55000",
    )
    # a plan of a SQL handler is not approved for Python
    sql_plan = create_plan(
        "sql-plan", "--handler", "credit(jsonb)", "--handler-version", registered_version(conn), dsn=operator
    )
    assert sql_plan.exit_code == 0, sql_plan.output
    fails(
        cli("replay", "run", str(json.loads(sql_plan.stdout)["plan_id"]), "--python", HANDLER, dsn=service),
        "is not approved for a Python handler",
        "SQLSTATE 42501",
    )
    assert logged(conn) == {}
    assert conn.execute(
        "SELECT count(*) FROM inbox.replay_item WHERE plan_id = %s AND status <> 'pending'", (plan_id,)
    ).fetchone() == (0,)
    # a consumer nobody is bound to: the operator cannot act for it
    role = conninfo_to_dict(service)["user"]
    conn.execute("SELECT inbox.unbind_consumer('billing', %s::regrole)", (role,))
    refused = create_plan("unbound", "--python", HANDLER, "--handler-version", "py-v2", dsn=operator)
    fails(refused, "no live role is bound to consumer 'billing'", "SQLSTATE 42501")
    assert conn.execute("SELECT count(*) FROM inbox.replay_plan WHERE plan_name = 'unbound'").fetchone() == (0,)


def registered_version(conn: psycopg.Connection[Any]) -> str:
    query = "SELECT handler_version FROM inbox.handler WHERE consumer = 'billing' AND message_type = 'credit'"
    return str(one_value(conn, query))


def test_a_runner_killed_mid_plan_then_run_again_applies_each_item_once(
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    tmp_path: Path,
) -> None:
    """SIGKILL the runner (a real process) while it is inside an item's transaction, then run the
    plan again: the killed item rolled back and is applied by the second run, every item once."""
    more = [claim_as_service(service, f"r-{n}", {"account": 1, "amount": n}) for n in range(7, 15)]
    items = history[:5] + more  # 13 items, none skipped
    plan_id = new_plan(operator, items, handler=SLOW, tmp_path=tmp_path)
    role = conninfo_to_dict(service)["user"]
    inside = (
        "SELECT count(*) FROM pg_stat_activity WHERE usename = %s AND datname = current_database()"
        " AND state = 'idle in transaction'"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    command = [sys.executable, "-m", "pginbox", "replay", "run", str(plan_id), "--python", SLOW, "--dsn", service]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        wait_until(lambda: applied(conn, plan_id) >= 3, "three items applied")
        # inside the next item's transaction: its handler wrote, and sleeps before COMMIT
        wait_until(lambda: conn.execute(inside, (role,)).fetchone() == (1,), "the runner inside an item")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    wait_until(
        lambda: (
            conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = %s AND datname = current_database()", (role,)
            ).fetchone()
            == (0,)
        ),
        "the killed runner's backend to end",
    )
    partial = logged(conn)
    done = applied(conn, plan_id)
    assert 3 <= done < len(items) and len(partial) == done and set(partial.values()) == {1}, (done, partial)
    assert conn.execute(
        "SELECT count(*) FROM inbox.message WHERE consumer = %s", (f"replay:{plan_id}",)
    ).fetchone() == (done,), "claims, applied items and domain effects committed together"

    again = subprocess.run(
        [*command, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    run = json.loads(again.stdout)
    assert run["status"] == "completed" and run["this_run"]["applied"] == len(items) - done
    assert logged(conn) == {i["message_id"]: 1 for i in items}, "each item's effect exactly once"


def applied(conn: psycopg.Connection[Any], plan_id: int) -> int:
    query = "SELECT count(*) FROM inbox.replay_item WHERE plan_id = %s AND status = 'applied'"
    return int(one_value(conn, query, (plan_id,)))


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_handler_pginbox_consume_is_configured_with(
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    tmp_path: Path,
) -> None:
    """--consume-config: the [consume] handler (and handler_version) of the consumer's own file,
    for the operator's create and the consumer's run alike."""
    config = tmp_path / "consume.toml"
    config.write_text(
        f'[consume]\nurl = "amqp://localhost"\nconsumer = "billing"\nqueue = "billing"\n'
        f'handler = "{HANDLER}"\nhandler_version = "py-v2"\n'
    )
    created = create_plan("from-config", "--consume-config", str(config), dsn=operator)
    assert created.exit_code == 0, created.output
    plan_id = json.loads(created.stdout)["plan_id"]
    assert conn.execute(
        "SELECT python_handler, handler_version FROM inbox.replay_plan WHERE plan_id = %s", (plan_id,)
    ).fetchone() == (HANDLER, "py-v2")
    lines = items_file(tmp_path / "items.jsonl", history[:2])
    assert cli("replay", "add", str(plan_id), str(lines), dsn=operator).exit_code == 0
    result = cli("replay", "run", str(plan_id), "--consume-config", str(config), dsn=service)
    assert result.exit_code == 0, result.output
    assert logged(conn) == {"r-1": 1, "r-2": 1}


def test_an_async_handler_runs_on_an_asyncio_connection(
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    tmp_path: Path,
) -> None:
    """`async def` handlers (what `pginbox consume` runs on its asyncio connection) get an
    AsyncCursor, with the consumer's login; a failure is recorded as a sync one's."""
    spec = "billing_handlers:recredit_async"
    items = [history[0], claim_as_service(service, "r-neg", {"account": 1, "amount": -3}), history[1]]
    plan_id = new_plan(operator, items, handler=spec, tmp_path=tmp_path)
    result = cli("replay", "run", str(plan_id), "--python", spec, "--json", dsn=service)
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)
    assert run["status"] == "completed"
    assert (run["this_run"]["applied"], run["this_run"]["failed"]) == (2, 1)
    assert [f["reason_code"] for f in run["this_run"]["failures"]] == ["ValueError"]
    role = conninfo_to_dict(service)["user"]
    assert logged(conn) == {"r-1": 1, "r-2": 1}
    assert conn.execute("SELECT DISTINCT login FROM replay_log").fetchall() == [(role,)]


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_connection_lost_inside_an_item_is_replaced_and_the_item_applied_once(
    flavour: str,
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    tmp_path: Path,
) -> None:
    """The runner's connection is terminated inside the first item's handler: the item's
    transaction is gone with it and runs again on a new connection with the same parameters
    (run_plan and run_plan_async share the rule); every item is applied once, and the
    replacement connection is closed on return."""
    plan_id = new_plan(operator, history, tmp_path=tmp_path)
    kill_once = KillOnce(conn)

    def handler(cur: psycopg.Cursor[Any], message: Message) -> None:
        kill_once(cur)
        recredit(cur, message)

    async def ahandler(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
        kill_once(cur)
        await recredit_async(cur, message)

    if flavour == "sync":
        with psycopg.connect(service, autocommit=True, prepare_threshold=None) as runner:
            run = python_replay.run_plan(runner, plan_id, HANDLER, handler)
    else:
        run = asyncio.run(python_replay.run_plan_async(service, plan_id, HANDLER, ahandler))
    assert len(kill_once.killed) == 1
    assert (run.status, run.applied_now, run.failed_now, run.skipped_now) == ("completed", 5, 0, 1)
    assert logged(conn) == {f"r-{n}": 1 for n in range(1, 6)}
    assert logins_gone(conn, str(conninfo_to_dict(service)["user"]))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_transient_error_every_time_gives_up_naming_the_plan(
    flavour: str,
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    tmp_path: Path,
) -> None:
    """An item whose transaction fails with a transient error each time: retried up to the
    policy's max_attempts, then RetriesExhausted noting the plan (both flavours); the item is still
    pending, and the next run applies every item once."""
    plan_id = new_plan(operator, history, tmp_path=tmp_path)
    conflict = ConflictEveryTime()
    policy = RetryPolicy(max_attempts=2, base_delay=0.0)
    with pytest.raises(RetriesExhausted) as caught:
        if flavour == "sync":
            with psycopg.connect(service, autocommit=True, prepare_threshold=None) as runner:
                python_replay.run_plan(runner, plan_id, HANDLER, conflict.handler, retry=policy)
        else:
            asyncio.run(python_replay.run_plan_async(service, plan_id, HANDLER, conflict.ahandler, retry=policy))
    assert conflict.calls == 2
    assert caught.value.sqlstate == "40001"
    assert caught.value.__notes__ == [f"pginbox: replay plan {plan_id}"]
    assert logged(conn) == {}
    with psycopg.connect(service, autocommit=True, prepare_threshold=None) as runner:
        run = python_replay.run_plan(runner, plan_id, HANDLER, recredit)
    assert (run.status, run.applied_now, run.failed_now, run.skipped_now) == ("completed", 5, 0, 1)
    assert logged(conn) == {f"r-{n}": 1 for n in range(1, 6)}


def test_the_documented_commands(
    history: list[dict[str, Any]],
    service: str,
    conn: psycopg.Connection[Any],
    operator: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/replay.md, "Python handlers": the ```sh block run as written, by an operator login
    (inbox_operator, not a superuser) and the billing service's login. The doc's plan 1 is this
    database's plan; items.jsonl holds the messages to replay."""
    page = (REPO_ROOT / "docs" / "replay.md").read_text()
    section = page[page.index("### Python handlers") :]
    block = re.findall(r"```sh\n(.*?)```", section, re.S)[0]
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("pginbox ")]
    assert len(commands) == 4
    env = {"OPERATOR_DSN": operator, "BILLING_DSN": service}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ids: dict[str, str] = {}
    items_file(tmp_path / "items.jsonl", history)
    with contextlib.chdir(tmp_path):
        for command in commands:
            argv = [ids.get(a, a) if i == 2 else os.path.expandvars(a) for i, a in enumerate(command[1:])]
            result = CliRunner().invoke(main, argv, catch_exceptions=True)
            assert result.exit_code == 0, (argv, result.output)
            created = re.search(r"replay plan (\d+) \(", result.stdout)
            if created:
                ids["1"] = created.group(1)
    assert logged(conn) == {f"r-{n}": 1 for n in range(1, 6)}
    assert conn.execute("SELECT status FROM inbox.replay_plan WHERE plan_id = %s", (int(ids["1"]),)).fetchone() == (
        "completed",
    )
