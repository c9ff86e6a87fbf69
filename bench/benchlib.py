"""What every benchmark here shares: a private, throw-away PostgreSQL cluster (fsync on) with the
SQL modules of sql/ deployed in database `bench`, stopped and removed afterwards."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from pginbox.devtools.cluster import Cluster  # noqa: E402


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
            for module in sorted(sql_dir.glob("*.sql")):
                done = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", str(module)],
                                      check=False, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"deploying {module} failed:\n{done.stderr}")
            yield cluster, dsn
        finally:
            cluster.stop("fast")
