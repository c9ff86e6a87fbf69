"""Destinations for the dispatcher tests.

record / slow_record   Python callables for `pginbox dispatch --callable` subprocesses: append each
                       delivered effect id to the file named by $PGINBOX_TEST_SINK.
refuse_bad             the same, but ids starting with "bad" are refused for good (the effect goes dead).
DedupSink              a real HTTP webhook receiver on 127.0.0.1 that deduplicates on the
                       Idempotency-Key header, the way a destination must for at-least-once delivery
                       to become effectively once. It records every request (key, arrival order) and
                       applies each key once (`applied`); a repeat of a key is answered 200 without
                       being applied again. Per-test behaviour for the FIRST request of a key:
                         hold        accept (record + apply), then wait until release() before answering
                         slow_first  accept, then answer after `slow_first` seconds (past the client's timeout)
                       and `delay` (seconds) before every answer.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pginbox.dispatcher import DeliveryReport, Effect


def record(effect: Effect) -> None:
    with open(os.environ["PGINBOX_TEST_SINK"], "a", encoding="utf-8") as sink:
        sink.write(effect.effect_id + "\n")


def refuse_bad(effect: Effect) -> DeliveryReport:
    """Like record, but refuses (not retryable: the effect goes dead) ids that start with "bad"."""
    if effect.effect_id.startswith("bad"):
        return DeliveryReport.failed("refused by the test sink", retryable=False, status_code=422)
    record(effect)
    return DeliveryReport.ok()


def slow_record(effect: Effect) -> None:
    """Marks the start in $PGINBOX_TEST_SINK.started, takes a second, then records."""
    with open(os.environ["PGINBOX_TEST_SINK"] + ".started", "a", encoding="utf-8") as started:
        started.write(effect.effect_id + "\n")
    time.sleep(1.0)
    record(effect)


@dataclass(frozen=True)
class Request:
    key: str | None
    body: Any
    seq: int  # arrival order at the sink


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the webhook client reuses its connections
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        sink = self.server.sink
        first, held = sink.accept(self.headers.get("Idempotency-Key"), body)
        if first and sink.hold_first:
            held.wait(60)
        elif first and sink.slow_first:
            time.sleep(sink.slow_first)
        if sink.delay:
            time.sleep(sink.delay)
        reply = b'{"status": "applied"}' if first else b'{"status": "duplicate"}'
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
        except OSError:
            pass  # the client is gone (killed, or timed out)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    sink: DedupSink


class DedupSink:
    """See the module docstring. Use as a context manager; `url` is http://127.0.0.1:PORT/hook."""

    def __init__(self, *, hold_first: bool = False, slow_first: float = 0.0, delay: float = 0.0) -> None:
        self.hold_first = hold_first
        self.slow_first = slow_first
        self.delay = delay
        self.requests: list[Request] = []
        self.applied: Counter[str] = Counter()  # the deduplicated count per key: 0 or 1
        self.lock = threading.Lock()
        self._held: dict[str, threading.Event] = {}
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.sink = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def accept(self, key: str | None, body: Any) -> tuple[bool, threading.Event]:
        with self.lock:
            self.requests.append(Request(key, body, len(self.requests)))
            first = key is not None and self.applied[key] == 0
            if first and key is not None:
                self.applied[key] += 1
            event = self._held.setdefault(key or "", threading.Event())
        return first, event

    def release(self, key: str | None = None) -> None:
        """Let held first requests answer (all of them without `key`)."""
        with self.lock:
            events = list(self._held.values()) if key is None else [self._held.setdefault(key, threading.Event())]
        for event in events:
            event.set()

    def requests_for(self, key: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.key == key]

    def per_key(self) -> Counter[str | None]:
        with self.lock:
            return Counter(r.key for r in self.requests)

    def arrival_order(self) -> list[str | None]:
        with self.lock:
            return [r.key for r in self.requests]

    def config(self, path: Path, *, timeout: float = 30.0, name: str = "sink") -> Path:
        """A destinations TOML file (pginbox.transports) for `pginbox dispatch --config`."""
        path.write_text(
            f'[destinations.{name}]\nurl = "{self.url}"\ntimeout = {timeout}\nallow_hosts = ["127.0.0.1"]\n',
            encoding="utf-8",
        )
        return path

    def __enter__(self) -> DedupSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
