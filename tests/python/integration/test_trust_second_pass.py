"""Trust no caller, second pass (issue 21, schema 0.3.0, docs/security.md): each test is an attack
made the way the review made it — separate LOGIN roles granted only the documented group roles, a
hostile service's own handler, a tenant-scoped role, an operator doing routine work, a login that
takes guessable lock keys — and asserts that it fails and that the invariant holds for the victim.

The domain is test_trust_boundaries's: consumer 'billing' credits accounts (app.ledger has no unique
key: a second application would show) and is bound to the billing service's role.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import create_database, drop_database, dsn_for
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from test_trust_boundaries import connect, role_of, scalar, setup_billing

Conn = psycopg.Connection[Any]


def ident(name: str) -> sql.Identifier:
    return sql.Identifier(name)


def hostile_service(conn: Conn, login_role: Callable[..., str]) -> tuple[str, str]:
    """A second service, bound only to its own consumer 'svc2', whose handler (SECURITY DEFINER, owned
    by its role, exactly as repair requires) tries to act as billing when an operator repairs one of
    its own entries. Returns (svc2 conninfo, svc2 role)."""
    svc2 = login_role("inbox_consumer")
    role = role_of(svc2)
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA app TO {0}").format(ident(role)))
    conn.execute("CREATE TABLE app.svc2_log (what text)")
    conn.execute(sql.SQL("GRANT INSERT ON app.svc2_log TO {0}").format(ident(role)))
    conn.execute("""
        CREATE FUNCTION app.svc2_handler(p jsonb, ctx inbox.message_context) RETURNS void
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = app, pg_temp AS $$
        DECLARE
            attack text;
        BEGIN
            IF p ? 'fail' THEN
                RAISE EXCEPTION 'svc2 cannot handle it yet';
            END IF;
            -- The 0.2.0 marker, forged; then every act the marker used to allow, each on its own.
            PERFORM set_config('inbox.operator_run', 'billing', true);
            PERFORM set_config('inbox.consumer', 'billing', true);
            FOREACH attack IN ARRAY ARRAY[
                $a$SELECT inbox.claim('billing', 'shop', 'order-next', '{"account": 1, "amount": 1}')$a$,
                $a$SELECT inbox.record_failure('billing', 'shop', 'order-next', '{}', 'X1',
                                               message_type => 'credit')$a$,
                $a$SELECT inbox.record_start('billing', 'shop', 'order-next')$a$,
                $a$SELECT inbox.enqueue_effect('steal', 'billing-hook', '{"transfer": 999999}',
                                               consumer => 'billing')$a$,
                $a$SELECT inbox.enqueue_effect('steal-2', 'billing-hook', '{"transfer": 999999}')$a$,
                $a$SELECT inbox.claim('replay:1', 'shop', 'op-1', '{}')$a$,
                $a$SELECT inbox.bind_consumer('billing', current_user::regrole, note => 'mine now')$a$]
            LOOP
                BEGIN
                    EXECUTE attack;
                    INSERT INTO app.svc2_log VALUES ('succeeded: ' || attack);
                EXCEPTION WHEN OTHERS THEN
                    INSERT INTO app.svc2_log VALUES ('refused ' || SQLSTATE);
                END;
            END LOOP;
            -- What it may do: act as itself.
            PERFORM inbox.enqueue_effect('svc2-own', 'svc2-hook', '{"ok": true}', consumer => 'svc2');
            INSERT INTO app.svc2_log VALUES ('enqueued as svc2');
        END $$""")
    conn.execute(
        sql.SQL("ALTER FUNCTION app.svc2_handler(jsonb, inbox.message_context) OWNER TO {0}").format(ident(role))
    )
    conn.execute("SELECT inbox.bind_consumer('svc2', %s::regrole, note => 'the second service')", (role,))
    conn.execute("SELECT inbox.register_handler('svc2', 'job', 'app.svc2_handler(jsonb, inbox.message_context)', 'v1')")
    conn.execute("SELECT inbox.configure_consumer('svc2', max_attempts => 1)")
    conn.execute("SELECT inbox.bind_destination('svc2-hook', 'svc2', 'svc2''s own')")
    conn.execute("SELECT inbox.bind_destination('billing-hook', 'billing', 'billing''s webhook')")
    return svc2, role


def test_a_hostile_handler_repaired_by_an_operator_acts_only_as_its_own_consumer(
    conn: Conn, login_role: Callable[..., str]
) -> None:
    billing, _, operator, _ = setup_billing(conn, login_role)
    svc2, _ = hostile_service(conn, login_role)
    with connect(svc2) as svc:
        assert (
            scalar(svc, "SELECT outcome FROM inbox.claim_and_apply('svc2', 'shop', 'job-1', 'job', '{\"fail\": true}')")
            == "quarantined"
        )
    entry = scalar(conn, "SELECT quarantine_id FROM inbox.quarantine WHERE consumer = 'svc2'")
    conn.execute("UPDATE inbox.quarantine SET payload = '{}' WHERE quarantine_id = %s", (entry,))  # the fixed input
    with connect(operator) as ops:
        assert scalar(ops, "SELECT outcome FROM inbox.repair(%s, 'routine repair')", (entry,)) == "applied"
    log = [r[0] for r in conn.execute("SELECT what FROM app.svc2_log").fetchall()]
    assert log == ["refused 42501"] * 7 + ["enqueued as svc2"], log
    # Nothing of billing's changed: no claim, no failure, no effect, no binding.
    assert scalar(conn, "SELECT count(*) FROM inbox.message WHERE consumer IN ('billing', 'replay:1')") == 0
    assert scalar(conn, "SELECT count(*) FROM inbox.attempt WHERE consumer = 'billing'") == 0
    assert conn.execute("SELECT effect_id, consumer FROM inbox.outbox").fetchall() == [("svc2-own", "svc2")]
    assert scalar(conn, "SELECT count(*) FROM inbox.consumer_binding WHERE consumer = 'billing'") == 1
    assert scalar(conn, "SELECT count(*) FROM inbox.operator_run") == 0
    # billing's next message is billing's to apply, once.
    with connect(billing) as svc:
        assert (
            scalar(
                svc,
                "SELECT outcome FROM inbox.claim_and_apply('billing', 'shop', 'order-next', 'credit',"
                ' \'{"account": 1, "amount": 1}\')',
            )
            == "applied"
        )
    assert scalar(conn, "SELECT count(*) FROM app.ledger WHERE message_id = 'order-next'") == 1


def test_an_operator_who_also_holds_the_consumer_role_cannot_act_as_an_unbound_consumer(
    conn: Conn, login_role: Callable[..., str]
) -> None:
    setup_billing(conn, login_role)
    both = login_role("inbox_operator", "inbox_consumer")
    with connect(both) as session:
        session.execute("SELECT set_config('inbox.operator_run', 'billing', false)")
        for attack in (
            "SELECT inbox.claim('billing', 'shop', 'x1', '{}')",
            "SELECT inbox.claim_and_apply('billing', 'shop', 'x1', 'credit', '{\"account\": 1}')",
            "SELECT inbox.record_failure('billing', 'shop', 'x1', '{}', 'X1')",
        ):
            with pytest.raises(errors.InsufficientPrivilege, match="may not act as consumer 'billing'"):
                session.execute(attack)
    assert scalar(conn, "SELECT count(*) FROM inbox.message WHERE consumer = 'billing'") == 0


def test_repair_is_refused_once_the_consumer_is_unbound_or_its_role_dropped(
    conn: Conn, login_role: Callable[..., str]
) -> None:
    """0.2.0 read "no binding left" as "only a superuser could have sent this" and ran the retired
    service's handler with the operator's rights. Now nobody's rights are left to run it with."""
    _, _, operator, _ = setup_billing(conn, login_role)
    svc2, svc2_role = hostile_service(conn, login_role)
    with connect(svc2) as svc:
        svc.execute("SELECT inbox.claim_and_apply('svc2', 'shop', 'job-1', 'job', '{\"fail\": true}')")
        svc.execute("SELECT inbox.claim_and_apply('svc2', 'shop', 'job-2', 'job', '{\"fail\": true}')")
    entries = [r[0] for r in conn.execute("SELECT quarantine_id FROM inbox.quarantine ORDER BY message_id").fetchall()]
    conn.execute("SELECT inbox.unbind_consumer('svc2', %s::regrole, 'retired')", (svc2_role,))
    with connect(operator) as ops:
        with pytest.raises(errors.InsufficientPrivilege, match="no live role is bound to consumer 'svc2'") as refused:
            ops.execute("SELECT inbox.repair(%s, 'leftover')", (entries[0],))
        assert "bind_consumer" in (refused.value.diag.message_hint or "")
    # Bound to a group role that is later dropped: the binding matches nobody.
    group = f"t_group_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {0} NOLOGIN; GRANT {0} TO {1}").format(ident(group), ident(svc2_role)))
    conn.execute("SELECT inbox.bind_consumer('svc2', %s::regrole, note => 'via a group')", (group,))
    with connect(operator) as ops:
        assert scalar(ops, "SELECT status FROM inbox.quarantine WHERE quarantine_id = %s", (entries[1],)) == "open"
    conn.execute(sql.SQL("DROP ROLE {0}").format(ident(group)))
    with connect(operator) as ops, pytest.raises(errors.InsufficientPrivilege, match="no live role is bound"):
        ops.execute("SELECT inbox.repair(%s, 'leftover')", (entries[1],))
    assert scalar(conn, "SELECT count(*) FROM app.svc2_log") == 0, "the retired handler ran"
    assert scalar(conn, "SELECT count(*) FROM inbox.quarantine WHERE status = 'open'") == 2


def test_a_pooled_login_is_held_to_the_role_it_set(conn: Conn, db_dsn: str) -> None:
    """PostgREST's model: an authenticator (LOGIN NOINHERIT) granted every tenant's role switches to
    one with SET LOCAL ROLE per request. Authorization follows the role it set, not its login."""
    names = {k: f"t_{k}_{uuid.uuid4().hex[:8]}" for k in ("auth", "acme", "globex")}
    try:
        for key in ("acme", "globex"):
            conn.execute(sql.SQL("CREATE ROLE {0} NOLOGIN IN ROLE inbox_consumer").format(ident(names[key])))
            conn.execute(
                "SELECT inbox.bind_consumer('shop-events', %s::regrole, ARRAY[%s], 'tenant role')", (names[key], key)
            )
        conn.execute(
            sql.SQL("CREATE ROLE {0} LOGIN NOINHERIT IN ROLE {1}, {2}").format(
                ident(names["auth"]), ident(names["acme"]), ident(names["globex"])
            )
        )
        params = {k: v for k, v in conninfo_to_dict(db_dsn).items() if v is not None}
        with psycopg.connect(make_conninfo("", **(params | {"user": names["auth"]}))) as auth:
            with auth.transaction():
                auth.execute(sql.SQL("SET LOCAL ROLE {0}").format(ident(names["acme"])))
                claim_a1 = "SELECT outcome FROM inbox.claim('shop-events', 'p', 'a1', '{}', tenant => 'acme')"
                assert scalar(auth, claim_a1) == "claimed"
                with pytest.raises(errors.InsufficientPrivilege, match="for tenant 'globex'"), auth.transaction():
                    auth.execute("SELECT inbox.claim('shop-events', 'p', 'g1', '{}', tenant => 'globex')")
            # Without a role the authenticator has no tenant's rights.
            with pytest.raises(errors.InsufficientPrivilege):
                auth.execute("SELECT inbox.claim('shop-events', 'p', 'n1', '{}', tenant => 'acme')")
            auth.rollback()
        assert conn.execute("SELECT tenant, message_id FROM inbox.message").fetchall() == [("acme", "a1")]
    finally:
        for name in names.values():
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {0}").format(ident(name)))


def test_a_tenant_scoped_role_cannot_preempt_another_tenants_effect(conn: Conn, login_role: Callable[..., str]) -> None:
    """The review's attack: a role bound to billing for tenant acme enqueued under globex's effect id
    (a public derivation) with its own payload; globex's real message then failed effect_id_conflict
    until quarantined, and acme's payload went out under globex's id."""
    acme = login_role("inbox_consumer")
    globex = login_role("inbox_consumer")
    for login, tenant in ((acme, "acme"), (globex, "globex")):
        conn.execute(
            "SELECT inbox.bind_consumer('billing', %s::regrole, ARRAY[%s], 'tenant service')", (role_of(login), tenant)
        )
    conn.execute("SELECT inbox.bind_destination('billing-hook', 'billing', 'the webhook')")
    stolen = scalar(conn, "SELECT inbox.effect_id('billing', 'shop', 'order-7', 'notify', 'globex')")
    with connect(acme) as evil:
        for forged in ("globex", None):
            with pytest.raises(errors.InsufficientPrivilege):
                evil.execute(
                    "SELECT inbox.enqueue_effect(%s, 'billing-hook', '{\"transfer\": 999999}',"
                    " consumer => 'billing', tenant => %s)",
                    (stolen, forged),
                )
        # Under its own tenant the id is its own: it cannot reach globex's effect.
        evil.execute(
            "SELECT inbox.enqueue_effect(%s, 'billing-hook', '{\"transfer\": 999999}', consumer => 'billing',"
            " tenant => 'acme')",
            (stolen,),
        )
    with connect(globex) as svc:
        assert (
            scalar(
                svc,
                "SELECT inbox.enqueue_effect(%s, 'billing-hook', '{\"notify\": \"order-7\"}',"
                " consumer => 'billing', tenant => 'globex')",
                (stolen,),
            )
            is True
        )
    keys = dict(
        conn.execute(
            "SELECT tenant, idempotency_key FROM inbox.claim_effects('d', 10, key_aware => true) WHERE effect_id = %s",
            (stolen,),
        ).fetchall()
    )
    assert set(keys) == {"acme", "globex"} and keys["acme"] != keys["globex"]
    assert keys["globex"] == scalar(conn, "SELECT inbox.idempotency_key('billing', 'globex', %s)", (stolen,))


def test_two_consumers_sharing_a_jetstream_destination_both_arrive(
    conn: Conn, db_dsn: str, login_role: Callable[..., str]
) -> None:
    """JetStream deduplicates on Nats-Msg-Id. 0.2.0 sent the bare effect id: one consumer enqueued
    another's future id first and the real message was dropped as a duplicate while the outbox
    recorded it delivered. Since 0.3.0 each consumer's effects go out under keys of their own."""
    import asyncio

    import nats
    from helpers_brokers import NATS_URL, channel, require

    from pginbox.brokers.jetstream import JetStreamTransport
    from pginbox.dispatcher import Dispatcher

    require("nats")
    for consumer in ("billing", "crm"):
        role = role_of(login_role("inbox_consumer"))
        conn.execute("SELECT inbox.bind_consumer(%s, %s::regrole, note => 'service')", (consumer, role))
        conn.execute("SELECT inbox.bind_destination('events', %s, 'shared')", (consumer,))
    future = scalar(conn, "SELECT inbox.effect_id('billing', 'shop', 'order-9', 'shipped')")
    conn.execute("SELECT inbox.enqueue_effect(%s, 'events', '{\"from\": \"crm\"}', consumer => 'crm')", (future,))
    conn.execute(
        "SELECT inbox.enqueue_effect(%s, 'events', '{\"from\": \"billing\"}', consumer => 'billing')", (future,)
    )
    with channel("nats") as ch:
        transport = JetStreamTransport(NATS_URL, subject=ch.subject, producer="shop", destination="events")
        try:
            with Dispatcher(db_dsn, "d1", {"events": transport}, batch_size=10) as dispatcher:
                dispatcher.run_once()
        finally:
            transport.close()

        async def bodies() -> list[Any]:
            nc = await nats.connect(NATS_URL)
            try:
                js = nc.jetstream()
                info = await js.stream_info(ch.stream)
                return [
                    json.loads((await js.get_msg(ch.stream, seq)).data or b"null")
                    for seq in range(1, info.state.messages + 1)
                ]
            finally:
                await nc.close()

        stored = asyncio.run(bodies())
    assert sorted(b["from"] for b in stored) == ["billing", "crm"], stored
    assert {r[0] for r in conn.execute("SELECT status::text FROM inbox.outbox").fetchall()} == {"delivered"}
    assert transport.duplicates == 0


def test_guessable_lock_keys_held_by_an_attacker_stall_nothing(conn: Conn, login_role: Callable[..., str]) -> None:
    """0.2.0 took advisory locks whose keys anyone could compute (hashtext of public names): a login
    holding them stalled every commit with that ordering key, and made the purge answer 'busy'."""
    billing, attacker, _, _ = setup_billing(conn, login_role)
    conn.execute("SELECT inbox.bind_destination('billing-hook', 'billing', 'the webhook')")
    conn.execute("""SELECT inbox.set_retention_policy('billing', '', broker_retention => '7 days',
        max_offset_rewind => '0',
        dead_letter_redrive_horizon => '0', producer_retry_horizon => '0', outage_allowance => '0',
        backup_restore_window => '0', planned_replay_horizon => '0', safety_margin => '1 hour', note => 'test')""")
    with connect(attacker) as evil:
        evil.execute("SELECT pg_advisory_lock(1886282358, hashtext('customer-42'))")  # 0.2.0's ordering key lock
        evil.execute("SELECT pg_advisory_lock(1886940770, hashtext('billing'))")  # 0.2.0's purge lock
        with connect(billing) as svc:
            svc.execute("SET lock_timeout = '3s'")
            with svc.transaction():
                svc.execute(
                    "SELECT inbox.enqueue_effect('e1', 'billing-hook', '{}', ordering_key => 'customer-42',"
                    " consumer => 'billing')"
                )
        assert scalar(conn, "SELECT order_seq IS NOT NULL FROM inbox.outbox WHERE effect_id = 'e1'") is True
        assert scalar(conn, "SELECT status FROM inbox.announce_purge('billing')") != "busy"


def test_an_anonymous_effect_holding_back_the_purge_is_named(conn: Conn) -> None:
    """After the upgrade any consumer member could enqueue an anonymous effect that held back every
    consumer's purge while the purge said 'done'. It still holds back (it may belong to anyone), and
    the purge now says which effect does."""
    conn.execute("SELECT inbox.configure_security(anonymous_enqueue => true, note => 'as an upgrade leaves it')")
    conn.execute("SELECT inbox.bind_destination('hook', '*', 'test')")
    conn.execute("""SELECT inbox.set_retention_policy('c', '', broker_retention => '1 day', max_offset_rewind => '0',
        dead_letter_redrive_horizon => '0', producer_retry_horizon => '0', outage_allowance => '0',
        backup_restore_window => '0', planned_replay_horizon => '0', safety_margin => '1 hour', note => 'test')""")
    conn.execute("SELECT inbox.claim('c', 'p', 'm1', '{}', produced_at => now())")
    conn.execute("SET inbox.consumer = ''")
    conn.execute("SELECT inbox.enqueue_effect('anon-1', 'hook', '{}')")
    conn.execute("UPDATE inbox.outbox SET created_at = now() - interval '5 days'")
    conn.execute(
        "UPDATE inbox.message SET processed_at = now() - interval '3 days', produced_at = now() - interval '3 days'"
    )
    conn.execute("UPDATE inbox.consumer_config SET last_active_at = now()")
    conn.execute("DELETE FROM inbox.activity_gap WHERE consumer = 'c'")
    conn.execute("INSERT INTO inbox.activity_gap VALUES ('c', '-infinity', now() - interval '30 days')")
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("CALL inbox.purge('c', wait_timeout => '20 seconds')")
    assert scalar(conn, "SELECT count(*) FROM inbox.message WHERE consumer = 'c'") == 1
    assert any("'anon-1'" in n and "anonymous" in n for n in notices), notices


# ---------------------------------------------------------------------------- randomized, two roles


OPERATIONS = ("claim", "claim_and_apply", "batch", "record_failure", "record_start", "enqueue", "redeliver")


def service_state(conn: Conn, consumer: str) -> list[Any]:
    """What a consumer's service can observe of its own outcomes."""
    return [
        conn.execute(
            "SELECT tenant, producer, message_id, encode(payload_sha256, 'hex'), status::text, handler_version"
            " FROM inbox.message WHERE consumer = %s ORDER BY 1, 2, 3",
            (consumer,),
        ).fetchall(),
        conn.execute(
            "SELECT tenant, producer, message_id, started, failed, reason_code FROM inbox.attempt"
            " WHERE consumer = %s ORDER BY 1, 2, 3",
            (consumer,),
        ).fetchall(),
        conn.execute(
            "SELECT tenant, producer, message_id, kind, status, deliveries, attempts FROM inbox.quarantine"
            " WHERE consumer = %s ORDER BY 1, 2, 3, 4",
            (consumer,),
        ).fetchall(),
        conn.execute(
            "SELECT effect_id, tenant, payload, ordering_key, order_seq IS NOT NULL FROM inbox.outbox"
            " WHERE consumer = %s ORDER BY 1, 2",
            (consumer,),
        ).fetchall(),
        conn.execute(
            "SELECT message_id, amount FROM app.ledger WHERE message_id LIKE %s ORDER BY 1, 2", (consumer + ":%",)
        ).fetchall(),
    ]


def random_call(rng: random.Random, consumer: str, tenant: str) -> tuple[str, tuple[Any, ...]]:
    message = f"{consumer}:m{rng.randrange(6)}"
    payload = json.dumps({"account": 1, "amount": rng.choice([1, 2])})
    op = rng.choice(OPERATIONS)
    if op == "claim":
        return ("SELECT inbox.claim(%s, 'shop', %s, %s::jsonb, tenant => %s)", (consumer, message, payload, tenant))
    if op in ("claim_and_apply", "redeliver"):
        return (
            "SELECT inbox.claim_and_apply(%s, 'shop', %s, 'credit', %s::jsonb, %s)",
            (consumer, message, payload, tenant),
        )
    if op == "batch":
        items = [
            {
                "producer": "shop",
                "message_id": f"{consumer}:m{rng.randrange(6)}",
                "message_type": "credit",
                "tenant": tenant,
                "payload": {"account": 1, "amount": 1},
            }
            for _ in range(3)
        ]
        return ("SELECT * FROM inbox.claim_and_apply_batch(%s, %s::jsonb)", (consumer, json.dumps(items)))
    if op == "record_failure":
        return (
            "SELECT inbox.record_failure(%s, 'shop', %s, %s::jsonb, 'X1', tenant => %s, message_type => 'credit')",
            (consumer, message, payload, tenant),
        )
    if op == "record_start":
        return ("SELECT inbox.record_start(%s, 'shop', %s, tenant => %s)", (consumer, message, tenant))
    effect = f"fx-{rng.randrange(4)}"
    return (
        "SELECT inbox.enqueue_effect(%s, 'hook', %s::jsonb, ordering_key => 'k', consumer => %s, tenant => %s)",
        (effect, json.dumps({"effect": effect}), consumer, tenant),
    )


@pytest.mark.slow
def test_randomized_two_roles_cannot_change_each_others_outcomes(pg_base: str, template_db: str) -> None:
    """Two services, A bound to consumer 'a' and B to consumer 'b' (each for tenant 't'), run the same
    random sequence of their own calls in two databases; in one of them A also makes random calls
    under B's consumer and tenant, forged settings included. B's observable state must be the same in
    both: nothing A does can change B's outcomes."""
    seed = random.randrange(1 << 30)
    rng_b = random.Random(seed)
    rng_a = random.Random(seed + 1)
    calls_b = [random_call(rng_b, "b", "t") for _ in range(120)]
    calls_a_own = [random_call(rng_a, "a", "t") for _ in range(60)]
    calls_a_attack = [random_call(rng_a, "b", rng_a.choice(["t", "", "u"])) for _ in range(60)]
    states = []
    for attacked in (False, True):
        name = f"t_rnd_{uuid.uuid4().hex}"
        create_database(pg_base, name, template=template_db)
        roles = {k: f"t_rnd_{k}_{uuid.uuid4().hex[:8]}" for k in ("a", "b")}
        try:
            dsn = dsn_for(pg_base, name)
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(DOMAIN_FOR_RANDOM)
                for key, role in roles.items():
                    admin.execute(sql.SQL("CREATE ROLE {0} LOGIN IN ROLE inbox_consumer").format(ident(role)))
                    admin.execute(
                        sql.SQL("GRANT USAGE ON SCHEMA app TO {0}; GRANT INSERT, SELECT ON app.ledger TO {0}").format(
                            ident(role)
                        )
                    )
                    admin.execute("SELECT inbox.bind_consumer(%s, %s::regrole, ARRAY['t'], 'random')", (key, role))
                    admin.execute(
                        "SELECT inbox.register_handler(%s, 'credit', 'app.credit(jsonb, inbox.message_context)', 'v1')",
                        (key,),
                    )
                    admin.execute("SELECT inbox.configure_consumer(%s, max_attempts => 3)", (key,))
                    admin.execute("SELECT inbox.bind_destination('hook', %s, 'random')", (key,))
            params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
            a_dsn = make_conninfo("", **(params | {"user": roles["a"]}))
            b_dsn = make_conninfo("", **(params | {"user": roles["b"]}))
            with psycopg.connect(a_dsn, autocommit=True) as a, psycopg.connect(b_dsn, autocommit=True) as b:
                attacks = iter(calls_a_attack)
                for i, (query, args) in enumerate(calls_b):
                    b.execute(query, args)
                    if i % 2 == 0:
                        a.execute(*calls_a_own[i // 2])
                    if attacked and i % 2 == 1:
                        query_a, args_a = next(attacks)
                        a.execute(
                            "SELECT set_config('inbox.consumer', 'b', false),"
                            " set_config('inbox.tenant', 't', false),"
                            " set_config('inbox.operator_run', 'b', false)"
                        )
                        with pytest.raises((errors.InsufficientPrivilege, errors.UndefinedObject)):
                            a.execute(query_a, args_a)
            with psycopg.connect(dsn, autocommit=True) as admin:
                states.append(service_state(admin, "b"))
        finally:
            drop_database(pg_base, name)
            with psycopg.connect(dsn_for(pg_base, "postgres"), autocommit=True) as admin:
                for role in roles.values():
                    admin.execute(sql.SQL("DROP ROLE IF EXISTS {0}").format(ident(role)))
    assert states[0] == states[1], f"seed {seed}: A changed B's outcomes"
    assert states[0][0], f"seed {seed}: B processed nothing"


DOMAIN_FOR_RANDOM = """
CREATE SCHEMA app;
CREATE TABLE app.ledger (message_id text NOT NULL, amount integer NOT NULL);
CREATE FUNCTION app.credit(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF (p ->> 'amount')::integer = 2 AND ctx.message_id LIKE '%m5' THEN
        RAISE EXCEPTION 'm5 with 2 fails' USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO app.ledger VALUES (ctx.consumer || ':' || split_part(ctx.message_id, ':', 2),
                                   (p ->> 'amount')::integer);
END $$;
"""
