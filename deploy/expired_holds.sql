-- Deploy pginbox:expired_holds. Generated from sql/097_expired_holds.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: identities of deliveries quarantined as expired before 0.2.0 are held. Until 0.2.0 an
-- expired delivery left no claim row: a redelivery without produced_at (or with a produced_at past
-- the watermark) was applied, and a discard let the next delivery reopen the entry. Since 0.2.0 an
-- expired delivery's claim row is its hold (sql/075_retention.sql, inbox._expire_check); this change
-- gives the entries recorded before it the same hold: open ones 'quarantined', discarded ones
-- 'discarded' (their redeliveries are duplicates). Released entries let their next delivery through
-- and get none. Data only: on a fresh database it inserts nothing. New in 0.2.0; never reworked.
BEGIN;

SET LOCAL ROLE inbox_owner;

INSERT INTO inbox.message AS m (consumer, tenant, producer, message_id, payload_sha256, handler_version, status,
                                produced_at, received_at, processed_at)
SELECT DISTINCT ON (q.consumer, q.tenant, q.producer, q.message_id)
       q.consumer, q.tenant, q.producer, q.message_id,
       coalesce(q.payload_sha256, pg_catalog.sha256(''::bytea)), q.handler_version,
       CASE q.status WHEN 'open' THEN 'quarantined' ELSE 'discarded' END::inbox.message_status,
       NULL, q.created_at, CASE q.status WHEN 'open' THEN NULL ELSE q.decided_at END
  FROM inbox.quarantine q
 WHERE q.kind = 'expired' AND q.status IN ('open', 'discarded')
 ORDER BY q.consumer, q.tenant, q.producer, q.message_id, (q.status = 'open') DESC, q.quarantine_id DESC
ON CONFLICT ON CONSTRAINT message_pkey DO NOTHING;

COMMIT;
