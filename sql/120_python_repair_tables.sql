-- pginbox: repair grants, for quarantined messages whose handler is Python (docs/security.md,
-- "Python handlers: repair grants"). An operator cannot run a Python handler inside the database,
-- and must not run it with the operator's own login: the handler acts as the consumer. So the
-- operator grants (inbox.grant_repair), and a login of the consumer's own role redeems the grant in
-- its transaction: the claim, the handler and the entry's decision commit together
-- (inbox.begin_granted_repair), or the failure is audited (inbox.granted_repair_failed). A grant is
-- used once, and expires. Every decision still lands in inbox.quarantine_decision, decided_by the
-- operator who granted it; this table says who ran it, with which handler.
-- Tables and types only: the functions are in 121_python_repair.sql.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

CREATE TABLE inbox.repair_grant (
    grant_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    quarantine_id bigint NOT NULL REFERENCES inbox.quarantine (quarantine_id),
    consumer text NOT NULL,
    tenant text NOT NULL,
    handler text NOT NULL,
    handler_version text NOT NULL,
    note text NOT NULL,
    granted_by text NOT NULL DEFAULT session_user,
    granted_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at timestamptz NOT NULL,
    redeemed_by text,
    redeemed_at timestamptz,
    result text CHECK (result IN ('recovered', 'repair_failed')),
    reason_code text,
    error_message text,
    CONSTRAINT repair_grant_redeemed CHECK ((redeemed_at IS NULL) = (result IS NULL)
                                            AND (redeemed_at IS NULL) = (redeemed_by IS NULL))
);
COMMENT ON TABLE inbox.repair_grant IS
    'Audit trail: one-time grants to repair a quarantine entry with a Python handler, run by a login of the consumer''s role';
COMMENT ON COLUMN inbox.repair_grant.handler IS 'The Python handler (module:function) the operator chose; the redeemer must name the same';
COMMENT ON COLUMN inbox.repair_grant.redeemed_by IS 'The login (effective role) that ran the handler: a member of a role bound to the consumer';
CREATE INDEX repair_grant_entry_idx ON inbox.repair_grant (quarantine_id);

GRANT SELECT ON inbox.repair_grant TO inbox_operator, inbox_reader;

-- What inbox.begin_granted_repair hands the consumer's login: the message to run its handler on.
CREATE TYPE inbox.granted_repair AS (
    grant_id bigint,
    quarantine_id bigint,
    consumer text,
    tenant text,
    producer text,
    message_id text,
    message_type text,
    payload jsonb,
    payload_sha256 text,
    handler_version text,
    attempts integer
);
COMMENT ON TYPE inbox.granted_repair IS 'A quarantined message claimed for a granted repair, for its Python handler';

COMMIT;
