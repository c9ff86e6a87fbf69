-- Verify pginbox:security_tables
BEGIN;

SELECT consumer, role, tenants, legacy, bound_at, bound_by, note FROM inbox.consumer_binding WHERE false;
SELECT change_id, action, consumer, role_name, tenants, destination, detail, changed_by, changed_at, note
  FROM inbox.binding_change WHERE false;
SELECT singleton, strict_consumers, anonymous_enqueue, max_effect_delay, updated_at, updated_by
  FROM inbox.security_settings WHERE false;
SELECT 1 / count(*) FROM inbox.security_settings;
SELECT recorded_by FROM inbox.quarantine WHERE false;
SELECT 1 / (pg_catalog.has_table_privilege('inbox_reader', 'inbox.consumer_binding', 'SELECT')
            AND NOT pg_catalog.has_table_privilege('inbox_consumer', 'inbox.consumer_binding', 'SELECT'))::integer;

ROLLBACK;
