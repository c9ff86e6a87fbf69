"""The FastStream app the FastStream crash test runs as a process of its own (`python
_faststream_app.py`), configured from the environment: PGINBOX_FS_BROKER (rabbitmq, nats,
redis), PGINBOX_FS_URL, PGINBOX_FS_NAME (the queue; NATS: the durable, subject NAME.in, stream
PGINBOX_FS_STREAM; Redis: the stream), PGINBOX_DSN, PGINBOX_FS_MARK (the handler writes the
message id there, then sleeps, when the payload asks it to: the test SIGKILLs the app then).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from pginbox import AsyncInbox, Message
from pginbox.integrations.faststream import close, inbox_subscriber

KIND = os.environ["PGINBOX_FS_BROKER"]
URL = os.environ["PGINBOX_FS_URL"]
NAME = os.environ["PGINBOX_FS_NAME"]
MARK = os.environ.get("PGINBOX_FS_MARK", "")
pool: AsyncConnectionPool[Any] = AsyncConnectionPool(os.environ["PGINBOX_DSN"], min_size=1, max_size=2, open=False)


async def make_inbox() -> AsyncInbox:
    await pool.open()
    return AsyncInbox(pool, consumer="billing")


async def credit(cur: psycopg.AsyncCursor[Any], message: Message) -> None:
    p = message.payload
    await cur.execute("SELECT apply_credit(1, %s, %s)", (message.message_id, p["amount"]))
    if p.get("sleep") and MARK:  # only in the app the test kills
        Path(MARK).write_text(message.message_id)
        await cur.execute("SELECT pg_sleep(%s)", (p["sleep"],))


def build() -> Any:
    options: dict[str, Any] = {"url": URL, "inbox": make_inbox}
    if KIND == "rabbitmq":
        from faststream.rabbit import RabbitBroker

        broker: Any = RabbitBroker(URL)
        inbox_subscriber(broker, NAME, **options)(credit)
    elif KIND == "nats":
        from faststream.nats import ConsumerConfig, JStream, NatsBroker, PullSub

        broker = NatsBroker(URL)
        inbox_subscriber(
            broker,
            f"{NAME}.in",
            stream=JStream(os.environ["PGINBOX_FS_STREAM"], declare=False),
            durable=NAME,
            pull_sub=PullSub(batch_size=1, timeout=0.2),
            config=ConsumerConfig(ack_wait=2),
            **options,
        )(credit)
    else:
        from faststream.redis import RedisBroker, StreamSub

        broker = RedisBroker(URL)
        sub = StreamSub(NAME, group="billing", consumer=f"c{os.getpid()}", polling_interval=100)
        inbox_subscriber(broker, stream=sub, claim_idle=2.0, **options)(credit)
    return broker


async def main() -> None:
    broker = build()
    async with broker:
        await broker.start()
        print("pginbox-fs-ready", flush=True)
        await asyncio.Event().wait()  # until killed
    await close(broker)


if __name__ == "__main__":
    asyncio.run(main())
