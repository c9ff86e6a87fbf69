"""Schema helpers for tests that compare databases: build from sql/, pg_dump of schema inbox, the
plan's changes and tags, psql on a file."""

from __future__ import annotations

import difflib
import os
import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pginbox.devtools.cluster import find_bindir
from pginbox.schema.sqitch import pinned_pgoptions

REPO_ROOT = Path(__file__).resolve().parents[2]
SQL_DIR = REPO_ROOT / "sql"
# pg_dump lines that say nothing about the schema (the \restrict key changes on every run).
DUMP_NOISE = ("--", "SET ", "SELECT pg_catalog.set_config(", "\\restrict", "\\unrestrict")


def psql_file(dsn: str, path: Path) -> subprocess.CompletedProcess[str]:
    """psql -f on a deploy, revert or verify script (or a source in sql/), its session started with
    search_path = pg_catalog, pg_temp as every deploy path starts it (pginbox.schema.sqitch)."""
    return subprocess.run(
        [str(find_bindir() / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PGOPTIONS": pinned_pgoptions(os.environ.get("PGOPTIONS"))},
    )


def sql_sources(sql_dir: Path = SQL_DIR) -> list[Path]:
    files = sorted(sql_dir.glob("*.sql"))
    if not files:
        pytest.fail(f"no SQL sources in {sql_dir}")
    return files


def build_from_sql_sources(dsn: str, sql_dir: Path = SQL_DIR) -> None:
    """Runs sql/*.sql in name order with psql: the readable current state, built directly."""
    for path in sql_sources(sql_dir):
        result = psql_file(dsn, path)
        assert result.returncode == 0, f"psql -f {path.name} failed:\n{result.stderr}"


def schema_dump(dsn: str) -> list[str]:
    """pg_dump of schema inbox (owners and ACLs kept), without comments, SET lines and the
    per-run \\restrict key."""
    result = subprocess.run(
        [str(find_bindir() / "pg_dump"), "--schema-only", "--schema=inbox", "-d", dsn],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"pg_dump failed:\n{result.stderr}"
    kept = []
    generated = False
    for line in result.stdout.splitlines():
        # pg_dump's own comments start at the margin; comments inside a function body are kept.
        if not line.strip() or line.startswith(DUMP_NOISE):
            continue
        # inbox._run_handler's static calls depend on the handlers registered (data, not schema).
        if "-- generated:end" in line:
            generated = False
        elif generated:
            continue
        elif "-- generated:begin" in line:
            generated = True
        kept.append(line.rstrip())
    return kept


def dump_diff(expected: list[str], actual: list[str], expected_name: str, actual_name: str) -> str:
    return "\n".join(difflib.unified_diff(expected, actual, expected_name, actual_name, lineterm=""))


def assert_same_lines(
    expected: list[str], actual: list[str], what: str, names: tuple[str, str] = ("sqitch deploy", "sql/*.sql")
) -> None:
    if expected != actual:
        pytest.fail(f"{what} differ:\n{dump_diff(expected, actual, *names)}")


def query(dsn: str, statement: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        return connection.execute(statement).fetchall()


def plan_entries(project: Path = REPO_ROOT) -> list[str]:
    """Change names and @tags of sqitch.plan, in plan order."""
    return [
        line.split()[0]
        for line in (project / "sqitch.plan").read_text().splitlines()
        if line.strip() and not line.startswith(("%", "#", " "))
    ]


def plan_changes(project: Path = REPO_ROOT) -> list[str]:
    return [entry for entry in plan_entries(project) if not entry.startswith("@")]


def plan_targets(project: Path = REPO_ROOT) -> list[str]:
    """Every plan position as Sqitch names it unambiguously: a reworked change's earlier position
    is `change@tag` (the first tag after it), its latest `change@HEAD`, any other just `change`."""
    entries = plan_entries(project)
    targets = []
    for i, entry in enumerate(entries):
        if entry.startswith("@"):
            continue
        if entry in entries[i + 1 :]:
            targets.append(entry + next(e for e in entries[i + 1 :] if e.startswith("@")))
        elif entry in entries[:i]:
            targets.append(entry + "@HEAD")
        else:
            targets.append(entry)
    return targets


def release_tags(project: Path = REPO_ROOT) -> list[str]:
    """The @tags of sqitch.plan, oldest first: every tag is a release (docs/releasing.md)."""
    tags = [entry for entry in plan_entries(project) if entry.startswith("@")]
    if not tags:
        pytest.fail("sqitch.plan has no release tag")
    return tags


def last_tag(project: Path = REPO_ROOT) -> str:
    return release_tags(project)[-1]
