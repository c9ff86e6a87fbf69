-- pgTAP: the routing layer (proxy/, project pginbox_proxy) in a proxy database: privileges and
-- hardening from the catalog, configure_shards' checks, the routing hash, tenant placements, and
-- an unreachable shard answering 08006. (Routing to real shards: tests/python/e2e/test_proxy.py.)
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(70);

-- ================================================================== catalog
SELECT set_eq($$SELECT p.proname::text COLLATE "default" FROM pg_catalog.pg_proc p
                 WHERE p.pronamespace = 'inbox'::regnamespace AND p.prosecdef$$,
              ARRAY['configure_shards', 'begin_tenant_move', 'place_tenant'],
              'exactly the operator''s configuration functions are SECURITY DEFINER: the routed calls run as the caller');
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace AND p.prosecdef
                     AND NOT 'search_path=pg_catalog, pg_temp' = ANY (coalesce(p.proconfig, '{}'))$$,
                'every SECURITY DEFINER function pins search_path = pg_catalog, pg_temp');
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace AND pg_catalog.has_function_privilege('public', p.oid, 'EXECUTE')$$,
                'no function in schema inbox is executable by PUBLIC');
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace AND p.proowner <> 'inbox_owner'::regrole$$,
                'every function in schema inbox is owned by inbox_owner');
SELECT is_empty($$SELECT c.oid::regclass::text FROM pg_catalog.pg_class c
                   WHERE c.relnamespace = 'inbox'::regnamespace AND c.relowner <> 'inbox_owner'::regrole$$,
                'every relation in schema inbox is owned by inbox_owner');
SELECT is_empty($$SELECT c.oid::regclass::text FROM pg_catalog.pg_class c
                   WHERE c.relnamespace = 'inbox'::regnamespace
                     AND EXISTS (SELECT 1 FROM aclexplode(c.relacl) a WHERE a.grantee = 0)$$,
                'PUBLIC has no privilege on any relation in schema inbox');
SELECT is_empty($$SELECT t.oid::regtype::text FROM pg_catalog.pg_type t
                   WHERE t.typnamespace = 'inbox'::regnamespace AND t.typowner <> 'inbox_owner'::regrole$$,
                'every type in schema inbox is owned by inbox_owner');
SELECT schema_owner_is('inbox', 'inbox_owner', 'schema inbox is owned by inbox_owner');
SELECT is((SELECT l.lanpltrusted FROM pg_catalog.pg_language l WHERE l.lanname = 'plproxy'), false,
          'plproxy stays untrusted: only superusers create functions that connect to the shards');
SELECT is_empty($$SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = 'inbox'::regnamespace
                     AND p.prolang NOT IN (SELECT oid FROM pg_catalog.pg_language WHERE lanname IN ('sql', 'plpgsql', 'plproxy'))$$,
                'every function in schema inbox is SQL, PL/pgSQL or PL/Proxy');
SELECT is(pg_catalog.has_schema_privilege('public', 'inbox', 'USAGE'), false, 'PUBLIC may not use schema inbox');

-- ================================================================== function privileges per role
SELECT function_privs_are('inbox', f.name, f.args, r.role,
                          CASE WHEN r.role = ANY (f.roles) THEN ARRAY['EXECUTE'] ELSE ARRAY[]::text[] END,
                          format('%s %s execute inbox.%s', r.role, CASE WHEN r.role = ANY (f.roles) THEN 'may' ELSE 'may not' END,
                                 f.name))
  FROM (VALUES
        ('claim_and_apply', ARRAY['text', 'text', 'text', 'text', 'jsonb', 'text', 'timestamp with time zone'],
         ARRAY['inbox_consumer']),
        ('claim_and_apply_batch', ARRAY['text', 'jsonb'], ARRAY['inbox_consumer']),
        ('record_start', ARRAY['text', 'text', 'text', 'text', 'text', 'jsonb', 'text', 'text'], ARRAY['inbox_consumer']),
        ('record_failure', ARRAY['text', 'text', 'text', 'jsonb', 'text', 'text', 'text', 'text', 'text', 'text'],
         ARRAY['inbox_consumer']),
        ('configure_shards', ARRAY['text[]'], ARRAY['inbox_operator']),
        ('begin_tenant_move', ARRAY['text', 'text'], ARRAY['inbox_operator']),
        ('place_tenant', ARRAY['text', 'integer', 'text'], ARRAY['inbox_operator']),
        ('metrics', ARRAY[]::text[], ARRAY['inbox_operator', 'inbox_reader']),
        ('shard_status', ARRAY[]::text[], ARRAY['inbox_operator', 'inbox_reader']),
        ('quarantine_entries', ARRAY['text', 'integer'], ARRAY['inbox_operator']),
        ('discard', ARRAY['text', 'bigint', 'text'], ARRAY['inbox_operator']),
        ('release', ARRAY['text', 'bigint', 'text'], ARRAY['inbox_operator']),
        ('repair', ARRAY['text', 'bigint', 'text'], ARRAY['inbox_operator'])) AS f(name, args, roles)
 CROSS JOIN (VALUES ('inbox_consumer'), ('inbox_operator'), ('inbox_reader')) AS r(role)
 WHERE (f.name, r.role) IN (('claim_and_apply', 'inbox_consumer'), ('claim_and_apply', 'inbox_reader'),
                            ('claim_and_apply_batch', 'inbox_consumer'), ('claim_and_apply_batch', 'inbox_operator'),
                            ('record_start', 'inbox_consumer'), ('record_failure', 'inbox_reader'),
                            ('configure_shards', 'inbox_operator'), ('configure_shards', 'inbox_consumer'),
                            ('configure_shards', 'inbox_reader'), ('begin_tenant_move', 'inbox_consumer'),
                            ('place_tenant', 'inbox_operator'), ('metrics', 'inbox_reader'),
                            ('metrics', 'inbox_consumer'), ('shard_status', 'inbox_reader'),
                            ('quarantine_entries', 'inbox_reader'), ('quarantine_entries', 'inbox_operator'),
                            ('discard', 'inbox_operator'), ('discard', 'inbox_reader'), ('release', 'inbox_consumer'),
                            ('repair', 'inbox_operator'))
 ORDER BY f.name, r.role;

-- ================================================================== routing hash
SELECT is(inbox.tenant_hash('acme'), pg_catalog.hashtext('acme'), 'tenant_hash is hashtext(tenant)');
SELECT is(inbox.tenant_hash(NULL), pg_catalog.hashtext(''), 'tenant_hash(NULL) is hashtext('''')');
SELECT is(inbox.partition_count(), 0, 'no partitions before configure_shards');

-- ================================================================== configure_shards
SELECT throws_ok($$SELECT inbox.configure_shards(ARRAY['dbname=a', 'dbname=b', 'dbname=c'])$$, '22023',
                 'inbox.configure_shards: the number of partitions must be a power of two from 1 to 1024, got 3',
                 'three partitions are refused');
SELECT throws_ok($$SELECT inbox.configure_shards('{}')$$, '22023', NULL, 'no partition is refused');
SELECT throws_ok($$SELECT inbox.configure_shards(NULL)$$, '22004', NULL, 'NULL is refused');
SELECT throws_ok($$SELECT inbox.configure_shards(ARRAY['dbname=a', ' user=postgres dbname=b'])$$, '22023',
                 'inbox.configure_shards: shard 1: the connection string must not name a user, password, passfile or service',
                 'a connection string naming a user is refused (everyone would act as it)');
SELECT throws_ok($$SELECT inbox.configure_shards(ARRAY['dbname=a PASSWORD=x'])$$, '22023', NULL,
                 'a password is refused');
SELECT throws_ok($$SELECT inbox.configure_shards(ARRAY['service=shards'])$$, '22023', NULL,
                 'a service (which may name a user) is refused');
SELECT throws_ok($$SELECT inbox.configure_shards(ARRAY['postgresql://u@h/db'])$$, '22023', NULL, 'a URI is refused');
SELECT throws_ok($$SELECT inbox.configure_shards(ARRAY['dbname=a', '  '])$$, '22023',
                 'inbox.configure_shards: shard 1 has no connection string', 'a blank connection string is refused');
SELECT is(pg_catalog.to_regclass('pg_catalog.pg_foreign_server') IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_foreign_server WHERE srvname = 'inbox_shards'), true,
          'nothing was created by the refused calls');

SELECT is(inbox.configure_shards(ARRAY['host=127.0.0.1 port=1 dbname=s0 connect_timeout=2',
                                       'host=127.0.0.1 port=1 dbname=s1 connect_timeout=2',
                                       'host=127.0.0.1 port=1 dbname=s0 connect_timeout=2',
                                       'host=127.0.0.1 port=1 dbname=s1 connect_timeout=2']),
          4, 'four partitions (two databases, each twice)');
SELECT is(inbox.partition_count(), 4, 'partition_count reads the cluster');
SELECT is((SELECT s.srvowner::regrole::text FROM pg_catalog.pg_foreign_server s WHERE s.srvname = 'inbox_shards'),
          'inbox_owner', 'the cluster inbox_shards is owned by inbox_owner');
SELECT is((SELECT (u.umuser, u.umoptions)::text FROM pg_catalog.pg_user_mapping u
             JOIN pg_catalog.pg_foreign_server s ON s.oid = u.umserver WHERE s.srvname = 'inbox_shards'),
          '(0,)', 'one user mapping, PUBLIC, without user or password: the shards see the caller''s role');
SELECT is(pg_catalog.has_server_privilege('public', 'inbox_shards', 'USAGE'), false, 'PUBLIC may not use the cluster');
SELECT is(pg_catalog.has_server_privilege('inbox_consumer', 'inbox_shards', 'USAGE'), true, 'consumers may use the cluster');
SELECT is(inbox.configure_shards(ARRAY['host=127.0.0.1 port=1 dbname=s0 connect_timeout=2',
                                       'host=127.0.0.1 port=1 dbname=s1 connect_timeout=2']),
          2, 'reconfigured: two partitions');
SELECT is((SELECT pg_catalog.array_to_string(s.srvoptions, ' | ') FROM pg_catalog.pg_foreign_server s
            WHERE s.srvname = 'inbox_shards'),
          'p0=host=127.0.0.1 port=1 dbname=s0 connect_timeout=2 | p1=host=127.0.0.1 port=1 dbname=s1 connect_timeout=2',
          'the old partitions are gone, the new ones in order');
SELECT is(inbox.shard_of('acme'), pg_catalog.hashtext('acme') & 1, 'shard_of is tenant_hash & (count - 1)');

-- ================================================================== an unreachable shard
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply('billing', 'shop', 'm-1', 'credit', '{}', 'acme')$$, '08006',
                 'inbox.claim_and_apply: the shard of tenant ''acme'' cannot be reached; retry later (the other shards'' tenants are unaffected)',
                 'a shard that cannot be reached is 08006, naming the tenant');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('billing',
                     '[{"producer": "shop", "message_id": "m-1", "message_type": "credit", "payload": {}, "tenant": "acme"}]')$$,
                 '08006', NULL, 'a batch for an unreachable shard is 08006');
SELECT throws_ok($$SELECT * FROM inbox.record_start('billing', 'shop', 'm-1', 'acme')$$, '08006', NULL,
                 'record_start too');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('billing', '{"a": 1}')$$, '22023', NULL,
                 'a batch that is not an array is refused on the proxy, before any shard is called');
SELECT throws_ok($$SELECT * FROM inbox.discard('acme', NULL, 'x')$$, '22004', NULL, 'a decision names its entry');

-- ================================================================== tenant placements
SELECT is(pg_catalog.hashtext('acme') & 1, 0, 'acme hashes to partition 0 (what follows relies on it)');
SELECT is(inbox.begin_tenant_move('acme', 'to partition 1'), 0, 'begin_tenant_move answers the partition the tenant is on');
SELECT throws_ok($$SELECT inbox.tenant_partition('acme')$$, '55P03',
                 'tenant ''acme'' is being moved between shards: retry later', 'a tenant being moved is held (55P03, retryable)');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply('billing', 'shop', 'm-1', 'credit', '{}', 'acme')$$, '55P03', NULL,
                 'its calls are held');
SELECT throws_ok($$SELECT * FROM inbox.claim_and_apply_batch('billing',
                     '[{"producer": "shop", "message_id": "m-1", "message_type": "credit", "payload": {}, "tenant": "zeta"},
                       {"producer": "shop", "message_id": "m-2", "message_type": "credit", "payload": {}, "tenant": "acme"}]')$$,
                 '55P03', 'tenant ''acme'' is being moved between shards: retry later',
                 'a batch holding one of its messages is held, naming it, before any shard is called');
SELECT throws_ok($$SELECT inbox.place_tenant('acme', 2, 'nowhere')$$, '22023', NULL, 'a partition that does not exist is refused');
SELECT is(inbox.place_tenant('acme', 1, 'moved'), 1, 'place_tenant routes it');
SELECT is(inbox.tenant_partition('acme'), 1, 'the placement wins over the hash');
SELECT is(inbox.shard_of('acme'), 1, 'shard_of says so too');
SELECT throws_ok($$SELECT inbox.configure_shards(ARRAY['dbname=a'])$$, '55000', NULL,
                 'shrinking below a placed tenant''s partition is refused');
SELECT throws_ok($$SELECT inbox.begin_tenant_move('acme', ' ')$$, '22023', NULL, 'a move needs a note');

-- ================================================================== unreachable classification
SELECT ok(inbox._shard_unreachable('XX000', 'PL/Proxy function inbox._route_claim_and_apply(7): [s1] PQconnectPoll: connection to server failed'),
          'a connection failure is unreachable');
SELECT ok(NOT inbox._shard_unreachable('XX000', 'inbox._route_claim_and_apply(7): [s1] REMOTE ERROR: could not connect to the ledger'),
          'an error the shard raised is the shard''s, whatever its text');

SELECT * FROM finish();
ROLLBACK;
