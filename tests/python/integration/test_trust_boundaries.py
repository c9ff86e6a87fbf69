"""Trust no caller (issue 10, docs/security.md): each test is an attack, made the way an attacker
would make it — separate LOGIN roles granted only the documented group role under test, real
sessions — and asserts that it fails before anything is written, and that the invariant holds (at
most one committed domain transition per consumer and producer intent).

The domain: consumer 'billing' credits accounts (app.ledger, no unique key: a second application
would show) and is bound to the LOGIN role of the billing service. The attacker is a second
service holding only inbox_consumer. Outbox attacks are in test_outbox_trust.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql

Conn = psycopg.Connection[Any]
CONSUMER = "billing"

DOMAIN = """
CREATE SCHEMA app;
CREATE TABLE app.ledger (message_id text NOT NULL, account integer NOT NULL, amount numeric NOT NULL,
                         applied_by text NOT NULL DEFAULT current_user);
CREATE TABLE app.balance (account integer PRIMARY KEY, amount numeric NOT NULL DEFAULT 0);
CREATE TABLE app.handler_runs (run_by text NOT NULL, message_id text);
INSERT INTO app.balance (account) SELECT g FROM generate_series(1, 9) g;
CREATE FUNCTION app.credit(p jsonb, ctx inbox.message_context) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO app.handler_runs VALUES (current_user, ctx.message_id);
    INSERT INTO app.ledger (message_id, account, amount)
    VALUES (ctx.message_id, (p ->> 'account')::integer, (p ->> 'amount')::numeric);
    UPDATE app.balance SET amount = amount + (p ->> 'amount')::numeric WHERE account = (p ->> 'account')::integer;
END
$$;
"""


def role_of(conninfo: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(conninfo)["user"])


def connect(dsn: str) -> Conn:
    return psycopg.connect(dsn, autocommit=True)


def scalar(conn: Conn, query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def setup_billing(conn: Conn, login_role: Callable[..., str]) -> tuple[str, str, str, str]:
    """(billing service, attacker, operator, reader) conninfos; billing bound to its service."""
    billing = login_role("inbox_consumer")
    attacker = login_role("inbox_consumer")
    operator = login_role("inbox_operator")
    reader = login_role("inbox_reader")
    billing_role = role_of(billing)
    conn.execute(DOMAIN)
    conn.execute(
        sql.SQL(
            "GRANT USAGE ON SCHEMA app TO {0}; GRANT INSERT, SELECT, UPDATE ON ALL TABLES IN SCHEMA app TO {0}"
        ).format(sql.Identifier(billing_role))
    )
    # Operators name the handler (they see its schema only); repair and replay call it through
    # inbox_runner, and it runs with the consumer's rights.
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA app TO {}, inbox_runner").format(sql.Identifier(role_of(operator))))
    conn.execute("SELECT inbox.register_handler('billing', 'credit', 'app.credit(jsonb, inbox.message_context)', 'v1')")
    conn.execute("SELECT inbox.bind_consumer('billing', %s::regrole, note => 'the billing service')", (billing_role,))
    return billing, attacker, operator, reader


def counts(conn: Conn) -> tuple[int, int, int, int]:
    return (
        scalar(conn, "SELECT count(*) FROM inbox.message WHERE consumer = 'billing'"),
        scalar(conn, "SELECT count(*) FROM inbox.attempt WHERE consumer = 'billing'"),
        scalar(conn, "SELECT count(*) FROM inbox.quarantine WHERE consumer = 'billing'"),
        scalar(conn, "SELECT count(*) FROM app.handler_runs"),
    )


APPLY = "SELECT outcome FROM inbox.claim_and_apply('billing', 'shop', %s, 'credit', %s, '', %s::timestamptz)"


def apply(dsn_or_conn: Conn, message_id: str, payload: dict[str, Any], produced_at: Any = None) -> str:
    return str(scalar(dsn_or_conn, APPLY, (message_id, json.dumps(payload), produced_at)))


# ---------------------------------------------------------------------------- 3. impersonation


def test_another_consumer_role_cannot_act_as_billing(conn: Conn, login_role: Callable[..., str]) -> None:
    billing, attacker, _, _ = setup_billing(conn, login_role)
    before = counts(conn)
    with connect(attacker) as evil:
        attacks = [
            "SELECT inbox.claim('billing', 'shop', 'order-A', '{}')",
            "SELECT inbox.claim_bytea('billing', 'shop', 'order-A', '\\x00')",
            "SELECT inbox.claim_and_apply('billing', 'shop', 'order-A', 'credit', '{\"account\": 1, \"amount\": 5}')",
            'SELECT * FROM inbox.claim_and_apply_batch(\'billing\', \'[{"producer": "shop",'
            ' "message_id": "order-A", "message_type": "credit", "payload": {}}]\')',
            "SELECT inbox.record_failure('billing', 'shop', 'order-A', '{}', 'X1')",
            "SELECT inbox.record_start('billing', 'shop', 'order-A')",
        ]
        for attack in attacks * 5:
            with pytest.raises(errors.InsufficientPrivilege, match="may not act as consumer 'billing'"):
                evil.execute(attack)
    assert counts(conn) == before, "an attack wrote something"
    # billing's real delivery is applied, once.
    with connect(billing) as svc:
        assert apply(svc, "order-A", {"account": 1, "amount": 5}) == "applied"
        assert apply(svc, "order-A", {"account": 1, "amount": 5}) == "duplicate"
    assert scalar(conn, "SELECT count(*) FROM app.ledger WHERE message_id = 'order-A'") == 1


def test_tenant_bindings_and_unknown_consumers(conn: Conn, login_role: Callable[..., str]) -> None:
    billing, _, _, _ = setup_billing(conn, login_role)
    role = role_of(billing)
    conn.execute("SELECT inbox.bind_consumer('billing', %s::regrole, ARRAY['acme'], 'acme only')", (role,))
    with connect(billing) as svc:
        claim_acme = "SELECT outcome FROM inbox.claim('billing', 'shop', 'm1', '{}', tenant => 'acme')"
        assert scalar(svc, claim_acme) == "claimed"
        with pytest.raises(errors.InsufficientPrivilege, match="for tenant 'globex'"):
            svc.execute("SELECT inbox.claim('billing', 'shop', 'm1', '{}', tenant => 'globex')")
        # A typo starts no fresh identity space: the consumer nobody is bound to is refused.
        with pytest.raises(errors.UndefinedObject, match="consumer 'biling' is not known"):
            svc.execute("SELECT inbox.claim('biling', 'shop', 'm1', '{}')")
        # Versioned names are covered by the base binding.
        versioned = scalar(svc, "SELECT inbox.versioned_consumer('billing', 'v2')")
        assert (
            scalar(svc, "SELECT outcome FROM inbox.claim(%s, 'shop', 'm1', '{}', tenant => 'acme')", (versioned,))
            == "claimed"
        )
    # Superusers pass an unbound consumer, unless strict_consumers is on.
    assert scalar(conn, "SELECT outcome FROM inbox.claim('scratch', 'p', 'm', '{}')") == "claimed"
    conn.execute("SELECT inbox.configure_security(strict_consumers => true, note => 'test')")
    with pytest.raises(errors.UndefinedObject):
        conn.execute("SELECT inbox.claim('scratch2', 'p', 'm', '{}')")
    assert scalar(conn, "SELECT count(*) FROM inbox.binding_change WHERE action = 'configure_security'") == 1


def test_a_binding_to_a_dropped_role_matches_nobody(conn: Conn) -> None:
    """A binding names a role by OID. Once that role is dropped the binding matches nobody, not
    even a superuser under strict_consumers (0.3.0: which holds superusers to the roles they are
    granted; the grant goes with the role)."""
    ghost = f"ghost_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(ghost)))
    conn.execute(sql.SQL("GRANT {} TO CURRENT_USER").format(sql.Identifier(ghost)))
    conn.execute("SELECT inbox.bind_consumer('haunted', %s::regrole, note => 'test')", (ghost,))
    conn.execute("SELECT inbox.configure_security(strict_consumers => true, note => 'test')")
    assert scalar(conn, "SELECT outcome FROM inbox.claim('haunted', 'p', 'm1', '{}')") == "claimed"
    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(ghost)))
    with pytest.raises(errors.InsufficientPrivilege, match="may not act as consumer 'haunted'"):
        conn.execute("SELECT inbox.claim('haunted', 'p', 'm2', '{}')")
    assert scalar(conn, "SELECT count(*) FROM inbox.message WHERE consumer = 'haunted'") == 1


# ---------------------------------------------------------------------------- 4. confused deputy


def test_repair_never_runs_with_more_rights_than_the_consumer(conn: Conn, login_role: Callable[..., str]) -> None:
    billing, attacker, operator, _ = setup_billing(conn, login_role)
    billing_role = role_of(billing)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 1)")
    # The attacker cannot plant a failure with a payload of its own choosing.
    with connect(attacker) as evil, pytest.raises(errors.InsufficientPrivilege):
        evil.execute(
            "SELECT inbox.record_failure('billing', 'shop', 'order-X',"
            " '{\"account\": 8, \"amount\": 1000000}', 'X1', message_type => 'credit')"
        )
    # billing's own failure is quarantined; the handler is SECURITY INVOKER, so repair would run it
    # with the operator's rights: refused.
    with connect(billing) as svc:
        assert (
            scalar(
                svc,
                "SELECT outcome FROM inbox.record_failure('billing', 'shop', 'order-B',"
                " '{\"account\": 2, \"amount\": 7}', 'X1', message_type => 'credit')",
            )
            == "quarantined"
        )
    entry = scalar(conn, "SELECT quarantine_id FROM inbox.quarantine WHERE message_id = 'order-B'")
    assert scalar(conn, "SELECT recorded_by FROM inbox.quarantine WHERE quarantine_id = %s", (entry,)) == billing_role
    with connect(operator) as ops:
        with pytest.raises(errors.InsufficientPrivilege, match="would run with more rights than consumer"):
            ops.execute("SELECT inbox.repair(%s, 'fixed')", (entry,))
        assert scalar(conn, "SELECT count(*) FROM app.handler_runs") == 0
        # Owned by billing's role as SECURITY DEFINER, it runs with billing's rights, whoever repairs.
        conn.execute(
            sql.SQL(
                "ALTER FUNCTION app.credit(jsonb, inbox.message_context) SECURITY DEFINER"
                " SET search_path = app, pg_temp; ALTER FUNCTION app.credit(jsonb, inbox.message_context)"
                " OWNER TO {}"
            ).format(sql.Identifier(billing_role))
        )
        repaired = ops.execute("SELECT outcome, error_message FROM inbox.repair(%s, 'fixed')", (entry,)).fetchone()
        assert repaired == ("applied", None)
    assert conn.execute("SELECT run_by, message_id FROM app.handler_runs").fetchall() == [(billing_role, "order-B")]


def test_a_handler_rewritten_by_its_owner_cannot_escape_to_the_operators_rights(
    conn: Conn, login_role: Callable[..., str]
) -> None:
    billing, _, operator, _ = setup_billing(conn, login_role)
    billing_role = role_of(billing)
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 1)")
    conn.execute("CREATE TABLE app.stolen (payload jsonb)")
    conn.execute(sql.SQL("GRANT INSERT ON app.stolen TO {}").format(sql.Identifier(billing_role)))
    # The service owns its handler and rewrites it to switch back to the session's role and copy
    # every stored quarantine payload (which only operators may read).
    conn.execute("""
        CREATE OR REPLACE FUNCTION app.credit(p jsonb, ctx inbox.message_context) RETURNS void
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = app, pg_temp AS $$
        BEGIN
            PERFORM set_config('role', 'none', true);
            INSERT INTO app.stolen SELECT q.payload FROM inbox.quarantine q;
        END $$""")
    conn.execute(
        sql.SQL("ALTER FUNCTION app.credit(jsonb, inbox.message_context) OWNER TO {}").format(
            sql.Identifier(billing_role)
        )
    )
    with connect(billing) as svc:
        svc.execute(
            "SELECT inbox.record_failure('billing', 'shop', 'order-C', '{\"account\": 3, \"amount\": 1}', 'X1',"
            " message_type => 'credit')"
        )
    entry = scalar(conn, "SELECT quarantine_id FROM inbox.quarantine WHERE message_id = 'order-C'")
    with connect(operator) as ops:
        result = ops.execute("SELECT outcome, error_message FROM inbox.repair(%s, 'try')", (entry,)).fetchone()
    assert result is not None and result[0] == "failed"
    assert "security-definer" in result[1]
    assert scalar(conn, "SELECT count(*) FROM app.stolen") == 0


# ---------------------------------------------------------------------------- 5. replay: reserved


def test_replay_consumer_names_are_reserved(conn: Conn, login_role: Callable[..., str]) -> None:
    billing, _, _, _ = setup_billing(conn, login_role)
    with connect(billing) as svc:
        for statement in (
            "SELECT inbox.claim('replay:1', 'shop', 'op-1', '{}')",
            "SELECT inbox.record_start('replay:1', 'shop', 'op-1')",
        ):
            with pytest.raises(errors.InsufficientPrivilege, match="belong to replay plans"):
                svc.execute(statement)
    # Not even a superuser, and nobody can bind such a name.
    with pytest.raises(errors.InsufficientPrivilege):
        conn.execute("SELECT inbox.claim('replay:1', 'shop', 'op-1', '{}')")
    with pytest.raises(errors.InsufficientPrivilege):
        conn.execute("SELECT inbox.bind_consumer('replay:1', 'inbox_consumer')")
    assert scalar(conn, "SELECT count(*) FROM inbox.message WHERE consumer LIKE 'replay:%'") == 0


# ---------------------------------------------------------------------------- 1, 2. retention vs clocks


RETENTION = """SELECT inbox.set_retention_policy('billing', '', broker_retention => '7 days', max_offset_rewind => '0',
    dead_letter_redrive_horizon => '0', producer_retry_horizon => '0', outage_allowance => '0',
    backup_restore_window => '0', planned_replay_horizon => '0', safety_margin => %s::interval, note => 'test')"""


def age_everything(conn: Conn, days: int) -> None:
    """Every billing row was processed `days` ago (its produced_at moves with it) by a consumer
    active all along, so the purge may forget it."""
    conn.execute(
        "UPDATE inbox.message SET processed_at = processed_at - make_interval(days => %s),"
        " produced_at = produced_at - make_interval(days => %s) WHERE consumer = 'billing'",
        (days, days),
    )
    conn.execute("DELETE FROM inbox.activity_gap WHERE consumer = 'billing'")
    conn.execute("INSERT INTO inbox.activity_gap VALUES ('billing', '-infinity', now() - interval '90 days')")


def purge(conn: Conn) -> None:
    conn.execute("CALL inbox.purge('billing', wait_timeout => '20 seconds')")


def test_a_producer_clock_ahead_of_the_database_is_refused(conn: Conn, login_role: Callable[..., str]) -> None:
    billing, _, _, _ = setup_billing(conn, login_role)
    conn.execute(RETENTION, ("1 hour",))
    with connect(billing) as svc:
        for ahead in ("'infinity'", "'9999-01-01'", "now() + interval '1 day'", "now() + interval '61 minutes'"):
            with pytest.raises(errors.DatetimeFieldOverflow, match="ahead of the database clock"):
                svc.execute(
                    "SELECT inbox.claim_and_apply('billing', 'shop', 'future-1', 'credit',"
                    f" '{{\"account\": 1, \"amount\": 1}}', '', {ahead})"
                )
            with pytest.raises(errors.DatetimeFieldOverflow):
                svc.execute(f"SELECT inbox.claim('billing', 'shop', 'future-1', '{{}}', produced_at => {ahead})")
        assert scalar(conn, "SELECT count(*) FROM inbox.message WHERE message_id = 'future-1'") == 0
        # Within the safety margin: accepted, and after the purge its redelivery is expired, not new.
        produced = scalar(conn, "SELECT now() + interval '50 minutes'")
        assert apply(svc, "near-1", {"account": 1, "amount": 1}, produced) == "applied"
    age_everything(conn, 30)
    purge(conn)
    assert scalar(conn, "SELECT count(*) FROM inbox.message WHERE message_id = 'near-1'") == 0, "not purged"
    # The redelivery carries the produced_at of the first delivery, 30 (simulated) days ago.
    produced_again = scalar(conn, "SELECT %s::timestamptz - interval '30 days'", (produced,))
    with connect(billing) as svc:
        assert apply(svc, "near-1", {"account": 1, "amount": 1}, produced_again) == "expired"
        # A later delivery with any produced_at is held by the open expired entry.
        assert apply(svc, "near-1", {"account": 1, "amount": 1}, None) == "expired"
    assert scalar(conn, "SELECT count(*) FROM app.ledger WHERE message_id = 'near-1'") == 1


def test_the_watermark_never_moves_back(conn: Conn, login_role: Callable[..., str]) -> None:
    billing, _, _, _ = setup_billing(conn, login_role)
    conn.execute(RETENTION, ("1 hour",))
    with connect(billing) as svc:
        # Clock skew inside the old margin: produced 40 minutes after it was processed.
        produced = scalar(conn, "SELECT now() + interval '40 minutes'")
        assert apply(svc, "skewed", {"account": 1, "amount": 1}, produced) == "applied"
    age_everything(conn, 30)
    purge(conn)
    first = scalar(conn, "SELECT watermark FROM inbox.purge_state WHERE consumer = 'billing'")
    # A longer horizon with a smaller margin would have moved the watermark back by seconds.
    conn.execute(RETENTION.replace("'7 days'", "'8 days'"), ("1 second",))
    conn.execute("UPDATE inbox.purge_state SET announced_before = announced_before - interval '2 days'")
    purge(conn)
    second = scalar(conn, "SELECT watermark FROM inbox.purge_state WHERE consumer = 'billing'")
    assert second >= first
    with connect(billing) as svc:
        assert (
            apply(
                svc,
                "skewed",
                {"account": 1, "amount": 1},
                scalar(conn, "SELECT %s::timestamptz - interval '30 days'", (produced,)),
            )
            == "expired"
        )
    assert scalar(conn, "SELECT count(*) FROM app.ledger WHERE message_id = 'skewed'") == 1


# ---------------------------------------------------------------------------- 9. readers


def test_readers_see_reason_codes_not_payload_traces(conn: Conn, login_role: Callable[..., str]) -> None:
    billing, _, _, reader = setup_billing(conn, login_role)
    conn.execute("""CREATE OR REPLACE FUNCTION app.credit(p jsonb, ctx inbox.message_context) RETURNS void
                    LANGUAGE plpgsql AS $$ BEGIN PERFORM (p ->> 'note')::numeric; END $$""")
    with connect(billing) as svc:
        assert apply(svc, "pii-1", {"note": "SSN 078-05-1120", "account": 1, "amount": 5}) == "failed"
    with connect(reader) as read:
        assert scalar(read, "SELECT reason_code FROM inbox.attempt WHERE message_id = 'pii-1'") == "22P02"
        for column, table in (
            ("error_message", "attempt"),
            ("payload_sha256", "attempt"),
            ("payload_sha256", "message"),
            ("error_message", "quarantine"),
            ("payload_sha256", "quarantine"),
        ):
            with pytest.raises(errors.InsufficientPrivilege):
                read.execute(sql.SQL("SELECT {} FROM inbox.{}").format(sql.Identifier(column), sql.Identifier(table)))
        with pytest.raises(errors.InsufficientPrivilege):
            read.execute("SELECT inbox.payload_hash('{\"amount\": 5}')")
        assert scalar(read, "SELECT count(*) FROM inbox.attempt WHERE reason_code = '22P02'") == 1
    # Operators (here the superuser) still see the error text.
    assert "078-05-1120" in scalar(conn, "SELECT error_message FROM inbox.attempt WHERE message_id = 'pii-1'")


# ---------------------------------------------------------------------------- 10. smaller holes


def test_a_shadowing_operator_cannot_turn_a_duplicate_into_an_application(
    conn: Conn, login_role: Callable[..., str]
) -> None:
    billing, _, _, _ = setup_billing(conn, login_role)
    role = role_of(billing)
    conn.execute(sql.SQL("CREATE SCHEMA evil AUTHORIZATION {}").format(sql.Identifier(role)))
    with connect(billing) as svc:
        svc.execute("""CREATE FUNCTION evil.ne(a text, b text) RETURNS boolean LANGUAGE sql AS 'SELECT false';
                       CREATE OPERATOR evil.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.ne);
                       CREATE FUNCTION evil.eq(a text, b text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
                       CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.eq)""")
        svc.execute("SET search_path = evil, pg_catalog, public")
        assert apply(svc, "dup-1", {"account": 4, "amount": 3}) == "applied"
        assert apply(svc, "dup-1", {"account": 4, "amount": 3}) == "duplicate"
    assert scalar(conn, "SELECT count(*) FROM app.ledger WHERE message_id = 'dup-1'") == 1


def test_a_compressed_payload_is_held_to_its_real_size(conn: Conn, login_role: Callable[..., str]) -> None:
    billing, _, _, _ = setup_billing(conn, login_role)
    role = role_of(billing)
    conn.execute("CREATE TABLE app.big (body jsonb)")
    conn.execute("INSERT INTO app.big SELECT jsonb_build_object('blob', repeat('a', 8 * 1024 * 1024))")
    conn.execute(sql.SQL("GRANT SELECT ON app.big TO {}").format(sql.Identifier(role)))
    assert scalar(conn, "SELECT pg_column_size(body) < 1048576 FROM app.big"), "the body is not stored compressed"
    with connect(billing) as svc:
        for statement in (
            "SELECT inbox.claim('billing', 'shop', 'big-1', (SELECT body FROM app.big))",
            "SELECT inbox.claim_and_apply('billing', 'shop', 'big-1', 'credit', (SELECT body FROM app.big))",
            "SELECT inbox.record_failure('billing', 'shop', 'big-1', (SELECT body FROM app.big), 'X1')",
        ):
            with pytest.raises(errors.ProgramLimitExceeded):
                svc.execute(statement)
    assert counts(conn)[:3] == (0, 0, 0)


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT inbox.claim(' ', 'shop', 'm', '{}')",
        "SELECT inbox.claim('billing', 'shop', E'\\t\\n', '{}')",
        "SELECT inbox.claim('billing', '  ', 'm', '{}')",
        "SELECT inbox.claim('billing', 'shop', 'm', '{}', handler_version => '   ')",
        "SELECT inbox.claim('billing', 'shop', 'm', '{}', tenant => '  ')",
        "SELECT inbox.claim_and_apply('billing', 'shop', 'm', ' ', '{}')",
        "SELECT inbox.record_failure('billing', 'shop', 'm', '{}', 'boom', message_type => ' ')",
        "SELECT inbox.record_start('billing', 'shop', 'm', message_type => E'\\t')",
    ],
)
def test_whitespace_only_names_are_refused(conn: Conn, login_role: Callable[..., str], statement: str) -> None:
    billing, _, _, _ = setup_billing(conn, login_role)
    with connect(billing) as svc, pytest.raises(errors.InvalidParameterValue, match="whitespace"):
        svc.execute(statement)
    assert counts(conn)[0] == 0


def test_an_empty_batch_answers_an_unbound_role_like_any_call(conn: Conn, login_role: Callable[..., str]) -> None:
    """An empty batch writes nothing, but must not tell an unbound role "0 rows, all fine": it gets
    the same 42501 / 42704 as a batch with messages, naming the batch function."""
    _, attacker, _, _ = setup_billing(conn, login_role)
    with connect(attacker) as svc:
        with pytest.raises(errors.InsufficientPrivilege, match=r"inbox\.claim_and_apply_batch: role"):
            svc.execute("SELECT * FROM inbox.claim_and_apply_batch('billing', '[]')")
        with pytest.raises(errors.UndefinedObject, match=r"inbox\.claim_and_apply_batch: consumer 'nobody'"):
            svc.execute("SELECT * FROM inbox.claim_and_apply_batch('nobody', '[]')")
    assert counts(conn) == (0, 0, 0, 0)


def test_a_handler_made_security_definer_after_registration_is_refused(
    conn: Conn, login_role: Callable[..., str]
) -> None:
    billing, _, _, _ = setup_billing(conn, login_role)
    conn.execute(
        "ALTER FUNCTION app.credit(jsonb, inbox.message_context) SECURITY DEFINER;"
        " ALTER FUNCTION app.credit(jsonb, inbox.message_context) OWNER TO postgres"
    )
    with connect(billing) as svc, pytest.raises(errors.InsufficientPrivilege, match="SECURITY DEFINER"):
        apply(svc, "sd-1", {"account": 5, "amount": 1})
    assert counts(conn) == (0, 0, 0, 0)


def test_a_replay_plan_checks_its_handler_at_every_run(conn: Conn, login_role: Callable[..., str]) -> None:
    """A handler altered into a SECURITY DEFINER function owned by a privileged role after the plan
    was made must be refused at the run, as claim_and_apply and repair refuse it (a consumer bound
    only by the upgrade from 0.1.0 too: since 0.3.0 its handler runs with no operator's rights)."""
    billing, _, operator, _ = setup_billing(conn, login_role)
    conn.execute("UPDATE inbox.consumer_binding SET legacy = true WHERE consumer = 'billing'")
    with connect(billing) as svc:
        assert apply(svc, "rp-1", {"account": 3, "amount": 5}) == "applied"
    with connect(operator) as op:
        plan = scalar(
            op,
            "SELECT plan_id FROM inbox.create_replay_plan('rp', 'billing', 'credit',"
            " 'app.credit(jsonb, inbox.message_context)', 'v1', 'trust test')",
        )
        op.execute(
            "SELECT inbox.add_replay_items(%s, %s)",
            (plan, json.dumps([{"producer": "shop", "message_id": "rp-1", "payload": {"account": 3, "amount": 5}}])),
        )
    conn.execute(
        "ALTER FUNCTION app.credit(jsonb, inbox.message_context) SECURITY DEFINER;"
        " ALTER FUNCTION app.credit(jsonb, inbox.message_context) OWNER TO postgres"
    )
    with connect(operator) as op, pytest.raises(errors.InsufficientPrivilege, match="SECURITY DEFINER"):
        op.execute("SELECT inbox.run_replay_plan(%s, 10)", (plan,))
    assert scalar(conn, "SELECT count(*) FROM app.ledger WHERE message_id = 'rp-1'") == 1
    assert scalar(conn, "SELECT amount FROM app.balance WHERE account = 3") == 5
    assert scalar(conn, "SELECT status FROM inbox.replay_item WHERE plan_id = %s", (plan,)) == "pending"


def test_unclaim_takes_back_only_what_the_same_transaction_claimed(conn: Conn, login_role: Callable[..., str]) -> None:
    """The batch's helper that takes back a failed message's claim cannot be used to make another
    delivery forget: a committed claim (anyone's) stays, and the redelivery stays a duplicate."""
    billing, attacker, _, _ = setup_billing(conn, login_role)
    with connect(billing) as svc:
        assert apply(svc, "kept-1", {"account": 6, "amount": 1}) == "applied"
    for who in (attacker, billing):
        with connect(who) as session:
            assert scalar(session, "SELECT inbox._unclaim('billing', '', 'shop', 'kept-1')") is False
    with connect(billing) as svc:
        assert apply(svc, "kept-1", {"account": 6, "amount": 1}) == "duplicate"
        # Within one transaction, its own fresh claim is what it may take back.
        svc.execute("BEGIN")
        assert scalar(svc, "SELECT outcome FROM inbox.claim('billing', 'shop', 'fresh-1', '{}')") == "claimed"
        assert scalar(svc, "SELECT inbox._unclaim('billing', '', 'shop', 'fresh-1')") is True
        svc.execute("ROLLBACK")
    assert scalar(conn, "SELECT count(*) FROM app.ledger WHERE message_id = 'kept-1'") == 1
