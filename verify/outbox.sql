-- Verify pginbox:outbox
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT 'inbox._check_text(text, text, text, integer)'::regprocedure,
       'inbox._effect_ok(text, text, integer, jsonb, text, timestamptz)'::regprocedure,
       'inbox._check_effect(text, text, text, integer, jsonb, text, timestamptz)'::regprocedure,
       'inbox._check_lease(text, interval)'::regprocedure,
       'inbox._lock_dead_effect(text, text, text, text, text, text, text, text)'::regprocedure,
       'inbox._check_report(text, text, bigint, integer, integer)'::regprocedure,
       'inbox._wake_dispatchers()'::regprocedure,
       'inbox._default_destination(text)'::regprocedure,
       'inbox._report_outcomes(text, text[], bigint[], integer[], text[])'::regprocedure,
       'inbox._unblock_successors(text[], text[], text[], bigint[])'::regprocedure,
       'inbox._order_bucket(text, text, text)'::regprocedure,
       'inbox._check_failure(text, text, boolean)'::regprocedure,
       'inbox._check_reports(text, boolean, text[], bigint[], integer[], text[], integer[], text[], boolean[])'::regprocedure,
       'inbox._complete_reports(text[], bigint[], integer[], text[], integer[])'::regprocedure,
       'inbox._fail_reports(text[], bigint[], text[], boolean[], integer[], text[], integer[])'::regprocedure,
       'inbox._backoff(inbox.outbox_destination, integer)'::regprocedure,
       'inbox._headers_ok(jsonb)'::regprocedure,
       'inbox._authorize_enqueue(text, text, text, text)'::regprocedure,
       'inbox._new_lease_token()'::regprocedure;

DO $verify$
DECLARE
    fn text;
    role_name text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles
                    WHERE rolname = 'inbox_dispatcher' AND NOT rolcanlogin AND NOT rolsuper) THEN
        RAISE EXCEPTION 'the NOLOGIN role inbox_dispatcher is not there';
    END IF;
    IF NOT pg_catalog.has_schema_privilege('inbox_dispatcher', 'inbox', 'USAGE') THEN
        RAISE EXCEPTION 'inbox_dispatcher has no USAGE on schema inbox';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                    WHERE tgrelid = 'inbox.outbox'::regclass AND tgname = 'outbox_order_at_commit'
                      AND tgfoid = 'inbox._order_at_commit()'::regprocedure AND tgdeferrable AND tginitdeferred) THEN
        RAISE EXCEPTION 'the deferred trigger outbox_order_at_commit on inbox.outbox is missing';
    END IF;
    -- Since 0.2.0 enqueue_effect wakes idle dispatchers itself: no trigger per inserted effect.
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                WHERE tgrelid = 'inbox.outbox'::regclass AND tgname = 'outbox_signal_at_commit') THEN
        RAISE EXCEPTION 'the per-row trigger outbox_signal_at_commit is still on inbox.outbox';
    END IF;
    FOR fn, role_name IN
        VALUES ('inbox.enqueue_effect(text, text, jsonb, jsonb, text, timestamptz, text, text)', 'inbox_consumer'),
               ('inbox.idempotency_key(text, text, text)', 'inbox_dispatcher'),
               ('inbox.effect_id(text, text, text, text, text)', 'inbox_consumer'),
               ('inbox.claim_effects(text, integer, interval, boolean)', 'inbox_dispatcher'),
               ('inbox.complete_effect(text, bigint, integer, text, integer)', 'inbox_dispatcher'),
               ('inbox.fail_effect(text, bigint, text, boolean, integer, text, integer)', 'inbox_dispatcher'),
               ('inbox.complete_effects(text[], bigint[], integer[], text[], integer[])', 'inbox_dispatcher'),
               ('inbox.fail_effects(text[], bigint[], text[], boolean[], integer[], text[], integer[])', 'inbox_dispatcher'),
               ('inbox.extend_lease(text, bigint, interval)', 'inbox_dispatcher'),
               ('inbox.dispatcher_idle(text, boolean)', 'inbox_dispatcher'),
               ('inbox.purge_delivered_effects(interval, integer)', 'inbox_dispatcher'),
               ('inbox.purge_delivered_effects(interval, integer)', 'inbox_operator'),
               ('inbox.configure_destination(text, integer, interval, interval)', 'inbox_operator'),
               ('inbox.redrive_effect(text, text, text, text)', 'inbox_operator'),
               ('inbox.discard_effect(text, text, text, text)', 'inbox_operator'),
               ('inbox.bind_destination(text, text, text)', 'inbox_operator'),
               ('inbox.unbind_destination(text, text, text)', 'inbox_operator'),
               ('inbox._order_at_commit()', NULL)
    LOOP
        IF pg_catalog.has_function_privilege('public', fn, 'EXECUTE') THEN
            RAISE EXCEPTION 'PUBLIC can execute %', fn;
        END IF;
        IF role_name IS NOT NULL AND NOT pg_catalog.has_function_privilege(role_name, fn, 'EXECUTE') THEN
            RAISE EXCEPTION '% cannot execute %', role_name, fn;
        END IF;
    END LOOP;
    IF pg_catalog.has_table_privilege('inbox_consumer', 'inbox.outbox', 'SELECT, INSERT, UPDATE, DELETE')
       OR pg_catalog.has_table_privilege('inbox_dispatcher', 'inbox.outbox', 'SELECT, INSERT, UPDATE, DELETE') THEN
        RAISE EXCEPTION 'consumers and dispatchers must not touch inbox.outbox directly';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                    WHERE p.oid = 'inbox.claim_effects(text, integer, interval, boolean)'::regprocedure
                      AND 'consumer' = ANY (p.proargnames)) THEN
        RAISE EXCEPTION 'inbox.claim_effects does not return the consumer';
    END IF;
    IF pg_catalog.has_function_privilege('inbox_consumer', 'inbox.bind_destination(text, text, text)', 'EXECUTE')
       OR pg_catalog.has_function_privilege('inbox_dispatcher', 'inbox.bind_destination(text, text, text)', 'EXECUTE') THEN
        RAISE EXCEPTION 'only operators may bind destinations';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_enum
                    WHERE enumtypid = 'inbox.effect_status'::regtype AND enumlabel = 'discarded') THEN
        RAISE EXCEPTION 'inbox.effect_status has no label discarded';
    END IF;
    IF NOT pg_catalog.has_table_privilege('inbox_operator', 'inbox.outbox_discard', 'SELECT')
       OR NOT pg_catalog.has_any_column_privilege('inbox_reader', 'inbox.outbox_discard', 'SELECT') THEN
        RAISE EXCEPTION 'operators and readers must be able to read inbox.outbox_discard';
    END IF;
    IF pg_catalog.has_column_privilege('inbox_reader', 'inbox.outbox', 'payload', 'SELECT')
       OR pg_catalog.has_column_privilege('inbox_reader', 'inbox.outbox', 'headers', 'SELECT') THEN
        RAISE EXCEPTION 'inbox_reader must not read effect payloads or headers';
    END IF;
END
$verify$;

ROLLBACK;
