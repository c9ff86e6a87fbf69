"""The limits of the SQL API that the Python package respects, in one place.

Each is a number the SQL functions enforce (or cut to); tests/python/integration/test_sql_contract.py probes
the deployed schema at each boundary and fails when the two drift apart. Nothing is imported here:
the CLI reads these when it starts.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CLAIM_LIMIT", "EXCERPT_CHARS", "LEASE_MAX_SECONDS", "MAX_BATCH", "REASON_MAX_BYTES", "REPORT_LIMIT"]

#: Messages in one inbox.claim_and_apply_batch call; handle_batch uses the same chunks (one
#: subtransaction per message: more would overflow the backend's subtransaction cache).
MAX_BATCH: Final = 64
#: The longest reason code inbox.record_failure takes, in bytes.
REASON_MAX_BYTES: Final = 64
#: Reports in one inbox.complete_effects / fail_effects call.
REPORT_LIMIT: Final = 1000
#: Effects one inbox.claim_effects call claims (its max_effects).
CLAIM_LIMIT: Final = 1000
#: The longest lease inbox.claim_effects and inbox.extend_lease grant, seconds (1 day).
LEASE_MAX_SECONDS: Final = 86400
#: Characters inbox.outbox keeps of a response excerpt and of an error (SQL cuts them there).
EXCERPT_CHARS: Final = 2000
