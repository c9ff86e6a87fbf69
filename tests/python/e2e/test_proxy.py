"""The routing layer (proxy/, issue 28): a proxy database with real PL/Proxy in front of four shard
databases with pginbox deployed, each holding a domain table keyed by tenant.

- every delivery is applied once, on the shard that owns its tenant (the documented hash), and
  nowhere else; redeliveries answer duplicate, changed payloads conflict, through the proxy;
- failures end in quarantine on the owning shard; the operator lists them over all shards and
  decides on the owning one;
- a batch spanning shards gives per-message outcomes in the caller's order;
- the shards see the caller's own role: a consumer's rights are not lent through the proxy;
- one shard stopped: its tenants' calls fail with 08006 (retryable), the other tenants go on;
- a tenant moved between shards with the documented procedure (docs/scaling.md);
- the Python client (Inbox.apply, apply_batch) against the proxy DSN.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import REPO_ROOT, create_database, drop_database, dsn_for, make_cluster, sqitch_project
from helpers_brokers import ConsumerThread, Out, channel, make_consumer, wait_for
from helpers_paths import pythonpath
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb

from pginbox.client.inbox import Inbox
from pginbox.client.outcomes import Message, Outcome
from pginbox.client.retry import is_transient
from pginbox.schema import sqitch

pytestmark = pytest.mark.timeout(300)

SHARDS = 4
CONSUMER = "bookings"

SHARD_DDL = """
CREATE TABLE public.booking (tenant text NOT NULL, message_id text NOT NULL, amount integer NOT NULL);
CREATE FUNCTION public.book(payload jsonb, ctx inbox.message_context) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  IF (payload->>'amount')::integer < 0 THEN
    RAISE EXCEPTION 'negative amount %', payload->>'amount' USING ERRCODE = 'check_violation';
  END IF;
  INSERT INTO public.booking VALUES (ctx.tenant, ctx.message_id, (payload->>'amount')::integer);
END $$;
SELECT inbox.register_handler('bookings', 'booked', 'public.book(jsonb, inbox.message_context)', 'v1');
SELECT inbox.configure_consumer('bookings', max_attempts => 3);
"""


def with_user(dsn: str, user: str) -> str:
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["user"] = user
    return make_conninfo("", **params)


def keyword_dsn(dsn: str) -> str:
    """A shard's connection string for configure_shards: no user (the proxy connects as the caller)."""
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None and k != "user"}
    return " ".join(f"{k}={v}" for k, v in params.items())


def prepare_shard(dsn: str, roles: dict[str, str]) -> None:
    """Domain table and handler; the login roles' grants and bindings (roles exist on the cluster)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SHARD_DDL)
        service, intruder = roles["service"], roles["intruder"]
        conn.execute(sql.SQL("GRANT SELECT, INSERT ON public.booking TO {}").format(sql.Identifier(service)))
        conn.execute("SELECT inbox.bind_consumer('bookings', %s::regrole)", (service,))
        conn.execute("SELECT inbox.bind_consumer('elsewhere', %s::regrole)", (intruder,))


def create_roles(base: str, suffix: str) -> dict[str, str]:
    roles = {
        "service": f"px_service_{suffix}",
        "intruder": f"px_intruder_{suffix}",
        "operator": f"px_operator_{suffix}",
        "reader": f"px_reader_{suffix}",
    }
    groups = {
        "service": "inbox_consumer",
        "intruder": "inbox_consumer",
        "operator": "inbox_operator",
        "reader": "inbox_reader",
    }
    with psycopg.connect(dsn_for(base, "postgres"), autocommit=True) as admin:
        for key, name in roles.items():
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
            admin.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(groups[key]), sql.Identifier(name)))
    return roles


def drop_roles(base: str, roles: dict[str, str], databases: list[str]) -> None:
    for db in databases:
        try:
            with psycopg.connect(dsn_for(base, db), autocommit=True) as conn:
                for name in roles.values():
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        except psycopg.Error:
            pass
    with psycopg.connect(dsn_for(base, "postgres"), autocommit=True) as admin:
        for name in roles.values():
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def deploy_proxy(dsn: str) -> None:
    project = sqitch_project()
    sqitch.deploy(dsn, project=(project / "proxy") if project is not None else sqitch.find_proxy_project())


@dataclass
class Farm:
    base: str
    proxy_db: str
    shard_dbs: list[str]
    roles: dict[str, str]

    def proxy(self, role: str = "service") -> str:
        return with_user(dsn_for(self.base, self.proxy_db), self.roles[role])

    def shard(self, i: int) -> str:
        return dsn_for(self.base, self.shard_dbs[i])

    def shard_of(self, tenant: str) -> int:
        with psycopg.connect(dsn_for(self.base, self.proxy_db), autocommit=True) as conn:
            row = conn.execute("SELECT inbox.shard_of(%s)", (tenant,)).fetchone()
        assert row is not None
        return int(row[0])

    def bookings(self) -> list[dict[tuple[str, str], int]]:
        """Per shard: (tenant, message_id) -> rows in public.booking."""
        out = []
        for i in range(len(self.shard_dbs)):
            with psycopg.connect(self.shard(i), autocommit=True) as conn:
                rows = conn.execute("SELECT tenant, message_id, count(*) FROM public.booking GROUP BY 1, 2").fetchall()
            out.append({(t, m): int(n) for t, m, n in rows})
        return out


@pytest.fixture(scope="module")
def farm(pg_base: str, template_db: str) -> Iterator[Farm]:
    suffix = uuid.uuid4().hex[:8]
    roles = create_roles(pg_base, suffix)
    shard_dbs = [f"px_{suffix}_s{i}" for i in range(SHARDS)]
    proxy_db = f"px_{suffix}_proxy"
    try:
        for name in shard_dbs:
            create_database(pg_base, name, template=template_db)
            prepare_shard(dsn_for(pg_base, name), roles)
        create_database(pg_base, proxy_db)
        deploy_proxy(dsn_for(pg_base, proxy_db))
        with psycopg.connect(dsn_for(pg_base, proxy_db), autocommit=True) as conn:
            conn.execute("SELECT inbox.configure_shards(%s)", ([keyword_dsn(dsn_for(pg_base, n)) for n in shard_dbs],))
        yield Farm(pg_base, proxy_db, shard_dbs, roles)
    finally:
        for name in [proxy_db, *shard_dbs]:
            drop_database(pg_base, name)
        drop_roles(pg_base, roles, [])


def uid(prefix: str = "m") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def tenants_on_every_shard(farm: Farm, per_shard: int = 2) -> list[str]:
    """Tenant names covering every shard, per_shard of each."""
    found: dict[int, list[str]] = {i: [] for i in range(SHARDS)}
    n = 0
    while any(len(v) < per_shard for v in found.values()):
        tenant = f"tenant-{uuid.uuid4().hex[:6]}-{n}"
        n += 1
        shard = farm.shard_of(tenant)
        if len(found[shard]) < per_shard:
            found[shard].append(tenant)
    return [t for i in range(SHARDS) for t in found[i]]


def apply(conn: psycopg.Connection[Any], message_id: str, tenant: str, amount: int = 1) -> dict[str, Any]:
    cur = conn.execute(
        "SELECT r.outcome, r.reason_code, r.quarantine_id, r.attempts"
        "  FROM inbox.claim_and_apply(consumer => %s, producer => 'orders', message_id => %s,"
        "                             message_type => 'booked', payload => %s, tenant => %s) r",
        (CONSUMER, message_id, Jsonb({"amount": amount}), tenant),
    )
    row = cur.fetchone()
    assert row is not None
    return dict(zip(["outcome", "reason_code", "quarantine_id", "attempts"], row, strict=True))


def test_routing_hash_is_the_documented_one(farm: Farm) -> None:
    """partition = hashtext(coalesce(tenant, '')) & (count - 1), computed here independently."""
    with psycopg.connect(farm.shard(0), autocommit=True) as conn:
        for tenant in ["", "acme", "globex", "tenant-42", "ünïcode"]:
            row = conn.execute("SELECT hashtext(%s) & %s", (tenant, SHARDS - 1)).fetchone()
            assert row is not None
            assert farm.shard_of(tenant) == row[0], tenant


def test_each_delivery_applied_once_on_its_shard_only(farm: Farm) -> None:
    tenants = tenants_on_every_shard(farm, per_shard=2)
    sent = [(uid(), tenants[i % len(tenants)]) for i in range(12)]
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        for message_id, tenant in sent:
            assert apply(conn, message_id, tenant)["outcome"] == "applied"
        # redelivered: duplicate, and the handler did not run again
        for message_id, tenant in sent:
            assert apply(conn, message_id, tenant)["outcome"] == "duplicate"
    bookings = farm.bookings()
    for message_id, tenant in sent:
        owner = farm.shard_of(tenant)
        for i in range(SHARDS):
            assert bookings[i].get((tenant, message_id), 0) == (1 if i == owner else 0), (tenant, i)
        with psycopg.connect(farm.shard(owner), autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM inbox.message WHERE tenant = %s AND message_id = %s", (tenant, message_id)
            ).fetchone()
            assert row == (1,)
    # every shard got some of them (the test is not passing on one shard)
    assert all(any(t in tenants for t, _ in b) for b in bookings)


def test_conflict_through_the_proxy_is_quarantined_on_the_owning_shard(farm: Farm) -> None:
    tenant = tenants_on_every_shard(farm, per_shard=1)[2]
    owner = farm.shard_of(tenant)
    message_id = uid()
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        assert apply(conn, message_id, tenant, 5)["outcome"] == "applied"
        changed = apply(conn, message_id, tenant, 6)
    assert changed["outcome"] == "conflict" and changed["reason_code"] == "identity_conflict"
    for i in range(SHARDS):
        with psycopg.connect(farm.shard(i), autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM inbox.quarantine WHERE tenant = %s AND message_id = %s AND kind = 'conflict'",
                (tenant, message_id),
            ).fetchone()
        assert row == ((1,) if i == owner else (0,))
    assert farm.bookings()[owner][(tenant, message_id)] == 1


def test_failures_end_in_quarantine_on_the_owning_shard_and_the_operator_decides_there(farm: Farm) -> None:
    tenant = tenants_on_every_shard(farm, per_shard=1)[1]
    owner = farm.shard_of(tenant)
    message_id = uid()
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        outcomes = [apply(conn, message_id, tenant, -1) for _ in range(3)]  # max_attempts 3
    assert [o["outcome"] for o in outcomes] == ["failed", "failed", "quarantined"]
    assert outcomes[0]["reason_code"] == "23514"
    quarantine_id = outcomes[-1]["quarantine_id"]

    with psycopg.connect(farm.proxy("operator"), autocommit=True) as op:
        listed = op.execute(
            "SELECT shard, quarantine_id, tenant, message_id, reason_code FROM inbox.quarantine_entries(%s)",
            (CONSUMER,),
        ).fetchall()
        mine = [r for r in listed if r[2] == tenant and r[3] == message_id]
        assert len(mine) == 1
        assert mine[0][0].endswith("/" + farm.shard_dbs[owner]) and mine[0][1] == quarantine_id
        # the id alone does not pick the shard: the wrong tenant is not found
        other = next(t for t in tenants_on_every_shard(farm, per_shard=1) if farm.shard_of(t) != owner)
        with pytest.raises(psycopg.errors.NoDataFound, match="no quarantine entry"):
            op.execute("SELECT * FROM inbox.discard(%s, %s, 'wrong tenant')", (other, quarantine_id))
        decided = op.execute(
            "SELECT status, decided_by FROM inbox.discard(%s, %s, 'bad amount, refunded by hand')",
            (tenant, quarantine_id),
        ).fetchone()
        assert decided == ("discarded", farm.roles["operator"])
    with psycopg.connect(farm.shard(owner), autocommit=True) as conn:
        row = conn.execute(
            "SELECT q.status, d.decided_by FROM inbox.quarantine q"
            "  JOIN inbox.quarantine_decision d USING (quarantine_id) WHERE q.quarantine_id = %s",
            (quarantine_id,),
        ).fetchone()
    assert row == ("discarded", farm.roles["operator"])
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        assert apply(conn, message_id, tenant, -1)["outcome"] == "duplicate"  # discarded: closed


def test_record_start_and_record_failure_are_routed(farm: Farm) -> None:
    tenant = tenants_on_every_shard(farm, per_shard=1)[3]
    owner = farm.shard_of(tenant)
    message_id = uid()
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        start = conn.execute(
            "SELECT outcome, attempts FROM inbox.record_start(%s, 'orders', %s, %s, 'booked')",
            (CONSUMER, message_id, tenant),
        ).fetchone()
        assert start == ("proceed", 1)
        failed = conn.execute(
            "SELECT outcome, attempts, reason_code FROM inbox.record_failure(%s, 'orders', %s, %s, 'downstream_down',"
            " 'the ledger service timed out', 'v1', %s, 'booked')",
            (CONSUMER, message_id, Jsonb({"amount": 1}), tenant),
        ).fetchone()
        assert failed == ("failed", 1, "downstream_down")
    for i in range(SHARDS):
        with psycopg.connect(farm.shard(i), autocommit=True) as conn:
            row = conn.execute(
                "SELECT started, failed FROM inbox.attempt WHERE tenant = %s AND message_id = %s", (tenant, message_id)
            ).fetchone()
        assert row == ((1, 1) if i == owner else None)


def test_batch_across_shards_per_message_outcomes_in_order(farm: Farm) -> None:
    tenants = tenants_on_every_shard(farm, per_shard=2)
    done = (uid(), tenants[0])
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        assert apply(conn, done[0], done[1])["outcome"] == "applied"
        fresh = [(uid(), tenants[i % len(tenants)]) for i in range(10)]
        batch: list[dict[str, Any]] = [
            {"producer": "orders", "message_id": m, "message_type": "booked", "payload": {"amount": 2}, "tenant": t}
            for m, t in fresh
        ]
        batch.insert(
            3,
            {
                "producer": "orders",
                "message_id": done[0],
                "message_type": "booked",
                "payload": {"amount": 1},
                "tenant": done[1],
            },
        )
        batch.insert(
            5,
            {
                "producer": "orders",
                "message_id": done[0],
                "message_type": "booked",
                "payload": {"amount": 7},
                "tenant": done[1],
            },
        )
        bad = uid()
        batch.insert(
            7,
            {
                "producer": "orders",
                "message_id": bad,
                "message_type": "booked",
                "payload": {"amount": -3},
                "tenant": tenants[5],
            },
        )
        rows = conn.execute(
            "SELECT ordinal, tenant, message_id, outcome, reason_code FROM inbox.claim_and_apply_batch(%s, %s)",
            (CONSUMER, Jsonb(batch)),
        ).fetchall()
        assert [r[0] for r in rows] == list(range(1, len(batch) + 1))
        assert [(r[1], r[2]) for r in rows] == [(b["tenant"], b["message_id"]) for b in batch]
        expected = ["applied"] * len(batch)
        expected[3], expected[5], expected[7] = "duplicate", "conflict", "failed"
        assert [r[3] for r in rows] == expected
        assert rows[7][4] == "23514"
        assert conn.execute("SELECT count(*) FROM inbox.claim_and_apply_batch(%s, '[]')", (CONSUMER,)).fetchone() == (
            0,
        )
        with pytest.raises(psycopg.errors.ProgramLimitExceeded):
            conn.execute("SELECT * FROM inbox.claim_and_apply_batch(%s, %s)", (CONSUMER, Jsonb(batch * 7)))
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="JSON array of message objects"):
            conn.execute("SELECT * FROM inbox.claim_and_apply_batch(%s, '[1]')", (CONSUMER,))
    bookings = farm.bookings()
    for m, t in fresh:
        owner = farm.shard_of(t)
        assert [bookings[i].get((t, m), 0) for i in range(SHARDS)] == [int(i == owner) for i in range(SHARDS)]
    assert all(bookings[i].get((tenants[5], bad), 0) == 0 for i in range(SHARDS))


def test_shards_see_the_callers_role(farm: Farm) -> None:
    """The proxy lends nobody its rights: a consumer role bound to another consumer is refused by
    the shard, as it would be there directly; errors keep their SQLSTATE, message and hint."""
    tenant = tenants_on_every_shard(farm, per_shard=1)[0]
    with (
        psycopg.connect(farm.proxy("intruder"), autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege) as caught,
    ):
        apply(conn, uid(), tenant)
    assert "may not act as consumer 'bookings'" in str(caught.value)
    assert "REMOTE ERROR" not in str(caught.value)
    assert caught.value.diag.message_hint and "bind_consumer" in caught.value.diag.message_hint
    with psycopg.connect(farm.proxy("reader"), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            apply(conn, uid(), tenant)
        # readers aggregate over every shard, each series labelled with its shard
        shards = {r[0] for r in conn.execute("SELECT labels->>'shard' FROM inbox.metrics()")}
        assert len(shards) == SHARDS
        status = conn.execute("SELECT shard, release FROM inbox.shard_status()").fetchall()
        assert len(status) == SHARDS and {r[1] for r in status} == {"0.3.0"}
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM inbox.quarantine_entries()")


def test_configure_shards_is_operator_only_and_checked(farm: Farm) -> None:
    with psycopg.connect(farm.proxy("service"), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT inbox.configure_shards(ARRAY['host=127.0.0.1 dbname=x'])")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT inbox.begin_tenant_move('acme', 'no')")
    with psycopg.connect(farm.proxy("operator"), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="power of two"):
            conn.execute("SELECT inbox.configure_shards(ARRAY['dbname=a', 'dbname=b', 'dbname=c'])")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="must not name a user"):
            conn.execute("SELECT inbox.configure_shards(ARRAY['dbname=a user=postgres'])")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="must not name a user"):
            conn.execute("SELECT inbox.configure_shards(ARRAY['dbname=a', 'dbname=b password=x'])")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="not a URI"):
            conn.execute("SELECT inbox.configure_shards(ARRAY['postgresql://postgres@h/db'])")
        with pytest.raises(psycopg.errors.NullValueNotAllowed):
            conn.execute("SELECT inbox.configure_shards(NULL)")
        assert conn.execute("SELECT inbox.partition_count()").fetchone() == (SHARDS,)


def test_python_client_against_the_proxy(farm: Farm) -> None:
    tenants = tenants_on_every_shard(farm, per_shard=1)
    with psycopg.connect(farm.proxy()) as conn:
        inbox = Inbox(conn, consumer=CONSUMER)
        one = Message("orders", uid(), "booked", {"amount": 3}, tenant=tenants[0])
        assert inbox.apply(one).outcome is Outcome.APPLIED
        assert inbox.apply(one).outcome is Outcome.DUPLICATE
        changed = Message("orders", one.message_id, "booked", {"amount": 4}, tenant=tenants[0])
        assert inbox.apply(changed).outcome is Outcome.CONFLICT
        batch = [Message("orders", uid(), "booked", {"amount": 1}, tenant=tenants[i % SHARDS]) for i in range(9)]
        batch.append(Message("orders", uid(), "booked", {"amount": -1}, tenant=tenants[2]))
        results = inbox.apply_batch([*batch, one])
        assert [r.outcome for r in results] == [Outcome.APPLIED] * 9 + [Outcome.FAILED, Outcome.DUPLICATE]
        # a redelivery announces itself (record_start through the proxy) and is applied below the limit
        again = Message("orders", uid(), "booked", {"amount": 1}, tenant=tenants[1], redelivered=True)
        assert inbox.apply(again).outcome is Outcome.APPLIED
    bookings = farm.bookings()
    for m in [*batch[:9], one, again]:
        owner = farm.shard_of(m.tenant)
        assert [bookings[i].get((m.tenant, m.message_id), 0) for i in range(SHARDS)] == [
            int(i == owner) for i in range(SHARDS)
        ]


def test_consume_against_the_proxy(farm: Farm) -> None:
    """`pginbox consume` (the Consumer loop, SQL handlers) with the proxy DSN: each batch the broker
    hands over is split per shard by inbox.claim_and_apply_batch, every message applied once on its
    tenant's shard, a redelivered batch answers duplicate."""
    tenants = tenants_on_every_shard(farm, per_shard=2)
    sent = [(uid("c"), tenants[i % len(tenants)]) for i in range(40)]
    with channel("memory") as ch:
        ch.publish([Out(m, {"amount": 1}, message_type="booked", tenant=t) for m, t in sent])
        consumer = make_consumer(ch, farm.proxy(), consumer=CONSUMER, prefetch=16)
        with ConsumerThread(consumer):
            wait_for(lambda: consumer.stats.outcomes.get("applied", 0) == len(sent), "every message applied")
            wait_for(lambda: ch.pending() == 0, "every message acked")
        assert consumer.stats.outcomes == {"applied": len(sent)}, consumer.stats.outcomes
        assert consumer.stats.transactions < len(sent)  # batches, not one call per message
        ch.publish([Out(m, {"amount": 1}, message_type="booked", tenant=t) for m, t in sent[:5]])
        again = make_consumer(ch, farm.proxy(), consumer=CONSUMER, prefetch=16)
        with ConsumerThread(again):
            wait_for(lambda: ch.pending() == 0, "the redeliveries acked")
        assert again.stats.outcomes == {"duplicate": 5}, again.stats.outcomes
    bookings = farm.bookings()
    for m, t in sent:
        owner = farm.shard_of(t)
        assert [bookings[i].get((t, m), 0) for i in range(SHARDS)] == [int(i == owner) for i in range(SHARDS)]


def test_one_shard_stopped_its_tenants_fail_retryably_the_others_go_on(
    farm: Farm, pg_base: str, tmp_path: Path
) -> None:
    """Partition 3 on a cluster of its own, stopped mid-run: its tenants get 08006 (what the
    client's retry policy classifies as transient) with a message naming the tenant; the tenants
    of partitions 0-2 are applied meanwhile; once it is back, the held tenant is applied."""
    lone = make_cluster(tmp_path)
    proxy_db = f"px_{uuid.uuid4().hex[:8]}_proxy2"
    try:
        lone.create_database("shard3")
        sqitch.deploy(lone.dsn("shard3"), project=sqitch_project())
        with psycopg.connect(lone.dsn("postgres"), autocommit=True) as admin:
            for name in farm.roles.values():
                admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
            admin.execute(sql.SQL("GRANT inbox_consumer TO {}").format(sql.Identifier(farm.roles["service"])))
            admin.execute(sql.SQL("GRANT inbox_consumer TO {}").format(sql.Identifier(farm.roles["intruder"])))
        prepare_shard(lone.dsn("shard3"), farm.roles)
        create_database(pg_base, proxy_db)
        deploy_proxy(dsn_for(pg_base, proxy_db))
        dsns = [keyword_dsn(farm.shard(i)) for i in range(3)] + [keyword_dsn(lone.dsn("shard3"))]
        with psycopg.connect(dsn_for(pg_base, proxy_db), autocommit=True) as conn:
            conn.execute("SELECT inbox.configure_shards(%s)", (dsns,))
        tenants = tenants_on_every_shard(farm, per_shard=1)  # partition i: tenants[i]
        proxy = with_user(dsn_for(pg_base, proxy_db), farm.roles["service"])
        with psycopg.connect(proxy, autocommit=True) as conn:
            assert apply(conn, uid(), tenants[3])["outcome"] == "applied"
            lone.stop("fast")
            held = uid()
            with pytest.raises(psycopg.errors.ConnectionFailure) as caught:
                apply(conn, held, tenants[3])
            assert is_transient(caught.value)
            assert f"the shard of tenant '{tenants[3]}' cannot be reached" in str(caught.value)
            for tenant in tenants[:3]:
                assert apply(conn, uid(), tenant)["outcome"] == "applied"
            # a batch with a message for the stopped shard fails as a whole, retryably
            with pytest.raises(psycopg.errors.ConnectionFailure):
                conn.execute(
                    "SELECT * FROM inbox.claim_and_apply_batch(%s, %s)",
                    (
                        CONSUMER,
                        Jsonb(
                            [
                                {
                                    "producer": "orders",
                                    "message_id": uid(),
                                    "message_type": "booked",
                                    "payload": {"amount": 1},
                                    "tenant": t,
                                }
                                for t in tenants
                            ]
                        ),
                    ),
                )
            lone.start()
            assert apply(conn, held, tenants[3])["outcome"] == "applied"
    finally:
        drop_database(pg_base, proxy_db)
        lone.destroy()


def move_script() -> str:
    """The ```sh block of docs/scaling.md under "Moving a tenant"."""
    text = (REPO_ROOT / "docs" / "scaling.md").read_text()
    section = text.split("## Moving a tenant", 1)[1]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def test_tenant_move_procedure(farm: Farm) -> None:
    """docs/scaling.md's procedure, run as written: the tenant's inbox rows travel with its domain
    rows; afterwards redeliveries answer duplicate from the new shard and new messages land there."""
    tenants = tenants_on_every_shard(farm, per_shard=1)
    tenant, source = tenants[0], 0
    target = 2
    sent = [uid() for _ in range(3)]
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        for m in sent:
            assert apply(conn, m, tenant)["outcome"] == "applied"
    admin_proxy = dsn_for(farm.base, farm.proxy_db)
    env = dict(
        os.environ,
        PROXY=admin_proxy,
        SOURCE=farm.shard(source),
        TARGET=farm.shard(target),
        TENANT=tenant,
        TO_PARTITION=str(target),
        DOMAIN_TABLES="public.booking",
    )
    # The move holds the tenant while it runs: a call in the middle is refused, retryably.
    script = move_script()
    first, rest = script.split("# 2.", 1)
    subprocess.run(["bash", "-euo", "pipefail", "-c", first], env=env, check=True)
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.LockNotAvailable, match="being moved") as caught:
            apply(conn, uid(), tenant)
        assert is_transient(caught.value)
    subprocess.run(["bash", "-euo", "pipefail", "-c", "# 2." + rest], env=env, check=True)

    assert farm.shard_of(tenant) == target
    with psycopg.connect(farm.proxy(), autocommit=True) as conn:
        for m in sent:
            assert apply(conn, m, tenant)["outcome"] == "duplicate"
        new = uid()
        assert apply(conn, new, tenant)["outcome"] == "applied"
    bookings = farm.bookings()
    for m in [*sent, new]:
        assert bookings[target].get((tenant, m)) == 1 and bookings[source].get((tenant, m), 0) == 0
    with psycopg.connect(farm.shard(source), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM inbox.message WHERE tenant = %s", (tenant,)).fetchone() == (0,)


def test_cli_deploys_and_verifies_the_proxy(pg_base: str) -> None:
    name = f"px_{uuid.uuid4().hex[:8]}_cli"
    create_database(pg_base, name)
    try:
        dsn = dsn_for(pg_base, name)
        env = dict(os.environ)
        for command in ("deploy", "verify"):
            out = subprocess.run(
                [sys.executable, "-m", "pginbox", command, "--proxy", "--dsn", dsn],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            assert out.returncode == 0, out.stdout + out.stderr
        assert "proxy_operator" in out.stdout
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT release FROM inbox.schema_release()").fetchone() == ("0.3.0",)
    finally:
        drop_database(pg_base, name)


PURGE_SETUP = """
CREATE FUNCTION public.noop(payload jsonb) RETURNS void LANGUAGE sql BEGIN ATOMIC SELECT 1; END;
SELECT inbox.register_handler('ledger', 'noted', 'public.noop(jsonb)', 'v1');
SELECT inbox.set_retention_policy('ledger', '', broker_retention => '7 days', max_offset_rewind => '3 days',
    dead_letter_redrive_horizon => '14 days', producer_retry_horizon => '1 day', outage_allowance => '2 days',
    backup_restore_window => '1 day', planned_replay_horizon => '0', safety_margin => '1 hour',
    note => 'test policy: window 17 days 1 hour');
"""

AGE = """
UPDATE inbox.message SET processed_at = now() - interval '30 days', produced_at = now() - interval '30 days'
 WHERE consumer = 'ledger';
DELETE FROM inbox.activity_gap WHERE consumer = 'ledger';
INSERT INTO inbox.activity_gap (consumer, gap_from, gap_to) VALUES ('ledger', '-infinity', now() - interval '60 days');
UPDATE inbox.consumer_config SET last_active_at = now() WHERE consumer = 'ledger';
"""


def test_purge_serves_several_shards(pg_base: str, template_db: str) -> None:
    """`pginbox purge --shard-dsn A --shard-dsn B ...`: one process purges every shard in turn, one
    connection at a time; a shard that is down is reported and the others are purged."""
    names = [f"px_{uuid.uuid4().hex[:8]}_purge{i}" for i in range(2)]
    try:
        for i, name in enumerate(names):
            create_database(pg_base, name, template=template_db)
            with psycopg.connect(dsn_for(pg_base, name), autocommit=True) as conn:
                conn.execute(PURGE_SETUP)
                for n in range(3 + i):
                    conn.execute(
                        "SELECT inbox.claim_and_apply('ledger', 'books', %s, 'noted', '{}', produced_at => now())",
                        (f"n{n}",),
                    )
                conn.execute(AGE)
        down = make_conninfo(dsn_for(pg_base, "nowhere"), port="1", connect_timeout="2")
        argv = [sys.executable, "-m", "pginbox", "purge", "--json"]
        for dsn in [dsn_for(pg_base, names[0]), down, dsn_for(pg_base, names[1])]:
            argv += ["--shard-dsn", dsn]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 1, done.stdout + done.stderr
        shards = json.loads(done.stdout)["shards"]
        assert [s.get("error") is not None for s in shards] == [False, True, False]
        assert [s["consumers"][0]["rows_deleted"] for s in (shards[0], shards[2])] == [3, 4]
        assert [s["consumers"][0]["status"] for s in (shards[0], shards[2])] == ["purged", "purged"]
        for name in names:
            with psycopg.connect(dsn_for(pg_base, name), autocommit=True) as conn:
                assert conn.execute("SELECT count(*) FROM inbox.message").fetchone() == (0,)
        again = subprocess.run(
            [
                sys.executable,
                "-m",
                "pginbox",
                "purge",
                *[a for n in names for a in ("--shard-dsn", dsn_for(pg_base, n))],
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert again.returncode == 0, again.stderr
        assert again.stdout.count("ledger: nothing to purge") == 2
    finally:
        for name in names:
            drop_database(pg_base, name)


def test_dispatch_serves_several_shards(pg_base: str, template_db: str, tmp_path: Path) -> None:
    """`pginbox dispatch --shard-dsn A --shard-dsn B --once`: one process, one dispatcher per shard,
    every shard's committed effects delivered once; a line of stats per shard."""
    names = [f"px_{uuid.uuid4().hex[:8]}_disp{i}" for i in range(2)]
    try:
        for i, name in enumerate(names):
            create_database(pg_base, name, template=template_db)
            with psycopg.connect(dsn_for(pg_base, name), autocommit=True) as conn:
                for n in range(3 + i):
                    conn.execute("SELECT inbox.enqueue_effect(%s, 'sink', '{}'::jsonb)", (f"s{i}-e{n}",))
        sink = tmp_path / "sink.txt"
        env = {
            **os.environ,
            "PGINBOX_TEST_SINK": str(sink),
            "PYTHONPATH": pythonpath(),
        }
        argv = [sys.executable, "-m", "pginbox", "dispatch", "--once", "--name", "sharded", "--batch-size", "2"]
        argv += ["--callable", "sink=_dispatch_sink:record"]
        for name in names:
            argv += ["--shard-dsn", dsn_for(pg_base, name)]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sorted(sink.read_text().split()) == sorted(
            [f"s0-e{n}" for n in range(3)] + [f"s1-e{n}" for n in range(4)]
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("shard=")]
        assert len(lines) == 2 and "delivered=3" in lines[0] and "delivered=4" in lines[1], done.stdout
        for name in names:
            with psycopg.connect(dsn_for(pg_base, name), autocommit=True) as conn:
                assert conn.execute("SELECT count(*) FROM inbox.outbox WHERE status <> 'delivered'").fetchone() == (0,)
        refused = subprocess.run(
            [*argv, "--health-port", "0"], capture_output=True, text=True, env=env, timeout=60, check=False
        )
        assert refused.returncode == 2 and "one process per shard" in refused.stderr
        # the daemon: woken by each shard's commits, stopped by SIGTERM with exit 0
        daemon = [a for a in argv if a != "--once"]
        proc = subprocess.Popen(daemon, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            for i, name in enumerate(names):
                with psycopg.connect(dsn_for(pg_base, name), autocommit=True) as conn:
                    conn.execute("SELECT inbox.enqueue_effect(%s, 'sink', '{}'::jsonb)", (f"late-{i}",))
            wait_for(lambda: {"late-0", "late-1"} <= set(sink.read_text().split()), "late effects delivered")
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err
        assert out.count("shard=") == 2
    finally:
        for name in names:
            drop_database(pg_base, name)


def test_eight_partitions_on_four_databases(farm: Farm, pg_base: str) -> None:
    """A connection string may repeat (room to spread later): 8 partitions over the 4 shards, p_i on
    shard i % 4. A batch is split per partition and still lands each message on its tenant's shard
    once; reads over all shards see each database once."""
    proxy_db = f"px_{uuid.uuid4().hex[:8]}_proxy8"
    try:
        create_database(pg_base, proxy_db)
        deploy_proxy(dsn_for(pg_base, proxy_db))
        dsns = [keyword_dsn(farm.shard(i % SHARDS)) for i in range(2 * SHARDS)]
        with psycopg.connect(dsn_for(pg_base, proxy_db), autocommit=True) as conn:
            assert conn.execute("SELECT inbox.configure_shards(%s)", (dsns,)).fetchone() == (2 * SHARDS,)
        proxy = with_user(dsn_for(pg_base, proxy_db), farm.roles["service"])
        tenants = [f"eight-{uuid.uuid4().hex[:6]}-{n}" for n in range(24)]
        sent = [(uid("e"), t) for t in tenants]
        batch = [
            {"producer": "orders", "message_id": m, "message_type": "booked", "payload": {"amount": 1}, "tenant": t}
            for m, t in sent
        ]
        with psycopg.connect(proxy, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT ordinal, message_id, outcome FROM inbox.claim_and_apply_batch(%s, %s)", (CONSUMER, Jsonb(batch))
            ).fetchall()
            assert rows == [(i + 1, m, "applied") for i, (m, _) in enumerate(sent)]
            found = conn.execute("SELECT t, inbox.shard_of(t) FROM unnest(%s::text[]) t", (tenants,)).fetchall()
            partitions = {str(t): int(p) for t, p in found}
        reader = with_user(dsn_for(pg_base, proxy_db), farm.roles["reader"])
        with psycopg.connect(reader, autocommit=True) as conn:
            assert len(conn.execute("SELECT shard FROM inbox.shard_status()").fetchall()) == SHARDS
        assert len(set(partitions.values())) > SHARDS  # partitions 4-7 are in use too
        bookings = farm.bookings()
        for m, t in sent:
            owner = partitions[t] % SHARDS
            assert owner == farm.shard_of(t)  # the same database as with 4 partitions: hash & 3
            assert [bookings[i].get((t, m), 0) for i in range(SHARDS)] == [int(i == owner) for i in range(SHARDS)]
    finally:
        drop_database(pg_base, proxy_db)


def test_shard_dsns_from_the_environment_one_per_line() -> None:
    """PGINBOX_PURGE_SHARD_DSN holds one connection string per line (they contain spaces)."""
    dead = [f"host=127.0.0.1 port=1 dbname=shard{i} connect_timeout=2" for i in range(2)]
    env = {**os.environ, "PGINBOX_PURGE_SHARD_DSN": "\n".join(dead)}
    done = subprocess.run(
        [sys.executable, "-m", "pginbox", "purge", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert [s["shard"] for s in json.loads(done.stdout)["shards"]] == dead
