-- Verify pginbox:hooks
BEGIN;

SELECT 'inbox._heartbeat(text)'::regprocedure,
       'inbox._expire_check(text, text, text, text, bytea, text, timestamptz, text, jsonb, bytea, boolean)'::regprocedure,
       'inbox._count_duplicate(text, text)'::regprocedure;

ROLLBACK;
