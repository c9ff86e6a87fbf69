"""docs/sql-api.md §8 names the internal functions granted to the group roles and the internal
SECURITY DEFINER functions: the lists must be the database's, so that a change of grants (0.3.0
took repair's and the replay runner's halves from operators) cannot leave the page behind."""

from __future__ import annotations

import re
from typing import Any

import psycopg
from conftest import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "sql-api.md"


def names(text: str) -> set[str]:
    return set(re.findall(r"`(_[a-z_]+)`", text))


def granted_lists() -> tuple[set[str], set[str]]:
    page = PAGE.read_text()
    start = page.index("Internal functions (names starting with `_`) are not part of the API")
    end = page.index("(Checked against the database by `test_doc_sql_security.py`.)", start)
    consumer, operator = re.split(r"to `inbox_consumer`;", page[start:end])
    return names(consumer), names(operator.split("to\n`inbox_operator`")[0])


def definer_list() -> set[str]:
    page = PAGE.read_text()
    start = page.index("- SECURITY DEFINER functions")
    return names(page[page.index("and internally", start) : page.index("run as `inbox_owner`", start)])


def internal(conn: psycopg.Connection[Any], where: str, *params: str) -> set[str]:
    rows = conn.execute(
        "SELECT DISTINCT p.proname FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace"
        f" WHERE n.nspname = 'inbox' AND p.proname LIKE '\\_%%' AND {where}",
        params,
    ).fetchall()
    return {str(r[0]) for r in rows}


def test_the_internal_functions_granted_are_the_pages(conn: psycopg.Connection[Any]) -> None:
    consumer, operator = granted_lists()
    execute = "pg_catalog.has_function_privilege(%s, p.oid, 'EXECUTE')"
    assert consumer == internal(conn, execute, "inbox_consumer")
    assert operator == internal(conn, execute, "inbox_operator")


def test_the_internal_definer_functions_are_the_pages(conn: psycopg.Connection[Any]) -> None:
    assert definer_list() == internal(conn, "p.prosecdef")
