'use strict';
// pginbox from Node.js with `pg`: the scenario of docs/other-languages.md, step by step.
// Connects with the PG* environment variables (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD)
// as the LOGIN role bound to consumer 'ledger'. Prints one JSON line per step.
const { Pool, DatabaseError } = require('pg');

const CONSUMER = 'ledger';
const PRODUCER = 'shop';
const HANDLER_VERSION = 'v1';

// doc:begin classify
// What to do with an error (docs/other-languages.md, section 4).
function sqlstate(err) {
  return err instanceof DatabaseError ? err.code : null; // null: no answer from the server
}

function classify(err) {
  const code = sqlstate(err);
  if (code === null) return 'retry'; // connection lost: retry the whole transaction
  if (code.startsWith('40') || code === '55P03' || code === '57014') return 'retry';
  if (code.startsWith('08') || code.startsWith('53') || code.startsWith('57')) return 'retry';
  if (['42501', '42704', '42883', '42P01', '3F000', '3D000'].includes(code) || code.startsWith('28')) {
    return 'halt'; // configuration or rights: every message would fail the same way
  }
  return 'dead-letter'; // this message can never succeed as it is
}
// doc:end classify

// doc:begin retry
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Runs work(client) in one transaction; retries the WHOLE transaction on a transient error,
// with a bounded, jittered backoff. Safe even when a lost connection hid the COMMIT's outcome:
// the retry's claim sees 'duplicate'.
async function inTransaction(pool, isolation, work, { attempts = 5, baseMs = 10, onRetry } = {}) {
  for (let attempt = 1; ; attempt++) {
    const client = await pool.connect();
    let broken = false;
    try {
      await client.query(`BEGIN ISOLATION LEVEL ${isolation}`);
      const result = await work(client);
      await client.query('COMMIT');
      return result;
    } catch (err) {
      broken = sqlstate(err) === null;
      if (!broken) await client.query('ROLLBACK');
      if (classify(err) !== 'retry' || attempt >= attempts) throw err;
      if (onRetry) onRetry(err, attempt);
      await sleep(Math.random() * baseMs * 2 ** attempt);
    } finally {
      client.release(broken);
    }
  }
}
// doc:end retry

// doc:begin claim
// Pattern 1: claim in your transaction, make the change in the same transaction.
async function handleWithClaim(client, msg) {
  const { rows } = await client.query(
    `SELECT outcome FROM inbox.claim($1, $2, $3, $4::jsonb,
                                     handler_version => $5, produced_at => $6)`,
    [CONSUMER, msg.producer, msg.id, JSON.stringify(msg.payload), HANDLER_VERSION, msg.producedAt ?? null],
  );
  const outcome = rows[0].outcome;
  if (outcome === 'claimed') {
    try {
      await client.query('UPDATE ledger.account SET balance = balance + $1 WHERE id = $2',
                         [msg.payload.amount, msg.payload.account]);
    } catch (err) {
      err.inChange = true; // the change failed, not the claim
      throw err;
    }
  }
  return outcome;
}

// One delivery: the outcome, and what to tell the broker.
async function deliver(pool, msg) {
  try {
    const outcome = await inTransaction(pool, 'READ COMMITTED', (c) => handleWithClaim(c, msg));
    return { outcome, then: 'ack' }; // claimed (and changed), duplicate, conflict, quarantined, expired
  } catch (err) {
    const action = classify(err);
    if (!err.inChange || action !== 'dead-letter') {
      return { sqlstate: sqlstate(err), action }; // refused before anything was written
    }
    // A permanent error in the change: its transaction rolled back; record the attempt.
    const { rows } = await pool.query(
      `SELECT outcome, reason_code FROM inbox.record_failure($1, $2, $3, $4::jsonb, $5, $6,
                                                             handler_version => $7)`,
      [CONSUMER, msg.producer, msg.id, JSON.stringify(msg.payload),
       err.constraint || err.code, err.message, HANDLER_VERSION],
    );
    const { outcome, reason_code: reasonCode } = rows[0];
    return { outcome, reason_code: reasonCode, then: outcome === 'failed' ? 'nack' : 'ack' };
  }
}
// doc:end claim

// doc:begin apply
// Pattern 2: one round trip; the change is the registered SQL handler.
// SELECT * FROM ...: a bare SELECT inbox.claim_and_apply(...) returns one text column '(applied,...)'.
async function apply(client, msg, consumer = CONSUMER) {
  const { rows } = await client.query(
    `SELECT * FROM inbox.claim_and_apply($1, $2, $3, $4, $5::jsonb, produced_at => $6)`,
    [consumer, msg.producer, msg.id, msg.type, JSON.stringify(msg.payload), msg.producedAt ?? null],
  );
  return rows[0]; // outcome, reason_code, attempts (number), quarantine_id (bigint: a string) ...
}

async function deliverApply(pool, msg, consumer = CONSUMER) {
  try {
    const r = await inTransaction(pool, 'READ COMMITTED', (c) => apply(c, msg, consumer));
    // failed: the handler's error was recorded (reason_code), its writes rolled back.
    return { outcome: r.outcome, reason_code: r.reason_code, then: r.outcome === 'failed' ? 'nack' : 'ack' };
  } catch (err) {
    return { sqlstate: sqlstate(err), action: classify(err) };
  }
}
// doc:end apply

function report(step, result) {
  console.log(JSON.stringify({ step, ...result }));
}

async function main() {
  const pool = new Pool({ max: 3 });
  const credit = (id, account, amount, extra = {}) =>
    ({ producer: PRODUCER, id, type: 'credit', payload: { account, amount }, ...extra });
  try {
    report('claim', await deliver(pool, credit('m-1', 1, 10)));
    report('claim_duplicate', await deliver(pool, credit('m-1', 1, 10)));
    report('claim_conflict', await deliver(pool, credit('m-1', 1, 99)));
    report('claim_change_failed', await deliver(pool, credit('m-2', 2, -5)));
    report('apply', await deliverApply(pool, credit('m-3', 2, 7)));
    report('apply_duplicate', await deliverApply(pool, credit('m-3', 2, 7)));
    report('apply_failed', await deliverApply(pool, credit('m-4', 1, -1000)));

    // doc:begin race
    // A REPEATABLE READ transaction whose snapshot predates another worker's commit of the same
    // message gets 40001; the retry loop runs it again and the claim says 'duplicate'.
    const msg = credit('m-5', 2, 1);
    const retried = [];
    let first;
    const outcome = await inTransaction(pool, 'REPEATABLE READ', async (client) => {
      await client.query('SELECT 1'); // the snapshot is taken here
      if (first === undefined) first = (await deliverApply(pool, msg)).outcome; // the other worker
      return (await apply(client, msg)).outcome;
    }, { onRetry: (err) => retried.push(sqlstate(err)) });
    // doc:end race
    report('race', { first, retried, outcome });

    const tomorrow = new Date(Date.now() + 86400e3).toISOString();
    report('produced_at_ahead', await deliver(pool, credit('m-6', 1, 1, { producedAt: tomorrow })));
    report('unbound_consumer', await deliverApply(pool, credit('m-7', 1, 1), 'ledgr'));
  } finally {
    await pool.end();
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
