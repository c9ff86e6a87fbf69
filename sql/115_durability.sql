-- pginbox: is a commit on the standbys? (issue 24, docs/failover.md). A broker message must be acked
-- only once its transaction survives a failover: with an asynchronous standby, COMMIT returning on
-- the primary is not enough. These functions read the standbys' reported positions
-- (pg_stat_replication) for callers that need no monitoring privileges of their own:
--
--   inbox.commit_durable(lsn, min_standbys, mode, standby_names)           -> boolean, at once
--   inbox.wait_durable(lsn, min_standbys, mode, standby_names, timeout)    -> boolean, polls until
--                                                                              true or the timeout
-- mode 'flush': the standby wrote and flushed the WAL (it survives the standby's crash and its
-- promotion); 'apply': the standby also replayed it (readers of the standby see it).
-- standby_names: application_name of the standbys that count (NULL: any physical standby).
--
-- Which position: call them AFTER COMMIT, on any session (they refuse to run inside a transaction
-- that wrote). lsn NULL (the default) means pg_current_wal_lsn(), the primary's WAL write position:
-- COMMIT returns only after the commit record was flushed (synchronous_commit local or above, the
-- default `on`), so that position is at or past the END of the commit record, of every transaction
-- whose COMMIT returned before the call. When the calling session runs synchronous_commit = off,
-- COMMIT returns before its record is written: lsn NULL then means pg_current_wal_insert_lsn()
-- (moved back from a page header to the page boundary, where the last record ended). An explicit
-- lsn must be read the same way after COMMIT; an lsn read before COMMIT is before the commit
-- record and proves nothing.
--
-- Reading the standbys' positions takes pg_read_all_stats, which also shows every session's query
-- text: the schema owner does not get it. The two functions are owned by inbox_monitor, a NOLOGIN
-- role (cluster-wide, created when missing, nobody is made a member of it) that holds
-- pg_read_all_stats (granted below when the deploying role may grant it; else a NOTICE, and the
-- functions answer 42501 with the GRANT to run), USAGE on schema inbox and EXECUTE on the two
-- internal helpers, nothing else. Logical replication senders do not count.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;

DO $role$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'inbox_monitor') THEN
        CREATE ROLE inbox_monitor NOLOGIN;
    END IF;
    IF (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = current_user)
       OR pg_catalog.pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER WITH ADMIN OPTION') THEN
        GRANT pg_read_all_stats TO inbox_monitor;
    ELSE
        RAISE NOTICE 'pginbox: % may not grant pg_read_all_stats: inbox.commit_durable and inbox.wait_durable '
                     'answer 42501 until it is granted', current_user
            USING HINT = 'As a superuser (or a role holding pg_read_all_stats WITH ADMIN OPTION): '
                         'GRANT pg_read_all_stats TO inbox_monitor;';
    END IF;
END
$role$;
GRANT USAGE ON SCHEMA inbox TO inbox_monitor;

SET LOCAL ROLE inbox_owner;

-- The position to wait for, after the arguments were checked. Raises before anything is read.
CREATE OR REPLACE FUNCTION inbox._durable_target(lsn pg_lsn, min_standbys integer, mode text, standby_names text[])
    RETURNS pg_lsn
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    target pg_lsn;
    pos numeric;
    page integer := pg_catalog.current_setting('wal_block_size')::integer;
    segment bigint := pg_catalog.pg_size_bytes(pg_catalog.current_setting('wal_segment_size'));
BEGIN
    IF min_standbys IS NULL OR min_standbys < 1 OR min_standbys > 64 THEN
        RAISE EXCEPTION 'pginbox: min_standbys must be between 1 and 64, not %', coalesce(min_standbys::text, 'NULL')
            USING ERRCODE = '22023', HINT = 'Pass how many standbys must have the commit (1 for "any standby").';
    END IF;
    IF mode IS NULL OR mode NOT IN ('flush', 'apply') THEN
        RAISE EXCEPTION 'pginbox: durability mode must be ''flush'' or ''apply'', not %', coalesce(pg_catalog.quote_literal(mode), 'NULL')
            USING ERRCODE = '22023',
                  HINT = '''flush'': the standby flushed the WAL (survives its promotion); ''apply'': it also replayed it.';
    END IF;
    IF standby_names IS NOT NULL AND (pg_catalog.cardinality(standby_names) = 0
            OR EXISTS (SELECT 1 FROM unnest(standby_names) n WHERE n IS NULL OR pg_catalog.btrim(n) = '')) THEN
        RAISE EXCEPTION 'pginbox: standby_names must name standbys (their application_name), or be NULL for any standby'
            USING ERRCODE = '22023', HINT = 'Pass NULL, or an array of non-blank application names.';
    END IF;
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION 'pginbox: the durability of a commit is asked after its COMMIT, not inside a transaction that wrote'
            USING ERRCODE = '25001',
                  HINT = 'COMMIT first, then call inbox.commit_durable / inbox.wait_durable (in autocommit mode).';
    END IF;
    IF pg_catalog.pg_is_in_recovery() THEN
        RAISE EXCEPTION 'pginbox: this server is a standby: the durability of a commit is asked on the primary'
            USING ERRCODE = '25006', HINT = 'Connect to the primary (libpq: target_session_attrs=read-write).';
    END IF;
    IF NOT pg_catalog.pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') THEN
        RAISE EXCEPTION 'pginbox: % cannot read the standbys'' positions (pg_stat_replication)', current_user
            USING ERRCODE = '42501', HINT = 'As a superuser: GRANT pg_read_all_stats TO inbox_monitor;';
    END IF;
    IF lsn IS NOT NULL THEN
        RETURN lsn;
    END IF;
    IF pg_catalog.current_setting('synchronous_commit') <> 'off' THEN
        RETURN pg_catalog.pg_current_wal_lsn();
    END IF;
    -- The insert position of an empty page points past its header: the last record ended at the
    -- page boundary, and a standby that flushed everything stops there.
    target := pg_catalog.pg_current_wal_insert_lsn();
    pos := target - '0/0'::pg_lsn;
    IF pos % segment = 40 THEN
        RETURN target - 40::numeric;
    ELSIF pos % page = 24 THEN
        RETURN target - 24::numeric;
    END IF;
    RETURN target;
END
$$;
COMMENT ON FUNCTION inbox._durable_target(pg_lsn, integer, text, text[]) IS
    'Internal: checks the arguments of commit_durable / wait_durable and returns the WAL position to wait for';

-- How many physical standbys report the position (flushed or replayed).
CREATE OR REPLACE FUNCTION inbox._durable_count(target pg_lsn, mode text, standby_names text[])
    RETURNS integer
    LANGUAGE sql VOLATILE
    SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT pg_catalog.count(*)::integer
      FROM pg_catalog.pg_stat_replication r
     WHERE CASE mode WHEN 'apply' THEN r.replay_lsn ELSE r.flush_lsn END OPERATOR(pg_catalog.>=) target
       AND (standby_names IS NULL OR r.application_name OPERATOR(pg_catalog.=) ANY (standby_names))
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots s
                        WHERE s.active_pid OPERATOR(pg_catalog.=) r.pid AND s.slot_type OPERATOR(pg_catalog.=) 'logical');
END;
COMMENT ON FUNCTION inbox._durable_count(pg_lsn, text, text[]) IS
    'Internal: the physical standbys whose reported flush (or replay) position is at or past target';

RESET ROLE;
DO $own$
BEGIN
    IF pg_catalog.to_regprocedure('inbox.commit_durable(pg_lsn, integer, text, text[])') IS NOT NULL THEN
        ALTER FUNCTION inbox.commit_durable(pg_lsn, integer, text, text[]) OWNER TO inbox_owner;
    END IF;
    IF pg_catalog.to_regprocedure('inbox.wait_durable(pg_lsn, integer, text, text[], interval)') IS NOT NULL THEN
        ALTER FUNCTION inbox.wait_durable(pg_lsn, integer, text, text[], interval) OWNER TO inbox_owner;
    END IF;
END
$own$;
SET LOCAL ROLE inbox_owner;

CREATE OR REPLACE FUNCTION inbox.commit_durable(lsn pg_lsn DEFAULT NULL, min_standbys integer DEFAULT 1,
                                                mode text DEFAULT 'flush', standby_names text[] DEFAULT NULL)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    target pg_lsn := inbox._durable_target(lsn, min_standbys, mode, standby_names);
BEGIN
    PERFORM pg_catalog.pg_stat_clear_snapshot();
    RETURN inbox._durable_count(target, mode, standby_names) >= min_standbys;
END
$$;
COMMENT ON FUNCTION inbox.commit_durable(pg_lsn, integer, text, text[]) IS
    'True when at least min_standbys standbys (of standby_names, NULL: any) report the WAL position lsn flushed '
    '(mode flush) or replayed (mode apply); lsn NULL: every commit that returned before this call. Call after COMMIT.';

CREATE OR REPLACE FUNCTION inbox.wait_durable(lsn pg_lsn DEFAULT NULL, min_standbys integer DEFAULT 1,
                                              mode text DEFAULT 'flush', standby_names text[] DEFAULT NULL,
                                              timeout interval DEFAULT '10 seconds')
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    target pg_lsn := inbox._durable_target(lsn, min_standbys, mode, standby_names);
    deadline timestamptz;
    nap double precision := 0.0005::double precision;
BEGIN
    IF timeout IS NULL OR timeout < interval '0' OR timeout > interval '1 hour' THEN
        RAISE EXCEPTION 'pginbox: the durability timeout must be between 0 and 1 hour, not %', coalesce(timeout::text, 'NULL')
            USING ERRCODE = '22023', HINT = 'A wait that times out returns false: hand the message back, never ack it.';
    END IF;
    deadline := pg_catalog.clock_timestamp() + timeout;
    LOOP
        PERFORM pg_catalog.pg_stat_clear_snapshot();  -- the standbys' current positions, not the first read's
        IF inbox._durable_count(target, mode, standby_names) >= min_standbys THEN
            RETURN true;
        END IF;
        EXIT WHEN pg_catalog.clock_timestamp() >= deadline;
        PERFORM pg_catalog.pg_sleep(least(nap, greatest(extract(epoch FROM deadline - pg_catalog.clock_timestamp())::double precision,
                                                      0::double precision)));
        nap := least(nap * 2::double precision, 0.02::double precision);
    END LOOP;
    RETURN false;
END
$$;
COMMENT ON FUNCTION inbox.wait_durable(pg_lsn, integer, text, text[], interval) IS
    'Waits (polling every 0.5 to 20 ms) until inbox.commit_durable(lsn, min_standbys, mode, standby_names) is true, '
    'or returns false at the timeout: then do not ack. Call after COMMIT.';

REVOKE ALL ON FUNCTION inbox._durable_target(pg_lsn, integer, text, text[]),
                       inbox._durable_count(pg_lsn, text, text[]),
                       inbox.commit_durable(pg_lsn, integer, text, text[]),
                       inbox.wait_durable(pg_lsn, integer, text, text[], interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.commit_durable(pg_lsn, integer, text, text[]),
                          inbox.wait_durable(pg_lsn, integer, text, text[], interval)
    TO inbox_consumer, inbox_operator, inbox_dispatcher;
GRANT EXECUTE ON FUNCTION inbox._durable_target(pg_lsn, integer, text, text[]),
                          inbox._durable_count(pg_lsn, text, text[])
    TO inbox_monitor;

-- Owned by inbox_monitor (above): to replace them, the deployer takes them back first.
RESET ROLE;
ALTER FUNCTION inbox.commit_durable(pg_lsn, integer, text, text[]) OWNER TO inbox_monitor;
ALTER FUNCTION inbox.wait_durable(pg_lsn, integer, text, text[], interval) OWNER TO inbox_monitor;

COMMIT;
