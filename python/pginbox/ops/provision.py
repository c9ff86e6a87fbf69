"""`pginbox outbox provision`: create (or, with check=True, only look for) what the dispatcher's
destinations need on their brokers, so that no effect waits for a deployment order.

    rabbitmq, default exchange   the durable queue named by routing_key
    rabbitmq, named exchange     the exchange must exist (its queues and bindings are the consuming
                                 service's: reported, not created)
    nats (JetStream)             a stream capturing the subject (created as `stream`, default: the
                                 destination's name upper-cased, with a 2-minute duplicate window)
    redis                        nothing: XADD creates the stream
    webhook, callable            nothing to provision

Each destination gives one Outcome: present, created, missing (check), skipped (nothing to do), or
failed (the broker said no, or could not be reached).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pginbox.transports.config import destination_type

__all__ = ["CREATED", "FAILED", "MISSING", "PRESENT", "SKIPPED", "Outcome", "provision"]

PRESENT: Final = "present"
CREATED: Final = "created"
MISSING: Final = "missing"
SKIPPED: Final = "skipped"
FAILED: Final = "failed"

#: The duplicate window of a stream provision creates: longer than a dispatcher's retry of one effect.
DUPLICATE_WINDOW_SECONDS: Final = 120.0


@dataclass(frozen=True)
class Outcome:
    destination: str
    kind: str
    what: str
    status: str
    detail: str = ""


def _stream_name(destination: str, options: Mapping[str, Any]) -> str:
    given = options.get("stream")
    if given:
        return str(given)
    return re.sub(r"[^A-Za-z0-9_-]", "_", destination).upper()


async def _rabbitmq(name: str, options: Mapping[str, Any], check: bool, timeout: float) -> Outcome:
    import aio_pika
    import aio_pika.exceptions

    exchange = str(options.get("exchange") or "")
    queue = str(options.get("routing_key") or "")
    connection = await aio_pika.connect(str(options["url"]), timeout=timeout)
    async with connection:
        if exchange:
            channel = await connection.channel()
            try:
                await channel.get_exchange(exchange, ensure=True)
            except aio_pika.exceptions.ChannelClosed:
                return Outcome(
                    name,
                    "rabbitmq",
                    f"exchange {exchange!r}",
                    MISSING,
                    "declare it with its queues and bindings (the consuming service's part)",
                )
            return Outcome(
                name,
                "rabbitmq",
                f"exchange {exchange!r}",
                PRESENT,
                "its queues and bindings are the consuming service's",
            )
        channel = await connection.channel()
        try:
            await channel.declare_queue(queue, passive=True)
            return Outcome(name, "rabbitmq", f"queue {queue!r}", PRESENT)
        except aio_pika.exceptions.ChannelClosed:
            if check:
                return Outcome(
                    name, "rabbitmq", f"queue {queue!r}", MISSING, "effects to it wait (unroutable) until it exists"
                )
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)
        return Outcome(name, "rabbitmq", f"queue {queue!r}", CREATED, "durable")


async def _jetstream(name: str, options: Mapping[str, Any], check: bool, timeout: float) -> Outcome:
    import nats
    import nats.js.errors

    subject = str(options.get("subject") or "")
    nc = await nats.connect(str(options["url"]), connect_timeout=timeout, max_reconnect_attempts=1)
    try:
        js = nc.jetstream(timeout=timeout)
        try:
            found = await js.find_stream_name_by_subject(subject)
            return Outcome(name, "nats", f"subject {subject!r}", PRESENT, f"stream {found}")
        except nats.js.errors.NotFoundError:
            pass
        stream = _stream_name(name, options)
        if check:
            return Outcome(
                name,
                "nats",
                f"subject {subject!r}",
                MISSING,
                f"no stream captures it; effects to it wait (no_stream); provision creates {stream}",
            )
        await js.add_stream(name=stream, subjects=[subject], duplicate_window=DUPLICATE_WINDOW_SECONDS)
        return Outcome(
            name,
            "nats",
            f"subject {subject!r}",
            CREATED,
            f"stream {stream}, duplicate window {DUPLICATE_WINDOW_SECONDS:g}s",
        )
    finally:
        await nc.close()


async def _one(name: str, options: Mapping[str, Any], check: bool, timeout: float) -> Outcome:
    try:
        kind = destination_type(name, options)
    except ValueError as exc:
        return Outcome(name, "?", "-", FAILED, str(exc))
    try:
        if kind == "rabbitmq":
            return await asyncio.wait_for(_rabbitmq(name, options, check, timeout), timeout * 3)
        if kind == "nats":
            return await asyncio.wait_for(_jetstream(name, options, check, timeout), timeout * 3)
    except Exception as exc:  # one broker down must not hide what the others need
        return Outcome(name, kind or "?", "-", FAILED, f"{type(exc).__name__}: {exc}")
    if kind == "redis":
        return Outcome(name, kind, f"stream {options.get('stream')!r}", SKIPPED, "XADD creates it")
    return Outcome(name, kind or "entry point", "-", SKIPPED, "nothing to provision")


def provision(sections: Mapping[str, Mapping[str, Any]], *, check: bool = False, timeout: float = 5.0) -> list[Outcome]:
    """One Outcome per destination (by name), creating what is missing unless `check`."""

    async def run() -> list[Outcome]:
        return [await _one(name, sections[name], check, timeout) for name in sorted(sections)]

    return asyncio.run(run())
