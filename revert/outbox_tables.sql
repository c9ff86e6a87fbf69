-- Revert pginbox:outbox_tables
-- No CASCADE: an object some later change left behind makes this fail loudly instead of vanishing.
BEGIN;

DROP TABLE inbox.outbox_waiter;
DROP TABLE inbox.outbox_fenced_report;
DROP TABLE inbox.outbox_discard;
DROP TABLE inbox.outbox_redrive;
DROP TABLE inbox.outbox_destination;
DROP TABLE inbox.outbox;
DROP SEQUENCE inbox.outbox_order_seq;
DROP SEQUENCE inbox.outbox_lease_token;
DROP TYPE inbox.effect_status;

COMMIT;
