# Generated from _library_child_async.py by python/tools/async_to_sync.py: DO NOT EDIT.
# Edit tests/python/_library_child_async.py, then run the script (tests/run checks this file).
"""Child process for the crash-loop test in test_library.py.

Usage: _library_child.py DSN MESSAGE_ID REDELIVERED(0|1)
Handles one 'credit' message with pginbox.Inbox; the handler writes, then kills the process
(os._exit(3)) before anything commits. When the inbox decides not to run the handler, prints
`<outcome> <reason_code>` and exits 0.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import psycopg

from pginbox import Inbox, Message


def main() -> None:
    dsn, message_id, redelivered = sys.argv[1:]
    with psycopg.connect(dsn) as conn:
        inbox = Inbox(conn, consumer="billing", handler_version="v1")

        def dies(cur: psycopg.Cursor[Any], m: Message) -> None:
            cur.execute("SELECT apply_credit(1, %s, 10)", (m.message_id,))
            os._exit(3)

        body = {"id": message_id, "account": 1, "amount": 10}
        message = Message("orders", message_id, "credit", body, redelivered=redelivered == "1")
        result = inbox.handle(message, dies)
        print(result.outcome.value, result.reason_code, flush=True)


if __name__ == "__main__":
    main()
