-- Verify pginbox:reader_grants
BEGIN;

SELECT 1 / (NOT pg_catalog.has_column_privilege('inbox_reader', t, c, 'SELECT'))::integer
  FROM (VALUES ('inbox.message', 'payload_sha256'), ('inbox.attempt', 'error_message'),
               ('inbox.attempt', 'payload_sha256'), ('inbox.quarantine', 'error_message'),
               ('inbox.quarantine', 'payload_sha256'), ('inbox.quarantine', 'stored_sha256'),
               ('inbox.quarantine', 'payload'), ('inbox.quarantine_decision', 'error_message'),
               ('inbox.outbox', 'last_error'), ('inbox.outbox', 'payload_sha256'), ('inbox.outbox', 'payload'),
               ('inbox.outbox', 'last_response_excerpt'), ('inbox.outbox_redrive', 'last_error'),
               ('inbox.outbox_discard', 'last_error'), ('inbox.replay_item', 'error_message'),
               ('inbox.replay_item', 'payload_sha256')) AS x(t, c);
SELECT 1 / (pg_catalog.has_column_privilege('inbox_reader', 'inbox.message', 'status', 'SELECT')
            AND pg_catalog.has_column_privilege('inbox_reader', 'inbox.quarantine', 'reason_code', 'SELECT')
            AND pg_catalog.has_table_privilege('inbox_operator', 'inbox.quarantine', 'SELECT'))::integer;

ROLLBACK;
