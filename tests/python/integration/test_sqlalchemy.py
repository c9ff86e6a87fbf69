"""pginbox.integrations.sqlalchemy against a real PostgreSQL, with real ORM models: claims and
applies in the caller's Session transaction, `handle` with ORM writes that commit with the claim,
failures recorded as Inbox records them, transient errors retried, a COMMIT whose answer is lost
resolved, and the consumer bindings of docs/security.md (a bound LOGIN role acts, an unbound one
is refused with 42501).

The invariant checked throughout: at most one committed domain transition (ledger row) per
consumer and message.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from helpers_inbox import canonical_sha256, failed_attempts, inbox_rows, setup_domain
from helpers_library import CommitDroppingProxy
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import Engine, ForeignKey, String, UniqueConstraint, create_engine, func, insert, select
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from pginbox import HandlerProtocolError, Message, Outcome, PginboxError, RetriesExhausted, RetryPolicy
from pginbox.integrations.sqlalchemy import SQLAlchemyInbox

Conn = psycopg.Connection[Any]
FAST_RETRY = RetryPolicy(max_attempts=5, base_delay=0.005, max_delay=0.05)


class Base(DeclarativeBase):
    pass


class Wallet(Base):
    __tablename__ = "wallet"
    id: Mapped[int] = mapped_column(primary_key=True)
    balance: Mapped[int] = mapped_column(default=0)


class Entry(Base):
    __tablename__ = "wallet_entry"
    __table_args__ = (UniqueConstraint("reference", name="wallet_entry_reference_key"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    wallet_id: Mapped[int] = mapped_column(ForeignKey("wallet.id"))
    message_id: Mapped[str] = mapped_column(String(200))
    amount: Mapped[int]
    reference: Mapped[str | None] = mapped_column(String(100), default=None)


def url_for(dsn: str) -> URL:
    p = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    return URL.create(
        "postgresql+psycopg",
        username=str(p.get("user")),
        host=str(p.get("host")),
        port=int(str(p.get("port"))),
        database=str(p.get("dbname")),
    )


def engine_for(dsn: str) -> Engine:
    return create_engine(url_for(dsn), poolclass=None)


@pytest.fixture
def domain(conn: Conn) -> Conn:
    setup_domain(conn)
    return conn


@pytest.fixture
def engine(db_dsn: str, domain: Conn) -> Iterator[Engine]:
    engine = engine_for(db_dsn)
    Base.metadata.create_all(engine)
    with Session(engine) as s, s.begin():
        s.add(Wallet(id=1, balance=0))
    yield engine
    engine.dispose()


def uid() -> str:
    return f"m-{uuid.uuid4().hex[:12]}"


def message(message_id: str, amount: int = 10, **kw: Any) -> Message:
    return Message("orders", message_id, "credit", {"id": message_id, "account": 1, "amount": amount}, **kw)


def credit(session: Session, m: Message) -> None:
    """An ORM handler: one ledger entry and a balance change per message."""
    wallet = session.get(Wallet, 1)
    assert wallet is not None
    wallet.balance += m.payload["amount"]
    session.add(
        Entry(wallet_id=1, message_id=m.message_id, amount=m.payload["amount"], reference=m.payload.get("reference"))
    )


def entries(engine: Engine) -> dict[str, int]:
    """message_id -> committed ledger entries, and the wallet balance under key ''."""
    with Session(engine) as s:
        rows = s.execute(select(Entry.message_id, func.count()).group_by(Entry.message_id)).all()
        wallet = s.get(Wallet, 1)
        assert wallet is not None
        return {**{mid: int(n) for mid, n in rows}, "": wallet.balance}


def test_handle_commits_orm_writes_with_the_claim(engine: Engine, domain: Conn) -> None:
    inbox = SQLAlchemyInbox(consumer="billing", handler_version="v1")
    m = message(uid(), 10)
    calls: list[str] = []

    def handler(session: Session, msg: Message) -> None:
        calls.append(msg.message_id)
        credit(session, msg)

    with Session(engine) as s:
        first = inbox.handle(s, m, handler)
        again = inbox.handle(s, m, handler)
        other = inbox.handle(s, message(m.message_id, 99), handler)
        assert not s.in_transaction()
    assert first.outcome is Outcome.APPLIED and first.ack and first.handler_version == "v1"
    assert first.payload_sha256 == canonical_sha256(domain, m.payload)
    assert again.outcome is Outcome.DUPLICATE and again.stored_sha256 == first.payload_sha256
    assert other.outcome is Outcome.CONFLICT and other.quarantine_id is not None
    assert calls == [m.message_id]
    assert entries(engine) == {m.message_id: 1, "": 10}
    assert len(inbox_rows(domain, m.message_id)) == 1


def test_handle_on_a_connection(engine: Engine, domain: Conn) -> None:
    inbox = SQLAlchemyInbox(consumer="billing")
    m = message(uid(), 3)

    def handler(connection: Any, msg: Message) -> None:
        connection.execute(insert(Entry).values(wallet_id=1, message_id=msg.message_id, amount=3))

    with engine.connect() as c:
        assert inbox.handle(c, m, handler).outcome is Outcome.APPLIED
        assert inbox.handle(c, m, handler).outcome is Outcome.DUPLICATE
    assert entries(engine)[m.message_id] == 1


def test_a_failing_handler_is_rolled_back_and_recorded_like_inbox(engine: Engine, domain: Conn) -> None:
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    inbox = SQLAlchemyInbox(consumer="billing", retry=FAST_RETRY)
    m = message(uid(), 10)
    taken = message(uid(), 5)

    def broken(session: Session, msg: Message) -> None:
        credit(session, msg)
        session.flush()
        raise ValueError("ledger service rejected the entry")

    with Session(engine) as s:
        failed = inbox.handle(s, m, broken)
        # An ORM write that violates a constraint at flush: the constraint name is the reason.
        s.add(Entry(wallet_id=1, message_id="other", amount=0, reference="ref-1"))
        s.commit()
        duplicate_ref = message(taken.message_id, 5)
        duplicate_ref.payload["reference"] = "ref-1"
        violated = inbox.handle(s, duplicate_ref, credit)
        with pytest.raises(ValueError) as caught:
            inbox.handle(s, m, broken, raise_on_failure=True)
        held = inbox.handle(s, m, broken)
    assert failed.outcome is Outcome.FAILED and not failed.ack and failed.attempts == 1
    assert (failed.reason_code, failed.error_message) == ("ValueError", "ledger service rejected the entry")
    assert isinstance(failed.exception, ValueError)
    assert violated.outcome is Outcome.FAILED and violated.reason_code == "wallet_entry_reference_key"
    assert isinstance(violated.exception, IntegrityError)
    assert any("recorded as failed (attempt 2" in note for note in caught.value.__notes__)
    assert held.outcome is Outcome.QUARANTINED and held.quarantine_id is not None
    assert failed_attempts(domain, m.message_id) == 3 and failed_attempts(domain, taken.message_id) == 1
    assert entries(engine) == {"other": 1, "": 0}  # nothing of the failed attempts committed
    row = domain.execute(
        "SELECT reason_code, message_type FROM inbox.attempt WHERE consumer = 'billing' AND message_id = %s",
        (m.message_id,),
    ).fetchone()
    assert row == ("ValueError", "credit")


def test_a_handler_that_swallows_a_database_error_or_ends_the_transaction(engine: Engine, domain: Conn) -> None:
    inbox = SQLAlchemyInbox(consumer="billing")

    def swallows(session: Session, msg: Message) -> None:
        credit(session, msg)
        session.flush()  # nothing left for the final flush to trip over
        with contextlib.suppress(DBAPIError):
            session.connection().exec_driver_sql("SELECT 1 / 0")

    def commits(session: Session, msg: Message) -> None:
        session.commit()

    with Session(engine) as s:
        swallowed = inbox.handle(s, message(uid()), swallows)
        with pytest.raises(HandlerProtocolError, match="ended the transaction"):
            inbox.handle(s, message(uid()), commits)
    assert swallowed.outcome is Outcome.FAILED and swallowed.reason_code == "25P02"
    assert entries(engine) == {"": 0}


def test_transient_errors_are_retried_and_never_recorded(engine: Engine, domain: Conn) -> None:
    inbox = SQLAlchemyInbox(consumer="billing", retry=FAST_RETRY)
    m = message(uid(), 4)
    calls = 0

    def flaky(session: Session, msg: Message) -> None:
        nonlocal calls
        calls += 1
        credit(session, msg)
        session.flush()
        if calls == 1:
            session.connection().exec_driver_sql(
                "DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40001'; END $$"
            )

    def always(session: Session, msg: Message) -> None:
        session.connection().exec_driver_sql("DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40P01'; END $$")

    with Session(engine) as s:
        result = inbox.handle(s, m, flaky)
        with pytest.raises(RetriesExhausted) as caught:
            SQLAlchemyInbox(consumer="billing", retry=RetryPolicy(max_attempts=2, base_delay=0.001)).handle(
                s, message("gives-up"), always
            )
    assert result.outcome is Outcome.APPLIED and result.retries == 1 and calls == 2
    assert caught.value.attempts == 2 and caught.value.sqlstate == "40P01"
    assert failed_attempts(domain, m.message_id) == 0 and failed_attempts(domain, "gives-up") == 0
    assert entries(engine) == {m.message_id: 1, "": 4}


def test_claim_and_apply_in_the_callers_transaction(engine: Engine, domain: Conn) -> None:
    inbox = SQLAlchemyInbox(consumer="billing")
    kept, dropped = message(uid(), 7), message(uid(), 8)
    with Session(engine) as s:
        with s.begin():
            claim = inbox.claim(s, kept)
            assert claim.outcome is Outcome.CLAIMED
            credit(s, kept)
        with s.begin():
            assert inbox.claim(s, kept).outcome is Outcome.DUPLICATE
        s.begin()
        assert inbox.claim(s, dropped).outcome is Outcome.CLAIMED
        credit(s, dropped)
        s.rollback()  # the claim and the ORM writes go together
        with s.begin():
            failed = inbox.record_failure(s, dropped, LookupError("unknown customer"))
        with s.begin():
            applied = inbox.apply(s, message(uid(), 2))
            batch = inbox.apply_batch(s, [message(uid(), 1), Message("orders", "neg", "credit", {"amount": -1})])
    assert failed.outcome is Outcome.FAILED and failed.reason_code == "LookupError"
    assert applied.outcome is Outcome.APPLIED
    assert [r.outcome for r in batch] == [Outcome.APPLIED, Outcome.FAILED]
    assert entries(engine) == {kept.message_id: 1, "": 7}
    assert inbox_rows(domain, dropped.message_id) == [] and failed_attempts(domain, dropped.message_id) == 1


def test_the_payload_is_bound_as_jsonb(engine: Engine, domain: Conn) -> None:
    """Lists, nested objects, unicode and numbers arrive as jsonb (no 22P02, the same hash as
    the server computes for the value)."""
    inbox = SQLAlchemyInbox(consumer="billing")
    body = {"id": "x", "lines": [1, 2.5, "drei", None, {"deep": ["ü", True]}], "amount": 3}
    for payload in (body, [1, 2, 3], "text", 42):
        m = Message("orders", uid(), "credit", payload)
        with Session(engine) as s, s.begin():
            claimed = inbox.claim(s, m)
        assert claimed.outcome is Outcome.CLAIMED
        assert claimed.payload_sha256 == canonical_sha256(domain, payload)  # type: ignore[arg-type]


def test_handle_refuses_a_session_inside_a_transaction(engine: Engine) -> None:
    inbox = SQLAlchemyInbox(consumer="billing")
    with Session(engine) as s:
        s.execute(select(1))  # autobegins
        with pytest.raises(PginboxError, match="inside a transaction"):
            inbox.handle(s, message(uid()), credit)


def test_a_commit_whose_answer_is_lost_is_resolved(engine: Engine, db_dsn: str, domain: Conn) -> None:
    m = message(uid(), 6)
    with CommitDroppingProxy(db_dsn) as proxy:
        lossy = engine_for(proxy.dsn)
        inbox = SQLAlchemyInbox(consumer="billing", retry=FAST_RETRY)
        with Session(lossy) as s:
            assert inbox.handle(s, message(uid(), 0), credit).outcome is Outcome.APPLIED  # schema check done
            proxy.arm()
            result = inbox.handle(s, m, credit)
            assert proxy.dropped.is_set()
            again = inbox.handle(s, m, credit)
        lossy.dispose()
    assert result.outcome is Outcome.APPLIED and result.retries == 0
    assert again.outcome is Outcome.DUPLICATE
    assert entries(engine)[m.message_id] == 1


def service_dsns(domain: Conn, login_role: Callable[..., str]) -> tuple[str, str]:
    """DSNs of two LOGIN roles holding inbox_consumer and the ledger's grants: the first bound to
    consumer 'billing', the second not (test_sqlalchemy_async.py uses them too)."""
    dsns = []
    for bind in (True, False):
        dsn = login_role("inbox_consumer")
        role = conninfo_to_dict(dsn)["user"]
        domain.execute(f'GRANT ALL ON wallet, wallet_entry TO "{role}"')
        domain.execute(f'GRANT USAGE ON SEQUENCE wallet_entry_id_seq TO "{role}"')
        if bind:
            domain.execute("SELECT inbox.bind_consumer('billing', %s::regrole, note => 'test')", (role,))
        dsns.append(dsn)
    return dsns[0], dsns[1]


@pytest.fixture
def bound_engines(engine: Engine, domain: Conn, login_role: Callable[..., str]) -> Iterator[tuple[Engine, Engine]]:
    """(an engine of a LOGIN role bound to consumer 'billing', one of a role that is not)."""
    engines = [engine_for(dsn) for dsn in service_dsns(domain, login_role)]
    yield engines[0], engines[1]
    for e in engines:
        e.dispose()


def test_only_a_role_bound_to_the_consumer_may_act_as_it(
    bound_engines: tuple[Engine, Engine], engine: Engine, domain: Conn
) -> None:
    bound, unbound = bound_engines
    inbox = SQLAlchemyInbox(consumer="billing")
    m = message(uid(), 5)
    with Session(bound) as s:
        assert inbox.handle(s, m, credit).outcome is Outcome.APPLIED
    with Session(unbound) as s:
        with pytest.raises(DBAPIError) as caught:
            SQLAlchemyInbox(consumer="billing").handle(s, message(uid(), 1), credit)
        assert not s.in_transaction()
    assert getattr(caught.value.orig, "sqlstate", None) == "42501"
    assert entries(engine) == {m.message_id: 1, "": 5}
    assert domain.execute("SELECT count(*) FROM inbox.attempt").fetchone() == (0,)


class Crash(BaseException):
    """The process dying inside the handler, as far as the transaction can tell."""


def test_a_crash_loop_of_redeliveries_ends_in_quarantine(engine: Engine, domain: Conn) -> None:
    """A handler interrupted like a crash (a BaseException): nothing commits, nothing is recorded;
    redeliveries announce themselves, and at max_attempts the message is quarantined unrun."""
    domain.execute("SELECT inbox.configure_consumer('billing', max_attempts => 3)")
    inbox = SQLAlchemyInbox(consumer="billing")
    m = message(uid(), 5)
    calls = 0

    def crashes(session: Session, msg: Message) -> None:
        nonlocal calls
        calls += 1
        credit(session, msg)
        session.flush()
        raise Crash

    with Session(engine) as s:
        for redelivered in (False, True, True):
            with pytest.raises(Crash):
                inbox.handle(s, replace(m, redelivered=redelivered), crashes)
            assert not s.in_transaction() and entries(engine) == {"": 0}
            assert failed_attempts(domain, m.message_id) == 0
        held = inbox.handle(s, replace(m, redelivered=True), crashes)
        fresh = message(uid(), 2)
        below = inbox.handle(s, replace(fresh, redelivered=True), credit)
    assert held.outcome is Outcome.QUARANTINED and held.reason_code == "crash_loop"
    assert calls == 3
    assert below.outcome is Outcome.APPLIED
    assert entries(engine) == {fresh.message_id: 1, "": 2}


def test_an_autocommit_engine_is_refused_before_anything_commits(engine: Engine, domain: Conn) -> None:
    """isolation_level="AUTOCOMMIT": SQLAlchemy's begin() sends no BEGIN, so the claim and the
    handler's first write would each commit on their own, and a handler that then raised would
    leave its half-applied write committed (its redelivery answered "duplicate"). Refused instead,
    with nothing written."""
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")
    inbox = SQLAlchemyInbox(consumer="billing", handler_version="v1")
    m = message(uid(), 10)

    def half_then_raise(session: Session, msg: Message) -> None:
        session.execute(insert(Entry).values(wallet_id=1, message_id=msg.message_id, amount=1))
        raise RuntimeError("after the first write")

    with Session(auto) as s, pytest.raises(PginboxError, match="AUTOCOMMIT"):
        inbox.handle(s, m, half_then_raise)
    with auto.connect() as c, pytest.raises(PginboxError, match="AUTOCOMMIT"):
        inbox.claim(c, m)
    assert inbox_rows(domain, m.message_id) == []
    assert m.message_id not in entries(engine)
    # The engine without the AUTOCOMMIT option works.
    with Session(engine) as s:
        assert inbox.handle(s, m, credit).outcome is Outcome.APPLIED
    assert entries(engine)[m.message_id] == 1
