"""The asyncio side of a SQL store (``outboxkit.storekit.sql``): ``SQLStore``'s hot path and
``SQLBatch`` on async connections, with the same statements and error mapping."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from typing import Any

from ..core.model import Claim, DeadKey
from ..store import SettleItem
from .bases import AsyncBatchBase, AsyncStoreBase
from .sql import KeptRecords, Row, SQLStore

__all__ = ["AsyncSQLBatch", "AsyncSQLStore"]


class AsyncSQLStore(AsyncStoreBase):
    """The asyncio side of a SQL store: the hot path of ``store`` on async connections, name for
    name with ``SQLStore``'s, with the same statements (``store.statements``) and the same
    error mapping (``store.dialect.mapped``). A store's asyncio side writes its async
    connections (``write``, ``rows``) and what is its own (enqueue through the app's async
    connection, the delivery and batch transactions, the async waiter).

    Args:
        store: the blocking store whose asyncio side this is.
    """

    def __init__(self, store: SQLStore) -> None:
        self.store = store

    @abstractmethod
    def write(self, doing: str) -> AbstractAsyncContextManager[Any]:
        """An async connection in a short write transaction, committed when the block ends;
        driver errors mapped (with the blocking store's mapping), naming ``doing``."""

    @abstractmethod
    async def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        """Run the named statement on ``conn``; its rows (none for one that returns none)."""

    # -- claims and leases ----------------------------------------------------------------------

    async def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        statements = self.store.statements
        async with self.write("claim events") as conn:
            rows = await self.rows(conn, *statements.claim_query(batch_size, lease, now, dead_key))
        return statements.claims(rows)

    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        async with self.write(f"extend {len(claims)} lease(s)") as conn:
            return await self.extend_on(conn, claims, lease, now)

    async def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        if not items:
            return []
        async with self.write(f"settle {len(items)} event(s)") as conn:
            return await self.settle_many_on(conn, items, now)

    async def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        if not claims:
            return 0
        async with self.write(f"release {len(claims)} claim(s)") as conn:
            return len(await self.rows(conn, *self.store.statements.release_query(claims)))

    async def extend_on(
        self, conn: Any, claims: Sequence[Claim], lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        statements = self.store.statements
        rows = await self.rows(conn, *statements.extend_query(claims, lease, now))
        return statements.extended(claims, rows)

    async def settle_many_on(
        self, conn: Any, items: Sequence[SettleItem], now: datetime | None
    ) -> list[bool]:
        statements = self.store.statements
        rows = await self.rows(conn, *statements.settle_many_query(items, now))
        return statements.settled(items, rows)


class AsyncSQLBatch(KeptRecords, AsyncBatchBase):
    """``SQLBatch`` for async code: the batch's lease extensions, its kept records and its
    ``settle_many`` on the batch's own async connection. Its ``delivery`` (a savepoint) is the
    store's own.

    Args:
        side: the store's asyncio side.
        conn: the batch's async connection.
    """

    def __init__(self, side: AsyncSQLStore, conn: Any) -> None:
        super().__init__()
        self.side = side
        self.conn = conn

    def check_open(self) -> None:
        """``SQLBatch.check_open``."""

    async def begin(self) -> None:
        """``SQLBatch.begin``."""

    async def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """``SQLBatch.record_many``: kept, written with the batch's settlement."""
        self.check_open()
        self.keep_succeeded(self.side.store.dialect, handler, claims, now)
        return [True] * len(claims)

    async def write_kept(self) -> None:
        """``SQLBatch.write_kept``: the kept records in one statement, each fenced by token."""
        if not self.kept:
            return
        rows = self.take_kept()
        self.check_open()
        store = self.side.store
        with store.dialect.mapped(f"record {len(rows)} deliveries", self.conn):
            await self.side.rows(self.conn, *store.statements.kept_query(rows))

    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        self.check_open()
        await self.begin()
        with self.side.store.dialect.mapped(f"extend {len(claims)} lease(s)", self.conn):
            return await self.side.extend_on(self.conn, claims, lease, now)

    async def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``SQLBatch.settle_many``."""
        self.check_open()
        await self.begin()
        return await self.settle(items, now)

    async def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``SQLBatch.settle_last``."""
        self.check_open()
        return await self.settle(items, now)

    async def settle(self, items: Sequence[SettleItem], now: datetime | None) -> list[bool]:
        """``SQLBatch.settle``."""
        if not items:
            await self.write_kept()
            return []
        store = self.side.store
        dialect, statements = store.dialect, store.statements
        together = statements.settle_kept(items, self.kept, now)
        if together is not None:
            self.kept = []
            with dialect.mapped(f"settle and record {len(items)} event(s)", self.conn):
                return statements.settled(items, await self.side.rows(self.conn, *together))
        if self.kept:
            await self.begin()  # the records and the settlement: one transaction
        await self.write_kept()
        with dialect.mapped(f"settle {len(items)} event(s)", self.conn):
            return await self.side.settle_many_on(self.conn, items, now)
