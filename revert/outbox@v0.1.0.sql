-- Revert pginbox:outbox
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

DROP FUNCTION inbox.purge_delivered_effects(interval, integer);
DROP FUNCTION inbox.discard_effect(text, text);
DROP FUNCTION inbox.redrive_effect(text, text);
DROP FUNCTION inbox._lock_dead_effect(text, text, text, text, text, text);
DROP FUNCTION inbox.extend_lease(text, bigint, interval);
DROP FUNCTION inbox.fail_effect(text, bigint, text, boolean, integer, text, integer);
DROP FUNCTION inbox.complete_effect(text, bigint, integer, text, integer);
DROP FUNCTION inbox.fail_effects(text[], bigint[], text[], boolean[], integer[], text[], integer[]);
DROP FUNCTION inbox.complete_effects(text[], bigint[], integer[], text[], integer[]);
DROP FUNCTION inbox._fail_reports(text[], bigint[], text[], boolean[], integer[], text[], integer[]);
DROP FUNCTION inbox._complete_reports(text[], bigint[], integer[], text[], integer[]);
DROP FUNCTION inbox._check_reports(text, boolean, text[], bigint[], integer[], text[], integer[], text[], boolean[]);
DROP FUNCTION inbox._check_failure(text, text, boolean);
DROP FUNCTION inbox._unblock_successors(text[], bigint[]);
DROP FUNCTION inbox._report_outcomes(text, text[], bigint[], integer[], text[]);
DROP FUNCTION inbox._backoff(inbox.outbox_destination, integer);
DROP FUNCTION inbox.claim_effects(text, integer, interval);
DROP FUNCTION inbox.configure_destination(text, integer, interval, interval);
DROP FUNCTION inbox._default_destination(text);
DROP FUNCTION inbox.enqueue_effect(text, text, jsonb, jsonb, text, timestamptz);
DROP TRIGGER outbox_signal_at_commit ON inbox.outbox;
DROP FUNCTION inbox._signal_at_commit();
DROP TRIGGER outbox_order_at_commit ON inbox.outbox;
DROP FUNCTION inbox._order_at_commit();
DROP FUNCTION inbox.dispatcher_idle(text, boolean);
DROP FUNCTION inbox._wake_dispatchers();
DROP FUNCTION inbox.effect_id(text, text, text, text, text);
DROP FUNCTION inbox._check_report(text, text, bigint, integer, integer);
DROP FUNCTION inbox._check_lease(text, interval);
DROP FUNCTION inbox._check_effect(text, text, text, integer, jsonb, text, timestamptz);
DROP FUNCTION inbox._effect_ok(text, text, integer, jsonb, text, timestamptz);
DROP FUNCTION inbox._check_text(text, text, text, integer);

COMMIT;
