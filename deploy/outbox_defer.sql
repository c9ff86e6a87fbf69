-- Deploy pginbox:outbox_defer: written from sql/126_outbox_defer.sql by python/tools/sync_deploy.py, never by hand,
-- and frozen once a tag releases it (sqitch.lock).
-- pginbox: deferring an effect without spending an attempt; the columns are in
-- 125_outbox_defer_tables.sql.
-- A deployment-order incident is not a failed delivery: the dispatcher has no transport configured
-- for the destination yet, or the broker cannot route the message yet (RabbitMQ answers
-- unroutable until the consuming service declares its queue; JetStream has no stream for the
-- subject). Reported as failures, such effects went dead after max_attempts (about 7.5 minutes
-- with the defaults). inbox.defer_effects hands them back instead: pending again after
-- retry_after, the attempt the claim counted given back, the reason recorded (deferred_reason, a
-- code readers may see; the text in last_error) so that `pginbox outbox list`, `pginbox doctor`
-- and the dispatcher's metrics show them.
-- Trust boundary: as fail_effects, only the role that claimed the lease (outbox.lease_role), with
-- the lease's token, may defer it; granted to inbox_dispatcher only.
BEGIN;

SET LOCAL search_path = pg_catalog, pg_temp;
SET LOCAL ROLE inbox_owner;

CREATE OR REPLACE FUNCTION inbox.defer_effects(effect_ids text[], lease_tokens bigint[], reasons text[],
                                               errors text[], retry_after interval DEFAULT '30 seconds')
    RETURNS TABLE (ord integer, effect_id text, lease_token bigint, result text, fenced_reason text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    ROWS 10
AS $$
DECLARE
    fn CONSTANT text := 'inbox.defer_effects';
    bad integer;
    accepted integer[];
    outcomes text[];
    holder oid := (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = inbox._caller());  -- the lease's role
BEGIN
    -- effect_ids, lease_tokens and errors as fail_effects checks them (arrays, lengths, each report).
    PERFORM inbox._check_reports(fn, true, defer_effects.effect_ids, defer_effects.lease_tokens, NULL, NULL, NULL,
                                 defer_effects.errors,
                                 pg_catalog.array_fill(true, ARRAY[coalesce(pg_catalog.cardinality(defer_effects.effect_ids), 0)]));
    IF defer_effects.reasons IS NULL THEN
        RAISE EXCEPTION '%: reasons must not be NULL', fn
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Pass one reason code per report, e.g. no_transport.';
    END IF;
    IF pg_catalog.array_ndims(defer_effects.reasons) > 1
       OR pg_catalog.cardinality(defer_effects.reasons) <> pg_catalog.cardinality(defer_effects.effect_ids) THEN
        RAISE EXCEPTION '%: reasons has % elements, effect_ids has %', fn,
            pg_catalog.cardinality(defer_effects.reasons), pg_catalog.cardinality(defer_effects.effect_ids)
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass one reason code per report, in the order of effect_ids.';
    END IF;
    SELECT min(u.n)::integer INTO bad
      FROM pg_catalog.unnest(defer_effects.reasons) WITH ORDINALITY AS u (reason, n)
     WHERE u.reason IS NULL OR u.reason !~ '^[a-z][a-z0-9_]{0,39}$';
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION '%: report %: reason must be a code of lower-case letters, digits and _ (at most 40), got %',
            fn, bad, coalesce(pg_catalog.quote_literal(defer_effects.reasons[bad]), 'NULL')
            USING ERRCODE = CASE WHEN defer_effects.reasons[bad] IS NULL THEN 'null_value_not_allowed'
                                 ELSE 'invalid_parameter_value' END,
                  HINT = 'For example no_transport, unroutable or no_stream.';
    END IF;
    IF defer_effects.retry_after IS NULL OR defer_effects.retry_after < interval '1 second'
       OR defer_effects.retry_after > interval '1 hour' THEN
        RAISE EXCEPTION '%: retry_after must be between 1 second and 1 hour, got %', fn,
            coalesce(defer_effects.retry_after::text, 'NULL')
            USING ERRCODE = CASE WHEN defer_effects.retry_after IS NULL THEN 'null_value_not_allowed'
                                 ELSE 'invalid_parameter_value' END;
    END IF;

    -- Applied only to effects still leased under the reported token by the caller's role (fenced
    -- otherwise, as a failure report would be); a second report of the same lease is refused.
    WITH report AS (
        SELECT DISTINCT ON (u.id, u.token) u.id, u.token, u.reason, u.error, u.n
          FROM ROWS FROM (pg_catalog.unnest(defer_effects.effect_ids), pg_catalog.unnest(defer_effects.lease_tokens),
                          pg_catalog.unnest(defer_effects.reasons), pg_catalog.unnest(defer_effects.errors))
               WITH ORDINALITY AS u (id, token, reason, error, n)
         ORDER BY u.id, u.token, u.n
    ), deferred AS (
        UPDATE inbox.outbox o
           SET status = 'pending',
               attempts = GREATEST(o.attempts - 1, 0),  -- the claim counted it: not an attempt
               available_at = pg_catalog.now() + defer_effects.retry_after,
               lease_expires_at = NULL,
               last_error = pg_catalog.left(r.error, 2000),
               dead_reason = NULL,
               deferred_reason = r.reason,
               deferred_at = pg_catalog.clock_timestamp(),
               deferrals = o.deferrals + 1
          FROM report r
         WHERE o.effect_id = r.id AND o.lease_token = r.token AND o.status = 'leased'
           AND (o.lease_role = holder OR o.lease_role IS NULL)
        RETURNING r.n::integer AS n, o.status
    )
    SELECT coalesce(array_agg(d.n), '{}'), coalesce(array_agg(d.status::text), '{}')
      INTO accepted, outcomes
      FROM deferred d;
    RETURN QUERY
    SELECT r.ord, r.effect_id, r.lease_token, r.result, r.fenced_reason
      FROM inbox._report_outcomes('defer', defer_effects.effect_ids, defer_effects.lease_tokens, accepted, outcomes) r;
END
$$;
COMMENT ON FUNCTION inbox.defer_effects(text[], bigint[], text[], text[], interval) IS
    'Hand leased effects back without spending an attempt (no transport configured, broker cannot route yet), each fenced by its lease token: pending after retry_after | fenced (with the reason)';
REVOKE ALL ON FUNCTION inbox.defer_effects(text[], bigint[], text[], text[], interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION inbox.defer_effects(text[], bigint[], text[], text[], interval) TO inbox_dispatcher;

COMMIT;
