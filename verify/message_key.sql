-- Verify pginbox:message_key: the claim key leads with message_id, and no half-built index is left.
BEGIN;

SELECT 1 / count(*) FROM pg_catalog.pg_constraint c
 WHERE c.conname = 'message_pkey' AND c.conrelid = 'inbox.message'::regclass AND c.contype = 'p'
   AND pg_catalog.pg_get_constraintdef(c.oid) = 'PRIMARY KEY (message_id, consumer, tenant, producer)';
SELECT 1 / (to_regclass('inbox.message_key_building') IS NULL)::integer;

ROLLBACK;
