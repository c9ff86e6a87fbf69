"""The outbox dispatcher (python/pginbox/dispatcher.py) against a real PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pginbox.dispatcher import CallableTransport, DeliveryReport, Dispatcher, Effect

Conn = psycopg.Connection[tuple[Any, ...]]
HERE = Path(__file__).resolve().parent


class Recorder:
    """A destination that records the effect ids it received, in order (thread-safe)."""

    def __init__(self, behaviour: Callable[[Effect], object] | None = None) -> None:
        self.ids: list[str] = []
        self.lock = threading.Lock()
        self.behaviour = behaviour

    def __call__(self, effect: Effect) -> object:
        with self.lock:
            self.ids.append(effect.effect_id)
        return self.behaviour(effect) if self.behaviour else None


def enqueue(conn: Conn, *effect_ids: str, destination: str = "sink", commit: bool = True) -> None:
    with conn.transaction(force_rollback=not commit):
        for effect_id in effect_ids:
            conn.execute("SELECT inbox.enqueue_effect(%s, %s, %s::jsonb)", (effect_id, destination, json.dumps({})))


def status_of(conn: Conn, effect_id: str) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT status::text, attempts, dead_reason::text, last_error FROM inbox.outbox WHERE effect_id = %s",
        (effect_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def fast_retries(conn: Conn) -> None:
    conn.execute("SELECT inbox.configure_destination('sink', 5, '10 milliseconds', '20 milliseconds')")


@pytest.fixture
def make_dispatcher(db_dsn: str) -> Iterator[Callable[..., Dispatcher]]:
    made: list[Dispatcher] = []

    def make(name: str, recorder: Recorder, **options: Any) -> Dispatcher:
        dispatcher = Dispatcher(db_dsn, name, {"sink": CallableTransport(recorder)}, **options)
        made.append(dispatcher)
        return dispatcher

    yield make
    for dispatcher in made:
        dispatcher.close()


def test_run_once_delivers_committed_effects_exactly_once(
    conn: Conn, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    enqueue(conn, *[f"e-{i}" for i in range(25)])
    enqueue(conn, "rolled-back", commit=False)
    recorder = Recorder()
    dispatcher = make_dispatcher("d1", recorder, batch_size=10)
    assert dispatcher.run_once() == 25
    assert sorted(recorder.ids) == sorted(f"e-{i}" for i in range(25))
    assert dispatcher.stats.delivered == 25
    assert dispatcher.stats.lag_seconds_last is not None
    assert dispatcher.run_once() == 0
    assert len(recorder.ids) == 25
    counts = dict(conn.execute("SELECT status::text, count(*) FROM inbox.outbox GROUP BY 1").fetchall())
    assert counts == {"delivered": 25}  # the rolled-back enqueue left nothing


def test_ambiguous_failure_is_retried_with_the_same_effect_id(
    conn: Conn, fast_retries: None, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    calls = {"n": 0}

    def flaky(effect: Effect) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise TimeoutError("read timed out after sending")

    enqueue(conn, "fx-1")
    recorder = Recorder(flaky)
    dispatcher = make_dispatcher("d1", recorder)
    dispatcher.run_once()  # may already retry: the backoff is 5-10 ms and run_once drains what is due
    assert "ambiguous: TimeoutError" in status_of(conn, "fx-1")[3]
    assert dispatcher.stats.retried == 1
    assert wait_until(lambda: (dispatcher.run_once(), status_of(conn, "fx-1")[0])[1] == "delivered", timeout=5)
    assert recorder.ids == ["fx-1", "fx-1"]  # the same idempotency key on the retry
    assert status_of(conn, "fx-1")[:2] == ("delivered", 2)
    assert dispatcher.stats.delivered == 1


def test_non_retryable_report_makes_the_effect_dead(conn: Conn, make_dispatcher: Callable[..., Dispatcher]) -> None:
    enqueue(conn, "fx-bad")
    recorder = Recorder(lambda e: DeliveryReport.failed("422 unprocessable", retryable=False, status_code=422))
    dispatcher = make_dispatcher("d1", recorder)
    dispatcher.run_once()
    assert status_of(conn, "fx-bad") == ("dead", 1, "permanent_failure", "422 unprocessable")
    assert dispatcher.stats.dead == 1
    assert dispatcher.run_once() == 0


def test_late_report_after_reclaim_is_fenced_and_counted(
    conn: Conn, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    enqueue(conn, "fx-slow")
    release = threading.Event()
    slow = Recorder(lambda e: release.wait(10))
    first = make_dispatcher("slow", slow, lease=0.5, extend_leases=False)
    runner = threading.Thread(target=first.run_once)
    runner.start()
    assert wait_until(lambda: slow.ids == ["fx-slow"])
    time.sleep(0.7)  # the lease expires
    fast = Recorder()
    second = make_dispatcher("fast", fast)
    assert second.run_once() == 1
    assert fast.ids == ["fx-slow"]
    release.set()
    runner.join(10)
    assert first.stats.fenced == 1 and first.stats.delivered == 0
    assert second.stats.delivered == 1
    assert status_of(conn, "fx-slow")[:2] == ("delivered", 2)
    fenced = conn.execute("SELECT report FROM inbox.outbox_fenced_report WHERE effect_id = 'fx-slow'").fetchall()
    assert fenced == [("complete",)]


def test_daemon_survives_a_terminated_listen_connection(
    conn: Conn, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    recorder = Recorder()
    # a long poll: what arrives within seconds came through the signal or a catch-up claim
    dispatcher = make_dispatcher("daemon", recorder, poll_interval=30.0)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        assert wait_until(lambda: dispatcher.listen_backend_pid is not None)
        enqueue(conn, "before")
        assert wait_until(lambda: recorder.ids == ["before"], timeout=5)
        old_pid = dispatcher.listen_backend_pid
        time.sleep(0.3)  # idle again, waiting on the LISTEN session
        conn.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
        enqueue(conn, "after")
        assert wait_until(lambda: recorder.ids == ["before", "after"], timeout=5)
        assert wait_until(lambda: dispatcher.listen_backend_pid not in (None, old_pid), timeout=5)
        assert dispatcher.stats.reconnects >= 1
        time.sleep(0.3)  # idle again on the new session: the signal still wakes it
        enqueue(conn, "later")
        assert wait_until(lambda: recorder.ids == ["before", "after", "later"], timeout=5)
    finally:
        dispatcher.stop()
        runner.join(10)
    assert not runner.is_alive()


def _pginbox() -> list[str]:
    script = Path(sys.executable).parent / "pginbox"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pginbox"]


def test_cli_dispatch_once_with_a_callable(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    enqueue(conn, "cli-1", "cli-2", "cli-3")
    sink = tmp_path / "sink.txt"
    env = {
        **os.environ,
        "PGINBOX_TEST_SINK": str(sink),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [*_pginbox(), "--dsn", db_dsn, "dispatch", "--once", "--name", "cli",
         "--callable", "sink=_dispatch_sink:record"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(sink.read_text().split()) == ["cli-1", "cli-2", "cli-3"]
    assert "delivered=3" in result.stdout + result.stderr
    listing = subprocess.run(
        [*_pginbox(), "--dsn", db_dsn, "outbox", "list", "--status", "delivered", "--json"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    assert sorted(e["effect_id"] for e in json.loads(listing.stdout)["effects"]) == ["cli-1", "cli-2", "cli-3"]


def test_cli_daemon_finishes_in_flight_work_on_sigterm(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    sink = tmp_path / "sink.txt"
    started = Path(str(sink) + ".started")
    env = {
        **os.environ,
        "PGINBOX_TEST_SINK": str(sink),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    with subprocess.Popen(
        [*_pginbox(), "--dsn", db_dsn, "dispatch", "--name", "daemon", "--poll-interval", "30",
         "--callable", "sink=_dispatch_sink:slow_record"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    ) as proc:
        try:
            # registered idle: the daemon is up and waiting on its LISTEN session
            assert wait_until(lambda: conn.execute("SELECT count(*) FROM inbox.outbox_waiter").fetchone() == (1,))
            enqueue(conn, "slow-1")
            assert wait_until(lambda: started.is_file() and started.read_text().split() == ["slow-1"], timeout=5)
            proc.send_signal(signal.SIGTERM)  # while slow-1 is in flight
            stdout, stderr = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, stderr
    assert sink.read_text().split() == ["slow-1"]
    assert status_of(conn, "slow-1")[0] == "delivered"
    assert "delivered=1" in stdout
    assert conn.execute("SELECT count(*) FROM inbox.outbox_waiter").fetchone() == (0,)  # unregistered


def test_cli_outbox_show_and_redrive(conn: Conn, db_dsn: str, make_dispatcher: Callable[..., Dispatcher]) -> None:
    enqueue(conn, "fx-dead")
    make_dispatcher("d1", Recorder(lambda e: DeliveryReport.failed("410 gone", retryable=False))).run_once()
    base = [*_pginbox(), "--dsn", db_dsn, "outbox"]
    shown = subprocess.run([*base, "show", "fx-dead", "--json"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["dead_reason"] == "permanent_failure"
    redriven = subprocess.run([*base, "redrive", "fx-dead", "--note", "fixed upstream"], capture_output=True,
                              text=True, timeout=60)
    assert redriven.returncode == 0, redriven.stderr
    assert "pending" in redriven.stdout
    recorder = Recorder()
    assert make_dispatcher("d2", recorder).run_once() == 1
    assert recorder.ids == ["fx-dead"]
    again = subprocess.run([*base, "redrive", "fx-dead", "--note", "x"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "not dead" in again.stderr


def test_hung_delivery_times_out_as_ambiguous_and_its_late_report_is_fenced(
    conn: Conn, fast_retries: None, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    release = threading.Event()
    calls = {"n": 0}

    def hangs_first(effect: Effect) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            release.wait(10)

    enqueue(conn, "fx-hung")
    recorder = Recorder(hangs_first)
    dispatcher = make_dispatcher("d1", recorder, delivery_timeout=0.3)
    # the hung call is reported after 0.3 s; the retry (due after a 5-10 ms backoff) is delivered
    assert wait_until(lambda: (dispatcher.run_once(), status_of(conn, "fx-hung")[0])[1] == "delivered", timeout=5)
    assert recorder.ids == ["fx-hung", "fx-hung"]
    assert status_of(conn, "fx-hung")[:2] == ("delivered", 2)
    release.set()
    assert wait_until(lambda: dispatcher.stats.fenced == 1, timeout=5)  # the hung call's late report
    assert (dispatcher.stats.retried, dispatcher.stats.delivered) == (1, 1)
