"""The one SQLSTATE table (pginbox.sqlstates) against the SQL: every SQLSTATE that sql/*.sql raises
has an entry, and the clients' classifications come from it (no database needed)."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
from psycopg import errors as pg_errors

from pginbox.brokers.wire import Action, action_for
from pginbox.client.retry import TransientKind, classify
from pginbox.errors import SQLSTATE_NAMES
from pginbox.sqlstates import SQLSTATES, condition

ROOT = Path(__file__).resolve().parents[3]
# ERRCODE = 'name' or '12345', and the branches of ERRCODE = CASE ... END
_ERRCODE = re.compile(r"ERRCODE\s*=\s*(CASE\b.*?\bEND|'[^']*')", re.IGNORECASE | re.DOTALL)
_QUOTED = re.compile(r"'([A-Za-z0-9_]+)'")
_CODE = re.compile(r"^[0-9A-Z]{5}$")


def raised_in_sql() -> dict[str, set[str]]:
    """SQLSTATE codes or condition names raised in sql/*.sql -> the files raising them."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "sql").glob("*.sql")):
        for match in _ERRCODE.finditer(path.read_text()):
            text = match.group(1)
            if text.upper().startswith("CASE"):
                # only the values a branch yields (THEN / ELSE 'x'), not the conditions tested
                values = re.findall(r"(?:THEN|ELSE)\s+'([A-Za-z0-9_]+)'", text, re.IGNORECASE)
            else:
                values = _QUOTED.findall(text)
            for value in values:
                found.setdefault(value, set()).add(path.name)
    return found


def code_of(value: str) -> str:
    """The SQLSTATE of a code or condition name as PL/pgSQL reads it (the first code of that name
    in PostgreSQL's errcodes: null_value_not_allowed is 22004, not 39004)."""
    if _CODE.match(value):
        return value
    named = [code for code, c in SQLSTATES.items() if len(code) == 5 and c.name == value]
    assert named, f"condition {value!r} (raised in sql/) has no entry in pginbox.sqlstates.SQLSTATES"
    pg_errors.lookup(value)  # a name PostgreSQL knows
    return min(named)


def test_the_sql_raises_sqlstates() -> None:
    raised = raised_in_sql()
    assert {"invalid_parameter_value", "null_value_not_allowed", "insufficient_privilege", "IR001"} <= set(raised)


def test_every_sqlstate_the_sql_raises_is_in_the_table() -> None:
    missing = {}
    for value, files in raised_in_sql().items():
        code = code_of(value)
        if code not in SQLSTATES:
            missing[value] = sorted(files)
    assert not missing, f"add these to pginbox.sqlstates.SQLSTATES: {missing}"


def test_every_named_entry_is_a_postgresql_condition_or_the_packages_own() -> None:
    for code, entry in SQLSTATES.items():
        if len(code) == 2 or code.startswith("I"):
            continue  # a class, or pginbox's own (class IR)
        assert pg_errors.lookup(code).sqlstate == code, code
        assert pg_errors.lookup(entry.name) is not None, entry.name


def test_the_clients_classify_by_the_table() -> None:
    for code, entry in SQLSTATES.items():
        if len(code) != 5:
            continue
        error = _error(code)
        assert classify(error) is entry.transient, code
        expected = Action.RETRY if entry.transient else Action.DEAD_LETTER if entry.bad_input else Action.HALT
        assert action_for(error) is expected, code
        assert SQLSTATE_NAMES[code] == entry.name


def test_classes_and_unknown_codes() -> None:
    assert condition("08006").transient is TransientKind.CONNECTION
    assert condition("57P01").transient is TransientKind.CONNECTION
    assert condition("57014").transient is TransientKind.TIMEOUT
    assert condition("22P05").bad_input and condition("54023").bad_input
    unknown = condition("XX000")
    assert unknown.transient is None and not unknown.bad_input
    assert action_for(_error("42P01")) is Action.HALT


def _error(code: str) -> psycopg.Error:
    try:
        cls = pg_errors.lookup(code)
    except KeyError:
        cls = pg_errors.Error
    error = cls("x")
    if error.sqlstate != code:  # pginbox's own codes: psycopg knows no class for them
        error = _with_sqlstate(code)
    return error


def _with_sqlstate(code: str) -> psycopg.Error:
    class Raised(psycopg.Error):
        sqlstate = code

    return Raised("x")
