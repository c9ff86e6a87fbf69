"""`HealthServer`: GET /healthz and GET /metrics of a running daemon (`pginbox dispatch
--health-port`, `pginbox consume --health-port`)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pginbox.runtime.log import kv

__all__ = ["HealthServer", "Monitored"]

log = logging.getLogger("pginbox.health")


class Monitored(Protocol):
    """What HealthServer serves: a pginbox.dispatcher.Dispatcher or a pginbox.consumer.Consumer."""

    name: str
    registry: CollectorRegistry

    def health(self) -> tuple[bool, dict[str, Any]]: ...


class HealthServer:
    """GET /healthz (200 or 503, JSON from .health()) and GET /metrics (Prometheus text of
    .registry) of a Dispatcher or a Consumer, on a daemon thread. Port 0 picks a free port (see
    `.port`). Bind it to loopback unless the network in front of it is trusted: it needs no
    authentication."""

    def __init__(self, dispatcher: Monitored, host: str = "127.0.0.1", port: int = 0) -> None:
        self.dispatcher = dispatcher
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    healthy, details = owner.dispatcher.health()
                    self._reply(
                        200 if healthy else 503, "application/json", json.dumps(details, sort_keys=True).encode()
                    )
                elif path == "/metrics":
                    self._reply(200, CONTENT_TYPE_LATEST, generate_latest(owner.dispatcher.registry))
                else:
                    self._reply(404, "text/plain; charset=utf-8", b"GET /healthz or /metrics\n")

            def _reply(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(body)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"health-{dispatcher.name}",
            daemon=True,
        )

    def start(self) -> HealthServer:
        self._thread.start()
        log.info(kv("health_listening", daemon=self.dispatcher.name, host=self.host, port=self.port))
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
