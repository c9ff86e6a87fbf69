-- Revert pginbox:quarantine
BEGIN;

DROP FUNCTION inbox.repair(bigint, text);
DROP FUNCTION inbox._repair_failed(bigint, text, text, text);
DROP FUNCTION inbox._begin_repair(bigint, text);
DROP FUNCTION inbox.release(bigint, text);
DROP FUNCTION inbox.discard(bigint, text);
DROP FUNCTION inbox._close_entry(inbox.quarantine, text, text, text);
DROP FUNCTION inbox._lock_open_entry(text, bigint, text);

COMMIT;
