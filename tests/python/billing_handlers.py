"""Python handlers for `pginbox quarantine repair --python` (test_cli_python_repair.py) and Python
replay plans (test_cli_python_replay.py): the billing consumer's handler(cursor, message), as
`pginbox consume --handler` would run it."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from pginbox import Message


def credit(cur: psycopg.Cursor[Any], message: Message) -> None:
    """Credits the account, logs which login ran it, and enqueues a receipt (as the consumer)."""
    account, amount = message.payload["account"], message.payload["amount"]
    cur.execute("UPDATE acct SET balance = balance + %s WHERE id = %s", (amount, account))
    if cur.rowcount == 0:
        raise LookupError(f"no account {account}")
    cur.execute("INSERT INTO repair_log (message_id, login) VALUES (%s, session_user)", (message.message_id,))
    cur.execute(
        "SELECT inbox.enqueue_effect(%s, 'crm', %s::jsonb, consumer => 'billing')",
        (f"{message.message_id}:receipt", f'{{"account": {account}}}'),
    )


async def credit_async(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
    """`credit` as an `async def` handler (what `pginbox consume` runs on its asyncio connection)."""
    account, amount = message.payload["account"], message.payload["amount"]
    await cur.execute("UPDATE acct SET balance = balance + %s WHERE id = %s", (amount, account))
    if cur.rowcount == 0:
        raise LookupError(f"no account {account}")
    await cur.execute("INSERT INTO repair_log (message_id, login) VALUES (%s, session_user)", (message.message_id,))


def recredit(cur: psycopg.Cursor[Any], message: Message) -> None:
    """A replay plan's handler (test_cli_python_replay.py): logs which login applied which message.
    replay_log has no unique key: an item applied twice would show as two rows."""
    if message.payload["amount"] < 0:
        raise ValueError(f"negative amount in {message.message_id}")
    cur.execute("INSERT INTO replay_log (message_id, login) VALUES (%s, session_user)", (message.message_id,))


def recredit_slow(cur: psycopg.Cursor[Any], message: Message) -> None:
    """`recredit`, then 0.4 s inside the item's transaction: time for a test to SIGKILL the runner."""
    recredit(cur, message)
    time.sleep(0.4)


async def recredit_async(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
    """`recredit` as an `async def` handler (what `pginbox consume` runs on its asyncio connection)."""
    if message.payload["amount"] < 0:
        raise ValueError(f"negative amount in {message.message_id}")
    await cur.execute("INSERT INTO replay_log (message_id, login) VALUES (%s, session_user)", (message.message_id,))
