-- Verify pginbox:expired_holds: every open expired entry holds its identity.
BEGIN;

SELECT 1 / (NOT EXISTS (
    SELECT 1 FROM inbox.quarantine q
     WHERE q.kind = 'expired' AND q.status = 'open'
       AND NOT EXISTS (SELECT 1 FROM inbox.message m
                        WHERE m.consumer = q.consumer AND m.tenant = q.tenant AND m.producer = q.producer
                          AND m.message_id = q.message_id)))::integer;

ROLLBACK;
