-- Deploy pginbox:retention_watermark_tables: written from sql/101_retention_watermark_tables.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: retention's watermark and released expired entries (docs/retention.md).
--   * A released 'expired' entry lets exactly one delivery of its identity through: the claim that
--     uses the release stamps release_used_at (inbox.release clears it again).
--   * The purge deletes only rows produced before the watermark it announced, and records the
--     latest produced_at it deleted (purged_produced_max): an operator may move a watermark that a
--     mistaken policy pushed too far back down to that, never below (inbox.correct_watermark,
--     audited in inbox.watermark_change).
-- Tables only: the functions are in 075_retention.sql. Numbered after the released
-- changes (a reader grant of 096_reader_grants.sql would otherwise drop its column grant).
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

ALTER TABLE inbox.quarantine ADD COLUMN release_used_at timestamptz;
COMMENT ON COLUMN inbox.quarantine.release_used_at IS
    'expired entries: when the one delivery their release allowed was claimed (NULL: not yet, or not released)';

-- A purge before 0.3.0 deleted rows whose produced_at nobody recorded: they were produced before
-- the watermark, and claimed (their produced_at checked against the clock) before this upgrade.
-- A watermark a mistyped margin pushed ahead of the clock therefore bounds nothing after now.
ALTER TABLE inbox.purge_state ADD COLUMN purged_produced_max timestamptz;
COMMENT ON COLUMN inbox.purge_state.purged_produced_max IS
    'Latest produced_at of the rows this policy''s purges deleted (before 0.3.0: the watermark, at most the upgrade''s time); nothing produced after it is expired';
UPDATE inbox.purge_state s SET purged_produced_max = least(s.watermark, pg_catalog.now()) WHERE s.rows_purged > 0;

CREATE TABLE inbox.watermark_change (
    change_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer text NOT NULL,
    producer text NOT NULL,
    previous_watermark timestamptz,
    watermark timestamptz NOT NULL,
    purged_produced_max timestamptz,
    changed_by text NOT NULL DEFAULT session_user,
    changed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    note text NOT NULL
);
COMMENT ON TABLE inbox.watermark_change IS
    'Audit trail: every purge watermark an operator corrected (inbox.correct_watermark): who, when, from what, why';

GRANT SELECT ON inbox.watermark_change TO inbox_reader, inbox_operator;
-- Readers see it (after 096_reader_grants.sql, which lists the readable columns of quarantine).
GRANT SELECT (release_used_at) ON inbox.quarantine TO inbox_reader;

COMMIT;
