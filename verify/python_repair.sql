-- Verify pginbox:python_repair
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

SELECT 'inbox.grant_repair(bigint, text, text, text, interval)'::regprocedure,
       'inbox.begin_granted_repair(bigint, text)'::regprocedure,
       'inbox.granted_repair_failed(bigint, text, text, text)'::regprocedure,
       'inbox._redeem_grant(text, bigint, text)'::regprocedure,
       'inbox._grant_decision(inbox.repair_grant, text, text, text)'::regprocedure,
       'inbox._repair_roles(text, inbox.quarantine)'::regprocedure,
       'inbox._check_repairable(text, inbox.quarantine)'::regprocedure,
       'inbox._settle_hold(text, inbox.quarantine, text)'::regprocedure;
-- begin_granted_repair claims by the rule inbox.repair claims by (quarantine's inbox._settle_hold).
SELECT 1 / (p.prosrc LIKE '%inbox._settle_hold(%')::integer FROM pg_catalog.pg_proc p
 WHERE p.oid = 'inbox.begin_granted_repair(bigint, text)'::regprocedure;

ROLLBACK;
