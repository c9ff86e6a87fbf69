-- pginbox: the columns of deferred effects: why the dispatcher last handed an
-- effect back without spending an attempt, when, and how often. Functions in 126_outbox_defer.sql.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

ALTER TABLE inbox.outbox
    ADD COLUMN deferred_reason text,
    ADD COLUMN deferred_at timestamptz,
    ADD COLUMN deferrals integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT outbox_deferred_reason_check CHECK (deferred_reason ~ '^[a-z][a-z0-9_]{0,39}$');
COMMENT ON COLUMN inbox.outbox.deferred_reason IS
    'Why the dispatcher last handed the effect back without spending an attempt (no_transport, unroutable, no_stream, ...); current while status is pending and deferred_at is after last_attempt_at';
COMMENT ON COLUMN inbox.outbox.deferred_at IS 'When the effect was last deferred (inbox.defer_effects)';
COMMENT ON COLUMN inbox.outbox.deferrals IS 'How many times the effect was deferred (not counted in attempts)';
-- Readers see reason codes and counts (the error text stays in last_error, which they cannot read).
GRANT SELECT (deferred_reason, deferred_at, deferrals) ON inbox.outbox TO inbox_reader;

COMMIT;
