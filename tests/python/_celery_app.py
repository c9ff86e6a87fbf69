"""The Celery app the Celery tests run in a real worker (`celery -A _celery_app worker`).

Configured from the environment the test gives the worker: PGINBOX_CELERY_BROKER (the broker
URL), PGINBOX_CELERY_QUEUE (the queue of the test), PGINBOX_DSN (the test's database),
PGINBOX_CELERY_MARK (a file the handler writes the message id to before it sleeps, when the
payload asks it to: the SIGKILL test kills the worker then).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

from pginbox import Inbox, Message, RetryPolicy
from pginbox.integrations.celery import inbox_task

BROKER = os.environ.get("PGINBOX_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
QUEUE = os.environ.get("PGINBOX_CELERY_QUEUE", "celery")
DSN = os.environ.get("PGINBOX_DSN", "")
MARK = os.environ.get("PGINBOX_CELERY_MARK", "")

app = Celery("pginbox_celery_test", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # RabbitMQ: dead letters are confirmed. Redis: a dead worker's messages come back after 3 s
    # (the sweep for them runs every second: kombu's default is every 100 s)
    broker_transport_options={
        "confirm_publish": True,
        "visibility_timeout": 3,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    worker_hijack_root_logger=False,
)


def make_inbox() -> Inbox:
    conn = psycopg.connect(DSN, options="-c lock_timeout=300 -c statement_timeout=60000")
    return Inbox(conn, consumer="billing", retry=RetryPolicy(max_attempts=2, max_delay=0.1))


@inbox_task(
    app,
    inbox=make_inbox,
    name="billing.credit",
    retry_delay=0.3,
    max_retry_delay=2.0,
    outage_pause=0.5,
    halt_recheck=0.5,
)
def credit(cur: psycopg.Cursor[Any], message: Message) -> None:
    p = message.payload
    cur.execute("SELECT nextval('handler_calls')")
    if p["amount"] < 0:
        raise ValueError(f"negative amount {p['amount']}")
    cur.execute("SELECT apply_credit(%s, %s, %s)", (p.get("account", 1), message.message_id, p["amount"]))
    if p.get("sleep") and MARK:  # only in the worker the test kills
        Path(MARK).write_text(message.message_id)
        cur.execute("SELECT pg_sleep(%s)", (p["sleep"],))
