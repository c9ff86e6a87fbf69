-- Deploy pginbox:message_key. Generated from sql/098_message_key.sql by python/tools/sync_deploy.py: edit that file.
-- pginbox: the claim key of inbox.message leads with message_id: PRIMARY KEY (message_id, consumer,
-- tenant, producer), the same identity as before (the same four columns, exact text), in another
-- column order. Every claim probes this index and inserts into it (twice per row under ON CONFLICT),
-- and a B-tree compares keys column by column: with consumer, tenant and producer first, every
-- comparison went through three equal text columns before reaching the one that differs, and
-- reached the fourth column of a tuple whose widths vary by walking it. Led by message_id, most
-- comparisons end at the first column. (claim_batch of 50: about 20% less CPU, bench/bench_cpu_ab.py.)
-- Queries by consumer alone (the purge, the metrics rollup, configure_consumer) use
-- message_purge_idx (consumer, processed_at), as they did.
--
-- The upgrade builds the new index with CREATE INDEX CONCURRENTLY, outside a transaction: claims go
-- on while it is built (a minute or so for 10 million identities); only the swap of the constraint
-- holds ACCESS EXCLUSIVE, for a moment. A run that failed halfway leaves an invalid index behind,
-- which running this script again drops first. New in 0.2.0.

SET ROLE inbox_owner;

DROP INDEX CONCURRENTLY IF EXISTS inbox.message_key_building;
CREATE UNIQUE INDEX CONCURRENTLY message_key_building ON inbox.message (message_id, consumer, tenant, producer);

BEGIN;
ALTER TABLE inbox.message DROP CONSTRAINT message_pkey,
    ADD CONSTRAINT message_pkey PRIMARY KEY USING INDEX message_key_building;
COMMIT;

RESET ROLE;
