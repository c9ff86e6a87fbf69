-- pginbox: who may act as which consumer (docs/security.md). A consumer name is bound to the roles
-- allowed to claim, apply, record failures and starts, and enqueue effects under it; a binding may
-- name the tenants it covers. Checked inside the SECURITY DEFINER functions, so every language gets
-- it. Tables only: the functions are in 027_security.sql; destinations are bound in
-- 061_outbox_scope_tables.sql. New in 0.2.0.
BEGIN;

SET LOCAL ROLE inbox_owner;

-- A role allowed to act as a consumer (and as its versioned names, '<consumer>@<version>').
-- role is a pg_authid OID: a binding survives a rename, and a dropped role matches nobody.
CREATE TABLE inbox.consumer_binding (
    consumer text NOT NULL,
    role oid NOT NULL,
    tenants text[],
    legacy boolean NOT NULL DEFAULT false,
    bound_at timestamptz NOT NULL DEFAULT now(),
    bound_by text NOT NULL DEFAULT session_user,
    note text NOT NULL,
    CONSTRAINT consumer_binding_pkey PRIMARY KEY (consumer, role)
);
COMMENT ON TABLE inbox.consumer_binding IS
    'Roles allowed to act as a consumer (claim, apply, record failures and starts, enqueue effects), per tenant list';
COMMENT ON COLUMN inbox.consumer_binding.role IS 'OID of the bound role (pg_authid); members of it may act as the consumer';
COMMENT ON COLUMN inbox.consumer_binding.tenants IS 'Tenants the binding covers; NULL: every tenant';
COMMENT ON COLUMN inbox.consumer_binding.legacy IS
    'Made by the upgrade from 0.1.0 (role inbox_consumer): repair keeps running as the operator until it is replaced';

-- Audit trail of every binding decision.
CREATE TABLE inbox.binding_change (
    change_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action text NOT NULL CHECK (action IN ('bind_consumer', 'unbind_consumer', 'bind_destination',
                                           'unbind_destination', 'configure_security')),
    consumer text,
    role_name text,
    tenants text[],
    destination text,
    detail jsonb,
    changed_by text NOT NULL DEFAULT session_user,
    changed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    note text NOT NULL
);
COMMENT ON TABLE inbox.binding_change IS 'Audit trail: every binding and security setting change (who, when, what, note)';

-- One row: deployment-wide security settings (inbox.configure_security).
CREATE TABLE inbox.security_settings (
    singleton boolean NOT NULL DEFAULT true CHECK (singleton),
    strict_consumers boolean NOT NULL DEFAULT false,
    anonymous_enqueue boolean NOT NULL DEFAULT false,
    max_effect_delay interval NOT NULL DEFAULT '30 days' CHECK (max_effect_delay BETWEEN '1 second' AND '365 days'),
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL DEFAULT session_user,
    CONSTRAINT security_settings_pkey PRIMARY KEY (singleton)
);
COMMENT ON TABLE inbox.security_settings IS 'Deployment-wide security settings (one row, inbox.configure_security)';
COMMENT ON COLUMN inbox.security_settings.strict_consumers IS
    'Also refuse superusers a consumer nobody is bound to (non-superusers are always refused)';
COMMENT ON COLUMN inbox.security_settings.anonymous_enqueue IS
    'Allow enqueue_effect outside a claim''s transaction without naming a consumer (0.1.0 behaviour, set by the upgrade)';
COMMENT ON COLUMN inbox.security_settings.max_effect_delay IS 'Latest available_at an effect may ask for, from now';

-- Who supplied a stored payload: repair runs the handler with no more rights than that.
ALTER TABLE inbox.quarantine ADD COLUMN recorded_by text;
COMMENT ON COLUMN inbox.quarantine.recorded_by IS 'session_user of the delivery that stored the payload (NULL before 0.2.0)';

-- An existing deployment keeps working: every consumer it knows stays usable by every member of
-- inbox_consumer (bindings marked legacy; docs/security.md says how to tighten them). A new, empty
-- deployment binds nothing: a consumer is unusable until an operator binds it.
INSERT INTO inbox.security_settings DEFAULT VALUES;
INSERT INTO inbox.consumer_binding (consumer, role, legacy, note)
SELECT k.consumer, 'inbox_consumer'::regrole::oid, true, 'upgrade from 0.1.0: every inbox_consumer, as before'
  FROM (WITH RECURSIVE m(consumer) AS (
            (SELECT min(x.consumer) FROM inbox.message x)
            UNION ALL
            SELECT (SELECT min(x.consumer) FROM inbox.message x WHERE x.consumer > m.consumer)
              FROM m WHERE m.consumer IS NOT NULL)
        SELECT m.consumer FROM m WHERE m.consumer IS NOT NULL
        UNION SELECT c.consumer FROM inbox.consumer_config c
        UNION SELECT h.consumer FROM inbox.handler h
        UNION SELECT a.consumer FROM inbox.attempt a
        UNION SELECT q.consumer FROM inbox.quarantine q) k
 WHERE NOT pg_catalog.starts_with(k.consumer, 'replay:');
GRANT SELECT ON inbox.consumer_binding, inbox.binding_change, inbox.security_settings
    TO inbox_reader, inbox_operator;

COMMIT;
