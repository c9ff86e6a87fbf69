"""python/tools/sync_deploy.py on a small Sqitch project of its own (no database needed): the headers
it writes stay true once a tag freezes a script, and a revert script that copied a released deploy
script does not keep a header sending the reader to sql/."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO_ROOT
from helpers_tools import load_tool

ROOT = REPO_ROOT
WHO = "A <a@example.invalid>"
BODY = "BEGIN;\nSET LOCAL search_path = pg_catalog, pg_temp;\n{sql}\nCOMMIT;\n"

tool = load_tool("sync_deploy")


def test_this_checkout_is_in_step() -> None:
    """Released scripts written with an earlier header are accepted as they are (never rewritten)."""
    assert tool.sync(ROOT, check=True) == []


def write_plan(root: Path, *lines: str) -> None:
    (root / "sqitch.plan").write_text("%syntax-version=1.0.0\n%project=pginbox\n\n" + "".join(f"{x}\n" for x in lines))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """Change `thing` generated from sql/010_thing.sql, not released yet."""
    (tmp_path / "sqitch.conf").write_text("[core]\n\tengine = pg\n\tplan_file = sqitch.plan\n\ttop_dir = .\n")
    for kind in ("sql", "deploy", "revert", "verify"):
        (tmp_path / kind).mkdir()
    (tmp_path / "sql" / "010_thing.sql").write_text(BODY.format(sql="CREATE FUNCTION f() RETURNS int AS 'SELECT 1';"))
    (tmp_path / "revert" / "thing.sql").write_text(BODY.format(sql="DROP FUNCTION f();"))
    (tmp_path / "verify" / "thing.sql").write_text(BODY.format(sql="SELECT f();"))
    write_plan(tmp_path, f"thing 2026-12-01T00:00:00Z {WHO} # first")
    return tmp_path


def test_generated_header_stays_true_after_release(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tool.sync(project, check=True) == [
        "deploy/thing.sql is out of date with sql/010_thing.sql: run python/tools/sync_deploy.py"
    ]
    assert tool.sync(project, check=False) == []
    header = (project / "deploy" / "thing.sql").read_text().splitlines()[:2]
    assert header == [
        "-- Deploy pginbox:thing: written from sql/010_thing.sql by python/tools/sync_deploy.py, never by hand,",
        "-- and frozen once a tag releases it (sqitch.lock).",
    ]

    # Release it, then rework it as docs/releasing.md says: the released scripts keep their names with
    # @v1, and the new revert script is the released deploy script (header and all) restoring f().
    write_plan(project, f"thing 2026-12-01T00:00:00Z {WHO} # first", f"@v1 2026-12-01T00:00:01Z {WHO} # release")
    assert tool.lock(project, "v1") == []
    released = (project / "deploy" / "thing.sql").read_text()
    for kind in ("deploy", "revert", "verify"):
        (project / kind / "thing@v1.sql").write_text((project / kind / "thing.sql").read_text())
    (project / "revert" / "thing.sql").write_text(released)
    (project / "sql" / "010_thing.sql").write_text(
        BODY.format(sql="CREATE OR REPLACE FUNCTION f() RETURNS int AS 'SELECT 2';")
    )
    write_plan(
        project,
        f"thing 2026-12-01T00:00:00Z {WHO} # first",
        f"@v1 2026-12-01T00:00:01Z {WHO} # release",
        f"thing [thing@v1] 2026-12-02T00:00:00Z {WHO} # again",
    )
    capsys.readouterr()

    problems = tool.sync(project, check=True)
    assert "revert/thing.sql holds the header of a generated deploy script" in " ".join(problems)
    assert tool.sync(project, check=False) == []
    assert tool.sync(project, check=True) == []
    assert (project / "deploy" / "thing@v1.sql").read_text() == released  # frozen: never rewritten
    assert "SELECT 2" in (project / "deploy" / "thing.sql").read_text()
    revert = (project / "revert" / "thing.sql").read_text()
    assert revert.startswith(
        "-- From here on the text of deploy/thing@v1.sql, as released (frozen: not generated from sql/ any more).\n"
    )
    assert "sql/010_thing.sql" not in revert and "SELECT 1" in revert


def test_released_script_with_an_earlier_header_is_accepted(project: Path) -> None:
    old = tool.OLD_HEADERS[0].format(change="thing", source="010_thing.sql")
    assert "edit that file" in old
    (project / "deploy" / "thing.sql").write_text(old + (project / "sql" / "010_thing.sql").read_text())
    write_plan(project, f"thing 2026-12-01T00:00:00Z {WHO} # first", f"@v1 2026-12-01T00:00:01Z {WHO} # release")
    assert tool.lock(project, "v1") == []
    assert tool.sync(project, check=True) == []
    (project / "sql" / "010_thing.sql").write_text("-- edited\n" + (project / "sql" / "010_thing.sql").read_text())
    assert "which was released and is frozen" in " ".join(tool.sync(project, check=True))
