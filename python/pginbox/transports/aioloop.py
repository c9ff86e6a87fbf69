"""`LoopThread`: an asyncio event loop on a daemon thread, for the broker transports (aio-pika and
nats-py are asyncio libraries; the dispatcher delivers from worker threads). `LoopTransport`: what
the broker transports share on top of it (deliver, deliver_batch, close)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

from pginbox.errors import BrokerError
from pginbox.transports.protocol import DeliveryReport

__all__ = ["LoopThread", "LoopTransport"]

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


class LoopTransport:
    """A broker destination publishing from its own LoopThread. Subclasses set `timeout` and
    `_loop`, and write `_publish_all` (one report per effect, in order) and `_close`."""

    #: What the broker answers a publish with, named in the ambiguous reports.
    CONFIRM: ClassVar[str] = "confirm"
    timeout: float
    _loop: LoopThread

    def deliver(self, effect: Any) -> DeliveryReport:
        report = self.deliver_batch([effect])[0]
        if report.error is not None and report.error.startswith("ambiguous"):
            raise BrokerError(report.error)
        return report

    def deliver_batch(self, effects: Sequence[Any]) -> list[DeliveryReport]:
        try:
            return self._loop.run(self._publish_all(effects), self.timeout + 5.0)
        except TimeoutError:
            return [DeliveryReport.failed(f"ambiguous: no {self.CONFIRM} within {self.timeout:g} s", retryable=True)
                    for _ in effects]

    def close(self) -> None:
        self._loop.close(self._close())

    async def _publish_all(self, effects: Sequence[Any]) -> list[DeliveryReport]:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError
