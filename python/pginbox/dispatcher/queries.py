"""The statements the dispatcher runs (claims, set-based reports, leases, the idle registration)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "CAN_DEFER",
    "CHANNEL",
    "CLAIM",
    "CLAIM_V2",
    "COMPLETE_MANY",
    "DEFER_MANY",
    "EXTEND",
    "FAIL_MANY",
    "IDLE",
    "LISTEN",
    "REPORT_MANY",
    "SCHEMA_VERSION",
]

#: The NOTIFY channel of inbox.dispatcher_idle's wake-up signal.
CHANNEL: Final = "inbox_outbox"
LISTEN: Final = "LISTEN inbox_outbox"

#: Schema version 3 (0.3.0) and later: the key each destination deduplicates on is idempotency_key,
#: derived from (consumer, tenant, effect_id); key_aware tells claim_effects this dispatcher sends it.
CLAIM: Final = (
    "SELECT effect_id, destination, payload, headers, ordering_key, attempts, lease_token, lease_expires_at,"
    " created_at, idempotency_key FROM inbox.claim_effects(%s, %s, %s, key_aware => true)"
)
#: Schema version 2 (0.2.0): the key is the effect id.
CLAIM_V2: Final = (
    "SELECT effect_id, destination, payload, headers, ordering_key, attempts, lease_token, lease_expires_at,"
    " created_at, effect_id AS idempotency_key FROM inbox.claim_effects(%s, %s, %s)"
)
SCHEMA_VERSION: Final = "SELECT inbox.schema_version()"
# Set-based reports: one row per report (ord = position in the arrays, from 1), in one statement.
COMPLETE_MANY: Final = (
    "SELECT 'complete' AS report, ord, result FROM inbox.complete_effects("
    "%s::text[], %s::bigint[], %s::integer[], %s::text[], %s::integer[])"
)
FAIL_MANY: Final = (
    "SELECT 'fail' AS report, ord, result FROM inbox.fail_effects("
    "%s::text[], %s::bigint[], %s::text[], %s::boolean[], %s::integer[], %s::text[], %s::integer[])"
)
REPORT_MANY: Final = COMPLETE_MANY + " UNION ALL " + FAIL_MANY
#: Deferred (not an attempt): pending again after %s, the reason recorded (sql/125_outbox_defer.sql).
DEFER_MANY: Final = (
    "SELECT 'defer' AS report, ord, result FROM inbox.defer_effects("
    "%s::text[], %s::bigint[], %s::text[], %s::text[], %s::interval)"
)
CAN_DEFER: Final = (
    "SELECT to_regprocedure('inbox.defer_effects(text[], bigint[], text[], text[], interval)') IS NOT NULL"
)
EXTEND: Final = "SELECT inbox.extend_lease(%s, %s, %s)"
IDLE: Final = "SELECT inbox.dispatcher_idle(%s, %s)"
