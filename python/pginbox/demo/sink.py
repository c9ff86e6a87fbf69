"""Act 3's destination: a webhook receiver on 127.0.0.1 that fails, times out, and deduplicates on
Idempotency-Key as a destination must (or, with dedup off, books every request: a broken one)."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Sink", "SinkRequest"]


@dataclass(frozen=True)
class SinkRequest:
    path: str
    keys: tuple[str, ...]  # every Idempotency-Key header of the request
    body: Any
    answer: str  # "ok" | "duplicate" | "unavailable" | "held"


@dataclass
class Sink:
    """A webhook receiver on 127.0.0.1 that deduplicates on Idempotency-Key (unless `dedup` is off).

    The n-th request carrying a key gets, decided by a seeded hash of (key, n): a 503 without
    processing (`unavailable_rate`), or processing followed by an answer held `hold_seconds`
    (`hold_rate`: longer than the client waits), or processing and 200. From the 4th request of a
    key on, always the last. `counted[key]` is how often the sink acted on the key."""

    seed: int
    hold_rate: float
    unavailable_rate: float
    hold_seconds: float
    dedup: bool = True
    requests: list[SinkRequest] = field(default_factory=list)
    counted: Counter[str] = field(default_factory=Counter)
    _seen: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _active: int = 0
    _idle: threading.Condition = field(init=False)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._idle = threading.Condition(self._lock)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sink.handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = False  # server_close() joins every request thread: no request goes unrecorded
            request_queue_size = 128

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="pginbox-demo-sink", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Wait for held answers to finish, then shut the server down (joining its threads)."""
        with self._idle:
            self._idle.wait_for(lambda: self._active == 0, timeout=self.hold_seconds + 5)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def fault(self, key: str, n: int) -> str:
        if n >= 4:
            return "ok"
        r = random.Random(f"{self.seed}:{key}:{n}").random()
        if r < self.hold_rate:
            return "held"
        if r < self.hold_rate + self.unavailable_rate:
            return "unavailable"
        return "ok"

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        raw = request.rfile.read(length)
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        keys = tuple(request.headers.get_all("Idempotency-Key") or ())
        key = keys[0] if len(keys) == 1 else ""
        with self._lock:
            self._active += 1
            self._seen[key] += 1
            plan = self.fault(key, self._seen[key])
            if plan == "unavailable":
                answer = "unavailable"
            elif self.dedup and self.counted[key]:
                answer = "duplicate"  # done before: answer as then, do not act again
            else:
                self.counted[key] += 1  # the sink acts on the request (books it)
                answer = plan
            self.requests.append(SinkRequest(request.path, keys, body, answer))
        try:
            if answer == "unavailable":
                self._answer(request, 503, b'{"error": "try again"}')
                return
            if answer == "held":
                time.sleep(self.hold_seconds)  # processed; the answer comes after the client gave up
            self._answer(request, 200, b'{"ok": true}')
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    @staticmethod
    def _answer(request: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        with contextlib.suppress(OSError):  # a held answer: the client has gone
            request.send_response(status)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
