# @ async: this child is the source of _library_child.py
# python/tools/async_to_sync.py writes _library_child.py from this file: edit this one.
# @ end
"""Child process for the crash-loop test in test_library_async.py.

Usage: _library_child_async.py DSN MESSAGE_ID REDELIVERED(0|1)
Handles one 'credit' message with pginbox.AsyncInbox; the handler writes, then kills the process
(os._exit(3)) before anything commits. When the inbox decides not to run the handler, prints
`<outcome> <reason_code>` and exits 0.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import psycopg

from pginbox import AsyncInbox, Message


async def main() -> None:
    dsn, message_id, redelivered = sys.argv[1:]
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        inbox = AsyncInbox(conn, consumer="billing", handler_version="v1")

        async def dies(cur: psycopg.AsyncCursor[Any], m: Message) -> None:
            await cur.execute("SELECT apply_credit(1, %s, 10)", (m.message_id,))
            os._exit(3)

        body = {"id": message_id, "account": 1, "amount": 10}
        message = Message("orders", message_id, "credit", body, redelivered=redelivered == "1")
        result = await inbox.handle(message, dies)
        print(result.outcome.value, result.reason_code, flush=True)


if __name__ == "__main__":
    # @ async
    asyncio.run(main())
    # @ sync
    # main()
    # @ end
