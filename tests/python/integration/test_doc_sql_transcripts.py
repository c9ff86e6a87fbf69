"""docs/sql-api.md's psql sessions (its ``` blocks of statements and what psql printed), and the
one of docs/retention.md §5, run and compared line by line, for each block whose marker names this
file.

sql-api.md §2 says how the page's examples were run: psql, `-X -a -v VERBOSITY=verbose -v
SHOW_CONTEXT=never -P null=∅`, on the example database (the page's first ```sql block, which
test_doc_sql.py runs; the consumer `shipping` bound like `billing`), `LOCATION:` lines and psql's
`psql:file:line:` prefixes removed. Each block runs on a fresh copy of that database (a block
whose first line is in AFTER_THE_SQL_BLOCKS: of that database after the page's other ```sql
blocks ran, as test_doc_sql.py runs them), as a superuser unless its first line is
`-- as <role>`, and psql's echo of the statements and their output must be the block. Trailing
blanks are ignored.

A statement starts on a line that is not output (a line of a result table, a row count, a command
tag, an ERROR/DETAIL/HINT line and the fields VERBOSITY=verbose adds (`SCHEMA NAME:` …), psql's
`Time:` line, a blank line) and ends on the line whose code ends with `;`.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO_ROOT, make_cluster, sqitch_project
from helpers_docs import Block, blocks
from test_doc_sql import as_script, kind, psql
from test_doc_sql import sql_blocks as sql_api_sql_blocks

from pginbox.devtools.cluster import Cluster
from pginbox.schema import sqitch

PAGE = REPO_ROOT / "docs" / "sql-api.md"
PSQL_OPTIONS = ["-X", "-a", "-v", "VERBOSITY=verbose", "-v", "SHOW_CONTEXT=never", "-P", "null=∅"]
THIS = "test_doc_sql_transcripts.py"
EXAMPLE_DB = "sql_api_example"
AFTER_DB = "sql_api_after_the_sql_blocks"
AFTER_THE_SQL_BLOCKS = {
    "-- billing has processed messages with hash_exclude_keys = {sent_at,trace_id}; what is left out is kept"
}
TAG = re.compile(
    r"^(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|SET|RESET|DO|CALL|GRANT|REVOKE|"
    r"(INSERT \d+|UPDATE|DELETE|SELECT|COPY) \d+|(CREATE|ALTER|DROP) [A-Z ]+)$"
)
OUTPUT = re.compile(
    r"^( |-+\+|\(\d+ rows?\)$|-[-+]*$|(ERROR|DETAIL|HINT|NOTICE|WARNING|CONTEXT|INFO|Time):|"
    r"(SCHEMA|TABLE|COLUMN|DATATYPE|CONSTRAINT) NAME:|$)"
)


# What a session needs that the run of §2 did before it (the ids it shows depend on that order),
# found by a line of the session; and the role a session runs as when the page says so in prose.
EVT_1_APPLIED = """SELECT inbox.claim('billing', 'orders', 'evt-1', '{"account": "A-1", "amount": 10}');"""
EVT_1_CONFLICT = """SELECT inbox.claim('billing', 'orders', 'evt-1', '{"account": "A-1", "amount": 250}');"""
DISCARD_1 = "  FROM inbox.discard(1, 'producer re-used evt-1; resent as evt-1b (ticket ORD-77)');"
CONFLICT_1 = (
    "SELECT outcome, quarantine_id, reason_code\n"
    """  FROM inbox.claim_and_apply('billing', 'orders', 'evt-1', 'credit', '{"account": "A-1", "amount": 250}');"""
)
BEFORE = {
    # entry 1 is evt-1's identity conflict (§6.10's list of entries)
    "-- the handler raises ... USING CONSTRAINT = 'unknown_account'": EVT_1_APPLIED + EVT_1_CONFLICT,
    DISCARD_1: EVT_1_APPLIED + EVT_1_CONFLICT,
    CONFLICT_1: EVT_1_APPLIED,
}
ROLE = {DISCARD_1: "docs_ops"}


def for_block(table: dict[str, str], block: Block) -> str | None:
    found = [value for lines, value in table.items() if f"\n{lines}\n" in f"\n{block.text}"]
    assert len(found) <= 1, block.where
    return found[0] if found else None


# docs/retention.md's session runs "on a scratch database (watermark 2026-11-01 for billing)": the
# state a purge would have left, written directly (a purge that old cannot run in a test).
RETENTION = REPO_ROOT / "docs" / "retention.md"
RETENTION_SCRATCH = """
SELECT * FROM inbox.set_retention_policy('billing', '', broker_retention => '7 days',
    max_offset_rewind => '0', dead_letter_redrive_horizon => '0', producer_retry_horizon => '0',
    outage_allowance => '0', backup_restore_window => '0', planned_replay_horizon => '0',
    safety_margin => '1 hour', note => 'scratch');
INSERT INTO inbox.purge_state (consumer, producer, watermark, purged_produced_max)
VALUES ('billing', '', '2026-11-01', '2026-10-31');
UPDATE inbox.consumer_config SET purge_watermark = '2026-11-01' WHERE consumer = 'billing';
"""


def transcripts() -> list[Block]:
    return [
        b
        for page in (PAGE, RETENTION)
        for b in blocks(page)
        if b.lang == "" and b.marker is not None and THIS in b.marker
    ]


def statements(block: Block) -> str:
    """The input lines of the session, in order."""
    script: list[str] = []
    inside = False
    for line in block.text.rstrip("\n").split("\n"):
        if not inside and (OUTPUT.match(line) or TAG.match(line)):
            continue
        script.append(line)
        code = re.sub(r"--.*$", "", line).rstrip()
        inside = (inside or bool(code)) and not code.endswith(";")
    return "\n".join(script) + "\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = make_cluster(tmp_path_factory.mktemp("doc_sql_transcripts"))
    try:
        cluster.create_database(EXAMPLE_DB)
        sqitch.deploy(cluster.dsn(EXAMPLE_DB), project=sqitch_project())
        (setup, *others) = sql_api_sql_blocks("docs/sql-api.md")
        psql(cluster, cluster.dsn(EXAMPLE_DB), as_script(setup), setup.where)
        psql(
            cluster,
            cluster.dsn(EXAMPLE_DB),
            "SELECT inbox.bind_consumer('shipping', 'docs_svc', note => 'the consumer service');",
            "shipping",
        )
        cluster.create_database(AFTER_DB, template=EXAMPLE_DB)
        for other in others:
            if kind(other) == "run":
                psql(cluster, cluster.dsn(AFTER_DB), as_script(other), other.where)
        yield cluster
    finally:
        cluster.destroy()


def rendered(cluster: Cluster, dsn: str, block: Block) -> str:
    script = statements(block)
    first = script.split("\n", 1)[0]
    marked = re.match(r"^-- as ([a-z_]+)\b", first)
    role = marked.group(1) if marked else for_block(ROLE, block)
    prefix = f"SET SESSION AUTHORIZATION {role};\n" if role else ""
    proc = subprocess.run(
        [str(cluster.bindir / "psql"), *PSQL_OPTIONS, "-d", dsn, "-f", "-"],
        input=prefix + script,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    out = proc.stdout.split("\n")
    if prefix:
        assert out[:2] == [prefix.strip(), "SET"], out[:2]
        out = out[2:]
    out = [re.sub(r"^psql:<stdin>:\d+: ", "", line).rstrip() for line in out if not line.startswith("LOCATION:")]
    return "\n".join(out).rstrip("\n") + "\n"


@pytest.mark.parametrize("block", transcripts(), ids=lambda b: f"{Path(b.page).stem}-line{b.line}")
def test_the_session_is_what_psql_prints(cluster: Cluster, block: Block) -> None:
    name = f"t_{Path(block.page).stem.replace('-', '_')}_{block.line}"
    after = block.text.split("\n", 1)[0] in AFTER_THE_SQL_BLOCKS
    cluster.create_database(name, template=AFTER_DB if after else EXAMPLE_DB)
    before = for_block(BEFORE, block)
    if before:
        psql(cluster, cluster.dsn(name), before, f"{block.where}: before")
    if block.page == "docs/retention.md":
        psql(cluster, cluster.dsn(name), RETENTION_SCRATCH, "retention scratch")
    expected = "\n".join(line.rstrip() for line in block.text.split("\n")).rstrip("\n") + "\n"
    assert rendered(cluster, cluster.dsn(name), block) == expected, block.where


def test_the_sessions_compared() -> None:
    assert len(transcripts()) == 19
    assert {b.text.split("\n", 1)[0] for b in transcripts()} >= AFTER_THE_SQL_BLOCKS
