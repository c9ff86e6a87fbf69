# @ async: the sync tests are generated from this module
# This module is the source of test_library.py: python/tools/async_to_sync.py writes it (tests/run
# fails when it is out of date). Edit this file, then run `python python/tools/async_to_sync.py`.
# @ end
"""The Python client `pginbox.AsyncInbox` against a real PostgreSQL: every public call and outcome,
the failure recording, crash loops, retries driven by real serialization failures, deadlocks and
lock timeouts, connections lost before and during COMMIT, and the schema-version check.

Every assertion about effects reads the domain tables (account, ledger) and the inbox tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from acompat import abarrier_once, aconnect, agather
from helpers_inbox import (
    SAFE_OPTIONS,
    assert_applied_exactly,
    balance,
    canonical_sha256,
    failed_attempts,
    inbox_rows,
    ledger_counts,
    setup_domain,
)
from helpers_inbox import connect as autocommit_connect
from helpers_library import (
    COMMIT_DELAY_DDL,
    CREDIT_SQL,
    Calls,
    CommitDroppingProxy,
    credit_args,
    message,
    terminate_backend_in_commit,
)
from helpers_paths import TESTS_DIR
from psycopg import IsolationLevel, sql
from psycopg_pool import AsyncConnectionPool

from pginbox import (
    AsyncHandler,
    AsyncInbox,
    HandlerProtocolError,
    Message,
    Outcome,
    PginboxError,
    Result,
    RetriesExhausted,
    RetryPolicy,
    SchemaVersionError,
    TransientKind,
    is_transient,
)
from pginbox.client.retry import classify
from pginbox.errors import SchemaNewerWarning

# @ async: anyio's pytest plugin runs the coroutine tests and fixtures, on asyncio
pytestmark = pytest.mark.anyio
# @ end

Conn = psycopg.Connection[Any]
# @ async: the sync module's connections are all `Conn`
AConn = psycopg.AsyncConnection[Any]
# @ end
ACursor = psycopg.AsyncCursor[Any]
Route = Callable[[str], str]
CHILD = TESTS_DIR / "_library_child_async.py"
FAST_RETRY = RetryPolicy(max_attempts=5, base_delay=0.005, max_delay=0.05)


# @ async
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# @ end
@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


@pytest.fixture
async def client(db_dsn: str, domain: Conn, route: Route) -> AsyncIterator[AConn]:
    """The connection the AsyncInbox under test uses (not autocommit: AsyncInbox must cope), directly
    or through PgBouncer in transaction mode (`route`: the tests that take it run both ways)."""
    async with await psycopg.AsyncConnection.connect(route(db_dsn), options=SAFE_OPTIONS) as c:
        yield c


@pytest.fixture
async def direct_client(db_dsn: str, domain: Conn) -> AsyncIterator[AConn]:
    """`client`, always direct: for the tests that terminate the backend of the client's session
    (behind PgBouncer the client does not know which backend serves it)."""
    async with await psycopg.AsyncConnection.connect(db_dsn, options=SAFE_OPTIONS) as c:
        yield c


@pytest.fixture(params=[True, False], ids=["pipeline", "no-pipeline"])
def pipeline(request: pytest.FixtureRequest) -> bool:
    """Both ways of starting a transaction: BEGIN in the claim's round trip, or on its own."""
    return bool(request.param)


@pytest.fixture
def inbox(client: AConn, pipeline: bool) -> AsyncInbox:
    return AsyncInbox(client, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=pipeline)


def credit(calls: Calls | None = None) -> AsyncHandler:
    """A Python handler: one apply_credit (balance + ledger row) per message."""

    async def handler(cur: ACursor, m: Message) -> None:
        if calls is not None:
            calls()
        await cur.execute(CREDIT_SQL, credit_args(m))

    return handler


def uid(prefix: str = "m") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# ----------------------------------------------------------------------------- handle


async def test_handle_applies_once_then_duplicate_then_conflict(inbox: AsyncInbox, domain: Conn) -> None:
    calls = Calls()
    m = message(uid(), 10)
    first = await inbox.handle(m, credit(calls))
    assert first.outcome is Outcome.APPLIED and first.ack
    assert first.payload_sha256 == canonical_sha256(domain, m.payload)
    assert first.handler_version == "v1" and first.processed_at is not None
    assert (first.retries, first.lock_wait_seconds) == (0, 0.0)

    again = await inbox.handle(m, credit(calls))
    assert again.outcome is Outcome.DUPLICATE and again.ack
    assert again.stored_sha256 == first.payload_sha256

    other = await inbox.handle(message(m.message_id, 99), credit(calls))
    assert other.outcome is Outcome.CONFLICT and other.ack
    assert other.quarantine_id is not None and other.reason_code == "identity_conflict"
    assert other.stored_sha256 == first.payload_sha256 != other.payload_sha256

    assert calls.n == 1
    assert_applied_exactly(domain, {m.message_id: 10})
    row = domain.execute(
        "SELECT kind, status FROM inbox.quarantine WHERE quarantine_id = %s", (other.quarantine_id,)
    ).fetchone()
    assert row == ("conflict", "open")
    stats = inbox.stats
    assert stats.deliveries == 3
    assert stats.outcomes == {Outcome.APPLIED: 1, Outcome.DUPLICATE: 1, Outcome.CONFLICT: 1}


async def test_handle_outcomes_with_a_given_connection(db_dsn: str, domain: Conn, route: Route, pipeline: bool) -> None:
    calls = Calls()
    m = message(uid(), 10)
    async with await aconnect(route(db_dsn)) as c:
        inbox = AsyncInbox(c, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=pipeline)
        first = await inbox.handle(m, credit(calls))
        again = await inbox.handle(m, credit(calls))
        other = await inbox.handle(message(m.message_id, 11), credit(calls))
        assert c.autocommit is False and inbox.connection is c
        assert inbox.stats.deliveries == 3
    assert first.outcome is Outcome.APPLIED and first.payload_sha256 == canonical_sha256(domain, m.payload)
    assert again.outcome is Outcome.DUPLICATE
    assert other.outcome is Outcome.CONFLICT and other.quarantine_id is not None
    assert calls.n == 1
    assert_applied_exactly(domain, {m.message_id: 10})


async def test_a_local_server_gets_no_pipeline_by_default(db_dsn: str, domain: Conn, tmp_path: Path) -> None:
    """The default (pipeline=None) sends BEGIN as a simple query of its own to a server on this
    machine, and BEGIN + the claim in one pipelined round trip when told to."""
    traces: dict[bool | None, str] = {}
    applied: dict[str, int] = {}
    for setting in (None, True):
        trace = tmp_path / f"trace-{setting}.txt"
        m = message(uid(), 1)
        with trace.open("w") as out:
            async with await aconnect(db_dsn) as c:
                inbox = AsyncInbox(c, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=setting)
                c.pgconn.trace(out.fileno())
                assert (await inbox.handle(m, credit())).outcome is Outcome.APPLIED
                c.pgconn.untrace()
        traces[setting] = trace.read_text()
        applied[m.message_id] = 1
    assert_applied_exactly(domain, applied)
    simple_begin = [line for line in traces[None].splitlines() if "\tQuery\t" in line and "BEGIN" in line]
    assert simple_begin, traces[None]
    assert not [line for line in traces[True].splitlines() if "\tQuery\t" in line and "BEGIN" in line]
    assert "inbox.claim" in traces[True] and "inbox.claim" in traces[None]


async def test_handle_keeps_the_callers_connection_settings(inbox: AsyncInbox, client: AConn) -> None:
    assert client.autocommit is False
    assert (await inbox.handle(message(uid()), credit())).outcome is Outcome.APPLIED
    assert client.autocommit is False
    assert client.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert inbox.connection is client


async def test_handle_refuses_a_connection_inside_a_transaction(inbox: AsyncInbox, client: AConn, domain: Conn) -> None:
    await client.execute("SELECT 1")  # opens a transaction (not autocommit)
    with pytest.raises(PginboxError, match="inside a transaction"):
        await inbox.handle(message(uid()), credit())
    await client.rollback()
    assert ledger_counts(domain) == {}


async def test_handler_exception_rolls_back_claim_and_writes_and_is_recorded(inbox: AsyncInbox, domain: Conn) -> None:
    m = message(uid(), 10)

    async def broken(cur: ACursor, msg: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(msg))  # written, then rolled back
        raise ValueError("ledger service rejected the entry")

    result = await inbox.handle(m, broken)
    assert result.outcome is Outcome.FAILED and not result.ack
    assert result.reason_code == "ValueError"
    assert result.error_message == "ledger service rejected the entry"
    assert isinstance(result.exception, ValueError)
    assert result.attempts == 1 and result.quarantine_id is None
    # Nothing of the attempt survived: no claim, no balance, no ledger row ...
    assert inbox_rows(domain, m.message_id) == []
    assert balance(domain) == 0 and ledger_counts(domain) == {}
    # ... but the failure is recorded, outside the rolled-back work.
    row = domain.execute(
        "SELECT failed, reason_code, error_message, handler_version, message_type FROM inbox.attempt"
        " WHERE consumer = 'billing' AND message_id = %s",
        (m.message_id,),
    ).fetchone()
    assert row == (1, "ValueError", "ledger service rejected the entry", "v1", "credit")

    # The redelivery, with the handler fixed, applies it.
    fixed = await inbox.handle(m, credit())
    assert fixed.outcome is Outcome.APPLIED
    assert_applied_exactly(domain, {m.message_id: 10})


async def test_handler_failure_is_rolled_back_and_recorded(db_dsn: str, domain: Conn, route: Route) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    m = message(uid(), 10)

    async def broken(cur: ACursor, msg: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(msg))
        raise ValueError("rejected")

    async def swallows(cur: ACursor, msg: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(msg))
        try:
            await cur.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            return

    async with await aconnect(route(db_dsn), autocommit=True) as c:
        inbox = AsyncInbox(c, consumer="billing", handler_version="v1")
        failed = await inbox.handle(m, broken)
        assert ledger_counts(domain) == {} and inbox_rows(domain, m.message_id) == []
        with pytest.raises(ValueError) as caught:
            await inbox.handle(m, broken, raise_on_failure=True)
        assert any("recorded as quarantined" in note for note in caught.value.__notes__)
        held = await inbox.handle(m, credit())
        other = await inbox.handle(message(uid()), swallows)
    assert failed.outcome is Outcome.FAILED and failed.reason_code == "ValueError"
    assert isinstance(failed.exception, ValueError) and failed.attempts == 1
    assert held.outcome is Outcome.QUARANTINED and held.quarantine_id is not None
    assert other.outcome is Outcome.FAILED and isinstance(other.exception, HandlerProtocolError)
    assert failed_attempts(domain, m.message_id) == 2
    assert ledger_counts(domain) == {} and balance(domain) == 0


async def test_failures_reach_quarantine_at_max_attempts(inbox: AsyncInbox, domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    calls = Calls()
    m = message(uid())

    async def broken(cur: ACursor, msg: Message) -> None:
        calls()
        raise RuntimeError("downstream refused")

    assert (await inbox.handle(m, broken)).outcome is Outcome.FAILED
    held = await inbox.handle(m, broken)
    assert held.outcome is Outcome.QUARANTINED and held.ack
    assert held.quarantine_id is not None and held.attempts == 2 and held.reason_code == "RuntimeError"
    # Held: the next delivery does not run the handler.
    later = await inbox.handle(m, broken)
    assert later.outcome is Outcome.QUARANTINED and later.quarantine_id == held.quarantine_id
    assert calls.n == 2
    assert ledger_counts(domain) == {}
    assert inbox.stats.outcomes == {Outcome.FAILED: 1, Outcome.QUARANTINED: 2}


async def test_reason_codes(inbox: AsyncInbox, domain: Conn) -> None:
    class InvalidAccount(Exception):
        reason_code = "invalid_account"

    async def coded(cur: ACursor, m: Message) -> None:
        raise InvalidAccount("account 7 is closed")

    async def violates(cur: ACursor, m: Message) -> None:
        await cur.execute("UPDATE account SET id = NULL WHERE id = 1")  # not-null violation

    async def named_constraint(cur: ACursor, m: Message) -> None:
        await cur.execute("INSERT INTO ledger (account, message_id, amount) VALUES (42, 'x', 1)")  # FK

    assert (await inbox.handle(message(uid()), coded)).reason_code == "invalid_account"
    assert (await inbox.handle(message(uid()), violates)).reason_code == "23502"
    assert (await inbox.handle(message(uid()), named_constraint)).reason_code == "ledger_account_fkey"
    assert ledger_counts(domain) == {}


async def test_raise_on_failure_reraises_after_recording(client: AConn, domain: Conn) -> None:
    inbox = AsyncInbox(client, consumer="billing", handler_version="v1", raise_on_failure=True)
    m = message(uid())

    async def broken(cur: ACursor, msg: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(msg))
        raise KeyError("missing field")

    with pytest.raises(KeyError) as caught:
        await inbox.handle(m, broken)
    assert any("recorded as failed" in note for note in caught.value.__notes__)
    assert failed_attempts(domain, m.message_id) == 1
    assert ledger_counts(domain) == {}
    # Per call, the default can be overridden.
    assert (await inbox.handle(m, broken, raise_on_failure=False)).outcome is Outcome.FAILED
    assert failed_attempts(domain, m.message_id) == 2


async def test_handler_that_swallows_a_database_error_fails(inbox: AsyncInbox, domain: Conn) -> None:
    m = message(uid())

    async def swallows(cur: ACursor, msg: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(msg))
        # The transaction is failed after this: returning does not make it commit.
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            await cur.execute("SELECT 1 / 0")

    result = await inbox.handle(m, swallows)
    assert result.outcome is Outcome.FAILED and result.reason_code == "25P02"
    assert isinstance(result.exception, HandlerProtocolError)
    assert ledger_counts(domain) == {} and inbox_rows(domain, m.message_id) == []


async def test_handler_may_not_end_the_transaction(inbox: AsyncInbox, domain: Conn) -> None:
    async def commits(cur: ACursor, msg: Message) -> None:
        await cur.connection.commit()

    with pytest.raises(HandlerProtocolError, match="ended the transaction"):
        await inbox.handle(message(uid()), commits)


async def test_handler_savepoint_inside_the_transaction(inbox: AsyncInbox, domain: Conn) -> None:
    """A handler may use savepoints (connection.transaction()) to recover from its own errors."""
    m = message(uid(), 5)

    async def careful(cur: ACursor, msg: Message) -> None:
        try:
            async with cur.connection.transaction():
                await cur.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass
        await cur.execute(CREDIT_SQL, credit_args(msg))

    assert (await inbox.handle(m, careful)).outcome is Outcome.APPLIED
    assert_applied_exactly(domain, {m.message_id: 5})


def test_redelivery_crash_loop_ends_in_quarantine(db_dsn: str, domain: Conn) -> None:
    """A handler that kills its process never records a failure; redeliveries announce themselves
    with record_start, and at max_attempts the message is quarantined without running the handler."""
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    message_id = uid("crash")

    def deliver(redelivered: bool) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(CHILD), db_dsn, message_id, "1" if redelivered else "0"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    first = deliver(False)
    assert first.returncode == 3, first.stderr  # died inside the handler
    for _ in range(2):
        again = deliver(True)
        assert again.returncode == 3, again.stderr
    last = deliver(True)
    assert last.returncode == 0, last.stderr
    assert last.stdout.split() == ["quarantined", "crash_loop"]  # the handler did not run
    assert ledger_counts(domain) == {}  # none of the crashed attempts' writes survived
    row = domain.execute(
        "SELECT reason_code, crashes, status FROM inbox.quarantine WHERE message_id = %s", (message_id,)
    ).fetchone()
    assert row == ("crash_loop", 3, "open")


# @ async: cancelling a call is an asyncio thing (a thread cannot be cancelled)
async def test_cancelled_handler_leaves_nothing_and_crash_loop_ends_in_quarantine(db_dsn: str, domain: Conn) -> None:
    """A task cancelled inside its handler is like a crash: nothing commits, nothing is recorded.
    Redeliveries announce themselves; at max_attempts the message is quarantined unrun."""
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    calls = Calls()

    async def hangs(cur: ACursor, msg: Message) -> None:
        calls()
        await cur.execute(CREDIT_SQL, credit_args(msg))
        await asyncio.sleep(30)

    async with await aconnect(db_dsn) as c:
        inbox = AsyncInbox(c, consumer="billing")
        m = message(uid(), 5)
        for attempt, redelivered in enumerate((False, True, True), start=1):
            task = asyncio.create_task(inbox.handle(replace(m, redelivered=redelivered), hangs))
            while calls.n < attempt and not task.done():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the handler's write is done: it sleeps
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert ledger_counts(domain) == {}
            assert failed_attempts(domain, m.message_id) == 0
        held = await inbox.handle(replace(m, redelivered=True), hangs)
    assert held.outcome is Outcome.QUARANTINED and held.reason_code == "crash_loop"
    assert calls.n == 3
    assert ledger_counts(domain) == {}


# @ end
async def test_redelivered_message_is_processed_normally_below_the_limit(inbox: AsyncInbox, domain: Conn) -> None:
    m = message(uid(), 7, redelivered=True)
    assert (await inbox.handle(m, credit())).outcome is Outcome.APPLIED
    assert_applied_exactly(domain, {m.message_id: 7})
    started = domain.execute("SELECT started FROM inbox.attempt WHERE message_id = %s", (m.message_id,)).fetchone()
    assert started == (1,)


# ----------------------------------------------------------------------------- apply


async def test_apply_outcomes(inbox: AsyncInbox, domain: Conn) -> None:
    m = message(uid(), 10)
    first = await inbox.apply(m)
    assert first.outcome is Outcome.APPLIED and first.handler_version == "v1"
    assert (await inbox.apply(m)).outcome is Outcome.DUPLICATE
    assert (await inbox.apply(message(m.message_id, 11))).outcome is Outcome.CONFLICT
    failed = await inbox.apply(message(uid(), -5))  # the SQL handler refuses negative amounts
    assert failed.outcome is Outcome.FAILED and failed.reason_code == "23514" and failed.attempts == 1
    assert_applied_exactly(domain, {m.message_id: 10})


async def test_apply_redelivered_crash_loop(inbox: AsyncInbox, domain: Conn) -> None:
    """max_attempts 2: the first delivery crashed (nothing recorded), the first redelivery announced
    itself and crashed too; the second redelivery is quarantined without running the handler."""
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    m = message(uid(), redelivered=True)
    domain.execute("SELECT inbox.record_start('billing', 'orders', %s, message_type => 'credit')", (m.message_id,))
    held = await inbox.apply(m)
    assert held.outcome is Outcome.QUARANTINED and held.reason_code == "crash_loop"
    assert ledger_counts(domain) == {}


async def test_apply_batch_results_in_input_order(inbox: AsyncInbox, domain: Conn) -> None:
    done = message(uid(), 1)
    assert (await inbox.apply(done)).outcome is Outcome.APPLIED
    fresh = [message(uid(), 2) for _ in range(70)]  # more than one chunk of 64
    batch = [fresh[0], done, message(done.message_id, 99), message(uid(), -1), *fresh[1:], fresh[0]]
    results = await inbox.apply_batch(batch)
    outcomes = [r.outcome for r in results]
    assert outcomes[:4] == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.CONFLICT, Outcome.FAILED]
    assert outcomes[4:-1] == [Outcome.APPLIED] * 69
    # The same message twice in one call: the second sees the first (a different chunk).
    assert outcomes[-1] is Outcome.DUPLICATE
    assert results[3].reason_code == "23514"
    assert results[0].payload_sha256 == canonical_sha256(domain, batch[0].payload)
    assert_applied_exactly(domain, {done.message_id: 1, **{m.message_id: 2 for m in fresh}})
    assert await inbox.apply_batch([]) == []


async def test_apply_batch_with_crash_looping_redelivery(inbox: AsyncInbox, domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    looping = message(uid(), redelivered=True)
    domain.execute(  # its first redelivery crashed too
        "SELECT inbox.record_start('billing', 'orders', %s, message_type => 'credit')", (looping.message_id,)
    )
    redelivered = message(uid(), 3, redelivered=True)
    plain = message(uid(), 4)
    results = await inbox.apply_batch([plain, looping, redelivered])
    assert [r.outcome for r in results] == [Outcome.APPLIED, Outcome.QUARANTINED, Outcome.APPLIED]
    assert results[1].reason_code == "crash_loop"
    assert_applied_exactly(domain, {plain.message_id: 4, redelivered.message_id: 3})


async def test_handle_batch(inbox: AsyncInbox, domain: Conn) -> None:
    done = message(uid(), 1)
    assert (await inbox.handle(done, credit())).outcome is Outcome.APPLIED
    poison = message(uid(), 3)
    fresh = [message(uid(), 2) for _ in range(66)]
    calls = Calls()

    async def handler(cur: ACursor, m: Message) -> None:
        calls()
        await cur.execute(CREDIT_SQL, credit_args(m))
        if m.message_id == poison.message_id:
            raise LookupError("no such customer")

    batch = [fresh[0], done, message(done.message_id, 9), poison, *fresh[1:]]
    results = await inbox.handle_batch(batch, handler)
    assert [r.outcome for r in results[:4]] == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.CONFLICT, Outcome.FAILED]
    assert [r.outcome for r in results[4:]] == [Outcome.APPLIED] * 65
    assert results[3].reason_code == "LookupError" and isinstance(results[3].exception, LookupError)
    assert calls.n == 67  # not for the duplicate and the conflict
    # The poison message's writes rolled back to its savepoint; the others' stayed.
    assert_applied_exactly(domain, {done.message_id: 1, **{m.message_id: 2 for m in fresh}})
    assert failed_attempts(domain, poison.message_id) == 1
    assert inbox_rows(domain, poison.message_id) == []


async def test_handle_batch_repeats_within_a_chunk(inbox: AsyncInbox, domain: Conn) -> None:
    """The chunk is claimed in one statement: an identity repeated in it is decided after its first
    occurrence, by the handler's result: DUPLICATE after an applied one, claimed and run again after
    a failed one (whose claim was taken back). Nothing applied twice, nothing failed kept."""
    once = message(uid(), 5)
    flaky = message(uid(), 7)
    seen: Counter[str] = Counter()

    async def handler(cur: ACursor, m: Message) -> None:
        seen[m.message_id] += 1
        await cur.execute(CREDIT_SQL, credit_args(m))
        if m.message_id == flaky.message_id and seen[m.message_id] == 1:
            raise LookupError("the first attempt fails")

    other = message(uid(), 1)
    results = await inbox.handle_batch([once, flaky, other, once, flaky], handler)
    assert [r.outcome for r in results] == [
        Outcome.APPLIED,
        Outcome.FAILED,
        Outcome.APPLIED,
        Outcome.DUPLICATE,
        Outcome.APPLIED,
    ]
    assert seen[once.message_id] == 1 and seen[flaky.message_id] == 2
    assert_applied_exactly(domain, {once.message_id: 5, flaky.message_id: 7, other.message_id: 1})
    assert failed_attempts(domain, flaky.message_id) == 1
    assert len(inbox_rows(domain, flaky.message_id)) == 1


async def test_apply_apply_batch_and_handle_batch(db_dsn: str, domain: Conn, route: Route) -> None:
    done = message(uid(), 1)
    fresh = [message(uid(), 2) for _ in range(66)]
    mine = [message(uid(), 3) for _ in range(3)]
    poison = message(uid(), 4)

    async def handler(cur: ACursor, m: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(m))
        if m.message_id == poison.message_id:
            raise LookupError("unknown customer")

    async with await aconnect(route(db_dsn)) as c:
        inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY)
        first = await inbox.apply(done)
        applied = await inbox.apply_batch([fresh[0], done, message(done.message_id, 9), message(uid(), -1), *fresh[1:]])
        handled = await inbox.handle_batch([mine[0], poison, fresh[0], *mine[1:]], handler)
    assert first.outcome is Outcome.APPLIED
    assert [r.outcome for r in applied[:4]] == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.CONFLICT, Outcome.FAILED]
    assert [r.outcome for r in applied[4:]] == [Outcome.APPLIED] * 65
    assert [r.outcome for r in handled] == [
        Outcome.APPLIED,
        Outcome.FAILED,
        Outcome.DUPLICATE,
        Outcome.APPLIED,
        Outcome.APPLIED,
    ]
    assert isinstance(handled[1].exception, LookupError)
    assert_applied_exactly(
        domain, {done.message_id: 1, **{m.message_id: 2 for m in fresh}, **{m.message_id: 3 for m in mine}}
    )
    assert failed_attempts(domain, poison.message_id) == 1


# ----------------------------------------------------------------------------- retries


async def test_serialization_failures_are_retried(db_dsn: str, domain: Conn, route: Route, pipeline: bool) -> None:
    """Two consumers at REPEATABLE READ credit the same account row: the second to update gets a
    real 40001, runs its whole transaction again, and both messages are applied exactly once."""
    both_read = abarrier_once(2)

    async def handler(cur: ACursor, m: Message) -> None:
        await cur.execute("SELECT balance FROM account WHERE id = 1")
        await both_read()  # both snapshots are taken before either updates
        await cur.execute(CREDIT_SQL, credit_args(m))

    errors: Counter[str] = Counter()

    async def run(message_id: str) -> Result:
        async with await aconnect(route(db_dsn)) as c:
            await c.set_isolation_level(IsolationLevel.REPEATABLE_READ)
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY, pipeline=pipeline)
            result = await inbox.handle(message(message_id, 5), handler)
            errors.update(inbox.stats.transient_errors)
            return result

    ids = [uid("rr"), uid("rr")]
    results = await agather(*(partial(run, i) for i in ids))
    assert [r.outcome for r in results] == [Outcome.APPLIED, Outcome.APPLIED]
    assert sum(r.retries for r in results) >= 1
    assert errors["40001"] == sum(r.retries for r in results)
    retried = max(results, key=lambda r: r.retries)
    assert retried.lock_wait_seconds > 0
    assert_applied_exactly(domain, dict.fromkeys(ids, 5))


async def test_deadlocks_are_retried(db_dsn: str, domain: Conn, route: Route) -> None:
    """Two handlers lock accounts 1 and 2 in opposite order: PostgreSQL kills one with 40P01,
    its transaction runs again, and each message is applied exactly once to each account."""
    both_locked = abarrier_once(2)

    async def handler(cur: ACursor, m: Message) -> None:
        first, second = m.payload["order"]
        await cur.execute(CREDIT_SQL, (first, m.message_id, 1))
        await both_locked()
        await cur.execute(CREDIT_SQL, (second, m.message_id, 1))

    errors: Counter[str] = Counter()

    async def run(message_id: str, order: list[int]) -> Result:
        options = SAFE_OPTIONS + " -c deadlock_timeout=50ms"
        async with await aconnect(route(db_dsn), options=options, autocommit=True) as c:
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY)
            result = await inbox.handle(Message("orders", message_id, "credit", {"order": order}), handler)
            errors.update(inbox.stats.transient_errors)
            return result

    jobs = [(uid("dl"), [1, 2]), (uid("dl"), [2, 1])]
    results = await agather(*(partial(run, *job) for job in jobs))
    assert [r.outcome for r in results] == [Outcome.APPLIED, Outcome.APPLIED]
    assert sum(r.retries for r in results) >= 1
    assert errors["40P01"] >= 1
    assert max(r.lock_wait_seconds for r in results) >= 0.04  # at least deadlock_timeout
    for account in (1, 2):
        assert ledger_counts(domain, account) == {jobs[0][0]: 1, jobs[1][0]: 1}
        assert balance(domain, account) == 2


async def test_serialization_failures_and_deadlocks_are_retried(db_dsn: str, domain: Conn, route: Route) -> None:
    rr_ids = [uid("rr"), uid("rr")]
    dl_ids = [uid("dl"), uid("dl")]
    errors: Counter[str] = Counter()
    rr_read = abarrier_once(2)
    dl_locked = abarrier_once(2)

    async def rr_handler(cur: ACursor, m: Message) -> None:
        await cur.execute("SELECT balance FROM account WHERE id = 1")
        await rr_read()
        await cur.execute(CREDIT_SQL, credit_args(m))

    async def dl_handler(cur: ACursor, m: Message) -> None:
        first, second = m.payload["order"]
        await cur.execute(CREDIT_SQL, (first, m.message_id, 1))
        await dl_locked()
        await cur.execute(CREDIT_SQL, (second, m.message_id, 1))

    async def deliver(m: Message, handler: AsyncHandler, **kw: Any) -> Result:
        async with await aconnect(route(db_dsn), **kw) as c:
            if kw.get("autocommit") is None:
                await c.set_isolation_level(IsolationLevel.REPEATABLE_READ)
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY)
            result = await inbox.handle(m, handler)
            errors.update(inbox.stats.transient_errors)
            return result

    rr = await agather(*(partial(deliver, message(i, 5), rr_handler) for i in rr_ids))
    dl = await agather(
        *(
            partial(
                deliver,
                Message("orders", i, "credit", {"order": order}),
                dl_handler,
                autocommit=True,
                options=SAFE_OPTIONS + " -c deadlock_timeout=50ms",
            )
            for i, order in zip(dl_ids, ([1, 2], [2, 1]), strict=True)
        )
    )
    assert [r.outcome for r in rr + dl] == [Outcome.APPLIED] * 4
    assert errors["40001"] >= 1 and errors["40P01"] >= 1
    assert sum(r.retries for r in rr) >= 1 and sum(r.retries for r in dl) >= 1
    assert max(r.lock_wait_seconds for r in dl) >= 0.04
    assert ledger_counts(domain, 1) == {rr_ids[0]: 1, rr_ids[1]: 1, dl_ids[0]: 1, dl_ids[1]: 1}
    assert ledger_counts(domain, 2) == {dl_ids[0]: 1, dl_ids[1]: 1}
    assert balance(domain, 1) == 12 and balance(domain, 2) == 2


async def test_lock_timeouts_are_retried(client: AConn, domain: Conn, db_dsn: str) -> None:
    m = message(uid(), 3)
    attempts = Calls()

    async def handler(cur: ACursor, msg: Message) -> None:
        attempts()
        await cur.execute("SET LOCAL lock_timeout = '30ms'")
        await cur.execute(CREDIT_SQL, credit_args(msg))

    with autocommit_connect(db_dsn) as blocker:
        blocker.execute("BEGIN")
        blocker.execute("SELECT 1 FROM account WHERE id = 1 FOR UPDATE")
        release = threading.Timer(0.15, blocker.execute, ("ROLLBACK",))
        release.start()
        retry = RetryPolicy(max_attempts=20, base_delay=0.02, max_delay=0.05)
        slow = AsyncInbox(client, consumer="billing", retry=retry)
        result = await slow.handle(m, handler)
        release.join()
    assert result.outcome is Outcome.APPLIED
    assert result.retries >= 1 and result.retries == attempts.n - 1
    assert slow.stats.transient_errors.get("55P03", 0) == result.retries
    assert_applied_exactly(domain, {m.message_id: 3})


async def test_retries_are_bounded(client: AConn, domain: Conn) -> None:
    m = message(uid())
    retry = RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.002)
    bounded = AsyncInbox(client, consumer="billing", retry=retry)

    async def always_conflicts(cur: ACursor, msg: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(msg))
        await cur.execute("DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40001'; END $$")

    with pytest.raises(RetriesExhausted) as caught:
        await bounded.handle(m, always_conflicts)
    assert caught.value.attempts == 3
    assert isinstance(caught.value.__cause__, psycopg.errors.SerializationFailure)
    assert bounded.stats.retries_exhausted == 1 and bounded.stats.retries == 2
    # Transient errors are not the message's fault: nothing recorded, nothing applied.
    assert failed_attempts(domain, m.message_id) == 0
    assert ledger_counts(domain) == {} and inbox_rows(domain, m.message_id) == []


async def test_retries_are_bounded_on_deadlocks(db_dsn: str, domain: Conn, route: Route) -> None:
    async def conflicts(cur: ACursor, msg: Message) -> None:
        await cur.execute("DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40P01'; END $$")

    async with await aconnect(route(db_dsn)) as c:
        inbox = AsyncInbox(c, consumer="billing", retry=RetryPolicy(max_attempts=2, base_delay=0.001))
        with pytest.raises(RetriesExhausted) as caught:
            await inbox.handle(message(uid()), conflicts)
        assert isinstance(caught.value.__cause__, psycopg.errors.DeadlockDetected)
        assert inbox.stats.retries == 1
    assert ledger_counts(domain) == {}


async def test_connection_lost_in_handler_is_retried_on_a_new_connection(
    direct_client: AConn, domain: Conn, pipeline: bool
) -> None:
    client = direct_client
    inbox = AsyncInbox(client, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=pipeline)
    m = message(uid(), 4)
    timers: list[threading.Timer] = []

    async def handler(cur: ACursor, msg: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(msg))
        if not timers:
            pid = cur.connection.info.backend_pid
            timers.append(threading.Timer(0.1, domain.execute, ("SELECT pg_terminate_backend(%s)", (pid,))))
            timers[0].start()
            await cur.execute("SELECT pg_sleep(10)")

    result = await inbox.handle(m, handler)
    timers[0].join()
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    assert inbox.connection is not client and client.closed
    assert inbox.stats.transient_errors.get("57P01", 0) + inbox.stats.transient_errors.get("connection", 0) == 1
    assert_applied_exactly(domain, {m.message_id: 4})
    await inbox.close()


def test_transient_classification(domain: Conn) -> None:
    def error(state: str) -> psycopg.Error:
        try:
            domain.execute(
                sql.SQL("DO $$ BEGIN RAISE EXCEPTION 'x' USING ERRCODE = {}; END $$").format(sql.Literal(state))
            )
        except psycopg.Error as exc:
            return exc
        raise AssertionError("no error")

    assert classify(error("40001")) is TransientKind.CONFLICT
    assert classify(error("40P01")) is TransientKind.CONFLICT
    assert classify(error("55P03")) is TransientKind.CONFLICT
    assert classify(error("57014")) is TransientKind.TIMEOUT
    assert classify(error("53300")) is TransientKind.RESOURCES
    assert classify(error("08006")) is TransientKind.CONNECTION
    assert not is_transient(error("23505")) and not is_transient(ValueError())
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = error("40001")
    assert is_transient(wrapped)


def test_retry_policy() -> None:
    policy = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.05)
    for retry in range(1, 10):
        cap = min(0.05, 0.01 * 2 ** (retry - 1))
        assert all(0 <= policy.backoff(retry) <= cap for _ in range(50))
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


# ----------------------------------------------------------------------------- unknown COMMIT outcome


async def test_backend_killed_during_commit_is_found_aborted_and_retried(
    inbox: AsyncInbox, client: AConn, domain: Conn
) -> None:
    """COMMIT blocks in a deferred trigger; the backend is terminated there. The transaction did not
    commit: pg_xact_status says 'aborted', the delivery runs again and applies once."""
    domain.execute(COMMIT_DELAY_DDL)
    domain.execute("UPDATE commit_delay SET seconds = 30")
    m = message(uid(), 6)
    killer = ThreadPoolExecutor(1)
    killed = killer.submit(terminate_backend_in_commit, domain)
    result = await inbox.handle(m, credit())
    assert killed.result(timeout=30) > 0
    killer.shutdown()
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    stats = inbox.stats
    assert (stats.unknown_commits, stats.unknown_committed) == (1, 0)
    assert_applied_exactly(domain, {m.message_id: 6})
    assert (await inbox.handle(m, credit())).outcome is Outcome.DUPLICATE
    await inbox.close()


async def test_backend_killed_during_commit(db_dsn: str, domain: Conn) -> None:
    domain.execute(COMMIT_DELAY_DDL)
    domain.execute("UPDATE commit_delay SET seconds = 30")
    m = message(uid(), 6)
    async with await aconnect(db_dsn) as c:
        inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY)
        with ThreadPoolExecutor(1) as killer:
            killed = killer.submit(terminate_backend_in_commit, domain)
            result = await inbox.handle(m, credit())
            killed.result(timeout=30)
        assert (inbox.stats.unknown_commits, inbox.stats.unknown_committed) == (1, 0)
        await inbox.close()
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    assert_applied_exactly(domain, {m.message_id: 6})


async def test_backend_killed_during_commit_with_a_pool(db_dsn: str, domain: Conn) -> None:
    domain.execute(COMMIT_DELAY_DDL)
    domain.execute("UPDATE commit_delay SET seconds = 30")
    m = message(uid(), 6)
    async with AsyncConnectionPool(
        db_dsn, min_size=1, max_size=2, open=False, kwargs={"options": SAFE_OPTIONS}
    ) as pool:
        inbox = AsyncInbox(pool, consumer="billing", retry=FAST_RETRY)
        with ThreadPoolExecutor(1) as killer:
            killed = killer.submit(terminate_backend_in_commit, domain)
            result = await inbox.handle(m, credit())
            killed.result(timeout=30)
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    assert inbox.stats.unknown_commits == 1
    assert_applied_exactly(domain, {m.message_id: 6})


async def test_commit_whose_answer_is_lost_is_found_committed(db_dsn: str, domain: Conn, pipeline: bool) -> None:
    """The COMMIT reaches the server and commits; the client's connection is lost before the answer.
    pg_xact_status says 'committed': APPLIED, with no second application and no retry."""
    m = message(uid(), 8)
    calls = Calls()
    with CommitDroppingProxy(db_dsn) as proxy:
        async with await aconnect(proxy.dsn) as c:
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY, pipeline=pipeline)
            proxy.arm()
            result = await inbox.handle(m, credit(calls))
            assert proxy.dropped.is_set() and c.closed
            assert result.outcome is Outcome.APPLIED and result.retries == 0
            assert calls.n == 1
            assert (inbox.stats.unknown_commits, inbox.stats.unknown_committed) == (1, 1)
            assert (await inbox.handle(m, credit(calls))).outcome is Outcome.DUPLICATE
            await inbox.close()
    assert_applied_exactly(domain, {m.message_id: 8})


async def test_commit_whose_answer_is_lost(db_dsn: str, domain: Conn, pipeline: bool) -> None:
    m = message(uid(), 8)
    with CommitDroppingProxy(db_dsn) as proxy:
        async with await aconnect(proxy.dsn) as c:
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY, pipeline=pipeline)
            proxy.arm()
            result = await inbox.handle(m, credit())
            assert proxy.dropped.is_set() and c.closed
            assert (inbox.stats.unknown_commits, inbox.stats.unknown_committed) == (1, 1)
            again = await inbox.handle(m, credit())
            await inbox.close()
    assert result.outcome is Outcome.APPLIED and result.retries == 0
    assert again.outcome is Outcome.DUPLICATE
    assert_applied_exactly(domain, {m.message_id: 8})


async def test_apply_commit_answer_lost(db_dsn: str, domain: Conn) -> None:
    m = message(uid(), 8)
    with CommitDroppingProxy(db_dsn) as proxy:
        async with await psycopg.AsyncConnection.connect(proxy.dsn, autocommit=True) as c:
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY)
            await inbox.check_schema()
            proxy.arm()
            result = await inbox.apply(m)
            assert proxy.dropped.is_set()
            assert result.outcome is Outcome.APPLIED and inbox.stats.unknown_committed == 1
            await inbox.close()
    assert_applied_exactly(domain, {m.message_id: 8})


# ----------------------------------------------------------------------------- pools and concurrency


async def test_pool_many_workers_racing_duplicates(db_dsn: str, domain: Conn, route: Route) -> None:
    """8 workers share a pool; every message is delivered three times at once."""
    messages = [message(uid("pool"), 1) for _ in range(30)]
    deliveries = [m for m in messages for _ in range(3)]
    async with AsyncConnectionPool(
        route(db_dsn), min_size=4, max_size=8, open=False, kwargs={"options": SAFE_OPTIONS}
    ) as pool:
        await pool.wait()
        inbox = AsyncInbox(pool, consumer="billing", handler_version="v2", retry=FAST_RETRY)
        results = await agather(*(partial(inbox.handle, m, credit()) for m in deliveries), concurrency=8)
        batch = await agather(*(partial(inbox.apply, m) for m in deliveries[:9]), concurrency=8)
    counts = Counter(r.outcome for r in results)
    assert counts == {Outcome.APPLIED: 30, Outcome.DUPLICATE: 60}
    assert all(r.outcome is Outcome.DUPLICATE for r in batch)
    assert_applied_exactly(domain, {m.message_id: 1 for m in messages})
    assert inbox.stats.deliveries == 99


async def test_pool_racing_duplicates(db_dsn: str, domain: Conn, route: Route) -> None:
    messages = [message(uid("pool"), 1) for _ in range(25)]
    async with AsyncConnectionPool(
        route(db_dsn), min_size=4, max_size=8, open=False, kwargs={"options": SAFE_OPTIONS}
    ) as pool:
        inbox = AsyncInbox(pool, consumer="billing", retry=FAST_RETRY)
        handled = await agather(
            *(partial(inbox.handle, m, credit()) for m in messages for _ in range(3)), concurrency=8
        )
        applied = await agather(*(partial(inbox.apply, m) for m in messages[:5]), concurrency=8)
    assert Counter(r.outcome for r in handled) == {Outcome.APPLIED: 25, Outcome.DUPLICATE: 50}
    assert all(r.outcome is Outcome.DUPLICATE for r in applied)
    assert_applied_exactly(domain, {m.message_id: 1 for m in messages})


async def test_inbox_rejects_wrong_arguments(client: AConn) -> None:
    with pytest.raises(TypeError, match=r"psycopg\.AsyncConnection"):
        AsyncInbox("dbname=x", consumer="billing")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AsyncInbox(client, consumer="")
    inbox = AsyncInbox(client, consumer="billing")
    with pytest.raises(TypeError, match="Message"):
        await inbox.handle(("orders", "1"), credit())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AsyncInbox(client, consumer="billing", batch_size=65)


# @ async: one copy checks both flavours
async def test_sync_and_async_types_are_not_mixed(conn: Conn, db_dsn: str) -> None:
    from pginbox import Inbox

    with pytest.raises(TypeError, match=r"pginbox\.Inbox"):
        AsyncInbox(conn, consumer="billing")  # type: ignore[arg-type]
    async with await aconnect(db_dsn) as c:
        with pytest.raises(TypeError, match="AsyncInbox"):
            Inbox(c, consumer="billing")  # type: ignore[arg-type]


# @ end
async def test_bad_input_raises_the_database_error(inbox: AsyncInbox, domain: Conn) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="must not be empty"):
        await inbox.handle(Message("orders", "", "credit", {}), credit())
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        await inbox.apply_batch([message(uid()), Message("", "x", "credit", {})])
    with pytest.raises(psycopg.errors.UndefinedObject, match="no handler registered"):
        await inbox.apply(Message("orders", uid(), "no_such_type", {}))
    with pytest.raises(TypeError):
        await inbox.handle(Message("orders", uid(), "credit", {"when": object()}), credit())
    # The connection is still usable, and nothing was written or recorded.
    m = message(uid())
    assert (await inbox.handle(m, credit())).outcome is Outcome.APPLIED
    assert_applied_exactly(domain, {m.message_id: 10})
    assert domain.execute("SELECT count(*) FROM inbox.attempt").fetchone() == (0,)


async def test_interrupts_are_not_failures(inbox: AsyncInbox, domain: Conn) -> None:
    """KeyboardInterrupt / SystemExit in a handler: rolled back, not recorded, propagated."""
    m = message(uid())

    async def interrupted(cur: ACursor, msg: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(msg))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await inbox.handle(m, interrupted)
    assert ledger_counts(domain) == {} and failed_attempts(domain, m.message_id) == 0
    assert (await inbox.handle(m, credit())).outcome is Outcome.APPLIED


async def test_transient_error_in_a_sql_handler_is_retried(client: AConn, domain: Conn) -> None:
    """claim_and_apply re-raises a transient error of the SQL handler: the whole transaction is
    retried (here it always fails, so the policy gives up), and nothing is recorded."""
    inbox = AsyncInbox(client, consumer="billing", retry=RetryPolicy(max_attempts=3, base_delay=0.001))
    m = Message("orders", uid(), "raising_credit", {"id": "x", "amount": 1, "sqlstate": "40P01"})
    with pytest.raises(RetriesExhausted) as caught:
        await inbox.apply(m)
    assert caught.value.attempts == 3
    assert isinstance(caught.value.__cause__, psycopg.errors.DeadlockDetected)
    assert inbox.stats.transient_errors == {"40P01": 3}
    assert ledger_counts(domain) == {} and failed_attempts(domain, m.message_id) == 0


# ----------------------------------------------------------------------------- schema version


async def test_schema_version_is_checked(inbox: AsyncInbox) -> None:
    assert await inbox.check_schema() == 3  # release 0.3.0


def scratch_db(pg_base: str) -> Iterator[str]:
    from conftest import create_database, drop_database, dsn_for

    name = f"scratch_{uuid.uuid4().hex[:12]}"
    create_database(pg_base, name)
    try:
        yield dsn_for(pg_base, name)
    finally:
        drop_database(pg_base, name)


@pytest.fixture
def empty_dsn(pg_base: str) -> Iterator[str]:
    yield from scratch_db(pg_base)


async def test_missing_schema_is_refused(empty_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(empty_dsn) as c:
        inbox = AsyncInbox(c, consumer="billing")
        with pytest.raises(SchemaVersionError, match="pginbox deploy --dsn") as caught:
            await inbox.handle(message(uid()), credit())
        assert caught.value.found is None
        await c.execute("CREATE SCHEMA inbox")
        await c.commit()
        with pytest.raises(SchemaVersionError, match="not deployed"):
            await inbox.apply(message(uid()))


def release_function(version: int, breaking_since: int) -> sql.Composed:
    return sql.SQL(
        "CREATE OR REPLACE FUNCTION inbox.schema_release(OUT version integer, OUT release text,"
        " OUT breaking_since integer) LANGUAGE sql AS $$ SELECT {}, {}, {} $$"
    ).format(sql.Literal(version), sql.Literal(f"0.{version}.0"), sql.Literal(breaking_since))


@pytest.mark.parametrize(
    ("version", "breaking_since", "advice"),
    [(99, 99, "upgrade the pginbox Python package"), (0, 0, "pginbox deploy")],
)
async def test_unknown_schema_version_is_refused(
    empty_dsn: str, version: int, breaking_since: int, advice: str
) -> None:
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute("CREATE SCHEMA inbox")
        await c.execute(release_function(version, breaking_since))
        inbox = AsyncInbox(c, consumer="billing")
        with pytest.raises(SchemaVersionError, match=advice) as caught:
            await inbox.check_schema()
        assert caught.value.found == version
        with pytest.raises(SchemaVersionError):
            await inbox.apply_batch([message(uid())])


async def test_schema_version_refusal(empty_dsn: str) -> None:
    async with await aconnect(empty_dsn, autocommit=True) as c:
        inbox = AsyncInbox(c, consumer="billing")
        with pytest.raises(SchemaVersionError, match="pginbox deploy"):
            await inbox.handle(message(uid()), credit())
        await c.execute("CREATE SCHEMA inbox")
        await c.execute(release_function(7, 7))
        with pytest.raises(SchemaVersionError, match="upgrade") as caught:
            await inbox.apply(message(uid()))
        assert caught.value.found == 7
        # A newer release that breaks nothing this client knows: served, with a warning.
        await c.execute(release_function(7, 1))
        with pytest.warns(SchemaNewerWarning, match="compatible"):
            assert await inbox.check_schema() == 7
        # The release before this client's (0.1.0) works with it too: 0.2.0 broke nothing.
        await c.execute(release_function(1, 1))
        assert await inbox.check_schema() == 1
