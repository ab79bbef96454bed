"""``AsyncSQLStore``: the asyncio side of a SQL store, name for name with ``SQLStore``'s hot path.

It runs the very statements of its blocking store, built and mapped by that store's own code
(``SQLStore._claim_query`` / ``_claims`` ...), with the same error mapping: only the waiting is
its own. A store's asyncio side fills in the async dialect seam - its async transactions and
``_rows`` - plus what is its own (enqueue through the app's async connection, the delivery and
batch transactions, the async waiter).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from typing import Any

from ..core.model import Claim, DeadKey
from ..storekit import AsyncBatchBase, AsyncStoreBase, SettleItem
from .base import KeptRecords, Row, SQLStore

__all__ = ["AsyncSQLBatch", "AsyncSQLStore"]


class AsyncSQLStore(AsyncStoreBase):
    """The hot path of ``store`` on async connections (see the module docstring)."""

    def __init__(self, store: SQLStore) -> None:
        self._store = store

    # -- the async dialect seam -------------------------------------------------------------------

    @abstractmethod
    def _write(self, doing: str) -> AbstractAsyncContextManager[Any]:
        """An async connection in a short write transaction, committed when the block ends;
        driver errors mapped (with the blocking store's mapping), naming ``doing``."""

    @abstractmethod
    async def _rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        """Run the named statement on ``conn``; its rows (none for one that returns none)."""

    # -- claims and leases ------------------------------------------------------------------------

    async def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        store = self._store
        async with self._write("claim events") as conn:
            rows = await self._rows(conn, *store._claim_query(batch_size, lease, now, dead_key))
        return store._claims(rows)

    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        async with self._write(f"extend {len(claims)} lease(s)") as conn:
            return await self._extend_on(conn, claims, lease, now)

    async def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        if not items:
            return []
        async with self._write(f"settle {len(items)} event(s)") as conn:
            return await self._settle_many_on(conn, items, now)

    async def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        if not claims:
            return 0
        async with self._write(f"release {len(claims)} claim(s)") as conn:
            return len(await self._rows(conn, *self._store._release_query(claims)))

    async def _extend_on(
        self, conn: Any, claims: Sequence[Claim], lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        store = self._store
        rows = await self._rows(conn, *store._extend_query(claims, lease, now))
        return store._extended(claims, rows)

    async def _settle_many_on(
        self, conn: Any, items: Sequence[SettleItem], now: datetime | None
    ) -> list[bool]:
        store = self._store
        rows = await self._rows(conn, *store._settle_many_query(items, now))
        return store._settled(items, rows)


class AsyncSQLBatch(KeptRecords, AsyncBatchBase):
    """``SQLBatch`` for async code: the batch's lease extensions, its kept records and its
    ``settle_many`` on the batch's own async connection. Its ``delivery`` (a savepoint) is the
    store's own."""

    def __init__(self, side: AsyncSQLStore, conn: Any) -> None:
        super().__init__()
        self._side = side
        self._conn = conn

    def _check_open(self) -> None:
        """Raise if the batch's transaction is no longer the one the store opened."""

    async def _begin(self) -> None:
        """``SQLBatch._begin``: make sure the batch's transaction has begun."""

    async def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """``SQLBatch.record_many``: kept, written with the batch's settlement."""
        self._check_open()
        self._keep_succeeded(self._side._store, handler, claims, now)
        return [True] * len(claims)

    async def write_kept(self) -> None:
        """``SQLBatch.write_kept``: the kept records in one statement, each fenced by token."""
        if not self._kept:
            return
        rows = self._take_kept()
        self._check_open()
        store = self._side._store
        with store._mapped(f"record {len(rows)} deliveries", self._conn):
            await self._side._rows(self._conn, *store._kept_query(rows))

    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        self._check_open()
        await self._begin()
        with self._side._store._mapped(f"extend {len(claims)} lease(s)", self._conn):
            return await self._side._extend_on(self._conn, claims, lease, now)

    async def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``settle_many`` inside the batch's transaction: true once the batch commits (with
        the kept records, as ``SQLBatch.settle_many``)."""
        self._check_open()
        await self._begin()
        return await self._settle(items, now)

    async def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``AsyncBatchTransaction.settle_last``, as ``SQLBatch.settle_last``."""
        self._check_open()
        return await self._settle(items, now)

    async def _settle(self, items: Sequence[SettleItem], now: datetime | None) -> list[bool]:
        if not items:
            await self.write_kept()
            return []
        store = self._side._store
        together = store._settle_kept_query(items, self._kept, now)
        if together is not None:
            self._kept = []
            with store._mapped(f"settle and record {len(items)} event(s)", self._conn):
                return store._settled(items, await self._side._rows(self._conn, *together))
        if self._kept:
            await self._begin()  # the records and the settlement: one transaction
        await self.write_kept()
        with store._mapped(f"settle {len(items)} event(s)", self._conn):
            return await self._side._settle_many_on(self._conn, items, now)
