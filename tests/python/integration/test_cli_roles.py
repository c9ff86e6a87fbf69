"""Every operator command run as each documented role (docs/security.md: operator, reader,
dispatcher, service): it works, or it fails with an actionable message — what the database said,
and for a missing grant the group role that holds it, named from the database's own grants."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg.conninfo import conninfo_to_dict

from pginbox.cli import main

ROLES = ("inbox_operator", "inbox_reader", "inbox_dispatcher", "inbox_consumer")

DOMAIN = """
CREATE TABLE acct (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'no account %', payload->>'account' USING CONSTRAINT = 'unknown_account';
END $$;
SELECT inbox.register_handler('billing', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
SELECT inbox.configure_consumer('billing', max_attempts => 1);
"""

#: broker_retention .. safety_margin of inbox.set_retention_policy
RETENTION = ("'14 days'", "'0'", "'0'", "'0'", "'0'", "'0'", "'0'", "'1 day'")
SCENARIOS = (
    "--broker-retention",
    "--max-offset-rewind",
    "--dead-letter-redrive-horizon",
    "--producer-retry-horizon",
    "--outage-allowance",
    "--backup-restore-window",
    "--planned-replay-horizon",
    "--safety-margin",
)

#: command -> the group roles that may run it (the others must be told which role they need).
COMMANDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("stats",): ("inbox_operator", "inbox_reader"),
    ("quarantine", "list"): ("inbox_operator", "inbox_reader"),
    ("outbox", "list"): ("inbox_operator", "inbox_reader"),
    ("retention", "show"): ("inbox_operator", "inbox_reader"),
    ("replay", "status"): ("inbox_operator", "inbox_reader"),
    ("metrics", "rollup"): ("inbox_operator",),
    ("purge", "--consumer", "billing"): ("inbox_operator",),
    ("quarantine", "discard", "QID", "--note", "roles test"): ("inbox_operator",),
    ("outbox", "redrive", "--destination", "nowhere", "--note", "roles test"): ("inbox_operator",),
    ("doctor",): ("inbox_operator", "inbox_reader"),
    ("quarantine", "show", "QID"): ("inbox_operator", "inbox_reader"),
    ("quarantine", "release", "QID", "--note", "roles test"): ("inbox_operator",),
    ("metrics", "configure", "--grace", "5min"): ("inbox_operator",),
    ("dispatch", "--once", "--callable", "sink=json:dumps"): ("inbox_dispatcher",),
}


def cli(*args: str, dsn: str) -> Result:
    return CliRunner().invoke(main, [*args, "--dsn", dsn], catch_exceptions=True)


@pytest.fixture
def deployment(conn: psycopg.Connection[Any], login_role: Callable[..., str]) -> dict[str, Any]:
    """One login role per documented group role; the consumer bound to the service; one open
    quarantine entry; a retention policy (so purge has work to refuse)."""
    conn.execute(DOMAIN)
    dsns = {role: login_role(role) for role in ROLES}
    service = str(conninfo_to_dict(dsns["inbox_consumer"])["user"])
    conn.execute("SELECT inbox.bind_consumer('billing', %s::regrole, note => 'service')", (service,))
    row = conn.execute(
        "SELECT quarantine_id FROM inbox.claim_and_apply('billing', 'shop', 'm-1', 'credit', '{\"account\": 2}')"
    ).fetchone()
    assert row is not None and row[0] is not None
    conn.execute(f"SELECT inbox.set_retention_policy('billing', '', {', '.join(RETENTION)}, note => 'roles test')")
    return {"dsns": dsns, "quarantine_id": row[0]}


@pytest.mark.parametrize("command", list(COMMANDS), ids=lambda c: " ".join(c[:2]))
def test_each_command_as_each_role_works_or_says_which_role(
    command: tuple[str, ...], deployment: dict[str, Any]
) -> None:
    argv = [str(deployment["quarantine_id"]) if a == "QID" else a for a in command]
    allowed = COMMANDS[command]
    for role, dsn in deployment["dsns"].items():
        user = str(conninfo_to_dict(dsn)["user"])
        result = cli(*argv, dsn=dsn)
        assert "Traceback" not in result.output, (role, result.output)
        if role in allowed:
            assert result.exit_code in (0, 1) if command == ("doctor",) else result.exit_code == 0, (
                role,
                argv,
                result.output,
            )
            continue
        assert result.exit_code == 1, (role, argv, result.output)
        lines = result.stderr.splitlines()
        # the dispatcher logs before it gives up: the error is its last lines
        lines = lines[next(i for i, line in enumerate(lines) if line.startswith("Error: ")) :]
        assert "42501" in result.stderr, result.stderr
        needs = [line for line in lines if line.startswith("  needs: ")]
        assert len(needs) == 1, (role, argv, result.stderr)
        wanted = allowed[0] if allowed != ("inbox_operator", "inbox_reader") else "inbox_reader"
        assert f"GRANT {wanted} TO {user};" in needs[0], (role, argv, needs[0])


def test_status_as_each_role_never_prints_a_sqitch_caret(deployment: dict[str, Any]) -> None:
    for role, dsn in deployment["dsns"].items():
        result = cli("status", dsn=dsn)
        assert result.exit_code == 0, (role, result.output)
        first = result.stdout.splitlines()[0]
        assert first.startswith("sqitch: registry not readable by role "), (role, first)
        assert "^" not in result.stdout
        if role in ("inbox_operator", "inbox_reader"):
            assert "inbox.message by status:" in result.stdout
        else:
            assert "connect as a member of inbox_reader or inbox_operator" in result.stdout, result.stdout
        as_json = json.loads(cli("status", "--json", dsn=dsn).stdout)
        assert as_json["sqitch"]["problem"].startswith("registry not readable by role")


def test_status_as_the_deployer_still_shows_sqitch(db_dsn: str) -> None:
    result = cli("status", dsn=db_dsn)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("# On database "), result.stdout[:200]


def test_repair_refusal_shows_the_databases_detail_and_hint(deployment: dict[str, Any]) -> None:
    """The handler is SECURITY INVOKER: the database refuses the repair with a DETAIL saying so and
    a HINT giving the ALTER FUNCTION; the CLI used to print 'decisions need the inbox_operator role'."""
    result = cli(
        "quarantine",
        "repair",
        str(deployment["quarantine_id"]),
        "--note",
        "try",
        dsn=deployment["dsns"]["inbox_operator"],
    )
    assert result.exit_code == 1, result.output
    err = result.stderr
    assert "would run with more rights than consumer 'billing' has" in err, err
    assert "decisions need the inbox_operator role" not in err
    assert "DETAIL: It is SECURITY INVOKER" in err or "(It is SECURITY INVOKER" in err, err
    assert "ALTER FUNCTION public.credit(jsonb) SECURITY DEFINER" in err, err
    assert "  database: " not in err, "the first line says it already"
    assert "SQLSTATE 42501" in err
    assert "needs:" not in err, "the role holds every grant: no group role to suggest"


def test_an_error_from_the_server_keeps_detail_hint_and_sqlstate(db_dsn: str) -> None:
    """A refusal pginbox has no sentence of its own for reaches the user whole."""
    values = ["-1 day", *(["0"] * (len(SCENARIOS) - 1))]
    options = [x for pair in zip(SCENARIOS, values, strict=True) for x in pair]
    result = cli("retention", "set", "nobody", *options, "--note", "bad", dsn=db_dsn)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert "broker_retention must not be negative" in lines[0], lines
    assert "SQLSTATE 22023 invalid_parameter_value" in lines[0], lines
    assert "  HINT: Pass '0' when the scenario does not apply." in lines, lines


def test_a_handler_that_is_not_a_function_signature_is_named(db_dsn: str) -> None:
    """PostgreSQL says 'expected a left parenthesis'; the CLI says which option and its form."""
    result = cli(
        "replay",
        "create",
        "p1",
        "--consumer",
        "billing",
        "--message-type",
        "credit",
        "--handler",
        "credit",
        "--handler-version",
        "v2",
        "--note",
        "x",
        dsn=db_dsn,
    )
    assert result.exit_code == 1, result.output
    first = result.stderr.splitlines()[0]
    assert "--handler must name an existing function with its argument types, e.g. 'billing.credit(jsonb)'" in first
    assert "(expected a left parenthesis) [SQLSTATE 22P02 invalid_text_representation]" in first
