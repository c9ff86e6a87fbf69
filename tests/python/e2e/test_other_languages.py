"""docs/other-languages.md, tested (issue 14, item 3).

Each example program (examples/node, examples/java, examples/go) runs the doc's scenario as the
LOGIN role `ledger_svc` bound to consumer 'ledger', on a private cluster whose database got the
doc's own setup block. Every step's outcome or SQLSTATE is checked, then the database: balances,
message rows, the conflict's quarantine entry, failures with their reason codes, and nothing
written for the deliveries the server refused (22008, 42704).

A second test checks that every excerpt the doc shows is the example file's text.

The toolchains come from ./dev.sh setup (Debian's nodejs + npm's `pg`, golang + pgx v4, Java 17 +
libpostgresql-jdbc-java); a missing one fails the test with what to install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import PRIVATE_DB, REPO_ROOT

from pginbox.devtools.cluster import Cluster

DOC = REPO_ROOT / "docs" / "other-languages.md"
EXAMPLES = REPO_ROOT / "examples"
CACHE = REPO_ROOT / ".cache"
JDBC_JAR = Path("/usr/share/java/postgresql.jar")
GO_PATH = "/usr/share/gocode"
ROLE = "ledger_svc"
SETUP_MARK = "-- once, as a superuser"

EXPECTED: list[dict[str, Any]] = [
    {"step": "claim", "outcome": "claimed", "then": "ack"},
    {"step": "claim_duplicate", "outcome": "duplicate", "then": "ack"},
    {"step": "claim_conflict", "outcome": "conflict", "then": "ack"},
    {"step": "claim_change_failed", "outcome": "failed", "reason_code": "balance_not_negative", "then": "nack"},
    {"step": "apply", "outcome": "applied", "reason_code": None, "then": "ack"},
    {"step": "apply_duplicate", "outcome": "duplicate", "reason_code": None, "then": "ack"},
    {"step": "apply_failed", "outcome": "failed", "reason_code": "balance_not_negative", "then": "nack"},
    {"step": "race", "first": "applied", "retried": ["40001"], "outcome": "duplicate"},
    {"step": "produced_at_ahead", "sqlstate": "22008", "action": "dead-letter"},
    {"step": "unbound_consumer", "sqlstate": "42704", "action": "halt"},
]


def setup_block() -> str:
    """The doc's setup block (the ```sql block that starts with SETUP_MARK)."""
    blocks = re.findall(r"```sql\n(.*?)```", DOC.read_text(), re.S)
    setup = [b for b in blocks if b.startswith(SETUP_MARK)]
    assert len(setup) == 1, f"{DOC}: one ```sql block must start with {SETUP_MARK!r}"
    return str(setup[0])


def require(program: str, package: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is not installed: run ./dev.sh setup (Debian package {package})")
    return path


def build_node(_: Path) -> list[str]:
    node = require("node", "nodejs")
    if not (EXAMPLES / "node" / "node_modules" / "pg").is_dir():
        pytest.fail("examples/node/node_modules is missing: run ./dev.sh setup (npm ci in examples/node)")
    return [node, str(EXAMPLES / "node" / "scenario.js")]


def build_java(out: Path) -> list[str]:
    javac = require("javac", "openjdk-17-jdk-headless")
    java = require("java", "openjdk-17-jre-headless")
    if not JDBC_JAR.is_file():
        pytest.fail(f"{JDBC_JAR} is missing: run ./dev.sh setup (Debian package libpostgresql-jdbc-java)")
    source = EXAMPLES / "java" / "Scenario.java"
    subprocess.run(
        [javac, "-Xlint:all", "-Werror", "-cp", str(JDBC_JAR), "-d", str(out), str(source)],
        check=True,
        timeout=120,
    )
    return [java, "-cp", f"{out}{os.pathsep}{JDBC_JAR}", "Scenario"]


def go_env() -> dict[str, str]:
    return {
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": GO_PATH,
        "GOCACHE": str(CACHE / "go-build"),
        "GOFLAGS": "",
        "GOPROXY": "off",
    }


def build_go(out: Path) -> list[str]:
    go = require("go", "golang-go")
    if not Path(GO_PATH, "src", "github.com", "jackc", "pgx", "v4").is_dir():
        pytest.fail("pgx v4 is missing: run ./dev.sh setup (Debian package golang-github-jackc-pgx-v4-dev)")
    gofmt = subprocess.run(
        [str(Path(go).resolve().parent / "gofmt"), "-l", str(EXAMPLES / "go")], capture_output=True, text=True
    )
    assert gofmt.returncode == 0 and gofmt.stdout == "", f"gofmt -l examples/go: {gofmt.stdout}{gofmt.stderr}"
    binary = out / "scenario"
    subprocess.run(
        [go, "build", "-o", str(binary), str(EXAMPLES / "go" / "scenario.go")],
        check=True,
        timeout=300,
        env=go_env(),
        cwd=EXAMPLES / "go",
    )
    return [str(binary)]


BUILDERS: dict[str, Callable[[Path], list[str]]] = {"node": build_node, "java": build_java, "go": build_go}


def query(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


@pytest.mark.parametrize("language", list(BUILDERS))
def test_example_runs_the_scenario(language: str, private_cluster: Cluster, tmp_path: Path) -> None:
    dsn = private_cluster.dsn(PRIVATE_DB)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(setup_block())
    argv = BUILDERS[language](tmp_path)
    env = {
        **os.environ,
        "PGHOST": "127.0.0.1",
        "PGPORT": str(private_cluster.port),
        "PGUSER": ROLE,
        "PGDATABASE": PRIVATE_DB,
    }
    for name in ("PGPASSWORD", "PGSERVICE", "PGOPTIONS", "DATABASE_URL"):
        env.pop(name, None)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{language} example failed:\n{proc.stdout}\n{proc.stderr}"
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert steps == EXPECTED, f"{language}:\n" + "\n".join(json.dumps(s) for s in steps)

    # The database: what each step promised.
    assert query(dsn, "SELECT id, balance FROM ledger.account ORDER BY id") == [
        (1, 100 + 10),  # m-1 once; m-4 failed and rolled back; m-6 refused
        (2, 7 + 1),  # m-3 once, m-5 once (the race); m-2 failed and rolled back
    ]
    assert query(dsn, "SELECT consumer, producer, message_id, status::text FROM inbox.message ORDER BY 3") == [
        ("ledger", "shop", "m-1", "processed"),
        ("ledger", "shop", "m-3", "processed"),
        ("ledger", "shop", "m-5", "processed"),
    ]
    assert query(
        dsn, "SELECT message_id, kind::text, reason_code, status::text, recorded_by FROM inbox.quarantine ORDER BY 1"
    ) == [("m-1", "conflict", "identity_conflict", "open", ROLE)]
    assert query(dsn, "SELECT message_id, failed, reason_code FROM inbox.attempt ORDER BY 1") == [
        ("m-2", 1, "balance_not_negative"),
        ("m-4", 1, "balance_not_negative"),
    ]
    # Nothing at all for the refused deliveries (22008, 42704).
    for table in ("message", "attempt", "quarantine"):
        assert query(dsn, f"SELECT count(*) FROM inbox.{table} WHERE message_id IN ('m-6', 'm-7')") == [(0,)]
    assert query(dsn, "SELECT count(*) FROM inbox.message WHERE consumer <> 'ledger'") == [(0,)]


# ------------------------------------------------------------------------------ excerpts

EXCERPT = re.compile(r"<!-- excerpt: (\S+) (\S+) -->\n```\w*\n(.*?)```", re.S)


def region(path: Path, name: str) -> str:
    text = path.read_text()
    begin, end = (rf"^[ \t]*// doc:{edge} {re.escape(name)}\n" for edge in ("begin", "end"))
    match = re.search(f"{begin}(.*?){end}", text, re.S | re.M)
    assert match, f"{path}: no region {name!r} (// doc:begin {name} ... // doc:end {name})"
    lines = match.group(1).rstrip().split("\n")
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines) + "\n"


def test_doc_excerpts_are_the_example_files() -> None:
    excerpts = EXCERPT.findall(DOC.read_text())
    files = {relpath for relpath, _, _ in excerpts}
    assert files == {"examples/node/scenario.js", "examples/go/scenario.go", "examples/java/Scenario.java"}
    for relpath, name, body in excerpts:
        assert body == region(REPO_ROOT / relpath, name), f"docs/other-languages.md: excerpt {relpath} {name} differs"
    # Every region of every example is shown in the doc.
    shown = {(relpath, name) for relpath, name, _ in excerpts}
    for relpath in files:
        for name in re.findall(r"// doc:begin (\S+)", (REPO_ROOT / relpath).read_text()):
            assert (relpath, name) in shown, f"docs/other-languages.md does not show {relpath} {name}"
