"""pginbox behind PgBouncer in transaction mode (a real PgBouncer: helpers_pgbouncer).

The cases a pooler brings that the library and dispatcher tests (which run a second time through
PgBouncer, marker `pgbouncer`) do not show by themselves: statements another client prepared on the
shared server session, detection of the pooler, pooler errors that are never message failures, and
the work that needs a direct connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, LiteralString

import psycopg
import pytest
from helpers_inbox import assert_applied_exactly, failed_attempts, inbox_rows, setup_domain
from helpers_library import CREDIT_SQL, credit_args, message
from helpers_paths import pythonpath
from helpers_pgbouncer import PgBouncer, free_port
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from pginbox import AsyncInbox, Inbox, Message, Outcome, PoolerError, RetryPolicy, TransientKind, pooler
from pginbox.client.retry import classify
from pginbox.dispatcher import CallableTransport, Dispatcher, Effect, HealthServer
from pginbox.ops.retention import purge, purge_consumer

Conn = psycopg.Connection[Any]
FAST_RETRY = RetryPolicy(max_attempts=5, base_delay=0.005, max_delay=0.05)
#: What psycopg names the statements it prepares on a connection: _pg3_0, _pg3_1, ...
PSYCOPG_NAMES = [f"_pg3_{i}" for i in range(8)]


def uid() -> str:
    return f"m-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


@pytest.fixture
def one_server(pg_base: str, tmp_path: Path) -> Iterator[PgBouncer]:
    """A PgBouncer with one server connection per database and user: every client shares it."""
    with PgBouncer(pg_base, tmp_path / "pgbouncer", pool_size=1) as bouncer:
        yield bouncer


def pollute(dsn: str, names: list[str]) -> None:
    """Another client of the pooler prepares statements under psycopg's names on the shared server
    session (they stay there: the server connection outlives the client's transaction)."""
    with psycopg.connect(dsn, autocommit=True) as other:
        for name in names:
            other.execute(sql.SQL("PREPARE {} AS SELECT 1").format(sql.Identifier(name)))


def prepared_credit(cur: psycopg.Cursor[Any], m: Message) -> None:
    """A handler whose statement psycopg prepares on the server session (prepare=True), as it does
    by itself for a statement run prepare_threshold (5) times."""
    cur.execute(CREDIT_SQL, credit_args(m), prepare=True)


def test_pgbouncer_is_detected(db_dsn: str, domain: Conn, pgbouncer: PgBouncer) -> None:
    with psycopg.connect(pgbouncer.route(db_dsn)) as pooled, psycopg.connect(db_dsn) as direct:
        assert pooler.behind_pooler(pooled) is True
        assert pooler.behind_pooler(direct) is False
        assert pooled.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        behind = Inbox(pooled, consumer="billing")
        beside = Inbox(direct, consumer="billing")
        assert not behind.behind_pooler and not beside.behind_pooler
        assert behind.check_schema() == beside.check_schema()
        assert (behind.behind_pooler, pooled.prepare_threshold) == (True, None)
        assert (beside.behind_pooler, direct.prepare_threshold) == (False, 5)


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "no-pipeline"])
def test_statement_prepared_by_another_client_is_not_a_failure(
    db_dsn: str, domain: Conn, one_server: PgBouncer, pipeline: bool
) -> None:
    """Before detection, the claim was prepared as _pg3_0 and the handler's statement as _pg3_1,
    which another client had prepared on the shared server session: 42P05 in the handler, recorded
    in inbox.attempt as a failure of a healthy message."""
    dsn = one_server.route(db_dsn)
    pollute(dsn, PSYCOPG_NAMES[1:2])
    m = message(uid(), 10)
    with psycopg.connect(dsn) as c:
        inbox = Inbox(c, consumer="billing", retry=FAST_RETRY, pipeline=pipeline)
        result = inbox.handle(m, prepared_credit)
        assert inbox.behind_pooler
    assert result.outcome is Outcome.APPLIED, (result.reason_code, result.error_message)
    assert failed_attempts(domain, m.message_id) == 0
    assert_applied_exactly(domain, {m.message_id: 10})


def test_every_call_works_on_a_polluted_shared_session(db_dsn: str, domain: Conn, one_server: PgBouncer) -> None:
    dsn = one_server.route(db_dsn)
    pollute(dsn, PSYCOPG_NAMES)
    a, b, c_, d = (message(uid(), n) for n in (1, 2, 3, 4))
    with psycopg.connect(dsn) as c:
        inbox = Inbox(c, consumer="billing", retry=FAST_RETRY)
        assert inbox.handle(a, prepared_credit).outcome is Outcome.APPLIED
        assert inbox.handle(a, prepared_credit).outcome is Outcome.DUPLICATE
        assert [r.outcome for r in inbox.handle_batch([b, a], prepared_credit)] == [Outcome.APPLIED, Outcome.DUPLICATE]
        assert inbox.apply(c_).outcome is Outcome.APPLIED
        assert [r.outcome for r in inbox.apply_batch([d, c_])] == [Outcome.APPLIED, Outcome.DUPLICATE]
        assert inbox.stats.transient_errors == {} and inbox.stats.retries == 0
    assert_applied_exactly(domain, {a.message_id: 1, b.message_id: 2, c_.message_id: 3, d.message_id: 4})
    assert sum(failed_attempts(domain, m.message_id) for m in (a, b, c_, d)) == 0


def test_every_pool_connection_is_configured(db_dsn: str, domain: Conn, one_server: PgBouncer) -> None:
    """A pool behind the pooler: detection on the first connection applies to all of them, and
    workers racing on the same messages apply each exactly once."""
    dsn = one_server.route(db_dsn)
    pollute(dsn, PSYCOPG_NAMES)
    messages = [message(uid(), n) for n in range(1, 11)]
    seen: set[int] = set()
    lock = threading.Lock()

    def handler(cur: psycopg.Cursor[Any], m: Message) -> None:
        assert cur.connection.prepare_threshold is None
        with lock:
            seen.add(id(cur.connection))
        prepared_credit(cur, m)

    with ConnectionPool(dsn, min_size=4, max_size=4, open=True) as pool:
        inbox = Inbox(pool, consumer="billing", retry=FAST_RETRY)
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(lambda m: inbox.handle(m, handler), messages * 3))
        assert inbox.behind_pooler
    outcomes = [r.outcome for r in results]
    assert outcomes.count(Outcome.APPLIED) == 10 and outcomes.count(Outcome.DUPLICATE) == 20
    assert len(seen) > 1
    assert_applied_exactly(domain, {m.message_id: m.payload["amount"] for m in messages})


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_async_inbox_behind_pgbouncer(db_dsn: str, domain: Conn, one_server: PgBouncer) -> None:
    dsn = one_server.route(db_dsn)
    pollute(dsn, PSYCOPG_NAMES)
    messages = [message(uid(), n) for n in range(1, 6)]

    async def handler(cur: psycopg.AsyncCursor[Any], m: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(m), prepare=True)

    async with AsyncConnectionPool(dsn, min_size=2, max_size=2, open=False) as pool:
        inbox = AsyncInbox(pool, consumer="billing", retry=FAST_RETRY)
        first = [await inbox.handle(m, handler) for m in messages]
        again = await inbox.handle_batch(messages, handler)
        assert inbox.behind_pooler
    assert {r.outcome for r in first} == {Outcome.APPLIED}
    assert {r.outcome for r in again} == {Outcome.DUPLICATE}
    assert_applied_exactly(domain, {m.message_id: m.payload["amount"] for m in messages})


#: A statement that fails the way a server session that is not the client's makes it fail.
POOLER_FAILURES: dict[str, LiteralString] = {
    "42P05": "PREPARE pginbox_taken AS SELECT 1",  # prepared on this session already
    "26000": "EXECUTE pginbox_missing",  # never prepared on this session
}


@pytest.mark.parametrize("sqlstate", sorted(POOLER_FAILURES))
def test_pooler_errors_are_retried_never_recorded(db_dsn: str, domain: Conn, sqlstate: str) -> None:
    """An undetectable pooler (here: a direct connection whose session disagrees with the handler
    once): the whole transaction is retried, nothing is recorded against the message, and the
    client stops preparing statements."""
    m = message(uid(), 10)
    calls = 0

    def handler(cur: psycopg.Cursor[Any], msg: Message) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            cur.execute(POOLER_FAILURES[sqlstate])
        cur.execute(CREDIT_SQL, credit_args(msg))

    with psycopg.connect(db_dsn) as c:
        c.execute("PREPARE pginbox_taken AS SELECT 1")
        c.commit()
        inbox = Inbox(c, consumer="billing", retry=FAST_RETRY)
        result = inbox.handle(m, handler)
        assert inbox.behind_pooler and c.prepare_threshold is None
        assert inbox.stats.transient_errors == {sqlstate: 1}
    assert result.outcome is Outcome.APPLIED and result.retries == 1 and calls == 2
    assert failed_attempts(domain, m.message_id) == 0 and len(inbox_rows(domain, m.message_id)) == 1
    assert_applied_exactly(domain, {m.message_id: 10})


def test_pooler_sqlstates_are_transient() -> None:
    assert classify(psycopg.errors.DuplicatePreparedStatement()) is TransientKind.POOLER
    assert classify(psycopg.errors.InvalidSqlStatementName()) is TransientKind.POOLER
    assert classify(psycopg.errors.DuplicateCursor()) is None


def test_refuse_pooled_says_what_to_do() -> None:
    pooler.refuse_pooled(False, "purge")
    with pytest.raises(pooler.PoolerError, match=r"purge needs one server session.*connect to PostgreSQL directly"):
        pooler.refuse_pooled(True, "purge")


# ----------------------------------------------------------------------------- dispatcher and purge


def enqueue(conn: Conn, effect_id: str) -> None:
    with conn.transaction():
        conn.execute("SELECT inbox.enqueue_effect(%s, 'sink', '{}'::jsonb)", (effect_id,))


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class Sink:
    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, effect: Effect) -> None:
        self.ids.append(effect.effect_id)


@contextlib.contextmanager
def running(dispatcher: Dispatcher) -> Iterator[Dispatcher]:
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        yield dispatcher
    finally:
        dispatcher.stop()
        runner.join(10)
        dispatcher.close()
    assert not runner.is_alive()


def test_dispatcher_behind_pgbouncer_without_a_listen_dsn_polls_and_says_so(
    conn: Conn, db_dsn: str, pgbouncer: PgBouncer
) -> None:
    """LISTEN through a transaction pooler would listen on a server session the notifications never
    reach: the dispatcher does not LISTEN, polls, and /healthz says so (healthy: it works)."""
    sink = Sink()
    dispatcher = Dispatcher(pgbouncer.route(db_dsn), "pooled", {"sink": CallableTransport(sink)}, poll_interval=0.2)
    with running(dispatcher), HealthServer(dispatcher) as server:
        assert wait_for(lambda: dispatcher.wakeup == "polling", timeout=10)
        enqueue(conn, "polled")
        assert wait_for(lambda: sink.ids == ["polled"], timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as response:
            status, health = response.status, json.loads(response.read())
    assert status == 200 and health["healthy"] is True
    assert (health["listening"], health["wakeup"], health["behind_pooler"]) == (False, "polling", True)
    assert "connection pooler" in health["wakeup_reason"] and "--listen-dsn" in health["wakeup_reason"]
    assert dispatcher.listen_backend_pid is None


def test_dispatcher_listens_on_the_listen_dsn_and_claims_through_pgbouncer(
    conn: Conn, db_dsn: str, pgbouncer: PgBouncer
) -> None:
    sink = Sink()
    # A poll interval far longer than the wait below: a delivery within it came through NOTIFY.
    dispatcher = Dispatcher(
        pgbouncer.route(db_dsn), "split", {"sink": CallableTransport(sink)}, poll_interval=60.0, listen_dsn=db_dsn
    )
    with running(dispatcher):
        assert wait_for(lambda: dispatcher.listen_backend_pid is not None, timeout=10)
        time.sleep(0.3)  # idle, waiting on the LISTEN session
        enqueue(conn, "signalled")
        assert wait_for(lambda: sink.ids == ["signalled"], timeout=5)
        healthy, health = dispatcher.health()
        pid = dispatcher.listen_backend_pid
        listener = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND query = 'LISTEN inbox_outbox'", (pid,)
        ).fetchone()
    assert healthy and (health["listening"], health["wakeup"], health["wakeup_reason"]) == (True, "listen", None)
    assert health["behind_pooler"] is True
    assert listener == (1,), "the LISTEN session is a direct one: its pid is a real backend's"


def test_purge_refuses_a_pooled_connection(conn: Conn, db_dsn: str, pgbouncer: PgBouncer) -> None:
    with psycopg.connect(pgbouncer.route(db_dsn), autocommit=True) as pooled:
        with pytest.raises(PoolerError, match=r"session-level advisory lock.*connect to PostgreSQL directly"):
            purge_consumer(pooled, "billing")
        with pytest.raises(PoolerError):
            purge(pooled)
    # this test's database only: tests on other xdist workers hold advisory locks of their own
    held = conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
        " WHERE l.locktype = 'advisory' AND d.datname = current_database()"
    ).fetchone()
    assert held == (0,)


def test_cli_purge_through_pgbouncer_says_what_to_do(db_dsn: str, pgbouncer: PgBouncer) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pginbox", "purge", "--dsn", pgbouncer.route(db_dsn)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "connection pooler" in done.stderr and "directly" in done.stderr


@pytest.mark.parametrize("listen_dsn", [True, False], ids=["listen-dsn-from-env", "no-listen-dsn"])
def test_cli_dispatch_reads_the_listen_dsn_from_the_environment(
    conn: Conn, db_dsn: str, pgbouncer: PgBouncer, tmp_path: Path, listen_dsn: bool
) -> None:
    """`pginbox dispatch` through PgBouncer: PGINBOX_DISPATCH_LISTEN_DSN gives LISTEN its direct
    connection (/healthz: wakeup listen); without it, wakeup polling with the reason."""
    port = free_port()
    env = {
        **os.environ,
        "PGINBOX_TEST_SINK": str(tmp_path / "sink.txt"),
        "PYTHONPATH": pythonpath(),
    }
    if listen_dsn:
        env["PGINBOX_DISPATCH_LISTEN_DSN"] = db_dsn
    else:
        env.pop("PGINBOX_DISPATCH_LISTEN_DSN", None)
    command = [
        sys.executable,
        "-m",
        "pginbox",
        "--dsn",
        pgbouncer.route(db_dsn),
        "dispatch",
        "--name",
        "cli-pooled",
        "--callable",
        "sink=_dispatch_sink:record",
        "--health-port",
        str(port),
        "--poll-interval",
        "0.2",
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    health: dict[str, Any] = {}

    def wakeup_known() -> bool:
        nonlocal health
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                health = json.loads(response.read())
        except OSError:
            return False
        return bool(health.get("listening")) or health.get("wakeup") == "polling"

    try:
        assert wait_for(wakeup_known, timeout=20), health
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(20)
    if listen_dsn:
        assert (health["listening"], health["wakeup"], health["wakeup_reason"]) == (True, "listen", None)
    else:
        assert (health["listening"], health["wakeup"]) == (False, "polling")
        assert "PGINBOX_DISPATCH_LISTEN_DSN" in health["wakeup_reason"]
    assert process.returncode == 0


def test_sqlalchemy_inbox_behind_pgbouncer(db_dsn: str, domain: Conn, one_server: PgBouncer) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import URL
    from sqlalchemy.orm import Session

    from pginbox.integrations.sqlalchemy import SQLAlchemyInbox

    dsn = one_server.route(db_dsn)
    pollute(dsn, PSYCOPG_NAMES)
    params = conninfo_to_dict(dsn)
    engine = create_engine(
        URL.create(
            "postgresql+psycopg",
            username=str(params["user"]),
            host="127.0.0.1",
            port=one_server.port,
            database=str(params["dbname"]),
        )
    )
    inbox = SQLAlchemyInbox(consumer="billing", retry=FAST_RETRY)
    messages = [message(uid(), n) for n in range(1, 8)]

    def handler(session: Session, m: Message) -> None:
        session.execute(
            text("SELECT apply_credit(:a, :m, :n)"),
            {"a": m.payload["account"], "m": m.message_id, "n": m.payload["amount"]},
        )

    try:
        with Session(engine) as s:
            first = [inbox.handle(s, m, handler) for m in messages]
            again = [inbox.handle(s, m, handler) for m in messages]
        assert inbox.behind_pooler
    finally:
        engine.dispose()
    assert {r.outcome for r in first} == {Outcome.APPLIED} and {r.outcome for r in again} == {Outcome.DUPLICATE}
    assert_applied_exactly(domain, {m.message_id: m.payload["amount"] for m in messages})
    assert sum(failed_attempts(domain, m.message_id) for m in messages) == 0


def test_operator_commands_prepare_nothing(db_dsn: str, domain: Conn, one_server: PgBouncer) -> None:
    """The operator commands' connection prepares no statements (a replay or a quarantine sweep
    runs the same statement many times: psycopg would prepare it on the shared server session)."""
    import click

    from pginbox.cli.context import State, connect

    dsn = one_server.route(db_dsn)
    pollute(dsn, PSYCOPG_NAMES)
    with click.Context(click.Command("t"), obj=State()) as ctx, connect(ctx, dsn) as c:
        assert c.prepare_threshold is None
        for _ in range(10):  # past psycopg's default prepare_threshold (5)
            assert c.execute("SELECT count(*) FROM inbox.attempt").fetchone() == (0,)
