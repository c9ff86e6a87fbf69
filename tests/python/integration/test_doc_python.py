"""The Python blocks of docs/python.md, docs/pgbouncer.md, docs/metrics.md and README.md, run as
written.

The examples connect with "dbname=shop" (PgBouncer: "host=pgbouncer ..."): the test puts the
conninfo of a LOGIN role granted inbox_consumer and bound to consumer 'billing' in its place, on a
fresh database with the examples' table `account` (id 7). Blocks that show a definition (the
Message dataclass, the constructors' signatures, RetryPolicy's defaults, the exception hierarchy)
are compared with what the package defines. metrics.md's exporter serves on a free port (not 9188)
from a registry of its own (not prometheus_client's global one), and is scraped.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import inspect
import re
import textwrap
import urllib.request
from collections.abc import Iterator
from typing import Any

import prometheus_client
import psycopg
import psycopg_pool
import pytest
from conftest import REPO_ROOT
from helpers_docs import blocks
from helpers_pgbouncer import free_port
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import pginbox
import pginbox.errors
import pginbox.pooler
from pginbox import AsyncInbox, Inbox, Message, Outcome, RetryPolicy


def python_blocks(page: str) -> list[str]:
    return [b.text for b in blocks(REPO_ROOT / page) if b.lang == "python"]


def with_dsn(code: str, written: str, dsn: str) -> str:
    assert code.count(written) == 1, f"the example no longer connects with {written}"
    return code.replace(written, repr(dsn))


class Pools:
    """psycopg_pool.ConnectionPool as the examples import it, remembering each pool to close it."""

    def __init__(self) -> None:
        self.opened: list[psycopg_pool.ConnectionPool[Any]] = []
        pools = self

        class ConnectionPool(psycopg_pool.ConnectionPool[Any]):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                pools.opened.append(self)

        self.ConnectionPool = ConnectionPool

    def close(self) -> None:
        for pool in self.opened:
            pool.close()


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pools]:
    pools = Pools()
    monkeypatch.setattr(psycopg_pool, "ConnectionPool", pools.ConnectionPool)
    yield pools
    pools.close()


@pytest.fixture
def shop(db_dsn: str, login_role: Any) -> Iterator[tuple[str, psycopg.Connection[Any]]]:
    """The bound service's conninfo, and an admin connection."""
    dsn: str = login_role("inbox_consumer")
    role = conninfo_to_dict(dsn)["user"]
    with psycopg.connect(db_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE account (id bigint PRIMARY KEY, balance numeric NOT NULL DEFAULT 0)")
        admin.execute("INSERT INTO account VALUES (7, 0)")
        admin.execute(sql.SQL("GRANT SELECT, UPDATE ON account TO {}").format(sql.Identifier(str(role))))
        admin.execute("SELECT inbox.bind_consumer('billing', %s, note => 'docs')", (role,))
        yield dsn, admin


def balance(admin: psycopg.Connection[Any]) -> Any:
    row = admin.execute("SELECT balance FROM account WHERE id = 7").fetchone()
    return row and row[0]


# ------------------------------------------------------------------------------ README.md


def test_readme_python_block(shop: tuple[str, psycopg.Connection[Any]], pools: Pools) -> None:
    dsn, admin = shop
    (block,) = python_blocks("README.md")
    code = compile(with_dsn(block, '"dbname=shop"', dsn), "README.md", "exec")
    acks: list[str] = []
    for expected in (Outcome.APPLIED, Outcome.DUPLICATE):  # the delivery, then its redelivery
        namespace: dict[str, Any] = {"ack": lambda: acks.append("ack"), "nack": lambda: acks.append("nack")}
        exec(code, namespace)
        assert namespace["result"].outcome is expected
    assert acks == ["ack", "ack"]
    assert balance(admin) == 10


# ------------------------------------------------------------------------------ docs/python.md


def test_quick_start(shop: tuple[str, psycopg.Connection[Any]], pools: Pools) -> None:
    dsn, admin = shop
    code = compile(with_dsn(python_blocks("docs/python.md")[0], '"dbname=shop"', dsn), "python.md", "exec")
    outcomes = []
    for _ in range(2):
        namespace: dict[str, Any] = {}
        exec(code, namespace)
        outcomes.append((namespace["result"].outcome, namespace["result"].ack))
    assert outcomes == [(Outcome.APPLIED, True), (Outcome.DUPLICATE, True)]
    assert balance(admin) == 10


def test_async_example(shop: tuple[str, psycopg.Connection[Any]]) -> None:
    dsn, admin = shop
    (code,) = [b for b in python_blocks("docs/python.md") if b.startswith("async with AsyncConnectionPool")]
    body = textwrap.indent(with_dsn(code, '"dbname=shop"', dsn), "    ")
    namespace: dict[str, Any] = {
        "AsyncConnectionPool": psycopg_pool.AsyncConnectionPool,
        "AsyncInbox": AsyncInbox,
        "Message": Message,
        "body": {"account": 7, "amount": 10},
    }
    exec(compile(f"async def example():\n{body}\n    return result\n", "python.md", "exec"), namespace)
    result = asyncio.run(namespace["example"]())
    assert result.outcome is Outcome.APPLIED
    assert balance(admin) == 10


def test_message_is_the_dataclass_shown() -> None:
    (code,) = [b for b in python_blocks("docs/python.md") if b.startswith("@dataclass(frozen=True)\nclass Message:")]
    namespace: dict[str, Any] = {"dataclass": dataclasses.dataclass}
    exec(compile("from __future__ import annotations\n" + code, "python.md", "exec"), namespace)

    def shape(cls: type) -> list[tuple[str, Any, Any]]:
        return [(f.name, str(f.type), f.default) for f in dataclasses.fields(cls)]

    assert shape(namespace["Message"]) == shape(Message)
    assert Message.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_constructor_signatures_are_the_ones_shown() -> None:
    (code,) = [b for b in python_blocks("docs/python.md") if b.startswith("Inbox(conn_or_pool")]
    inbox_call, async_line = code.split("\nAsyncInbox(")
    namespace: dict[str, Any] = {}
    exec(f"def Inbox({inbox_call.removeprefix('Inbox(').rstrip()[:-1]}): pass", namespace)
    assert async_line.startswith("...same arguments...)")

    def shape(function: Any, drop_self: bool) -> list[tuple[str, Any, Any]]:
        params = list(inspect.signature(function).parameters.values())[1 if drop_self else 0 :]
        return [(p.name, p.kind, p.default) for p in params]

    shown = shape(namespace["Inbox"], drop_self=False)
    assert shown == shape(Inbox.__init__, drop_self=True)
    assert shown == shape(AsyncInbox.__init__, drop_self=True)


def test_retry_policy_defaults_are_the_ones_shown() -> None:
    (code,) = [b for b in python_blocks("docs/python.md") if b.startswith("RetryPolicy(")]
    assert eval(code, {"RetryPolicy": RetryPolicy}) == RetryPolicy()


def test_the_exception_hierarchy_is_complete() -> None:
    (tree,) = [b.text for b in blocks(REPO_ROOT / "docs" / "python.md") if b.text.startswith("PginboxError ")]
    parents: list[tuple[int, type]] = []
    listed = set()
    for line in tree.splitlines():
        match = re.fullmatch(r"( *)(\w+)\s*(.*)", line)
        assert match, line
        indent, name, notes = len(match.group(1)), match.group(2), match.group(3)
        cls = getattr(pginbox.errors, name)
        listed.add(cls)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        if parents:
            assert cls.__bases__[0] is parents[-1][1], f"{name} is not a subclass of {parents[-1][1].__name__}"
        else:
            assert cls.__bases__[0] in (Exception, UserWarning), name
        parents.append((indent, cls))
        for attribute in re.findall(r"\.(\w+)", notes):
            source = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__ == "pginbox.errors")
            assert f"self.{attribute} =" in source or f"    {attribute}:" in source, f"{name} has no .{attribute}"
        also = re.search(r"\((?:also )?an? (\w+)\)", notes)
        if also:
            assert issubclass(cls, getattr(builtins, also.group(1))), line
    defined = {
        c
        for _, c in inspect.getmembers(pginbox.errors, inspect.isclass)
        if c.__module__ == "pginbox.errors" and issubclass(c, (pginbox.errors.PginboxError, Warning))
    }
    assert defined - listed == set(), f"docs/python.md does not list {sorted(c.__name__ for c in defined - listed)}"


# ------------------------------------------------------------------------------ docs/pgbouncer.md


def test_pgbouncer_detection(shop: tuple[str, psycopg.Connection[Any]], pgbouncer: Any) -> None:
    dsn, _ = shop
    code = with_dsn(python_blocks("docs/pgbouncer.md")[0], '"host=pgbouncer port=6432 dbname=app user=billing"', "")
    pools = Pools()
    try:
        namespace: dict[str, Any] = {"ConnectionPool": pools.ConnectionPool, "Inbox": Inbox}
        exec(compile(code.replace("''", repr(pgbouncer.route(dsn)), 1), "pgbouncer.md", "exec"), namespace)
        assert namespace["inbox"].behind_pooler is True
    finally:
        pools.close()


def test_pgbouncer_settings_turn_preparation_off(db_dsn: str) -> None:
    lines = python_blocks("docs/pgbouncer.md")[1].splitlines()
    assert len(lines) == 3
    namespace: dict[str, Any] = {
        "psycopg": psycopg,
        "pginbox": pginbox,
        "dsn": db_dsn,
        "ConnectionPool": psycopg_pool.ConnectionPool,
        "AsyncConnectionPool": psycopg_pool.AsyncConnectionPool,
    }
    conn, pool, apool = [eval(line, namespace) for line in lines]
    with conn:
        assert conn.prepare_threshold is None
    with pool, pool.connection(timeout=10) as conn:
        assert conn.prepare_threshold is None

    async def async_pool() -> Any:
        async with apool, apool.connection(timeout=10) as aconn:
            return aconn.prepare_threshold

    assert asyncio.run(async_pool()) is None


# ------------------------------------------------------------------------------ docs/metrics.md


def test_metrics_exporter_in_an_application(
    shop: tuple[str, psycopg.Connection[Any]], db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, _ = shop
    (code,) = python_blocks("docs/metrics.md")
    registry = prometheus_client.CollectorRegistry()
    servers: list[Any] = []
    port = free_port()
    serve = prometheus_client.start_http_server

    def start_http_server(written_port: int, addr: str) -> None:
        assert written_port == 9188
        servers.append(serve(port, addr=addr, registry=registry))

    monkeypatch.setattr(prometheus_client, "REGISTRY", registry)
    monkeypatch.setattr(prometheus_client, "start_http_server", start_http_server)
    with (
        psycopg_pool.ConnectionPool(db_dsn, open=True, min_size=1) as pool,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        inbox = Inbox(conn, consumer="billing")
        inbox.handle(Message("shop", "order-1", "credit", {}), lambda cur, m: None)
        try:
            exec(compile(code, "metrics.md", "exec"), {"pool": pool, "inbox": inbox})
            (server, thread), *_ = servers
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                scraped = response.read().decode()
        finally:
            for server, thread in servers:
                server.shutdown()
                server.server_close()
                thread.join(timeout=10)
    assert "pginbox_database_up 1.0" in scraped
    assert 'pginbox_client_outcomes_total{consumer="billing",outcome="applied"} 1.0' in scraped


# ------------------------------------------------------------------------------ README.md, "Operate it"


def test_readme_command_synopsis_names_real_commands_and_options() -> None:
    """Each line of the synopsis, resolved through the click command tree: every command word
    (alternatives split at `|`) names a command, every `--option` is one of that command's (or of
    the main group's). Nothing runs: the commands themselves are run by test_cli*.py and
    test_doc_operations.py."""
    import shlex

    import click

    from pginbox.cli import main

    (synopsis,) = [b for b in blocks(REPO_ROOT / "README.md") if b.lang == "sh" and b.text.startswith("pginbox status")]

    def options(command: click.Command) -> set[str]:
        return {name for param in command.params for name in getattr(param, "opts", []) if name.startswith("--")}

    checked = 0
    for line in synopsis.text.splitlines():
        words = shlex.split(line.split("  #")[0]) if line.startswith("pginbox ") else []
        if not words:
            continue
        group: click.Command = main
        rest = words[1:]
        while rest and isinstance(group, click.Group) and rest[0] in group.commands:
            group, rest = group.commands[rest[0]], rest[1:]
        parent = (
            main
            if group is main
            else next(g for g in _groups(main) if group.name in g.commands and g.commands[group.name] is group)
        )
        alternatives: list[list[str]] = [[]]
        for word in rest:
            if word == "|":
                alternatives.append([])
            else:
                alternatives[-1].append(word)
        for number, alternative in enumerate(alternatives):
            command = group
            if number > 0:  # `a | b`: b is another command of the same group
                assert isinstance(parent, click.Group) and alternative[0] in parent.commands, f"README.md: {line}"
                command, alternative = parent.commands[alternative[0]], alternative[1:]
            while alternative and isinstance(command, click.Group) and alternative[0] in command.commands:
                command, alternative = command.commands[alternative[0]], alternative[1:]
            for word in alternative:
                for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", word):
                    assert option in options(command) | options(main), (
                        f"README.md: {line.strip()}: {command.name} has no {option}"
                    )
            checked += 1
    assert checked >= 25, checked


def _groups(group: Any) -> Iterator[Any]:
    import click

    yield group
    for command in group.commands.values():
        if isinstance(command, click.Group):
            yield from _groups(command)
