"""How every CLI error is printed: one handler (DsnGroup.invoke in context.py) for every command.

    Error: <what failed, in pginbox's words where it knows better, else the database's message>
      database: <the server's primary message, when the line above is pginbox's>
      DETAIL: <the server's DETAIL>
      HINT: <the server's HINT>
      SQLSTATE: 42501 insufficient_privilege
      needs: the inbox_reader group role: GRANT inbox_reader TO svc;   (42501, a missing grant)

Nothing the database said is dropped: pginbox's own sentence comes first, the server's message,
DETAIL, HINT and SQLSTATE follow (each once: a line that repeats the first is left out). A role
that lacks a grant is told which of the package's group roles has it, read from the database's own
grants (so it stays true when grants change), falling back to what the command is documented to need.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

import psycopg
from psycopg import sql

from pginbox.errors import SQLSTATE_NAMES, PginboxError, SqitchError, database_error

__all__ = ["COMMAND_ROLES", "GROUP_ROLES", "database_error", "describe", "role_needed"]

#: The package's group roles a login role is granted (docs/security.md), least powerful first.
GROUP_ROLES: Final = ("inbox_reader", "inbox_dispatcher", "inbox_consumer", "inbox_operator")

_READ: Final = "inbox_reader (or inbox_operator)"
#: What each command is documented to need (docs/security.md, "The roles"); used when the
#: database's message names no object whose grants can be read.
COMMAND_ROLES: Final[Mapping[str, str]] = {
    "status": _READ,
    "doctor": _READ,
    "stats": _READ,
    "metrics serve": _READ,
    "metrics rollup": "inbox_operator",
    "metrics configure": "inbox_operator",
    "quarantine list": _READ,
    "quarantine show": "inbox_reader (without payloads; inbox_operator with them)",
    "quarantine repair": "inbox_operator",
    "quarantine discard": "inbox_operator",
    "quarantine release": "inbox_operator",
    "outbox list": _READ,
    "outbox show": _READ,
    "outbox redrive": "inbox_operator",
    "outbox discard": "inbox_operator",
    "outbox provision": _READ,
    "replay status": _READ,
    "replay create": "inbox_operator",
    "replay add": "inbox_operator",
    "replay run": "inbox_operator",
    "replay accept-version": "inbox_operator",
    "replay cancel": "inbox_operator",
    "retention show": _READ,
    "retention set": "inbox_operator",
    "purge": "inbox_operator",
    "dispatch": "inbox_dispatcher",
    "consume": "inbox_consumer",
}

_DENIED: Final = re.compile(
    r"permission denied for (function|procedure|table|view|relation|sequence|schema) ([\w.\"]+)", re.IGNORECASE
)


def _lookup_roles(dsn: str, kind: str, name: str) -> tuple[list[str], str | None]:
    """The group roles holding the privilege the message says is missing, and the login role."""
    schema, _, obj = name.replace('"', "").rpartition(".")
    schema = schema or "inbox"
    with psycopg.connect(dsn, autocommit=True, application_name="pginbox-cli", connect_timeout=5) as conn:
        user = conn.execute("SELECT session_user::text").fetchone()
        roles = [
            r[0]
            for r in conn.execute(
                "SELECT rolname::text FROM pg_roles WHERE rolname = ANY(%s)", (list(GROUP_ROLES),)
            ).fetchall()
        ]
        if kind == "schema":
            check = sql.SQL("has_schema_privilege(%(role)s, %(obj)s, 'USAGE')")
            target = obj or schema
        elif kind in ("function", "procedure"):
            check = sql.SQL(
                "EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = %(schema)s AND p.proname = %(obj)s "
                "AND has_function_privilege(%(role)s, p.oid, 'EXECUTE'))"
            )
            target = obj
        else:
            check = sql.SQL(
                "EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %(schema)s AND c.relname = %(obj)s "
                "AND has_any_column_privilege(%(role)s, c.oid, 'SELECT'))"
            )
            target = obj
        holding = []
        for role in sorted(roles, key=GROUP_ROLES.index):
            row = conn.execute(sql.SQL("SELECT ") + check, {"role": role, "obj": target, "schema": schema}).fetchone()
            if row is not None and row[0]:
                holding.append(role)
    return holding, (user[0] if user else None)


def role_needed(exc: psycopg.Error, dsn: str | None, command: str | None) -> str | None:
    """'the inbox_reader group role: GRANT inbox_reader TO svc;' for a 42501 that is a missing
    grant; None when it is a refusal the database explains itself (a binding, a handler's rights)."""
    if exc.sqlstate != "42501":
        return None
    primary = (exc.diag.message_primary or "") if exc.diag else ""
    match = _DENIED.search(primary)
    if match is None:
        return None  # the package's own 42501: its message, DETAIL and HINT say what to do
    holding: list[str] = []
    user: str | None = None
    if dsn:
        try:
            holding, user = _lookup_roles(dsn, match.group(1).lower(), match.group(2))
        except psycopg.Error:
            holding = []
    grantee = user or "<login role>"
    documented = COMMAND_ROLES.get(command or "")
    if holding:
        # The least powerful role holding the grant, unless the command needs a stronger one for
        # what it does next (purge reads policies as a reader could, then purges as an operator).
        wanted = documented.split()[0] if documented else None
        first = wanted if wanted in holding else holding[0]
        rest = [r for r in holding if r != first]
        others = f" (also held by {', '.join(rest)})" if rest else ""
        return f"the {first} group role{others}: an administrator runs GRANT {first} TO {grantee};"
    if documented:
        return f"`pginbox {command}` needs {documented}: an administrator grants it to {grantee}"
    return None


def _clean(text: str) -> str:
    return " ".join(text.split())


def describe(exc: BaseException, *, dsn: str | None = None, command: str | None = None) -> str:
    """The text of the error for `exc` (without click's 'Error: '): its first line, then what
    the database said that the first line does not already say."""
    first = _first_line(exc)
    if len(first) > 1000:
        first = first[:997] + "..."
    db = database_error(exc)
    if db is None or db.diag is None:
        return first
    return "\n".join([first, *_database_lines(db, first, dsn, command)])


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, psycopg.Error):
        first = _clean(exc.diag.message_primary or "") if exc.diag else ""
        if not first:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            first = lines[0] if lines else type(exc).__name__
        if exc.sqlstate:
            name = SQLSTATE_NAMES.get(exc.sqlstate, "")
            first = f"{first} [SQLSTATE {exc.sqlstate}{' ' + name if name else ''}]"
        return first
    if isinstance(exc, PginboxError):
        first = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        return first.split("\n", 1)[0] if isinstance(exc, SqitchError) else first
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _database_lines(db: psycopg.Error, first: str, dsn: str | None, command: str | None) -> list[str]:
    """What the database said (message, DETAIL, HINT, SQLSTATE) that `first` does not say, and the
    group role the command needs when that is what is missing."""
    out = []
    diag = db.diag
    primary = _clean(diag.message_primary or "")
    bare = primary.split(": ", 1)[1] if primary.startswith("inbox.") and ": " in primary else primary
    if primary and bare.rstrip(".") not in first:
        out.append(f"  database: {primary}")
    for label, value in (("DETAIL", diag.message_detail), ("HINT", diag.message_hint)):
        text = _clean(value or "")
        if text and text.rstrip(".") not in first:
            out.append(f"  {label}: {text}")
    if db.sqlstate and f"SQLSTATE {db.sqlstate}" not in first:
        name = SQLSTATE_NAMES.get(db.sqlstate, "")
        out.append(f"  SQLSTATE: {db.sqlstate}{' ' + name if name else ''}")
    needs = role_needed(db, dsn, command)
    if needs:
        out.append(f"  needs: {needs}")
    return out
