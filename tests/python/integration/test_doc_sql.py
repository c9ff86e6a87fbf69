"""The ```sql blocks of README.md and docs/sql-api.md run as pasted (issue 14, item 4).

Every ```sql block is run with psql, in the page's order, on a fresh database of a private cluster
(the blocks create roles, which are cluster-wide). Conventions the blocks follow:

- A block starts as a superuser (who deployed pginbox). A comment line
  `-- as <role>` (also `-- once, as <role>`, `-- then, as <role>`, `-- per message, as <role>`)
  switches to that role for what follows: the test runs `SET SESSION AUTHORIZATION <role>`, so the
  session_user is that role, as for a service that logs in as it. `-- as a superuser` switches back.
- A block whose first line is `-- doc test: skip (...)` is not run (GRANTs to the reader's own roles).
- A block that starts with `inbox.<function>(` is a signature: compared with the deployed function.

Each page's blocks must give the outcomes the page promises (checked line by line on psql's output),
and the database must then hold what they promise (balances, one message row per identity).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import PRIVATE_DB, REPO_ROOT, make_cluster, sqitch_project

from pginbox.devtools.cluster import Cluster
from pginbox.schema import sqitch

pytestmark = pytest.mark.slow  # a private cluster per module

MARKER = re.compile(r"^-- (?:once, |then, |per message, )?as (a superuser|[a-z_][a-z0-9_]*)\b")
SKIP = "-- doc test: skip"
SIGNATURE = re.compile(r"^inbox\.[a-z_]+\(")


@dataclass(frozen=True)
class Block:
    path: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def sql_blocks(relpath: str) -> list[Block]:
    """Every ```sql block of the file, with the line of its opening fence."""
    blocks: list[Block] = []
    lines = (REPO_ROOT / relpath).read_text().split("\n")
    start: int | None = None
    is_sql = False
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if start is None:
                start, is_sql, body = number, line[3:].strip() == "sql", []
            else:
                if is_sql:
                    blocks.append(Block(relpath, start, "\n".join(body) + "\n"))
                start = None
        elif start is not None:
            body.append(line)
    assert start is None, f"{relpath}: unclosed code fence at line {start}"
    return blocks


def kind(block: Block) -> str:
    first = block.text.lstrip().split("\n", 1)[0]
    if first.startswith(SKIP):
        return "skip"
    if SIGNATURE.match(first):
        return "signature"
    return "run"


def as_script(block: Block) -> str:
    """The block with its role markers turned into SET SESSION AUTHORIZATION."""
    out = []
    for line in block.text.split("\n"):
        match = MARKER.match(line)
        if match:
            role = match.group(1)
            out.append("RESET SESSION AUTHORIZATION;")
            if role != "a superuser":
                out.append(f"SET SESSION AUTHORIZATION {role};")
        out.append(line)
    return "\n".join(out)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = make_cluster(tmp_path_factory.mktemp("doc_sql"))
    try:
        cluster.create_database(PRIVATE_DB)
        sqitch.deploy(cluster.dsn(PRIVATE_DB), project=sqitch_project())
        yield cluster
    finally:
        cluster.destroy()


def fresh_database(cluster: Cluster, name: str) -> str:
    cluster.create_database(name, template=PRIVATE_DB)
    return cluster.dsn(name)


def psql(cluster: Cluster, dsn: str, script: str, where: str) -> list[str]:
    """Runs the script as one psql session (as a person pastes it); returns the result lines."""
    proc = subprocess.run(
        [str(cluster.bindir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"{where} failed as pasted:\n{proc.stderr}"
    assert "ERROR" not in proc.stderr, f"{where}:\n{proc.stderr}"
    return [line for line in proc.stdout.split("\n") if line]


def run_page(cluster: Cluster, dsn: str, relpath: str) -> list[tuple[Block, list[str]]]:
    ran = []
    for block in sql_blocks(relpath):
        if kind(block) == "run":
            ran.append((block, psql(cluster, dsn, as_script(block), block.where)))
    return ran


def query(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


# ------------------------------------------------------------------------------ README.md


def test_readme_sql_runs_as_pasted(cluster: Cluster) -> None:
    dsn = fresh_database(cluster, "doc_readme")
    ran = run_page(cluster, dsn, "README.md")
    assert len(ran) == 2, [b.where for b, _ in ran]
    (setup_and_claim, claim_out), (apply_block, apply_out) = ran
    # The claim block: the service's first delivery is claimed, the change is made with it.
    assert claim_out[-1] == "claimed", f"{setup_and_claim.where}: {claim_out}"
    # claim_and_apply, with its own message id: applied by the registered credit(jsonb).
    assert apply_out == ["applied"], f"{apply_block.where}: {apply_out}"

    # Pasted again: the redelivery is a duplicate and changes nothing.
    assert psql(cluster, dsn, as_script(apply_block), apply_block.where) == ["duplicate"]

    assert query(dsn, "SELECT id, balance FROM account") == [(7, 20)]
    rows = query(
        dsn,
        "SELECT consumer, producer, message_id, status FROM inbox.message ORDER BY message_id",
    )
    assert rows == [
        ("billing", "shop", "order-1042", "processed"),
        ("billing", "shop", "order-1043", "processed"),
    ]
    # The service acted as itself (its binding), not as the superuser.
    assert query(dsn, "SELECT consumer, role::regrole::text FROM inbox.consumer_binding") == [
        ("billing", "billing_service")
    ]
    assert query(dsn, "SELECT count(*) FROM inbox.attempt") == [(0,)]


# ------------------------------------------------------------------------------ docs/sql-api.md


def test_sql_api_sql_runs_as_pasted(cluster: Cluster) -> None:
    dsn = fresh_database(cluster, "doc_sql_api")
    blocks = sql_blocks("docs/sql-api.md")
    skipped = [b for b in blocks if kind(b) == "skip"]
    assert [b.text.split("\n")[1] for b in skipped] == ["GRANT inbox_consumer TO my_service;"]

    ran = run_page(cluster, dsn, "docs/sql-api.md")
    outputs = [out for _, out in ran]
    wheres = [b.where for b, _ in ran]
    assert len(ran) == 5, wheres
    setup, claim, apply, batch, redelivery = outputs
    assert claim == ["claimed"], wheres[1]
    assert apply[-1] == "applied", f"{wheres[2]}: {apply}"
    assert batch == ["1|evt-1043|applied", "2|evt-1044|applied"], wheres[3]
    assert redelivery == ["proceed", "applied"], wheres[4]
    assert setup, wheres[0]

    assert query(dsn, "SELECT account_id, balance FROM app.account ORDER BY 1") == [
        ("A-1", 100 + 10 + 10 + 1 + 10),
        ("A-2", 2),
    ]
    assert query(dsn, "SELECT message_id, status FROM inbox.message ORDER BY message_id") == [
        (f"evt-{n}", "processed") for n in (1042, 1043, 1044, 1045, 1046)
    ]
    assert query(dsn, "SELECT consumer, role::regrole::text FROM inbox.consumer_binding") == [("billing", "docs_svc")]


# ------------------------------------------------------------------------------ signatures


def _normalize(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    text = text.replace("timestamp with time zone", "timestamptz")
    text = re.sub(r"::[a-z_.]+( [a-z]+)*(\[\])?", "", text)  # DEFAULT ''::text -> DEFAULT ''
    text = text.replace("TABLE (", "TABLE(").replace("( ", "(").replace(" )", ")")
    return text


def _signatures() -> list[tuple[Block, str, str, str | None]]:
    found = []
    for page in ("README.md", "docs/sql-api.md"):
        for block in sql_blocks(page):
            if kind(block) != "signature":
                continue
            for decl in re.split(r"\n(?=inbox\.)", block.text.strip()):
                match = re.fullmatch(r"inbox\.(\w+)\((.*?)\)(?:\s+RETURNS\s+(.*))?", decl.strip(), re.S)
                assert match, f"{block.where}: not a signature: {decl}"
                found.append((block, match.group(1), match.group(2), match.group(3)))
    return found


def test_signature_blocks_match_the_deployed_functions(cluster: Cluster) -> None:
    signatures = _signatures()
    assert len(signatures) >= 12
    rows = query(
        cluster.dsn(PRIVATE_DB),
        """SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid)
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'inbox'""",
    )
    deployed: dict[str, list[tuple[str, str]]] = {}
    for name, args, result in rows:
        deployed.setdefault(name, []).append((_normalize(args), _normalize(result or "")))
    for block, name, args, result in signatures:
        assert name in deployed, f"{block.where}: inbox.{name} is not deployed"
        candidates = deployed[name]
        wanted_args = _normalize(args)
        matching = [r for a, r in candidates if a == wanted_args]
        assert matching, f"{block.where}: inbox.{name}({wanted_args}) is not deployed; deployed: {candidates}"
        if result is not None:
            assert _normalize(result) in matching, f"{block.where}: inbox.{name} returns {matching}"
