-- Verify pginbox:outbox_scope_tables
BEGIN;

SELECT destination, consumer, bound_at, bound_by, note FROM inbox.destination_binding WHERE false;
SELECT consumer, lease_role FROM inbox.outbox WHERE false;
SELECT consumer FROM inbox.outbox_redrive WHERE false;
SELECT consumer FROM inbox.outbox_discard WHERE false;
SELECT 1 / count(*) FROM pg_catalog.pg_constraint c
 WHERE c.conname = 'outbox_pkey' AND c.conrelid = 'inbox.outbox'::regclass AND c.contype = 'p'
   AND pg_catalog.pg_get_constraintdef(c.oid) = 'PRIMARY KEY (effect_id, consumer)';
SELECT 'inbox.outbox_consumer_undelivered_idx'::regclass, 'inbox.outbox_closed_idx'::regclass;
SELECT 1 / (to_regclass('inbox.outbox_delivered_idx') IS NULL AND to_regclass('inbox.outbox_dead_idx') IS NULL)::integer;
SELECT 1 / (NOT a.attnotnull)::integer FROM pg_catalog.pg_attribute a
 WHERE a.attrelid = 'inbox.outbox'::regclass AND a.attname = 'payload_sha256';
SELECT 1 / (pg_catalog.has_table_privilege('inbox_reader', 'inbox.destination_binding', 'SELECT')
            AND NOT pg_catalog.has_table_privilege('inbox_consumer', 'inbox.destination_binding', 'SELECT')
            AND NOT pg_catalog.has_table_privilege('inbox_dispatcher', 'inbox.destination_binding', 'SELECT'))::integer;

ROLLBACK;
