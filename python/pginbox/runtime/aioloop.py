"""`LoopThread`: an asyncio event loop on a daemon thread. The broker publishers are asyncio code
(aio-pika, nats-py, redis.asyncio) and the dispatcher delivers from worker threads: each broker
destination runs its publisher on a LoopThread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (TimeoutError after `timeout` seconds,
        the coroutine cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self, final: Coroutine[Any, Any, object] | None = None) -> None:
        if self.loop.is_closed():
            return
        if final is not None:
            with contextlib.suppress(Exception):  # closing anyway
                self.run(final, 5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()
