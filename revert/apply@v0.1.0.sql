-- Revert pginbox:apply
BEGIN;

DROP FUNCTION inbox.claim_and_apply_batch(text, jsonb);
DROP FUNCTION inbox.claim_and_apply(text, text, text, text, jsonb, text, timestamptz);
DROP FUNCTION inbox._begin_apply(text, text, text, text, jsonb, text, timestamptz);
DROP FUNCTION inbox.register_handler(text, text, regprocedure, text);
DROP FUNCTION inbox._check_message_type(text, text);

COMMIT;
