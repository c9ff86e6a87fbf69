"""pginbox.integrations.sqlalchemy_async (AsyncSQLAlchemyInbox) against a real PostgreSQL, with the
ORM models of test_sqlalchemy.py on an asyncio engine (create_async_engine, postgresql+psycopg):
claims and applies in the caller's AsyncSession transaction, `handle` with ORM writes that commit
with the claim, failures recorded as AsyncInbox records them, transient errors retried, a COMMIT
whose answer is lost resolved, consumer bindings enforced, and two sessions racing on one message.

The sync SQLAlchemyInbox is generated from the same module (python/tools/async_to_sync.py) and
tested by test_sqlalchemy.py; these tests cover what only the asyncio flavour does (awaits, the
AsyncSession and AsyncConnection, the psycopg AsyncConnection under them).

The invariant checked throughout: at most one committed domain transition (ledger row) per
consumer and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from helpers_inbox import canonical_sha256, failed_attempts, inbox_rows, setup_domain
from helpers_library import CommitDroppingProxy
from sqlalchemy import func, insert, select
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from test_sqlalchemy import Base, Entry, Wallet, service_dsns, url_for

from pginbox import HandlerProtocolError, Message, Outcome, PginboxError, RetriesExhausted, RetryPolicy
from pginbox.integrations.sqlalchemy_async import AsyncSQLAlchemyInbox

pytestmark = pytest.mark.anyio
Conn = psycopg.Connection[Any]
FAST_RETRY = RetryPolicy(max_attempts=5, base_delay=0.005, max_delay=0.05)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def async_engine_for(dsn: str) -> AsyncEngine:
    return create_async_engine(url_for(dsn))


@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


@pytest.fixture
async def engine(db_dsn: str, domain: Conn) -> AsyncIterator[AsyncEngine]:
    engine = async_engine_for(db_dsn)
    async with engine.begin() as c:
        await c.run_sync(Base.metadata.create_all)
    async with AsyncSession(engine) as s, s.begin():
        s.add(Wallet(id=1, balance=0))
    yield engine
    await engine.dispose()


def uid() -> str:
    return f"m-{uuid.uuid4().hex[:12]}"


def message(message_id: str, amount: int = 10, **kw: Any) -> Message:
    return Message("orders", message_id, "credit", {"id": message_id, "account": 1, "amount": amount}, **kw)


async def credit(session: AsyncSession, m: Message) -> None:
    """An ORM handler: one ledger entry and a balance change per message."""
    wallet = await session.get(Wallet, 1, with_for_update=True)
    assert wallet is not None
    wallet.balance += m.payload["amount"]
    session.add(
        Entry(wallet_id=1, message_id=m.message_id, amount=m.payload["amount"], reference=m.payload.get("reference"))
    )


async def entries(engine: AsyncEngine) -> dict[str, int]:
    """message_id -> committed ledger entries, and the wallet balance under key ''."""
    async with AsyncSession(engine) as s:
        rows = (await s.execute(select(Entry.message_id, func.count()).group_by(Entry.message_id))).all()
        wallet = await s.get(Wallet, 1)
        assert wallet is not None
        return {**{mid: int(n) for mid, n in rows}, "": wallet.balance}


async def test_handle_commits_orm_writes_with_the_claim(
    engine: AsyncEngine, db_dsn: str, domain: Conn, route: Callable[[str], str]
) -> None:
    """Directly and through PgBouncer in transaction mode (`route`)."""
    routed = async_engine_for(route(db_dsn))
    inbox = AsyncSQLAlchemyInbox(consumer="billing", handler_version="v1")
    m = message(uid(), 10)
    calls: list[str] = []

    async def handler(session: AsyncSession, msg: Message) -> None:
        calls.append(msg.message_id)
        await credit(session, msg)

    async with AsyncSession(routed) as s:
        first = await inbox.handle(s, m, handler)
        again = await inbox.handle(s, m, handler)
        other = await inbox.handle(s, message(m.message_id, 99), handler)
        assert not s.in_transaction()
    await routed.dispose()
    assert inbox.behind_pooler == (route(db_dsn) != db_dsn)  # PgBouncer found: nothing prepared
    assert first.outcome is Outcome.APPLIED and first.ack and first.handler_version == "v1"
    assert first.payload_sha256 == canonical_sha256(domain, m.payload)
    assert again.outcome is Outcome.DUPLICATE and again.stored_sha256 == first.payload_sha256
    assert other.outcome is Outcome.CONFLICT and other.quarantine_id is not None
    assert calls == [m.message_id]
    assert await entries(engine) == {m.message_id: 1, "": 10}
    assert len(inbox_rows(domain, m.message_id)) == 1


async def test_handle_on_an_async_connection(engine: AsyncEngine, domain: Conn) -> None:
    inbox = AsyncSQLAlchemyInbox(consumer="billing")
    m = message(uid(), 3)

    async def handler(connection: Any, msg: Message) -> None:
        await connection.execute(insert(Entry).values(wallet_id=1, message_id=msg.message_id, amount=3))

    async with engine.connect() as c:
        assert (await inbox.handle(c, m, handler)).outcome is Outcome.APPLIED
        assert (await inbox.handle(c, m, handler)).outcome is Outcome.DUPLICATE
    assert (await entries(engine))[m.message_id] == 1


async def test_a_failing_handler_is_rolled_back_and_recorded(engine: AsyncEngine, domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    inbox = AsyncSQLAlchemyInbox(consumer="billing", retry=FAST_RETRY)
    m = message(uid(), 10)
    taken = message(uid(), 5)

    async def broken(session: AsyncSession, msg: Message) -> None:
        await credit(session, msg)
        await session.flush()
        raise ValueError("ledger service rejected the entry")

    async with AsyncSession(engine) as s:
        failed = await inbox.handle(s, m, broken)
        # An ORM write that violates a constraint at flush: the constraint name is the reason.
        s.add(Entry(wallet_id=1, message_id="other", amount=0, reference="ref-1"))
        await s.commit()
        duplicate_ref = message(taken.message_id, 5)
        duplicate_ref.payload["reference"] = "ref-1"
        violated = await inbox.handle(s, duplicate_ref, credit)
        with pytest.raises(ValueError) as caught:
            await inbox.handle(s, m, broken, raise_on_failure=True)
        held = await inbox.handle(s, m, broken)
    assert failed.outcome is Outcome.FAILED and not failed.ack and failed.attempts == 1
    assert (failed.reason_code, failed.error_message) == ("ValueError", "ledger service rejected the entry")
    assert violated.outcome is Outcome.FAILED and violated.reason_code == "wallet_entry_reference_key"
    assert isinstance(violated.exception, IntegrityError)
    assert any("recorded as failed (attempt 2" in note for note in caught.value.__notes__)
    assert held.outcome is Outcome.QUARANTINED and held.quarantine_id is not None
    assert failed_attempts(domain, m.message_id) == 3 and failed_attempts(domain, taken.message_id) == 1
    assert await entries(engine) == {"other": 1, "": 0}  # nothing of the failed attempts committed


async def test_a_handler_that_swallows_a_database_error_or_ends_the_transaction(
    engine: AsyncEngine, domain: Conn
) -> None:
    """The state of psycopg's AsyncConnection under the session (failed transaction) and of the
    session's transaction (ended by the handler) are read through the asyncio layers."""
    inbox = AsyncSQLAlchemyInbox(consumer="billing")

    async def swallows(session: AsyncSession, msg: Message) -> None:
        await credit(session, msg)
        await session.flush()  # nothing left for the final flush to trip over
        with contextlib.suppress(DBAPIError):
            await (await session.connection()).exec_driver_sql("SELECT 1 / 0")

    async def commits(session: AsyncSession, msg: Message) -> None:
        await session.commit()

    async with AsyncSession(engine) as s:
        swallowed = await inbox.handle(s, message(uid()), swallows)
        with pytest.raises(HandlerProtocolError, match="ended the transaction"):
            await inbox.handle(s, message(uid()), commits)
    assert swallowed.outcome is Outcome.FAILED and swallowed.reason_code == "25P02"
    assert await entries(engine) == {"": 0}


async def test_transient_errors_are_retried_and_never_recorded(engine: AsyncEngine, domain: Conn) -> None:
    inbox = AsyncSQLAlchemyInbox(consumer="billing", retry=FAST_RETRY)
    m = message(uid(), 4)
    calls = 0

    async def flaky(session: AsyncSession, msg: Message) -> None:
        nonlocal calls
        calls += 1
        await credit(session, msg)
        await session.flush()
        if calls == 1:
            await (await session.connection()).exec_driver_sql(
                "DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40001'; END $$"
            )

    async def always(session: AsyncSession, msg: Message) -> None:
        await (await session.connection()).exec_driver_sql(
            "DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40P01'; END $$"
        )

    async with AsyncSession(engine) as s:
        result = await inbox.handle(s, m, flaky)
        with pytest.raises(RetriesExhausted) as caught:
            await AsyncSQLAlchemyInbox(consumer="billing", retry=RetryPolicy(max_attempts=2, base_delay=0.001)).handle(
                s, message("gives-up"), always
            )
    assert result.outcome is Outcome.APPLIED and result.retries == 1 and calls == 2
    assert caught.value.attempts == 2 and caught.value.sqlstate == "40P01"
    assert failed_attempts(domain, m.message_id) == 0 and failed_attempts(domain, "gives-up") == 0
    assert await entries(engine) == {m.message_id: 1, "": 4}


async def test_claim_and_apply_in_the_callers_transaction(engine: AsyncEngine, domain: Conn) -> None:
    inbox = AsyncSQLAlchemyInbox(consumer="billing")
    kept, dropped = message(uid(), 7), message(uid(), 8)
    async with AsyncSession(engine) as s:
        async with s.begin():
            assert (await inbox.claim(s, kept)).outcome is Outcome.CLAIMED
            await credit(s, kept)
        async with s.begin():
            assert (await inbox.claim(s, kept)).outcome is Outcome.DUPLICATE
        await s.begin()
        assert (await inbox.claim(s, dropped)).outcome is Outcome.CLAIMED
        await credit(s, dropped)
        await s.rollback()  # the claim and the ORM writes go together
        async with s.begin():
            failed = await inbox.record_failure(s, dropped, LookupError("unknown customer"))
        async with s.begin():
            applied = await inbox.apply(s, message(uid(), 2))
            batch = await inbox.apply_batch(s, [message(uid(), 1), Message("orders", "neg", "credit", {"amount": -1})])
    assert failed.outcome is Outcome.FAILED and failed.reason_code == "LookupError"
    assert applied.outcome is Outcome.APPLIED
    assert [r.outcome for r in batch] == [Outcome.APPLIED, Outcome.FAILED]
    assert await entries(engine) == {kept.message_id: 1, "": 7}
    assert inbox_rows(domain, dropped.message_id) == [] and failed_attempts(domain, dropped.message_id) == 1


async def test_handle_refuses_a_session_inside_a_transaction(engine: AsyncEngine) -> None:
    inbox = AsyncSQLAlchemyInbox(consumer="billing")
    async with AsyncSession(engine) as s:
        await s.execute(select(1))  # autobegins
        with pytest.raises(PginboxError, match="inside a transaction"):
            await inbox.handle(s, message(uid()), credit)


async def test_two_sessions_racing_on_one_message_apply_it_once(
    engine: AsyncEngine, db_dsn: str, domain: Conn, route: Callable[[str], str]
) -> None:
    """Redelivery while the first delivery still runs: the second claim waits for the first
    transaction and finds the identity taken. Twenty messages, each delivered to two sessions at
    once; the handler yields to the event loop mid-transaction so the two really overlap.
    Directly and through PgBouncer in transaction mode (`route`)."""
    routed = async_engine_for(route(db_dsn))
    inbox = AsyncSQLAlchemyInbox(consumer="billing", retry=FAST_RETRY)
    ids = [uid() for _ in range(20)]
    runs: list[str] = []

    async def slow_credit(session: AsyncSession, msg: Message) -> None:
        runs.append(msg.message_id)
        await asyncio.sleep(0.01)
        await credit(session, msg)

    async def deliver(message_id: str) -> Outcome:
        async with AsyncSession(routed) as s:
            return (await inbox.handle(s, message(message_id, 1), slow_credit)).outcome

    outcomes = await asyncio.gather(*(deliver(i) for i in ids for _ in range(2)))
    await routed.dispose()
    assert sorted(o.value for o in outcomes) == sorted(["applied", "duplicate"] * len(ids))
    assert await entries(engine) == {**dict.fromkeys(ids, 1), "": len(ids)}
    # the second claim waited for the first transaction and found the identity taken: its
    # handler never ran
    assert sorted(runs) == sorted(ids)


async def test_a_commit_whose_answer_is_lost_is_resolved(engine: AsyncEngine, db_dsn: str, domain: Conn) -> None:
    m = message(uid(), 6)
    with CommitDroppingProxy(db_dsn) as proxy:
        lossy = async_engine_for(proxy.dsn)
        inbox = AsyncSQLAlchemyInbox(consumer="billing", retry=FAST_RETRY)
        async with AsyncSession(lossy) as s:
            assert (await inbox.handle(s, message(uid(), 0), credit)).outcome is Outcome.APPLIED  # schema check
            proxy.arm()
            result = await inbox.handle(s, m, credit)
            assert proxy.dropped.is_set()
            again = await inbox.handle(s, m, credit)
        await lossy.dispose()
    assert result.outcome is Outcome.APPLIED and result.retries == 0
    assert again.outcome is Outcome.DUPLICATE
    assert (await entries(engine))[m.message_id] == 1


@pytest.fixture
async def bound_engines(
    engine: AsyncEngine, domain: Conn, login_role: Callable[..., str]
) -> AsyncIterator[tuple[AsyncEngine, AsyncEngine]]:
    """(an engine of a LOGIN role bound to consumer 'billing', one of a role that is not)."""
    engines = [async_engine_for(dsn) for dsn in service_dsns(domain, login_role)]
    yield engines[0], engines[1]
    for e in engines:
        await e.dispose()


async def test_only_a_role_bound_to_the_consumer_may_act_as_it(
    bound_engines: tuple[AsyncEngine, AsyncEngine], engine: AsyncEngine, domain: Conn
) -> None:
    bound, unbound = bound_engines
    m = message(uid(), 5)
    async with AsyncSession(bound) as s:
        assert (await AsyncSQLAlchemyInbox(consumer="billing").handle(s, m, credit)).outcome is Outcome.APPLIED
    async with AsyncSession(unbound) as s:
        with pytest.raises(DBAPIError) as caught:
            await AsyncSQLAlchemyInbox(consumer="billing").handle(s, message(uid(), 1), credit)
        assert not s.in_transaction()
    assert getattr(caught.value.orig, "sqlstate", None) == "42501"
    assert await entries(engine) == {m.message_id: 1, "": 5}
    assert domain.execute("SELECT count(*) FROM inbox.attempt").fetchone() == (0,)


class Crash(BaseException):
    """The process dying inside the handler, as far as the transaction can tell."""


async def test_a_crash_loop_of_redeliveries_ends_in_quarantine(engine: AsyncEngine, domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    inbox = AsyncSQLAlchemyInbox(consumer="billing")
    m = message(uid(), 5)
    calls = 0

    async def crashes(session: AsyncSession, msg: Message) -> None:
        nonlocal calls
        calls += 1
        await credit(session, msg)
        await session.flush()
        raise Crash

    async with AsyncSession(engine) as s:
        for redelivered in (False, True, True):
            with pytest.raises(Crash):
                await inbox.handle(s, replace(m, redelivered=redelivered), crashes)
            assert not s.in_transaction() and await entries(engine) == {"": 0}
        held = await inbox.handle(s, replace(m, redelivered=True), crashes)
    assert held.outcome is Outcome.QUARANTINED and held.reason_code == "crash_loop"
    assert calls == 3


async def test_an_autocommit_engine_is_refused_before_anything_commits(engine: AsyncEngine, domain: Conn) -> None:
    """As test_sqlalchemy.py's test: on an AUTOCOMMIT engine the claim would commit apart from the
    handler's writes; refused, with nothing written."""
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")
    inbox = AsyncSQLAlchemyInbox(consumer="billing", handler_version="v1")
    m = message(uid(), 10)

    async def half_then_raise(session: AsyncSession, msg: Message) -> None:
        await session.execute(insert(Entry).values(wallet_id=1, message_id=msg.message_id, amount=1))
        raise RuntimeError("after the first write")

    async with AsyncSession(auto) as s:
        with pytest.raises(PginboxError, match="AUTOCOMMIT"):
            await inbox.handle(s, m, half_then_raise)
    async with auto.connect() as c:
        with pytest.raises(PginboxError, match="AUTOCOMMIT"):
            await inbox.claim(c, m)
    assert inbox_rows(domain, m.message_id) == []
    assert m.message_id not in await entries(engine)
