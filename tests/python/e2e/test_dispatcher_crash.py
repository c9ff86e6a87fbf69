"""The dispatcher daemon as an operator runs it: `pginbox dispatch` processes against a real
PostgreSQL and a real HTTP sink on 127.0.0.1 that deduplicates on Idempotency-Key
(tests/python/_dispatch_sink.py), killed (SIGKILL), paused (SIGSTOP/SIGCONT) and run eight at a
time. What each test proves is written in docs/outbox.md ("Crash semantics").
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _dispatch_sink import DedupSink
from helpers_paths import pythonpath
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pginbox.transports.effect import idempotency_key

Conn = psycopg.Connection[tuple[Any, ...]]


def pginbox_cmd() -> list[str]:
    script = Path(sys.executable).parent / "pginbox"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pginbox"]


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (`name{labels} value`); without labels, the sum
    over every label set (0 when there is none: a labelled counter has no sample before its first
    increment)."""
    if not labels:
        found_all = re.findall(re.escape(name) + r"(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.MULTILINE)
        return sum(float(v) for v in found_all)
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+-]+)$"
    found = re.search(pattern, text, re.MULTILINE)
    assert found is not None, f"no sample {name}{{{labels}}} in:\n{text}"
    return float(found.group(1))


class DispatchProcess:
    """One `pginbox dispatch` daemon; stdout and stderr (its structured log) go to files."""

    def __init__(self, dsn: str, name: str, workdir: Path, *args: str, health_port: int | None = None) -> None:
        self.name = name
        self.stdout_path = workdir / f"{name}.out"
        self.log_path = workdir / f"{name}.log"
        self.health_port = health_port
        extra = ["--health-port", str(health_port)] if health_port is not None else []
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        with open(self.stdout_path, "w") as out, open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*pginbox_cmd(), "--dsn", dsn, "dispatch", "--name", name, *extra, *args],
                stdout=out,
                stderr=log,
                env=env,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text()

    def stats(self) -> dict[str, str]:
        """The `key=value ...` line `pginbox dispatch` prints when it exits."""
        lines = self.stdout_path.read_text().strip().splitlines()
        assert lines, f"{self.name} printed no stats; log:\n{self.log()[-3000:]}"
        return dict(part.split("=", 1) for part in lines[-1].split())

    def health(self, path: str = "/healthz") -> tuple[int, str]:
        assert self.health_port is not None
        return http_get(f"http://127.0.0.1:{self.health_port}{path}")

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case it is stopped
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def dispatchers(db_dsn: str, tmp_path: Path) -> Iterator[Callable[..., DispatchProcess]]:
    started: list[DispatchProcess] = []

    def start(name: str, *args: str, dsn: str | None = None, health_port: int | None = None) -> DispatchProcess:
        process = DispatchProcess(dsn or db_dsn, name, tmp_path, *args, health_port=health_port)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


def listening(conn: Conn, name: str) -> bool:
    """The daemon's LISTEN session is up (its application_name is pginbox-dispatch-listen:NAME)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (f"pginbox-dispatch-listen:{name}",)
    ).fetchone()
    return row == (1,)


def listen_pid(conn: Conn, name: str) -> int | None:
    row = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (f"pginbox-dispatch-listen:{name}",)
    ).fetchone()
    return None if row is None else int(row[0])


def K(effect_id: str) -> str:
    """The Idempotency-Key the sink sees for an effect enqueued by enqueue() below (no consumer, tenant
    ''): inbox.idempotency_key('', '', effect_id)."""
    return idempotency_key("", "", effect_id)


def enqueue(conn: Conn, *effect_ids: str, key: str | None = None) -> None:
    with conn.transaction():
        for effect_id in effect_ids:
            conn.execute(
                "SELECT inbox.enqueue_effect(%s, 'sink', %s::jsonb, ordering_key => %s)",
                (effect_id, json.dumps({"id": effect_id}), key),
            )


def row_of(conn: Conn, effect_id: str) -> dict[str, Any]:
    cur = conn.execute(
        "SELECT status::text, attempts, leased_by, lease_token, last_error FROM inbox.outbox WHERE effect_id = %s",
        (effect_id,),
    )
    row = cur.fetchone()
    assert row is not None
    return dict(zip(["status", "attempts", "leased_by", "lease_token", "last_error"], row, strict=True))


@pytest.fixture
def fast_retries(conn: Conn) -> None:
    conn.execute("SELECT inbox.configure_destination('sink', 10, '10 milliseconds', '50 milliseconds')")


FAST = ["--poll-interval", "0.1"]


# ------------------------------------------------------------------------ the article's case


def test_daemon_retries_an_ambiguous_remote_timeout_with_the_same_key(
    conn: Conn, fast_retries: None, dispatchers: Callable[..., DispatchProcess], tmp_path: Path
) -> None:
    """The sink accepts the request, then answers after the client's timeout: an ambiguous outcome.
    The daemon retries with the same Idempotency-Key; the sink applies it once."""
    with DedupSink(slow_first=1.0) as sink:
        config = sink.config(tmp_path / "dest.toml", timeout=0.3)
        daemon = dispatchers("amb", "--config", str(config), *FAST)
        assert wait_until(lambda: listening(conn, "amb"))
        enqueue(conn, "fx-ambiguous")
        assert wait_until(lambda: row_of(conn, "fx-ambiguous")["status"] == "delivered")
        assert daemon.terminate() == 0
    requests = sink.requests_for(K("fx-ambiguous"))
    assert len(requests) == 2, "the first attempt timed out after the sink accepted it; one retry"
    assert sink.per_key() == {K("fx-ambiguous"): 2}, "the retry carried the same Idempotency-Key, no other"
    assert sink.applied[K("fx-ambiguous")] == 1, "deduplicated on the key: applied once"
    assert requests[0].body == requests[1].body == {"id": "fx-ambiguous"}
    row = row_of(conn, "fx-ambiguous")
    assert (row["status"], row["attempts"]) == ("delivered", 2)
    assert row["last_error"].startswith("ambiguous: AmbiguousDelivery"), row["last_error"]
    log = daemon.log()
    assert re.search(r"effect_retry .*effect_id=fx-ambiguous destination=sink attempt=1 .*duration_ms=\d+", log)
    assert re.search(r"effect_delivered .*effect_id=fx-ambiguous destination=sink attempt=2 .*duration_ms=\d+", log)
    stats = daemon.stats()
    assert (stats["delivered"], stats["retried"], stats["claimed"]) == ("1", "1", "2")


# ------------------------------------------------------------------------ crashes


def test_sigkill_after_the_remote_accepted_redelivers_with_the_same_key(
    conn: Conn, dispatchers: Callable[..., DispatchProcess], tmp_path: Path
) -> None:
    """SIGKILL between the remote's acceptance and complete_effect: the effect stays leased, the
    lease expires, another dispatcher redelivers it with the same key, the sink applies it once."""
    with DedupSink(hold_first=True) as sink:
        config = sink.config(tmp_path / "dest.toml")
        doomed = dispatchers("doomed", "--config", str(config), "--lease", "1", *FAST)
        assert wait_until(lambda: listening(conn, "doomed"))
        enqueue(conn, "fx-killed")
        assert wait_until(lambda: len(sink.requests_for(K("fx-killed"))) == 1)  # accepted, the answer held
        before = row_of(conn, "fx-killed")
        assert (before["status"], before["leased_by"], before["attempts"]) == ("leased", "doomed", 1)
        doomed.proc.send_signal(signal.SIGKILL)
        assert doomed.proc.wait(10) == -signal.SIGKILL
        time.sleep(0.2)
        assert row_of(conn, "fx-killed")["status"] == "leased", "nobody recorded the delivery"

        heir = dispatchers("heir", "--config", str(config), "--lease", "1", *FAST)
        assert wait_until(lambda: row_of(conn, "fx-killed")["status"] == "delivered", timeout=20)
        assert heir.terminate() == 0
    assert sink.per_key() == {K("fx-killed"): 2}, "the redelivery carried the same Idempotency-Key, no other"
    assert sink.applied[K("fx-killed")] == 1
    after = row_of(conn, "fx-killed")
    assert (after["status"], after["leased_by"], after["attempts"]) == ("delivered", "heir", 2)
    assert after["lease_token"] != before["lease_token"], "the redelivery ran under a new fencing token"
    assert heir.stats()["delivered"] == "1"


def test_sigstop_past_the_lease_then_sigcont_its_late_report_is_fenced_and_counted(
    conn: Conn, dispatchers: Callable[..., DispatchProcess], tmp_path: Path
) -> None:
    """A dispatcher paused past its lease while another one delivers the effect: when it resumes,
    its report is refused (an inbox.outbox_fenced_report row) and counted (stats and /metrics)."""
    port = free_port()
    with DedupSink(hold_first=True) as sink:
        config = sink.config(tmp_path / "dest.toml")
        paused = dispatchers("paused", "--config", str(config), "--lease", "1", *FAST, health_port=port)
        assert wait_until(lambda: listening(conn, "paused"))
        enqueue(conn, "fx-paused")
        assert wait_until(lambda: len(sink.requests_for(K("fx-paused"))) == 1)
        first_token = row_of(conn, "fx-paused")["lease_token"]
        paused.proc.send_signal(signal.SIGSTOP)

        other = dispatchers("other", "--config", str(config), "--lease", "1", *FAST)
        assert wait_until(lambda: row_of(conn, "fx-paused")["status"] == "delivered", timeout=20)
        assert row_of(conn, "fx-paused")["leased_by"] == "other"

        sink.release(K("fx-paused"))  # the paused dispatcher's request is answered 200 ...
        paused.proc.send_signal(signal.SIGCONT)  # ... and it reports it, too late
        assert wait_until(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM inbox.outbox_fenced_report"
                    " WHERE effect_id = 'fx-paused' AND report = 'complete'"
                ).fetchone()
                == (1,)
            )
        )
        fenced = conn.execute(
            "SELECT lease_token, application_name, current_status::text FROM inbox.outbox_fenced_report"
            " WHERE effect_id = 'fx-paused' AND report = 'complete'"
        ).fetchone()
        assert fenced == (first_token, "pginbox-dispatch:paused", "delivered")

        # The refusal is committed by the report's transaction; the reporter counts it once that
        # call has returned, so the counter can trail the row by a moment.
        def fenced_count() -> float:
            status, metrics = paused.health("/metrics")
            assert status == 200
            return metric(metrics, "pginbox_dispatcher_fenced_out_total", 'report="complete"')

        assert wait_until(lambda: fenced_count() >= 1.0)
        status, metrics = paused.health("/metrics")
        assert status == 200
        assert metric(metrics, "pginbox_dispatcher_fenced_out_total", 'report="complete"') == 1.0
        assert metric(metrics, "pginbox_dispatcher_delivered_total") == 0.0
        assert paused.terminate() == 0
        assert other.terminate() == 0
    assert paused.stats()["fenced"] == "1" and paused.stats()["delivered"] == "0"
    assert other.stats()["delivered"] == "1"
    assert re.search(r"report_fenced .*effect_id=fx-paused destination=sink attempt=1 .*report=complete", paused.log())
    assert len(sink.requests_for(K("fx-paused"))) == 2 and sink.applied[K("fx-paused")] == 1


# ------------------------------------------------------------------------ many dispatchers


@pytest.mark.slow
def test_eight_dispatchers_deliver_ten_thousand_effects_each_once(
    conn: Conn, dispatchers: Callable[..., DispatchProcess], tmp_path: Path
) -> None:
    total, names = 10_000, [f"d{i}" for i in range(8)]
    with DedupSink() as sink:
        config = sink.config(tmp_path / "dest.toml")
        conn.execute(
            "SELECT inbox.enqueue_effect('fx-' || g, 'sink', jsonb_build_object('n', g))"
            " FROM generate_series(1, %s::int) g",
            (total // 2,),
        )
        procs = [
            dispatchers(n, "--config", str(config), "--batch-size", "8", "--concurrency", "4", *FAST) for n in names
        ]
        # the second half arrives while they run, in small transactions
        for start in range(total // 2 + 1, total + 1, 250):
            conn.execute(
                "SELECT inbox.enqueue_effect('fx-' || g, 'sink', jsonb_build_object('n', g))"
                " FROM generate_series(%s::int, %s::int) g",
                (start, min(start + 249, total)),
            )

        def delivered() -> int:
            row = conn.execute("SELECT count(*) FROM inbox.outbox WHERE status = 'delivered'").fetchone()
            return int(row[0]) if row else 0

        assert wait_until(lambda: delivered() == total, timeout=240, interval=0.5), f"{delivered()} of {total}"
        assert [p.terminate() for p in procs] == [0] * len(procs)
    stats = [p.stats() for p in procs]
    attempts: dict[str, int] = {K(eid): n for eid, n in conn.execute("SELECT effect_id, attempts FROM inbox.outbox")}
    per_key = sink.per_key()
    assert set(per_key) == set(attempts) and len(attempts) == total, "every effect reached the sink"
    assert all(sink.applied[k] == 1 for k in attempts), "the sink applied each key once"
    # The dispatchers' own accounting: one delivery recorded per effect, one claim per attempt, and
    # any request beyond the first per key is an attempt they logged as retried (or a fenced report).
    assert sum(int(s["delivered"]) for s in stats) == total
    assert sum(int(s["claimed"]) for s in stats) == sum(attempts.values())
    extra = {k: n - 1 for k, n in per_key.items() if k is not None and n > 1}
    logs = "".join(p.log() for p in procs)
    logged = Counter(K(m.group(1)) for m in re.finditer(r"(?:effect_retry|report_fenced) .*?effect_id=(\S+)", logs))
    assert all(logged[k] >= n for k, n in extra.items()), f"unexplained repeats: {extra}"
    assert all(per_key[k] == attempts[k] for k in attempts), "one request per recorded attempt"
    assert sum(1 for s in stats if int(s["delivered"]) > 0) >= 2, "the work was shared"


# ------------------------------------------------------------------------ ordering


def test_out_of_order_commits_on_one_key_reach_the_sink_in_commit_order(
    conn: Conn, db_dsn: str, dispatchers: Callable[..., DispatchProcess], tmp_path: Path
) -> None:
    """For each key, three transactions enqueue in one order and commit in another, while two
    daemons run; the sink receives each key's effects in commit order, one at a time."""
    orders = list(itertools.permutations(range(3)))  # commit order of the three enqueuers
    with DedupSink(delay=0.02) as sink:
        config = sink.config(tmp_path / "dest.toml")
        procs = [dispatchers(n, "--config", str(config), *FAST) for n in ("o1", "o2")]
        assert wait_until(lambda: listening(conn, "o1") and listening(conn, "o2"))
        sessions = [psycopg.connect(db_dsn, autocommit=True) for _ in range(3)]
        expected: dict[str, list[str]] = {}
        try:
            for round_no, commit_order in enumerate(orders):
                key = f"K{round_no}"
                for i, session in enumerate(sessions):  # enqueued in order 0, 1, 2 ...
                    session.execute("BEGIN")
                    session.execute(
                        "SELECT inbox.enqueue_effect(%s, 'sink', '{}', ordering_key => %s)",
                        (f"{key}-enqueued-{i}", key),
                    )
                for i in commit_order:  # ... committed in another order
                    sessions[i].execute("COMMIT")
                    time.sleep(0.03)  # let a dispatcher see the key mid-way, sometimes
                expected[key] = [f"{key}-enqueued-{i}" for i in commit_order]
        finally:
            for session in sessions:
                session.close()
        effects = sum(len(v) for v in expected.values())
        assert wait_until(
            lambda: (
                conn.execute("SELECT count(*) FROM inbox.outbox WHERE status = 'delivered'").fetchone() == (effects,)
            ),
            timeout=60,
        )
        assert [p.terminate() for p in procs] == [0, 0]
    arrivals = sink.arrival_order()
    for key, order in expected.items():
        keys = [K(effect_id) for effect_id in order]
        assert [k for k in arrivals if k in keys] == keys, key
        by_seq = [
            r[0]
            for r in conn.execute(
                "SELECT effect_id FROM inbox.outbox WHERE ordering_key = %s ORDER BY order_seq", (key,)
            )
        ]
        assert by_seq == order, "order_seq is commit order"
    assert len(arrivals) == effects, "no effect was sent twice"


# ------------------------------------------------------------------------ health and metrics


@pytest.fixture
def dispatcher_role(conn: Conn, db_dsn: str) -> Iterator[tuple[str, str]]:
    """A LOGIN role in inbox_dispatcher (the least privilege a dispatcher needs), and its DSN."""
    role = f"disp_{uuid.uuid4().hex[:12]}"
    conn.execute(f'CREATE ROLE "{role}" LOGIN IN ROLE inbox_dispatcher')
    params = {k: v for k, v in conninfo_to_dict(db_dsn).items() if v is not None}
    params["user"] = role
    try:
        yield role, make_conninfo("", **params)
    finally:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_health_endpoint_and_metrics(
    conn: Conn, dispatcher_role: tuple[str, str], dispatchers: Callable[..., DispatchProcess], tmp_path: Path
) -> None:
    role, dsn = dispatcher_role
    port = free_port()
    with DedupSink() as sink:
        config = sink.config(tmp_path / "dest.toml")
        daemon = dispatchers("healthy", "--config", str(config), *FAST, dsn=dsn, health_port=port)
        assert wait_until(lambda: listening(conn, "healthy"))
        assert wait_until(lambda: daemon.health()[0] == 200)
        status, body = daemon.health()
        details = json.loads(body)
        assert details["listening"] is True and details["in_flight"] == 0
        assert 0 <= details["last_loop_age_seconds"] < details["stall_after_seconds"]
        checked = subprocess.run(
            [*pginbox_cmd(), "dispatch-health", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
        assert checked.returncode == 0, checked.stderr
        assert json.loads(checked.stdout)["healthy"] is True

        enqueue(conn, *[f"m-{i}" for i in range(5)])
        assert wait_until(lambda: len(sink.applied) == 5)
        assert wait_until(lambda: metric(daemon.health("/metrics")[1], "pginbox_dispatcher_delivered_total") == 5)
        status, metrics = daemon.health("/metrics")
        assert status == 200
        assert metric(metrics, "pginbox_dispatcher_claimed_total") == 5
        # Per destination (issue 26): with several, which one retries is the first question.
        assert metric(metrics, "pginbox_dispatcher_delivered_total", 'destination="sink"') == 5
        assert metric(metrics, "pginbox_dispatcher_claimed_total", 'destination="sink"') == 5
        assert metric(metrics, "pginbox_dispatcher_retried_total") == 0
        assert metric(metrics, "pginbox_dispatcher_dead_total") == 0
        assert metric(metrics, "pginbox_dispatcher_fenced_out_total", 'report="complete"') == 0
        assert metric(metrics, "pginbox_dispatcher_lag_seconds_count") == 5
        assert 0 < metric(metrics, "pginbox_dispatcher_lag_seconds_sum") < 60
        assert metric(metrics, "pginbox_dispatcher_in_flight") == 0
        assert json.loads(daemon.health()[1])["counters"]["delivered"] == 5

        # The LISTEN backend dies and the role cannot log in again for now: unhealthy (503) until
        # the session is back. Claims go on through the pool's open connection meanwhile.
        old_pid = listen_pid(conn, "healthy")
        conn.execute(f'ALTER ROLE "{role}" NOLOGIN')
        conn.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
        assert wait_until(lambda: daemon.health()[0] == 503)
        down = json.loads(daemon.health()[1])
        assert down["listening"] is False and down["healthy"] is False
        checked = subprocess.run(
            [*pginbox_cmd(), "dispatch-health", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
        assert checked.returncode == 1 and json.loads(checked.stdout)["listening"] is False
        conn.execute(f'ALTER ROLE "{role}" LOGIN')
        assert wait_until(lambda: daemon.health()[0] == 200, timeout=20)
        assert listen_pid(conn, "healthy") not in (None, old_pid)
        assert metric(daemon.health("/metrics")[1], "pginbox_dispatcher_listen_reconnects_total") >= 1
        enqueue(conn, "after-reconnect")
        assert wait_until(lambda: sink.applied[K("after-reconnect")] == 1)
        assert daemon.terminate() == 0
    assert re.search(r"listen_connect_failed .*dispatcher=healthy", daemon.log())
