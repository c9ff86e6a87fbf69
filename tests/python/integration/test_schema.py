"""The deployable history (Sqitch) and the readable source (sql/) describe the same schema,
revert really takes everything away, and verify really checks.

(a) sql/*.sql run in name order with psql builds what `sqitch deploy` builds: same pg_dump of
    schema inbox (owners and ACLs included), same inbox_* roles and memberships, same default
    privileges, same extensions. Each side gets a cluster of its own: roles are cluster-wide.
(b) `sqitch revert` leaves the database as it was before deploy (no schema inbox, nothing that
    depends on an inbox_* role) and a second deploy works.
(c) `sqitch verify` fails when any function, table or view of schema inbox is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import (
    PRIVATE_DB,
    REPO_ROOT,
    create_database,
    drop_database,
    dsn_for,
    make_cluster,
    sqitch_project,
)
from helpers_schema import (
    assert_same_lines,
    build_from_sql_sources,
    plan_changes,
    plan_targets,
    psql_file,
    query,
    schema_dump,
)
from psycopg import sql
from psycopg.types.json import Jsonb

from pginbox.devtools.cluster import Cluster
from pginbox.schema import sqitch

# Schemas that are not the package's: PostgreSQL's own and Sqitch's registry.
FOREIGN_SCHEMAS = ("pg_catalog", "information_schema", "pg_toast", "sqitch")


ROLES_QUERY = """
SELECT rolname, rolsuper, rolinherit, rolcreaterole, rolcreatedb, rolcanlogin,
       rolreplication, rolbypassrls, rolconnlimit, rolvaliduntil, rolconfig
FROM pg_catalog.pg_roles
WHERE rolname LIKE 'inbox\\_%'
ORDER BY rolname
"""

MEMBERSHIPS_QUERY = """
SELECT r.rolname AS role, m.rolname AS member, am.admin_option
FROM pg_catalog.pg_auth_members am
JOIN pg_catalog.pg_roles r ON r.oid = am.roleid
JOIN pg_catalog.pg_roles m ON m.oid = am.member
WHERE r.rolname LIKE 'inbox\\_%' OR m.rolname LIKE 'inbox\\_%'
ORDER BY 1, 2
"""

DEFAULT_ACL_QUERY = """
SELECT pg_catalog.pg_get_userbyid(d.defaclrole), n.nspname, d.defaclobjtype,
       d.defaclacl::text
FROM pg_catalog.pg_default_acl d
LEFT JOIN pg_catalog.pg_namespace n ON n.oid = d.defaclnamespace
ORDER BY 1, 2, 3
"""

EXTENSIONS_QUERY = """
SELECT e.extname, n.nspname
FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
ORDER BY 1
"""

DATABASE_SETTINGS_QUERY = """
SELECT d.datacl::text,
       (SELECT array_agg(s.setconfig::text ORDER BY s.setrole)
        FROM pg_catalog.pg_db_role_setting s WHERE s.setdatabase = d.oid)
FROM pg_catalog.pg_database d
WHERE d.datname = current_database()
"""

# Every object of this database outside PostgreSQL's and Sqitch's schemas, plus everything
# that depends on an inbox_* role (ownership, privileges, default privileges, policies).
OBJECTS_QUERY = """
SELECT 'schema', n.nspname, pg_catalog.pg_get_userbyid(n.nspowner) || ' ' ||
       coalesce(n.nspacl::text, '')
FROM pg_catalog.pg_namespace n
WHERE n.nspname <> ALL (%(foreign)s) AND n.nspname NOT LIKE 'pg\\_temp\\_%%'
  AND n.nspname NOT LIKE 'pg\\_toast\\_temp\\_%%'
UNION ALL
SELECT 'relation', c.oid::regclass::text, c.relkind::text
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname <> ALL (%(foreign)s)
UNION ALL
SELECT 'routine', p.oid::regprocedure::text, ''
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname <> ALL (%(foreign)s)
UNION ALL
SELECT 'type', t.oid::regtype::text, ''
FROM pg_catalog.pg_type t JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace
WHERE n.nspname <> ALL (%(foreign)s)
UNION ALL
SELECT 'extension', e.extname, ''
FROM pg_catalog.pg_extension e
UNION ALL
SELECT 'event trigger', evtname, ''
FROM pg_catalog.pg_event_trigger
UNION ALL
SELECT 'default acl', pg_catalog.pg_get_userbyid(defaclrole), defaclacl::text
FROM pg_catalog.pg_default_acl
UNION ALL
SELECT 'depends on role ' || r.rolname,
       coalesce(pg_catalog.pg_describe_object(s.classid, s.objid, s.objsubid), '?'),
       s.deptype::text
FROM pg_catalog.pg_shdepend s
JOIN pg_catalog.pg_roles r ON r.oid = s.refobjid AND s.refclassid = 'pg_catalog.pg_authid'::regclass
JOIN pg_catalog.pg_database d ON d.oid = s.dbid AND d.datname = current_database()
WHERE r.rolname LIKE 'inbox\\_%%'
ORDER BY 1, 2, 3
"""


def database_objects(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        return connection.execute(OBJECTS_QUERY, {"foreign": list(FOREIGN_SCHEMAS)}).fetchall()


# --------------------------------------------------------------------------- (a)


@pytest.fixture(scope="module")
def built_both_ways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(dsn built by sqitch deploy, dsn built from sql/*.sql), each on a cluster of its own."""
    clusters: list[Cluster] = []
    try:
        by_sqitch = make_cluster(tmp_path_factory.mktemp("by_sqitch"))
        clusters.append(by_sqitch)
        by_sql = make_cluster(tmp_path_factory.mktemp("by_sql"))
        clusters.append(by_sql)
        for cluster in clusters:
            cluster.create_database(PRIVATE_DB)
        sqitch.deploy(by_sqitch.dsn(PRIVATE_DB), project=sqitch_project())
        build_from_sql_sources(by_sql.dsn(PRIVATE_DB))
        yield by_sqitch.dsn(PRIVATE_DB), by_sql.dsn(PRIVATE_DB)
    finally:
        for cluster in clusters:
            cluster.destroy()


@pytest.mark.slow
def test_sql_sources_and_sqitch_build_the_same_schema(built_both_ways: tuple[str, str]) -> None:
    by_sqitch, by_sql = built_both_ways
    dump = schema_dump(by_sqitch)
    assert any("CREATE SCHEMA inbox" in line for line in dump), "schema inbox not deployed"
    assert_same_lines(dump, schema_dump(by_sql), "pg_dump --schema=inbox outputs")


@pytest.mark.parametrize(
    "statement",
    [
        pytest.param(ROLES_QUERY, id="roles"),
        pytest.param(MEMBERSHIPS_QUERY, id="memberships"),
        pytest.param(DEFAULT_ACL_QUERY, id="default-privileges"),
        pytest.param(EXTENSIONS_QUERY, id="extensions"),
        pytest.param(DATABASE_SETTINGS_QUERY, id="database-acl-and-settings"),
    ],
)
@pytest.mark.slow
def test_sql_sources_and_sqitch_build_the_same_globals(built_both_ways: tuple[str, str], statement: str) -> None:
    by_sqitch, by_sql = built_both_ways
    expected = [repr(row) for row in query(by_sqitch, statement)]
    actual = [repr(row) for row in query(by_sql, statement)]
    assert_same_lines(expected, actual, "catalog rows")


@pytest.mark.slow
def test_sqitch_creates_the_inbox_roles(built_both_ways: tuple[str, str]) -> None:
    by_sqitch, _ = built_both_ways
    roles = {row[0]: row for row in query(by_sqitch, ROLES_QUERY)}
    assert set(roles) >= {"inbox_owner", "inbox_consumer", "inbox_operator", "inbox_reader"}
    for name, row in roles.items():
        assert row[5] is False, f"{name} must be NOLOGIN"
        assert row[1] is False, f"{name} must not be a superuser"


# --------------------------------------------------------------------------- (b)


@pytest.mark.slow
def test_revert_leaves_nothing_behind_and_deploy_works_again(pg_base: str, template_db: str, db_dsn: str) -> None:
    empty = "t_empty_baseline"
    drop_database(pg_base, empty)
    create_database(pg_base, empty)
    try:
        baseline = database_objects(dsn_for(pg_base, empty))
    finally:
        drop_database(pg_base, empty)
    deployed_dump = schema_dump(db_dsn)

    sqitch.revert(db_dsn, project=sqitch_project())
    leftovers = [row for row in database_objects(db_dsn) if row not in baseline]
    missing = [row for row in baseline if row not in database_objects(db_dsn)]
    assert not leftovers, f"left behind by sqitch revert: {leftovers}"
    assert not missing, f"removed by deploy+revert although it was there before: {missing}"
    assert query(db_dsn, "SELECT to_regnamespace('inbox')") == [(None,)]

    sqitch.deploy(db_dsn, project=sqitch_project())
    sqitch.verify(db_dsn, project=sqitch_project())
    assert_same_lines(deployed_dump, schema_dump(db_dsn), "schema after deploy, revert, deploy")


# --------------------------------------------------------------------------- (c)

PACKAGE_OBJECTS_QUERY = """
SELECT 'routine', n.nspname, p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid),
       p.oid::regprocedure::text
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'inbox'
UNION ALL
SELECT CASE c.relkind WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view' ELSE 'table' END,
       n.nspname, c.relname, '', c.oid::regclass::text
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'inbox' AND c.relkind IN ('r', 'p', 'v', 'm')
ORDER BY 1, 5
"""


def drop_statement(kind: str, schema: str, name: str, arguments: str, cascade: bool) -> sql.Composed:
    target: sql.Composable
    if kind == "routine":
        # The argument list comes from pg_get_function_identity_arguments: PostgreSQL's own
        # quoting of a catalog entry, not outside input.
        target = sql.SQL("ROUTINE {}({})").format(sql.Identifier(schema, name), sql.SQL(arguments))
    else:
        keyword = {"table": "TABLE", "view": "VIEW", "materialized view": "MATERIALIZED VIEW"}
        target = sql.SQL("{} {}").format(sql.SQL(keyword[kind]), sql.Identifier(schema, name))
    return sql.SQL("DROP {}{}").format(target, sql.SQL(" CASCADE" if cascade else ""))


def test_sqitch_verify_passes_on_a_fresh_deploy(db_dsn: str) -> None:
    sqitch.verify(db_dsn, project=sqitch_project())


def verify_bodies() -> list[tuple[str, str]]:
    """(change, statements) of the current verify script of every change (a reworked change once),
    without its BEGIN; / ROLLBACK; lines, so that they can run inside a transaction of the test's own."""
    bodies = []
    for change in dict.fromkeys(plan_changes()):
        lines = (REPO_ROOT / "verify" / f"{change}.sql").read_text().splitlines()
        assert lines.count("BEGIN;") == 1 and lines.count("ROLLBACK;") == 1, f"verify/{change}.sql: unexpected shape"
        bodies.append((change, "\n".join(x for x in lines if x not in ("BEGIN;", "ROLLBACK;"))))
    return bodies


def run_verify_bodies(connection: psycopg.Connection[Any], bodies: list[tuple[str, str]]) -> str | None:
    """Runs the verify statements in the current transaction; the first change that fails, or None."""
    for change, body in bodies:
        try:
            connection.execute(body)
        except psycopg.Error:
            return change
    return None


@pytest.mark.slow
def test_verify_scripts_fail_when_any_package_object_is_missing(db_dsn: str) -> None:
    """Every object of schema inbox is dropped in turn (in a transaction rolled back afterwards) and
    the verify scripts must notice. Running the scripts' statements directly keeps this to seconds;
    the next test shows that `sqitch verify` runs those same scripts and fails with them."""
    objects = query(db_dsn, PACKAGE_OBJECTS_QUERY)
    assert any(row[0] == "routine" for row in objects), "no functions in schema inbox"
    bodies = verify_bodies()
    unnoticed: list[str] = []
    with psycopg.connect(db_dsn, autocommit=True) as connection:
        connection.execute("BEGIN")
        assert run_verify_bodies(connection, bodies) is None, "the verify scripts fail on an intact deploy"
        connection.execute("ROLLBACK")
        for kind, schema, name, arguments, label in objects:
            connection.execute("BEGIN")
            try:
                connection.execute("SAVEPOINT before_drop")
                try:
                    connection.execute(drop_statement(kind, schema, name, arguments, False))
                    how = ""
                except psycopg.errors.DependentObjectsStillExist:
                    connection.execute("ROLLBACK TO SAVEPOINT before_drop")
                    connection.execute(drop_statement(kind, schema, name, arguments, True))
                    how = " (dropped with CASCADE)"
                if run_verify_bodies(connection, bodies) is None:
                    unnoticed.append(f"{kind} {label}{how}")
            finally:
                connection.execute("ROLLBACK")
    assert not unnoticed, "the verify scripts pass although these are missing:\n  " + "\n  ".join(unnoticed)


@pytest.mark.parametrize(
    "kind,name,arguments",
    [("routine", "schema_version", ""), ("table", "handler_registration", "")],
)
def test_sqitch_verify_fails_when_an_object_is_missing(
    pg_base: str, template_db: str, kind: str, name: str, arguments: str
) -> None:
    clone = "t_verify_probe"
    drop_database(pg_base, clone)
    create_database(pg_base, clone, template=template_db)
    dsn = dsn_for(pg_base, clone)
    try:
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(drop_statement(kind, "inbox", name, arguments, True))
        with pytest.raises(sqitch.SqitchError):
            sqitch.verify(dsn, project=sqitch_project())
    finally:
        drop_database(pg_base, clone)


SMOKE = """
CREATE TABLE IF NOT EXISTS public.smoke (n integer NOT NULL);
CREATE OR REPLACE FUNCTION public.smoke_handler(p jsonb) RETURNS void LANGUAGE sql
    AS $$ INSERT INTO public.smoke VALUES ((p ->> 'n')::integer) $$;
SELECT inbox.register_handler('smoke', 'm', 'public.smoke_handler(jsonb)', 'v1');
"""


def smoke_claims(conn: psycopg.Connection[Any], step: int) -> None:
    """Both claim paths on what the schema is now: a claim and its duplicate, an applied message and
    its duplicate, the handler's row written once (`step` keeps each call's identities its own)."""
    conn.execute(SMOKE)
    claimed, applied = f"a-{step}", f"b-{step}"
    outcomes = [
        conn.execute(
            "SELECT outcome FROM inbox.claim('smoke', 'p', %s, '{\"n\": 1}', produced_at => now())", (claimed,)
        ).fetchone()
        for _ in range(2)
    ] + [
        conn.execute(
            "SELECT outcome FROM inbox.claim_and_apply('smoke', 'p', %s, 'm', %s, '', now())",
            (applied, Jsonb({"n": step})),
        ).fetchone()
        for _ in range(2)
    ]
    assert outcomes == [("claimed",), ("duplicate",), ("applied",), ("duplicate",)], step
    assert conn.execute("SELECT count(*) FROM public.smoke WHERE n = %s", (step,)).fetchone() == (1,)


@pytest.mark.slow
def test_reverting_the_later_changes_leaves_working_claims(db_dsn: str) -> None:
    """`sqitch revert --to X` for every X from `apply` on, latest first, one change at a time (the
    state `revert --to X` leaves is the same, and each revert here runs over the rows the earlier
    steps wrote): the claim paths of what is left must still work (later modules hook into them;
    their reverts must put the hooks back), and deploying again restores everything."""
    targets = plan_targets()[plan_targets().index("apply@v0.1.0") : -1]
    for step, to_change in enumerate(reversed(targets), start=1):
        # `@HEAD^`: one change back (a name like replay@v0.2.0 only resolves while its tag is deployed)
        sqitch.revert(db_dsn, to_change="@HEAD^", project=sqitch_project())
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            head = conn.execute(
                "SELECT change FROM sqitch.changes WHERE project = 'pginbox' ORDER BY committed_at DESC LIMIT 1"
            ).fetchone()
            assert head is not None and head[0] == to_change.split("@")[0], (step, to_change, head)
            smoke_claims(conn, step)
    sqitch.deploy(db_dsn, project=sqitch_project())
    sqitch.verify(db_dsn, project=sqitch_project())
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        smoke_claims(conn, len(targets) + 1)


# --------------------------------------------------------------------------- (d)

# Changes that only create tables, types and indexes (changed later by new ALTER changes), or that
# must never run twice (the no-op hooks would replace retention's and metrics' real ones).
NOT_REWORKABLE = ("roles", "schema", "hooks")
# reader_grants runs again without error, but its REVOKE and column lists are those of 0.2.0: run
# over a later change that granted readers a new column (100_outbox_tenant_tables.sql,
# 101_retention_watermark_tables.sql), it would take that grant away. A table's grants change with
# the table, in a new change; this one is never reworked.
GRANTS_AT_THEIR_RELEASE = ("reader_grants",)


def reworkable_changes() -> list[str]:
    return [
        c for c in plan_changes() if c not in NOT_REWORKABLE + GRANTS_AT_THEIR_RELEASE and not c.endswith("_tables")
    ]


def test_functions_changes_deploy_again_over_themselves(db_dsn: str) -> None:
    """`sqitch rework` deploys a change's new script over the old one: every functions change must be
    rerunnable (CREATE OR REPLACE, DROP ... IF EXISTS) and leave the schema as it was, hooks included."""
    before = schema_dump(db_dsn)
    changes = reworkable_changes()
    assert {"claim", "apply", "outbox", "retention", "metrics", "version"} <= set(changes)
    for change in changes:
        result = psql_file(db_dsn, REPO_ROOT / "deploy" / f"{change}.sql")
        assert result.returncode == 0, f"deploy/{change}.sql cannot run again:\n{result.stderr}"
    assert_same_lines(before, schema_dump(db_dsn), "schema after deploying every functions change again")


@pytest.mark.parametrize("change", [c for c in NOT_REWORKABLE if c != "roles"] + ["outbox_tables"])
def test_tables_and_hooks_changes_refuse_to_run_twice(db_dsn: str, change: str) -> None:
    """A tables change (or the hooks) run again fails instead of silently replacing what is there."""
    result = psql_file(db_dsn, REPO_ROOT / "deploy" / f"{change}.sql")
    assert result.returncode != 0 and "already exists" in result.stderr
