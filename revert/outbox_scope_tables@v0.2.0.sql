-- Revert pginbox:outbox_scope_tables
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
-- Effects keep their rows; their consumer and lease holder are forgotten. Refused while two
-- consumers hold effects under one id (0.1.0 allows one row per id): deliver or purge them first.
BEGIN;

SET LOCAL ROLE inbox_owner;

DO $revert$
DECLARE
    shared text;
BEGIN
    SELECT o.effect_id INTO shared FROM inbox.outbox o GROUP BY o.effect_id HAVING count(*) > 1 LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'cannot revert outbox_scope_tables: effect % is held by several consumers', quote_literal(shared)
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Before 0.2.0 an effect id is unique: purge or discard the duplicates first.';
    END IF;
END
$revert$;

-- 0.1.0 hashes every payload (what inbox.payload_hash(payload) computes), and has three indexes
-- for the closed effects.
UPDATE inbox.outbox SET payload_sha256 = sha256(convert_to(payload::text, 'UTF8')) WHERE payload_sha256 IS NULL;
ALTER TABLE inbox.outbox ALTER COLUMN payload_sha256 SET NOT NULL;
COMMENT ON COLUMN inbox.outbox.payload_sha256 IS 'inbox.payload_hash(payload): a second enqueue of the id must match it';
DROP INDEX inbox.outbox_closed_idx;
CREATE INDEX outbox_delivered_idx ON inbox.outbox (delivered_at) WHERE status = 'delivered';
CREATE INDEX outbox_dead_idx ON inbox.outbox (created_at) WHERE status = 'dead';
CREATE INDEX outbox_discarded_idx ON inbox.outbox (discarded_at) WHERE status = 'discarded';
ALTER TABLE inbox.outbox DROP CONSTRAINT outbox_pkey, ADD CONSTRAINT outbox_pkey PRIMARY KEY (effect_id);
DROP INDEX inbox.outbox_consumer_undelivered_idx;
ALTER TABLE inbox.outbox DROP COLUMN lease_role, DROP COLUMN consumer;
ALTER TABLE inbox.outbox_discard DROP COLUMN consumer;
ALTER TABLE inbox.outbox_redrive DROP COLUMN consumer;
DROP TABLE inbox.destination_binding;

COMMIT;
