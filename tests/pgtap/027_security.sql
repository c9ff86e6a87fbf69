-- pgTAP: privileges and hardening of schema inbox, tested from the catalog and the way an attacker
-- would: as roles without grants, as a consumer, reader and operator, with shadowing objects on
-- the search_path and with a hostile handler name.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(348);

-- ================================================================== catalog meta-tests
SELECT set_eq($$SELECT p.proname::text COLLATE "default" FROM pg_catalog.pg_proc p
                 WHERE p.pronamespace = 'inbox'::regnamespace AND p.prosecdef$$,
              ARRAY['claim', 'claim_bytea', 'record_failure', 'record_start', 'configure_consumer', 'register_handler',
                    '_begin_apply', 'discard', 'release', 'repair', '_run_confined',
                    'enqueue_effect', 'claim_effects', 'complete_effect', 'fail_effect', 'extend_lease', 'dispatcher_idle',
                    'complete_effects', 'fail_effects', 'defer_effects',
                    'configure_destination', 'redrive_effect', 'discard_effect', 'purge_delivered_effects', '_order_at_commit',
                    'retention_window', 'set_retention_policy', 'purge_lock', 'purge_unlock',
                    'announce_purge', 'purge_batch', 'correct_watermark',
                    'metrics', 'metrics_rollup', 'configure_metrics',
                    'create_replay_plan', 'add_replay_items', 'accept_replay_version', 'cancel_replay_plan',
                    'run_replay_plan',
                    'bind_consumer', 'unbind_consumer', 'configure_security',
                    'bind_destination', 'unbind_destination', '_generate_dispatcher', '_begin_apply_batch', '_unclaim',
                    'grant_repair', 'begin_granted_repair', 'granted_repair_failed', 'commit_durable', 'wait_durable',
                    'create_python_replay_plan', 'begin_python_replay_item', 'python_replay_item_failed',
                    'kafka_acquire', 'kafka_store_offsets', 'kafka_release', 'kafka_reset_offsets'],
              'exactly the expected functions in schema inbox are SECURITY DEFINER');
SELECT is_empty($$SELECT p.oid::regprocedure::text, p.proconfig::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace AND p.prosecdef
                     AND NOT EXISTS (
                         SELECT 1 FROM unnest(p.proconfig) c
                          WHERE c LIKE 'search\_path=%'
                            AND (string_to_array(replace(substr(c, 13), ' ', ''), ','))[1] = 'pg_catalog'
                            AND (string_to_array(replace(substr(c, 13), ' ', ''), ','))[
                                    cardinality(string_to_array(replace(substr(c, 13), ' ', ''), ','))] = 'pg_temp')$$,
                'every SECURITY DEFINER function in inbox pins search_path, starting with pg_catalog and ending with pg_temp');
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace
                     AND (p.proacl IS NULL
                          OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) a WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'))$$,
                'no function in schema inbox is executable by PUBLIC (no NULL = default ACL, no PUBLIC grant)');
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace AND pg_catalog.has_function_privilege('public', p.oid, 'EXECUTE')$$,
                'has_function_privilege(public, ...) is false for every function in schema inbox');
SELECT is_empty($$SELECT c.oid::regclass::text FROM pg_catalog.pg_class c
                   WHERE c.relnamespace = 'inbox'::regnamespace
                     AND EXISTS (SELECT 1 FROM aclexplode(c.relacl) a WHERE a.grantee = 0)$$,
                'PUBLIC has no privilege on any relation in schema inbox');
SELECT is_empty($$SELECT c.oid::regclass::text, c.relkind FROM pg_catalog.pg_class c
                   WHERE c.relnamespace = 'inbox'::regnamespace AND c.relowner <> 'inbox_owner'::regrole$$,
                'every relation (tables, indexes, sequences) in schema inbox is owned by inbox_owner');
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace AND p.proowner <> 'inbox_owner'::regrole
                     AND p.oid <> 'inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context)'::regprocedure
                     AND p.oid <> 'inbox.commit_durable(pg_lsn, integer, text, text[])'::regprocedure
                     AND p.oid <> 'inbox.wait_durable(pg_lsn, integer, text, text[], interval)'::regprocedure$$,
                'every function in schema inbox is owned by inbox_owner, but the confined runner of operator decisions '
                'and the two that read the standbys'' positions');
SELECT set_eq($$SELECT p.oid::regprocedure::text COLLATE "default" FROM pg_catalog.pg_proc p
                 WHERE p.pronamespace = 'inbox'::regnamespace AND p.proowner = 'inbox_monitor'::regrole$$,
              ARRAY['inbox.commit_durable(pg_lsn,integer,text,text[])',
                    'inbox.wait_durable(pg_lsn,integer,text,text[],interval)'],
              'inbox_monitor (pg_read_all_stats) owns exactly inbox.commit_durable and inbox.wait_durable');
SELECT ok(NOT pg_catalog.pg_has_role('inbox_owner', 'pg_read_all_stats', 'USAGE'),
          'inbox_owner cannot read other sessions'' statistics (pg_read_all_stats is inbox_monitor''s alone)');
SELECT is((SELECT (p.proowner::regrole::text, p.prosecdef)::text FROM pg_catalog.pg_proc p
            WHERE p.oid = 'inbox._run_confined(regprocedure, boolean, jsonb, inbox.message_context)'::regprocedure),
          '(inbox_runner,t)', 'inbox._run_confined is SECURITY DEFINER owned by inbox_runner (no rights)');
SELECT is_empty($$SELECT t.oid::regtype::text FROM pg_catalog.pg_type t
                   WHERE t.typnamespace = 'inbox'::regnamespace AND t.typowner <> 'inbox_owner'::regrole$$,
                'every type in schema inbox is owned by inbox_owner');
SELECT schema_owner_is('inbox', 'inbox_owner', 'schema inbox is owned by inbox_owner');
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace AND p.prolang NOT IN
                         (SELECT oid FROM pg_catalog.pg_language WHERE lanname IN ('sql', 'plpgsql'))$$,
                'every function in schema inbox is SQL or PL/pgSQL');

-- Default privileges: a function inbox_owner creates later is not executable by PUBLIC either.
SET LOCAL ROLE inbox_owner;
CREATE FUNCTION inbox.tap_probe() RETURNS integer LANGUAGE sql AS 'SELECT 1';
RESET ROLE;
SELECT is(pg_catalog.has_function_privilege('public', 'inbox.tap_probe()', 'EXECUTE'), false,
          'default privileges: a new function by inbox_owner is not executable by PUBLIC');
DROP FUNCTION inbox.tap_probe();

-- ================================================================== function privileges per role
SELECT function_privs_are('inbox', f.name, f.args, r.role,
                          CASE WHEN r.role = ANY (f.roles) THEN ARRAY['EXECUTE'] ELSE ARRAY[]::text[] END,
                          format('%s %s execute inbox.%s', r.role, CASE WHEN r.role = ANY (f.roles) THEN 'may' ELSE 'may not' END,
                                 f.name))
  FROM (VALUES
        ('claim', ARRAY['text', 'text', 'text', 'jsonb', 'text', 'text', 'timestamptz'], ARRAY['inbox_consumer'], 1),
        ('claim_bytea', ARRAY['text', 'text', 'text', 'bytea', 'text', 'text', 'timestamptz'], ARRAY['inbox_consumer'], 2),
        ('claim_and_apply', ARRAY['text', 'text', 'text', 'text', 'jsonb', 'text', 'timestamptz'], ARRAY['inbox_consumer'], 3),
        ('claim_and_apply_batch', ARRAY['text', 'jsonb'], ARRAY['inbox_consumer'], 4),
        ('record_start', ARRAY['text', 'text', 'text', 'text', 'text', 'jsonb', 'text', 'text'], ARRAY['inbox_consumer'], 5),
        ('record_failure', ARRAY['text', 'text', 'text', 'jsonb', 'text', 'text', 'text', 'text', 'text', 'text'], ARRAY['inbox_consumer'], 6),
        ('register_handler', ARRAY['text', 'text', 'regprocedure', 'text'], ARRAY['inbox_operator'], 7),
        ('configure_consumer', ARRAY['text', 'text[]', 'integer', 'boolean', 'integer', 'boolean'], ARRAY['inbox_operator'], 8),
        ('repair', ARRAY['bigint', 'text'], ARRAY['inbox_operator'], 9),
        ('discard', ARRAY['bigint', 'text'], ARRAY['inbox_operator'], 10),
        ('release', ARRAY['bigint', 'text'], ARRAY['inbox_operator'], 11),
        ('enqueue_effect', ARRAY['text', 'text', 'jsonb', 'jsonb', 'text', 'timestamptz', 'text', 'text'], ARRAY['inbox_consumer'], 12),
        ('effect_id', ARRAY['text', 'text', 'text', 'text', 'text'], ARRAY['inbox_consumer'], 13),
        ('claim_effects', ARRAY['text', 'integer', 'interval', 'boolean'], ARRAY['inbox_dispatcher'], 14),
        ('complete_effect', ARRAY['text', 'bigint', 'integer', 'text', 'integer'], ARRAY['inbox_dispatcher'], 15),
        ('fail_effect', ARRAY['text', 'bigint', 'text', 'boolean', 'integer', 'text', 'integer'], ARRAY['inbox_dispatcher'], 16),
        ('extend_lease', ARRAY['text', 'bigint', 'interval'], ARRAY['inbox_dispatcher'], 17),
        ('dispatcher_idle', ARRAY['text', 'boolean'], ARRAY['inbox_dispatcher'], 18),
        ('purge_delivered_effects', ARRAY['interval', 'integer'], ARRAY['inbox_dispatcher', 'inbox_operator'], 19),
        ('configure_destination', ARRAY['text', 'integer', 'interval', 'interval'], ARRAY['inbox_operator'], 20),
        ('redrive_effect', ARRAY['text', 'text', 'text', 'text'], ARRAY['inbox_operator'], 21),
        ('_order_at_commit', ARRAY[]::text[], ARRAY[]::text[], 22),
        ('discard_effect', ARRAY['text', 'text', 'text', 'text'], ARRAY['inbox_operator'], 24),
        ('complete_effects', ARRAY['text[]', 'bigint[]', 'integer[]', 'text[]', 'integer[]'], ARRAY['inbox_dispatcher'], 25),
        ('fail_effects', ARRAY['text[]', 'bigint[]', 'text[]', 'boolean[]', 'integer[]', 'text[]', 'integer[]'],
         ARRAY['inbox_dispatcher'], 26),
        ('bind_destination', ARRAY['text', 'text', 'text'], ARRAY['inbox_operator'], 27),
        ('unbind_destination', ARRAY['text', 'text', 'text'], ARRAY['inbox_operator'], 28),
        ('idempotency_key', ARRAY['text', 'text', 'text'],
         ARRAY['inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_dispatcher'], 29),
        ('correct_watermark', ARRAY['text', 'text', 'timestamptz', 'text'], ARRAY['inbox_operator'], 30),
        ('_run_for_operator', ARRAY['text', 'text', 'text', 'oid', 'regprocedure', 'boolean', 'jsonb', 'inbox.message_context'],
         ARRAY[]::text[], 31),
        ('_run_confined', ARRAY['regprocedure', 'boolean', 'jsonb', 'inbox.message_context'], ARRAY[]::text[], 32),
        ('commit_durable', ARRAY['pg_lsn', 'integer', 'text', 'text[]'],
         ARRAY['inbox_consumer', 'inbox_operator', 'inbox_dispatcher'], 33),
        ('wait_durable', ARRAY['pg_lsn', 'integer', 'text', 'text[]', 'interval'],
         ARRAY['inbox_consumer', 'inbox_operator', 'inbox_dispatcher'], 34),
        ('defer_effects', ARRAY['text[]', 'bigint[]', 'text[]', 'text[]', 'interval'], ARRAY['inbox_dispatcher'], 35),
        ('kafka_acquire', ARRAY['text', 'text[]', 'integer[]', 'text'], ARRAY['inbox_consumer'], 36),
        ('kafka_store_offsets', ARRAY['text', 'text[]', 'integer[]', 'bigint[]', 'bigint[]'], ARRAY['inbox_consumer'], 37),
        ('kafka_release', ARRAY['text', 'text[]', 'integer[]', 'bigint[]'], ARRAY['inbox_consumer'], 38),
        ('kafka_reset_offsets', ARRAY['text', 'text', 'bigint', 'integer[]'], ARRAY['inbox_operator'], 39)
       ) AS f(name, args, roles, ord)
 CROSS JOIN (VALUES ('inbox_consumer', 1), ('inbox_operator', 2), ('inbox_reader', 3), ('inbox_dispatcher', 4)) AS r(role, ord)
 ORDER BY f.ord, r.ord;

-- The complete set each role can execute, internal helpers included.
SELECT set_eq(format($$SELECT p.proname::text COLLATE "default" FROM pg_catalog.pg_proc p
                        WHERE p.pronamespace = 'inbox'::regnamespace
                          AND pg_catalog.has_function_privilege(%L, p.oid, 'EXECUTE')$$, r.role),
              r.expected, format('%s can execute exactly: %s', r.role, array_to_string(r.expected, ', ')))
  FROM (VALUES
        ('inbox_consumer', ARRAY['claim', 'claim_bytea', 'claim_and_apply', 'claim_and_apply_batch', 'claim_batch', 'record_start',
                                 'record_failure', '_begin_apply', '_check_identity', '_check_message_type',
                                 '_identity_ok', '_identity_problem', '_message_type_ok', '_message_type_problem',
                                 '_name_ok', '_raise_problem',
                                 '_reason_code', 'payload_hash', 'schema_version', 'schema_release', 'enqueue_effect',
                                 'effect_id',
                                 '_check_text', 'versioned_consumer', '_is_transient',
                                 '_run_handler', '_run_handler_batch', '_blank', '_begin_apply_batch', '_unclaim',
                                 'idempotency_key', '_has_control', 'begin_granted_repair', 'granted_repair_failed', 'commit_durable', 'wait_durable',
                                 'begin_python_replay_item', 'python_replay_item_failed',
                                 'kafka_acquire', 'kafka_store_offsets', 'kafka_release'], 1),
        ('inbox_operator', ARRAY['register_handler', 'configure_consumer', 'repair', 'discard', 'release',
                                 '_reason_code', 'payload_hash', 'idempotency_key', '_has_control', 'correct_watermark',
                                 'schema_version', 'schema_release', 'configure_destination', 'redrive_effect',
                                 'discard_effect',
                                 'purge_delivered_effects', 'retention_window', '_retention_window', '_active_cutoff',
                                 'set_retention_policy', 'purge_lock', 'purge_unlock', 'announce_purge', 'purge_batch',
                                 'purge', 'metrics', 'metrics_rollup', 'configure_metrics',
                                 'create_replay_plan', 'add_replay_items', 'accept_replay_version',
                                 'cancel_replay_plan', 'run_replay_plan',
                                 'versioned_consumer', 'replay_operation_id', '_is_transient', '_run_handler', '_blank',
                                 '_check_purge_call', '_announced', '_announced_detail', 'bind_consumer',
                                 'unbind_consumer', 'configure_security', 'bind_destination',
                                 'unbind_destination', 'grant_repair', 'commit_durable', 'wait_durable',
                                 'create_python_replay_plan', 'kafka_reset_offsets'], 2),
        ('inbox_reader', ARRAY['schema_version', 'schema_release', 'retention_window', '_retention_window',
                               '_active_cutoff', 'metrics', 'versioned_consumer', 'replay_operation_id',
                               'idempotency_key'], 3),
        ('inbox_dispatcher', ARRAY['claim_effects', 'complete_effect', 'fail_effect', 'extend_lease', 'dispatcher_idle',
                                   'complete_effects', 'fail_effects', 'defer_effects', 'purge_delivered_effects',
                                   'schema_version', 'schema_release', 'idempotency_key', 'commit_durable',
                                   'wait_durable'], 4)
       ) AS r(role, expected, ord)
 ORDER BY r.ord;

-- ================================================================== table privileges per role
SELECT table_privs_are('inbox', t, r, ARRAY[]::text[], r || ' has no privilege on inbox.' || t)
  FROM unnest(ARRAY['message', 'attempt', 'quarantine', 'quarantine_decision', 'consumer_config', 'handler',
                    'handler_registration', 'outbox', 'outbox_destination', 'outbox_redrive', 'outbox_fenced_report',
                    'outbox_waiter', 'outbox_discard']) t
 CROSS JOIN unnest(ARRAY['inbox_consumer', 'inbox_dispatcher']) r;
SELECT table_privs_are('inbox', t, 'inbox_reader', ARRAY['SELECT'], 'inbox_reader may only SELECT inbox.' || t)
  FROM unnest(ARRAY['consumer_config', 'handler', 'handler_registration',
                    'outbox_destination', 'outbox_fenced_report', 'outbox_waiter']) t;
SELECT table_privs_are('inbox', t, 'inbox_operator', ARRAY['SELECT'], 'inbox_operator may only SELECT inbox.' || t)
  FROM unnest(ARRAY['message', 'attempt', 'quarantine', 'quarantine_decision', 'consumer_config', 'handler',
                    'handler_registration', 'outbox', 'outbox_destination', 'outbox_redrive', 'outbox_fenced_report',
                    'outbox_waiter', 'outbox_discard']) t;
SELECT table_privs_are('inbox', 'outbox', 'inbox_reader', ARRAY[]::text[],
                       'inbox_reader has no table-wide privilege on inbox.outbox (column grants only)');
SELECT column_privs_are('inbox', 'outbox', c, 'inbox_reader', ARRAY[]::text[], 'inbox_reader cannot read inbox.outbox.' || c)
  FROM unnest(ARRAY['payload', 'headers', 'last_response_excerpt']) c;
-- Why an effect waits without spending attempts (issue 26): a reason code and counts, for readers too.
SELECT column_privs_are('inbox', 'outbox', c, 'inbox_reader', ARRAY['SELECT'], 'inbox_reader can read inbox.outbox.' || c)
  FROM unnest(ARRAY['deferred_reason', 'deferred_at', 'deferrals']) c;
SELECT table_privs_are('inbox', 'quarantine', 'inbox_reader', ARRAY[]::text[],
                       'inbox_reader has no table-wide privilege on inbox.quarantine (column grants only)');
SELECT column_privs_are('inbox', 'quarantine', c, 'inbox_reader', ARRAY[]::text[],
                        'inbox_reader cannot read inbox.quarantine.' || c)
  FROM unnest(ARRAY['payload', 'payload_bytes', 'payload_sha256']) c;
SELECT column_privs_are('inbox', 'quarantine', c, 'inbox_reader', ARRAY['SELECT'],
                        'inbox_reader can read inbox.quarantine.' || c)
  FROM unnest(ARRAY['quarantine_id', 'consumer', 'message_id', 'kind', 'payload_ref', 'reason_code',
                    'status']) c;
-- Readers see reason codes and counts, not error texts or payload hashes (0.2.0).
SELECT column_privs_are('inbox', x.t, x.c, 'inbox_reader', ARRAY[]::text[],
                        'inbox_reader cannot read inbox.' || x.t || '.' || x.c)
  FROM (VALUES ('quarantine', 'payload_sha256'), ('quarantine', 'stored_sha256'), ('quarantine', 'error_message'),
               ('message', 'payload_sha256'), ('attempt', 'error_message'), ('attempt', 'payload_sha256'),
               ('quarantine_decision', 'error_message')) AS x(t, c);
SELECT table_privs_are('inbox', t, 'inbox_reader', ARRAY[]::text[],
                       'inbox_reader has no table-wide privilege on inbox.' || t || ' (column grants only)')
  FROM unnest(ARRAY['message', 'attempt', 'quarantine_decision', 'outbox_redrive', 'outbox_discard']) t;
SELECT is_empty($$SELECT c.oid::regclass::text FROM pg_catalog.pg_class c
                   WHERE c.relnamespace = 'inbox'::regnamespace AND c.relkind = 'S'
                     AND (pg_catalog.has_sequence_privilege('inbox_consumer', c.oid, 'USAGE, UPDATE, SELECT')
                          OR pg_catalog.has_sequence_privilege('inbox_operator', c.oid, 'USAGE, UPDATE, SELECT')
                          OR pg_catalog.has_sequence_privilege('inbox_reader', c.oid, 'USAGE, UPDATE, SELECT')
                          OR pg_catalog.has_sequence_privilege('inbox_dispatcher', c.oid, 'USAGE, UPDATE, SELECT'))$$,
                'no working role may use the sequences (identities, fencing tokens, commit order)');

-- ================================================================== test roles and a small domain
CREATE ROLE tap_sec_nobody NOLOGIN;
CREATE ROLE tap_sec_stranger NOLOGIN;
GRANT USAGE ON SCHEMA inbox TO tap_sec_stranger;   -- may see the schema, has no other grant
CREATE ROLE tap_sec_consumer NOLOGIN IN ROLE inbox_consumer;
CREATE ROLE tap_sec_operator NOLOGIN IN ROLE inbox_operator;
CREATE ROLE tap_sec_reader NOLOGIN IN ROLE inbox_reader;

CREATE SCHEMA tapsec;
GRANT USAGE ON SCHEMA tapsec TO tap_sec_consumer, tap_sec_operator;
CREATE TABLE tapsec.who (role_name text, via text);
GRANT INSERT, SELECT ON tapsec.who TO tap_sec_consumer, tap_sec_operator;
CREATE FUNCTION tapsec.whoami(payload jsonb) RETURNS void LANGUAGE sql
    AS $$INSERT INTO tapsec.who VALUES (current_user, payload ->> 'via')$$;
CREATE FUNCTION tapsec.peek(payload jsonb) RETURNS void LANGUAGE plpgsql
    AS $$BEGIN PERFORM count(*) FROM inbox.message; END$$;
-- A hostile handler name: quotes, a semicolon and a comment in both schema and function name.
CREATE SCHEMA "we""ird";
GRANT USAGE ON SCHEMA "we""ird" TO tap_sec_consumer, tap_sec_operator;
CREATE FUNCTION "we""ird"."x; DROP TABLE account; --"(payload jsonb) RETURNS void LANGUAGE sql
    AS $$INSERT INTO tapsec.who VALUES (current_user, 'hostile')$$;
CREATE TABLE public.account (id integer);   -- what the name would drop if it were spliced into SQL
GRANT SELECT ON public.account TO PUBLIC;

-- The consumer role is bound to the consumers it acts as (0.3.0: the effective role, SET ROLE
-- included, is the caller).
SELECT inbox.bind_consumer(c, 'tap_sec_consumer', note => 'pgTAP') FROM unnest(ARRAY['tap-sec', 'tap-sec-r', 'tap-shadow']) c \g /dev/null

-- Results collected under SET ROLE / a hostile search_path, checked afterwards.
CREATE TEMP TABLE sec_res (step text PRIMARY KEY, LIKE inbox.delivery_result);
GRANT ALL ON sec_res TO PUBLIC;
CREATE TEMP TABLE sec_err (step text PRIMARY KEY, sqlstate text);
GRANT ALL ON sec_err TO PUBLIC;

-- ================================================================== roles without grants
SET ROLE tap_sec_nobody;
SELECT throws_ok(c.sql, '42501', 'permission denied for schema inbox',
                 'a role without grants cannot call inbox.' || c.fn || ' (no USAGE on schema inbox)')
  FROM (VALUES
        (1, 'claim', $$SELECT inbox.claim('c', 'p', 'm', '{}')$$),
        (2, 'claim_bytea', $$SELECT inbox.claim_bytea('c', 'p', 'm', '\x00')$$),
        (3, 'claim_and_apply', $$SELECT inbox.claim_and_apply('c', 'p', 'm', 't', '{}')$$),
        (4, 'claim_and_apply_batch', $$SELECT * FROM inbox.claim_and_apply_batch('c', '[]')$$),
        (5, 'record_start', $$SELECT inbox.record_start('c', 'p', 'm')$$),
        (6, 'record_failure', $$SELECT inbox.record_failure('c', 'p', 'm', '{}', 'X1')$$),
        (7, 'configure_consumer', $$SELECT inbox.configure_consumer('c')$$),
        (8, 'register_handler', $$SELECT inbox.register_handler('c', 't', NULL::regprocedure, 'v1')$$),
        (9, 'repair', $$SELECT inbox.repair(1, 'n')$$),
        (10, 'discard', $$SELECT inbox.discard(1, 'n')$$),
        (11, 'release', $$SELECT inbox.release(1, 'n')$$),
        (12, 'payload_hash', $$SELECT inbox.payload_hash('{}')$$),
        (13, 'schema_version', $$SELECT inbox.schema_version()$$)
       ) AS c(ord, fn, sql)
 ORDER BY c.ord;
SELECT throws_ok($$SELECT * FROM inbox.message$$, '42501', 'permission denied for schema inbox',
                 'a role without grants cannot read inbox.message');
RESET ROLE;

SET ROLE tap_sec_stranger;
SELECT throws_ok(c.sql, '42501', 'permission denied for function ' || c.fn,
                 'a role with only USAGE on schema inbox cannot call inbox.' || c.fn)
  FROM (VALUES
        (1, 'claim', $$SELECT inbox.claim('c', 'p', 'm', '{}')$$),
        (2, 'claim_bytea', $$SELECT inbox.claim_bytea('c', 'p', 'm', '\x00')$$),
        (3, 'claim_and_apply', $$SELECT inbox.claim_and_apply('c', 'p', 'm', 't', '{}')$$),
        (4, 'claim_and_apply_batch', $$SELECT * FROM inbox.claim_and_apply_batch('c', '[]')$$),
        (5, 'record_start', $$SELECT inbox.record_start('c', 'p', 'm')$$),
        (6, 'record_failure', $$SELECT inbox.record_failure('c', 'p', 'm', '{}', 'X1')$$),
        (7, 'configure_consumer', $$SELECT inbox.configure_consumer('c')$$),
        (8, 'register_handler', $$SELECT inbox.register_handler('c', 't', NULL::regprocedure, 'v1')$$),
        (9, 'repair', $$SELECT inbox.repair(1, 'n')$$),
        (10, 'discard', $$SELECT inbox.discard(1, 'n')$$),
        (11, 'release', $$SELECT inbox.release(1, 'n')$$),
        (12, 'payload_hash', $$SELECT inbox.payload_hash('{}')$$),
        (13, 'schema_version', $$SELECT inbox.schema_version()$$),
        (14, '_begin_apply', $$SELECT inbox._begin_apply('c', 'p', 'm', 't', '{}', '', NULL)$$),
        (15, '_claim_core', $$SELECT inbox._claim_core('c', '', 'p', 'm', '\x00', 'v', NULL, '{}', NULL, true)$$)
       ) AS c(ord, fn, sql)
 ORDER BY c.ord;
SELECT throws_ok($$SELECT * FROM inbox.message$$, '42501', 'permission denied for table message',
                 'a role with only USAGE on schema inbox cannot read inbox.message');
RESET ROLE;

-- ================================================================== operator sets up (as the operator role)
SET ROLE tap_sec_operator;
SELECT lives_ok($$SELECT inbox.register_handler('tap-sec', 'whoami', 'tapsec.whoami(jsonb)', 'w1');
                  SELECT inbox.register_handler('tap-sec', 'peek', 'tapsec.peek(jsonb)', 'p1');
                  SELECT inbox.register_handler('tap-sec', 'hostile', '"we""ird"."x; DROP TABLE account; --"(jsonb)', 'h1');
                  SELECT inbox.configure_consumer('tap-sec-r', max_attempts => 1);
                  SELECT inbox.register_handler('tap-sec-r', 'thing', 'tapsec.peek(jsonb)', 'p1')$$,
                'operator: registers handlers (one with a hostile name) and configures consumers');
RESET ROLE;
SELECT is((SELECT handler::text FROM inbox.handler WHERE consumer = 'tap-sec' AND message_type = 'hostile'),
          '"we""ird"."x; DROP TABLE account; --"(jsonb)', 'the hostile handler is stored as its regprocedure');
SELECT is((SELECT registered_by FROM inbox.handler_registration WHERE consumer = 'tap-sec' AND message_type = 'whoami'),
          session_user::text, 'registered_by is the session user');

-- ================================================================== the consumer
SET ROLE tap_sec_consumer;
INSERT INTO sec_res SELECT 'claim', c.* FROM inbox.claim('tap-sec', 'p', 'c1', '{"a": 1}') c;
INSERT INTO sec_res SELECT 'whoami', c.* FROM inbox.claim_and_apply('tap-sec', 'p', 'w1', 'whoami', '{"via": "claim_and_apply"}') c;
INSERT INTO sec_res SELECT 'peek', c.* FROM inbox.claim_and_apply('tap-sec', 'p', 'k1', 'peek', '{}') c;
INSERT INTO sec_res SELECT 'hostile', c.* FROM inbox.claim_and_apply('tap-sec', 'p', 'h1', 'hostile', '{}') c;
INSERT INTO sec_res SELECT 'to-repair', c.* FROM inbox.claim_and_apply('tap-sec-r', 'p', 'r1', 'thing', '{"via": "repair"}') c;
INSERT INTO sec_res SELECT 'batch', b.outcome, b.payload_sha256, b.stored_sha256, b.handler_version, b.processed_at,
                           b.quarantine_id, b.attempts, b.reason_code, b.error_message
  FROM inbox.claim_and_apply_batch('tap-sec', '[{"producer": "p", "message_id": "b1", "message_type": "whoami",
                                                "payload": {"via": "batch"}}]') b;
SELECT throws_ok($$SELECT * FROM inbox.message$$, '42501', 'permission denied for table message',
                 'consumer: cannot SELECT inbox.message');
SELECT throws_ok($$INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version)
                   VALUES ('tap-sec', '', 'p', 'forged', '\x00', 'v')$$, '42501', 'permission denied for table message',
                 'consumer: cannot INSERT into inbox.message');
SELECT throws_ok($$DELETE FROM inbox.message$$, '42501', 'permission denied for table message',
                 'consumer: cannot DELETE from inbox.message');
SELECT throws_ok($$UPDATE inbox.message SET status = 'processed'$$, '42501', 'permission denied for table message',
                 'consumer: cannot UPDATE inbox.message');
SELECT throws_ok($$SELECT payload FROM inbox.quarantine$$, '42501', 'permission denied for table quarantine',
                 'consumer: cannot read quarantine payloads');
SELECT throws_ok($$DELETE FROM inbox.attempt$$, '42501', 'permission denied for table attempt',
                 'consumer: cannot reset its attempt counters');
SELECT throws_ok(c.sql, '42501', 'permission denied for function ' || c.fn, 'consumer: cannot call inbox.' || c.fn)
  FROM (VALUES
        (1, 'register_handler', $$SELECT inbox.register_handler('tap-sec', 'x', 'tapsec.whoami(jsonb)', 'v9')$$),
        (2, 'configure_consumer', $$SELECT inbox.configure_consumer('tap-sec', max_payload_bytes => 104857600)$$),
        (3, 'discard', $$SELECT inbox.discard(1, 'n')$$),
        (4, 'release', $$SELECT inbox.release(1, 'n')$$),
        (5, 'repair', $$SELECT inbox.repair(1, 'n')$$),
        (6, '_begin_repair', $$SELECT inbox._begin_repair(1, 'n')$$),
        (7, '_repair_failed', $$SELECT inbox._repair_failed(1, 'n', 'X', 'e')$$),
        (8, '_claim_core', $$SELECT inbox._claim_core('c', '', 'p', 'm', '\x00', 'v', NULL, '{}', NULL, true)$$),
        (9, '_settings', $$SELECT inbox._settings('c')$$),
        (10, '_quarantine_failure', $$SELECT inbox._quarantine_failure(NULL::inbox.attempt, 'X', 'e', 0, '{}', NULL, true)$$),
        (11, '_lock_open_entry', $$SELECT inbox._lock_open_entry('f', 1, 'n')$$),
        (12, '_settle_hold', $$SELECT inbox._settle_hold('f', NULL::inbox.quarantine, 'v')$$)
       ) AS c(ord, fn, sql)
 ORDER BY c.ord;
RESET ROLE;

SELECT is((SELECT (outcome, handler_version)::text FROM sec_res WHERE step = 'claim'), '(claimed,unversioned)',
          'consumer: can claim');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'tap-sec' AND message_id = 'c1'), 1,
          'consumer: the claim row exists');
SELECT is((SELECT outcome FROM sec_res WHERE step = 'whoami'), 'applied', 'consumer: can claim_and_apply');
SELECT results_eq($$SELECT role_name COLLATE "default", via COLLATE "default" FROM tapsec.who ORDER BY via$$,
                  $$VALUES ('tap_sec_consumer', 'batch'), ('tap_sec_consumer', 'claim_and_apply'), ('tap_sec_consumer', 'hostile')$$,
                  'handlers run with the caller''s rights (current_user is the consumer, not inbox_owner)');
SELECT is((SELECT (outcome, reason_code, error_message)::text FROM sec_res WHERE step = 'peek'),
          '(failed,42501,"permission denied for table message")',
          'a handler cannot read the inbox tables: it has the consumer''s rights only');
SELECT is((SELECT outcome FROM sec_res WHERE step = 'hostile'), 'applied', 'the hostile handler name runs safely');
SELECT has_table('public', 'account', 'the hostile handler name dropped nothing');
SELECT is((SELECT outcome FROM sec_res WHERE step = 'batch'), 'applied', 'consumer: can claim_and_apply_batch');
SELECT is((SELECT outcome FROM sec_res WHERE step = 'to-repair'), 'quarantined',
          'consumer: a failure at max_attempts 1 is quarantined');

-- The hostile handler also runs safely for a superuser (who could drop public.account).
SELECT is((SELECT outcome FROM inbox.claim_and_apply('tap-sec', 'p', 'h2', 'hostile', '{}')), 'applied',
          'the hostile handler name runs safely as superuser');
SELECT has_table('public', 'account', 'the hostile handler name still dropped nothing');
-- Hostile consumer and message type strings are plain data.
SELECT lives_ok($$SELECT inbox.register_handler('''; DROP TABLE account; --', '"); DROP TABLE account; --',
                                                'tapsec.whoami(jsonb)', 'v1')$$,
                'a hostile consumer name and message type register as data');
SELECT is((SELECT outcome FROM inbox.claim_and_apply('''; DROP TABLE account; --', '$$;--', 'x''y', '"); DROP TABLE account; --',
                                                     '{"via": "hostile-names"}')), 'applied',
          'a hostile consumer name, producer, message id and message type are plain data');
SELECT throws_ok($$SELECT inbox.claim_and_apply('''; DROP TABLE account; --', 'p', 'm', 'nope''; --', '{}')$$, '42704',
                 'inbox.claim_and_apply: no handler registered for consumer ''''''; DROP TABLE account; --'' and message type ''nope''''; --''',
                 'error messages quote hostile names as literals');
SELECT has_table('public', 'account', 'hostile names dropped nothing');

-- ================================================================== the reader
SET ROLE tap_sec_reader;
SELECT lives_ok($$SELECT consumer, message_id, status FROM inbox.message$$, 'reader: can SELECT inbox.message');
SELECT lives_ok($$SELECT consumer, message_id, started, failed, reason_code FROM inbox.attempt;
                   SELECT decision_id, decision, result, note, reason_code FROM inbox.quarantine_decision;
                   SELECT * FROM inbox.handler$$,
                'reader: can SELECT attempts, decisions and handlers (without error texts)');
SELECT lives_ok($$SELECT quarantine_id, kind, reason_code, status, deliveries FROM inbox.quarantine$$,
                'reader: can SELECT the non-payload columns of inbox.quarantine');
SELECT throws_ok($$SELECT payload FROM inbox.quarantine$$, '42501', 'permission denied for table quarantine',
                 'reader: cannot SELECT inbox.quarantine.payload');
SELECT throws_ok($$SELECT payload_bytes FROM inbox.quarantine$$, '42501', 'permission denied for table quarantine',
                 'reader: cannot SELECT inbox.quarantine.payload_bytes');
SELECT throws_ok($$SELECT * FROM inbox.quarantine$$, '42501', 'permission denied for table quarantine',
                 'reader: cannot SELECT * FROM inbox.quarantine');
SELECT throws_ok($$SELECT inbox.claim('tap-sec', 'p', 'reader', '{}')$$, '42501', 'permission denied for function claim',
                 'reader: cannot claim');
SELECT throws_ok($$SELECT inbox.discard(1, 'n')$$, '42501', 'permission denied for function discard',
                 'reader: cannot discard');
SELECT throws_ok($$DELETE FROM inbox.message$$, '42501', 'permission denied for table message',
                 'reader: cannot DELETE from inbox.message');
SELECT is(inbox.schema_version(), 3, 'reader: can check schema_version()');
RESET ROLE;

-- ================================================================== the operator
SET ROLE tap_sec_operator;
SELECT is((SELECT q.payload FROM inbox.quarantine q WHERE q.consumer = 'tap-sec-r' AND q.message_id = 'r1'),
          '{"via": "repair"}'::jsonb, 'operator: can read quarantine payloads');
SELECT throws_ok($$SELECT inbox.claim('tap-sec', 'p', 'operator', '{}')$$, '42501', 'permission denied for function claim',
                 'operator: is not a consumer (cannot claim)');
SELECT throws_ok($$SELECT inbox.claim_and_apply('tap-sec', 'p', 'operator', 'whoami', '{}')$$, '42501',
                 'permission denied for function claim_and_apply', 'operator: cannot claim_and_apply');
SELECT throws_ok($$UPDATE inbox.quarantine SET status = 'recovered'$$, '42501', 'permission denied for table quarantine',
                 'operator: cannot close an entry behind the API''s back');
SELECT throws_ok($$DELETE FROM inbox.quarantine_decision$$, '42501', 'permission denied for table quarantine_decision',
                 'operator: cannot delete the audit trail');
SELECT throws_ok($$INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version)
                   VALUES ('tap-sec', '', 'p', 'forged', '\x00', 'v')$$, '42501', 'permission denied for table message',
                 'operator: cannot INSERT into inbox.message');
-- repair runs the handler only with the rights of a role bound to the consumer: a SECURITY INVOKER
-- handler is refused (it would run with the rights of whoever calls it).
SELECT lives_ok($$SELECT inbox.register_handler('tap-sec-r', 'thing', 'tapsec.whoami(jsonb)', 'w2')$$,
                'operator: registers the fixed handler');
SELECT throws_ok($$SELECT inbox.repair((SELECT q.quarantine_id FROM inbox.quarantine q
                                         WHERE q.consumer = 'tap-sec-r' AND q.message_id = 'r1'), 'fixed')$$,
                 '42501', 'inbox.repair: handler tapsec.whoami(jsonb) would run with more rights than consumer ''tap-sec-r'' has',
                 'operator: repair refuses a SECURITY INVOKER handler');
RESET ROLE;
-- The consumer's own handler: SECURITY DEFINER, owned by its role; inbox_runner calls it.
CREATE FUNCTION tapsec.whoami_own(payload jsonb) RETURNS void LANGUAGE sql SECURITY DEFINER SET search_path = tapsec, pg_temp
    AS $$INSERT INTO tapsec.who VALUES (current_user, payload ->> 'via')$$;
ALTER FUNCTION tapsec.whoami_own(jsonb) OWNER TO tap_sec_consumer;
GRANT USAGE ON SCHEMA tapsec TO inbox_runner;
SET ROLE tap_sec_operator;
SELECT lives_ok($$SELECT inbox.register_handler('tap-sec-r', 'thing', 'tapsec.whoami_own(jsonb)', 'w3')$$,
                'operator: registers the consumer''s own handler');
INSERT INTO sec_res SELECT 'repair', r.* FROM inbox.repair(
    (SELECT q.quarantine_id FROM inbox.quarantine q WHERE q.consumer = 'tap-sec-r' AND q.message_id = 'r1'), 'fixed') r;
RESET ROLE;
SELECT is((SELECT (outcome, handler_version)::text FROM sec_res WHERE step = 'repair'), '(applied,w3)', 'operator: can repair');
SELECT is((SELECT role_name FROM tapsec.who WHERE via = 'repair'), 'tap_sec_consumer',
          'repair runs the handler with the consumer''s rights, not the operator''s nor the owner''s');
SELECT is((SELECT d.decided_by FROM inbox.quarantine_decision d JOIN inbox.quarantine q USING (quarantine_id)
            WHERE q.consumer = 'tap-sec-r'), session_user::text,
          'the audit row names the session user (SET ROLE does not hide who decided)');

-- ================================================================== shadowing
-- The consumer plants look-alikes in its own schema (first on its search_path, ahead of
-- pg_catalog, and open to everybody, inbox_owner included, like a writable public schema) and in
-- pg_temp; the definer functions must keep using the real objects.
CREATE SCHEMA tap_shadow AUTHORIZATION tap_sec_consumer;
-- Runs one call under the caller's (hostile) search_path; records its result or its SQLSTATE.
CREATE FUNCTION pg_temp.shadow_try(step text, sql text) RETURNS void LANGUAGE plpgsql AS $f$
BEGIN
    EXECUTE pg_catalog.format('INSERT INTO pg_temp.sec_res SELECT %L, c.* FROM (%s) c', step, sql);
EXCEPTION WHEN OTHERS THEN
    INSERT INTO pg_temp.sec_err VALUES (step, SQLSTATE);
END
$f$;
SET ROLE tap_sec_consumer;
GRANT USAGE ON SCHEMA tap_shadow TO PUBLIC;
CREATE FUNCTION tap_shadow.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$SELECT '\x00'::bytea$$;
CREATE FUNCTION tap_shadow.encode(bytea, text) RETURNS text LANGUAGE sql AS $$SELECT 'shadow'$$;
CREATE FUNCTION tap_shadow.convert_to(text, name) RETURNS bytea LANGUAGE sql AS $$SELECT '\x00'::bytea$$;
CREATE FUNCTION tap_shadow.octet_length(bytea) RETURNS integer LANGUAGE sql AS $$SELECT 0$$;
CREATE FUNCTION tap_shadow.octet_length(text) RETURNS integer LANGUAGE sql AS $$SELECT 0$$;
CREATE FUNCTION tap_shadow.pg_column_size(jsonb) RETURNS integer LANGUAGE sql AS $$SELECT 0$$;
CREATE FUNCTION tap_shadow.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql AS $$SELECT 'array'$$;
CREATE FUNCTION tap_shadow.now() RETURNS timestamptz LANGUAGE sql AS $$SELECT '2000-01-01 00:00:00+00'::timestamptz$$;
CREATE FUNCTION tap_shadow.session_user() RETURNS text LANGUAGE sql AS $$SELECT 'shadow'$$;
CREATE FUNCTION tap_shadow.always(bytea, bytea) RETURNS boolean LANGUAGE sql AS $$SELECT true$$;
CREATE OPERATOR tap_shadow.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = tap_shadow.always);
CREATE FUNCTION tap_shadow.always(text, text) RETURNS boolean LANGUAGE sql AS $$SELECT true$$;
CREATE OPERATOR tap_shadow.= (LEFTARG = text, RIGHTARG = text, FUNCTION = tap_shadow.always);
CREATE FUNCTION tap_shadow.never(integer, integer) RETURNS boolean LANGUAGE sql AS $$SELECT false$$;
CREATE OPERATOR tap_shadow.> (LEFTARG = integer, RIGHTARG = integer, FUNCTION = tap_shadow.never);
CREATE TABLE tap_shadow.message (consumer text, tenant text, producer text, message_id text);
CREATE TEMP TABLE message (consumer text, tenant text, producer text, message_id text);
CREATE TEMP TABLE consumer_config (consumer text);
CREATE FUNCTION pg_temp.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$SELECT '\x00'::bytea$$;
CREATE FUNCTION pg_temp.payload_hash(jsonb, text[]) RETURNS bytea LANGUAGE sql AS $$SELECT '\x00'::bytea$$;
SET search_path = tap_shadow, pg_temp, pg_catalog, public;
-- No pgTAP calls here: pgTAP itself would resolve "=" to the planted operator.
SELECT pg_temp.shadow_try('shadow-1', $$SELECT * FROM inbox.claim('tap-shadow', 'p', 's1', '{"a": 1}')$$);
SELECT pg_temp.shadow_try('shadow-2', $$SELECT * FROM inbox.claim('tap-shadow', 'p', 's1', '{"a": 1}')$$);
SELECT pg_temp.shadow_try('shadow-3', $$SELECT * FROM inbox.claim('tap-shadow', 'p', 's1', '{"a": 2}')$$);
SELECT pg_temp.shadow_try('shadow-bytea', $$SELECT * FROM inbox.claim_bytea('tap-shadow', 'p', 'sb', '\x0102'::bytea)$$);
SELECT pg_temp.shadow_try('shadow-big-bytea',
                          $$SELECT * FROM inbox.claim_bytea('tap-shadow', 'p', 'big', decode(repeat('00', 1048577), 'hex'))$$);
SELECT pg_temp.shadow_try('shadow-big-json',
                          $$SELECT * FROM inbox.claim('tap-shadow', 'p', 'big', jsonb_build_object('k', repeat('x', 1048576)))$$);
SELECT pg_temp.shadow_try('shadow-empty-id', $$SELECT * FROM inbox.claim('tap-shadow', 'p', '', '{}')$$);
SELECT pg_temp.shadow_try('shadow-record-failure',
                          $$SELECT * FROM inbox.record_failure('tap-shadow', 'p', 's1', '{"a": 1}', 'X1')$$);
RESET search_path;
RESET ROLE;

SELECT is_empty($$SELECT * FROM sec_err WHERE step NOT IN ('shadow-big-bytea', 'shadow-big-json', 'shadow-empty-id')$$,
                'shadowing: the valid calls under the hostile search_path raised nothing');
SELECT is((SELECT (outcome, payload_sha256)::text FROM sec_res WHERE step = 'shadow-1'),
          ('claimed', pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to('{"a": 1}', 'UTF8')), 'hex'))::text,
          'shadowing: claim still hashes with the real sha256, convert_to and encode');
SELECT is((SELECT outcome FROM sec_res WHERE step = 'shadow-2'), 'duplicate', 'shadowing: a redelivery is still a duplicate');
SELECT is((SELECT outcome FROM sec_res WHERE step = 'shadow-3'), 'conflict',
          'shadowing: a changed payload is still a conflict (a planted bytea "=" did not make it a duplicate)');
SELECT is((SELECT processed_at FROM sec_res WHERE step = 'shadow-1'), now(), 'shadowing: claim uses the real now()');
SELECT is((SELECT payload_sha256 FROM sec_res WHERE step = 'shadow-bytea'),
          pg_catalog.encode(pg_catalog.sha256('\x0102'::bytea), 'hex'), 'shadowing: claim_bytea uses the real sha256');
SELECT is((SELECT sqlstate FROM sec_err WHERE step = 'shadow-big-bytea'), '54000',
          'shadowing: a planted octet_length does not lift the claim_bytea size limit');
SELECT is((SELECT sqlstate FROM sec_err WHERE step = 'shadow-big-json'), '54000',
          'shadowing: a planted pg_column_size does not lift the claim size limit');
SELECT is((SELECT sqlstate FROM sec_err WHERE step = 'shadow-empty-id'), '22023',
          'shadowing: a planted text "=" does not bypass identity validation');
SELECT is((SELECT (outcome, attempts, payload_sha256)::text FROM sec_res WHERE step = 'shadow-record-failure'),
          ('failed', 1, pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to('{"a": 1}', 'UTF8')), 'hex'))::text,
          'shadowing: record_failure counts and hashes with the real objects');
SELECT is((SELECT count(*)::integer FROM inbox.message WHERE consumer = 'tap-shadow'), 2,
          'shadowing: the claims went to inbox.message');
SELECT is((SELECT count(*)::integer FROM pg_temp.message), 0, 'shadowing: nothing went to the planted temp table');
SELECT is((SELECT count(*)::integer FROM tap_shadow.message), 0, 'shadowing: nothing went to the planted schema''s table');
SELECT is((SELECT payload_sha256 FROM inbox.message WHERE consumer = 'tap-shadow' AND message_id = 's1'),
          pg_catalog.sha256(pg_catalog.convert_to('{"a": 1}', 'UTF8')), 'shadowing: the stored hash is the real one');

SELECT * FROM finish();
ROLLBACK;
