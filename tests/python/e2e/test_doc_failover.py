"""docs/failover.md and docs/other-languages.md section 11, run: every example of them against a
private primary with a streaming standby named pg2 (helpers_replication).

- the TOML block is read by load_consume_config;
- the Python block is executed as it is: its consume_one() says ack (True) while the standby
  streams, and hand back (False, after the doc's 10 s timeout) while its walreceiver is stopped;
- the SQL blocks run after a COMMIT: true while the standby has it, false when 2 standbys are
  required of a pair with one;
- the multi-host connection string is parsed by libpq's rules and reaches the primary.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import REPO_ROOT
from helpers_replication import Golden, ReplicatedPair
from psycopg.conninfo import conninfo_to_dict

from pginbox.client.outcomes import Message
from pginbox.consumer import load_consume_config

pytestmark = pytest.mark.timeout(300)

FAILOVER = REPO_ROOT / "docs" / "failover.md"
OTHER = REPO_ROOT / "docs" / "other-languages.md"

SETUP = """
CREATE TABLE ledger(message_id text NOT NULL);
CREATE FUNCTION doc_credit(payload jsonb) RETURNS void LANGUAGE sql AS $$
  INSERT INTO ledger(message_id) VALUES (payload->>'id');
$$;
SELECT inbox.register_handler('billing', 'credit', 'doc_credit(jsonb)'::regprocedure, 'v1');
"""


def blocks(doc: Path | str, lang: str) -> list[str]:
    text = doc.read_text() if isinstance(doc, Path) else doc
    return [str(b) for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S)]


def section(doc: Path, heading: str) -> str:
    text = doc.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


@pytest.fixture(scope="module")
def pair() -> Iterator[ReplicatedPair]:
    golden = Golden(SETUP)
    try:
        p = ReplicatedPair(golden, name="pg2")
        try:
            yield p
        finally:
            p.destroy()
    finally:
        golden.destroy()


def committed(dsn: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("INSERT INTO ledger VALUES ('doc')")  # a commit to wait for
    return conn


def test_the_toml_block_configures_the_standby_mode(tmp_path: Path) -> None:
    (toml,) = blocks(FAILOVER, "toml")
    path = tmp_path / "consume.toml"
    path.write_text(toml)
    d = load_consume_config(path).durability
    assert (d.mode, d.min_standbys, d.standby_names, d.wait, d.timeout) == ("standby", 1, ("pg2", "pg3"), "flush", 10.0)


def test_the_python_block_acks_only_what_the_standby_has(pair: ReplicatedPair, monkeypatch: pytest.MonkeyPatch) -> None:
    (code,) = blocks(FAILOVER, "python")
    monkeypatch.setenv("DATABASE_URL", pair.dsn())
    namespace: dict[str, Any] = {}
    exec(compile(code, str(FAILOVER), "exec"), namespace)  # the doc's own example
    consume_one = namespace["consume_one"]

    def message(i: str) -> Message:
        return Message("orders", i, "credit", {"id": i})

    assert asyncio.run(consume_one(message("doc-1"))) is True
    pair.stop_wal()
    try:
        assert asyncio.run(consume_one(message("doc-2"))) is False  # committed, not on the standby
    finally:
        pair.resume_wal()
    assert asyncio.run(consume_one(message("doc-2"))) is True  # the redelivery: a duplicate, now durable


def test_the_sql_blocks_of_failover_md(pair: ReplicatedPair) -> None:
    (sql_block,) = [b for b in blocks(FAILOVER, "sql") if "inbox.wait_durable" in b]
    code = re.sub(r"--[^\n]*", "", sql_block)  # comments (they hold semicolons)
    statements = [s.strip() for s in code.split(";") if s.strip()]
    with committed(pair.primary_dsn()) as conn:
        answers = [conn.execute(s).fetchone() for s in statements]
    assert [a and a[0] for a in answers] == [True, True, False]  # 2 of pg2, pg3: only pg2 exists


def test_the_sql_blocks_of_other_languages(pair: ReplicatedPair) -> None:
    wait, check = blocks(section(OTHER, "## 11. Ack after the standbys have the commit"), "sql")
    wait = re.sub(r"--[^\n]*", "", wait)  # its comment names $1 too
    with committed(pair.primary_dsn()) as conn:
        row = conn.execute(wait.replace("$1", "%s"), (2,)).fetchone()
        assert row is not None and row[0] is True
        row = conn.execute(check).fetchone()
        assert row is not None and row[0] is True
        with conn.transaction():
            conn.execute("INSERT INTO ledger VALUES ('inside')")
            with pytest.raises(psycopg.Error) as err:
                conn.execute(wait.replace("$1", "%s"), (2,))
        assert err.value.sqlstate == "25001"  # the table of the section


def test_the_multi_host_connection_string(pair: ReplicatedPair) -> None:
    (line,) = [b for b in blocks(FAILOVER, "text") if "pginbox consume --dsn" in b]
    dsn = re.search(r'--dsn "([^"]+)"', line)
    assert dsn is not None
    params = conninfo_to_dict(dsn.group(1))
    assert params["target_session_attrs"] == "read-write" and params["host"] == "pg1,pg2"
    # the same shape against the pair: the primary answers, never the standby
    with psycopg.connect(pair.dsn(), autocommit=True) as conn:
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        assert row is not None and row[0] is False
