-- pginbox: retention. Inbox rows cannot live forever, but deleting one too soon makes an old
-- delivery new again. (Skeleton: the retention policy, the purge and the watermark land here.)
BEGIN;

SET LOCAL ROLE inbox_owner;

-- Identities the purge must keep whatever their age (a replay plan that still needs them, an
-- operator's hold). One row per holder; the purge never deletes an inbox.message row with a hold.
CREATE TABLE inbox.retention_hold (
    consumer text NOT NULL,
    tenant text NOT NULL,
    producer text NOT NULL,
    message_id text NOT NULL,
    holder text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT retention_hold_pkey PRIMARY KEY (consumer, tenant, producer, message_id, holder)
);
COMMENT ON TABLE inbox.retention_hold IS 'Identities the purge keeps whatever their age, one row per holder (e.g. replay:<plan_id>)';
GRANT SELECT ON inbox.retention_hold TO inbox_reader, inbox_operator;

COMMIT;
