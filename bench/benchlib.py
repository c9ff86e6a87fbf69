"""What every benchmark here shares: a private, throw-away PostgreSQL cluster (fsync on) with the
SQL modules of sql/ deployed in database `bench`, stopped and removed afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from pginbox.devtools.cluster import Cluster  # noqa: E402
from pginbox.schema.sqitch import pinned_pgoptions  # noqa: E402


def deploy_sql(dsn: str, sql_dir: Path = ROOT / "sql") -> None:
    """sql_dir/*.sql deployed in name order with psql (the readable current state, built directly),
    each session pinned to search_path = pg_catalog, pg_temp like every deploy path."""
    env = {**os.environ, "PGOPTIONS": pinned_pgoptions(os.environ.get("PGOPTIONS"))}
    for module in sorted(sql_dir.glob("*.sql")):
        done = subprocess.run(
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", str(module)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode != 0:
            raise SystemExit(f"deploying {module} failed:\n{done.stderr}")


@contextmanager
def bench_database(sql_dir: Path = ROOT / "sql", prefix: str = "pginbox-bench-") -> Iterator[tuple[Cluster, str]]:
    """Yield (cluster, dsn of database `bench`) with sql_dir/*.sql deployed in name order."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        Path(tmp).chmod(0o755)  # the postgres OS user must enter it when we run as root
        cluster = Cluster(Path(tmp) / "data")
        cluster.ensure()
        cluster.start()
        try:
            cluster.create_database("bench")
            dsn = cluster.dsn("bench")
            deploy_sql(dsn, sql_dir)
            yield cluster, dsn
        finally:
            cluster.stop("fast")


def run_pgbench(
    cluster: Cluster,
    script: str,
    clients: int,
    seconds: int,
    *,
    db: str = "bench",
    user: str = "postgres",
    max_tries: int | None = 20,
) -> float:
    """Transactions per second of `script` under pgbench -M prepared (without connection time)."""
    import re

    from pginbox.devtools.cluster import find_bindir

    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
        path = f.name
    Path(path).chmod(0o644)
    cmd = [
        str(find_bindir() / "pgbench"),
        "-n",
        "-M",
        "prepared",
        "-c",
        str(clients),
        "-j",
        str(clients),
        "-T",
        str(seconds),
        "-f",
        path,
        "-h",
        "127.0.0.1",
        "-p",
        str(cluster.port),
        "-U",
        user,
        db,
    ]
    if max_tries is not None:
        cmd.insert(-1, f"--max-tries={max_tries}")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    Path(path).unlink()
    if out.returncode != 0:
        raise SystemExit(f"pgbench failed:\n{out.stdout}\n{out.stderr}")
    match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    if not match:
        raise SystemExit(f"no tps in pgbench output:\n{out.stdout}")
    return float(match.group(1))


SERVICE_ROLE = "bench_svc"


def create_service_role(dsn: str, consumer: str = "bench", grants: str = "", *, create: bool = True) -> None:
    """A LOGIN role as a real service has it: member of inbox_consumer only, bound to `consumer`
    (authorization on, as in production), plus `grants` (SQL run as the superuser, {role} replaced).
    create=False: the role exists (made for another database of the cluster); bind and grant only."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        if create:
            conn.execute(f"CREATE ROLE {SERVICE_ROLE} LOGIN IN ROLE inbox_consumer")  # type: ignore[arg-type]
        conn.execute(
            "SELECT inbox.bind_consumer(%s, %s::regrole, note => 'benchmark service')", (consumer, SERVICE_ROLE)
        )
        if grants:
            conn.execute(grants.replace("{role}", SERVICE_ROLE))  # type: ignore[arg-type]
