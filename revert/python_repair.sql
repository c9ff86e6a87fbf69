-- Revert pginbox:python_repair
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

DROP FUNCTION inbox.granted_repair_failed(bigint, text, text, text);
DROP FUNCTION inbox.begin_granted_repair(bigint, text);
DROP FUNCTION inbox._grant_decision(inbox.repair_grant, text, text, text);
DROP FUNCTION inbox._redeem_grant(text, bigint, text);
DROP FUNCTION inbox.grant_repair(bigint, text, text, text, interval);
DROP FUNCTION inbox._check_repairable(text, inbox.quarantine);
DROP FUNCTION inbox._repair_roles(text, inbox.quarantine);

COMMIT;
