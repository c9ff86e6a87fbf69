"""The outbox's trust boundaries, tried as an attacker would (issue 10, items 6, 7, 8 and the
bounded available_at): separate LOGIN roles granted only the group role under test, each in its
own real session; the superuser only sets up (bindings, handlers) and looks.

  (a) a consumer not bound to a destination cannot enqueue to it, and nothing of it is delivered;
  (b) a copy of another consumer's effect id enqueued first no longer fails the victim's handler,
      and is never delivered under the victim's consumer or to the victim's destination;
  (c) a second dispatcher login cannot complete, fail or extend another dispatcher's lease, with
      its own token +-1, the holder's token +-1, or the holder's real token;
  (d) an effect due in the year 9999 is refused;
  (e) every bad header is refused at enqueue with 22023, and nothing is written;
  (f) an upgrade from the release keeps the deployment's anonymous enqueues working, and binds
      what it found; a fresh deployment binds nothing.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import create_database, drop_database, dsn_for, sqitch_project
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb

from pginbox.dispatcher import CallableTransport, Dispatcher, Effect
from pginbox.schema import sqitch

Conn = psycopg.Connection[Any]


def as_role(dsn: str, role: str) -> str:
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["user"] = role
    return make_conninfo("", **params)


@dataclass(frozen=True)
class Login:
    name: str
    dsn: str

    def connect(self) -> Conn:
        return psycopg.connect(self.dsn, autocommit=True)


def drop_login(admin: Conn, name: str) -> None:
    admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
    admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))  # its grants in this database
    admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@pytest.fixture
def login(conn: Conn, db_dsn: str) -> Iterator[Callable[[str, str], Login]]:
    """login(label, group): a new LOGIN role (unique name) granted only `group`; dropped afterwards."""
    made: list[str] = []

    def make(label: str, group: str) -> Login:
        name = f"t_{label}_{uuid.uuid4().hex[:10]}"
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(sql.Identifier(name), sql.Identifier(group)))
        made.append(name)
        return Login(name, as_role(db_dsn, name))

    yield make
    for name in made:
        drop_login(conn, name)


@dataclass(frozen=True)
class Services:
    billing: Login
    mallory: Login
    dispatcher: Login


@pytest.fixture
def services(conn: Conn, login: Callable[[str, str], Login]) -> Services:
    """billing and mallory: two consumer services, each bound to its consumer name and its own
    destination (payments, mallory-hook); a dispatcher login."""
    made = Services(
        login("billing", "inbox_consumer"), login("mallory", "inbox_consumer"), login("dsp", "inbox_dispatcher")
    )
    for consumer, role, destination in (
        ("billing", made.billing.name, "payments"),
        ("mallory", made.mallory.name, "mallory-hook"),
    ):
        conn.execute("SELECT inbox.bind_consumer(%s, %s::regrole, note => 'test')", (consumer, role))
        conn.execute("SELECT inbox.bind_destination(%s, %s, 'test')", (destination, consumer))
    return made


def enqueue_as(
    c: Conn,
    consumer: str,
    effect_id: str,
    destination: str,
    payload: Any,
    headers: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """One transaction that enqueues as `consumer` the way a handler does: the claim paths set
    inbox.consumer (anyone can set it: it only names the consumer the session claims to act as)."""
    with c.transaction():
        c.execute("SELECT set_config('inbox.consumer', %s, true)", (consumer,))
        extra = "".join(f", {name} => %({name})s" for name in options)
        row = c.execute(
            f"SELECT inbox.enqueue_effect(%(id)s, %(dest)s, %(payload)s, %(headers)s{extra})",
            {
                "id": effect_id,
                "dest": destination,
                "payload": Jsonb(payload),
                "headers": Jsonb(headers or {}),
                **options,
            },
        ).fetchone()
    assert row is not None
    return row[0]


class Recorder:
    def __init__(self) -> None:
        self.effects: list[Effect] = []

    def __call__(self, effect: Effect) -> None:
        self.effects.append(effect)

    def seen(self) -> list[tuple[str, Any]]:
        return [(e.effect_id, e.payload) for e in self.effects]


def dispatch(login: Login, *destinations: str) -> dict[str, Recorder]:
    """A real dispatcher, logged in as `login`, drains the outbox into one recorder per destination."""
    recorders = {name: Recorder() for name in destinations}
    dispatcher = Dispatcher(login.dsn, "trust-test", {n: CallableTransport(r) for n, r in recorders.items()})
    try:
        dispatcher.run_once()
    finally:
        dispatcher.close()
    return recorders


# ---------------------------------------------------------------------------- (a) destinations


def test_a_consumer_not_bound_to_a_destination_cannot_enqueue_to_it(conn: Conn, services: Services) -> None:
    with services.mallory.connect() as mallory:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
            enqueue_as(
                mallory,
                "mallory",
                "forged-1",
                "payments",
                {"to": "mallory", "amount": 1_000_000},
                {"X-Reason": "refund"},
            )
        assert "consumer 'mallory' may not enqueue effects to destination 'payments'" in str(refused.value)
        assert "inbox.bind_destination('payments', 'mallory'" in (refused.value.diag.message_hint or "")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            enqueue_as(mallory, "mallory", "forged-2", "nobody-bound", {})
        assert enqueue_as(mallory, "mallory", "own-1", "mallory-hook", {"to": "mallory"}) is True
    with services.billing.connect() as billing:
        assert enqueue_as(billing, "billing", "pay-1", "payments", {"to": "shop", "amount": 10}) is True

    delivered = dispatch(services.dispatcher, "payments", "mallory-hook", "nobody-bound")
    assert delivered["payments"].seen() == [("pay-1", {"to": "shop", "amount": 10})]
    assert delivered["mallory-hook"].seen() == [("own-1", {"to": "mallory"})]
    assert delivered["nobody-bound"].seen() == []
    assert conn.execute("SELECT count(*) FROM inbox.outbox WHERE effect_id LIKE 'forged-%'").fetchone() == (0,)


def test_a_consumer_cannot_enqueue_as_another_consumer(conn: Conn, services: Services) -> None:
    with services.mallory.connect() as mallory, pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
        enqueue_as(mallory, "billing", "forged-3", "payments", {"to": "mallory", "amount": 1_000_000})
    assert f"role {services.mallory.name} may not act as consumer 'billing'" in str(refused.value)
    assert conn.execute("SELECT count(*) FROM inbox.outbox").fetchone() == (0,)


def test_an_enqueue_without_a_consumer_is_refused_on_a_new_deployment(conn: Conn, services: Services) -> None:
    conn.execute("SELECT inbox.bind_destination('public-hook', '*', 'test')")
    with services.mallory.connect() as mallory, pytest.raises(psycopg.errors.NullValueNotAllowed) as refused:
        mallory.execute("SELECT inbox.enqueue_effect('anon-1', 'public-hook', '{}')")
    assert "no consumer" in str(refused.value) and "claim" in (refused.value.diag.message_hint or "")


# ---------------------------------------------------------------------------- (b) effect ids per consumer

CHARGE_HANDLER = """
CREATE SCHEMA app;
CREATE TABLE app.charge (order_id text NOT NULL, amount integer NOT NULL);
CREATE FUNCTION app.charge(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO app.charge VALUES (ctx.message_id, (p ->> 'amount')::integer);
    -- What the claim paths do from 0.2.0 on (harmless when they already did).
    PERFORM set_config('inbox.consumer', ctx.consumer, true);
    PERFORM inbox.enqueue_effect(inbox.effect_id(ctx.consumer, ctx.producer, ctx.message_id, 'charge', ctx.tenant),
                                 'payments', p);
END
$$;
"""


def test_a_squatted_effect_id_neither_fails_the_victim_nor_is_delivered_as_its_effect(
    conn: Conn, services: Services
) -> None:
    conn.execute(CHARGE_HANDLER)
    conn.execute(
        sql.SQL("GRANT USAGE ON SCHEMA app TO {0}; GRANT INSERT ON app.charge TO {0}").format(
            sql.Identifier(services.billing.name)
        )
    )
    conn.execute("SELECT inbox.register_handler('billing', 'order', 'app.charge(jsonb, inbox.message_context)', 'v1')")
    victim_id = conn.execute("SELECT inbox.effect_id('billing', 'shop', 'order-A', 'charge')").fetchone()
    assert victim_id is not None

    # Mallory computes billing's next effect id and enqueues it first, in the only place it may.
    with services.mallory.connect() as mallory:
        assert enqueue_as(mallory, "mallory", victim_id[0], "mallory-hook", {"amount": 1_000_000, "to": "mallory"})

    with services.billing.connect() as billing:
        row = billing.execute(
            "SELECT outcome, reason_code FROM inbox.claim_and_apply('billing', 'shop', 'order-A', 'order', %s)",
            (Jsonb({"amount": 10}),),
        ).fetchone()
    assert row == ("applied", None), "the victim's handler failed on the squatted id"

    delivered = dispatch(services.dispatcher, "payments", "mallory-hook")
    assert delivered["payments"].seen() == [(victim_id[0], {"amount": 10})]
    assert delivered["mallory-hook"].seen() == [(victim_id[0], {"amount": 1_000_000, "to": "mallory"})]
    owners = conn.execute(
        "SELECT consumer, destination, payload ->> 'amount' FROM inbox.outbox WHERE effect_id = %s ORDER BY consumer",
        victim_id,
    ).fetchall()
    assert owners == [("billing", "payments", "10"), ("mallory", "mallory-hook", "1000000")]


# ---------------------------------------------------------------------------- (c) fencing


def test_another_dispatcher_cannot_report_on_a_lease_it_does_not_hold(
    conn: Conn, login: Callable[[str, str], Login]
) -> None:
    holder, intruder = login("dsp_a", "inbox_dispatcher"), login("dsp_b", "inbox_dispatcher")
    for effect_id in ("fx-held", "fx-own"):
        conn.execute("SELECT inbox.enqueue_effect(%s, 'sink', '{}')", (effect_id,))
    with holder.connect() as a, intruder.connect() as b:
        held = a.execute("SELECT effect_id, lease_token FROM inbox.claim_effects('a', 1, key_aware => true)").fetchone()
        own = b.execute("SELECT effect_id, lease_token FROM inbox.claim_effects('b', 1, key_aware => true)").fetchone()
        assert held is not None and own is not None
        effect_id, token = held
        mine = int(own[1])
        for guess in sorted({mine - 1, mine + 1, token - 1, token + 1, token}):
            assert b.execute("SELECT inbox.complete_effect(%s, %s, 200)", (effect_id, guess)).fetchone() == (False,)
            assert b.execute("SELECT inbox.fail_effect(%s, %s, 'x', false)", (effect_id, guess)).fetchone() == (
                "fenced",
            )
            assert b.execute("SELECT inbox.extend_lease(%s, %s, '1 hour')", (effect_id, guess)).fetchone() == (None,)
            assert b.execute(
                "SELECT result FROM inbox.complete_effects(%s, %s)", ([effect_id], [guess])
            ).fetchall() == [("fenced",)]
        reasons = b.execute(
            "SELECT fenced_reason FROM inbox.fail_effects(%s, %s, '{x}', '{f}')", ([effect_id], [token])
        ).fetchall()
        assert reasons == [("not_lease_holder",)]
        state = conn.execute(
            "SELECT status::text, lease_token, attempts, delivered_at FROM inbox.outbox WHERE effect_id = %s",
            (effect_id,),
        ).fetchone()
        assert state == ("leased", token, 1, None), "another dispatcher changed a lease it does not hold"
        assert a.execute("SELECT inbox.complete_effect(%s, %s, 200)", (effect_id, token)).fetchone() == (True,)
    refused_by = conn.execute(
        "SELECT DISTINCT reported_by FROM inbox.outbox_fenced_report WHERE effect_id = %s", (effect_id,)
    ).fetchall()
    assert refused_by == [(intruder.name,)]


def test_lease_tokens_are_not_a_sequence(conn: Conn) -> None:
    for i in range(20):
        conn.execute("SELECT inbox.enqueue_effect(%s, 'sink', '{}')", (f"t-{i}",))
    claim = "SELECT lease_token FROM inbox.claim_effects('d', 20, key_aware => true)"
    tokens = [int(r[0]) for r in conn.execute(claim).fetchall()]
    assert len(tokens) == 20 and len(set(tokens)) == 20
    gaps = sorted(abs(x - y) for x, y in zip(sorted(tokens), sorted(tokens)[1:], strict=False))
    assert gaps[0] > 1_000_000, f"neighbouring tokens: {sorted(tokens)}"


# ---------------------------------------------------------------------------- (d) available_at


def test_an_effect_due_in_the_year_9999_is_refused(conn: Conn, services: Services) -> None:
    with services.billing.connect() as billing:
        with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
            enqueue_as(billing, "billing", "far-1", "payments", {}, available_at="9999-01-01")
        assert "further ahead than max_effect_delay (30 days)" in str(refused.value)
        assert "configure_security(max_effect_delay" in (refused.value.diag.message_hint or "")
        assert enqueue_as(billing, "billing", "soon-1", "payments", {}, available_at="2000-01-01") is True
    assert conn.execute("SELECT effect_id FROM inbox.outbox").fetchall() == [("soon-1",)]


# ---------------------------------------------------------------------------- (e) headers

BAD_HEADERS: list[tuple[str, Any]] = [
    ("Host", {"Host": "evil.example"}),
    ("Authorization", {"Authorization": "Bearer stolen"}),
    ("authorization in lower case", {"authorization": "Bearer stolen"}),
    ("Proxy-Authorization", {"Proxy-Authorization": "Basic eA=="}),
    ("Cookie", {"Cookie": "session=1"}),
    ("Content-Length", {"Content-Length": "0"}),
    ("Transfer-Encoding", {"Transfer-Encoding": "chunked"}),
    ("Connection", {"Connection": "close"}),
    ("Keep-Alive", {"Keep-Alive": "timeout=5"}),
    ("TE", {"TE": "trailers"}),
    ("Trailer", {"Trailer": "X-A"}),
    ("Upgrade", {"Upgrade": "h2c"}),
    ("Idempotency-Key", {"IDEMPOTENCY-KEY": "another-key"}),
    ("a name with a space and colon", {"Bad Name:": "x"}),
    ("an empty name", {"": "x"}),
    ("CR LF in a value", {"X-Note": "a\r\nX-Injected: 1"}),
    ("LF in a value", {"X-Note": "a\nb"}),
    ("CR in a value", {"X-Note": "a\rb"}),
    ("another control character in a value", {"X-Note": "a\x1bb"}),
    ("a number value", {"X-Note": 1}),
    ("not an object", ["X-Note", "x"]),
]


@pytest.mark.parametrize("headers", [h for _, h in BAD_HEADERS], ids=[name for name, _ in BAD_HEADERS])
def test_a_bad_header_is_refused_at_enqueue_and_nothing_is_written(
    conn: Conn, services: Services, headers: Any
) -> None:
    with services.billing.connect() as billing, billing.transaction(force_rollback=True):
        billing.execute("SELECT set_config('inbox.consumer', 'billing', true)")
        with pytest.raises(psycopg.errors.InvalidParameterValue), billing.transaction():
            billing.execute("SELECT inbox.enqueue_effect('h-1', 'payments', '{}', %s)", (Jsonb(headers),))
        # A write, even one rolled back with its savepoint, would have given the transaction an id.
        assert billing.execute("SELECT pg_current_xact_id_if_assigned()").fetchone() == (None,)
    assert conn.execute("SELECT count(*) FROM inbox.outbox").fetchone() == (0,)


def test_a_nul_in_a_header_cannot_reach_enqueue(services: Services) -> None:
    with services.billing.connect() as billing, pytest.raises(psycopg.errors.UntranslatableCharacter):
        enqueue_as(billing, "billing", "h-nul", "payments", {}, {"X-Note": "a\x00b"})


# ---------------------------------------------------------------------------- (f) upgrade


@pytest.fixture
def empty_db(pg_base: str) -> Iterator[str]:
    name = f"t_trust_{uuid.uuid4().hex[:12]}"
    create_database(pg_base, name)
    try:
        yield dsn_for(pg_base, name)
    finally:
        drop_database(pg_base, name)


@pytest.mark.slow
def test_an_upgrade_keeps_anonymous_enqueue_working(empty_db: str) -> None:
    # 0.1.0 is the release before the outbox's trust boundaries (change outbox_scope_tables, 0.2.0).
    sqitch.deploy(empty_db, to_change="@v0.1.0", project=sqitch_project())
    service = f"t_svc_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(empty_db, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE inbox_consumer").format(sql.Identifier(service)))
        try:
            with psycopg.connect(as_role(empty_db, service), autocommit=True) as svc:
                svc.execute("SELECT inbox.enqueue_effect('before', 'notifications', '{}')")
            admin.execute("SELECT inbox.configure_destination('webhooks', 3)")

            sqitch.deploy(empty_db, project=sqitch_project())

            settings = admin.execute("SELECT anonymous_enqueue FROM inbox.security_settings").fetchone()
            assert settings == (True,)
            assert admin.execute(
                "SELECT destination, consumer FROM inbox.destination_binding ORDER BY 1"
            ).fetchall() == [("notifications", "*"), ("webhooks", "*")]
            audit = admin.execute(
                "SELECT action, destination FROM inbox.binding_change"
                " WHERE action IN ('bind_destination', 'configure_security') ORDER BY 1, 2"
            )
            assert audit.fetchall() == [
                ("bind_destination", "notifications"),
                ("bind_destination", "webhooks"),
                ("configure_security", None),
            ]
            with psycopg.connect(as_role(empty_db, service), autocommit=True) as svc:
                assert svc.execute("SELECT inbox.enqueue_effect('after', 'notifications', '{}')").fetchone() == (True,)
                assert svc.execute("SELECT inbox.enqueue_effect('after-2', 'webhooks', '{}')").fetchone() == (True,)
                with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
                    svc.execute("SELECT inbox.enqueue_effect('new', 'brand-new', '{}')")
                assert "inbox.bind_destination('brand-new', '*'" in (refused.value.diag.message_hint or "")
            assert admin.execute("SELECT effect_id, consumer FROM inbox.outbox ORDER BY 1").fetchall() == [
                ("after", ""),
                ("after-2", ""),
                ("before", ""),
            ]
        finally:
            drop_login(admin, service)


def test_a_fresh_deployment_binds_nothing_and_refuses_anonymous_enqueue(conn: Conn) -> None:
    assert conn.execute("SELECT anonymous_enqueue, max_effect_delay FROM inbox.security_settings").fetchone() == (
        False,
        datetime.timedelta(days=30),
    )
    assert conn.execute("SELECT count(*) FROM inbox.destination_binding").fetchone() == (0,)


def test_payload_size_is_the_length_of_its_text(conn: Conn) -> None:
    """pg_column_size is the compressed size: 8 MB of one repeated character passed a 1 MiB limit."""
    conn.execute("CREATE TABLE big AS SELECT jsonb_build_object('k', repeat('x', 2097152)) AS body")
    assert conn.execute("SELECT pg_column_size(body) < 1048576 FROM big").fetchone() == (True,)
    with pytest.raises(psycopg.errors.ProgramLimitExceeded, match=r"payload is 20971\d\d bytes"):
        conn.execute("SELECT inbox.enqueue_effect('big', 'd', body) FROM big")
    assert conn.execute("SELECT count(*) FROM inbox.outbox").fetchone() == (0,)
