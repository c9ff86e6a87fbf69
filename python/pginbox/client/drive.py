"""The two drivers of the transaction protocol (pginbox.client.protocol): `drive` runs its
operations with blocking calls, `drive_async` awaits them. The protocol itself does no I/O."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TypeVar

from pginbox.client.protocol import Call, Steps

__all__ = ["drive", "drive_async"]

T = TypeVar("T")


def drive(steps: Steps[T]) -> T:
    """Run the protocol `steps` to their end with blocking calls; their value."""
    send: object = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        send, error = None, None
        try:
            if isinstance(op, Call):
                send = op.fn()
            else:
                time.sleep(op.seconds)
        except BaseException as exc:
            error = exc


async def drive_async(steps: Steps[T]) -> T:
    """Run the protocol `steps` to their end, awaiting what their calls return; their value."""
    send: object = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        send, error = None, None
        try:
            if isinstance(op, Call):
                send = op.fn()
                if inspect.isawaitable(send):
                    send = await send
            else:
                await asyncio.sleep(op.seconds)
        except BaseException as exc:
            error = exc
