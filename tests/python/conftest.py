"""Fixtures and tiers.

Tiers: a test's folder gives it its marker (pytest_collection_modifyitems): unit/ (no database:
must not take pg_base, template_db, db_dsn, conn ...), integration/ (PostgreSQL only), e2e/
(brokers, chains, crashes, failover, private clusters, PgBouncer, other languages). Select with
`-m unit`, `-m "not e2e"` ...; docs/development.md.

Under pytest-xdist each worker has its own template database (its name carries the worker id), so
workers never share a database; roles are cluster-wide, so tests name theirs uniquely (or share an
xdist_group when a name is fixed by the docs).

pg_base          (session)  conninfo without dbname: $PGINBOX_TEST_DSN_BASE (tests/run sets it),
                            else a private cluster started for this session.
template_db      (session)  name of a database deployed once per session (per xdist worker) with
                            `sqitch deploy`.
db_dsn           (function) conninfo of a fresh clone of template_db, dropped afterwards.
conn             (function) autocommit connection to db_dsn.
private_cluster  (function) a cluster of its own (schema deployed in database `pginbox`) that a
                            test may crash with `stop("immediate")`; removed afterwards.
login_role       (function) factory: login_role("inbox_consumer") creates a LOGIN role granted only
                            that group role and returns its conninfo to db_dsn; dropped afterwards.
make_cluster(path)          helper: a started private cluster under `path`.
dsn_for(base, dbname)       helper: conninfo for `dbname`.
pgbouncer        (session)  a PgBouncer in transaction mode in front of pg_base (helpers_pgbouncer);
                            `pgbouncer.route(db_dsn)` is db_dsn through it.
route            (function) parametrized "direct" / "pgbouncer" (marker `pgbouncer`): a function
                            that routes a conninfo the chosen way; tests that take it run twice.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers_pgbouncer import PgBouncer
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pginbox.devtools.cluster import Cluster
from pginbox.schema import sqitch

REPO_ROOT = Path(__file__).resolve().parents[2]
TIERS = ("unit", "integration", "e2e")
# "gw0", "gw1" ... under pytest-xdist; "main" when run without -n.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
TEMPLATE_DB = f"pginbox_test_template_{WORKER}"
PRIVATE_DB = "pginbox"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, the name of the folder below tests/python it lives in."""
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        try:
            tier = item.path.resolve().relative_to(tests_dir).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    # The longest first, so that pytest-xdist's workers do not end on a long test that started
    # last: the tests marked slow, then e2e, integration and unit (the order within stays).
    rank = {"e2e": 0, "integration": 1, "unit": 2}
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            min((rank[t] for t in TIERS if item.get_closest_marker(t)), default=1),
        )
    )


def sqitch_project() -> Path | None:
    """The checkout these tests belong to (None: let pginbox.sqitch find it)."""
    if os.environ.get("PGINBOX_SQITCH_DIR"):
        return None
    return REPO_ROOT if (REPO_ROOT / "sqitch.plan").is_file() else None


def dsn_for(base: str, dbname: str) -> str:
    """`base` conninfo (without dbname) completed with `dbname`."""
    params = {k: v for k, v in conninfo_to_dict(base).items() if v is not None}
    params["dbname"] = dbname
    return make_conninfo("", **params)


def _let_postgres_in(path: Path) -> None:
    """As root, the server runs as the postgres OS user: it must be able to traverse the
    temporary directories (pytest makes them 0700). Only directories below the system
    temporary directory are touched."""
    if os.geteuid() != 0:
        return
    tmp_root = Path(tempfile.gettempdir()).resolve()
    for directory in [path, *path.parents]:
        if directory == tmp_root or tmp_root not in directory.parents:
            break
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            directory.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


_CLUSTER_DIRS: list[str] = []


@atexit.register
def _remove_cluster_dirs() -> None:
    for directory in _CLUSTER_DIRS:
        shutil.rmtree(directory, ignore_errors=True)


def make_cluster(path: Path) -> Cluster:
    """A started private cluster; `path`/cluster links to its data directory. As root the data
    directory lives in a directory of its own right under the system temporary directory: the
    server runs as the postgres OS user, and another pytest session on the machine resets the
    modes of pytest's own temporary tree (/tmp/pytest-of-root) to 0700 at any moment (the
    server then cannot even open its data directory)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        home = tempfile.mkdtemp(prefix="pginbox-test-cluster-")
        os.chmod(home, 0o755)
        _CLUSTER_DIRS.append(home)
        (path / "cluster").symlink_to(Path(home) / "cluster")
        cluster = Cluster(Path(home) / "cluster")
    else:
        cluster = Cluster(path / "cluster")
    cluster.start()
    return cluster


def create_database(base: str, name: str, template: str | None = None) -> None:
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
    with psycopg.connect(dsn_for(base, "postgres"), autocommit=True) as admin:
        admin.execute(query)


def drop_database(base: str, name: str) -> None:
    with psycopg.connect(dsn_for(base, "postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def throw_away(base: str) -> None:
    """No fsync for a cluster nobody crashes and nobody keeps (pg_base's own; tests/run does the
    same): creating and dropping a database per test, and every sqitch deploy, cost about half as
    much. synchronous_commit stays on (inbox.wait_durable reads it)."""
    with psycopg.connect(dsn_for(base, "postgres"), autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET fsync = off")
        admin.execute("ALTER SYSTEM SET full_page_writes = off")
        admin.execute("SELECT pg_catalog.pg_reload_conf()")


@pytest.fixture(scope="session")
def pg_base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = os.environ.get("PGINBOX_TEST_DSN_BASE")
    if base:
        yield base
        return
    cluster = make_cluster(tmp_path_factory.mktemp("pg_base"))
    try:
        throw_away(cluster.dsn_base())
        yield cluster.dsn_base()
    finally:
        cluster.destroy()


TEMPLATE_LOCK = "SELECT pg_advisory_lock(hashtext('pginbox tests: template deploy'))"
TEMPLATE_UNLOCK = "SELECT pg_advisory_unlock(hashtext('pginbox tests: template deploy'))"


@pytest.fixture(scope="session")
def template_db(pg_base: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """The schema deployed with `sqitch deploy`, once per run. Under pytest-xdist the first worker
    deploys a template of the run (named after xdist's testrunuid) and every worker clones it into
    a template of its own (a clone takes under a second, a deploy 10 s and more). An advisory lock
    of the cluster's postgres database serializes this: concurrent deploys into one cluster would
    race on the cluster-wide roles the first change creates when missing."""
    workerinput: dict[str, Any] | None = getattr(request.config, "workerinput", None)
    run_template = f"pginbox_test_template_run_{workerinput['testrunuid'][:12]}" if workerinput else None
    with psycopg.connect(dsn_for(pg_base, "postgres"), autocommit=True) as lock:
        lock.execute(TEMPLATE_LOCK)
        try:
            drop_database(pg_base, TEMPLATE_DB)
            if run_template is None:
                deploy_database(pg_base, TEMPLATE_DB)
            else:
                exists = lock.execute("SELECT 1 FROM pg_database WHERE datname = %s", (run_template,)).fetchone()
                if exists is None:
                    deploy_database(pg_base, run_template)
                create_database(pg_base, TEMPLATE_DB, template=run_template)
        finally:
            lock.execute(TEMPLATE_UNLOCK)
    yield TEMPLATE_DB
    drop_database(pg_base, TEMPLATE_DB)
    if run_template is not None:
        # The first worker done drops it; a worker that had not cloned it yet deploys it again.
        with psycopg.connect(dsn_for(pg_base, "postgres"), autocommit=True) as lock:
            lock.execute(TEMPLATE_LOCK)
            try:
                drop_database(pg_base, run_template)
            finally:
                lock.execute(TEMPLATE_UNLOCK)


def deploy_database(pg_base: str, name: str) -> None:
    """A new database `name` with the schema deployed by `sqitch deploy` (dropped if that fails)."""
    create_database(pg_base, name)
    try:
        sqitch.deploy(dsn_for(pg_base, name), project=sqitch_project())
    except BaseException:
        drop_database(pg_base, name)
        raise


@pytest.fixture
def db_dsn(pg_base: str, template_db: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex}"
    create_database(pg_base, name, template=template_db)
    try:
        yield dsn_for(pg_base, name)
    finally:
        drop_database(pg_base, name)


@pytest.fixture(scope="session")
def pgbouncer(pg_base: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgBouncer]:
    with PgBouncer(pg_base, tmp_path_factory.mktemp("pgbouncer")) as bouncer:
        yield bouncer


@pytest.fixture(params=["direct", pytest.param("pgbouncer", marks=pytest.mark.pgbouncer)])
def route(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """How the code under test reaches the database: directly, or through PgBouncer."""
    if request.param == "direct":
        return lambda dsn: dsn
    bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
    return bouncer.route


@pytest.fixture
def conn(db_dsn: str) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    with psycopg.connect(db_dsn, autocommit=True) as connection:
        yield connection


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = make_cluster(tmp_path)
    try:
        cluster.create_database(PRIVATE_DB)
        sqitch.deploy(cluster.dsn(PRIVATE_DB), project=sqitch_project())
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def login_role(db_dsn: str) -> Iterator[Callable[..., str]]:
    """Creates LOGIN roles granted only the named group roles (as an attacker or a service would
    have them) and returns a conninfo for each; drops them, and what they own, afterwards."""
    created: list[str] = []

    def make(*groups: str) -> str:
        name = f"t_role_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(db_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
            created.append(name)
            for group in groups:
                admin.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(group), sql.Identifier(name)))
        params = {k: v for k, v in conninfo_to_dict(db_dsn).items() if v is not None}
        params["user"] = name
        return make_conninfo("", **params)

    yield make
    with psycopg.connect(db_dsn, autocommit=True) as admin:
        for name in created:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))
