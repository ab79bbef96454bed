"""The memory store's asyncio side: the same store, its calls awaitable (nothing here waits on
I/O); a delivery's connection is the ``MemoryTransaction``, as for blocking handlers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.model import Claim, DeadKey, NewEvent, Outcome
from ..storekit import AsyncBatchBase, AsyncDeliveriesBase, AsyncStoreBase, SettleItem
from ..waiter import AsyncClosingWaiter
from .tables import AsyncCommitWaiter

if TYPE_CHECKING:
    from .store import MemoryBatch, MemoryDelivery, MemoryStore
    from .transaction import MemoryTransaction

__all__ = ["AsyncMemory"]


class AsyncMemoryDelivery:
    """A delivery transaction for async code: the blocking one's writes, awaitable."""

    def __init__(self, tx: MemoryDelivery) -> None:
        self._tx = tx

    async def open(self) -> None:
        """Nothing to do: a memory delivery is open from the start."""

    @property
    def connection(self) -> MemoryTransaction:
        return self._tx.connection

    async def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        return self._tx.enqueue(events)

    async def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        self._tx.record(handler, outcome, reason=reason)


class AsyncMemoryDeliveries(AsyncDeliveriesBase):
    """The async twin of the store or of one of its batches (``Deliveries``)."""

    def __init__(self, deliveries: MemoryStore | MemoryBatch) -> None:
        self._deliveries = deliveries

    @asynccontextmanager
    async def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AsyncIterator[AsyncMemoryDelivery]:
        with self._deliveries.delivery(claim, now=now) as tx:
            yield AsyncMemoryDelivery(tx)

    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        return self._deliveries.extend(claims, lease=lease, now=now)

    async def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        return self._deliveries.settle_many(items, now=now)


class AsyncMemoryBatch(AsyncMemoryDeliveries, AsyncBatchBase):
    """The async twin of one of the store's batches."""


class AsyncMemory(AsyncMemoryDeliveries, AsyncStoreBase):
    """``MemoryStore.async_store()``."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self._store = store

    async def enqueue(
        self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        return self._store.enqueue(conn, events, now=now)

    async def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        return self._store.claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    @asynccontextmanager
    async def batch(self, *, now: datetime | None) -> AsyncIterator[AsyncMemoryBatch]:
        with self._store.batch(now=now) as batch:
            yield AsyncMemoryBatch(batch)

    async def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        return self._store.release(claims, now=now)

    def make_waiter(self) -> AsyncClosingWaiter | None:
        return AsyncCommitWaiter(self._store.tables)

    async def close(self) -> None:
        """Nothing of its own to release."""
