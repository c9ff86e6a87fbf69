"""The deployment commands of README.md ("Install and deploy") and docs/python.md ("Deploying after
`pip install`"), run as written by bash in the checkout, each against an empty database of the
test cluster: the host and database names of the blocks (`postgres@localhost/mydb`, `mydb`,
`postgres@db1/shop`, `shop`) are replaced by the test cluster's, and the block's `pip install` line
is left out (the package is installed already; test_wheel.py installs a wheel). Afterwards each
database holds the schema at the version this checkout deploys; `pginbox deploy` run again over the
database the plain script built has nothing to do (the ways are one history); the `--since v0.1.0`
line upgrades a database built to v0.1.0. Slow (about a minute: four Sqitch deployments).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import REPO_ROOT, create_database, drop_database, dsn_for
from helpers_docs import page_blocks
from psycopg.conninfo import conninfo_to_dict

from pginbox.schema.compat import KNOWN_SCHEMA_VERSION

pytestmark = pytest.mark.slow


@pytest.fixture
def empty_db(pg_base: str) -> Iterator[Callable[[], str]]:
    made: list[str] = []

    def make() -> str:
        name = f"t_doc_deploy_{uuid.uuid4().hex[:10]}"
        create_database(pg_base, name)
        made.append(name)
        return name

    yield make
    for name in made:
        drop_database(pg_base, name)


def run(script: str, pg_base: str, cwd: Path) -> str:
    params = conninfo_to_dict(pg_base)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "PGHOST": str(params.get("host") or ""),
        "PGPORT": str(params.get("port") or "5432"),
        "PGUSER": "postgres",
    }
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{script}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def schema_version(pg_base: str, name: str) -> int:
    with psycopg.connect(dsn_for(pg_base, name)) as conn:
        row = conn.execute("SELECT inbox.schema_version()").fetchone()
    assert row is not None
    return int(row[0])


def test_readme_three_ways_to_deploy(pg_base: str, empty_db: Callable[[], str]) -> None:
    (block,) = [b for b in page_blocks("README.md", "sh") if b.startswith("sqitch deploy")]
    sqitch_line, deploy_line, script_line = block.strip().split("\n")
    host = "{}:{}".format(*(conninfo_to_dict(pg_base).get(k) for k in ("host", "port")))
    databases = [empty_db() for _ in range(3)]
    lines = [
        sqitch_line.replace("postgres@localhost/mydb", f"postgres@{host}/{databases[0]}"),
        deploy_line.replace("postgres@localhost/mydb", f"postgres@{host}/{databases[1]}"),
        script_line.replace(" mydb ", f" {databases[2]} "),
    ]
    assert lines != [sqitch_line, deploy_line, script_line] and all(
        db in line for db, line in zip(databases, lines, strict=True)
    )
    for line in lines:
        run(line, pg_base, REPO_ROOT)
    assert [schema_version(pg_base, db) for db in databases] == [KNOWN_SCHEMA_VERSION] * 3
    # One history: pginbox deploy takes over from the plain script (which writes Sqitch's registry).
    again = run(deploy_line.replace("postgres@localhost/mydb", f"postgres@{host}/{databases[2]}"), pg_base, REPO_ROOT)
    assert "Nothing to deploy" in again, again


def test_python_md_deploy_after_pip_install(pg_base: str, empty_db: Callable[[], str], tmp_path: Path) -> None:
    (block,) = [b for b in page_blocks("docs/python.md", "sh") if b.startswith("pip install dist/")]
    pip, deploy, render, apply, upgrade = block.strip().split("\n")
    assert pip.startswith("pip install")
    host = "{}:{}".format(*(conninfo_to_dict(pg_base).get(k) for k in ("host", "port")))
    deployed, scripted, old = empty_db(), empty_db(), empty_db()
    run(deploy.replace("postgres@db1/shop", f"postgres@{host}/{deployed}"), pg_base, tmp_path)
    run(render, pg_base, tmp_path)
    run(apply.replace("-d shop", f"-d {scripted}"), pg_base, tmp_path)
    run(f"pginbox schema sql --to v0.1.0 | psql -X -q -v ON_ERROR_STOP=1 -d {old}", pg_base, tmp_path)
    assert schema_version(pg_base, old) == 1
    run(upgrade.replace("-d shop", f"-d {old}"), pg_base, tmp_path)
    assert [schema_version(pg_base, db) for db in (deployed, scripted, old)] == [KNOWN_SCHEMA_VERSION] * 3
