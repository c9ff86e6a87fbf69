-- pgTAP: no caller's search_path can change what an inbox function decides.
-- SECURITY DEFINER functions pin their search_path (027_security.sql). A SECURITY INVOKER function
-- that some role may call runs with that caller's search_path, and a schema ahead of pg_catalog can
-- shadow an operator (a `text <> text` that turns a duplicate into 'claimed'). So each of them pins
-- its own search_path, or names every operator with its schema (OPERATOR(pg_catalog.=)): the ones
-- that call handlers (which resolve their own names with the caller's path) and the inlined
-- hot-path helpers (a SET clause would stop the planner inlining them). Functions no role but the
-- owner may execute run only inside the pinned definer functions, so they are left out.
-- The scan is lexical: comments, string literals and quoted identifiers are removed first; then
-- any operator character, IN (...), BETWEEN, LIKE, IS DISTINCT FROM or a simple CASE is a finding.
\set QUIET 1
\pset format unaligned
\pset tuples_only true
\pset pager off
SET client_min_messages = warning;

BEGIN;
SELECT plan(3);

CREATE FUNCTION pg_temp.unqualified_operators(src text) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    s text := src;
BEGIN
    s := regexp_replace(s, '/\*.*?\*/', ' ', 'gs');
    s := regexp_replace(s, '--[^\n]*', ' ', 'g');
    s := regexp_replace(s, '[Ee]''(?:[^''\\]|\\.|'''')*''', ' ', 'g');
    s := regexp_replace(s, '''(?:[^'']|'''')*''', ' ', 'g');
    s := regexp_replace(s, '"(?:[^"]|"")*"', ' ', 'g');
    s := regexp_replace(s, 'OPERATOR\s*\(\s*pg_catalog\.[^)]+\)', ' ', 'gi');
    -- Syntax that is not an operator: assignment, named arguments, casts, ranges, %TYPE, stars.
    s := regexp_replace(s, ':=|=>|::|\.\.|%(ROW)?TYPE', ' ', 'gi');
    s := regexp_replace(s, '\mGET\s+(STACKED\s+)?DIAGNOSTICS[^;]*;', ' ', 'gi');
    s := regexp_replace(s, '\m(ERRCODE|MESSAGE|DETAIL|HINT|COLUMN|CONSTRAINT|DATATYPE|TABLE|SCHEMA)\s*=', ' ', 'gi');
    s := regexp_replace(s, '\(\s*\*\s*\)|\.\*|\m(SELECT|RETURNING)\s+\*', ' ', 'gi');
    RETURN ARRAY(SELECT DISTINCT m[1] FROM regexp_matches(s,
        '([-+*/<>=~!@#%^&|`?]+|\mIN\s*\(|\mBETWEEN\M|\m(I)?LIKE\M|\mSIMILAR\M|\mIS\s+(NOT\s+)?DISTINCT\M|\mCASE\s+(?!WHEN\M)\w+)',
        'gi') m ORDER BY 1);
END
$$;

-- The scanner finds what it must (a test that cannot fail is a defect).
SELECT is(pg_temp.unqualified_operators($q$
    -- a comment with = and <>
    IF x OPERATOR(pg_catalog.<>) 'a = b' AND y := 1 THEN SELECT count(*), t.* FROM t; END IF;
    GET STACKED DIAGNOSTICS e = RETURNED_SQLSTATE; RAISE EXCEPTION 'x' USING ERRCODE = 'y', HINT = 'z';
    IF a <> b OR c IN (1, 2) OR d BETWEEN 1 AND 2 OR e LIKE 'x' OR f IS DISTINCT FROM g THEN
        RETURN CASE h WHEN 1 THEN -1 END;
    END IF;$q$),
    ARRAY['-', '<>', 'BETWEEN', 'CASE h', 'IN (', 'IS DISTINCT', 'LIKE'],
    'the scanner: qualified operators, comments, literals and syntax pass; the rest is found');

CREATE TEMP TABLE invoker_functions AS
SELECT p.oid::regprocedure::text AS fn, pg_temp.unqualified_operators(p.prosrc) AS found
  FROM pg_catalog.pg_proc p
 WHERE p.pronamespace = 'inbox'::regnamespace
   AND NOT p.prosecdef
   AND NOT EXISTS (SELECT 1 FROM unnest(coalesce(p.proconfig, '{}')) c WHERE c LIKE 'search\_path=%')
   AND EXISTS (SELECT 1 FROM unnest(ARRAY['inbox_consumer', 'inbox_operator', 'inbox_reader', 'inbox_dispatcher']) r
                WHERE pg_catalog.has_function_privilege(r, p.oid, 'EXECUTE'));

SELECT ok((SELECT count(*) FROM invoker_functions) >= 5,
          'there are invoker functions callable by roles to check (claim_and_apply, repair, purge, ...)');
SELECT is(ARRAY(SELECT fn || ': ' || array_to_string(found, ' ') FROM invoker_functions
                 WHERE cardinality(found) > 0 ORDER BY fn),
          '{}'::text[],
          'every invoker function callable by a role pins its search_path or schema-qualifies every operator');

SELECT * FROM finish();
ROLLBACK;
