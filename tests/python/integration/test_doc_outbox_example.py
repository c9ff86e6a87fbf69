"""docs/outbox.md §10 (Example) is what psql prints: the transcript is run, and compared line by line.

The section holds a ```sql block (the login roles and the service's table, run first as a
superuser, as pasted) and one ``` block: a psql session. In the session, a line that starts with a
prompt naming the role of the connection (`docs_ops=> `, `postgres=# ` for a superuser) starts a
statement, a comment or a meta-command; an SQL statement goes on, on the lines that follow, up to
the line that ends with `;` (a trailing `-- comment` aside). Every other line is psql's output.

The test runs the session's statements in order, in one psql process, on a fresh database of a
private cluster, and renders the session again from the doc's own statement lines, the prompt of the
role connected at that point, and the output psql really printed. The rendering must equal the doc's
block. Normalized, and said so in the doc: psql's `psql:<stdin>:N: ` prefix of errors and warnings
and the `LOCATION:` line of verbose errors are dropped (they name lines of the input and of the C
source), the notifying backend's PID is shown as `<pid>`, and trailing blanks are removed. Nothing
else is: the example shows random values (lease tokens, times) only through stable expressions.

PGINBOX_UPDATE_DOCS=1 writes what psql printed into docs/outbox.md (then fails: review the diff).
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from conftest import PRIVATE_DB, REPO_ROOT, make_cluster, sqitch_project

from pginbox.devtools.cluster import Cluster
from pginbox.schema import sqitch

pytestmark = pytest.mark.slow  # a private cluster per module

PAGE = "docs/outbox.md"
SECTION = "## 10. Example"
DATABASE = "docs_ob"  # the transcript's \c lines and psql's "You are now connected" name it
FIRST_ROLE = "postgres"  # the session starts as the superuser who ran the setup block

PROMPT = re.compile(r"^(?P<role>[a-z_][a-z0-9_]*)=(?P<mark>[>#]) (?P<text>.*)$")
TRAILING_COMMENT = re.compile(r"\s+--\s.*$")
ERROR_PREFIX = re.compile(r"^psql:[^:]*:\d+: ")
NOTIFICATION_PID = re.compile(r"(received from server process with PID )\d+\.$")
SENTINEL = "@@pginbox-doc-chunk@@"
HUNK = re.compile(r"([-+])(\d+)")


@dataclass(frozen=True)
class Chunk:
    """One thing typed at a prompt: a statement (its lines), a comment or a meta-command."""

    role: str
    lines: tuple[str, ...]  # as sent to psql: the first line without its prompt
    shown: tuple[str, ...]  # as the doc shows them: the first line with its prompt
    output: tuple[str, ...]  # what the doc says psql printed


@dataclass(frozen=True)
class Section:
    setup: str
    transcript: list[str]
    first_line: int  # line number (from 1) in the page of the transcript's first line


def read_section() -> Section:
    """The ```sql block and the ``` block of §10."""
    lines = (REPO_ROOT / PAGE).read_text().split("\n")
    start = lines.index(SECTION)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    blocks: list[tuple[str, int, list[str]]] = []
    fence: tuple[str, int] | None = None
    for number in range(start + 1, end):
        line = lines[number]
        if line.startswith("```"):
            if fence is None:
                fence = (line[3:].strip(), number + 1)
            else:
                blocks.append((fence[0], fence[1], lines[fence[1] : number]))
                fence = None
    assert fence is None, f"{PAGE}: unclosed code fence at line {fence[1]}"
    kinds = [kind for kind, _, _ in blocks]
    assert kinds == ["sql", ""], f"{PAGE} {SECTION}: expected a ```sql block, then a ``` block; found {kinds}"
    (_, _, setup), (_, first, transcript) = blocks
    return Section("\n".join(setup) + "\n", transcript, first + 1)


def statement_ends(line: str) -> bool:
    return TRAILING_COMMENT.sub("", line).rstrip().endswith(";")


def parse(transcript: list[str], first_line: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    i = 0
    while i < len(transcript):
        match = PROMPT.match(transcript[i])
        assert match, f"{PAGE}:{first_line + i}: the session must go on with a prompt, found: {transcript[i]!r}"
        text = match["text"]
        lines, shown = [text], [transcript[i]]
        i += 1
        if not (text.startswith(("\\", "--")) or statement_ends(text)):
            while True:
                assert i < len(transcript), f"{PAGE}:{first_line + i}: the last statement does not end with ';'"
                assert not PROMPT.match(transcript[i]), f"{PAGE}:{first_line + i}: the statement above has no ';'"
                lines.append(transcript[i])
                shown.append(transcript[i])
                i += 1
                if statement_ends(lines[-1]):
                    break
        output_start = i
        while i < len(transcript) and not PROMPT.match(transcript[i]):
            i += 1
        chunks.append(Chunk(match["role"], tuple(lines), tuple(shown), tuple(transcript[output_start:i])))
    return chunks


def normalize(line: str) -> str:
    line = ERROR_PREFIX.sub("", line)
    line = NOTIFICATION_PID.sub(r"\1<pid>.", line)
    return line.rstrip()


def psql_env(cluster: Cluster) -> dict[str, str]:
    """Where the example's psql (and the `\\!` one it starts) connect; messages in English."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k not in ("LANGUAGE", "DATABASE_URL")}
    env.update(
        PGHOST="127.0.0.1",
        PGPORT=str(cluster.port),
        PGCLIENTENCODING="UTF8",
        LC_ALL="C.UTF-8",
        PATH=f"{cluster.bindir}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    return env


def run_session(cluster: Cluster, setup: str, chunks: list[Chunk]) -> tuple[list[str], list[list[str]]]:
    """Runs the setup (stopping at an error), then every chunk, in one psql session; returns the role
    connected when each chunk runs (its prompt) and each chunk's normalized output."""
    script = ["\\set ON_ERROR_STOP on", setup, "\\set ON_ERROR_STOP off", f"\\echo {SENTINEL} :USER"]
    for chunk in chunks:
        script.extend(chunk.lines)
        script.append(f"\\echo {SENTINEL} :USER")
    proc = subprocess.run(
        [
            str(cluster.bindir / "psql"),
            "-X",
            "-v",
            "VERBOSITY=verbose",
            "-v",
            "SHOW_CONTEXT=never",
            "-P",
            "null=∅",
            "-P",
            "pager=off",
            "-d",
            DATABASE,
            "-U",
            FIRST_ROLE,
            "-f",
            "-",
        ],
        input="\n".join(script) + "\n",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # in order: psql flushes stdout before it writes to stderr
        env=psql_env(cluster),
        text=True,
        encoding="utf-8",
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"psql exited with {proc.returncode}:\n{proc.stdout}"
    # setup's output, then per chunk: "<role connected before it>\n<its output>", then the last role.
    setup_output, *parts = proc.stdout.split(f"{SENTINEL} ")
    assert "ERROR" not in setup_output, f"the setup block of {PAGE} {SECTION} failed:\n{setup_output}"
    assert len(parts) == len(chunks) + 1, proc.stdout
    roles: list[str] = []
    outputs: list[list[str]] = []
    for part in parts[:-1]:
        role, _, output = part.partition("\n")
        roles.append(role)
        lines = output.split("\n")
        assert lines.pop() == "", part  # the output ends with a newline
        outputs.append([normalize(line) for line in lines if not line.startswith("LOCATION:  ")])
    return roles, outputs


def superusers(cluster: Cluster) -> set[str]:
    with psycopg.connect(cluster.dsn(DATABASE), autocommit=True) as conn:
        return {name for (name,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolsuper")}


def render(chunks: list[Chunk], roles: list[str], outputs: list[list[str]], supers: set[str]) -> list[str]:
    """The session as the doc should show it: the doc's statements after the prompt of the role
    really connected at that point, each followed by what psql printed."""
    lines: list[str] = []
    for chunk, role, output in zip(chunks, roles, outputs, strict=True):
        prompt = f"{role}={'#' if role in supers else '>'} "
        lines.append(prompt + chunk.lines[0])
        lines.extend(chunk.shown[1:])
        lines.extend(output)
    return lines


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = make_cluster(tmp_path_factory.mktemp("doc_outbox"))
    try:
        cluster.create_database(PRIVATE_DB)
        sqitch.deploy(cluster.dsn(PRIVATE_DB), project=sqitch_project())
        yield cluster
    finally:
        cluster.destroy()


def test_the_example_is_what_psql_prints(cluster: Cluster) -> None:
    section = read_section()
    chunks = parse(section.transcript, section.first_line)
    assert chunks[0].role == FIRST_ROLE, "the session starts as the superuser who ran the setup block"
    cluster.create_database(DATABASE, template=PRIVATE_DB)

    roles, outputs = run_session(cluster, section.setup, chunks)
    actual = render(chunks, roles, outputs, superusers(cluster))
    expected = [line.rstrip() for line in section.transcript]
    if actual == expected:
        return
    if os.environ.get("PGINBOX_UPDATE_DOCS") == "1":
        page = REPO_ROOT / PAGE
        lines = page.read_text().split("\n")
        start = section.first_line - 1
        lines[start : start + len(section.transcript)] = actual
        page.write_text("\n".join(lines))
    diff = difflib.unified_diff(expected, actual, f"{PAGE} (the doc)", "psql (the run)", lineterm="", n=2)
    pytest.fail(
        f"{PAGE} {SECTION} is not what psql prints (hunks numbered by lines of {PAGE}):\n"
        + "\n".join(page_lines(line, section.first_line - 1) for line in diff),
        pytrace=False,
    )


def page_lines(diff_line: str, offset: int) -> str:
    """A hunk header of the diff with line numbers of the page rather than of the block."""

    def shift(match: re.Match[str]) -> str:
        return f"{match[1]}{int(match[2]) + offset}"

    return HUNK.sub(shift, diff_line) if diff_line.startswith("@@ ") else diff_line


def test_the_parser_tells_statements_from_output() -> None:
    transcript = [
        "postgres=# \\c docs_ob docs_ops",
        'You are now connected to database "docs_ob" as user "docs_ops".',
        "docs_ops=> -- a comment",
        "docs_ops=> SELECT 1 AS a,",
        "              2 AS b;  -- the end",
        " a | b",
        "---+---",
        " 1 | 2",
        "(1 row)",
        "",
        "docs_ops=> BEGIN; SELECT 1",
        "           ;",
        "BEGIN",
    ]
    chunks = parse(transcript, 1)
    assert [(c.role, c.lines, c.output) for c in chunks] == [
        ("postgres", ("\\c docs_ob docs_ops",), ('You are now connected to database "docs_ob" as user "docs_ops".',)),
        ("docs_ops", ("-- a comment",), ()),
        (
            "docs_ops",
            ("SELECT 1 AS a,", "              2 AS b;  -- the end"),
            (" a | b", "---+---", " 1 | 2", "(1 row)", ""),
        ),
        ("docs_ops", ("BEGIN; SELECT 1", "           ;"), ("BEGIN",)),
    ]
    with pytest.raises(AssertionError, match="has no ';'"):
        parse(["docs_ops=> SELECT 1", "docs_ops=> SELECT 2;"], 1)
    assert normalize("psql:<stdin>:12: ERROR:  22023: bad  ") == "ERROR:  22023: bad"
    assert normalize('Asynchronous notification "inbox_outbox" received from server process with PID 3913.') == (
        'Asynchronous notification "inbox_outbox" received from server process with PID <pid>.'
    )
