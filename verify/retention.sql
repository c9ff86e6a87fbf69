-- Verify pginbox:retention
BEGIN;

SELECT consumer, tenant, producer, message_id, holder, created_at FROM inbox.retention_hold WHERE false;

ROLLBACK;
