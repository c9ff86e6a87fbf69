"""Every signature block of the docs is a function the schema deploys: a ```sql block that starts
with `inbox.<function>(`, on any page (docs/outbox.md's outbox API; docs/sql-api.md's, which
test_doc_sql.py also checks), compared with pg_get_function_arguments and pg_get_function_result
of the deployed function (the normalization of test_doc_sql.py; an interval default as the doc
writes it, '30 seconds', is compared as PostgreSQL prints it, '00:00:30')."""

from __future__ import annotations

import re
from typing import Any

import psycopg
from helpers_docs import blocks, pages
from test_doc_sql import Block, _normalize, kind


def signatures() -> list[tuple[Block, str, str, str | None]]:
    found = []
    for page in pages():
        for example in blocks(page):
            block = Block(example.page, example.line, example.text)
            if example.lang != "sql" or kind(block) != "signature":
                continue
            for decl in re.split(r"\n(?=inbox\.)", block.text.strip()):
                match = re.fullmatch(r"inbox\.(\w+)\((.*?)\)(?:\s+RETURNS\s+(.*))?", decl.strip(), re.S)
                assert match, f"{block.where}: not a signature: {decl}"
                found.append((block, match.group(1), match.group(2), match.group(3)))
    return found


def test_every_signature_block_is_deployed(conn: psycopg.Connection[Any]) -> None:
    found = signatures()
    pages = {block.path for block, *_ in found}
    assert pages == {"docs/sql-api.md", "docs/outbox.md"}, pages
    rows = conn.execute(
        """SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid)
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'inbox'"""
    ).fetchall()
    deployed: dict[str, list[tuple[str, str]]] = {}
    for name, args, result in rows:
        deployed.setdefault(name, []).append((_normalize(args), _normalize(result or "")))

    def interval(match: re.Match[str]) -> str:
        row = conn.execute("SELECT %s::interval::text", (match.group(1),)).fetchone()
        assert row is not None
        return f"interval DEFAULT '{row[0]}'"

    wrong = []
    for block, name, doc_args, result in found:
        args = re.sub(r"interval DEFAULT '([^']*)'", interval, doc_args)
        candidates = deployed.get(name, [])
        matching = [r for a, r in candidates if a == _normalize(args)]
        if not matching:
            wrong.append(f"{block.where}: inbox.{name}({_normalize(args)}) is not deployed; deployed: {candidates}")
        elif result is not None and _normalize(result) not in matching:
            wrong.append(f"{block.where}: inbox.{name} returns {matching}, not {_normalize(result)}")
    assert not wrong, "\n".join(wrong)
