"""The package deploys itself: a wheel built from python/ carries the Sqitch project, and after
`pip install` into a fresh virtualenv outside the checkout, `pginbox deploy | verify | status |
schema sql | revert` work against a real database, with no PGINBOX_SQITCH_DIR and no checkout in
sight. Also the operator commands' safe defaults (issue 9): no DSN, no demo cluster; a revert that
would throw history away is refused; status says when the schema is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import REPO_ROOT, create_database, drop_database, dsn_for

pytestmark = pytest.mark.slow


def run(argv: list[str], cwd: Path, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=600)
    if check:
        assert result.returncode == 0, f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """(the `pginbox` script of a fresh venv with the wheel installed, a clean environment)."""
    root = tmp_path_factory.mktemp("wheel")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PGINBOX_SQITCH_DIR", "VIRTUAL_ENV", "PYTHONPATH", "DATABASE_URL", "PGINBOX_DSN")
    }
    build = root / "dist"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(build), str(REPO_ROOT / "python")],
        cwd=root,
        env=env,
    )
    wheels = list(build.glob("pginbox-*.whl"))
    assert len(wheels) == 1, wheels
    venv = root / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=root, env=env)
    run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheels[0])],
        cwd=root,
        env=env,
    )
    yield venv / "bin" / "pginbox", env


@pytest.fixture
def empty_db(pg_base: str) -> Iterator[str]:
    name = f"t_wheel_{os.getpid()}"
    drop_database(pg_base, name)
    create_database(pg_base, name)
    try:
        yield dsn_for(pg_base, name)
    finally:
        drop_database(pg_base, name)


def test_the_installed_package_deploys_upgrades_and_guards_the_schema(
    installed: tuple[Path, dict[str, str]], empty_db: str, tmp_path: Path
) -> None:
    pginbox, env = installed
    elsewhere = tmp_path / "somewhere-else"
    elsewhere.mkdir()
    where = "import pginbox, pathlib; print(pathlib.Path(pginbox.__file__).parent)"
    site = run([str(pginbox.parent / "python"), "-c", where], cwd=elsewhere, env=env).stdout.strip()
    assert REPO_ROOT.as_posix() not in site, f"pginbox imported from the checkout: {site}"

    # Without a database, operator commands refuse instead of using a demo cluster.
    for argv in (["status"], ["purge"], ["deploy"]):
        refused = run([str(pginbox), *argv], cwd=elsewhere, env=env, check=False)
        assert refused.returncode != 0 and "no database given" in refused.stderr, refused

    status = run([str(pginbox), "--dsn", empty_db, "status"], cwd=elsewhere, env=env, check=False)
    assert status.returncode == 3 and "not deployed" in status.stdout

    deployed = run([str(pginbox), "--dsn", empty_db, "deploy", "--to-change", "@v0.1.0"], cwd=elsewhere, env=env)
    assert "+ version" in deployed.stdout
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT release FROM inbox.schema_release()").fetchone() == ("0.1.0",)
        conn.execute("SELECT inbox.claim('billing', 'shop', 'm-1', '{}')")
    run([str(pginbox), "--dsn", empty_db, "deploy"], cwd=elsewhere, env=env)  # the upgrade, in place
    run([str(pginbox), "--dsn", empty_db, "verify"], cwd=elsewhere, env=env)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT outcome FROM inbox.claim('billing', 'shop', 'm-1', '{}')").fetchone() == (
            "duplicate",
        )
    status = run([str(pginbox), "--dsn", empty_db, "status"], cwd=elsewhere, env=env)
    assert "release 0.3.0" in status.stdout

    # A revert that would forget the claimed identity is refused, and says what would be lost.
    refused = run([str(pginbox), "--dsn", empty_db, "revert"], cwd=elsewhere, env=env, check=False)
    assert refused.returncode == 1 and "remembers 1 identities" in refused.stderr
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM inbox.message").fetchone() == (1,)
    # Back to the release keeps the data and needs no flag.
    run([str(pginbox), "--dsn", empty_db, "revert", "--to-change", "@v0.1.0"], cwd=elsewhere, env=env)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM inbox.message").fetchone() == (1,)
    run([str(pginbox), "--dsn", empty_db, "revert", "--yes", "--discard-history"], cwd=elsewhere, env=env)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT to_regnamespace('inbox')").fetchone() == (None,)

    # The plain SQL script of the whole deploy, applied with psql, is what Sqitch deploys.
    script = run([str(pginbox), "schema", "sql"], cwd=elsewhere, env=env).stdout
    assert '"sqitch"."changes"' in script and "inbox.schema_release" in script and "version.sql" in script
    applied = subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty_db],
        input=script,
        capture_output=True,
        text=True,
        check=False,
    )
    assert applied.returncode == 0, applied.stderr
    status = run([str(pginbox), "--dsn", empty_db, "status"], cwd=elsewhere, env=env)
    assert "Nothing to deploy" in status.stdout or "up-to-date" in status.stdout, status.stdout


def test_the_installed_package_deploys_the_proxy(
    installed: tuple[Path, dict[str, str]], empty_db: str, tmp_path: Path
) -> None:
    """The routing layer ships in the wheel too (pginbox/schema/proxy_project): `deploy --proxy`
    and `verify --proxy` work from anywhere after pip install."""
    pginbox, env = installed
    elsewhere = tmp_path / "somewhere-else"
    elsewhere.mkdir()
    deployed = run([str(pginbox), "--dsn", empty_db, "deploy", "--proxy"], cwd=elsewhere, env=env)
    assert "+ proxy_operator" in deployed.stdout
    run([str(pginbox), "--dsn", empty_db, "verify", "--proxy"], cwd=elsewhere, env=env)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT inbox.partition_count()").fetchone() == (0,)
