"""The outbox dispatcher (python/pginbox/dispatcher/) against a real PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers_paths import pythonpath

from pginbox.dispatcher import CallableTransport, DeliveryReport, Dispatcher, Effect

Conn = psycopg.Connection[tuple[Any, ...]]


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


@contextlib.contextmanager
def _factory(claims_dsn: str, listen_dsn: str | None) -> Iterator[Callable[..., Dispatcher]]:
    made: list[Dispatcher] = []
    routed: dict[str, Any] = {} if listen_dsn is None else {"listen_dsn": listen_dsn}

    def make(name: str, recorder: Recorder, **options: Any) -> Dispatcher:
        dispatcher = Dispatcher(claims_dsn, name, {"sink": CallableTransport(recorder)}, **routed, **options)
        made.append(dispatcher)
        return dispatcher

    try:
        yield make
    finally:
        for dispatcher in made:
            dispatcher.close()


@pytest.fixture
def make_dispatcher(db_dsn: str, route: Callable[[str], str]) -> Iterator[Callable[..., Dispatcher]]:
    """Dispatchers whose claims go directly to the database, or through PgBouncer with a direct
    --listen-dsn (`route`: the tests that take this fixture run both ways)."""
    claims_dsn = route(db_dsn)
    with _factory(claims_dsn, None if claims_dsn == db_dsn else db_dsn) as make:
        yield make


@pytest.fixture
def make_direct_dispatcher(db_dsn: str) -> Iterator[Callable[..., Dispatcher]]:
    """Dispatchers connected directly: for the tests that kill the backends of the claim pool
    (PgBouncer hides that from its clients: it opens another server connection)."""
    with _factory(db_dsn, None) as make:
        yield make


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
    counts: dict[str, int] = dict(conn.execute("SELECT status::text, count(*) FROM inbox.outbox GROUP BY 1").fetchall())
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


def test_daemon_survives_a_terminated_listen_connection(conn: Conn, make_dispatcher: Callable[..., Dispatcher]) -> None:
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
        "PYTHONPATH": pythonpath(),
    }
    result = subprocess.run(
        [
            *_pginbox(),
            "--dsn",
            db_dsn,
            "dispatch",
            "--once",
            "--name",
            "cli",
            "--callable",
            "sink=_dispatch_sink:record",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(sink.read_text().split()) == ["cli-1", "cli-2", "cli-3"]
    assert "delivered=3" in result.stdout + result.stderr
    listing = subprocess.run(
        [*_pginbox(), "--dsn", db_dsn, "outbox", "list", "--status", "delivered", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    assert sorted(e["effect_id"] for e in json.loads(listing.stdout)["effects"]) == ["cli-1", "cli-2", "cli-3"]


def _dispatch_once(db_dsn: str, sink: Path, *, name: str = "cron") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PGINBOX_TEST_SINK": str(sink),
        "PYTHONPATH": pythonpath(),
    }
    return subprocess.run(
        [
            *_pginbox(),
            "--dsn",
            db_dsn,
            "dispatch",
            "--once",
            "--name",
            name,
            "--callable",
            "sink=_dispatch_sink:refuse_bad",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_cli_dispatch_once_exits_3_when_effects_went_dead(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    """Cron can tell: effects that died during the run (a refused one, and one whose last lease had
    expired, which a claim turns dead without any report) make --once exit 3 with the count on
    stderr; the next run, with nothing new dead, exits 0."""
    conn.execute("SELECT inbox.configure_destination('sink', 1, '10 milliseconds', '20 milliseconds')")
    enqueue(conn, "lost-1")
    # A dispatcher that claimed lost-1 (its only attempt) and vanished: its lease expires.
    assert conn.execute(
        "SELECT effect_id FROM inbox.claim_effects('vanished', 10, '1 millisecond', key_aware => true)"
    ).fetchall() == [("lost-1",)]
    time.sleep(0.05)
    enqueue(conn, "bad-1", "ok-1")
    sink = tmp_path / "sink.txt"
    first = _dispatch_once(db_dsn, sink)
    assert first.returncode == 3, (first.stdout, first.stderr)
    assert "2 effects went dead during this run" in first.stderr
    assert "dead=1" in first.stdout  # the refused one was reported; lost-1 died in the claim
    assert status_of(conn, "lost-1")[:3] == ("dead", 1, "lease_expired")
    assert status_of(conn, "bad-1")[:3] == ("dead", 1, "permanent_failure")
    assert status_of(conn, "ok-1")[0] == "delivered"
    assert sink.read_text().split() == ["ok-1"]

    enqueue(conn, "ok-2")
    second = _dispatch_once(db_dsn, sink)  # the dead ones are still dead, none died now
    assert second.returncode == 0, (second.stdout, second.stderr)
    assert "went dead" not in second.stderr
    assert sink.read_text().split() == ["ok-1", "ok-2"]


def test_cli_dispatch_once_counts_its_own_dead_reports_without_read_access(
    conn: Conn, db_dsn: str, tmp_path: Path, login_role: Callable[..., str]
) -> None:
    """A role that may not read inbox.outbox (inbox_dispatcher only) still exits 3 for the effects
    its own reports turned dead."""
    dispatcher_dsn = login_role("inbox_dispatcher")
    enqueue(conn, "bad-2", "ok-3")
    result = _dispatch_once(dispatcher_dsn, tmp_path / "sink.txt")
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "1 effect went dead during this run" in result.stderr
    assert status_of(conn, "bad-2")[0] == "dead"
    assert status_of(conn, "ok-3")[0] == "delivered"


def test_cli_daemon_finishes_in_flight_work_on_sigterm(conn: Conn, db_dsn: str, tmp_path: Path) -> None:
    sink = tmp_path / "sink.txt"
    started = Path(str(sink) + ".started")
    env = {
        **os.environ,
        "PGINBOX_TEST_SINK": str(sink),
        "PYTHONPATH": pythonpath(),
    }
    with subprocess.Popen(
        [
            *_pginbox(),
            "--dsn",
            db_dsn,
            "dispatch",
            "--name",
            "daemon",
            "--poll-interval",
            "30",
            "--callable",
            "sink=_dispatch_sink:slow_record",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
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
    redriven = subprocess.run(
        [*base, "redrive", "fx-dead", "--note", "fixed upstream"], capture_output=True, text=True, timeout=60
    )
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


# ------------------------------------------------------------------ rolled-back handlers, lost signals


def test_a_rolled_back_handler_leaves_no_effect_and_no_wake_up(conn: Conn, db_dsn: str) -> None:
    conn.execute("""
        CREATE FUNCTION notify_then_fail(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM inbox.enqueue_effect(inbox.effect_id('billing', 'shop', payload->>'id', 'email'), 'sink', payload);
            RAISE EXCEPTION 'mail template missing' USING ERRCODE = 'data_exception';
        END $$""")
    conn.execute("SELECT inbox.register_handler('billing', 'notify', 'notify_then_fail(jsonb)'::regprocedure, 'v1')")
    with psycopg.connect(db_dsn, autocommit=True) as listener:
        listener.execute("LISTEN inbox_outbox")
        conn.execute("SELECT inbox.dispatcher_idle('idle-one', true)")
        row = conn.execute(
            "SELECT outcome::text, reason_code"
            " FROM inbox.claim_and_apply('billing', 'shop', 'm-1', 'notify', %s::jsonb)",
            (json.dumps({"id": "m-1"}),),
        ).fetchone()
        assert row is not None and row[0] == "failed"
        assert conn.execute("SELECT count(*) FROM inbox.outbox").fetchone() == (0,), "the enqueue rolled back"
        assert list(listener.notifies(timeout=0.5)) == [], "no wake-up for an effect that does not exist"
        waiters = conn.execute("SELECT dispatcher FROM inbox.outbox_waiter").fetchall()
        assert waiters == [("idle-one",)], "the idle dispatcher is still registered for the next real effect"


def test_an_effect_signalled_while_no_dispatcher_listens_is_delivered(
    conn: Conn, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    # A registration left by a dispatcher that died: the enqueue notifies, and nobody listens.
    conn.execute("SELECT inbox.dispatcher_idle('gone', true)")
    enqueue(conn, "while-nobody-listened")
    assert conn.execute("SELECT count(*) FROM inbox.outbox_waiter").fetchone() == (0,), "the NOTIFY was sent"
    recorder = Recorder()
    dispatcher = make_dispatcher("late", recorder, poll_interval=30.0)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:  # the daemon's first claim (and its catch-up claim) find it: no signal needed
        assert wait_until(lambda: recorder.ids == ["while-nobody-listened"], timeout=5)
    finally:
        dispatcher.stop()
        runner.join(10)


def test_a_lost_signal_is_covered_by_polling(conn: Conn, make_dispatcher: Callable[..., Dispatcher]) -> None:
    recorder = Recorder()
    dispatcher = make_dispatcher("poller", recorder, poll_interval=0.3)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        assert wait_until(lambda: conn.execute("SELECT count(*) FROM inbox.outbox_waiter").fetchone() == (1,))
        # Lose the signal: the registration disappears (as in the race §7 describes), so the
        # enqueue's commit notifies nobody.
        conn.execute("SELECT inbox.dispatcher_idle('poller', false)")
        with psycopg.connect(conn.info.dsn, autocommit=True) as listener:
            listener.execute("LISTEN inbox_outbox")
            enqueue(conn, "unsignalled")
            assert list(listener.notifies(timeout=0.2)) == [], "no NOTIFY was sent"
        started = time.monotonic()
        assert wait_until(lambda: recorder.ids == ["unsignalled"], timeout=5)
        assert time.monotonic() - started < 0.3 + 1.0, "found by the poll, within the poll interval (+ slack)"
    finally:
        dispatcher.stop()
        runner.join(10)


# ------------------------------------------------------------------ discard, health


@pytest.mark.slow
def test_cli_outbox_discard_lets_the_ordering_key_move_on(
    conn: Conn, db_dsn: str, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    with conn.transaction():
        for effect_id in ("k-1", "k-2"):
            conn.execute("SELECT inbox.enqueue_effect(%s, 'sink', '{}', ordering_key => 'K')", (effect_id,))
    failing = Recorder(lambda e: DeliveryReport.failed("410 gone", retryable=False, status_code=410))
    make_dispatcher("d1", failing).run_once()
    assert failing.ids == ["k-1"], "k-2 waits behind its key's head"
    assert status_of(conn, "k-1")[0] == "dead"
    recorder = Recorder()
    assert make_dispatcher("d2", recorder).run_once() == 0, "a dead head blocks its key"
    base = [*_pginbox(), "--dsn", db_dsn, "outbox"]
    refused = subprocess.run([*base, "discard", "k-2", "--note", "x"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "k-2' is pending, not dead" in refused.stderr
    first, *rest = refused.stderr.strip().splitlines()
    assert first.startswith("Error: ") and rest == [
        "  HINT: Only dead effects can be discarded; a pending or leased effect is still being delivered."
    ], refused.stderr  # the database's HINT, under the one error line
    no_note = subprocess.run([*base, "discard", "k-1"], capture_output=True, text=True, timeout=60)
    assert no_note.returncode == 2 and "--note" in no_note.stderr
    done = subprocess.run(
        [*base, "discard", "k-1", "--note", "customer gone, OPS-12"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "discarded" in done.stdout and "ordering key K moves on" in done.stdout
    assert make_dispatcher("d3", recorder).run_once() == 1
    assert recorder.ids == ["k-2"], "the key moved on; the discarded effect was not sent"
    shown = subprocess.run([*base, "show", "k-1", "--json"], capture_output=True, text=True, timeout=60)
    details = json.loads(shown.stdout)
    assert details["status"] == "discarded" and details["discarded_at"] is not None
    assert [d["note"] for d in details["discards"]] == ["customer gone, OPS-12"]
    listed = subprocess.run(
        [*base, "list", "--status", "discarded", "--json"], capture_output=True, text=True, timeout=60
    )
    assert [e["effect_id"] for e in json.loads(listed.stdout)["effects"]] == ["k-1"]


def test_health_reports_a_loop_that_does_not_run(conn: Conn, make_dispatcher: Callable[..., Dispatcher]) -> None:
    from pginbox.dispatcher import HealthServer

    dispatcher = make_dispatcher("h", Recorder(), poll_interval=0.05, stall_after=0.5)
    with HealthServer(dispatcher) as server:
        url = f"http://127.0.0.1:{server.port}"

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(url + path, timeout=5) as response:
                    return int(response.status), response.read().decode()
            except urllib.error.HTTPError as exc:
                return int(exc.code), exc.read().decode()

        status, body = get("/healthz")
        assert status == 503 and json.loads(body)["last_loop_age_seconds"] is None, "not started yet"
        runner = threading.Thread(target=dispatcher.run)
        runner.start()
        try:
            assert wait_until(lambda: get("/healthz")[0] == 200)
            enqueue(conn, "h-1")
            assert wait_until(lambda: json.loads(get("/healthz")[1])["counters"]["delivered"] == 1)
        finally:
            dispatcher.stop()
            runner.join(10)
        # The loop has stopped: once stall_after has passed, unhealthy (so does a stuck loop).
        assert wait_until(lambda: get("/healthz")[0] == 503, timeout=5)
        assert get("/nope")[0] == 404
        assert 'pginbox_dispatcher_delivered_total{destination="sink"} 1.0' in get("/metrics")[1]


# ------------------------------------------------------------------ capacity, claim errors, batched reports


@pytest.mark.slow
def test_run_once_drains_everything_when_in_flight_capacity_is_full(
    conn: Conn, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    """The repro: with in-flight capacity full, a claim round used to look like "nothing due" and
    run_once stopped early (256 of 10 000 delivered)."""
    conn.execute("SELECT count(inbox.enqueue_effect('cap-' || g, 'sink', '{}')) FROM generate_series(1, 10000) g")
    recorder = Recorder()
    dispatcher = make_dispatcher("cap", recorder, batch_size=100, concurrency_per_destination=4, max_in_flight=4)
    assert dispatcher.run_once() == 10000
    assert len(recorder.ids) == 10000 and len(set(recorder.ids)) == 10000, "each effect delivered once"
    counts: dict[str, int] = dict(conn.execute("SELECT status::text, count(*) FROM inbox.outbox GROUP BY 1").fetchall())
    assert counts == {"delivered": 10000}
    assert dispatcher.stats.delivered == 10000 and dispatcher.stats.claimed == 10000
    assert dispatcher.in_flight == 0


def test_a_failed_claim_is_retried(
    conn: Conn, make_direct_dispatcher: Callable[..., Dispatcher], caplog: pytest.LogCaptureFixture
) -> None:
    enqueue(conn, "after-claim-error-1", "after-claim-error-2")
    recorder = Recorder()
    dispatcher = make_direct_dispatcher("flaky-claim", recorder)
    app = "pginbox-dispatch:flaky-claim"
    assert wait_until(
        lambda: (
            conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)).fetchone() == (1,)
        )
    )
    # the connection must be idle in the pool, configured: a backend killed while the pool still
    # configures it is only a failed connect (retried by the pool), and no claim would fail
    dispatcher._pool.wait(timeout=10)
    assert wait_until(lambda: dispatcher._pool.get_stats().get("pool_available", 0) >= 1)
    # the pool's idle connection dies: the next claim on it fails with a database error
    conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (app,))
    with caplog.at_level("WARNING", logger="pginbox.dispatcher"):
        assert dispatcher.run_once() == 2
    assert "claim_failed" in caplog.text, "the first claim failed and was retried"
    assert sorted(recorder.ids) == ["after-claim-error-1", "after-claim-error-2"]
    assert status_of(conn, "after-claim-error-1")[0] == "delivered"


@pytest.fixture
def no_dispatcher_role(conn: Conn, db_dsn: str) -> Iterator[str]:
    """A DSN whose role may connect but is not an inbox_dispatcher: every claim fails (42501)."""
    role = f"not_a_dispatcher_{os.getpid()}"
    conn.execute(f"CREATE ROLE {role} LOGIN")
    yield f"{db_dsn} user={role}"
    conn.execute(f"DROP ROLE {role}")


def test_run_once_gives_up_on_persistent_claim_errors(conn: Conn, no_dispatcher_role: str) -> None:
    from pginbox.dispatcher import ClaimError

    enqueue(conn, "never-claimed")
    recorder = Recorder()
    dispatcher = Dispatcher(no_dispatcher_role, "denied", {"sink": CallableTransport(recorder)}, claim_retries=3)
    try:
        started = time.monotonic()
        expected = r"3 claims in a row failed, the last with: permission denied .*\(SQLSTATE 42501\)$"
        with pytest.raises(ClaimError, match=expected):
            dispatcher.run_once()
        assert time.monotonic() - started >= 0.1, "retried with backoff (0.05-0.1 s, then 0.1-0.2 s)"
    finally:
        dispatcher.close()
    assert recorder.ids == []
    assert status_of(conn, "never-claimed")[0] == "pending"


def test_cli_dispatch_once_exits_non_zero_when_claims_keep_failing(conn: Conn, no_dispatcher_role: str) -> None:
    enqueue(conn, "never-claimed")
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    result = subprocess.run(
        [
            *_pginbox(),
            "--dsn",
            no_dispatcher_role,
            "dispatch",
            "--once",
            "--name",
            "denied",
            "--callable",
            "sink=_dispatch_sink:record",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "claims in a row failed" in errors[0] and "permission denied" in errors[0]
    assert status_of(conn, "never-claimed")[0] == "pending"


def test_reports_are_flushed_in_batches_with_every_outcome_counted(
    conn: Conn, fast_retries: None, make_dispatcher: Callable[..., Dispatcher]
) -> None:
    """One flush carries completions and failures together; each effect's outcome is counted as
    with one report per effect (delivered, retried, dead)."""
    enqueue(conn, *[f"ok-{i}" for i in range(30)], "gone", "busy")

    def behaviour(effect: Effect) -> object:
        if effect.effect_id == "gone":
            return DeliveryReport.failed("410 gone", retryable=False, status_code=410)
        if effect.effect_id == "busy" and effect.attempts == 1:
            return DeliveryReport.failed("503 busy", retryable=True, status_code=503)
        return None

    recorder = Recorder(behaviour)
    dispatcher = make_dispatcher("batched", recorder, report_batch=1000, report_interval=0.05)
    flushes = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
    assert wait_until(lambda: (dispatcher.run_once(), status_of(conn, "busy")[0])[1] == "delivered", timeout=10)
    after = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
    assert flushes is not None and after is not None
    assert status_of(conn, "gone")[:3] == ("dead", 1, "permanent_failure")
    assert status_of(conn, "busy")[:2] == ("delivered", 2)
    assert (dispatcher.stats.delivered, dispatcher.stats.dead, dispatcher.stats.retried) == (31, 1, 1)
    assert dispatcher.stats.fenced == 0 and dispatcher.stats.report_errors == 0
    assert dispatcher.in_flight == 0
    counts: dict[str, int] = dict(conn.execute("SELECT status::text, count(*) FROM inbox.outbox GROUP BY 1").fetchall())
    assert counts == {"delivered": 31, "dead": 1}


def test_report_interval_must_stay_far_below_the_lease(db_dsn: str) -> None:
    with pytest.raises(ValueError, match="report_interval must be between 0 and lease / 10"):
        Dispatcher(db_dsn, "bad", {}, lease=1.0, report_interval=0.5)
    with pytest.raises(ValueError, match="report_batch must be between 1 and 1000"):
        Dispatcher(db_dsn, "bad", {}, report_batch=1001)
