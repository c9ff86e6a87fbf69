"""`pginbox demo`: four acts on a real database, each proving what it shows.

    act1_outcomes.py     every outcome of the inbox, one delivery at a time
    act2_simulation.py   thousands of messages through a broker that redelivers, loses acks, crashes
                         consumers and races duplicates; the invariant proven from the domain tables
    act3_outbox.py       handlers enqueue effects, the real dispatcher delivers them to a flaky
                         webhook (sink.py); one stable key per effect, each counted once
    act4_brokers.py      two services chained through RabbitMQ and NATS JetStream (skipped, with a
                         line saying so, when a broker is not reachable)
    broker.py            the at-least-once broker acts 2 and 3 share

run() deploys schema `inbox` (Sqitch) if it is missing, then runs the chosen acts. Every act uses a
new consumer name on every run, so the demo can run again on the same database.
"""

from __future__ import annotations

from collections.abc import Collection

import psycopg

from pginbox.demo import act2_simulation, act3_outbox, act4_brokers
from pginbox.demo.act1_outcomes import OutcomesAct
from pginbox.errors import InvariantBroken
from pginbox.schema import sqitch
from pginbox.schema.compat import SCHEMA_RELEASE, check_release

__all__ = ["ensure_schema", "run"]


def ensure_schema(dsn: str) -> None:
    """Deploy schema inbox when it is missing, bring a Sqitch-deployed one up to the plan (a no-op
    when it is current), and refuse a version this code does not know (SchemaVersionError; the
    CLI turns it into exit status 1)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT to_regnamespace('inbox') IS NOT NULL, to_regclass('sqitch.changes') IS NOT NULL"
        ).fetchone()
        deployed, by_sqitch = (bool(row[0]), bool(row[1])) if row else (False, False)
    if not deployed:
        print("deploying schema inbox with sqitch ...", flush=True)
        sqitch.deploy(dsn)
    elif by_sqitch:
        sqitch.deploy(dsn)  # changes added to the plan since; "Nothing to deploy" otherwise
    with psycopg.connect(dsn, autocommit=True) as conn:
        release_row = conn.execute(SCHEMA_RELEASE).fetchone()
    check_release(release_row, "the demo database")


def run(
    dsn: str,
    *,
    messages: int = 3000,
    workers: int = 4,
    seed: int | None = None,
    acts: Collection[int] = (1, 2, 3, 4),
    outbox_messages: int = 200,
    sink_dedup: bool = True,
) -> None:
    """Deploy if needed; act 1 walks through every outcome of the inbox, act 2 simulates
    at-least-once delivery with faults (pginbox.demo.act2_simulation) and proves the invariant, act 3
    (pginbox.demo.act3_outbox) delivers outbox effects to a flaky HTTP sink and proves the outbox's
    promise. `acts` selects the acts. Raises InvariantBroken (exit status 1 from the CLI) when an
    act finds its invariant broken."""
    ensure_schema(dsn)
    if 1 in acts:
        act1 = OutcomesAct(dsn)
        try:
            act1.run()
        finally:
            act1.conn.close()
    if 2 in acts and not act2_simulation.run(dsn, messages=messages, workers=workers, seed=seed):
        raise InvariantBroken("the invariant is broken: a message was applied twice or lost (see FAILED above)")
    if 3 in acts and not act3_outbox.run(dsn, seed=seed, messages=outbox_messages, sink_dedup=sink_dedup):
        raise InvariantBroken(
            "the outbox promise is broken: an effect was lost, sent with another key or counted twice "
            "(see FAILED above)"
        )
    if 4 in acts and not act4_brokers.run(dsn):
        raise InvariantBroken(
            "the broker chain is broken: an order was lost, published after a rollback or applied "
            "twice (see FAILED above)"
        )
