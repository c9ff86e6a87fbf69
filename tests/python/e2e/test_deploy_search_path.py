"""Deploying into a database whose public schema anyone may write to (GRANT CREATE ON SCHEMA public
TO PUBLIC: the default before PostgreSQL 15, kept by databases upgraded or restored from such
clusters). An unprivileged login plants, in public, overloads of what the released scripts call
unqualified, each recording that it ran and as whom. The database also names public before
pg_catalog in its search_path, and so does the deployer's PGOPTIONS (or DSN options), so that plants
with the built-ins' own signatures (now(), text = text) compete too: "any schema the deployer's path
names".

Every way of running the scripts runs none of the plants, binds nothing to them, creates nothing in
pg_catalog or public, and builds what a clean build from sql/ builds: plain `sqitch` in the checkout
(sqitch.conf's client, psql-pinned), `pginbox deploy | verify | revert` (here with a project that has
no psql-pinned: the package pins by itself), `pginbox schema sql | psql` (fresh, and --since a tag),
and the test helpers' build from sql/; a fresh deploy at each release tag, the upgrade from it to
HEAD with traffic in between, verify, and a revert of everything.

The same released scripts run the old way (Sqitch's plain psql, as before this project named its
client) run every plant, as the superuser and as inbox_owner, and leave the schema bound to them:
the checks here see the attack they guard against.

Last, python/tools/sync_deploy.py's rule: a script not frozen yet pins its own search path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from conftest import REPO_ROOT, make_cluster
from helpers_schema import assert_same_lines, build_from_sql_sources, plan_entries, schema_dump
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pginbox.cli import main
from pginbox.devtools.cluster import Cluster, find_bindir
from pginbox.schema.sqitch import SEARCH_PATH_OPTION, target_from_dsn

pytestmark = pytest.mark.slow

ATTACKER = "mallory"
INBOX_ROLES = ("inbox_dispatcher", "inbox_reader", "inbox_operator", "inbox_consumer", "inbox_owner")
SYNC_DEPLOY = REPO_ROOT / "python" / "tools" / "sync_deploy.py"

# What the attacker plants, by name. Each records (plant_ran) and then does what the built-in does,
# so that a deployment that runs it succeeds and nobody notices.
PLANTS = {
    # Better matches than the built-ins (VARIADIC "any", anyarray, name) on any path that names public:
    # roles (deploy and revert): EXECUTE format('CREATE ROLE %I NOLOGIN', role_name), as the superuser.
    "format": """CREATE FUNCTION public.format(text, text) RETURNS text LANGUAGE sql
        AS $$ SELECT public.plant_ran('format'); SELECT pg_catalog.format($1, $2) $$""",
    # outbox_scope_tables, upgrading a 0.1.0 database that holds data, under SET LOCAL ROLE inbox_owner.
    "jsonb_build_object": """CREATE FUNCTION public.jsonb_build_object(text, boolean, text, boolean, text, interval)
        RETURNS jsonb LANGUAGE sql
        AS $$ SELECT public.plant_ran('jsonb_build_object');
              SELECT pg_catalog.jsonb_build_object($1, $2, $3, $4, $5, $6) $$""",
    # verify/version, verify/security: FROM unnest(ARRAY['...']), as the superuser, at every verify.
    "unnest": """CREATE FUNCTION public.unnest(text[]) RETURNS SETOF text LANGUAGE sql
        AS $$ SELECT public.plant_ran('unnest'); SELECT pg_catalog.unnest($1) $$""",
    # revert/outbox_scope_tables: convert_to(payload::text, 'UTF8') for effects without a hash, as inbox_owner.
    "convert_to": """CREATE FUNCTION public.convert_to(text, text) RETURNS bytea LANGUAGE sql
        AS $$ SELECT public.plant_ran('convert_to'); SELECT pg_catalog.convert_to($1, $2::pg_catalog.name) $$""",
    # The built-ins' own signatures: they win where the path names public before pg_catalog.
    # Column defaults (DEFAULT now()) and metrics_tables' first rollup cursor.
    "now": """CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql
        AS $$ SELECT public.plant_ran('now'); SELECT pg_catalog.now() $$""",
    # CHECK (status IN ('open', ...)), partial index predicates, WHERE clauses.
    "texteq": """CREATE FUNCTION public.plant_texteq(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE
        AS $$ SELECT public.plant_ran('texteq'); SELECT $1 OPERATOR(pg_catalog.=) $2 $$;
        CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.plant_texteq)""",
}

# The attacker's records: a table for the runs that commit, and a sequence per plant, because nextval
# is not undone by the ROLLBACK that ends every verify script.
RECORDER = """
CREATE TABLE public.plant_log (plant text NOT NULL, run_as name NOT NULL, session_as name NOT NULL,
                               superuser boolean NOT NULL);
GRANT INSERT ON public.plant_log TO PUBLIC;
{sequences}
CREATE FUNCTION public.plant_ran(plant text) RETURNS void LANGUAGE sql AS $$
    SELECT pg_catalog.nextval(('public.plant_' OPERATOR(pg_catalog.||) plant)::pg_catalog.regclass);
    INSERT INTO public.plant_log
    VALUES (plant, current_user, session_user,
            (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user));
$$;
"""


def attacker_script() -> str:
    sequences = "\n".join(
        f"CREATE SEQUENCE public.plant_{name}; GRANT USAGE ON SEQUENCE public.plant_{name} TO PUBLIC;"
        for name in PLANTS
    )
    return RECORDER.format(sequences=sequences) + ";\n".join(PLANTS.values()) + ";\n"


# ---------------------------------------------------------------------------- what the test looks at


def connect(dsn: str) -> psycopg.Connection[tuple[Any, ...]]:
    """The test's own sessions are pinned: its queries never run a plant."""
    return psycopg.connect(dsn, autocommit=True, options=SEARCH_PATH_OPTION)


def as_role(dsn: str, role: str) -> str:
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["user"] = role
    return make_conninfo("", **params)


def plants_run(dsn: str) -> dict[str, int]:
    """How many times each plant ran (rolled-back runs included)."""
    with connect(dsn) as conn:
        ran = {}
        for name in PLANTS:
            query = sql.SQL("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.{}").format(
                sql.Identifier(f"plant_{name}")
            )
            row = conn.execute(query).fetchone()
            assert row is not None
            if row[0]:
                ran[name] = int(row[0])
        return ran


def plant_log(dsn: str) -> set[tuple[str, str, bool]]:
    """(plant, the role it ran as, whether that role is a superuser) of the runs that committed."""
    with connect(dsn) as conn:
        rows = conn.execute("SELECT plant, run_as::text, superuser FROM public.plant_log").fetchall()
        return {(str(plant), str(role), bool(superuser)) for plant, role, superuser in rows}


def bound_to_plants(dsn: str) -> list[str]:
    """Objects whose definition refers to a function or operator in public (defaults, constraints,
    index predicates, views, ...), apart from the attacker's operators on their own functions."""
    with connect(dsn) as conn:
        rows = conn.execute("""
            WITH planted(classid, objid) AS (
                SELECT 'pg_proc'::regclass, p.oid FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
                UNION ALL
                SELECT 'pg_operator'::regclass, o.oid FROM pg_operator o WHERE o.oprnamespace = 'public'::regnamespace)
            SELECT pg_describe_object(d.classid, d.objid, d.objsubid) || ' -> '
                   || pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid)
              FROM pg_depend d
             WHERE (d.refclassid, d.refobjid) IN (SELECT classid, objid FROM planted)
               AND (d.classid, d.objid) NOT IN (SELECT classid, objid FROM planted)
             ORDER BY 1""").fetchall()
        return [str(row[0]) for row in rows]


def outside_inbox(dsn: str) -> set[str]:
    """Every function, operator, relation and type in pg_catalog and public: a script that creates
    something unqualified under search_path = pg_catalog, pg_temp would add it to pg_catalog."""
    with connect(dsn) as conn:
        rows = conn.execute("""
            SELECT 'function ' || p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace IN ('pg_catalog'::regnamespace, 'public'::regnamespace)
            UNION ALL SELECT 'operator ' || o.oid::regoperator FROM pg_operator o
             WHERE o.oprnamespace IN ('pg_catalog'::regnamespace, 'public'::regnamespace)
            UNION ALL SELECT 'relation ' || c.oid::regclass FROM pg_class c
             WHERE c.relnamespace IN ('pg_catalog'::regnamespace, 'public'::regnamespace)
            UNION ALL SELECT 'type ' || t.oid::regtype FROM pg_type t
             WHERE t.typnamespace IN ('pg_catalog'::regnamespace, 'public'::regnamespace)""").fetchall()
        return {str(row[0]) for row in rows}


@dataclass
class Attacked:
    dsn: str
    baseline: set[str]  # outside_inbox right after the plants went in
    clean: list[str]  # schema_dump of a clean build from sql/

    def assert_untouched(self, *, deployed: bool) -> None:
        """No plant ran or got bound, nothing appeared outside schema inbox, and (deployed) the schema
        is what a clean build makes."""
        ran = plants_run(self.dsn)
        assert not ran, f"planted objects ran: {ran}; committed runs: {sorted(plant_log(self.dsn))}"
        assert bound_to_plants(self.dsn) == []
        assert outside_inbox(self.dsn) == self.baseline
        if deployed:
            assert_same_lines(self.clean, schema_dump(self.dsn), "schema inbox", ("clean build", "attacked database"))


# ---------------------------------------------------------------------------- the site


@dataclass
class Site:
    cluster: Cluster
    clean: list[str]
    legacy_project: Path  # this project as an older checkout has it: no psql-pinned, no client in sqitch.conf
    databases: int = 0


def admin(cluster: Cluster, statement: str | sql.Composed) -> None:
    with connect(cluster.dsn()) as conn:
        conn.execute(statement)


def drop_inbox_roles(cluster: Cluster) -> None:
    """Roles are cluster-wide: each test starts without them, so the roles change creates them (and
    runs its format(...) as the superuser)."""
    admin(cluster, sql.SQL("DROP ROLE IF EXISTS {}").format(sql.SQL(", ").join(map(sql.Identifier, INBOX_ROLES))))


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    # Not under pytest's basetemp: another pytest session of the same user resets pytest-of-<user> to
    # mode 0700, and the server (the postgres OS user, when we are root) then loses its data directory.
    root = Path(tempfile.mkdtemp(prefix="pginbox-search-path-"))
    cluster = make_cluster(root)
    try:
        cluster.create_database("clean")
        build_from_sql_sources(cluster.dsn("clean"))
        clean = schema_dump(cluster.dsn("clean"))
        cluster.drop_database("clean")
        drop_inbox_roles(cluster)
        admin(cluster, sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(ATTACKER)))

        legacy = root / "legacy-project"
        legacy.mkdir()
        for name in ("sqitch.plan", "sqitch.lock"):
            shutil.copy2(REPO_ROOT / name, legacy / name)
        for name in ("deploy", "revert", "verify"):
            shutil.copytree(REPO_ROOT / name, legacy / name)
        conf = (REPO_ROOT / "sqitch.conf").read_text()
        assert '[engine "pg"]' in conf and "psql-pinned" in conf
        (legacy / "sqitch.conf").write_text(conf[: conf.index('[engine "pg"]')])
        yield Site(cluster, clean, legacy)
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def attacked(site: Site) -> Iterator[Attacked]:
    """A fresh database where PUBLIC may create in public and the path names public first, planted."""
    site.databases += 1
    name = f"attacked_{site.databases}"
    site.cluster.create_database(name)
    dsn = site.cluster.dsn(name)
    try:
        with connect(dsn) as conn:
            conn.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
            conn.execute(sql.SQL("ALTER DATABASE {} SET search_path = public, pg_catalog").format(sql.Identifier(name)))
        with connect(as_role(dsn, ATTACKER)) as conn:
            conn.execute(attacker_script())
        attacked = Attacked(dsn, outside_inbox(dsn), site.clean)
        assert plants_run(dsn) == {} and bound_to_plants(dsn) == []
        yield attacked
    finally:
        site.cluster.drop_database(name)
        drop_inbox_roles(site.cluster)


# ---------------------------------------------------------------------------- traffic and the runners


def traffic(dsn: str, n: int) -> None:
    """A claimed message and a conflicting redelivery of it (an open quarantine entry); from 0.2.0 on
    also an effect (0.2.0 stores none of their hashes, which a revert to 0.1.0 recomputes)."""
    with connect(dsn) as conn:
        conn.execute("SELECT inbox.claim('billing', 'shop', %s, '{\"v\": 2}')", (f"c-{n}",))
        conflict = conn.execute("SELECT outcome FROM inbox.claim('billing', 'shop', %s, '{\"v\": 1}')", (f"c-{n}",))
        assert conflict.fetchone() == ("conflict",)
        if conn.execute("SELECT to_regclass('inbox.destination_binding') IS NULL").fetchone() == (True,):
            conn.execute("SELECT inbox.claim('billing', 'shop', %s, '{}')", (f"m-{n}",))
            return
        if conn.execute("SELECT NOT EXISTS (SELECT FROM inbox.destination_binding)").fetchone() == (True,):
            conn.execute("SELECT inbox.bind_destination('webhook', 'billing', 'test')")
        with conn.transaction():
            conn.execute("SELECT inbox.claim('billing', 'shop', %s, '{}')", (f"m-{n}",))
            conn.execute("SELECT inbox.enqueue_effect(%s, 'webhook', %s::jsonb)", (f"e-{n}", f'{{"n": {n}}}'))


def plain_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of someone deploying by hand: no PGOPTIONS, no PGINBOX_PSQL."""
    env = {k: v for k, v in os.environ.items() if k not in ("PGOPTIONS", "PGINBOX_PSQL")}
    env.update(extra)
    return env


# A deployer whose environment asks for public first.
DEPLOYER_PGOPTIONS = "-c search_path=public,pg_catalog -c application_name=deployer"


def sqitch_in_checkout(dsn: str, command: str, *args: str, client: str | None = None) -> str:
    """`sqitch <command>` in the checkout, as a developer runs it: with the project's own client
    (psql-pinned), or `client` (the old way: `--client psql`)."""
    target = target_from_dsn(dsn)
    argv = ["sqitch", command, "--target", target.uri, *(["--client", client] if client else []), *args]
    env = plain_env({**target.env, "PGOPTIONS": DEPLOYER_PGOPTIONS})
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(argv)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def pginbox(project: Path, *args: str) -> str:
    """The `pginbox` command, with PGINBOX_SQITCH_DIR = project and no PGOPTIONS of its own."""
    env: dict[str, str | None] = {"PGINBOX_SQITCH_DIR": str(project), "PGOPTIONS": None, "PGINBOX_PSQL": None}
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 0, f"pginbox {' '.join(args)}:\n{result.output}"
    return result.stdout


def psql_script(dsn: str, script: str) -> None:
    """`... | psql -X -v ON_ERROR_STOP=1 -d DB`, by hand, in the deployer's environment."""
    result = subprocess.run(
        [str(find_bindir() / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn],
        input=script,
        env=plain_env({"PGOPTIONS": DEPLOYER_PGOPTIONS}),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def starting_points() -> list[str]:
    """Where a fresh deploy stops before the upgrade to HEAD: every release tag, and HEAD itself when
    changes came after the last tag."""
    entries = plan_entries()
    return [e for e in entries if e.startswith("@")] + ([] if entries[-1].startswith("@") else ["HEAD"])


def is_plan_end(point: str) -> bool:
    return point == "HEAD" or plan_entries()[-1] == point


def assert_reverted(attacked: Attacked) -> None:
    attacked.assert_untouched(deployed=False)
    with connect(attacked.dsn) as conn:
        assert conn.execute("SELECT to_regnamespace('inbox')").fetchone() == (None,)


# ---------------------------------------------------------------------------- the attack, the old way


def test_run_the_old_way_the_released_scripts_run_every_plant(attacked: Attacked) -> None:
    """Sqitch with its default client, plain psql (`--client psql`: what sqitch did before this project
    named psql-pinned): the deployer's path resolves the scripts' calls."""
    dsn = attacked.dsn
    first_release = starting_points()[0]
    sqitch_in_checkout(dsn, "deploy", "--to-change", first_release, client="psql")
    traffic(dsn, 1)
    sqitch_in_checkout(dsn, "deploy", client="psql")
    traffic(dsn, 2)
    bound = bound_to_plants(dsn)
    deployed = schema_dump(dsn)
    sqitch_in_checkout(dsn, "revert", "-y", client="psql")

    assert set(plants_run(dsn)) == set(PLANTS)
    committed = plant_log(dsn)
    assert ("format", "postgres", True) in committed  # the roles change, as the superuser
    assert ("jsonb_build_object", "inbox_owner", False) in committed  # the 0.1.0 -> 0.2.0 upgrade
    assert ("convert_to", "inbox_owner", False) in committed  # the revert of outbox_scope_tables
    # verify ends in ROLLBACK: its runs of unnest are counted by the sequence only
    assert plants_run(dsn)["unnest"] > 0 and "unnest" not in {plant for plant, _, _ in committed}
    # The schema was bound to the plants, which the comparison with a clean build shows.
    assert any(b.endswith("-> function public.now()") for b in bound), bound
    assert any(b.endswith("-> operator public.=(text,text)") for b in bound), bound
    assert deployed != attacked.clean
    assert any("public.now()" in line for line in deployed)


def test_an_unqualified_create_under_the_pin_lands_in_pg_catalog_and_is_caught(attacked: Attacked) -> None:
    """Why the scripts create everything schema-qualified: with search_path = pg_catalog, pg_temp a
    superuser's unqualified CREATE FUNCTION goes to pg_catalog (silently). The checks catch it."""
    psql_script(
        attacked.dsn,
        "SET search_path = pg_catalog, pg_temp;\nCREATE FUNCTION stray() RETURNS integer LANGUAGE sql AS 'SELECT 1';\n",
    )
    assert outside_inbox(attacked.dsn) - attacked.baseline == {"function stray()"}
    with pytest.raises(AssertionError):
        attacked.assert_untouched(deployed=False)


# ---------------------------------------------------------------------------- every way of deploying


@pytest.mark.parametrize("start", starting_points())
def test_sqitch_in_the_checkout_runs_no_plant(attacked: Attacked, start: str) -> None:
    """psql-pinned appends the pin to the deployer's PGOPTIONS, which ask for public first."""
    dsn = attacked.dsn
    sqitch_in_checkout(dsn, "deploy", *([] if start == "HEAD" else ["--to-change", start]))
    traffic(dsn, 1)
    sqitch_in_checkout(dsn, "deploy")
    traffic(dsn, 2)
    assert "Verify successful" in sqitch_in_checkout(dsn, "verify")
    attacked.assert_untouched(deployed=True)
    sqitch_in_checkout(dsn, "revert", "-y")
    assert_reverted(attacked)


@pytest.mark.parametrize("start", starting_points())
def test_pginbox_deploy_verify_revert_run_no_plant(site: Site, attacked: Attacked, start: str) -> None:
    """pginbox pins the path itself: the project here has no psql-pinned and names no client, and the
    deployer's DSN asks for public first (its options go into PGOPTIONS, before the pin)."""
    dsn = attacked.dsn
    deployer = make_conninfo(dsn, options=DEPLOYER_PGOPTIONS)
    project = site.legacy_project
    pginbox(project, "--dsn", deployer, "deploy", *([] if start == "HEAD" else ["--to-change", start]))
    traffic(dsn, 1)
    pginbox(project, "--dsn", deployer, "deploy")
    traffic(dsn, 2)
    assert "Verify successful" in pginbox(project, "--dsn", deployer, "verify")
    attacked.assert_untouched(deployed=True)
    # Its history check runs first (the inbox holds data, an open quarantine entry) and is pinned too.
    pginbox(project, "--dsn", deployer, "revert", "--yes", "--discard-history")
    assert_reverted(attacked)


@pytest.mark.parametrize("start", starting_points())
def test_pginbox_schema_sql_runs_no_plant(attacked: Attacked, start: str) -> None:
    """The plain SQL script pins the path itself: applied with psql and nothing else."""
    dsn = attacked.dsn
    psql_script(dsn, pginbox(REPO_ROOT, "schema", "sql", *([] if start == "HEAD" else ["--to", start])))
    traffic(dsn, 1)
    if not is_plan_end(start):
        psql_script(dsn, pginbox(REPO_ROOT, "schema", "sql", "--since", start))
        traffic(dsn, 2)
    assert "Verify successful" in sqitch_in_checkout(dsn, "verify")
    attacked.assert_untouched(deployed=True)


def test_the_build_from_sql_sources_runs_no_plant(attacked: Attacked) -> None:
    build_from_sql_sources(attacked.dsn)
    traffic(attacked.dsn, 1)
    attacked.assert_untouched(deployed=True)


# ---------------------------------------------------------------------------- sync_deploy.py's rule


def run_tool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SYNC_DEPLOY), *map(str, args)], capture_output=True, text=True, check=False
    )


def digests(project: Path) -> dict[str, str]:
    return {
        str(p.relative_to(project)): hashlib.sha256(p.read_bytes()).hexdigest()
        for kind in ("deploy", "revert", "verify")
        for p in sorted((project / kind).glob("*.sql"))
    }


PIN = "SET LOCAL search_path = pg_catalog, pg_temp;"
WIDGETS = """-- pginbox: widgets, a change added after the last release (test).
BEGIN;

SET LOCAL ROLE inbox_owner;

CREATE TABLE inbox.widget (id bigint PRIMARY KEY, made_at timestamptz NOT NULL DEFAULT now());

COMMIT;
"""


def test_sync_deploy_pins_every_unreleased_script_and_check_refuses_one_that_does_not(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    for name in ("sqitch.plan", "sqitch.conf", "sqitch.lock", "psql-pinned"):
        shutil.copy2(REPO_ROOT / name, project / name)
    for name in ("deploy", "revert", "verify", "sql"):
        shutil.copytree(REPO_ROOT / name, project / name)
    assert run_tool("--check", "--root", project).returncode == 0  # every script is frozen: nothing to pin
    released = digests(project)

    added = subprocess.run(
        ["sqitch", "add", "widgets", "--requires", "schema", "-n", "widgets"],
        cwd=project,
        env=plain_env({}),
        capture_output=True,
        text=True,
        check=False,
    )
    assert added.returncode == 0, added.stderr
    (project / "sql" / "100_widgets.sql").write_text(WIDGETS)

    # Sqitch's templates (revert, verify) pin nothing: --check names each script and the line to add.
    check = run_tool("--check", "--root", project)
    assert check.returncode == 1
    assert "deploy/widgets.sql is out of date with sql/100_widgets.sql" in check.stderr
    for script in ("revert/widgets.sql", "verify/widgets.sql"):
        assert (
            f"{script} does not pin its search_path (its `BEGIN;` is not followed by `{PIN}`): "
            f"add the line `{PIN}` right after its `BEGIN;`"
        ) in check.stderr, check.stderr

    # Without --check the tool adds the line: to the generated deploy script, and in place.
    wrote = run_tool("--root", project)
    assert wrote.returncode == 0, wrote.stderr
    assert "pinned the search_path of revert/widgets.sql" in wrote.stdout
    assert "pinned the search_path of verify/widgets.sql" in wrote.stdout
    deploy = (project / "deploy" / "widgets.sql").read_text()
    assert deploy.endswith(WIDGETS.replace("BEGIN;\n", f"BEGIN;\n{PIN}\n"))
    for kind in ("revert", "verify"):
        assert f"BEGIN;\n{PIN}\n" in (project / kind / "widgets.sql").read_text()
    assert run_tool("--check", "--root", project).returncode == 0
    assert {k: v for k, v in digests(project).items() if k in released} == released  # frozen scripts untouched

    # A source that pins itself is copied as it is: one pin, not two.
    (project / "sql" / "100_widgets.sql").write_text(WIDGETS.replace("BEGIN;\n", f"BEGIN;\n{PIN}\n"))
    assert run_tool("--root", project).returncode == 0
    assert (project / "deploy" / "widgets.sql").read_text().count("search_path") == 1

    # SET LOCAL lasts one transaction: a script that runs more gets the session form at its top.
    two = f"BEGIN;\n{PIN}\nDROP TABLE inbox.widget;\nCOMMIT;\nSELECT 1;\n"
    (project / "revert" / "widgets.sql").write_text(two)
    check = run_tool("--check", "--root", project)
    assert check.returncode == 1 and "runs more than one transaction" in check.stderr
    assert run_tool("--root", project).returncode == 0
    assert (project / "revert" / "widgets.sql").read_text() == "SET search_path = pg_catalog, pg_temp;\n" + two

    # A script that changes the path after pinning it cannot be fixed by a line: refused, either way.
    (project / "verify" / "widgets.sql").write_text(f"BEGIN;\n{PIN}\nRESET ALL;\nSELECT 1;\nROLLBACK;\n")
    for args in (("--check",), ()):
        refused = run_tool(*args, "--root", project)
        assert refused.returncode == 1
        assert (
            "verify/widgets.sql does not keep its search_path pinned "
            "(it changes the path again after pinning it: `RESET ALL`)"
        ) in refused.stderr, refused.stderr
