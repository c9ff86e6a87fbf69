"""The statements the dispatcher runs (claims, set-based reports, leases, the idle registration)."""

from __future__ import annotations

from typing import Final

__all__ = ["CHANNEL", "CLAIM", "COMPLETE_MANY", "EXTEND", "FAIL_MANY", "IDLE", "LISTEN", "REPORT_MANY"]

#: The NOTIFY channel of inbox.dispatcher_idle's wake-up signal.
CHANNEL: Final = "inbox_outbox"
LISTEN: Final = "LISTEN inbox_outbox"

# Every column: a schema that returns idempotency_key (the key destinations deduplicate on) hands
# it to Effect; an older one does not, and the effect id is the key (transports.effect).
CLAIM: Final = "SELECT * FROM inbox.claim_effects(%s, %s, %s)"
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
EXTEND: Final = "SELECT inbox.extend_lease(%s, %s, %s)"
IDLE: Final = "SELECT inbox.dispatcher_idle(%s, %s)"
