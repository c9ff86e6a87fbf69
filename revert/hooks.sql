-- Revert pginbox:hooks
BEGIN;

DROP FUNCTION inbox._count_duplicate(text, text);
DROP FUNCTION inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean);
DROP FUNCTION inbox._heartbeat(text);

COMMIT;
