-- Verify pginbox:outbox_tenant_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT tenant, key_scoped FROM inbox.outbox WHERE false;
SELECT tenant FROM inbox.outbox_redrive WHERE false;
SELECT tenant FROM inbox.outbox_discard WHERE false;
SELECT 1 / (count(*) = 16384)::integer FROM inbox.outbox_order_lock;
SELECT 1 / (pg_catalog.pg_get_constraintdef(c.oid) = 'PRIMARY KEY (effect_id, consumer, tenant)')::integer
  FROM pg_catalog.pg_constraint c WHERE c.conrelid = 'inbox.outbox'::regclass AND c.conname = 'outbox_pkey';
SELECT 1 / (NOT has_table_privilege(r, 'inbox.outbox_order_lock', 'SELECT, UPDATE'))::integer
  FROM unnest(ARRAY['inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_dispatcher', 'public']) r;

ROLLBACK;
