# Generated from test_library_async.py by python/tools/async_to_sync.py: DO NOT EDIT.
# Edit tests/python/integration/test_library_async.py, then run the script (tests/run checks this file).
"""The Python client `pginbox.Inbox` against a real PostgreSQL: every public call and outcome,
the failure recording, crash loops, retries driven by real serialization failures, deadlocks and
lock timeouts, connections lost before and during COMMIT, and the schema-version check.

Every assertion about effects reads the domain tables (account, ledger) and the inbox tables.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from acompat import barrier_once, connect, gather
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
from psycopg_pool import ConnectionPool

from pginbox import (
    Handler,
    HandlerProtocolError,
    Inbox,
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

Conn = psycopg.Connection[Any]
Cursor = psycopg.Cursor[Any]
Route = Callable[[str], str]
CHILD = TESTS_DIR / "_library_child.py"
FAST_RETRY = RetryPolicy(max_attempts=5, base_delay=0.005, max_delay=0.05)


@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


@pytest.fixture
def client(db_dsn: str, domain: Conn, route: Route) -> Iterator[Conn]:
    """The connection the Inbox under test uses (not autocommit: Inbox must cope), directly
    or through PgBouncer in transaction mode (`route`: the tests that take it run both ways)."""
    with psycopg.connect(route(db_dsn), options=SAFE_OPTIONS) as c:
        yield c


@pytest.fixture
def direct_client(db_dsn: str, domain: Conn) -> Iterator[Conn]:
    """`client`, always direct: for the tests that terminate the backend of the client's session
    (behind PgBouncer the client does not know which backend serves it)."""
    with psycopg.connect(db_dsn, options=SAFE_OPTIONS) as c:
        yield c


@pytest.fixture(params=[True, False], ids=["pipeline", "no-pipeline"])
def pipeline(request: pytest.FixtureRequest) -> bool:
    """Both ways of starting a transaction: BEGIN in the claim's round trip, or on its own."""
    return bool(request.param)


@pytest.fixture
def inbox(client: Conn, pipeline: bool) -> Inbox:
    return Inbox(client, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=pipeline)


def credit(calls: Calls | None = None) -> Handler:
    """A Python handler: one apply_credit (balance + ledger row) per message."""

    def handler(cur: Cursor, m: Message) -> None:
        if calls is not None:
            calls()
        cur.execute(CREDIT_SQL, credit_args(m))

    return handler


def uid(prefix: str = "m") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# ----------------------------------------------------------------------------- handle


def test_handle_applies_once_then_duplicate_then_conflict(inbox: Inbox, domain: Conn) -> None:
    calls = Calls()
    m = message(uid(), 10)
    first = inbox.handle(m, credit(calls))
    assert first.outcome is Outcome.APPLIED and first.ack
    assert first.payload_sha256 == canonical_sha256(domain, m.payload)
    assert first.handler_version == "v1" and first.processed_at is not None
    assert (first.retries, first.lock_wait_seconds) == (0, 0.0)

    again = inbox.handle(m, credit(calls))
    assert again.outcome is Outcome.DUPLICATE and again.ack
    assert again.stored_sha256 == first.payload_sha256

    other = inbox.handle(message(m.message_id, 99), credit(calls))
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


def test_handle_outcomes_with_a_given_connection(db_dsn: str, domain: Conn, route: Route, pipeline: bool) -> None:
    calls = Calls()
    m = message(uid(), 10)
    with connect(route(db_dsn)) as c:
        inbox = Inbox(c, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=pipeline)
        first = inbox.handle(m, credit(calls))
        again = inbox.handle(m, credit(calls))
        other = inbox.handle(message(m.message_id, 11), credit(calls))
        assert c.autocommit is False and inbox.connection is c
        assert inbox.stats.deliveries == 3
    assert first.outcome is Outcome.APPLIED and first.payload_sha256 == canonical_sha256(domain, m.payload)
    assert again.outcome is Outcome.DUPLICATE
    assert other.outcome is Outcome.CONFLICT and other.quarantine_id is not None
    assert calls.n == 1
    assert_applied_exactly(domain, {m.message_id: 10})


def test_a_local_server_gets_no_pipeline_by_default(db_dsn: str, domain: Conn, tmp_path: Path) -> None:
    """The default (pipeline=None) sends BEGIN as a simple query of its own to a server on this
    machine, and BEGIN + the claim in one pipelined round trip when told to."""
    traces: dict[bool | None, str] = {}
    applied: dict[str, int] = {}
    for setting in (None, True):
        trace = tmp_path / f"trace-{setting}.txt"
        m = message(uid(), 1)
        with trace.open("w") as out, connect(db_dsn) as c:
            inbox = Inbox(c, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=setting)
            c.pgconn.trace(out.fileno())
            assert inbox.handle(m, credit()).outcome is Outcome.APPLIED
            c.pgconn.untrace()
        traces[setting] = trace.read_text()
        applied[m.message_id] = 1
    assert_applied_exactly(domain, applied)
    simple_begin = [line for line in traces[None].splitlines() if "\tQuery\t" in line and "BEGIN" in line]
    assert simple_begin, traces[None]
    assert not [line for line in traces[True].splitlines() if "\tQuery\t" in line and "BEGIN" in line]
    assert "inbox.claim" in traces[True] and "inbox.claim" in traces[None]


def test_handle_keeps_the_callers_connection_settings(inbox: Inbox, client: Conn) -> None:
    assert client.autocommit is False
    assert inbox.handle(message(uid()), credit()).outcome is Outcome.APPLIED
    assert client.autocommit is False
    assert client.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert inbox.connection is client


def test_handle_refuses_a_connection_inside_a_transaction(inbox: Inbox, client: Conn, domain: Conn) -> None:
    client.execute("SELECT 1")  # opens a transaction (not autocommit)
    with pytest.raises(PginboxError, match="inside a transaction"):
        inbox.handle(message(uid()), credit())
    client.rollback()
    assert ledger_counts(domain) == {}


def test_handler_exception_rolls_back_claim_and_writes_and_is_recorded(inbox: Inbox, domain: Conn) -> None:
    m = message(uid(), 10)

    def broken(cur: Cursor, msg: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(msg))  # written, then rolled back
        raise ValueError("ledger service rejected the entry")

    result = inbox.handle(m, broken)
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
    fixed = inbox.handle(m, credit())
    assert fixed.outcome is Outcome.APPLIED
    assert_applied_exactly(domain, {m.message_id: 10})


def test_handler_failure_is_rolled_back_and_recorded(db_dsn: str, domain: Conn, route: Route) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    m = message(uid(), 10)

    def broken(cur: Cursor, msg: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(msg))
        raise ValueError("rejected")

    def swallows(cur: Cursor, msg: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(msg))
        try:
            cur.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            return

    with connect(route(db_dsn), autocommit=True) as c:
        inbox = Inbox(c, consumer="billing", handler_version="v1")
        failed = inbox.handle(m, broken)
        assert ledger_counts(domain) == {} and inbox_rows(domain, m.message_id) == []
        with pytest.raises(ValueError) as caught:
            inbox.handle(m, broken, raise_on_failure=True)
        assert any("recorded as quarantined" in note for note in caught.value.__notes__)
        held = inbox.handle(m, credit())
        other = inbox.handle(message(uid()), swallows)
    assert failed.outcome is Outcome.FAILED and failed.reason_code == "ValueError"
    assert isinstance(failed.exception, ValueError) and failed.attempts == 1
    assert held.outcome is Outcome.QUARANTINED and held.quarantine_id is not None
    assert other.outcome is Outcome.FAILED and isinstance(other.exception, HandlerProtocolError)
    assert failed_attempts(domain, m.message_id) == 2
    assert ledger_counts(domain) == {} and balance(domain) == 0


def test_failures_reach_quarantine_at_max_attempts(inbox: Inbox, domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    calls = Calls()
    m = message(uid())

    def broken(cur: Cursor, msg: Message) -> None:
        calls()
        raise RuntimeError("downstream refused")

    assert inbox.handle(m, broken).outcome is Outcome.FAILED
    held = inbox.handle(m, broken)
    assert held.outcome is Outcome.QUARANTINED and held.ack
    assert held.quarantine_id is not None and held.attempts == 2 and held.reason_code == "RuntimeError"
    # Held: the next delivery does not run the handler.
    later = inbox.handle(m, broken)
    assert later.outcome is Outcome.QUARANTINED and later.quarantine_id == held.quarantine_id
    assert calls.n == 2
    assert ledger_counts(domain) == {}
    assert inbox.stats.outcomes == {Outcome.FAILED: 1, Outcome.QUARANTINED: 2}


def test_reason_codes(inbox: Inbox, domain: Conn) -> None:
    class InvalidAccount(Exception):
        reason_code = "invalid_account"

    def coded(cur: Cursor, m: Message) -> None:
        raise InvalidAccount("account 7 is closed")

    def violates(cur: Cursor, m: Message) -> None:
        cur.execute("UPDATE account SET id = NULL WHERE id = 1")  # not-null violation

    def named_constraint(cur: Cursor, m: Message) -> None:
        cur.execute("INSERT INTO ledger (account, message_id, amount) VALUES (42, 'x', 1)")  # FK

    assert inbox.handle(message(uid()), coded).reason_code == "invalid_account"
    assert inbox.handle(message(uid()), violates).reason_code == "23502"
    assert inbox.handle(message(uid()), named_constraint).reason_code == "ledger_account_fkey"
    assert ledger_counts(domain) == {}


def test_raise_on_failure_reraises_after_recording(client: Conn, domain: Conn) -> None:
    inbox = Inbox(client, consumer="billing", handler_version="v1", raise_on_failure=True)
    m = message(uid())

    def broken(cur: Cursor, msg: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(msg))
        raise KeyError("missing field")

    with pytest.raises(KeyError) as caught:
        inbox.handle(m, broken)
    assert any("recorded as failed" in note for note in caught.value.__notes__)
    assert failed_attempts(domain, m.message_id) == 1
    assert ledger_counts(domain) == {}
    # Per call, the default can be overridden.
    assert inbox.handle(m, broken, raise_on_failure=False).outcome is Outcome.FAILED
    assert failed_attempts(domain, m.message_id) == 2


def test_handler_that_swallows_a_database_error_fails(inbox: Inbox, domain: Conn) -> None:
    m = message(uid())

    def swallows(cur: Cursor, msg: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(msg))
        # The transaction is failed after this: returning does not make it commit.
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            cur.execute("SELECT 1 / 0")

    result = inbox.handle(m, swallows)
    assert result.outcome is Outcome.FAILED and result.reason_code == "25P02"
    assert isinstance(result.exception, HandlerProtocolError)
    assert ledger_counts(domain) == {} and inbox_rows(domain, m.message_id) == []


def test_handler_may_not_end_the_transaction(inbox: Inbox, domain: Conn) -> None:
    def commits(cur: Cursor, msg: Message) -> None:
        cur.connection.commit()

    with pytest.raises(HandlerProtocolError, match="ended the transaction"):
        inbox.handle(message(uid()), commits)


def test_handler_savepoint_inside_the_transaction(inbox: Inbox, domain: Conn) -> None:
    """A handler may use savepoints (connection.transaction()) to recover from its own errors."""
    m = message(uid(), 5)

    def careful(cur: Cursor, msg: Message) -> None:
        try:
            with cur.connection.transaction():
                cur.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass
        cur.execute(CREDIT_SQL, credit_args(msg))

    assert inbox.handle(m, careful).outcome is Outcome.APPLIED
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


def test_redelivered_message_is_processed_normally_below_the_limit(inbox: Inbox, domain: Conn) -> None:
    m = message(uid(), 7, redelivered=True)
    assert inbox.handle(m, credit()).outcome is Outcome.APPLIED
    assert_applied_exactly(domain, {m.message_id: 7})
    started = domain.execute("SELECT started FROM inbox.attempt WHERE message_id = %s", (m.message_id,)).fetchone()
    assert started == (1,)


# ----------------------------------------------------------------------------- apply


def test_apply_outcomes(inbox: Inbox, domain: Conn) -> None:
    m = message(uid(), 10)
    first = inbox.apply(m)
    assert first.outcome is Outcome.APPLIED and first.handler_version == "v1"
    assert inbox.apply(m).outcome is Outcome.DUPLICATE
    assert inbox.apply(message(m.message_id, 11)).outcome is Outcome.CONFLICT
    failed = inbox.apply(message(uid(), -5))  # the SQL handler refuses negative amounts
    assert failed.outcome is Outcome.FAILED and failed.reason_code == "23514" and failed.attempts == 1
    assert_applied_exactly(domain, {m.message_id: 10})


def test_apply_redelivered_crash_loop(inbox: Inbox, domain: Conn) -> None:
    """max_attempts 2: the first delivery crashed (nothing recorded), the first redelivery announced
    itself and crashed too; the second redelivery is quarantined without running the handler."""
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    m = message(uid(), redelivered=True)
    domain.execute("SELECT inbox.record_start('billing', 'orders', %s, message_type => 'credit')", (m.message_id,))
    held = inbox.apply(m)
    assert held.outcome is Outcome.QUARANTINED and held.reason_code == "crash_loop"
    assert ledger_counts(domain) == {}


def test_apply_batch_results_in_input_order(inbox: Inbox, domain: Conn) -> None:
    done = message(uid(), 1)
    assert inbox.apply(done).outcome is Outcome.APPLIED
    fresh = [message(uid(), 2) for _ in range(70)]  # more than one chunk of 64
    batch = [fresh[0], done, message(done.message_id, 99), message(uid(), -1), *fresh[1:], fresh[0]]
    results = inbox.apply_batch(batch)
    outcomes = [r.outcome for r in results]
    assert outcomes[:4] == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.CONFLICT, Outcome.FAILED]
    assert outcomes[4:-1] == [Outcome.APPLIED] * 69
    # The same message twice in one call: the second sees the first (a different chunk).
    assert outcomes[-1] is Outcome.DUPLICATE
    assert results[3].reason_code == "23514"
    assert results[0].payload_sha256 == canonical_sha256(domain, batch[0].payload)
    assert_applied_exactly(domain, {done.message_id: 1, **{m.message_id: 2 for m in fresh}})
    assert inbox.apply_batch([]) == []


def test_apply_batch_with_crash_looping_redelivery(inbox: Inbox, domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 2)")
    looping = message(uid(), redelivered=True)
    domain.execute(  # its first redelivery crashed too
        "SELECT inbox.record_start('billing', 'orders', %s, message_type => 'credit')", (looping.message_id,)
    )
    redelivered = message(uid(), 3, redelivered=True)
    plain = message(uid(), 4)
    results = inbox.apply_batch([plain, looping, redelivered])
    assert [r.outcome for r in results] == [Outcome.APPLIED, Outcome.QUARANTINED, Outcome.APPLIED]
    assert results[1].reason_code == "crash_loop"
    assert_applied_exactly(domain, {plain.message_id: 4, redelivered.message_id: 3})


def test_handle_batch(inbox: Inbox, domain: Conn) -> None:
    done = message(uid(), 1)
    assert inbox.handle(done, credit()).outcome is Outcome.APPLIED
    poison = message(uid(), 3)
    fresh = [message(uid(), 2) for _ in range(66)]
    calls = Calls()

    def handler(cur: Cursor, m: Message) -> None:
        calls()
        cur.execute(CREDIT_SQL, credit_args(m))
        if m.message_id == poison.message_id:
            raise LookupError("no such customer")

    batch = [fresh[0], done, message(done.message_id, 9), poison, *fresh[1:]]
    results = inbox.handle_batch(batch, handler)
    assert [r.outcome for r in results[:4]] == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.CONFLICT, Outcome.FAILED]
    assert [r.outcome for r in results[4:]] == [Outcome.APPLIED] * 65
    assert results[3].reason_code == "LookupError" and isinstance(results[3].exception, LookupError)
    assert calls.n == 67  # not for the duplicate and the conflict
    # The poison message's writes rolled back to its savepoint; the others' stayed.
    assert_applied_exactly(domain, {done.message_id: 1, **{m.message_id: 2 for m in fresh}})
    assert failed_attempts(domain, poison.message_id) == 1
    assert inbox_rows(domain, poison.message_id) == []


def test_handle_batch_repeats_within_a_chunk(inbox: Inbox, domain: Conn) -> None:
    """The chunk is claimed in one statement: an identity repeated in it is decided after its first
    occurrence, by the handler's result: DUPLICATE after an applied one, claimed and run again after
    a failed one (whose claim was taken back). Nothing applied twice, nothing failed kept."""
    once = message(uid(), 5)
    flaky = message(uid(), 7)
    seen: Counter[str] = Counter()

    def handler(cur: Cursor, m: Message) -> None:
        seen[m.message_id] += 1
        cur.execute(CREDIT_SQL, credit_args(m))
        if m.message_id == flaky.message_id and seen[m.message_id] == 1:
            raise LookupError("the first attempt fails")

    other = message(uid(), 1)
    results = inbox.handle_batch([once, flaky, other, once, flaky], handler)
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


def test_apply_apply_batch_and_handle_batch(db_dsn: str, domain: Conn, route: Route) -> None:
    done = message(uid(), 1)
    fresh = [message(uid(), 2) for _ in range(66)]
    mine = [message(uid(), 3) for _ in range(3)]
    poison = message(uid(), 4)

    def handler(cur: Cursor, m: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(m))
        if m.message_id == poison.message_id:
            raise LookupError("unknown customer")

    with connect(route(db_dsn)) as c:
        inbox = Inbox(c, consumer="billing", retry=FAST_RETRY)
        first = inbox.apply(done)
        applied = inbox.apply_batch([fresh[0], done, message(done.message_id, 9), message(uid(), -1), *fresh[1:]])
        handled = inbox.handle_batch([mine[0], poison, fresh[0], *mine[1:]], handler)
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


def test_serialization_failures_are_retried(db_dsn: str, domain: Conn, route: Route, pipeline: bool) -> None:
    """Two consumers at REPEATABLE READ credit the same account row: the second to update gets a
    real 40001, runs its whole transaction again, and both messages are applied exactly once."""
    both_read = barrier_once(2)

    def handler(cur: Cursor, m: Message) -> None:
        cur.execute("SELECT balance FROM account WHERE id = 1")
        both_read()  # both snapshots are taken before either updates
        cur.execute(CREDIT_SQL, credit_args(m))

    errors: Counter[str] = Counter()

    def run(message_id: str) -> Result:
        with connect(route(db_dsn)) as c:
            c.set_isolation_level(IsolationLevel.REPEATABLE_READ)
            inbox = Inbox(c, consumer="billing", retry=FAST_RETRY, pipeline=pipeline)
            result = inbox.handle(message(message_id, 5), handler)
            errors.update(inbox.stats.transient_errors)
            return result

    ids = [uid("rr"), uid("rr")]
    results = gather(*(partial(run, i) for i in ids))
    assert [r.outcome for r in results] == [Outcome.APPLIED, Outcome.APPLIED]
    assert sum(r.retries for r in results) >= 1
    assert errors["40001"] == sum(r.retries for r in results)
    retried = max(results, key=lambda r: r.retries)
    assert retried.lock_wait_seconds > 0
    assert_applied_exactly(domain, dict.fromkeys(ids, 5))


def test_deadlocks_are_retried(db_dsn: str, domain: Conn, route: Route) -> None:
    """Two handlers lock accounts 1 and 2 in opposite order: PostgreSQL kills one with 40P01,
    its transaction runs again, and each message is applied exactly once to each account."""
    both_locked = barrier_once(2)

    def handler(cur: Cursor, m: Message) -> None:
        first, second = m.payload["order"]
        cur.execute(CREDIT_SQL, (first, m.message_id, 1))
        both_locked()
        cur.execute(CREDIT_SQL, (second, m.message_id, 1))

    errors: Counter[str] = Counter()

    def run(message_id: str, order: list[int]) -> Result:
        options = SAFE_OPTIONS + " -c deadlock_timeout=50ms"
        with connect(route(db_dsn), options=options, autocommit=True) as c:
            inbox = Inbox(c, consumer="billing", retry=FAST_RETRY)
            result = inbox.handle(Message("orders", message_id, "credit", {"order": order}), handler)
            errors.update(inbox.stats.transient_errors)
            return result

    jobs = [(uid("dl"), [1, 2]), (uid("dl"), [2, 1])]
    results = gather(*(partial(run, *job) for job in jobs))
    assert [r.outcome for r in results] == [Outcome.APPLIED, Outcome.APPLIED]
    assert sum(r.retries for r in results) >= 1
    assert errors["40P01"] >= 1
    assert max(r.lock_wait_seconds for r in results) >= 0.04  # at least deadlock_timeout
    for account in (1, 2):
        assert ledger_counts(domain, account) == {jobs[0][0]: 1, jobs[1][0]: 1}
        assert balance(domain, account) == 2


def test_serialization_failures_and_deadlocks_are_retried(db_dsn: str, domain: Conn, route: Route) -> None:
    rr_ids = [uid("rr"), uid("rr")]
    dl_ids = [uid("dl"), uid("dl")]
    errors: Counter[str] = Counter()
    rr_read = barrier_once(2)
    dl_locked = barrier_once(2)

    def rr_handler(cur: Cursor, m: Message) -> None:
        cur.execute("SELECT balance FROM account WHERE id = 1")
        rr_read()
        cur.execute(CREDIT_SQL, credit_args(m))

    def dl_handler(cur: Cursor, m: Message) -> None:
        first, second = m.payload["order"]
        cur.execute(CREDIT_SQL, (first, m.message_id, 1))
        dl_locked()
        cur.execute(CREDIT_SQL, (second, m.message_id, 1))

    def deliver(m: Message, handler: Handler, **kw: Any) -> Result:
        with connect(route(db_dsn), **kw) as c:
            if kw.get("autocommit") is None:
                c.set_isolation_level(IsolationLevel.REPEATABLE_READ)
            inbox = Inbox(c, consumer="billing", retry=FAST_RETRY)
            result = inbox.handle(m, handler)
            errors.update(inbox.stats.transient_errors)
            return result

    rr = gather(*(partial(deliver, message(i, 5), rr_handler) for i in rr_ids))
    dl = gather(
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


def test_lock_timeouts_are_retried(client: Conn, domain: Conn, db_dsn: str) -> None:
    m = message(uid(), 3)
    attempts = Calls()

    def handler(cur: Cursor, msg: Message) -> None:
        attempts()
        cur.execute("SET LOCAL lock_timeout = '30ms'")
        cur.execute(CREDIT_SQL, credit_args(msg))

    with autocommit_connect(db_dsn) as blocker:
        blocker.execute("BEGIN")
        blocker.execute("SELECT 1 FROM account WHERE id = 1 FOR UPDATE")
        release = threading.Timer(0.15, blocker.execute, ("ROLLBACK",))
        release.start()
        retry = RetryPolicy(max_attempts=20, base_delay=0.02, max_delay=0.05)
        slow = Inbox(client, consumer="billing", retry=retry)
        result = slow.handle(m, handler)
        release.join()
    assert result.outcome is Outcome.APPLIED
    assert result.retries >= 1 and result.retries == attempts.n - 1
    assert slow.stats.transient_errors.get("55P03", 0) == result.retries
    assert_applied_exactly(domain, {m.message_id: 3})


def test_retries_are_bounded(client: Conn, domain: Conn) -> None:
    m = message(uid())
    retry = RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.002)
    bounded = Inbox(client, consumer="billing", retry=retry)

    def always_conflicts(cur: Cursor, msg: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(msg))
        cur.execute("DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40001'; END $$")

    with pytest.raises(RetriesExhausted) as caught:
        bounded.handle(m, always_conflicts)
    assert caught.value.attempts == 3
    assert isinstance(caught.value.__cause__, psycopg.errors.SerializationFailure)
    assert bounded.stats.retries_exhausted == 1 and bounded.stats.retries == 2
    # Transient errors are not the message's fault: nothing recorded, nothing applied.
    assert failed_attempts(domain, m.message_id) == 0
    assert ledger_counts(domain) == {} and inbox_rows(domain, m.message_id) == []


def test_retries_are_bounded_on_deadlocks(db_dsn: str, domain: Conn, route: Route) -> None:
    def conflicts(cur: Cursor, msg: Message) -> None:
        cur.execute("DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40P01'; END $$")

    with connect(route(db_dsn)) as c:
        inbox = Inbox(c, consumer="billing", retry=RetryPolicy(max_attempts=2, base_delay=0.001))
        with pytest.raises(RetriesExhausted) as caught:
            inbox.handle(message(uid()), conflicts)
        assert isinstance(caught.value.__cause__, psycopg.errors.DeadlockDetected)
        assert inbox.stats.retries == 1
    assert ledger_counts(domain) == {}


def test_connection_lost_in_handler_is_retried_on_a_new_connection(
    direct_client: Conn, domain: Conn, pipeline: bool
) -> None:
    client = direct_client
    inbox = Inbox(client, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=pipeline)
    m = message(uid(), 4)
    timers: list[threading.Timer] = []

    def handler(cur: Cursor, msg: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(msg))
        if not timers:
            pid = cur.connection.info.backend_pid
            timers.append(threading.Timer(0.1, domain.execute, ("SELECT pg_terminate_backend(%s)", (pid,))))
            timers[0].start()
            cur.execute("SELECT pg_sleep(10)")

    result = inbox.handle(m, handler)
    timers[0].join()
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    assert inbox.connection is not client and client.closed
    assert inbox.stats.transient_errors.get("57P01", 0) + inbox.stats.transient_errors.get("connection", 0) == 1
    assert_applied_exactly(domain, {m.message_id: 4})
    inbox.close()


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


def test_backend_killed_during_commit_is_found_aborted_and_retried(inbox: Inbox, client: Conn, domain: Conn) -> None:
    """COMMIT blocks in a deferred trigger; the backend is terminated there. The transaction did not
    commit: pg_xact_status says 'aborted', the delivery runs again and applies once."""
    domain.execute(COMMIT_DELAY_DDL)
    domain.execute("UPDATE commit_delay SET seconds = 30")
    m = message(uid(), 6)
    killer = ThreadPoolExecutor(1)
    killed = killer.submit(terminate_backend_in_commit, domain)
    result = inbox.handle(m, credit())
    assert killed.result(timeout=30) > 0
    killer.shutdown()
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    stats = inbox.stats
    assert (stats.unknown_commits, stats.unknown_committed) == (1, 0)
    assert_applied_exactly(domain, {m.message_id: 6})
    assert inbox.handle(m, credit()).outcome is Outcome.DUPLICATE
    inbox.close()


def test_backend_killed_during_commit(db_dsn: str, domain: Conn) -> None:
    domain.execute(COMMIT_DELAY_DDL)
    domain.execute("UPDATE commit_delay SET seconds = 30")
    m = message(uid(), 6)
    with connect(db_dsn) as c:
        inbox = Inbox(c, consumer="billing", retry=FAST_RETRY)
        with ThreadPoolExecutor(1) as killer:
            killed = killer.submit(terminate_backend_in_commit, domain)
            result = inbox.handle(m, credit())
            killed.result(timeout=30)
        assert (inbox.stats.unknown_commits, inbox.stats.unknown_committed) == (1, 0)
        inbox.close()
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    assert_applied_exactly(domain, {m.message_id: 6})


def test_backend_killed_during_commit_with_a_pool(db_dsn: str, domain: Conn) -> None:
    domain.execute(COMMIT_DELAY_DDL)
    domain.execute("UPDATE commit_delay SET seconds = 30")
    m = message(uid(), 6)
    with ConnectionPool(db_dsn, min_size=1, max_size=2, open=False, kwargs={"options": SAFE_OPTIONS}) as pool:
        inbox = Inbox(pool, consumer="billing", retry=FAST_RETRY)
        with ThreadPoolExecutor(1) as killer:
            killed = killer.submit(terminate_backend_in_commit, domain)
            result = inbox.handle(m, credit())
            killed.result(timeout=30)
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    assert inbox.stats.unknown_commits == 1
    assert_applied_exactly(domain, {m.message_id: 6})


def test_commit_whose_answer_is_lost_is_found_committed(db_dsn: str, domain: Conn, pipeline: bool) -> None:
    """The COMMIT reaches the server and commits; the client's connection is lost before the answer.
    pg_xact_status says 'committed': APPLIED, with no second application and no retry."""
    m = message(uid(), 8)
    calls = Calls()
    with CommitDroppingProxy(db_dsn) as proxy, connect(proxy.dsn) as c:
        inbox = Inbox(c, consumer="billing", retry=FAST_RETRY, pipeline=pipeline)
        proxy.arm()
        result = inbox.handle(m, credit(calls))
        assert proxy.dropped.is_set() and c.closed
        assert result.outcome is Outcome.APPLIED and result.retries == 0
        assert calls.n == 1
        assert (inbox.stats.unknown_commits, inbox.stats.unknown_committed) == (1, 1)
        assert inbox.handle(m, credit(calls)).outcome is Outcome.DUPLICATE
        inbox.close()
    assert_applied_exactly(domain, {m.message_id: 8})


def test_commit_whose_answer_is_lost(db_dsn: str, domain: Conn, pipeline: bool) -> None:
    m = message(uid(), 8)
    with CommitDroppingProxy(db_dsn) as proxy, connect(proxy.dsn) as c:
        inbox = Inbox(c, consumer="billing", retry=FAST_RETRY, pipeline=pipeline)
        proxy.arm()
        result = inbox.handle(m, credit())
        assert proxy.dropped.is_set() and c.closed
        assert (inbox.stats.unknown_commits, inbox.stats.unknown_committed) == (1, 1)
        again = inbox.handle(m, credit())
        inbox.close()
    assert result.outcome is Outcome.APPLIED and result.retries == 0
    assert again.outcome is Outcome.DUPLICATE
    assert_applied_exactly(domain, {m.message_id: 8})


def test_apply_commit_answer_lost(db_dsn: str, domain: Conn) -> None:
    m = message(uid(), 8)
    with CommitDroppingProxy(db_dsn) as proxy, psycopg.connect(proxy.dsn, autocommit=True) as c:
        inbox = Inbox(c, consumer="billing", retry=FAST_RETRY)
        inbox.check_schema()
        proxy.arm()
        result = inbox.apply(m)
        assert proxy.dropped.is_set()
        assert result.outcome is Outcome.APPLIED and inbox.stats.unknown_committed == 1
        inbox.close()
    assert_applied_exactly(domain, {m.message_id: 8})


# ----------------------------------------------------------------------------- pools and concurrency


def test_pool_many_workers_racing_duplicates(db_dsn: str, domain: Conn, route: Route) -> None:
    """8 workers share a pool; every message is delivered three times at once."""
    messages = [message(uid("pool"), 1) for _ in range(30)]
    deliveries = [m for m in messages for _ in range(3)]
    with ConnectionPool(route(db_dsn), min_size=4, max_size=8, open=False, kwargs={"options": SAFE_OPTIONS}) as pool:
        pool.wait()
        inbox = Inbox(pool, consumer="billing", handler_version="v2", retry=FAST_RETRY)
        results = gather(*(partial(inbox.handle, m, credit()) for m in deliveries), concurrency=8)
        batch = gather(*(partial(inbox.apply, m) for m in deliveries[:9]), concurrency=8)
    counts = Counter(r.outcome for r in results)
    assert counts == {Outcome.APPLIED: 30, Outcome.DUPLICATE: 60}
    assert all(r.outcome is Outcome.DUPLICATE for r in batch)
    assert_applied_exactly(domain, {m.message_id: 1 for m in messages})
    assert inbox.stats.deliveries == 99


def test_pool_racing_duplicates(db_dsn: str, domain: Conn, route: Route) -> None:
    messages = [message(uid("pool"), 1) for _ in range(25)]
    with ConnectionPool(route(db_dsn), min_size=4, max_size=8, open=False, kwargs={"options": SAFE_OPTIONS}) as pool:
        inbox = Inbox(pool, consumer="billing", retry=FAST_RETRY)
        handled = gather(*(partial(inbox.handle, m, credit()) for m in messages for _ in range(3)), concurrency=8)
        applied = gather(*(partial(inbox.apply, m) for m in messages[:5]), concurrency=8)
    assert Counter(r.outcome for r in handled) == {Outcome.APPLIED: 25, Outcome.DUPLICATE: 50}
    assert all(r.outcome is Outcome.DUPLICATE for r in applied)
    assert_applied_exactly(domain, {m.message_id: 1 for m in messages})


def test_inbox_rejects_wrong_arguments(client: Conn) -> None:
    with pytest.raises(TypeError, match=r"psycopg\.Connection"):
        Inbox("dbname=x", consumer="billing")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Inbox(client, consumer="")
    inbox = Inbox(client, consumer="billing")
    with pytest.raises(TypeError, match="Message"):
        inbox.handle(("orders", "1"), credit())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Inbox(client, consumer="billing", batch_size=65)


def test_bad_input_raises_the_database_error(inbox: Inbox, domain: Conn) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="must not be empty"):
        inbox.handle(Message("orders", "", "credit", {}), credit())
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        inbox.apply_batch([message(uid()), Message("", "x", "credit", {})])
    with pytest.raises(psycopg.errors.UndefinedObject, match="no handler registered"):
        inbox.apply(Message("orders", uid(), "no_such_type", {}))
    with pytest.raises(TypeError):
        inbox.handle(Message("orders", uid(), "credit", {"when": object()}), credit())
    # The connection is still usable, and nothing was written or recorded.
    m = message(uid())
    assert inbox.handle(m, credit()).outcome is Outcome.APPLIED
    assert_applied_exactly(domain, {m.message_id: 10})
    assert domain.execute("SELECT count(*) FROM inbox.attempt").fetchone() == (0,)


def test_interrupts_are_not_failures(inbox: Inbox, domain: Conn) -> None:
    """KeyboardInterrupt / SystemExit in a handler: rolled back, not recorded, propagated."""
    m = message(uid())

    def interrupted(cur: Cursor, msg: Message) -> None:
        cur.execute(CREDIT_SQL, credit_args(msg))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        inbox.handle(m, interrupted)
    assert ledger_counts(domain) == {} and failed_attempts(domain, m.message_id) == 0
    assert inbox.handle(m, credit()).outcome is Outcome.APPLIED


def test_transient_error_in_a_sql_handler_is_retried(client: Conn, domain: Conn) -> None:
    """claim_and_apply re-raises a transient error of the SQL handler: the whole transaction is
    retried (here it always fails, so the policy gives up), and nothing is recorded."""
    inbox = Inbox(client, consumer="billing", retry=RetryPolicy(max_attempts=3, base_delay=0.001))
    m = Message("orders", uid(), "raising_credit", {"id": "x", "amount": 1, "sqlstate": "40P01"})
    with pytest.raises(RetriesExhausted) as caught:
        inbox.apply(m)
    assert caught.value.attempts == 3
    assert isinstance(caught.value.__cause__, psycopg.errors.DeadlockDetected)
    assert inbox.stats.transient_errors == {"40P01": 3}
    assert ledger_counts(domain) == {} and failed_attempts(domain, m.message_id) == 0


# ----------------------------------------------------------------------------- schema version


def test_schema_version_is_checked(inbox: Inbox) -> None:
    assert inbox.check_schema() == 3  # release 0.3.0


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


def test_missing_schema_is_refused(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as c:
        inbox = Inbox(c, consumer="billing")
        with pytest.raises(SchemaVersionError, match="pginbox deploy --dsn") as caught:
            inbox.handle(message(uid()), credit())
        assert caught.value.found is None
        c.execute("CREATE SCHEMA inbox")
        c.commit()
        with pytest.raises(SchemaVersionError, match="not deployed"):
            inbox.apply(message(uid()))


def release_function(version: int, breaking_since: int) -> sql.Composed:
    return sql.SQL(
        "CREATE OR REPLACE FUNCTION inbox.schema_release(OUT version integer, OUT release text,"
        " OUT breaking_since integer) LANGUAGE sql AS $$ SELECT {}, {}, {} $$"
    ).format(sql.Literal(version), sql.Literal(f"0.{version}.0"), sql.Literal(breaking_since))


@pytest.mark.parametrize(
    ("version", "breaking_since", "advice"),
    [(99, 99, "upgrade the pginbox Python package"), (0, 0, "pginbox deploy")],
)
def test_unknown_schema_version_is_refused(empty_dsn: str, version: int, breaking_since: int, advice: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA inbox")
        c.execute(release_function(version, breaking_since))
        inbox = Inbox(c, consumer="billing")
        with pytest.raises(SchemaVersionError, match=advice) as caught:
            inbox.check_schema()
        assert caught.value.found == version
        with pytest.raises(SchemaVersionError):
            inbox.apply_batch([message(uid())])


def test_schema_version_refusal(empty_dsn: str) -> None:
    with connect(empty_dsn, autocommit=True) as c:
        inbox = Inbox(c, consumer="billing")
        with pytest.raises(SchemaVersionError, match="pginbox deploy"):
            inbox.handle(message(uid()), credit())
        c.execute("CREATE SCHEMA inbox")
        c.execute(release_function(7, 7))
        with pytest.raises(SchemaVersionError, match="upgrade") as caught:
            inbox.apply(message(uid()))
        assert caught.value.found == 7
        # A newer release that breaks nothing this client knows: served, with a warning.
        c.execute(release_function(7, 1))
        with pytest.warns(SchemaNewerWarning, match="compatible"):
            assert inbox.check_schema() == 7
        # The release before this client's (0.1.0) works with it too: 0.2.0 broke nothing.
        c.execute(release_function(1, 1))
        assert inbox.check_schema() == 1
