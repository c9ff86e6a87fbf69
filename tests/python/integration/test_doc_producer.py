"""docs/outbox.md §14 (Producer-only services): the operator's SQL block and the service's Python
block are run as written on a fresh database, then what they committed is checked. Also the
`enqueue` API the section documents, on every client: Inbox, AsyncInbox, SQLAlchemyInbox (sync and
asyncio), inside a handler, and its refusals (an autocommit connection with no transaction, an
unbound destination) before anything is written."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import REPO_ROOT
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from pginbox import AsyncInbox, Inbox, Message, Outcome, PginboxError
from pginbox.integrations.sqlalchemy import SQLAlchemyInbox
from pginbox.integrations.sqlalchemy_async import AsyncSQLAlchemyInbox

PAGE = "docs/outbox.md"
SECTION = "## 14. Producer-only services"
ROLE = "shop_api"  # the doc's login role (cluster-wide: dropped after each test)
# the doc's login role shop_api is cluster-wide: one worker runs these tests (pytest-xdist).
pytestmark = pytest.mark.xdist_group("role_shop_api")


def section_blocks() -> dict[str, str]:
    """The ```sql and ```python blocks of §14, by language."""
    page = (REPO_ROOT / PAGE).read_text()
    start = page.index(SECTION)
    end = page.find("\n## ", start + 1)
    body = page[start : end if end >= 0 else len(page)]
    return dict(re.findall(r"```(\w+)\n(.*?)```", body, re.S))


def outbox(conn: psycopg.Connection[Any], consumer: str = "shop-api") -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT effect_id, destination, payload, ordering_key, tenant, status FROM inbox.outbox"
        " WHERE consumer = %s ORDER BY effect_id",
        (consumer,),
    ).fetchall()


@pytest.fixture
def shop(db_dsn: str) -> Iterator[tuple[psycopg.Connection[Any], str]]:
    """The doc's SQL block run by the superuser; yields (superuser connection, the service's dsn)."""
    with psycopg.connect(db_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(ROLE)))
        try:
            admin.execute(section_blocks()["sql"].encode())
            params = {k: v for k, v in conninfo_to_dict(db_dsn).items() if v is not None}
            params["user"] = ROLE
            yield admin, make_conninfo("", **params)
        finally:
            admin.execute("DROP TABLE IF EXISTS orders")
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(ROLE)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(ROLE)))


def test_the_documented_producer_runs_on_a_fresh_database(shop: tuple[psycopg.Connection[Any], str]) -> None:
    admin, dsn = shop
    exec(compile(section_blocks()["python"], f"{PAGE} {SECTION}", "exec"), {"dsn": dsn, "__name__": "doc"})
    assert admin.execute("SELECT id, amount FROM orders").fetchall() == [("o-1", 30)]
    assert outbox(admin) == [("order-o-1:crm", "crm", {"order": "o-1", "amount": 30}, "o-1", "", "pending")]


def test_enqueue_commits_and_rolls_back_with_the_callers_transaction(
    shop: tuple[psycopg.Connection[Any], str],
) -> None:
    admin, dsn = shop
    with psycopg.connect(dsn) as conn:  # not autocommit: psycopg opens the transaction
        inbox = Inbox(conn, consumer="shop-api")
        assert inbox.enqueue(conn, "e-rolled-back", "crm", {"n": 1}) is True
        conn.rollback()
        assert inbox.enqueue(conn, "e-1", "crm", {"n": 1}, headers={"X-Kind": "order"}, tenant="acme") is True
        conn.commit()
    assert [(r[0], r[4]) for r in outbox(admin)] == [("e-1", "acme")]
    assert admin.execute("SELECT headers FROM inbox.outbox WHERE effect_id = 'e-1'").fetchone() == (
        {"X-Kind": "order"},
    )


def test_enqueue_refuses_autocommit_and_unbound_destinations(shop: tuple[psycopg.Connection[Any], str]) -> None:
    admin, dsn = shop
    with psycopg.connect(dsn, autocommit=True) as conn:
        inbox = Inbox(conn, consumer="shop-api")
        with pytest.raises(PginboxError, match="autocommit"):
            inbox.enqueue(conn, "e-alone", "crm", {})
        with pytest.raises(errors.InsufficientPrivilege), conn.transaction():
            inbox.enqueue(conn, "e-mail", "mail", {})  # 'mail' is not bound to shop-api
        with pytest.raises(errors.UndefinedObject, match="not known"), conn.transaction():
            Inbox(conn, consumer="billing").enqueue(conn, "e-billing", "crm", {})  # nobody acts as billing
    assert outbox(admin) == [] and outbox(admin, "billing") == []


def test_enqueue_from_a_handler_belongs_to_the_claimed_consumer(
    shop: tuple[psycopg.Connection[Any], str],
) -> None:
    admin, dsn = shop
    with psycopg.connect(dsn, autocommit=True) as conn:
        inbox = Inbox(conn, consumer="shop-api")

        def handler(cur: psycopg.Cursor[Any], m: Message) -> None:
            inbox.enqueue(cur, f"{m.message_id}:crm", "crm", m.payload, ordering_key="k")

        assert inbox.handle(Message("web", "req-1", "order", {"order": "o-2"}), handler).outcome is Outcome.APPLIED

        def failing(cur: psycopg.Cursor[Any], m: Message) -> None:
            handler(cur, m)
            raise RuntimeError("after the enqueue")

        failed = inbox.handle(Message("web", "req-2", "order", {"order": "o-3"}), failing)
        assert failed.outcome is Outcome.FAILED
    assert [r[0] for r in outbox(admin)] == ["req-1:crm"]


@pytest.mark.anyio
async def test_async_enqueue(shop: tuple[psycopg.Connection[Any], str]) -> None:
    admin, dsn = shop
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        inbox = AsyncInbox(conn, consumer="shop-api")
        with pytest.raises(PginboxError, match="autocommit"):
            await inbox.enqueue(conn, "a-alone", "crm", {})
        async with conn.transaction():
            assert await inbox.enqueue(conn, "a-1", "crm", {"n": 1}) is True
        async with conn.transaction():
            assert await inbox.enqueue(conn, "a-1", "crm", {"n": 1}) is False
    assert [r[0] for r in outbox(admin)] == ["a-1"]


def sqlalchemy_url(dsn: str, driver: str = "postgresql+psycopg") -> URL:
    p = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    return URL.create(
        driver, username=str(p["user"]), host=str(p["host"]), port=int(str(p["port"])), database=str(p["dbname"])
    )


def test_sqlalchemy_enqueue(shop: tuple[psycopg.Connection[Any], str]) -> None:
    admin, dsn = shop
    engine = create_engine(sqlalchemy_url(dsn))
    inbox = SQLAlchemyInbox(consumer="shop-api")
    try:
        with Session(engine) as s, s.begin():
            s.execute(text("INSERT INTO orders VALUES ('o-9', 9)"))
            assert inbox.enqueue(s, "s-1", "crm", {"order": "o-9"}, ordering_key="o-9") is True
        with Session(engine) as s, s.begin():
            assert inbox.enqueue(s, "s-1", "crm", {"order": "o-9"}, ordering_key="o-9") is False
        with (
            Session(engine.execution_options(isolation_level="AUTOCOMMIT")) as s,
            pytest.raises(PginboxError, match="AUTOCOMMIT"),
        ):
            inbox.enqueue(s, "s-alone", "crm", {})
    finally:
        engine.dispose()
    assert outbox(admin) == [("s-1", "crm", {"order": "o-9"}, "o-9", "", "pending")]


@pytest.mark.anyio
async def test_async_sqlalchemy_enqueue(shop: tuple[psycopg.Connection[Any], str]) -> None:
    admin, dsn = shop
    engine = create_async_engine(sqlalchemy_url(dsn))
    inbox = AsyncSQLAlchemyInbox(consumer="shop-api")
    try:
        async with AsyncSession(engine) as s, s.begin():
            assert await inbox.enqueue(s, "as-1", "crm", {"n": 1}, headers={"X-A": "1"}) is True
    finally:
        await engine.dispose()
    assert [r[0] for r in outbox(admin)] == ["as-1"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
