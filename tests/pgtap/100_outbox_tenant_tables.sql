-- pgTAP: sql/100_outbox_tenant_tables.sql and the 0.3.0 outbox (docs/outbox.md#13-trust-boundaries):
-- effect ids, ordering keys and the key a destination deduplicates on are scoped per consumer and
-- tenant; a role bound to some tenants enqueues only under them; effects enqueued before 0.3.0 keep
-- their bare effect id as key; an available_at in the past cannot jump the queue.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(24);

\ir write_counter.psql

CREATE ROLE tap_ot_acme NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_ot_globex NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_ot_crm NOLOGIN IN ROLE inbox_consumer;
SELECT inbox.bind_consumer('ot-billing', 'tap_ot_acme', tenants => ARRAY['acme'], note => 'tap') \g /dev/null
SELECT inbox.bind_consumer('ot-billing', 'tap_ot_globex', tenants => ARRAY['globex'], note => 'tap') \g /dev/null
SELECT inbox.bind_consumer('ot-crm', 'tap_ot_crm', note => 'tap') \g /dev/null
SELECT inbox.bind_destination('ot-hook', c, 'tap') FROM unnest(ARRAY['ot-billing', 'ot-crm']) c \g /dev/null
DELETE FROM inbox.outbox;
CREATE TEMP TABLE res (step text PRIMARY KEY, val text, sqlstate text);
GRANT ALL ON res TO PUBLIC;
CREATE FUNCTION pg_temp.try(step text, sql text) RETURNS void LANGUAGE plpgsql AS $f$
DECLARE
    got text;
BEGIN
    EXECUTE sql INTO got;
    INSERT INTO pg_temp.res VALUES (step, got, NULL);
EXCEPTION WHEN OTHERS THEN
    INSERT INTO pg_temp.res VALUES (step, NULL, SQLSTATE);
END
$f$;

-- ================================================================== tenant-scoped enqueues
-- The attack: acme's role squats the id globex's handler will derive, with its own payload.
SELECT inbox.effect_id('ot-billing', 'shop', 'order-7', 'notify', 'globex') AS globex_id \gset
SET ROLE tap_ot_acme;
SELECT pg_temp.try('acme-as-globex', format($$SELECT inbox.enqueue_effect(%L, 'ot-hook', '{"transfer": 999999}',
                                                  consumer => 'ot-billing', tenant => 'globex')::text$$, :'globex_id'));
SELECT pg_temp.try('acme-default-tenant', format($$SELECT inbox.enqueue_effect(%L, 'ot-hook', '{"transfer": 999999}',
                                                       consumer => 'ot-billing')::text$$, :'globex_id'));
SELECT pg_temp.try('acme-squats', format($$SELECT inbox.enqueue_effect(%L, 'ot-hook', '{"transfer": 999999}',
                                               consumer => 'ot-billing', tenant => 'acme')::text$$, :'globex_id'));
-- Its own claim in this transaction makes its tenant the default.
SELECT inbox.claim('ot-billing', 'shop', 'order-1', '{}', tenant => 'acme') \g /dev/null
SELECT pg_temp.try('acme-claimed-default', $$SELECT inbox.enqueue_effect('acme-own', 'ot-hook', '{}')::text$$);
RESET ROLE;
SET ROLE tap_ot_globex;
SELECT pg_temp.try('globex-real', format($$SELECT inbox.enqueue_effect(%L, 'ot-hook', '{"notify": "order-7"}',
                                               consumer => 'ot-billing', tenant => 'globex')::text$$, :'globex_id'));
SELECT pg_temp.try('globex-again', format($$SELECT inbox.enqueue_effect(%L, 'ot-hook', '{"notify": "order-7"}',
                                                consumer => 'ot-billing', tenant => 'globex')::text$$, :'globex_id'));
RESET ROLE;
SELECT is((SELECT sqlstate FROM res WHERE step = 'acme-as-globex'), '42501', 'a role bound to tenant acme cannot enqueue under globex');
SELECT is((SELECT sqlstate FROM res WHERE step = 'acme-default-tenant'), '42501',
          '... nor under tenant '''' (not in its binding) by leaving the tenant out');
SELECT is((SELECT val FROM res WHERE step = 'acme-squats'), 'true', 'under its own tenant it may use any id, globex''s too');
SELECT is((SELECT val FROM res WHERE step = 'acme-claimed-default'), 'true', 'the tenant claimed in the transaction is the default');
SELECT is((SELECT tenant FROM inbox.outbox WHERE effect_id = 'acme-own'), 'acme', '... and the effect belongs to it');
SELECT is((SELECT val FROM res WHERE step = 'globex-real'), 'true',
          'globex''s real effect under the same id is its own effect: enqueued, no effect_id_conflict');
SELECT is((SELECT val FROM res WHERE step = 'globex-again'), 'false', 'a repeat of globex''s effect is a no-op');
SELECT is((SELECT count(*)::integer FROM inbox.outbox WHERE effect_id = :'globex_id'), 2, 'two effects share the id, one per tenant');

-- ================================================================== the key a destination sees
SELECT is((SELECT count(DISTINCT c.idempotency_key)::integer
             FROM inbox.claim_effects('ot-d', 100, key_aware => true) c WHERE c.effect_id = :'globex_id'),
          2, 'the two effects go out under two keys');
SELECT results_eq($$SELECT o.consumer, o.tenant, o.effect_id, inbox.idempotency_key(o.consumer, o.tenant, o.effect_id) ~ '^ik_[0-9a-f]{64}$'
                     FROM inbox.outbox o WHERE o.key_scoped ORDER BY o.tenant, o.effect_id$$,
                  format($$VALUES ('ot-billing', 'acme', 'acme-own', true), ('ot-billing', 'acme', %L, true),
                                  ('ot-billing', 'globex', %L, true)$$, :'globex_id', :'globex_id'),
                  'effects enqueued since 0.3.0 are key-scoped: ik_ and 64 hex digits');
SELECT isnt(inbox.idempotency_key('a', '', 'bc'), inbox.idempotency_key('ab', '', 'c'),
            'idempotency_key: length-prefixed parts, (a, bc) and (ab, c) differ');
SELECT isnt(inbox.idempotency_key('crm', 'x', 'fx'), inbox.idempotency_key('billing', 'x', 'fx'),
            'idempotency_key: another consumer, another key');
SELECT is(inbox.idempotency_key('c', 't', 'fx'), inbox.idempotency_key('c', 't', 'fx'), 'idempotency_key: stable');
-- Two consumers sharing a destination, the same effect id: two keys (JetStream would have dropped one).
SET ROLE tap_ot_crm;
SELECT inbox.enqueue_effect('shared-id', 'ot-hook', '{"crm": 1}', consumer => 'ot-crm') \g /dev/null
RESET ROLE;
SET ROLE tap_ot_acme;
SELECT inbox.enqueue_effect('shared-id', 'ot-hook', '{"billing": 1}', consumer => 'ot-billing', tenant => 'acme') \g /dev/null
RESET ROLE;
SELECT is((SELECT count(DISTINCT c.idempotency_key)::integer
             FROM inbox.claim_effects('ot-d', 100, key_aware => true) c WHERE c.effect_id = 'shared-id'),
          2, 'two consumers, one effect id, one destination: two keys');
-- An effect enqueued before 0.3.0 keeps its bare id as key, and a dispatcher of that release (no
-- key_aware) gets only such effects.
INSERT INTO inbox.outbox (effect_id, destination, payload, consumer, key_scoped) VALUES ('legacy-1', 'ot-hook', '{}', '', false);
SELECT is((SELECT array_agg(c.effect_id || '=' || c.idempotency_key) FROM inbox.claim_effects('ot-old', 100) c),
          ARRAY['legacy-1=legacy-1'], 'a dispatcher without key_aware gets the legacy effect only, keyed by its id');

-- ================================================================== ordering keys per consumer and tenant
DELETE FROM inbox.outbox;
SET ROLE tap_ot_crm;
SELECT inbox.enqueue_effect('crm-later', 'ot-hook', '{}', ordering_key => 'customer-42', consumer => 'ot-crm',
                            available_at => now() + interval '29 days') \g /dev/null
RESET ROLE;
SET ROLE tap_ot_acme;
SELECT inbox.enqueue_effect('acme-now', 'ot-hook', '{}', ordering_key => 'customer-42', consumer => 'ot-billing',
                            tenant => 'acme') \g /dev/null
RESET ROLE;
SET CONSTRAINTS inbox.outbox_order_at_commit IMMEDIATE;
SELECT is((SELECT array_agg(c.effect_id) FROM inbox.claim_effects('ot-d', 10, key_aware => true) c), ARRAY['acme-now'],
          'another consumer''s effect with the same ordering key, due in 29 days, holds nothing back');
SELECT inbox.fail_effect('acme-now', (SELECT lease_token FROM inbox.outbox WHERE effect_id = 'acme-now'), 'boom',
                         retryable => false) \g /dev/null
SET ROLE tap_ot_globex;
SELECT inbox.enqueue_effect('globex-next', 'ot-hook', '{}', ordering_key => 'customer-42', consumer => 'ot-billing',
                            tenant => 'globex') \g /dev/null
RESET ROLE;
SET ROLE tap_ot_acme;
SELECT inbox.enqueue_effect('acme-next', 'ot-hook', '{}', ordering_key => 'customer-42', consumer => 'ot-billing',
                            tenant => 'acme') \g /dev/null
RESET ROLE;
SET CONSTRAINTS inbox.outbox_order_at_commit IMMEDIATE;
SELECT is((SELECT array_agg(c.effect_id) FROM inbox.claim_effects('ot-d', 10, key_aware => true) c), ARRAY['globex-next'],
          'a dead head blocks its own tenant''s key (acme-next waits), not another tenant''s');

-- ================================================================== available_at
SELECT inbox.enqueue_effect('old-date', 'ot-hook', '{}', consumer => 'ot-crm', available_at => '1900-01-01') \g /dev/null
SELECT is((SELECT available_at FROM inbox.outbox WHERE effect_id = 'old-date'), now(),
          'available_at 1900-01-01 is stored as now: it cannot jump ahead of effects already due');

-- ================================================================== redrive and discard name the tenant
SET ROLE tap_ot_globex;
SELECT inbox.enqueue_effect('acme-now', 'ot-hook', '{}', consumer => 'ot-billing', tenant => 'globex') \g /dev/null
RESET ROLE;
SELECT inbox.claim_effects('ot-d', 100, key_aware => true) \g /dev/null
SELECT inbox.fail_effect('acme-now', (SELECT lease_token FROM inbox.outbox WHERE effect_id = 'acme-now' AND tenant = 'globex'),
                         'boom', retryable => false) \g /dev/null
SELECT throws_ok($$SELECT inbox.redrive_effect('acme-now', 'retry')$$, 'P0003', NULL,
                 'redrive: an id two tenants hold needs the tenant (P0003)');
SELECT is((SELECT (tenant, status)::text FROM inbox.redrive_effect('acme-now', 'retry', 'ot-billing', 'globex')), '(globex,pending)',
          'redrive: the named tenant''s effect is redriven');
SELECT is((SELECT (consumer, tenant)::text FROM inbox.outbox_redrive WHERE effect_id = 'acme-now'), '(ot-billing,globex)',
          'redrive: audited with consumer and tenant');
SELECT is((SELECT status::text FROM inbox.outbox WHERE effect_id = 'acme-now' AND tenant = 'acme'), 'dead',
          'redrive: the other tenant''s effect stays dead');
SELECT is((SELECT (tenant, status)::text FROM inbox.discard_effect('acme-now', 'give up', 'ot-billing', 'acme')), '(acme,discarded)',
          'discard: the named tenant''s effect is discarded');
SELECT is((SELECT array_agg(c.effect_id) FROM inbox.claim_effects('ot-d', 10, key_aware => true) c
            WHERE c.effect_id = 'acme-next'), ARRAY['acme-next'],
          'discard: acme''s key moves on to its next effect');

SELECT * FROM finish();
ROLLBACK;
