"""The helpers that differ between the async tests and the sync tests generated from them
(python/tools/async_to_sync.py renames each async helper to its sync twin: aconnect -> connect,
agather -> gather, abarrier_once -> barrier_once).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg
from helpers_inbox import SAFE_OPTIONS

T = TypeVar("T")

BARRIER_TIMEOUT = 20.0


async def aconnect(dsn: str, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
    """A connection with the safety timeouts (not autocommit unless asked)."""
    kwargs.setdefault("options", SAFE_OPTIONS)
    return await psycopg.AsyncConnection.connect(dsn, **kwargs)


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A connection with the safety timeouts (not autocommit unless asked)."""
    kwargs.setdefault("options", SAFE_OPTIONS)
    return psycopg.connect(dsn, **kwargs)


async def agather(*calls: Callable[[], Awaitable[T]], concurrency: int | None = None) -> list[T]:
    """Run the calls concurrently (tasks, all at once: `concurrency` bounds the sync twin's threads);
    their results in order."""
    return list(await asyncio.gather(*(call() for call in calls)))


def gather(*calls: Callable[[], T], concurrency: int | None = None) -> list[T]:
    """Run the calls concurrently, each in a thread (at most `concurrency` at once); their results
    in order."""
    with ThreadPoolExecutor(concurrency or max(len(calls), 1)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def abarrier_once(parties: int) -> Callable[[], Awaitable[None]]:
    """A barrier that only the first attempt of each task waits on (a retry runs in the same task)."""
    barrier = asyncio.Barrier(parties)
    seen: set[asyncio.Task[Any] | None] = set()

    async def wait() -> None:
        me = asyncio.current_task()
        if me not in seen:
            seen.add(me)
            await asyncio.wait_for(barrier.wait(), BARRIER_TIMEOUT)

    return wait


def barrier_once(parties: int) -> Callable[[], None]:
    """A barrier that only the first attempt of each thread waits on (a retry runs in the same
    thread)."""
    barrier = threading.Barrier(parties, timeout=BARRIER_TIMEOUT)
    seen: set[int] = set()
    lock = threading.Lock()

    def wait() -> None:
        me = threading.get_ident()
        with lock:
            first = me not in seen
            seen.add(me)
        if first:
            barrier.wait()

    return wait
