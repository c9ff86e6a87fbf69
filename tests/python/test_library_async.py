"""`pginbox.AsyncInbox` against a real PostgreSQL: the asyncio variants of the library tests, with a
psycopg.AsyncConnection and a psycopg_pool.AsyncConnectionPool. Each test runs its own event loop
(asyncio.run): no pytest plugin needed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import psycopg
import pytest
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
from helpers_library import (
    COMMIT_DELAY_DDL,
    CREDIT_SQL,
    Calls,
    CommitDroppingProxy,
    credit_args,
    message,
    terminate_backend_in_commit,
)
from psycopg import IsolationLevel, sql
from psycopg_pool import AsyncConnectionPool

from pginbox import (
    AsyncInbox,
    HandlerProtocolError,
    Inbox,
    Message,
    Outcome,
    Result,
    RetriesExhausted,
    RetryPolicy,
    SchemaVersionError,
)

Conn = psycopg.Connection[Any]
ACursor = psycopg.AsyncCursor[Any]
T = TypeVar("T")
FAST_RETRY = RetryPolicy(max_attempts=5, base_delay=0.005, max_delay=0.05)


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


def credit(calls: Calls | None = None) -> Callable[[ACursor, Message], Awaitable[None]]:
    async def handler(cur: ACursor, m: Message) -> None:
        if calls is not None:
            calls()
        await cur.execute(CREDIT_SQL, credit_args(m))

    return handler


def uid(prefix: str = "a") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def connect(dsn: str, **kw: Any) -> psycopg.AsyncConnection[Any]:
    kw.setdefault("options", SAFE_OPTIONS)
    return await psycopg.AsyncConnection.connect(dsn, **kw)


# ----------------------------------------------------------------------------- outcomes


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "no-pipeline"])
def test_handle_outcomes_with_an_async_connection(db_dsn: str, domain: Conn, pipeline: bool) -> None:
    calls = Calls()
    m = message(uid(), 10)

    async def scenario() -> list[Result]:
        async with await connect(db_dsn) as c:
            inbox = AsyncInbox(c, consumer="billing", handler_version="v1", retry=FAST_RETRY, pipeline=pipeline)
            out = [
                await inbox.handle(m, credit(calls)),
                await inbox.handle(m, credit(calls)),
                await inbox.handle(message(m.message_id, 11), credit(calls)),
            ]
            assert c.autocommit is False and inbox.connection is c
            assert inbox.stats.deliveries == 3
            return out

    first, again, other = run(scenario())
    assert first.outcome is Outcome.APPLIED and first.payload_sha256 == canonical_sha256(domain, m.payload)
    assert again.outcome is Outcome.DUPLICATE
    assert other.outcome is Outcome.CONFLICT and other.quarantine_id is not None
    assert calls.n == 1
    assert_applied_exactly(domain, {m.message_id: 10})


def test_handler_failure_is_rolled_back_and_recorded(db_dsn: str, domain: Conn) -> None:
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

    async def scenario() -> tuple[Result, Result, Result]:
        async with await connect(db_dsn, autocommit=True) as c:
            inbox = AsyncInbox(c, consumer="billing", handler_version="v1")
            failed = await inbox.handle(m, broken)
            assert ledger_counts(domain) == {} and inbox_rows(domain, m.message_id) == []
            with pytest.raises(ValueError) as caught:
                await inbox.handle(m, broken, raise_on_failure=True)
            assert any("recorded as quarantined" in note for note in caught.value.__notes__)
            held = await inbox.handle(m, credit())
            other = await inbox.handle(message(uid()), swallows)
            return failed, held, other

    failed, held, other = run(scenario())
    assert failed.outcome is Outcome.FAILED and failed.reason_code == "ValueError"
    assert isinstance(failed.exception, ValueError) and failed.attempts == 1
    assert held.outcome is Outcome.QUARANTINED and held.quarantine_id is not None
    assert other.outcome is Outcome.FAILED and isinstance(other.exception, HandlerProtocolError)
    assert failed_attempts(domain, m.message_id) == 2
    assert ledger_counts(domain) == {} and balance(domain) == 0


def test_cancelled_handler_leaves_nothing_and_crash_loop_ends_in_quarantine(db_dsn: str, domain: Conn) -> None:
    """A task cancelled inside its handler is like a crash: nothing commits, nothing is recorded.
    Redeliveries announce themselves; at max_attempts the message is quarantined unrun."""
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    calls = Calls()

    async def hangs(cur: ACursor, msg: Message) -> None:
        calls()
        await cur.execute(CREDIT_SQL, credit_args(msg))
        await asyncio.sleep(30)

    async def scenario() -> Result:
        async with await connect(db_dsn) as c:
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
            return await inbox.handle(replace(m, redelivered=True), hangs)

    held = run(scenario())
    assert held.outcome is Outcome.QUARANTINED and held.reason_code == "crash_loop"
    assert calls.n == 3
    assert ledger_counts(domain) == {}


def test_apply_apply_batch_and_handle_batch(db_dsn: str, domain: Conn) -> None:
    done = message(uid(), 1)
    fresh = [message(uid(), 2) for _ in range(66)]
    mine = [message(uid(), 3) for _ in range(3)]
    poison = message(uid(), 4)

    async def handler(cur: ACursor, m: Message) -> None:
        await cur.execute(CREDIT_SQL, credit_args(m))
        if m.message_id == poison.message_id:
            raise LookupError("unknown customer")

    async def scenario() -> tuple[Result, list[Result], list[Result]]:
        async with await connect(db_dsn) as c:
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY)
            first = await inbox.apply(done)
            applied = await inbox.apply_batch([fresh[0], done, message(done.message_id, 9), message(uid(), -1),
                                               *fresh[1:]])
            handled = await inbox.handle_batch([mine[0], poison, fresh[0], *mine[1:]], handler)
            return first, applied, handled

    first, applied, handled = run(scenario())
    assert first.outcome is Outcome.APPLIED
    assert [r.outcome for r in applied[:4]] == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.CONFLICT, Outcome.FAILED]
    assert [r.outcome for r in applied[4:]] == [Outcome.APPLIED] * 65
    assert [r.outcome for r in handled] == [Outcome.APPLIED, Outcome.FAILED, Outcome.DUPLICATE, Outcome.APPLIED,
                                            Outcome.APPLIED]
    assert isinstance(handled[1].exception, LookupError)
    assert_applied_exactly(domain, {done.message_id: 1, **{m.message_id: 2 for m in fresh},
                                    **{m.message_id: 3 for m in mine}})
    assert failed_attempts(domain, poison.message_id) == 1


# ----------------------------------------------------------------------------- pools and retries


def test_async_pool_racing_duplicates(db_dsn: str, domain: Conn) -> None:
    messages = [message(uid("pool"), 1) for _ in range(25)]

    async def scenario() -> tuple[list[Result], list[Result]]:
        async with AsyncConnectionPool(db_dsn, min_size=4, max_size=8, open=False,
                                       kwargs={"options": SAFE_OPTIONS}) as pool:
            inbox = AsyncInbox(pool, consumer="billing", retry=FAST_RETRY)
            handled = await asyncio.gather(*(inbox.handle(m, credit()) for m in messages for _ in range(3)))
            applied = await asyncio.gather(*(inbox.apply(m) for m in messages[:5]))
            return list(handled), list(applied)

    handled, applied = run(scenario())
    assert Counter(r.outcome for r in handled) == {Outcome.APPLIED: 25, Outcome.DUPLICATE: 50}
    assert all(r.outcome is Outcome.DUPLICATE for r in applied)
    assert_applied_exactly(domain, {m.message_id: 1 for m in messages})


def test_serialization_failures_and_deadlocks_are_retried(db_dsn: str, domain: Conn) -> None:
    rr_ids = [uid("rr"), uid("rr")]
    dl_ids = [uid("dl"), uid("dl")]

    async def scenario() -> tuple[list[Result], list[Result], Counter[str]]:
        errors: Counter[str] = Counter()
        barrier = asyncio.Barrier(2)
        waited: set[str] = set()

        async def once(key: str) -> None:
            if key not in waited:
                waited.add(key)
                await asyncio.wait_for(barrier.wait(), 20)

        async def rr_handler(cur: ACursor, m: Message) -> None:
            await cur.execute("SELECT balance FROM account WHERE id = 1")
            await once(m.message_id)
            await cur.execute(CREDIT_SQL, credit_args(m))

        async def dl_handler(cur: ACursor, m: Message) -> None:
            first, second = m.payload["order"]
            await cur.execute(CREDIT_SQL, (first, m.message_id, 1))
            await once(m.message_id)
            await cur.execute(CREDIT_SQL, (second, m.message_id, 1))

        async def deliver(m: Message, handler: Any, **kw: Any) -> Result:
            async with await connect(db_dsn, **kw) as c:
                if kw.get("autocommit") is None:
                    await c.set_isolation_level(IsolationLevel.REPEATABLE_READ)
                inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY)
                result = await inbox.handle(m, handler)
                errors.update(inbox.stats.transient_errors)
                return result

        rr = await asyncio.gather(*(deliver(message(i, 5), rr_handler) for i in rr_ids))
        barrier = asyncio.Barrier(2)
        dl = await asyncio.gather(*(
            deliver(Message("orders", i, "credit", {"order": order}), dl_handler, autocommit=True,
                    options=SAFE_OPTIONS + " -c deadlock_timeout=50ms")
            for i, order in zip(dl_ids, ([1, 2], [2, 1]), strict=True)
        ))
        return list(rr), list(dl), errors

    rr, dl, errors = run(scenario())
    assert [r.outcome for r in rr + dl] == [Outcome.APPLIED] * 4
    assert errors["40001"] >= 1 and errors["40P01"] >= 1
    assert sum(r.retries for r in rr) >= 1 and sum(r.retries for r in dl) >= 1
    assert max(r.lock_wait_seconds for r in dl) >= 0.04
    assert ledger_counts(domain, 1) == {rr_ids[0]: 1, rr_ids[1]: 1, dl_ids[0]: 1, dl_ids[1]: 1}
    assert ledger_counts(domain, 2) == {dl_ids[0]: 1, dl_ids[1]: 1}
    assert balance(domain, 1) == 12 and balance(domain, 2) == 2


def test_retries_are_bounded(db_dsn: str, domain: Conn) -> None:
    async def conflicts(cur: ACursor, msg: Message) -> None:
        await cur.execute("DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40P01'; END $$")

    async def scenario() -> None:
        async with await connect(db_dsn) as c:
            inbox = AsyncInbox(c, consumer="billing", retry=RetryPolicy(max_attempts=2, base_delay=0.001))
            with pytest.raises(RetriesExhausted) as caught:
                await inbox.handle(message(uid()), conflicts)
            assert isinstance(caught.value.__cause__, psycopg.errors.DeadlockDetected)
            assert inbox.stats.retries == 1

    run(scenario())
    assert ledger_counts(domain) == {}


# ----------------------------------------------------------------------------- unknown COMMIT outcome


def test_backend_killed_during_commit(db_dsn: str, domain: Conn) -> None:
    domain.execute(COMMIT_DELAY_DDL)
    domain.execute("UPDATE commit_delay SET seconds = 30")
    m = message(uid(), 6)

    async def scenario() -> Result:
        async with await connect(db_dsn) as c:
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY)
            killer = asyncio.create_task(asyncio.to_thread(terminate_backend_in_commit, domain))
            result = await inbox.handle(m, credit())
            await killer
            assert (inbox.stats.unknown_commits, inbox.stats.unknown_committed) == (1, 0)
            await inbox.close()
            return result

    result = run(scenario())
    assert result.outcome is Outcome.APPLIED and result.retries == 1
    assert_applied_exactly(domain, {m.message_id: 6})


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "no-pipeline"])
def test_commit_whose_answer_is_lost(db_dsn: str, domain: Conn, pipeline: bool) -> None:
    m = message(uid(), 8)

    async def scenario(proxy: CommitDroppingProxy) -> tuple[Result, Result]:
        async with await connect(proxy.dsn) as c:
            inbox = AsyncInbox(c, consumer="billing", retry=FAST_RETRY, pipeline=pipeline)
            proxy.arm()
            result = await inbox.handle(m, credit())
            assert proxy.dropped.is_set() and c.closed
            assert (inbox.stats.unknown_commits, inbox.stats.unknown_committed) == (1, 1)
            again = await inbox.handle(m, credit())
            await inbox.close()
            return result, again

    with CommitDroppingProxy(db_dsn) as proxy:
        result, again = run(scenario(proxy))
    assert result.outcome is Outcome.APPLIED and result.retries == 0
    assert again.outcome is Outcome.DUPLICATE
    assert_applied_exactly(domain, {m.message_id: 8})


# ----------------------------------------------------------------------------- arguments, schema


def test_sync_and_async_types_are_not_mixed(conn: Conn, db_dsn: str) -> None:
    with pytest.raises(TypeError, match=r"pginbox\.Inbox"):
        AsyncInbox(conn, consumer="billing")  # type: ignore[arg-type]

    async def scenario() -> None:
        async with await connect(db_dsn) as c:
            with pytest.raises(TypeError, match="AsyncInbox"):
                Inbox(c, consumer="billing")  # type: ignore[arg-type]

    run(scenario())


@pytest.fixture
def empty_dsn(pg_base: str) -> Iterator[str]:
    from conftest import create_database, drop_database, dsn_for

    name = f"scratch_{uuid.uuid4().hex[:12]}"
    create_database(pg_base, name)
    try:
        yield dsn_for(pg_base, name)
    finally:
        drop_database(pg_base, name)


def test_schema_version_refusal(empty_dsn: str) -> None:
    async def scenario() -> None:
        async with await connect(empty_dsn, autocommit=True) as c:
            inbox = AsyncInbox(c, consumer="billing")
            with pytest.raises(SchemaVersionError, match="pginbox deploy"):
                await inbox.handle(message(uid()), credit())
            await c.execute("CREATE SCHEMA inbox")
            await c.execute("CREATE FUNCTION inbox.schema_version() RETURNS integer LANGUAGE sql RETURN 7")
            with pytest.raises(SchemaVersionError, match="upgrade") as caught:
                await inbox.apply(message(uid()))
            assert caught.value.found == 7
            await c.execute("DROP FUNCTION inbox.schema_version()")
            await c.execute(
                sql.SQL("CREATE FUNCTION inbox.schema_version() RETURNS integer LANGUAGE sql RETURN {}").format(
                    sql.Literal(1)
                )
            )
            assert await inbox.check_schema() == 1

    run(scenario())
