-- pginbox: operator runs (docs/security.md#repair-and-replay). An operator's repair or replay runs
-- a consumer's handler, and the handler acts as the consumer: an effect it enqueues belongs to the
-- consumer. Who it acts for is recorded here by the SECURITY DEFINER functions that run it
-- (inbox.repair, inbox.run_replay_plan), for the length of the handler call only, never in a
-- session setting: any code of the transaction, the handler included, can set one.
-- The handler is called by inbox._run_confined, owned by the role inbox_runner, which holds no
-- rights at all: a handler that is SECURITY DEFINER (what repair requires) runs with its owner's
-- rights, one altered into SECURITY INVOKER behind the check's back runs with none.
-- Tables only: the functions are in 027_security.sql.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

-- Cluster-wide, created only when missing (like the roles of 010_roles.sql). Nobody logs in as it
-- and nobody is made a member of it; it owns inbox._run_confined and gets nothing else but the
-- right to call the handlers an operator runs (granted by the consumer's owner: docs/security.md).
DO $role$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'inbox_runner') THEN
        CREATE ROLE inbox_runner NOLOGIN NOINHERIT;
    END IF;
END
$role$;

SET LOCAL ROLE inbox_owner;

-- One row while an operator's decision runs a consumer's handler in this transaction: its code may
-- act as whatever the handler's owner may act as (inbox._authorize). Written and deleted only by
-- the functions that run the handler; nobody else has a privilege on it.
CREATE TABLE inbox.operator_run (
    xact xid8 NOT NULL,
    consumer text NOT NULL,
    tenant text NOT NULL,
    handler regprocedure NOT NULL,
    handler_owner oid NOT NULL,
    decision text NOT NULL CHECK (decision IN ('repair', 'replay')),
    started_by text NOT NULL DEFAULT session_user,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT operator_run_pkey PRIMARY KEY (xact)
);
COMMENT ON TABLE inbox.operator_run IS
    'internal: the handler call of an operator decision running now, per transaction (who its code acts as)';
COMMENT ON COLUMN inbox.operator_run.handler_owner IS
    'OID of the handler''s owner: the handler''s code may act as what this role may act as, nothing more';

-- A secret of this database: advisory lock keys are derived from it, so that no other session can
-- compute (and take first) the keys of the purge and of the consumers' first heartbeat.
CREATE TABLE inbox.lock_salt (
    singleton boolean NOT NULL DEFAULT true CHECK (singleton),
    salt bytea NOT NULL,
    CONSTRAINT lock_salt_pkey PRIMARY KEY (singleton)
);
COMMENT ON TABLE inbox.lock_salt IS 'internal: the secret advisory lock keys are derived from (readable by the owner only)';
INSERT INTO inbox.lock_salt (salt)
VALUES (pg_catalog.uuid_send(pg_catalog.gen_random_uuid()) OPERATOR(pg_catalog.||)
        pg_catalog.uuid_send(pg_catalog.gen_random_uuid()));

COMMIT;
