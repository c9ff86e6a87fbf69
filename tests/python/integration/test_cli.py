"""`pginbox quarantine ...` and `pginbox status` against a real database (click's CliRunner), plus
one real subprocess run of the installed `pginbox` command.

The fixture builds a small billing consumer whose handler refuses unknown accounts, configured
with max_attempts 1, and leaves three open quarantine entries behind:
    conflict  m-1 applied with amount 5, then re-sent with amount 6
    failure   m-2 credits account 2 (missing)
    failure   m-3 credits account 3 (missing)
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import psycopg
import pytest
from click.testing import CliRunner, Result
from conftest import create_database, drop_database, dsn_for
from helpers_inbox import hand_to_service
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pginbox.cli import main
from pginbox.ops.quarantine import OperatorError

CONSUMER = "billing"

DOMAIN = """
CREATE TABLE acct (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO acct (id) VALUES (1);
CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE acct SET balance = balance + (payload->>'amount')::bigint WHERE id = (payload->>'account')::integer;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no account %', payload->>'account' USING CONSTRAINT = 'unknown_account';
    END IF;
END $$;
SELECT inbox.register_handler('billing', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
SELECT inbox.configure_consumer('billing', max_attempts => 1);
"""

APPLY = "SELECT outcome, quarantine_id FROM inbox.claim_and_apply('billing', 'shop', %s, 'credit', %s::jsonb)"


@dataclass
class Entries:
    dsn: str
    conflict: int
    missing_2: int
    missing_3: int


def _apply(conn: psycopg.Connection[Any], message_id: str, payload: dict[str, int]) -> tuple[str, int | None]:
    row = conn.execute(APPLY, (message_id, json.dumps(payload))).fetchone()
    assert row is not None
    return row[0], row[1]


@pytest.fixture
def entries(db_dsn: str, conn: psycopg.Connection[Any], login_role: Callable[..., str]) -> Entries:
    conn.execute(DOMAIN)
    # A repair runs the handler with the rights of the consumer's service (docs/security.md).
    service = conninfo_to_dict(login_role("inbox_consumer"))["user"]
    hand_to_service(conn, str(service), CONSUMER, functions=("credit(jsonb)",), tables=("acct",))
    assert _apply(conn, "m-1", {"account": 1, "amount": 5})[0] == "applied"
    outcome, conflict = _apply(conn, "m-1", {"account": 1, "amount": 6})
    assert outcome == "conflict" and conflict is not None
    outcome, missing_2 = _apply(conn, "m-2", {"account": 2, "amount": 7})
    assert outcome == "quarantined" and missing_2 is not None
    outcome, missing_3 = _apply(conn, "m-3", {"account": 3, "amount": 9})
    assert outcome == "quarantined" and missing_3 is not None
    return Entries(db_dsn, conflict, missing_2, missing_3)


def cli(*args: str, dsn: str | None = None) -> Result:
    argv = list(args) + (["--dsn", dsn] if dsn else [])
    return CliRunner().invoke(main, argv, catch_exceptions=True)


def ok_json(*args: str, dsn: str) -> Any:
    result = cli(*args, "--json", dsn=dsn)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def fails(result: Result, *fragments: str) -> str:
    """The first line of a failed command's error; asserts it names every fragment."""
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # One 'Error:' line, then what the database added (indented: DETAIL, HINT, SQLSTATE, needs).
    assert lines[0].startswith("Error: ") and all(line.startswith("  ") for line in lines[1:]), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- list


def test_list_shows_open_entries_as_a_table(entries: Entries) -> None:
    result = cli("quarantine", "list", dsn=entries.dsn)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "id",
        "consumer",
        "producer",
        "message_id",
        "kind",
        "reason_code",
        "attempts",
        "deliveries",
        "status",
        "age",
    ]
    body = [line.split() for line in lines[2:-1]]
    assert [row[0] for row in body] == [str(entries.conflict), str(entries.missing_2), str(entries.missing_3)]
    assert body[0][1:6] == [CONSUMER, "shop", "m-1", "conflict", "identity_conflict"]
    assert body[1][1:9] == [CONSUMER, "shop", "m-2", "failure", "unknown_account", "1", "1", "open"]
    assert lines[-1] == "3 open entries"


def test_list_json_filters_and_limit(entries: Entries) -> None:
    listing = ok_json("quarantine", "list", dsn=entries.dsn)
    assert listing["total"] == 3 and listing["shown"] == 3
    assert listing["filter"] == {"consumer": None, "status": "open", "limit": 50}
    first = listing["entries"][0]
    assert first["quarantine_id"] == entries.conflict
    assert first["kind"] == "conflict" and first["reason_code"] == "identity_conflict"
    assert isinstance(first["age_seconds"], float) and first["created_at"].startswith("20")
    assert "payload" not in first

    limited = ok_json("quarantine", "list", "--limit", "1", dsn=entries.dsn)
    assert limited["total"] == 3 and [e["quarantine_id"] for e in limited["entries"]] == [entries.conflict]
    text = cli("quarantine", "list", "--limit", "1", dsn=entries.dsn)
    assert text.stdout.splitlines()[-1] == "3 open entries (showing 1; --limit shows more)"

    assert ok_json("quarantine", "list", "--consumer", "nobody", dsn=entries.dsn)["entries"] == []
    assert cli("quarantine", "list", "--consumer", "nobody", dsn=entries.dsn).stdout.strip() == (
        "no open entries of consumer nobody in quarantine"
    )
    assert ok_json("quarantine", "list", "--consumer", CONSUMER, dsn=entries.dsn)["total"] == 3


def test_list_by_status(entries: Entries) -> None:
    assert cli("quarantine", "discard", str(entries.conflict), "--note", "n", dsn=entries.dsn).exit_code == 0
    assert ok_json("quarantine", "list", dsn=entries.dsn)["total"] == 2
    discarded = ok_json("quarantine", "list", "--status", "discarded", dsn=entries.dsn)
    assert [e["quarantine_id"] for e in discarded["entries"]] == [entries.conflict]
    assert discarded["entries"][0]["decided_by"]
    every = ok_json("quarantine", "list", "--status", "all", dsn=entries.dsn)
    assert every["filter"]["status"] == "all" and every["total"] == 3

    bad = cli("quarantine", "list", "--status", "closed", dsn=entries.dsn)
    assert bad.exit_code == 2 and "'closed' is not one of" in bad.stderr


# --------------------------------------------------------------------------- show


def test_show_every_field_without_payload(entries: Entries) -> None:
    result = cli("quarantine", "show", str(entries.missing_2), dsn=entries.dsn)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith(f"quarantine entry {entries.missing_2} (open, failure)")
    for field in (
        "consumer",
        "tenant",
        "producer",
        "message_id",
        "message_type",
        "reason_code",
        "error_message",
        "attempts",
        "crashes",
        "deliveries",
        "handler_version",
        "payload_sha256",
        "created_at",
        "decided_by",
    ):
        assert f"\n  {field} " in out, field
    assert "no account 2" in out and "unknown_account" in out
    assert "audit trail (inbox.quarantine_decision):\n  no decisions yet" in out
    assert "attempt record (inbox.attempt):\n  started 0 (announced redeliveries), failed 1" in out
    assert "inbox row (inbox.message):\n  status quarantined" in out
    assert "payload: not shown" in out
    assert '"amount"' not in out and "7" not in out.split("payload:")[-1]


def test_show_json_and_payload_on_request(entries: Entries) -> None:
    details = ok_json("quarantine", "show", str(entries.missing_2), dsn=entries.dsn)
    assert set(details) == {"entry", "decisions", "attempt", "message"}
    assert details["entry"]["message_id"] == "m-2" and details["entry"]["status"] == "open"
    assert details["entry"]["payload_sha256"] and len(details["entry"]["payload_sha256"]) == 64
    assert details["attempt"]["failed"] == 1 and details["attempt"]["reason_code"] == "unknown_account"
    assert details["message"]["status"] == "quarantined"
    assert details["decisions"] == []

    with_payload = ok_json("quarantine", "show", str(entries.missing_2), "--show-payload", dsn=entries.dsn)
    assert with_payload["payload"] == {"account": 2, "amount": 7}
    text = cli("quarantine", "show", str(entries.missing_2), "--show-payload", dsn=entries.dsn)
    assert '"amount": 7' in text.stdout

    conflict = ok_json("quarantine", "show", str(entries.conflict), "--show-payload", dsn=entries.dsn)
    assert conflict["entry"]["kind"] == "conflict"
    assert conflict["entry"]["stored_sha256"] != conflict["entry"]["payload_sha256"]
    assert conflict["payload"] == {"account": 1, "amount": 6}  # the conflicting delivery's payload
    assert conflict["message"]["status"] == "processed"


def test_show_unknown_id(entries: Entries) -> None:
    fails(cli("quarantine", "show", "424242", dsn=entries.dsn), "entry 424242 does not exist")
    fails(cli("quarantine", "show", "424242", "--json", dsn=entries.dsn), "entry 424242 does not exist")


# --------------------------------------------------------------------------- decisions


def test_discard_then_closed_entry_is_refused(entries: Entries, conn: psycopg.Connection[Any]) -> None:
    result = cli("quarantine", "discard", str(entries.conflict), "--note", "producer bug #12", dsn=entries.dsn)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"entry {entries.conflict}: discarded (nothing was applied; redeliveries of its message are duplicates now)"
    )
    line = fails(
        cli("quarantine", "discard", str(entries.conflict), "--note", "again", dsn=entries.dsn),
        f"entry {entries.conflict} is already discarded",
        "SQLSTATE 55000 object_not_in_prerequisite_state",
    )
    assert "inbox.discard" not in line
    fails(
        cli("quarantine", "repair", str(entries.conflict), "--note", "again", "--json", dsn=entries.dsn),
        f"entry {entries.conflict} is already discarded",
    )
    details = ok_json("quarantine", "show", str(entries.conflict), dsn=entries.dsn)
    assert [(d["decision"], d["result"], d["note"]) for d in details["decisions"]] == [
        ("discard", "discarded", "producer bug #12")
    ]
    assert details["entry"]["status"] == "discarded" and details["entry"]["decided_by"]
    text = cli("quarantine", "show", str(entries.conflict), dsn=entries.dsn).stdout
    assert "discard -> discarded  note: producer bug #12" in text
    # The first payload stays applied; the redelivered conflicting one still changes nothing.
    assert _apply(conn, "m-1", {"account": 1, "amount": 6})[0] == "conflict"
    row = conn.execute("SELECT balance FROM acct WHERE id = 1").fetchone()
    assert row is not None and row[0] == 5


@pytest.mark.parametrize("action", ["release", "repair"])
def test_conflict_can_only_be_discarded(entries: Entries, action: str) -> None:
    fails(
        cli("quarantine", action, str(entries.conflict), "--note", "please", dsn=entries.dsn),
        "a conflict entry can only be discarded",
        f"entry {entries.conflict}",
        "SQLSTATE 55000",
    )
    assert ok_json("quarantine", "show", str(entries.conflict), dsn=entries.dsn)["entry"]["status"] == "open"


def test_repair_fails_then_succeeds(entries: Entries, conn: psycopg.Connection[Any]) -> None:
    failed = cli("quarantine", "repair", str(entries.missing_2), "--note", "retry", "--json", dsn=entries.dsn)
    assert failed.exit_code == 1, failed.output
    decision = json.loads(failed.stdout)
    assert decision["ok"] is False and decision["result"] == "repair_failed"
    assert decision["entry_status"] == "open" and decision["reason_code"] == "unknown_account"
    text = cli("quarantine", "repair", str(entries.missing_2), "--note", "retry", dsn=entries.dsn)
    assert text.exit_code == 1
    assert "repair failed, the entry stays open (reason unknown_account: no account 2)" in text.stdout

    conn.execute("INSERT INTO acct (id) VALUES (2)")
    repaired = cli("quarantine", "repair", str(entries.missing_2), "--note", "account 2 exists now", dsn=entries.dsn)
    assert repaired.exit_code == 0, repaired.output
    assert repaired.stdout.startswith(f"entry {entries.missing_2}: recovered (the stored payload was applied")
    row = conn.execute("SELECT balance FROM acct WHERE id = 2").fetchone()
    assert row is not None and row[0] == 7
    assert _apply(conn, "m-2", {"account": 2, "amount": 7})[0] == "duplicate"

    details = ok_json("quarantine", "show", str(entries.missing_2), dsn=entries.dsn)
    assert [(d["decision"], d["result"]) for d in details["decisions"]] == [
        ("repair", "repair_failed"),
        ("repair", "repair_failed"),
        ("repair", "recovered"),
    ]
    assert details["decisions"][0]["reason_code"] == "unknown_account"
    assert details["entry"]["status"] == "recovered" and details["message"]["status"] == "processed"


def test_release_lets_the_next_delivery_through(entries: Entries, conn: psycopg.Connection[Any]) -> None:
    decision = ok_json("quarantine", "release", str(entries.missing_3), "--note", "account 3 is back", dsn=entries.dsn)
    assert decision == decision | {"ok": True, "result": "released", "entry_status": "released", "kind": "failure"}
    details = ok_json("quarantine", "show", str(entries.missing_3), dsn=entries.dsn)
    assert details["message"] is None and details["attempt"]["failed"] == 0
    conn.execute("INSERT INTO acct (id) VALUES (3)")
    assert _apply(conn, "m-3", {"account": 3, "amount": 9})[0] == "applied"
    fails(
        cli("quarantine", "release", str(entries.missing_3), "--note", "x", dsn=entries.dsn),
        f"entry {entries.missing_3} is already released",
    )


def test_decision_input_errors(entries: Entries) -> None:
    fails(
        cli("quarantine", "discard", "424242", "--note", "n", dsn=entries.dsn),
        "entry 424242 does not exist",
        "SQLSTATE P0002 no_data_found",
    )
    fails(
        cli("quarantine", "release", str(entries.missing_3), "--note", "   ", dsn=entries.dsn),
        "a decision needs a note saying why",
        "SQLSTATE 22023",
    )
    missing_note = cli("quarantine", "discard", str(entries.missing_3), dsn=entries.dsn)
    assert missing_note.exit_code == 2 and "--note" in missing_note.stderr
    not_a_number = cli("quarantine", "show", "seven", dsn=entries.dsn)
    assert not_a_number.exit_code == 2


def test_verbose_shows_the_details(entries: Entries) -> None:
    result = CliRunner().invoke(
        main, ["--verbose", "quarantine", "discard", "424242", "--note", "n", "--dsn", entries.dsn]
    )
    assert result.exit_code == 1
    assert isinstance(result.exception, OperatorError)
    assert isinstance(result.exception.__cause__, psycopg.errors.NoDataFound)


def test_reader_may_look_but_not_read_payloads_or_decide(entries: Entries, pg_base: str) -> None:
    role = f"t_reader_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(entries.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE inbox_reader").format(sql.Identifier(role)))
    try:
        params = {k: v for k, v in conninfo_to_dict(entries.dsn).items() if v is not None}
        params["user"] = role
        reader = make_conninfo("", **params)
        assert ok_json("quarantine", "list", dsn=reader)["total"] == 3
        assert ok_json("quarantine", "show", str(entries.missing_2), dsn=reader)["entry"]["message_id"] == "m-2"
        fails(
            cli("quarantine", "show", str(entries.missing_2), "--show-payload", dsn=reader),
            "permission denied to read payloads",
            "SQLSTATE 42501 insufficient_privilege",
        )
        fails(
            cli("quarantine", "discard", str(entries.missing_2), "--note", "n", dsn=reader),
            f"permission denied to discard entry {entries.missing_2}",
            "inbox_operator",
        )
        assert ok_json("status", dsn=reader)["open_entries"] == 3
    finally:
        with psycopg.connect(entries.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_password_is_never_printed(entries: Entries) -> None:
    params = {k: v for k, v in conninfo_to_dict(entries.dsn).items() if v is not None}
    params.update(port="1", password="s3cr3t-pw", connect_timeout="2")
    bad = make_conninfo("", **params)
    for args in (("quarantine", "list"), ("quarantine", "discard", "1", "--note", "n"), ("status", "--json")):
        result = cli(*args, dsn=bad)
        assert result.exit_code == 1, result.output
        assert "s3cr3t-pw" not in result.output
        assert "Traceback" not in result.output


# --------------------------------------------------------------------------- status


def test_status_counts(entries: Entries) -> None:
    result = cli("status", dsn=entries.dsn)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "schema inbox: release 0.3.0 (version 3)" in out
    assert "inbox.message by status:\n  processed    1\n  quarantined  2\n  discarded    0" in out
    assert "  open         3  (conflict 1, failure 2, expired 0)" in out
    assert "open quarantine entries: 3" in out and CONSUMER in out

    status = ok_json("status", dsn=entries.dsn)
    assert status["deployed"] is True and status["schema_version"] == 3 and status["release"] == "0.3.0"
    assert status["messages"] == {"processed": 1, "quarantined": 2, "discarded": 0}
    assert status["quarantine"]["open"] == {"conflict": 1, "failure": 2, "expired": 0}
    assert status["quarantine"]["discarded"] == {"conflict": 0, "failure": 0, "expired": 0}
    assert status["open_entries"] == 3
    assert [(c["consumer"], c["open"], c["conflicts"], c["failures"]) for c in status["open_by_consumer"]] == [
        (CONSUMER, 3, 1, 2)
    ]
    changes = [c["change"] for c in status["sqitch"]["deployed_changes"]]
    assert changes[-1] == "roles" and "quarantine" in changes
    assert status["sqitch"]["up_to_date"] is True and status["sqitch"]["problem"] is None


@pytest.fixture
def empty_dsn(pg_base: str) -> Iterator[str]:
    name = f"t_empty_{uuid.uuid4().hex}"
    create_database(pg_base, name)
    try:
        yield dsn_for(pg_base, name)
    finally:
        drop_database(pg_base, name)


def test_status_and_quarantine_without_schema(empty_dsn: str) -> None:
    result = cli("status", "--json", dsn=empty_dsn)
    assert result.exit_code == 3, result.output
    status = json.loads(result.stdout)
    assert status["deployed"] is False and status["messages"] == {}
    assert status["sqitch"]["problem"]
    text = cli("status", dsn=empty_dsn)
    # Not deployed: exit 3, so that a health check or cron job notices.
    assert text.exit_code == 3 and "schema inbox: not deployed (run `pginbox deploy`)" in text.stdout
    fails(cli("quarantine", "list", dsn=empty_dsn), "schema inbox is not deployed", "pginbox deploy")


# --------------------------------------------------------------------------- the real command


def pginbox_command() -> list[str]:
    script = Path(sys.executable).parent / "pginbox"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pginbox"]


def test_subprocess_quarantine_list(entries: Entries) -> None:
    result = subprocess.run(
        [*pginbox_command(), "quarantine", "list", "--dsn", entries.dsn],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("id  consumer")
    assert result.stdout.splitlines()[-1] == "3 open entries"
    error = subprocess.run(
        [*pginbox_command(), "quarantine", "show", "424242", "--dsn", entries.dsn],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert error.returncode == 1
    assert error.stderr.strip().startswith("Error: entry 424242 does not exist")
    assert "Traceback" not in error.stderr


# --------------------------------------------------------------------------- environment variables


def test_options_are_read_from_the_environment(entries: Entries) -> None:
    def invoke(*args: str, env: dict[str, str]) -> Result:
        return CliRunner().invoke(main, list(args), env=env, catch_exceptions=True)

    # PGINBOX_DSN stands for --dsn; PGINBOX_<COMMAND>_<OPTION> for the command's options.
    result = invoke(
        "quarantine", "list", "--json", env={"PGINBOX_DSN": entries.dsn, "PGINBOX_QUARANTINE_LIST_CONSUMER": "nobody"}
    )
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    assert listing["filter"]["consumer"] == "nobody" and listing["entries"] == []
    # The command line wins over the environment.
    result = invoke(
        "quarantine",
        "list",
        "--json",
        "--consumer",
        CONSUMER,
        env={"PGINBOX_DSN": entries.dsn, "PGINBOX_QUARANTINE_LIST_CONSUMER": "nobody"},
    )
    assert json.loads(result.stdout)["total"] == 3
    flag = invoke("status", env={"PGINBOX_DSN": entries.dsn, "PGINBOX_STATUS_JSON": "1"})
    assert flag.exit_code == 0 and json.loads(flag.stdout)["open_entries"] == 3


def test_every_option_names_its_environment_variable() -> None:
    def options(command: click.Command, path: str) -> Iterator[tuple[str, click.Option]]:
        for param in command.params:
            if isinstance(param, click.Option) and param.expose_value and not param.is_eager:
                yield path, param
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from options(sub, f"{path} {name}")

    seen = list(options(main, "pginbox"))
    assert len(seen) > 60
    for path, option in seen:
        if "--dsn" in option.opts and path != "pginbox":
            assert option.envvar is None, path  # one variable for --dsn: the global option's
            continue
        envvars = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar or [])
        assert envvars and envvars[0].startswith("PGINBOX_") and option.show_envvar, (path, option.opts)
    names = {(path, o.opts[0]): o.envvar for path, o in seen}
    assert names[("pginbox dispatch", "--health-port")] == "PGINBOX_DISPATCH_HEALTH_PORT"
    assert names[("pginbox cluster", "--datadir")] == "PGINBOX_CLUSTER_DIR"
    assert names[("pginbox", "--dsn")] == ["PGINBOX_DSN", "DATABASE_URL"]
