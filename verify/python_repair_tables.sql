-- Verify pginbox:python_repair_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT grant_id, quarantine_id, consumer, tenant, handler, handler_version, note, granted_by, granted_at, expires_at,
       redeemed_by, redeemed_at, result, reason_code, error_message
  FROM inbox.repair_grant WHERE false;

SELECT (NULL::inbox.granted_repair).grant_id;

ROLLBACK;
