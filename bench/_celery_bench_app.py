"""The Celery app bench_frameworks.py runs in a `celery worker` (env: PGINBOX_BENCH_BROKER,
PGINBOX_BENCH_QUEUE, PGINBOX_DSN). Two tasks doing the same work:

  bench.hand     hand-written: acks_late, the article's statements in one transaction
                 (INSERT .. ON CONFLICT DO NOTHING RETURNING; UPDATE account; UPDATE
                 consumer_inbox SET processed_at), the identity from the task's kwargs
  bench.pginbox  pginbox.integrations.celery.inbox_task: the claim, then UPDATE account
"""

from __future__ import annotations

import json
import os
from typing import Any

import psycopg
from celery import Celery

from pginbox import Inbox, Message
from pginbox.integrations.celery import inbox_task

ARTICLE = (
    "INSERT INTO consumer_inbox (consumer_name, producer_name, message_id, payload_sha256, handler_version) "
    "VALUES (%s, %s, %s, encode(sha256(%s::bytea), 'hex'), 'v1') ON CONFLICT DO NOTHING RETURNING message_id",
    "UPDATE account SET balance = balance + %s WHERE id = %s",
    "UPDATE consumer_inbox SET processed_at = now() WHERE consumer_name = %s AND producer_name = %s "
    "AND message_id = %s",
)
DSN = os.environ.get("PGINBOX_DSN", "")
app = Celery("pginbox_bench", broker=os.environ.get("PGINBOX_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672//"))
app.conf.update(
    task_default_queue=os.environ.get("PGINBOX_BENCH_QUEUE", "bench"),
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
)
_conn: list[psycopg.Connection[Any]] = []


@app.task(name="bench.hand", bind=True, acks_late=True)
def hand(self: Any, payload: dict[str, Any], message_id: str, producer: str) -> None:
    if not _conn:
        _conn.append(psycopg.connect(DSN))
    conn = _conn[0]
    body = json.dumps(payload).encode()
    with conn.transaction():
        row = conn.execute(ARTICLE[0], ("bench", producer, message_id, body)).fetchone()
        if row is not None:
            conn.execute(ARTICLE[1], (payload["amount"], payload["account"]))
            conn.execute(ARTICLE[2], ("bench", producer, message_id))


def make_inbox() -> Inbox:
    return Inbox(psycopg.connect(DSN), consumer="bench")


@inbox_task(app, inbox=make_inbox, name="bench.pginbox")
def credit(cur: psycopg.Cursor[Any], message: Message) -> None:
    cur.execute(ARTICLE[1], (message.payload["amount"], message.payload["account"]))
