-- Deploy pginbox:outbox_scope_tables. Generated from sql/061_outbox_scope_tables.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: the outbox's trust boundaries (docs/outbox.md#13-trust-boundaries, docs/security.md).
--   * A destination is bound to the consumers allowed to enqueue effects to it (consumer '*': every
--     consumer); nobody else can make the dispatcher send a body with the destination's credentials.
--   * An effect belongs to the consumer that enqueued it, and effect ids are scoped per consumer: the
--     primary key is (effect_id, consumer), so one consumer cannot squat another's id. Consumer ''
--     marks effects enqueued before 0.2.0 or anonymously (security_settings.anonymous_enqueue).
--   * A lease belongs to the role that claimed it (lease_role): a report with the right token from
--     another role is refused like a stale one.
-- Tables only: the functions are in 065_outbox.sql. New in 0.2.0.
-- The upgrade rebuilds the primary key of inbox.outbox (it holds ACCESS EXCLUSIVE on inbox.outbox
-- while it runs: enqueues and claims wait, in proportion to the table's size).
BEGIN;

SET LOCAL ROLE inbox_owner;

CREATE TABLE inbox.destination_binding (
    destination text NOT NULL,
    consumer text NOT NULL,
    bound_at timestamptz NOT NULL DEFAULT now(),
    bound_by text NOT NULL DEFAULT session_user,
    note text NOT NULL,
    CONSTRAINT destination_binding_pkey PRIMARY KEY (destination, consumer)
);
COMMENT ON TABLE inbox.destination_binding IS
    'Consumers allowed to enqueue effects to a destination (consumer ''*'': every consumer, and anonymous enqueues)';
COMMENT ON COLUMN inbox.destination_binding.consumer IS
    'A consumer name (its versioned names included), or ''*'' for every consumer';

-- Who an effect belongs to. A constant default: no table rewrite.
ALTER TABLE inbox.outbox ADD COLUMN consumer text NOT NULL DEFAULT '';
COMMENT ON COLUMN inbox.outbox.consumer IS
    'Consumer that enqueued the effect (effect ids are unique per consumer); '''': enqueued before 0.2.0 or anonymously';
-- Who holds the lease: only that role may report on it (with the token).
ALTER TABLE inbox.outbox ADD COLUMN lease_role oid;
COMMENT ON COLUMN inbox.outbox.lease_role IS
    'OID of the session_user that claimed the current (status leased) or last lease; NULL: leased before 0.2.0';
ALTER TABLE inbox.outbox DROP CONSTRAINT outbox_pkey,
    ADD CONSTRAINT outbox_pkey PRIMARY KEY (effect_id, consumer);
-- The per-consumer purge floor: the oldest undelivered effect of a consumer.
CREATE INDEX outbox_consumer_undelivered_idx ON inbox.outbox (consumer, created_at)
    WHERE status IN ('pending', 'leased', 'dead');

-- Cheaper enqueues (0.2.0). An enqueue no longer hashes the payload (a repeat of an effect id is
-- compared with the stored payload itself), so new rows carry no hash. And one partial index for
-- the closed effects instead of three: each partial index's predicate is evaluated at every insert,
-- even when it never matches there. Dead effects are found through outbox_consumer_undelivered_idx.
ALTER TABLE inbox.outbox ALTER COLUMN payload_sha256 DROP NOT NULL;
COMMENT ON COLUMN inbox.outbox.payload_sha256 IS
    'SHA-256 of the payload''s text for effects enqueued before 0.2.0; NULL since (a repeat is compared with the payload)';
DROP INDEX inbox.outbox_delivered_idx, inbox.outbox_discarded_idx, inbox.outbox_dead_idx;
CREATE INDEX outbox_closed_idx ON inbox.outbox ((coalesce(delivered_at, discarded_at)))
    WHERE status IN ('delivered', 'discarded');

-- Which consumer's effect an operator redrove or discarded ('' before 0.2.0, as for the effects).
ALTER TABLE inbox.outbox_redrive ADD COLUMN consumer text NOT NULL DEFAULT '';
ALTER TABLE inbox.outbox_discard ADD COLUMN consumer text NOT NULL DEFAULT '';
COMMENT ON COLUMN inbox.outbox_redrive.consumer IS 'Consumer of the redriven effect';
COMMENT ON COLUMN inbox.outbox_discard.consumer IS 'Consumer of the discarded effect';

-- An existing deployment keeps working: every destination it knows stays open to every consumer,
-- and enqueues that name no consumer stay allowed (docs/security.md says how to tighten both).
-- A new, empty deployment binds nothing and refuses anonymous enqueues.
WITH known AS (
    SELECT d.destination FROM inbox.outbox_destination d
    UNION
    SELECT o.destination FROM inbox.outbox o
), bound AS (
    INSERT INTO inbox.destination_binding (destination, consumer, note)
    SELECT k.destination, '*', 'upgrade from 0.1.0: every consumer, as before' FROM known k
    RETURNING destination, consumer, note
)
INSERT INTO inbox.binding_change (action, consumer, destination, note)
SELECT 'bind_destination', b.consumer, b.destination, b.note FROM bound b;

WITH changed AS (
    UPDATE inbox.security_settings s
       SET anonymous_enqueue = true, updated_at = now(), updated_by = session_user
     WHERE NOT s.anonymous_enqueue
       AND (EXISTS (SELECT FROM inbox.message) OR EXISTS (SELECT FROM inbox.outbox))
    RETURNING s.*
)
INSERT INTO inbox.binding_change (action, detail, note)
SELECT 'configure_security',
       jsonb_build_object('strict_consumers', c.strict_consumers, 'anonymous_enqueue', c.anonymous_enqueue,
                          'max_effect_delay', c.max_effect_delay),
       'upgrade from 0.1.0: enqueue_effect without a consumer keeps working'
  FROM changed c;

GRANT SELECT ON inbox.destination_binding TO inbox_reader, inbox_operator;

COMMIT;
