"""The statements Inbox and AsyncInbox run, as named constants: no SQL is assembled at run time.
(The operator commands, the dispatcher and the demo keep theirs next to their code: ops/*.py,
dispatcher/queries.py, demo/*.py.)

Statements that write return `pg_current_xact_id_if_assigned()` as their last column, read in the
same round trip as the result: when the connection is lost during the COMMIT that follows, the
transaction id is what pg_xact_status is asked about. (`_if_assigned`: a transaction that wrote
nothing gets no id and needs no WAL flush at commit.) The functions are called in FROM, so each
runs exactly once, before the transaction id is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, LiteralString

from psycopg import IsolationLevel

from pginbox.schema.compat import SCHEMA_RELEASE

SCHEMA_VERSION: Final = SCHEMA_RELEASE

# The schema check Inbox and AsyncInbox run on first use: SCHEMA_RELEASE's columns, then the server
# session's process id (a pooler's differs from the one the client got at login: pginbox.pooler).
SCHEMA_CHECK: Final = (
    "SELECT r.version, r.release, r.breaking_since, pg_catalog.pg_backend_pid() FROM inbox.schema_release() r"
)

# BEGIN honouring the connection's isolation_level (None: the server's default).
BEGIN: Final[Mapping[IsolationLevel | None, LiteralString]] = {
    None: "BEGIN",
    IsolationLevel.READ_UNCOMMITTED: "BEGIN ISOLATION LEVEL READ UNCOMMITTED",
    IsolationLevel.READ_COMMITTED: "BEGIN ISOLATION LEVEL READ COMMITTED",
    IsolationLevel.REPEATABLE_READ: "BEGIN ISOLATION LEVEL REPEATABLE READ",
    IsolationLevel.SERIALIZABLE: "BEGIN ISOLATION LEVEL SERIALIZABLE",
}

# handle_batch: one savepoint per message.
SAVEPOINT: Final = "SAVEPOINT pginbox_message"
RELEASE_SAVEPOINT: Final = "RELEASE SAVEPOINT pginbox_message"
ROLLBACK_TO_SAVEPOINT: Final = "ROLLBACK TO SAVEPOINT pginbox_message"

# Result columns of inbox.delivery_result, in the order outcomes.Result takes them.
# (Spelled out in each statement below: constants are not concatenated.)

# params: consumer, producer, message_id, payload (Jsonb), handler_version, tenant, produced_at
CLAIM: Final = """
SELECT r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at,
       r.quarantine_id, r.attempts, r.reason_code, r.error_message,
       pg_catalog.pg_current_xact_id_if_assigned()::text
  FROM inbox.claim(consumer => %s, producer => %s, message_id => %s, payload => %s::jsonb,
                   handler_version => %s, tenant => %s, produced_at => %s::timestamptz) AS r
"""

# params: consumer, producer, message_id, message_type, payload (Jsonb), tenant, produced_at
CLAIM_AND_APPLY: Final = """
SELECT r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at,
       r.quarantine_id, r.attempts, r.reason_code, r.error_message,
       pg_catalog.pg_current_xact_id_if_assigned()::text
  FROM inbox.claim_and_apply(consumer => %s, producer => %s, message_id => %s, message_type => %s,
                             payload => %s::jsonb, tenant => %s, produced_at => %s::timestamptz) AS r
"""

# params: consumer, messages (Jsonb array of {producer, message_id, message_type, payload,
# tenant, produced_at}); rows in input order, ordinal first.
CLAIM_AND_APPLY_BATCH: Final = """
SELECT r.ordinal, r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at,
       r.quarantine_id, r.attempts, r.reason_code, r.error_message,
       pg_catalog.pg_current_xact_id_if_assigned()::text
  FROM inbox.claim_and_apply_batch(consumer => %s, messages => %s::jsonb) AS r
 ORDER BY r.ordinal
"""

# params: consumer, messages (Jsonb array), version. Rows in input order; outcome 'repeat': an
# identity an earlier element holds (claimed with CLAIM once the earlier one is decided).
CLAIM_BATCH: Final = """
SELECT r.ordinal, r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at,
       r.quarantine_id, r.attempts, r.reason_code, r.error_message,
       pg_catalog.pg_current_xact_id_if_assigned()::text
  FROM inbox.claim_batch(consumer => %s, messages => %s::jsonb, version => %s) AS r
 ORDER BY r.ordinal
"""

# params: consumer, tenant, producer, message_id. After a handler failed and its writes rolled
# back to the message's savepoint: takes back the claim CLAIM_BATCH made in this transaction.
UNCLAIM: Final = """
SELECT inbox._unclaim(consumer => %s, tenant => %s, producer => %s, message_id => %s)
"""

# params: consumer, producer, message_id, payload (Jsonb), reason_code, error_message,
# handler_version, tenant, message_type
RECORD_FAILURE: Final = """
SELECT r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version, r.processed_at,
       r.quarantine_id, r.attempts, r.reason_code, r.error_message,
       pg_catalog.pg_current_xact_id_if_assigned()::text
  FROM inbox.record_failure(consumer => %s, producer => %s, message_id => %s, payload => %s::jsonb,
                            reason_code => %s, error_message => %s, handler_version => %s,
                            tenant => %s, message_type => %s) AS r
"""

# Announces redelivered attempts, several at once (arrays of equal length, one element per
# message); rows in input order, ordinal first. Outcome: proceed | quarantined.
# params: consumer, producers text[], message_ids text[], tenants text[], message_types text[],
# payloads jsonb[], handler_version
RECORD_STARTS: Final = """
SELECT m.ordinal::integer, r.outcome, r.payload_sha256, r.stored_sha256, r.handler_version,
       r.processed_at, r.quarantine_id, r.attempts, r.reason_code, r.error_message,
       pg_catalog.pg_current_xact_id_if_assigned()::text
  FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::jsonb[])
       WITH ORDINALITY AS m(producer, message_id, tenant, message_type, payload, ordinal)
 CROSS JOIN LATERAL inbox.record_start(consumer => %s, producer => m.producer,
                                       message_id => m.message_id, tenant => m.tenant,
                                       message_type => m.message_type, payload => m.payload,
                                       handler_version => %s) AS r
 ORDER BY m.ordinal
"""

# Resolving a COMMIT whose reply was lost. params: xid (text of an xid8)
XACT_STATUS: Final = "SELECT pg_catalog.pg_xact_status(%s::xid8)"

# The orphaned backend of a lost connection, still holding our transaction open: terminate it so
# that the transaction resolves. Matching on the transaction id too means a reused pid is never hit.
# params: backend pid, xid (text of an xid8)
TERMINATE_ORPHAN: Final = """
SELECT pg_catalog.pg_terminate_backend(a.pid)
  FROM pg_catalog.pg_stat_activity a
 WHERE a.pid = %s AND a.backend_xid = pg_catalog.xid(%s::xid8)
"""

# An effect of the consumer in the caller's transaction (producer-only services, and handlers that
# enqueue): true = enqueued, false = already enqueued with the same destination and payload.
# params: effect_id, destination, payload (Jsonb), headers (Jsonb or None), ordering_key,
# available_at (or None: now), consumer, tenant (or None: the claimed one, else '')
ENQUEUE: Final = """
SELECT inbox.enqueue_effect(effect_id => %s, destination => %s, payload => %s::jsonb,
                            headers => coalesce(%s::jsonb, '{}'::jsonb), ordering_key => %s,
                            available_at => coalesce(%s::timestamptz, pg_catalog.now()),
                            consumer => %s, tenant => %s)
"""
