"""pginbox.pooler's pool callbacks on real pools: no statement is ever prepared."""

from __future__ import annotations

import asyncio

from psycopg_pool import AsyncConnectionPool, ConnectionPool

from pginbox import pooler


def test_configure_turns_preparing_off_in_a_sync_pool(db_dsn: str) -> None:
    pool = ConnectionPool(db_dsn, min_size=1, max_size=1, configure=pooler.configure, open=False)
    with pool, pool.connection(timeout=10) as conn:
        assert conn.prepare_threshold is None
        for _ in range(3):
            conn.execute("SELECT 1").fetchone()
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)


def test_aconfigure_turns_preparing_off_in_an_async_pool(db_dsn: str) -> None:
    async def main() -> None:
        pool = AsyncConnectionPool(db_dsn, min_size=1, max_size=1, configure=pooler.aconfigure, open=False)
        async with pool, pool.connection(timeout=10) as conn:
            assert conn.prepare_threshold is None
            for _ in range(3):
                await (await conn.execute("SELECT 1")).fetchone()
            cur = await conn.execute("SELECT count(*) FROM pg_prepared_statements")
            assert await cur.fetchone() == (0,)

    asyncio.run(main())
