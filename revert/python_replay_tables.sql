-- Revert pginbox:python_replay_tables
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM inbox.replay_plan p WHERE p.handler IS NULL) THEN
        RAISE EXCEPTION 'revert python_replay_tables: replay plans with a Python handler exist; a plan without a SQL handler cannot be kept'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Their audit trail would be lost: keep this change, or export and delete those plans first.';
    END IF;
END
$$;
DROP TYPE inbox.python_replay_step;
ALTER TABLE inbox.replay_plan
    DROP CONSTRAINT replay_plan_one_handler,
    DROP COLUMN python_handler,
    ALTER COLUMN handler SET NOT NULL;

COMMIT;
