"""Shared by test_library.py and test_library_async.py: the Python handlers, a COMMIT that can be
made to hang (so that its backend can be terminated mid-COMMIT), and a TCP proxy that loses the
client connection right after forwarding a COMMIT (the commit happens, the client never hears).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
from helpers_inbox import PRODUCER, wait_until
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pginbox import Message

# A deferred constraint trigger on the ledger: it runs at COMMIT and sleeps while armed, so a test
# can terminate the backend in the middle of COMMIT (before the commit record is written).
COMMIT_DELAY_DDL = """
CREATE TABLE commit_delay(seconds float8 NOT NULL);
INSERT INTO commit_delay VALUES (0);
CREATE FUNCTION sleep_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_sleep(seconds) FROM commit_delay WHERE seconds > 0;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER ledger_sleep_at_commit AFTER INSERT ON ledger
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION sleep_at_commit();
"""

CREDIT_SQL = "SELECT apply_credit(%s, %s, %s)"


def message(message_id: str, amount: int = 10, account: int = 1, **kw: Any) -> Message:
    """A 'credit' message whose payload names the account and amount (like helpers_inbox.payload)."""
    return Message(PRODUCER, message_id, "credit", {"id": message_id, "account": account, "amount": amount}, **kw)


def credit_args(m: Message) -> tuple[Any, ...]:
    return (m.payload["account"], m.message_id, m.payload["amount"])


class Calls:
    """Counts handler invocations (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.n = 0

    def __call__(self) -> int:
        with self._lock:
            self.n += 1
            return self.n


def terminate_backend_in_commit(observer: psycopg.Connection[Any], timeout: float = 20.0) -> int:
    """Wait until a backend sleeps inside COMMIT (the armed trigger), disarm the trigger, and
    terminate that backend. Returns its pid."""
    found: list[int] = []

    def sleeping() -> bool:
        row = observer.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event = 'PgSleep' AND query = 'COMMIT'"
        ).fetchone()
        if row is not None:
            found.append(int(row[0]))
        return row is not None

    wait_until(sleeping, "a backend sleeping inside COMMIT", timeout)
    observer.execute("UPDATE commit_delay SET seconds = 0")
    observer.execute("SELECT pg_terminate_backend(%s)", (found[0],))
    return found[0]


class CommitDroppingProxy:
    """A TCP proxy to PostgreSQL on 127.0.0.1. While armed, the first COMMIT a client sends is
    forwarded, the server's answer is awaited (the commit has happened) and thrown away, and both
    sockets are closed: the client loses its connection during COMMIT without an answer."""

    def __init__(self, dsn: str) -> None:
        params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
        self._target = (str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)))
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port: int = self._listener.getsockname()[1]
        params.update(host="127.0.0.1", port=str(self.port), sslmode="disable", gssencmode="disable")
        self.dsn = make_conninfo("", **params)
        self._armed = threading.Event()
        self.dropped = threading.Event()
        self._closing = False
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def arm(self) -> None:
        self.dropped.clear()
        self._armed.set()

    def close(self) -> None:
        self._closing = True
        for s in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> CommitDroppingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, server]
            self._spawn(self._client_to_server, client, server)
            self._spawn(self._server_to_client, server, client)

    def _client_to_server(self, client: socket.socket, server: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self._armed.is_set() and b"COMMIT\x00" in data:
                    self._armed.clear()
                    self._drop_after(data, client, server)
                    return
                server.sendall(data)
        self._close_pair(client, server)

    def _server_to_client(self, server: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                client.sendall(data)
        self._close_pair(client, server)

    def _drop_after(self, data: bytes, client: socket.socket, server: socket.socket) -> None:
        # Stop relaying answers to this client first, then let the COMMIT through.
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)
        # The server-to-client thread now fails to relay; read the COMMIT answer ourselves.
        server.sendall(data)
        self.dropped.set()
        self._close_pair(client, server)

    @staticmethod
    def _close_pair(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()


@contextlib.contextmanager
def observer(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn
