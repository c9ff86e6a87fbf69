"""A real Celery worker for the Celery tests (a `celery worker` subprocess running
tests/python/_celery_app.py), and the broker look-ups the tests make with kombu.

Every queue is named by the test and deleted afterwards. Redis: database 11, whose keys the tests
delete (Celery on Redis keeps global keys, `unacked` and `_kombu.binding.*`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import psycopg
import psycopg.sql
from helpers_brokers import RABBIT_URL, REDIS_URL, require

HERE = Path(__file__).resolve().parent
CELERY_REDIS_URL = REDIS_URL.rsplit("/", 1)[0] + "/11"


def broker_url(broker: str) -> str:
    require(broker)
    return CELERY_REDIS_URL if broker == "redis" else RABBIT_URL


def new_queue() -> str:
    return f"t_celery_{uuid.uuid4().hex[:10]}"


def _queue(name: str) -> kombu.Queue:
    return kombu.Queue(name, exchange=kombu.Exchange(name, type="direct"), routing_key=name)


def publish_raw(url: str, queue: str, body: bytes, headers: dict[str, Any], content_type: str) -> None:
    """A message as a broken producer would send it (not through Celery)."""
    with kombu.Connection(url) as conn:
        producer = conn.Producer()
        target = _queue(queue)
        producer.publish(
            body,
            exchange=target.exchange,
            routing_key=queue,
            declare=[target],
            headers=headers,
            content_type=content_type,
            content_encoding="utf-8",
        )


def drain(url: str, name: str) -> list[tuple[dict[str, Any], bytes]]:
    """Every message in queue `name` (headers, raw body), taken off it."""
    out: list[tuple[dict[str, Any], bytes]] = []
    with kombu.Connection(url) as conn:
        bound = _queue(name)(conn.default_channel)
        bound.declare()
        while True:
            message = bound.get(no_ack=True, accept=["application/json", "application/octet-stream", "text/plain"])
            if message is None:
                return out
            body = message.body
            out.append((dict(message.headers or {}), body if isinstance(body, bytes) else str(body).encode()))


def waiting(url: str, name: str) -> int:
    """Messages ready in queue `name` (not handed to a worker)."""
    with kombu.Connection(url) as conn:
        _, count, _ = _queue(name)(conn.default_channel).queue_declare()
        return int(count)


def delete(url: str, *names: str) -> None:
    with contextlib.suppress(Exception), kombu.Connection(url) as conn:
        channel = conn.default_channel
        for name in names:
            with contextlib.suppress(Exception):
                channel.queue_delete(name)
            with contextlib.suppress(Exception):
                channel.exchange_delete(name)
    if url == CELERY_REDIS_URL:
        import redis

        r = redis.Redis.from_url(url)
        try:
            for name in names:
                for key in r.scan_iter(match=f"*{name}*"):
                    r.delete(key)
        finally:
            r.close()


def grant_domain(conn: psycopg.Connection[Any], role_dsn: str) -> str:
    """The login role of `role_dsn` may run the test handler's statements; returns its name."""
    role = psycopg.conninfo.conninfo_to_dict(role_dsn)["user"]
    assert isinstance(role, str)
    conn.execute(
        psycopg.sql.SQL(
            "GRANT SELECT, UPDATE ON account TO {0}; GRANT INSERT ON ledger TO {0};"
            " GRANT USAGE ON SEQUENCE handler_calls TO {0}"
        ).format(psycopg.sql.Identifier(role))
    )
    return role


class Worker:
    """`celery -A _celery_app worker -P solo` on `queue`: the task runs in the worker's main
    process, so a SIGKILL of it is a SIGKILL mid-task."""

    def __init__(
        self,
        url: str,
        queue: str,
        dsn: str,
        log: Path,
        mark: Path | None = None,
        *,
        module: str = "_celery_app",
        cwd: Path = HERE,
        env: dict[str, str] | None = None,
    ) -> None:
        self.url = url
        self.queue = queue
        self.log = log
        env = {
            # not Django's settings another test of this session put in os.environ: Celery's Django
            # fixup would load them in the worker
            **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
            **(env or {}),
            "PYTHONPATH": os.pathsep.join([str(cwd), str(HERE), os.environ.get("PYTHONPATH", "")]),
            "PGINBOX_CELERY_BROKER": url,
            "PGINBOX_CELERY_QUEUE": queue,
            "PGINBOX_DSN": dsn,
            "PGINBOX_CELERY_MARK": str(mark or ""),
        }
        self._out = log.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                module,
                "worker",
                "-P",
                "solo",
                "-Q",
                queue,
                "-n",
                f"{queue}-{uuid.uuid4().hex[:6]}@localhost",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
            ],
            cwd=cwd,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "ready." in self.text():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the celery worker exited: {self.text()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"the celery worker did not start: {self.text()[-3000:]}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._out.close()


@contextlib.contextmanager
def worker(url: str, queue: str, dsn: str, log: Path, mark: Path | None = None, **options: Any) -> Iterator[Worker]:
    w = Worker(url, queue, dsn, log, mark, **options)
    try:
        w.wait_ready()
        yield w
    finally:
        w.stop()
