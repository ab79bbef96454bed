"""``MemoryStore``: a real, transactional store in memory (``memory://``), with its delivery
transaction and its batch.

It is the reference the conformance suite is written against, and the store to use in unit tests
of an app that has no database of its own. Writes are buffered in a ``MemoryTransaction`` and
applied atomically at commit; a rolled-back transaction leaves no trace. A delivery transaction
holds a row lock on its event, and claims skip locked rows, as ``FOR UPDATE SKIP LOCKED`` does.
All state sits behind one lock (``tables.Tables``), so pollers in several threads may share a
store.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from ..core.model import (
    AttemptError,
    Claim,
    DeadKey,
    DeadLetter,
    DeliveryRecord,
    Event,
    NewEvent,
    Outcome,
    Stats,
)
from ..errors import ConfigurationError, HandlerCrashed, LeaseLostError
from ..storekit import BatchBase, Capabilities, SettleItem, StoreBase
from ..waiter import ClosingWaiter
from .aio import AsyncMemory
from .tables import CommitWaiter, Row, Settle, Tables, now_or_wall
from .transaction import MemoryTransaction

__all__ = ["MemoryBatch", "MemoryDelivery", "MemoryStore"]


class MemoryDelivery:
    """A delivery transaction: a ``MemoryTransaction`` (its own, or in a batch the batch's)
    plus the claim it is fenced by."""

    def __init__(self, claim: Claim, now: datetime, tx: MemoryTransaction) -> None:
        self._claim = claim
        self._now = now
        self.tx = tx

    @property
    def connection(self) -> MemoryTransaction:
        return self.tx

    def check_kept(self) -> None:
        """R17: the handler did not try to end its delivery transaction.

        Raises:
            HandlerCrashed: it tried to (refused, whatever it made of the refusal).
        """
        if self.tx.refused is not None:
            raise HandlerCrashed(
                f"event {self._claim.event.id}: a handler tried to {self.tx.refused} its "
                "delivery transaction; outboxkit commits it together with the delivery record, "
                "so nothing of this delivery was committed and it runs again"
            )

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        tx = self.tx
        tx.check_open()
        return tx.tables.enqueue(tx, tx.pending, events, self._now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        if not outcome.recorded:
            raise ConfigurationError(
                f"only succeeded/rejected outcomes are recorded, got {outcome}"
            )
        self.tx.check_open()
        self.tx.pending.records.append(
            DeliveryRecord(
                event_id=self._claim.event.id,
                handler=handler,
                outcome=outcome,
                attempt=self._claim.attempt,
                recorded_at=self._now,
                reason=reason,
            )
        )


class MemoryBatch(BatchBase):
    """One transaction for a claimed batch (``transaction="per_batch"``): deliveries are
    savepoints of it, settlements wait in it, and it commits once."""

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self.tx = MemoryTransaction(tables, managed=True)
        self.locked: dict[int, Row] = {}  # event id -> the row this batch holds

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[MemoryDelivery]:
        self._lock(claim)
        delivery = MemoryDelivery(claim, now_or_wall(now), self.tx)
        mark = self.tx.pending.mark()
        self.tx.refused = None
        try:
            yield delivery
            delivery.check_kept()
        except BaseException:
            self.tx.pending.roll_back_to(mark)
            raise

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """Each settlement waits in the batch's transaction: applied when it commits."""
        at = now_or_wall(now)
        done = []
        for claim, settlement, error in items:
            try:
                self._lock(claim)
            except LeaseLostError:
                done.append(False)
                continue
            with self._tables.lock:
                settleable = self._tables.settleable(claim) is not None
            if settleable:
                self.tx.pending.settles.append(Settle(claim, settlement, error, at))
            done.append(settleable)
        return done

    def _lock(self, claim: Claim) -> None:
        self.locked[claim.event.id] = self._tables.lock_row(claim, self)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        # Applied at once (nothing to roll back but the lease), but claims this batch has
        # settled are no longer owned, as inside a database transaction.
        settled = {s.claim.token for s in self.tx.pending.settles}
        live = [c for c in claims if c.token not in settled]
        return self._tables.extend(live, lease, now_or_wall(now))


class MemoryStore(StoreBase):
    """A transactional in-memory store (``memory://``). Thread-safe; one process only.

    Usage::

        store = MemoryStore()
        with store.transaction() as tx:          # the "app transaction"
            outbox.enqueue(tx, "order.placed", {"order_id": 42})
            tx.insert("orders", {"id": 42})      # app rows, committed together
    """

    capabilities = Capabilities(
        batches=True,
        transactional_handlers=True,
        concurrent_claimers=True,
        concurrent_batches=True,
        asyncio=True,
        ordering=True,
        dedupe=True,
        error_history=True,
    )
    url: str | None = None  # another process's memory:// is another store
    options: Mapping[str, Any] = MappingProxyType({})

    def __init__(self) -> None:
        self.tables = Tables()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryStore:
        """The factory behind ``open_store("memory://")``; every call gives a new, empty store."""
        if options:
            raise ConfigurationError(f"memory:// takes no options, got {sorted(options)}")
        if url.rstrip("/").lower() != "memory:":
            raise ConfigurationError(f"the memory store's URL is just 'memory://', got {url!r}")
        return cls()

    def __repr__(self) -> str:
        return f"MemoryStore({len(self.tables.events)} events)"

    # -- transactions ---------------------------------------------------------------------------

    def begin(self) -> MemoryTransaction:
        """A new open transaction; call ``commit()`` or ``rollback()`` on it."""
        self.tables.check_open()
        return MemoryTransaction(self.tables)

    @contextmanager
    def transaction(self) -> Iterator[MemoryTransaction]:
        """An app transaction: committed when the block ends, rolled back if it raises."""
        tx = self.begin()
        try:
            yield tx
        except BaseException:
            tx.discard()
            raise
        tx.apply()

    def rows(self, table: str) -> list[dict[str, Any]]:
        """Committed app rows of ``table``."""
        return self.tables.rows_of(table)

    # -- Store protocol -------------------------------------------------------------------------

    def migrate(self) -> None:
        """Nothing to create: the memory store has no versioned schema (returns None)."""
        self.tables.check_open()

    def close(self) -> None:
        with self.tables.lock:
            self.tables.closed = True

    def now(self) -> datetime:
        self.tables.check_open()
        return now_or_wall(None)

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        if not isinstance(conn, MemoryTransaction) or conn.tables is not self.tables:
            raise ConfigurationError(
                "the memory store enqueues through a transaction of the same store "
                f"(store.transaction() or store.begin()), got {conn!r}"
            )
        conn.check_open()
        return self.tables.enqueue(conn, conn.pending, events, now_or_wall(now))

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        return self.tables.claim(batch_size, lease, now_or_wall(now), dead_key)

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[MemoryDelivery]:
        tables = self.tables
        delivery = MemoryDelivery(claim, now_or_wall(now), MemoryTransaction(tables, managed=True))
        row = tables.lock_row(claim, delivery)
        try:
            yield delivery
            delivery.check_kept()
        except BaseException:
            delivery.tx.discard()
            raise
        else:
            with tables.lock:
                if tables.owned(claim) is None:  # cannot happen while we hold the row lock
                    delivery.tx.discard()
                    raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
                delivery.tx.apply()
        finally:
            tables.unlock([row], delivery)

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[MemoryBatch]:
        """One transaction for a claimed batch (``transaction="per_batch"``)."""
        self.tables.check_open()
        batch = MemoryBatch(self.tables)
        try:
            yield batch
        except BaseException:
            batch.tx.discard()
            raise
        else:
            batch.tx.apply()
        finally:
            self.tables.unlock(batch.locked.values(), batch)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        return self.tables.extend(claims, lease, now_or_wall(now))

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        return self.tables.settle_many(items, now_or_wall(now))

    def make_waiter(self) -> ClosingWaiter | None:
        """A waiter that every commit adding events wakes: an enqueue's own wake
        (``Outbox.wake``) comes before its transaction commits, when a poll finds nothing."""
        return CommitWaiter(self.tables)

    def async_store(self) -> AsyncMemory:
        """The asyncio side: the same store, its calls awaitable (nothing here waits on I/O).
        A delivery's connection is the ``MemoryTransaction``, as for blocking handlers."""
        return AsyncMemory(self)

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        return self.tables.release(claims)

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        return self.tables.requeue(ids, now_or_wall(now))

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        return self.tables.dead_letters(topic, since, limit)

    def get(self, event_id: int) -> Event | None:
        return self.tables.get(event_id)

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        return self.tables.list_events(after_id, topic, limit)

    def records(self, event_id: int) -> list[DeliveryRecord]:
        return self.tables.records_of(event_id)

    def attempt_errors(self, event_id: int) -> list[AttemptError]:
        with self.tables.lock:
            row = self.tables.events.get(event_id)
            return [] if row is None else list(row.errors)

    def purge_published(self, *, before: datetime, limit: int) -> int:
        tables = self.tables
        with tables.lock:
            doomed = [
                r
                for r in tables.events.values()
                if r.published_at is not None and r.published_at < before
            ]
            return tables.purge(doomed, limit)

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        wanted = None if ids is None else set(ids)
        tables = self.tables
        with tables.lock:
            doomed = [
                r
                for r in tables.events.values()
                if r.failed_at is not None
                and (wanted is None or r.id in wanted)
                and (before is None or r.failed_at < before)
            ]
            return tables.purge(doomed, limit)

    def stats(self, *, now: datetime | None) -> Stats:
        return self.tables.stats(now_or_wall(now))
