"""Claim throughput against baselines measured in the same run (issue: the inbox core).

Runs pgbench (-M prepared, 8 clients by default) on a private cluster with fsync on, and prints
messages per second and ratios:

  bare      one-row business UPDATE in autocommit: the baseline
  article   the article's statements, one round trip each: BEGIN; INSERT .. ON CONFLICT DO NOTHING
            RETURNING; UPDATE account; UPDATE consumer_inbox SET processed_at; COMMIT
  claim     inbox.claim + the UPDATE in one transaction (two round trips)
  apply     inbox.claim_and_apply with a PL/pgSQL handler running the same UPDATE (one round trip)
  batch     inbox.claim_and_apply_batch, --batch messages per call
  floor     the least a one-round-trip claim can do: a PL/pgSQL function that inserts the identity
            row into inbox.message and calls the handler, without validation, settings, hashing
            exclusions, subtransaction or definer split. Not a product: the floor apply is held to.
  setsql    hand-written set SQL for --batch messages per transaction: one INSERT .. SELECT .. ON
            CONFLICT DO NOTHING RETURNING into the article's table, one UPDATE of the accounts it
            returned (no per-message isolation, no outcomes): the limit the batch is held to
  apply-noauth  apply with inbox._may_act_as replaced by `RETURN true` for the run (A/B of the
            authorization check; restored right after)

Every workload runs as a LOGIN role that holds only inbox_consumer and is bound to consumer
'bench' (plus the grants on the benchmark's own tables), so authorization is on as in production.

Workloads are interleaved over --rounds rounds and the median of each is reported, because
this machine is noisy; each ratio is the median of its per-round ratios, with their range. The
commit latency of the run (one client's bare update) is printed too: ratios to bare and article,
whose transactions commit once per message, move with it.
Usage:  .venv/bin/python bench/bench_claim.py [--seconds 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import psycopg
from benchlib import SERVICE_ROLE, bench_database, create_service_role, run_pgbench

ACCOUNTS = 100_000

SETUP = """
CREATE TABLE account (id integer PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO account (id) SELECT g FROM generate_series(1, %(accounts)s) g;
CREATE TABLE consumer_inbox (
  consumer_name text NOT NULL, producer_name text NOT NULL, message_id text NOT NULL,
  payload_sha256 text NOT NULL, received_at timestamptz NOT NULL DEFAULT now(),
  processed_at timestamptz, handler_version text NOT NULL,
  PRIMARY KEY (consumer_name, producer_name, message_id));
CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  UPDATE account SET balance = balance + (payload->>'amount')::bigint WHERE id = (payload->>'account')::integer;
END $$;
SELECT inbox.register_handler('bench', 'credit', 'credit(jsonb)'::regprocedure, 'v1');
CREATE FUNCTION floor_claim(message_id text, payload jsonb) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO inbox.message (consumer, tenant, producer, message_id, payload_sha256, handler_version, processed_at)
  VALUES ('bench', '', 'shop', message_id, sha256(convert_to(payload::text, 'UTF8')), 'v1', now())
  ON CONFLICT DO NOTHING;
  IF NOT FOUND THEN RETURN 'duplicate'; END IF;
  PERFORM credit(payload);
  RETURN 'applied';
END $$;
"""

GRANTS = """
GRANT SELECT, UPDATE ON account TO {role};
GRANT SELECT, INSERT, UPDATE ON consumer_inbox TO {role};
GRANT SELECT, INSERT ON inbox.message TO {role};  -- the floor writes the identity row itself
"""

# Message ids: client id plus a random 60-bit number; a collision would show up as a duplicate
# (the counts below check there were none).
SCRIPTS = {
    "bare": """
\\set aid random(1, {accounts})
UPDATE account SET balance = balance + 1 WHERE id = :aid::integer;
""",
    "article": """
\\set aid random(1, {accounts})
\\set mid random(1, 1152921504606846976)
BEGIN;
INSERT INTO consumer_inbox (consumer_name, producer_name, message_id, payload_sha256, handler_version)
  VALUES ('bench', 'shop', :client_id::text || '-' || :mid::text, encode(sha256(convert_to(jsonb_build_object('account', :aid::integer, 'amount', 1)::text, 'UTF8')), 'hex'), 'v1')
  ON CONFLICT DO NOTHING RETURNING message_id;
UPDATE account SET balance = balance + 1 WHERE id = :aid::integer;
UPDATE consumer_inbox SET processed_at = now()
  WHERE consumer_name = 'bench' AND producer_name = 'shop' AND message_id = :client_id::text || '-' || :mid::text;
COMMIT;
""",
    "claim": """
\\set aid random(1, {accounts})
\\set mid random(1, 1152921504606846976)
BEGIN;
SELECT outcome FROM inbox.claim('bench', 'shop', :client_id::text || '-' || :mid::text, jsonb_build_object('account', :aid::integer, 'amount', 1), 'v1');
UPDATE account SET balance = balance + 1 WHERE id = :aid::integer;
COMMIT;
""",
    "apply": """
\\set aid random(1, {accounts})
\\set mid random(1, 1152921504606846976)
SELECT outcome FROM inbox.claim_and_apply('bench', 'shop', :client_id::text || '-' || :mid::text, 'credit', jsonb_build_object('account', :aid::integer, 'amount', 1));
""",
    "floor": """
\\set aid random(1, {accounts})
\\set mid random(1, 1152921504606846976)
SELECT floor_claim(:client_id::text || '-' || :mid::text, jsonb_build_object('account', :aid::integer, 'amount', 1));
""",
    "setsql": """
\\set aid random(1, {accounts_less_batch})
\\set mid random(1, 1152921504606846976)
BEGIN;
WITH msgs AS (
  SELECT :client_id::text || '-' || :mid::text || '-' || g::text AS message_id, :aid::integer + g AS account,
         jsonb_build_object('account', :aid::integer + g, 'amount', 1) AS payload
    FROM generate_series(1, {batch}) g),
claimed AS (
  INSERT INTO consumer_inbox (consumer_name, producer_name, message_id, payload_sha256, handler_version, processed_at)
  SELECT 'bench', 'shop', m.message_id, encode(sha256(convert_to(m.payload::text, 'UTF8')), 'hex'), 'v1', now()
    FROM msgs m
  ON CONFLICT DO NOTHING RETURNING message_id)
UPDATE account a SET balance = a.balance + 1
  FROM msgs m JOIN claimed c USING (message_id)
 WHERE a.id = m.account;
COMMIT;
""",
    "batch": """
\\set aid random(1, {accounts_less_batch})
\\set mid random(1, 1152921504606846976)
SELECT count(*) FROM inbox.claim_and_apply_batch('bench', (
  SELECT jsonb_agg(jsonb_build_object('producer', 'shop', 'message_id', :client_id::text || '-' || :mid::text || '-' || g::text,
                                      'message_type', 'credit',
                                      'payload', jsonb_build_object('account', :aid::integer + g, 'amount', 1)) ORDER BY g)
    FROM generate_series(1, {batch}) g));
""",
}


NOAUTH = """
CREATE OR REPLACE FUNCTION inbox._may_act_as(consumer text, tenant text) RETURNS boolean
    LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$ BEGIN RETURN true; END $$;
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10, help="duration of each pgbench run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--batch", type=int, default=50, help="messages per claim_and_apply_batch call")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    with bench_database() as (cluster, dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP % {"accounts": ACCOUNTS})  # type: ignore[arg-type]
            create_service_role(dsn, "bench", GRANTS)
            conn.execute("VACUUM ANALYZE")
            row = conn.execute("SELECT pg_get_functiondef('inbox._may_act_as(text, text)'::regprocedure)").fetchone()
            assert row is not None
            with_auth = str(row[0])
        scripts = {
            name: s.format(accounts=ACCOUNTS, accounts_less_batch=ACCOUNTS - args.batch, batch=args.batch)
            for name, s in SCRIPTS.items()
        }
        scripts["apply-noauth"] = scripts["apply"]
        samples: dict[str, list[float]] = {name: [] for name in scripts}
        commit_tps = run_pgbench(cluster, scripts["bare"], 1, min(args.seconds, 5), user=SERVICE_ROLE)
        for rnd in range(args.rounds):
            for name, script in scripts.items():
                if name == "apply-noauth":
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        conn.execute(NOAUTH)
                try:
                    tps = run_pgbench(cluster, script, args.clients, args.seconds, user=SERVICE_ROLE)
                finally:
                    if name == "apply-noauth":
                        with psycopg.connect(dsn, autocommit=True) as conn:
                            conn.execute(with_auth)  # type: ignore[arg-type]
                msgs = tps * (args.batch if name in ("batch", "setsql") else 1)
                samples[name].append(msgs)
                print(f"round {rnd + 1}: {name:8s} {msgs:10.0f} msgs/s", flush=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*), count(DISTINCT (producer, message_id)) FROM inbox.message").fetchone()
            assert row is not None and row[0] == row[1]

    med = {name: statistics.median(v) for name, v in samples.items()}
    # Each ratio is the median of its per-round ratios (two workloads of one round ran minutes
    # apart at most, so the machine's drift between rounds stays out of it), with their range.
    pairs = [
        ("apply", "floor"),
        ("apply", "article"),
        ("batch", "bare"),
        ("batch", "setsql"),
        ("apply", "bare"),
        ("claim", "article"),
        ("article", "bare"),
        ("floor", "bare"),
        ("setsql", "bare"),
        ("batch", "apply"),
        ("apply", "apply-noauth"),
    ]
    per_round = {f"{a} / {b}": [x / y for x, y in zip(samples[a], samples[b], strict=True)] for a, b in pairs}
    ratios = {name: statistics.median(v) for name, v in per_round.items()}
    targets = {"apply / floor": 0.80, "apply / article": 1.3, "batch / bare": 3.0, "batch / setsql": 0.60}
    print()
    print(
        f"commit latency: {1000 / commit_tps:.2f} ms (one client, the bare update, autocommit: {commit_tps:.0f} tps);"
        " the ratios to bare and article depend on it, those to floor and setsql (same commits) do not"
    )
    print(f"medians over {args.rounds} rounds of {args.seconds}s, {args.clients} clients, batch {args.batch}:")
    for name, value in med.items():
        print(f"  {name:8s} {value:10.0f} msgs/s")
    print("ratios:")
    for name, value in ratios.items():
        target = targets.get(name)
        verdict = "" if target is None else (f"  target >= {target}: " + ("met" if value >= target else "MISSED"))
        spread = per_round[name]
        print(f"  {name:20s} {value:5.2f}x [{min(spread):.2f}..{max(spread):.2f}]{verdict}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "medians": med,
                    "ratios": ratios,
                    "per_round": per_round,
                    "commit_tps_one_client": commit_tps,
                    "args": vars(args) | {"json": None},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
