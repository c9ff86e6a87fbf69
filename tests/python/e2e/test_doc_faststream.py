"""docs/faststream.md's example, as written there: app.py (its first Python block) runs with
`faststream run app:app` on RabbitMQ, and the producer's block (its second) publishes the same
message twice: applied once, both acked."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from conftest import REPO_ROOT
from helpers_brokers import RABBIT_URL, require, wait_for
from helpers_celery import delete, drain, waiting
from helpers_inbox import setup_domain

PAGE = Path(REPO_ROOT) / "docs" / "faststream.md"
Conn = psycopg.Connection[tuple[Any, ...]]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_the_example_runs_as_written(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    require("rabbitmq")
    app, producer = python_blocks()
    (tmp_path / "app.py").write_text(app)
    setup_domain(conn)
    queue = f"t_fs_{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "RABBITMQ_URL": RABBIT_URL, "DATABASE_URL": db_dsn, "BILLING_QUEUE": queue}
    log = tmp_path / "app.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "faststream", "run", "app:app"], cwd=tmp_path, env=env, stdout=out, stderr=out
        )
    try:
        wait_for(lambda: "started successfully" in log.read_text(errors="replace"), "the app started", timeout=60)
        os.environ["BILLING_QUEUE"] = queue
        os.environ["RABBITMQ_URL"] = RABBIT_URL
        namespace: dict[str, Any] = {}
        exec(compile(producer, str(PAGE), "exec"), namespace)

        async def send_twice() -> None:
            async with namespace["shop"]:
                await namespace["order_paid"]("17", 250)
                await namespace["order_paid"]("17", 250)  # a resend: acked, not applied

        asyncio.run(send_twice())

        def done() -> bool:
            row = conn.execute("SELECT count(*) FROM inbox.message WHERE message_id = 'order-17'").fetchone()
            return row == (1,) and waiting(RABBIT_URL, queue) == 0

        wait_for(done, "order-17 processed", timeout=60)
        time.sleep(1.0)
        assert conn.execute("SELECT balance FROM account WHERE id = 1").fetchone() == (250,)
        row = conn.execute("SELECT producer FROM inbox.message WHERE message_id = 'order-17'").fetchone()
        assert row == ("shop",)
        assert drain(RABBIT_URL, f"{queue}.dead") == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        os.environ.pop("BILLING_QUEUE", None)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        delete(RABBIT_URL, queue, f"{queue}.dead")
