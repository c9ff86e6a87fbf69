-- Revert pginbox:outbox_tenant_tables
-- Effect ids are unique per consumer again: refused while two tenants of a consumer hold the same id.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DO $check$
DECLARE
    example record;
BEGIN
    SELECT o.effect_id, o.consumer INTO example FROM inbox.outbox o
     GROUP BY o.effect_id, o.consumer HAVING count(*) > 1 LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'cannot revert outbox_tenant_tables: effect % of consumer % is held by several tenants',
            quote_literal(example.effect_id), quote_literal(example.consumer)
            USING ERRCODE = 'unique_violation',
                  HINT = 'Before 0.3.0 effect ids were unique per consumer: purge or discard one of them first.';
    END IF;
END
$check$;

DROP TABLE inbox.outbox_order_lock;
DROP INDEX inbox.outbox_order_idx;
ALTER TABLE inbox.outbox DROP CONSTRAINT outbox_pkey;
ALTER TABLE inbox.outbox DROP COLUMN tenant, DROP COLUMN key_scoped;
ALTER TABLE inbox.outbox ADD CONSTRAINT outbox_pkey PRIMARY KEY (effect_id, consumer);
CREATE INDEX outbox_order_idx ON inbox.outbox (ordering_key, order_seq)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'leased', 'dead');
ALTER TABLE inbox.outbox_redrive DROP COLUMN tenant;
ALTER TABLE inbox.outbox_discard DROP COLUMN tenant;

COMMIT;
