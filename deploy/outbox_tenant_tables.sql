-- Deploy pginbox:outbox_tenant_tables: written from sql/100_outbox_tenant_tables.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: the outbox's names scoped like identities (docs/outbox.md#13-trust-boundaries).
--   * An effect belongs to a consumer and a tenant: the primary key is (effect_id, consumer, tenant),
--     and a role bound to some tenants of a consumer enqueues only under those tenants. Tenant ''
--     marks effects enqueued before 0.3.0 (and those of consumers without tenants).
--   * The key a destination deduplicates on is derived from (consumer, tenant, effect_id)
--     (inbox.idempotency_key): two consumers sharing a destination cannot send each other's key.
--     Effects enqueued before 0.3.0 keep the bare effect id they may have been sent with already
--     (key_scoped false): a key never changes between two attempts of one effect.
--   * Ordering keys are scoped per consumer and tenant: one consumer's effects never hold back
--     another's that use the same key. Their commit-time numbering serializes on rows of
--     inbox.outbox_order_lock, which nobody but the package can lock (an advisory lock could be
--     taken by any session that guessed or saw its key).
-- Tables only: the functions are in 065_outbox.sql. Numbered after the released
-- changes (096_reader_grants.sql would otherwise drop its column grants).
-- The upgrade rebuilds the primary key and the ordering index of inbox.outbox (ACCESS EXCLUSIVE on
-- inbox.outbox while it runs: enqueues and claims wait, in proportion to the table's size).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

-- Constant defaults: no table rewrite. key_scoped is false for the rows already there, true for
-- every row enqueued from now on.
ALTER TABLE inbox.outbox ADD COLUMN tenant text NOT NULL DEFAULT '';
ALTER TABLE inbox.outbox ADD COLUMN key_scoped boolean NOT NULL DEFAULT false;
ALTER TABLE inbox.outbox ALTER COLUMN key_scoped SET DEFAULT true;
COMMENT ON COLUMN inbox.outbox.tenant IS
    'Tenant of the consumer the effect belongs to (effect ids are unique per consumer and tenant); '''' before 0.3.0';
COMMENT ON COLUMN inbox.outbox.key_scoped IS
    'true: destinations receive inbox.idempotency_key(consumer, tenant, effect_id); false (enqueued before 0.3.0): the bare effect id';
ALTER TABLE inbox.outbox DROP CONSTRAINT outbox_pkey,
    ADD CONSTRAINT outbox_pkey PRIMARY KEY (effect_id, consumer, tenant);

-- "Is there an earlier undelivered effect with my ordering key?", per consumer and tenant.
DROP INDEX inbox.outbox_order_idx;
CREATE INDEX outbox_order_idx ON inbox.outbox (consumer, tenant, ordering_key, order_seq)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'leased', 'dead');

-- Commit-time numbering of keyed effects locks the row of each key's bucket (inbox._order_at_commit).
-- A fixed set of buckets: two keys in one bucket only serialize their commits a little more.
CREATE TABLE inbox.outbox_order_lock (
    bucket integer NOT NULL,
    CONSTRAINT outbox_order_lock_pkey PRIMARY KEY (bucket)
);
COMMENT ON TABLE inbox.outbox_order_lock IS
    'internal: one row per bucket of ordering keys, locked while a transaction numbers its keyed effects at commit';
INSERT INTO inbox.outbox_order_lock (bucket) SELECT b FROM pg_catalog.generate_series(0, 16383) b;

-- Which tenant's effect an operator redrove or discarded.
ALTER TABLE inbox.outbox_redrive ADD COLUMN tenant text NOT NULL DEFAULT '';
ALTER TABLE inbox.outbox_discard ADD COLUMN tenant text NOT NULL DEFAULT '';
COMMENT ON COLUMN inbox.outbox_redrive.tenant IS 'Tenant of the redriven effect';
COMMENT ON COLUMN inbox.outbox_discard.tenant IS 'Tenant of the discarded effect';

-- Readers see these columns (after 096_reader_grants.sql, which lists the readable columns).
GRANT SELECT (tenant, key_scoped) ON inbox.outbox TO inbox_reader;
GRANT SELECT (tenant) ON inbox.outbox_redrive, inbox.outbox_discard TO inbox_reader;

COMMIT;
