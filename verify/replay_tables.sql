-- Verify pginbox:replay_tables
BEGIN;

SELECT plan_id, plan_name, consumer, message_type, handler, handler_version, takes_context, status, note, created_at,
       created_by, stopped_at, finished_at FROM inbox.replay_plan WHERE false;
SELECT plan_id, item_no, tenant, producer, message_id, operation_id, payload, payload_sha256, status, handler_version,
       reason_code, error_message, added_at, added_by, finished_at, finished_by FROM inbox.replay_item WHERE false;
SELECT decision_id, plan_id, decision, decided_by, decided_at, note, handler, handler_version, previous_handler,
       previous_version, items FROM inbox.replay_decision WHERE false;
SELECT (NULL::inbox.replay_run).plan_id, (NULL::inbox._replay_step).action;

ROLLBACK;
