"""pginbox.schema.sqitch_script renders the Sqitch project as one psql script; a database built with it
is one Sqitch itself recognizes, and would have built the same.

Checked against real PostgreSQL and the real `sqitch`, on a small synthetic project (a tag, a
change reworked after a later tag, dependencies in the change@tag, project:change and !conflict
forms, an escaped note, a %uri that only matches once canonicalized) and on this repository's plan:
(1) the whole plan rendered and applied: sqitch status has nothing to deploy, verify passes, log
    lists every change, and the registry (rows, ids, hashes, DDL) equals what `sqitch deploy` writes;
(2) a database deployed by Sqitch to a tag, upgraded with since=tag: same registry and same schema
    as a database Sqitch deployed to the end; to=tag stops where `sqitch deploy --to` stops;
(3) Sqitch takes over: it deploys only a change added to the plan later, and reverts everything;
(4) unknown tags, since not before to, a missing script, an unparsable plan: a clear error;
    a database in the wrong state: refused before anything runs.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import REPO_ROOT, create_database, drop_database, dsn_for

from pginbox.devtools.cluster import find_bindir
from pginbox.schema import sqitch
from pginbox.schema.sqitch_script import SqitchScriptError, canonical_uri, read_plan, render_script

DUMP_NOISE = ("--", "SET ", "SELECT pg_catalog.set_config(", "\\restrict", "\\unrestrict")

# --------------------------------------------------------------------------- synthetic project

PLANNER = "Ann Planner <ann@example.com>"
TAGGER = "Bob Tagger <bob@example.com>"

PLAN = f"""\
%syntax-version=1.0.0
%project=widgets
%uri=https://Example.COM:443/widgets

# Changes before the first release.
base 2024-01-01T10:00:00Z {PLANNER} # Schema widgets\\nand its counter
items [base !ext:legacy] 2024-01-01T10:01:00Z {PLANNER} # Items
label [widgets:items] 2024-01-01T10:02:00Z {PLANNER} # label() v1
@v1 2024-01-02T09:00:00Z {TAGGER} # First release

audit [items] 2024-01-03T09:00:00Z {PLANNER} # Audit table — UTF-8 note
@v2 2024-01-04T09:00:00Z {TAGGER}

label [label@v2 audit] 2024-01-05T09:00:00Z {PLANNER} # label() v2 audits
"""
CHANGE_COUNT = 5

DEPLOY = {
    "base": "BEGIN;\nCREATE SCHEMA widgets;\nCREATE SEQUENCE widgets.counter;\nCOMMIT;\n",
    # A session-level SET: Sqitch runs the next script in a new session, so must the rendered script.
    "items": "BEGIN;\nSET search_path = widgets;\nCREATE TABLE items (id int PRIMARY KEY, name text);\nCOMMIT;\n",
    # The first instance of the reworked change: `sqitch rework` names it after the last tag before
    # the rework (@v2), not the first tag after the change (@v1).
    "label@v2": (
        "BEGIN;\nCREATE OR REPLACE FUNCTION widgets.label(i widgets.items) RETURNS text\n"
        "LANGUAGE sql AS $$ SELECT i.name $$;\nCOMMIT;\n"
    ),
    # Ends without a newline and without a final semicolon: psql runs that at the end of a file.
    # Names its schema: every script runs with search_path = pg_catalog, pg_temp (pginbox deploy, the
    # rendered script), where an unqualified CREATE would target pg_catalog.
    "audit": (
        "-- l'audit (UTF-8: é)\nBEGIN;\nCREATE TABLE widgets.audit (id int);\nCREATE SEQUENCE public.audit_seq;\nCOMMIT"
    ),
    "label": (
        "BEGIN;\nCREATE OR REPLACE FUNCTION widgets.label(i widgets.items) RETURNS text\n"
        "LANGUAGE sql AS $$ SELECT upper(i.name) $$;\nCOMMIT;\n"
    ),
}
# Sqitch prefers label@v2.sql over label@v1.sql when both exist: this decoy must never run.
DECOY = {"label@v1": "BEGIN;\nCREATE FUNCTION widgets.decoy() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;\nCOMMIT;\n"}
REVERT = {
    "base": "BEGIN;\nDROP SEQUENCE widgets.counter;\nDROP SCHEMA widgets;\nCOMMIT;\n",
    "items": "BEGIN;\nDROP TABLE widgets.items;\nCOMMIT;\n",
    "label@v2": "BEGIN;\nDROP FUNCTION widgets.label(widgets.items);\nCOMMIT;\n",
    "audit": "BEGIN;\nDROP SEQUENCE public.audit_seq;\nDROP TABLE widgets.audit;\nCOMMIT;\n",
    "label": DEPLOY["label@v2"],
}
VERIFY = {
    "base": "SELECT pg_catalog.nextval('widgets.counter');\n",
    "items": "SELECT id, name FROM widgets.items WHERE false;\n",
    "label@v2": "SELECT widgets.label(ROW(1, 'a')::widgets.items);\n",
    "audit": "SELECT id FROM widgets.audit WHERE false;\nSELECT pg_catalog.nextval('public.audit_seq');\n",
    "label": "SELECT 1 / (widgets.label(ROW(1, 'a')::widgets.items) = 'A')::int;\n",
}


def write_scripts(project: Path, kind: str, scripts: dict[str, str]) -> None:
    directory = project / kind
    directory.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (directory / f"{name}.sql").write_text(text, encoding="utf-8")


def make_widgets(root: Path, plan: str = PLAN) -> Path:
    project = root / "widgets"
    project.mkdir()
    (project / "sqitch.conf").write_text("[core]\n\tengine = pg\n\tplan_file = sqitch.plan\n\ttop_dir = .\n")
    (project / "sqitch.plan").write_text(plan, encoding="utf-8")
    write_scripts(project, "deploy", {**DEPLOY, **DECOY})
    write_scripts(project, "revert", REVERT)
    write_scripts(project, "verify", VERIFY)
    return project


def make_ext(root: Path) -> Path:
    """A second project, for project:change dependencies."""
    project = root / "ext"
    project.mkdir()
    (project / "sqitch.conf").write_text("[core]\n\tengine = pg\n")
    (project / "sqitch.plan").write_text(
        f"%syntax-version=1.0.0\n%project=ext\n\next_base 2023-06-01T00:00:00Z {PLANNER} # ext\n"
    )
    write_scripts(project, "deploy", {"ext_base": "CREATE SCHEMA ext;\n"})
    write_scripts(project, "revert", {"ext_base": "DROP SCHEMA ext;\n"})
    write_scripts(project, "verify", {"ext_base": "SELECT 1;\n"})
    return project


@pytest.fixture
def widgets(tmp_path: Path) -> Path:
    return make_widgets(tmp_path)


# --------------------------------------------------------------------------- databases and tools


@pytest.fixture
def new_db(pg_base: str) -> Iterator[Callable[[], str]]:
    """Factory of empty databases (dropped afterwards); returns their conninfo."""
    names: list[str] = []

    def make() -> str:
        name = f"t_script_{uuid.uuid4().hex[:12]}"
        create_database(pg_base, name)
        names.append(name)
        return dsn_for(pg_base, name)

    yield make
    for name in names:
        drop_database(pg_base, name)


def apply_script(dsn: str, script: str) -> subprocess.CompletedProcess[str]:
    """The documented way: psql -X -v ON_ERROR_STOP=1 -f - (script on stdin)."""
    return subprocess.run(
        [str(find_bindir() / "psql"), "-X", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        check=False,
    )


def apply_ok(dsn: str, script: str) -> str:
    result = apply_script(dsn, script)
    assert result.returncode == 0, f"psql failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def query(dsn: str, statement: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        return connection.execute(statement).fetchall()


REGISTRY_QUERIES = {
    "releases": "SELECT version FROM sqitch.releases ORDER BY version",
    "projects": "SELECT project, uri FROM sqitch.projects ORDER BY project",
    "changes": """SELECT change_id, script_hash, change, project, note, planned_at, planner_name, planner_email
                  FROM sqitch.changes ORDER BY committed_at""",
    "tags": """SELECT tag_id, tag, project, change_id, note, planned_at, planner_name, planner_email
               FROM sqitch.tags ORDER BY committed_at, tag""",
    "dependencies": """SELECT change_id, type, dependency, dependency_id
                       FROM sqitch.dependencies ORDER BY change_id, dependency""",
    "events": """SELECT event, change_id, change, project, note, requires, conflicts, tags, planned_at,
                        planner_name, planner_email
                 FROM sqitch.events ORDER BY committed_at""",
}


def registry(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every registry row, without the columns saying who deployed and when."""
    return {table: query(dsn, statement) for table, statement in REGISTRY_QUERIES.items()}


def pg_dump(dsn: str, *args: str) -> list[str]:
    result = subprocess.run(
        [str(find_bindir() / "pg_dump"), "--schema-only", *args, "-d", dsn],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"pg_dump failed:\n{result.stderr}"
    return [line.rstrip() for line in result.stdout.splitlines() if line.strip() and not line.startswith(DUMP_NOISE)]


def schema_snapshot(dsn: str) -> list[str]:
    """Everything but Sqitch's registry, owners and privileges included."""
    return pg_dump(dsn, "--exclude-schema=sqitch")


def registry_ddl(dsn: str) -> list[str]:
    return pg_dump(dsn, "--schema=sqitch")


def assert_same(expected: Any, actual: Any, what: str) -> None:
    if expected != actual:
        if isinstance(expected, dict):
            expected = [f"{k}: {row!r}" for k, rows in expected.items() for row in rows]
            actual = [f"{k}: {row!r}" for k, rows in actual.items() for row in rows]
        diff = "\n".join(difflib.unified_diff(expected, actual, "sqitch deploy", "rendered script", lineterm=""))
        pytest.fail(f"{what} differ:\n{diff}")


def run_sqitch(project: Path, command: str, dsn: str, *args: str) -> str:
    return sqitch.run(command, dsn, *args, project=project)


def deployed_changes(dsn: str) -> list[str]:
    return [row[0] for row in query(dsn, "SELECT change FROM sqitch.changes ORDER BY committed_at")]


# --------------------------------------------------------------------------- (1) the whole plan


@pytest.mark.slow
def test_whole_plan_is_what_sqitch_deploys(widgets: Path, new_db: Callable[[], str]) -> None:
    by_script, by_sqitch = new_db(), new_db()
    output = apply_ok(by_script, render_script(widgets))
    run_sqitch(widgets, "deploy", by_sqitch)

    assert "+ label @v1 .. ok" in output and "+ label .. ok" in output
    assert deployed_changes(by_script) == ["base", "items", "label", "audit", "label"]
    assert "Nothing to deploy (up-to-date)" in run_sqitch(widgets, "status", by_script)
    assert "Verify successful" in run_sqitch(widgets, "verify", by_script)
    log = run_sqitch(widgets, "log", by_script)
    assert re.findall(r"^Name:\s+(\S+)", log, re.MULTILINE) == ["label", "audit", "label", "items", "base"]

    expected, actual = registry(by_sqitch), registry(by_script)
    assert len(actual["changes"]) == CHANGE_COUNT and len(actual["tags"]) == 2
    assert_same(expected, actual, "registry rows")
    assert_same(registry_ddl(by_sqitch), registry_ddl(by_script), "registry DDL (pg_dump --schema=sqitch)")
    assert_same(schema_snapshot(by_sqitch), schema_snapshot(by_script), "schemas")
    assert query(by_script, "SELECT to_regprocedure('widgets.decoy()')") == [(None,)]


@pytest.mark.slow
def test_ids_are_sqitchs_own(widgets: Path, new_db: Callable[[], str]) -> None:
    """read_plan's ids and hashes, the ones rendered into the script, are those Sqitch computes."""
    by_sqitch = new_db()
    run_sqitch(widgets, "deploy", by_sqitch)
    plan = read_plan(widgets)
    assert [(c.name, c.id) for c in plan.changes] == [
        (row[2], row[0]) for row in query(by_sqitch, REGISTRY_QUERIES["changes"])
    ]
    assert [(t.format_name, t.id) for c in plan.changes for t in c.tags] == [
        (row[1], row[0]) for row in query(by_sqitch, REGISTRY_QUERIES["tags"])
    ]
    assert plan.changes[2].deploy_file.name == "label@v2.sql"
    assert plan.changes[4].deploy_file.name == "label.sql"


@pytest.mark.slow
def test_default_and_given_committer(widgets: Path, new_db: Callable[[], str]) -> None:
    by_default, by_name = new_db(), new_db()
    apply_ok(by_default, render_script(widgets))
    apply_ok(by_name, render_script(widgets, committer_name="Rita Renderer", committer_email="rita@example.com"))
    user, host = query(by_default, "SELECT session_user, coalesce(host(inet_server_addr()), 'localhost')")[0]
    for dsn, who in [(by_default, (user, f"{user}@{host}")), (by_name, ("Rita Renderer", "rita@example.com"))]:
        assert set(query(dsn, "SELECT committer_name, committer_email FROM sqitch.changes")) == {who}
        assert set(query(dsn, "SELECT committer_name, committer_email FROM sqitch.events")) == {who}
        assert query(dsn, "SELECT installer_name, installer_email FROM sqitch.releases") == [who]
        assert query(dsn, "SELECT creator_name, creator_email FROM sqitch.projects") == [who]


@pytest.mark.slow
def test_repository_plan_is_what_sqitch_deploys(pg_base: str, template_db: str, new_db: Callable[[], str]) -> None:
    """The real plan, rendered and applied, against the session's database that `sqitch deploy` built."""
    by_script, by_sqitch = new_db(), dsn_for(pg_base, template_db)
    apply_ok(by_script, render_script(REPO_ROOT))

    plan = read_plan(REPO_ROOT)
    assert deployed_changes(by_script) == [change.name for change in plan.changes]
    assert "Nothing to deploy (up-to-date)" in run_sqitch(REPO_ROOT, "status", by_script)
    assert "Verify successful" in run_sqitch(REPO_ROOT, "verify", by_script)
    log = run_sqitch(REPO_ROOT, "log", by_script)
    assert re.findall(r"^Name:\s+(\S+)", log, re.MULTILINE) == [c.name for c in reversed(plan.changes)]
    assert_same(registry(by_sqitch), registry(by_script), "registry rows")
    assert_same(registry_ddl(by_sqitch), registry_ddl(by_script), "registry DDL (pg_dump --schema=sqitch)")
    assert_same(schema_snapshot(by_sqitch), schema_snapshot(by_script), "schemas")


def test_registry_ddl_is_sqitchs_file() -> None:
    found = subprocess.run(
        ["perl", "-MApp::Sqitch::Engine::pg", "-e", "print $INC{'App/Sqitch/Engine/pg.pm'}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sqitch_file = Path(found).with_name("pg.sql")
    ours = Path(__file__).resolve().parents[3] / "python" / "pginbox" / "schema" / "sqitch_registry_pg.sql"
    assert ours.read_bytes() == sqitch_file.read_bytes()


# --------------------------------------------------------------------------- (2) ranges


@pytest.mark.slow
def test_upgrade_from_a_tag_equals_a_full_sqitch_deploy(widgets: Path, new_db: Callable[[], str]) -> None:
    upgraded, by_sqitch = new_db(), new_db()
    run_sqitch(widgets, "deploy", upgraded, "--to-change", "@v1")
    assert deployed_changes(upgraded) == ["base", "items", "label"]
    output = apply_ok(upgraded, render_script(widgets, since="v1"))
    assert "Adding registry tables" not in output and "+ base" not in output
    run_sqitch(widgets, "deploy", by_sqitch)

    assert deployed_changes(upgraded) == ["base", "items", "label", "audit", "label"]
    assert "Nothing to deploy (up-to-date)" in run_sqitch(widgets, "status", upgraded)
    assert_same(registry(by_sqitch), registry(upgraded), "registry rows")
    assert_same(schema_snapshot(by_sqitch), schema_snapshot(upgraded), "schemas")


@pytest.mark.slow
def test_upgrade_logs_a_tag_planned_after_the_database_was_deployed(widgets: Path, new_db: Callable[[], str]) -> None:
    """Sqitch's deploy records the tags added to the plan after the change the database is at
    (Engine::_sync_plan -> log_new_tags); the rendered upgrade does the same."""
    by_script, by_sqitch = new_db(), new_db()
    # The project before @v1 was tagged (and label reworked): label.sql held the first version.
    (widgets / "sqitch.plan").write_text(PLAN.split("@v1 ")[0], encoding="utf-8")
    write_scripts(widgets, "deploy", {"label": DEPLOY["label@v2"]})
    for dsn in (by_script, by_sqitch):
        run_sqitch(widgets, "deploy", dsn)
    assert query(by_script, "SELECT count(*) FROM sqitch.tags") == [(0,)]

    (widgets / "sqitch.plan").write_text(PLAN, encoding="utf-8")
    write_scripts(widgets, "deploy", {"label": DEPLOY["label"]})
    apply_ok(by_script, render_script(widgets, since="v1"))
    run_sqitch(widgets, "deploy", by_sqitch)
    assert [row[1] for row in registry(by_script)["tags"]] == ["@v1", "@v2"]
    assert_same(registry(by_sqitch), registry(by_script), "registry rows")


@pytest.mark.slow
def test_to_and_since_stop_where_sqitch_stops(widgets: Path, new_db: Callable[[], str]) -> None:
    by_script, by_sqitch = new_db(), new_db()
    apply_ok(by_script, render_script(widgets, to="@v1"))
    run_sqitch(widgets, "deploy", by_sqitch, "--to-change", "@v1")
    assert deployed_changes(by_script) == ["base", "items", "label"]
    assert_same(registry(by_sqitch), registry(by_script), "registry rows at @v1")

    apply_ok(by_script, render_script(widgets, since="v1", to="v2"))
    run_sqitch(widgets, "deploy", by_sqitch, "--to-change", "@v2")
    assert deployed_changes(by_script) == ["base", "items", "label", "audit"]
    assert_same(registry(by_sqitch), registry(by_script), "registry rows at @v2")
    assert_same(schema_snapshot(by_sqitch), schema_snapshot(by_script), "schemas at @v2")


@pytest.mark.slow
def test_running_the_script_again_deploys_nothing(widgets: Path, new_db: Callable[[], str]) -> None:
    dsn = new_db()
    script = render_script(widgets)
    apply_ok(dsn, script)
    before = registry(dsn)
    output = apply_ok(dsn, script)
    assert "+ " not in output and output.count("(already deployed)") == CHANGE_COUNT
    assert registry(dsn) == before


@pytest.mark.slow
def test_a_database_in_another_state_is_refused_before_anything_runs(widgets: Path, new_db: Callable[[], str]) -> None:
    fresh = new_db()
    result = apply_script(fresh, render_script(widgets, since="v1"))
    assert result.returncode != 0
    assert "this database has no change of project widgets" in result.stderr
    assert query(fresh, "SELECT to_regnamespace('widgets')") == [(None,)]

    at_v2 = new_db()
    run_sqitch(widgets, "deploy", at_v2, "--to-change", "@v2")
    result = apply_script(at_v2, render_script(widgets, to="v1"))
    assert result.returncode != 0
    assert "this database is at change audit" in result.stderr
    assert deployed_changes(at_v2) == ["base", "items", "label", "audit"]


@pytest.mark.slow
def test_project_dependencies_resolve_in_the_database(tmp_path: Path, new_db: Callable[[], str]) -> None:
    ext = make_ext(tmp_path)
    widgets = make_widgets(tmp_path, PLAN.replace("items [base !ext:legacy]", "items [base ext:ext_base !ext:legacy]"))
    by_script, by_sqitch, without_ext = new_db(), new_db(), new_db()
    for dsn in (by_script, by_sqitch):
        run_sqitch(ext, "deploy", dsn)
    apply_ok(by_script, render_script(widgets))
    run_sqitch(widgets, "deploy", by_sqitch)
    ext_id = query(by_sqitch, "SELECT change_id FROM sqitch.changes WHERE project = 'ext'")[0][0]
    assert ("require", "ext:ext_base", ext_id) in [row[1:] for row in registry(by_script)["dependencies"]]
    assert_same(registry(by_sqitch), registry(by_script), "registry rows")

    result = apply_script(without_ext, render_script(widgets))
    assert result.returncode != 0
    assert "missing required changes: items requires ext:ext_base" in result.stderr
    assert query(without_ext, "SELECT to_regnamespace('widgets')") == [(None,)]


# --------------------------------------------------------------------------- (3) Sqitch takes over


@pytest.mark.slow
def test_sqitch_takes_over_after_the_script(widgets: Path, new_db: Callable[[], str]) -> None:
    dsn = new_db()
    apply_ok(dsn, render_script(widgets, committer_name="Rita Renderer", committer_email="rita@example.com"))

    with (widgets / "sqitch.plan").open("a") as plan:
        plan.write(f"gadgets [items] 2024-02-01T00:00:00Z {PLANNER} # Gadgets\n")
    write_scripts(widgets, "deploy", {"gadgets": "BEGIN;\nCREATE TABLE widgets.gadgets (id int);\nCOMMIT;\n"})
    write_scripts(widgets, "revert", {"gadgets": "BEGIN;\nDROP TABLE widgets.gadgets;\nCOMMIT;\n"})
    write_scripts(widgets, "verify", {"gadgets": "SELECT id FROM widgets.gadgets WHERE false;\n"})

    output = run_sqitch(widgets, "deploy", dsn)
    assert re.findall(r"^\s+\+ (\S+)", output, re.MULTILINE) == ["gadgets"]
    assert deployed_changes(dsn) == ["base", "items", "label", "audit", "label", "gadgets"]
    assert query(dsn, "SELECT to_regclass('widgets.gadgets') IS NOT NULL") == [(True,)]

    output = run_sqitch(widgets, "revert", dsn, "-y", "--to-change", "@HEAD^")
    assert re.findall(r"^\s+- (\S+)", output, re.MULTILINE) == ["gadgets"]
    assert query(dsn, "SELECT to_regclass('widgets.gadgets')") == [(None,)]

    # The changes the script recorded revert too, the reworked one with its @v2 revert script.
    output = run_sqitch(widgets, "revert", dsn, "-y")
    assert re.findall(r"^\s+- (\S+)", output, re.MULTILINE) == ["label", "audit", "label", "items", "base"]
    assert query(dsn, "SELECT to_regnamespace('widgets')") == [(None,)]
    assert deployed_changes(dsn) == []


# --------------------------------------------------------------------------- (4) errors


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param({"to": "v9"}, r'unknown tag "v9" in .*sqitch\.plan \(tags in the plan: @v1, @v2\)', id="to"),
        pytest.param({"since": "@nope"}, r'unknown tag "@nope"', id="since"),
        pytest.param({"since": "v2", "to": "v1"}, r"since @v2 \(change audit\) is not before to @v1", id="after"),
        pytest.param({"since": "v1", "to": "v1"}, r"since @v1 \(change label\) is not before to @v1", id="same"),
    ],
)
def test_bad_range_is_refused(widgets: Path, arguments: dict[str, str], message: str) -> None:
    with pytest.raises(SqitchScriptError, match=message):
        render_script(widgets, **arguments)


def test_unknown_tag_of_the_repository_plan_names_the_known_ones() -> None:
    with pytest.raises(SqitchScriptError, match=r'unknown tag "v1" .*\(tags in the plan: @v0\.1\.0.*\)'):
        render_script(REPO_ROOT, to="v1")


@pytest.mark.parametrize("missing", ["items", "label@v2"])
def test_missing_deploy_script_is_refused(widgets: Path, missing: str) -> None:
    (widgets / "deploy" / f"{missing}.sql").unlink()
    if missing == "label@v2":
        (widgets / "deploy" / "label@v1.sql").unlink()  # without the decoy, no file is left
    change = missing.split("@")[0]
    with pytest.raises(SqitchScriptError, match=rf'deploy script of change "{change}" .* is missing: .*{missing}\.sql'):
        render_script(widgets)


def test_reworked_change_falls_back_to_an_older_tag_file(widgets: Path) -> None:
    """Sqitch takes the first rework-tag file that exists: without label@v2.sql, label@v1.sql."""
    (widgets / "deploy" / "label@v2.sql").unlink()
    assert "widgets.decoy()" in render_script(widgets)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        pytest.param(PLAN.replace("%project=widgets\n", ""), r"Missing %project pragma", id="no-project"),
        pytest.param(
            PLAN.replace("2024-01-03T09:00:00Z ", ""), r"sqitch\.plan at line 11: Missing timestamp$", id="no-timestamp"
        ),
        pytest.param(PLAN.replace("2024-01-03T09", "2024-13-03T09"), r"at line 11: invalid timestamp", id="bad-date"),
        pytest.param(
            PLAN.replace("audit [items]", "audit [it:em:s]"), r'"it:em:s" is not a valid dependency', id="dep"
        ),
        pytest.param(
            PLAN.replace("[widgets:items]", "[audit]"),
            r'"label" requires "audit", which is not planned before',
            id="order",
        ),
        pytest.param(
            PLAN.replace("@v2 2024", "@v1 2024"),
            r'at line 12: Tag "v1" duplicates earlier declaration on line 9',
            id="dup-tag",
        ),
        pytest.param(PLAN.replace("\n\n# Changes", "\n# Changes"), r"Invalid pragma", id="no-blank-line"),
        pytest.param(
            PLAN + "label 2024-02-01T00:00:00Z A <a@b>\n", r'Change "label" duplicates earlier', id="dup-change"
        ),
    ],
)
def test_unparsable_plan_is_refused(widgets: Path, plan: str, message: str) -> None:
    (widgets / "sqitch.plan").write_text(plan, encoding="utf-8")
    with pytest.raises(SqitchScriptError, match=message):
        render_script(widgets)


@pytest.mark.parametrize(
    "uri",
    [
        "https://Example.COM:443/widgets",
        "HTTP://x.example:80",
        "http://x.example:8080?q=1",
        "https://user@Host.example/a%7eb%2fc",
        "https://github.com/sqitchers/sqitch-intro/",
        "git://Host.COM/x",
        "urnish:Foo:%41",
        "widgets",
    ],
)
def test_canonical_uri_is_perls(uri: str) -> None:
    perl = subprocess.run(
        ["perl", "-MURI", "-e", "print URI->new($ARGV[0])->canonical", uri],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert canonical_uri(uri) == perl


def test_uri_schemes_with_rules_of_their_own_are_refused() -> None:
    with pytest.raises(SqitchScriptError, match="the urn: scheme is not supported"):
        canonical_uri("urn:Foo:Bar")


def test_script_header_says_what_and_how(widgets: Path) -> None:
    script = render_script(widgets, since="v1")
    header = script.split("\n\n", 1)[0]
    assert header.startswith("-- Sqitch project widgets, rendered as one psql script")
    assert f"Plan:  {widgets / 'sqitch.plan'}" in header
    assert "from the changes after @v1 (label) through the end of the plan: 2 change(s)" in header
    assert "psql -X -v ON_ERROR_STOP=1 -d DATABASE -f THIS_FILE" in header
    assert textwrap.dedent(header) == header and all(line.startswith("--") for line in header.splitlines())
