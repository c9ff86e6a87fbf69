-- pgTAP: static analysis of every PL/pgSQL function in schema inbox with plpgsql_check
-- (errors, extra, performance and security warnings). One test per function, plus one overall.
-- A trigger function is checked against the table its trigger fires on (plpgsql_check needs it).
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(3 + (SELECT count(*)::integer FROM pg_catalog.pg_proc p
                  WHERE p.pronamespace = 'inbox'::regnamespace
                    AND p.prolang = (SELECT oid FROM pg_catalog.pg_language WHERE lanname = 'plpgsql')));

SELECT has_extension('plpgsql_check', 'plpgsql_check is installed');
SELECT set_has($$SELECT p.proname::text COLLATE "default" FROM pg_catalog.pg_proc p
                  WHERE p.pronamespace = 'inbox'::regnamespace
                    AND p.prolang = (SELECT oid FROM pg_catalog.pg_language WHERE lanname = 'plpgsql')$$,
               $$SELECT unnest(ARRAY['claim', 'claim_bytea', 'claim_and_apply', 'claim_and_apply_batch', 'record_start',
                                     'record_failure', 'configure_consumer', 'register_handler', 'repair', 'discard',
                                     'release'])$$,
               'the public API functions are PL/pgSQL, so they are among those checked');

SELECT is_empty(format($$SELECT c.lineno, c.sqlstate, c.message, c.detail, c.hint, c.level, c.context
                          FROM plpgsql_check_function_tb(%s::oid, %s::oid, extra_warnings => true,
                                                          performance_warnings => true, security_warnings => true) c$$,
                       p.oid, coalesce((SELECT min(t.tgrelid::oid) FROM pg_catalog.pg_trigger t WHERE t.tgfoid = p.oid), 0)),
                format('plpgsql_check finds nothing in %s', p.oid::regprocedure))
  FROM pg_catalog.pg_proc p
 WHERE p.pronamespace = 'inbox'::regnamespace
   AND p.prolang = (SELECT oid FROM pg_catalog.pg_language WHERE lanname = 'plpgsql')
 ORDER BY p.oid::regprocedure::text;

SELECT is_empty($$SELECT p.oid::regprocedure::text, c.lineno, c.level, c.message
                   FROM pg_catalog.pg_proc p,
                        LATERAL plpgsql_check_function_tb(
                            p.oid, coalesce((SELECT min(t.tgrelid::oid) FROM pg_catalog.pg_trigger t WHERE t.tgfoid = p.oid), 0),
                            extra_warnings => true, performance_warnings => true, security_warnings => true) c
                  WHERE p.pronamespace = 'inbox'::regnamespace
                    AND p.prolang = (SELECT oid FROM pg_catalog.pg_language WHERE lanname = 'plpgsql')$$,
                'plpgsql_check finds nothing in any PL/pgSQL function of schema inbox');

SELECT * FROM finish();
ROLLBACK;
