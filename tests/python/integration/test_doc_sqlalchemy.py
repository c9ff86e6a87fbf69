"""The Python blocks of docs/sqlalchemy.md, run as written: the engine line (with the URL of a LOGIN
role granted inbox_consumer and bound to 'billing'), `handle` with the ORM handler, `claim` in the
caller's transaction with that handler, and the asyncio version. The names the page leaves to the
reader are given: the models Wallet and Entry (tables created by the test), msg_id, payload, and a
broker that records its acks."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers_docs import page_blocks
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import ForeignKey, String, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from pginbox import Message, Outcome

WRITTEN_URL = '"postgresql+psycopg://billing_service@db/app"'


class Base(DeclarativeBase):
    pass


class Wallet(Base):
    __tablename__ = "wallet"
    id: Mapped[int] = mapped_column(primary_key=True)
    balance: Mapped[int] = mapped_column(default=0)


class Entry(Base):
    __tablename__ = "wallet_entry"
    id: Mapped[int] = mapped_column(primary_key=True)
    wallet_id: Mapped[int] = mapped_column(ForeignKey("wallet.id"))
    message_id: Mapped[str] = mapped_column(String(200))
    amount: Mapped[int]


class Broker:
    def __init__(self) -> None:
        self.acked: list[str] = []

    def ack(self, delivery: str) -> None:
        self.acked.append(delivery)


@pytest.fixture
def service_url(db_dsn: str, login_role: Any) -> Iterator[tuple[str, psycopg.Connection[Any]]]:
    """The bound role's URL (as the page writes one), and an admin connection."""
    params = conninfo_to_dict(login_role("inbox_consumer"))
    role = str(params["user"])
    admin_engine = create_engine(URL.create("postgresql+psycopg", **url_parts(conninfo_to_dict(db_dsn))))
    Base.metadata.create_all(admin_engine)
    admin_engine.dispose()
    with psycopg.connect(db_dsn, autocommit=True) as admin:
        for table in ("wallet", "wallet_entry"):
            admin.execute(
                sql.SQL("GRANT SELECT, INSERT, UPDATE ON {} TO {}").format(*map(sql.Identifier, (table, role)))
            )
        admin.execute(sql.SQL("GRANT USAGE ON SEQUENCE wallet_entry_id_seq TO {}").format(sql.Identifier(role)))
        admin.execute("INSERT INTO wallet VALUES (7, 0)")
        admin.execute("SELECT inbox.bind_consumer('billing', %s, note => 'docs')", (role,))
        url = URL.create("postgresql+psycopg", **url_parts(params)).render_as_string(hide_password=False)
        yield url, admin


def url_parts(params: dict[str, Any]) -> dict[str, Any]:
    return {
        "username": str(params["user"]),
        "host": str(params["host"]),
        "port": int(str(params["port"])),
        "database": str(params["dbname"]),
    }


def ledger(admin: psycopg.Connection[Any]) -> tuple[Any, list[tuple[Any, ...]]]:
    row = admin.execute("SELECT balance FROM wallet WHERE id = 7").fetchone()
    entries = admin.execute("SELECT message_id, amount FROM wallet_entry ORDER BY id").fetchall()
    return row and row[0], entries


def test_the_sync_blocks(service_url: tuple[str, psycopg.Connection[Any]]) -> None:
    url, admin = service_url
    engine_line, handle_block, claim_block, _ = page_blocks("docs/sqlalchemy.md", "python")
    assert engine_line.count(WRITTEN_URL) == 1
    broker = Broker()
    namespace: dict[str, Any] = {"create_engine": create_engine, "Session": Session, "Wallet": Wallet, "Entry": Entry}
    exec(compile(engine_line.replace(WRITTEN_URL, repr(url)), "sqlalchemy.md", "exec"), namespace)
    try:
        for _ in range(2):  # the delivery, then its redelivery
            namespace.update(msg_id="order-1", payload={"account": 7, "amount": 10}, broker=broker, delivery="d-1")
            exec(compile(handle_block, "sqlalchemy.md §1", "exec"), namespace)
        assert namespace["result"].outcome is Outcome.DUPLICATE
        assert broker.acked == ["d-1", "d-1"]

        outcomes = []
        for _ in range(2):
            namespace["message"] = Message("orders", "order-2", "credit", {"account": 7, "amount": 5})
            exec(compile(claim_block, "sqlalchemy.md §2", "exec"), namespace)
            outcomes.append((namespace["claim"].outcome, namespace["claim"].ack))
        assert outcomes == [(Outcome.CLAIMED, False), (Outcome.DUPLICATE, True)]  # as the block's comment says
    finally:
        namespace["engine"].dispose()
    assert ledger(admin) == (15, [("order-1", 10), ("order-2", 5)])


def test_the_asyncio_block(service_url: tuple[str, psycopg.Connection[Any]]) -> None:
    url, admin = service_url
    code = page_blocks("docs/sqlalchemy.md", "python")[3]
    assert code.count(WRITTEN_URL) == 1
    imports, _, body = code.replace(WRITTEN_URL, repr(url)).partition("\n\nengine = ")
    namespace: dict[str, Any] = {"Message": Message, "Wallet": Wallet, "Entry": Entry}
    program = f"{imports}\n\nasync def example(msg_id, payload):\n"
    program += textwrap.indent("engine = " + body, "    ") + "\n    await engine.dispose()\n    return result\n"
    exec(compile(program, "sqlalchemy.md §4", "exec"), namespace)
    results = [asyncio.run(namespace["example"]("order-3", {"account": 7, "amount": 4})) for _ in range(2)]
    assert [r.outcome for r in results] == [Outcome.APPLIED, Outcome.DUPLICATE]
    assert ledger(admin) == (4, [("order-3", 4)])
