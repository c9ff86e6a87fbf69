"""docs/celery.md's example, as written there: tasks.py (its first Python block) runs in a real
`celery worker` on RabbitMQ, and the sending block (its second) runs as a script."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from conftest import REPO_ROOT
from helpers_brokers import wait_for
from helpers_celery import broker_url, delete, drain, new_queue, waiting, worker
from helpers_inbox import setup_domain

PAGE = Path(REPO_ROOT) / "docs" / "celery.md"
Conn = psycopg.Connection[tuple[Any, ...]]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_the_example_runs_as_written(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    tasks, send = python_blocks()
    (tmp_path / "tasks.py").write_text(tasks)
    (tmp_path / "send.py").write_text(send)
    setup_domain(conn)
    url, queue = broker_url("rabbitmq"), new_queue()
    env = {"CELERY_BROKER_URL": url, "DATABASE_URL": db_dsn, "BILLING_QUEUE": queue}
    try:
        subprocess.run([sys.executable, "send.py"], cwd=tmp_path, env={**env, "PATH": ""}, check=True, timeout=60)
        with worker(url, queue, db_dsn, tmp_path / "worker.log", module="tasks", cwd=tmp_path, env=env) as w:

            def done() -> bool:
                row = conn.execute(
                    "SELECT count(*) FROM inbox.message WHERE consumer = 'billing' AND message_id = 'order-17'"
                ).fetchone()
                return row == (1,) and waiting(url, queue) == 0

            wait_for(done, "order-17 processed", timeout=60)
            time.sleep(1.0)  # the duplicate, if it were applied, would be now
            log = w.text()
        assert conn.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (250,), log[-3000:]
        assert drain(url, f"{queue}.dead") == []
    finally:
        delete(url, queue, f"{queue}.dead")
