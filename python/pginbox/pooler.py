"""Connection poolers between pginbox and PostgreSQL (PgBouncer in transaction or statement mode).

A transaction pooler gives each transaction whichever server connection is free: what a client left
on a server session (prepared statements, LISTEN, session-level advisory locks, SET) belongs to the
server connection, not to the client. psycopg prepares statements on the server session by default
(`prepare_threshold`, and pginbox's claim statements ask for it), so behind a transaction pooler a
client meets statements prepared by another client (42P05 duplicate_prepared_statement), misses its
own (26000 invalid_sql_statement_name), or runs another client's statement with its parameters.

Detection needs no setting: PgBouncer hands the client a backend process id of its own, which differs
from `pg_backend_pid()` of the server session. `Inbox` and `AsyncInbox` compare the two in the
schema check they run on first use, and behind a pooler they switch prepared statements off on every
connection they use (`configure`), the handler's statements included. For a pooler that passes the
server's process id through, configure the connections yourself:

    psycopg.connect(dsn, prepare_threshold=None)
    ConnectionPool(dsn, kwargs={"prepare_threshold": None})   # or configure=pginbox.pooler.configure

Some work needs one server session across transactions and cannot run behind a transaction pooler:
LISTEN (the dispatcher's wake-ups: give it a direct connection with --listen-dsn) and the
session-level advisory lock that `pginbox purge` holds (`refuse_pooled`).
"""

from __future__ import annotations

from typing import Any, Final

import psycopg

from pginbox.errors import PoolerError

__all__ = [
    "BACKEND_PID",
    "PoolerError",
    "behind_pooler",
    "configure",
    "differs",
    "refuse_pooled",
]

#: The server session's process id (compared with the one the client was given at login).
BACKEND_PID: Final = "SELECT pg_catalog.pg_backend_pid()"


def differs(client_pid: int | None, server_pid: object) -> bool:
    """True when the process id the client got at login is not the server session's: a pooler
    (PgBouncer) answered the login."""
    return isinstance(server_pid, int) and client_pid != server_pid


def configure(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Never prepare statements on this connection (safe behind a transaction pooler). Usable as the
    `configure` callback of a sync psycopg_pool.ConnectionPool; an AsyncConnectionPool awaits its
    callback: give it `aconfigure`."""
    conn.prepare_threshold = None


async def aconfigure(conn: psycopg.AsyncConnection[Any]) -> None:
    """`configure` for a psycopg_pool.AsyncConnectionPool (which awaits its callback)."""
    conn.prepare_threshold = None


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """Whether a pooler answered this connection's login (one query; the connection must be idle or
    in autocommit mode, and is left as it was)."""
    row = conn.execute(BACKEND_PID, prepare=False).fetchone()
    if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
        conn.rollback()
    return differs(conn.info.backend_pid, row[0] if row else None)


def refuse_pooled(pooled: bool, what: str) -> None:
    """PoolerError unless `pooled` is False: `what` needs one server session across transactions."""
    if pooled:
        raise PoolerError(
            f"{what} needs one server session across transactions, and this connection goes through a "
            "connection pooler (PgBouncer answered with a process id that is not the server's): connect "
            "to PostgreSQL directly for it (a DSN without the pooler's port)"
        )
