"""docs/retention.md's psql session of §5 (its ``` block of statements and what psql printed), run
and compared line by line: the psql sessions whose marker names this file. docs/sql-api.md's
sessions are test_doc_sql_session.py's, which replays them in the order of the page's run.

The session was run as sql-api.md §2 says the page's examples were: psql, `-X -a -v
VERBOSITY=verbose -v SHOW_CONTEXT=never -P null=∅`, on the example database (sql-api.md's first
```sql block, which test_doc_sql.py runs), `LOCATION:` lines and psql's `psql:file:line:`
prefixes removed. It runs on a fresh copy of that database, as a superuser, and psql's echo of the
statements and their output must be the block. Trailing blanks are ignored.

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
from test_doc_sql import as_script, psql
from test_doc_sql import sql_blocks as sql_api_sql_blocks

from pginbox.devtools.cluster import Cluster
from pginbox.schema import sqitch

PAGE = REPO_ROOT / "docs" / "sql-api.md"
PSQL_OPTIONS = ["-X", "-a", "-v", "VERBOSITY=verbose", "-v", "SHOW_CONTEXT=never", "-P", "null=∅"]
THIS = "test_doc_sql_transcripts.py"
EXAMPLE_DB = "sql_api_example"
TAG = re.compile(
    r"^(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|SET|RESET|DO|CALL|GRANT|REVOKE|"
    r"(INSERT \d+|UPDATE|DELETE|SELECT|COPY) \d+|(CREATE|ALTER|DROP) [A-Z ]+)$"
)
OUTPUT = re.compile(
    r"^( |-+\+|\(\d+ rows?\)$|-[-+]*$|(ERROR|DETAIL|HINT|NOTICE|WARNING|CONTEXT|INFO|Time):|"
    r"(SCHEMA|TABLE|COLUMN|DATATYPE|CONSTRAINT) NAME:|$)"
)


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
        (setup, *_) = sql_api_sql_blocks("docs/sql-api.md")
        psql(cluster, cluster.dsn(EXAMPLE_DB), as_script(setup), setup.where)
        yield cluster
    finally:
        cluster.destroy()


def rendered(cluster: Cluster, dsn: str, block: Block) -> str:
    proc = subprocess.run(
        [str(cluster.bindir / "psql"), *PSQL_OPTIONS, "-d", dsn, "-f", "-"],
        input=statements(block),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    out = [
        re.sub(r"^psql:<stdin>:\d+: ", "", line).rstrip()
        for line in proc.stdout.split("\n")
        if not line.startswith("LOCATION:")
    ]
    return "\n".join(out).rstrip("\n") + "\n"


@pytest.mark.parametrize("block", transcripts(), ids=lambda b: f"{Path(b.page).stem}-line{b.line}")
def test_the_session_is_what_psql_prints(cluster: Cluster, block: Block) -> None:
    name = f"t_{Path(block.page).stem.replace('-', '_')}_{block.line}"
    cluster.create_database(name, template=EXAMPLE_DB)
    if block.page == "docs/retention.md":
        psql(cluster, cluster.dsn(name), RETENTION_SCRATCH, "retention scratch")
    expected = "\n".join(line.rstrip() for line in block.text.split("\n")).rstrip("\n") + "\n"
    assert rendered(cluster, cluster.dsn(name), block) == expected, block.where


def test_the_sessions_compared() -> None:
    """retention.md's session; none of sql-api.md's (test_doc_sql_session.py compares them, once)."""
    assert [b.page for b in transcripts()] == ["docs/retention.md"]
