"""`TcpProxy`: a loopback TCP proxy between a client and a server that a test can turn against
them: `refuse = True` closes new connections at once (a server refusing connections), `cut()`
drops every open connection (a network cut)."""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["TcpProxy"]


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.refuse = False
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}")

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._listener.close()
        self.cut()

    def cut(self) -> None:
        """Drop every open connection (both sides see a reset / EOF)."""
        with self._lock:
            socks, self._open = self._open, set()
            if socks:
                self.cuts += 1
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            if self.refuse:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
