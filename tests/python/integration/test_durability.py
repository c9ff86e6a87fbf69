"""Durability settings and the client's side of the wait, without a standby (test_failover.py and
test_doc_failover.py run them against a real one): with no standby nothing is durable by
`standby`, so every call raises NotDurable after its timeout, with what it would have returned;
`commit` never waits; a permanent error of the wait is raised as it is; the settings are checked."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers_inbox import setup_domain

from pginbox import AsyncInbox, Durability, Inbox, Message, NotDurable, Outcome
from pginbox.consumer import load_consume_config
from pginbox.errors import ConsumerConfigError


def msg(i: str) -> Message:
    return Message("orders", i, "credit", {"id": i, "amount": 1})


@pytest.fixture
def domain(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    setup_domain(conn)
    return conn


def test_commit_mode_never_waits(db_dsn: str, domain: psycopg.Connection[Any]) -> None:
    with psycopg.connect(db_dsn) as c:
        inbox = Inbox(c, consumer="billing")
        assert inbox.durability == Durability() and not inbox.durability.waits
        assert inbox.apply(msg("c-1")).outcome is Outcome.APPLIED


def test_standby_mode_without_a_standby_raises_not_durable_with_the_results(
    db_dsn: str, domain: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(db_dsn) as c:
        inbox = Inbox(c, consumer="billing", durability=Durability.standby(timeout=0.05))
        with pytest.raises(NotDurable) as err:
            inbox.handle_batch([msg("s-1"), msg("s-2")], lambda cur, m: None)
        results: Any = err.value.results
        assert [r.outcome for r in results] == [Outcome.APPLIED, Outcome.APPLIED]
        assert "did not confirm it within 0.05 s" in str(err.value)
        # committed on the primary: the redelivery is a duplicate, and waits again
        with pytest.raises(NotDurable) as again:
            inbox.handle(msg("s-1"), lambda cur, m: None)
        duplicate: Any = again.value.results
        assert duplicate.outcome is Outcome.DUPLICATE
    row = domain.execute("SELECT count(*) FROM inbox.message WHERE message_id IN ('s-1', 's-2')").fetchone()
    assert row is not None and row[0] == 2


def test_async_client_waits_too(db_dsn: str, domain: psycopg.Connection[Any]) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(db_dsn) as c:
            inbox = AsyncInbox(c, consumer="billing", durability=Durability.standby(timeout=0.05))
            with pytest.raises(NotDurable):
                await inbox.apply(msg("a-1"))
            with pytest.raises(NotDurable):
                await inbox.apply_batch([msg("a-2"), msg("a-3")])

    asyncio.run(main())


def test_a_permanent_error_of_the_wait_is_raised_as_it_is(db_dsn: str, domain: psycopg.Connection[Any]) -> None:
    """The functions' owner (inbox_monitor) may not read the standbys' positions: 42501 with the GRANT to run (the
    consumer halts on it with that fix), not a NotDurable retried forever."""
    domain.execute("REVOKE pg_read_all_stats FROM inbox_monitor")
    try:
        with psycopg.connect(db_dsn) as c:
            inbox = Inbox(c, consumer="billing", durability=Durability.standby(timeout=0.05))
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
                inbox.apply(msg("p-1"))
            assert "GRANT pg_read_all_stats TO inbox_monitor" in (err.value.diag.message_hint or "")
    finally:
        domain.execute("GRANT pg_read_all_stats TO inbox_monitor")


def test_durability_checks_its_values() -> None:
    for bad in (
        {"mode": "sync"},
        {"min_standbys": 0},
        {"min_standbys": 65},
        {"wait": "write"},
        {"timeout": -1.0},
        {"standby_names": ()},
        {"standby_names": ("a", " ")},
    ):
        with pytest.raises(ValueError):
            Durability(**bad)
    d = Durability.standby(2, names=["pg2", "pg3"], wait="apply", timeout=3)
    assert d.params() == (2, "apply", ["pg2", "pg3"], 3)
    assert d.describe() == "standby: 2 of pg2,pg3, apply, timeout 3 s"


def test_consume_settings(tmp_path: Path) -> None:
    base = {"url": "amqp://127.0.0.1/", "consumer": "billing", "queue": "q"}
    assert load_consume_config(None, base).durability == Durability()
    d = load_consume_config(
        None,
        {
            **base,
            "durability": "standby",
            "min_standbys": "2",
            "standby_names": "pg2, pg3",
            "durability_timeout": "1.5",
        },
    ).durability
    assert (d.mode, d.min_standbys, d.standby_names, d.wait, d.timeout) == ("standby", 2, ("pg2", "pg3"), "flush", 1.5)
    for bad, what in (
        ({"durability": "sync"}, "durability='sync'"),
        ({"min_standbys": 2}, "apply to durability 'standby' only"),  # a typo must not leave you on commit
        ({"durability": "standby", "min_standbys": 0}, "min_standbys=0"),
        ({"durability": "standby", "standby_wait": "write"}, "standby_wait='write'"),
        ({"durability": "standby", "standby_names": ""}, "standby_names"),
        ({"durability": "standby", "durability_timeout": 7200}, "durability_timeout=7200"),
    ):
        with pytest.raises(ConsumerConfigError, match=what.replace("(", r"\(")):
            load_consume_config(None, {**base, **bad})
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[consume]\nurl = "amqp://x/"\nconsumer = "b"\nqueue = "q"\ndurability = "standby"\n'
        'standby_names = ["pg2"]\nstandby_wait = "apply"\n'
    )
    d = load_consume_config(toml).durability
    assert (d.standby_names, d.wait) == (("pg2",), "apply")
