-- Revert pginbox:message_key: the claim key in 0.1.0's column order (consumer, tenant, producer,
-- message_id), built concurrently as the deploy builds it.
SET ROLE inbox_owner;

DROP INDEX CONCURRENTLY IF EXISTS inbox.message_key_building;
CREATE UNIQUE INDEX CONCURRENTLY message_key_building ON inbox.message (consumer, tenant, producer, message_id);

BEGIN;
ALTER TABLE inbox.message DROP CONSTRAINT message_pkey,
    ADD CONSTRAINT message_pkey PRIMARY KEY USING INDEX message_key_building;
COMMIT;

RESET ROLE;
