"""The base classes of ``outboxkit.storekit``: the required methods, and the defaults of the
rest (see the package's docstring for what each does)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Self

from ..capabilities import Capabilities
from ..core.model import (
    AttemptError,
    Claim,
    DeadKey,
    DeadLetter,
    DeliveryRecord,
    Event,
    Migration,
    NewEvent,
    Outcome,
    State,
    Stats,
    state_of,
)
from ..errors import ConfigurationError, LeaseLostError
from ..store import (
    AsyncBatchTransaction,
    AsyncDeliveries,
    AsyncDeliveryTransaction,
    AsyncStore,
    BatchTransaction,
    Deliveries,
    DeliveryTransaction,
    SettleItem,
)
from ..waiter import AsyncClosingWaiter, ClosingWaiter
from .rows import fold_stats

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "PAGE_SIZE",
    "AsyncBatchBase",
    "AsyncDeliveriesBase",
    "AsyncStoreBase",
    "BatchBase",
    "DeliveriesBase",
    "StoreBase",
]

PAGE_SIZE = 1000
"""How many events the defaults read per ``events`` call."""


# -- the blocking side ------------------------------------------------------------------------


class DeliveriesBase(ABC):
    """Where one round's deliveries go (``Deliveries``): the store itself, a round of its
    own, or a batch. Three methods to write; ``record_many`` is made of ``delivery``."""

    @abstractmethod
    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractContextManager[DeliveryTransaction]:
        """A delivery transaction fenced by ``claim.token`` (see ``Deliveries.delivery``).

        Raises:
            LeaseLostError: the token is stale; nothing is written.
        """

    @abstractmethod
    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        """R13: push the leases of ``claims`` to ``now + lease``; returns those still owned,
        with their new ``locked_until``."""

    @abstractmethod
    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """R8: each item's settlement, fenced by its token, the lease cleared; which were
        settled (False: the token was stale, nothing changed)."""

    def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """Record ``handler`` as succeeded for each of ``claims`` (a relay's confirms).

        Default: one ``delivery`` and ``record`` per claim. A store that can write them
        together (one statement, or kept for a batch's settlement) overrides it.

        Args:
            handler: the handler's name.
            claims: the claims whose runs succeeded, each fencing its own record.
            now: the instant to stamp the records with (None: the store's clock).

        Returns:
            Per claim, whether its record was written (False: its token was stale).

        Raises:
            StoreError: the store failed.
        """
        written: list[bool] = []
        for claim in claims:
            try:
                with self.delivery(claim, now=now) as tx:
                    tx.record(handler, Outcome.SUCCEEDED)
            except LeaseLostError:
                written.append(False)
            else:
                written.append(True)
        return written


class BatchBase(DeliveriesBase):
    """A batch transaction (``BatchTransaction``, what ``StoreBase.batch`` yields): the three
    methods of ``DeliveriesBase`` on the batch's one transaction, each delivery a savepoint."""

    def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """The batch's settlement as its last write (see ``BatchTransaction.settle_last``).

        Default: ``settle_many``; the batch's block then commits, as ever.

        Returns:
            Which items were settled (true once the batch commits).

        Raises:
            StoreError: the store failed.
        """
        return self.settle_many(items, now=now)

    def claimed(self, claims: Sequence[Claim]) -> None:
        """The batch's claims, before its first delivery (``BatchTransaction.claimed``).
        Default: nothing."""
        return None


class StoreBase(DeliveriesBase):
    """A store (``Store``) from twelve methods: ``enqueue``, ``transaction``, ``claim``,
    ``delivery``, ``extend``, ``settle_many``, ``release``, ``requeue``, ``events``,
    ``records``, ``purge_published`` and ``purge_dead``. Everything else has a default, made
    of those or of nothing (see ``outboxkit.storekit``); override a default where the store
    can do better (a ``get`` by primary key, ``stats`` in one query).
    """

    capabilities: Capabilities = Capabilities()
    """What the store offers; the default declares none of the optional parts."""

    url: str | None = None
    """The URL that ``open_store(store.url, **store.options)`` opens the store with in another
    process (with ``multiprocess``), or None."""

    options: Mapping[str, Any] = MappingProxyType({})
    """The options that go with ``url``."""

    # -- required ---------------------------------------------------------------------------

    @abstractmethod
    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        """Insert ``events`` through the caller's connection, inside its open transaction,
        never ending it; the new ids, in ``events`` order (see ``Store.enqueue``)."""

    @abstractmethod
    def transaction(self) -> AbstractContextManager[Any]:
        """A connection of the store's own in an open transaction, committed when the block
        ends, rolled back if it raises; ``enqueue`` takes it."""

    @abstractmethod
    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        """R3: lease at most ``batch_size`` due events, oldest ``(available_at, id)`` first,
        attempts + 1 and a fresh token each, committed before returning (see
        ``Store.claim``)."""

    @abstractmethod
    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        """Hand back unstarted claims: lease cleared, the attempt refunded, fenced by token;
        how many were released."""

    @abstractmethod
    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        """R12: dead events due again at ``now`` with attempts reset, records kept; how many."""

    @abstractmethod
    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        """Events of any state with ``id > after_id`` (and the topic), in id order, at most
        ``limit``, each with its state's columns filled in."""

    @abstractmethod
    def records(self, event_id: int) -> list[DeliveryRecord]:
        """The delivery records of one event, in the order they were written."""

    @abstractmethod
    def purge_published(self, *, before: datetime, limit: int) -> int:
        """Delete at most ``limit`` events published before ``before``, with their records;
        how many."""

    @abstractmethod
    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        """Delete at most ``limit`` dead events (of ``ids``, and failed before ``before``),
        with their records; how many."""

    # -- defaults ---------------------------------------------------------------------------

    def migrate(self) -> Migration | None:
        """Create or upgrade the schema. Default: nothing to do (no versioned schema)."""
        return None

    def close(self) -> None:
        """Release what the store holds. Default: nothing."""

    def __enter__(self) -> Self:
        """The store, closed when the block ends (``with open_store(url) as store:``)."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def now(self) -> datetime:
        """The store's production clock. Default: this host's wall clock, in UTC."""
        return datetime.now(UTC)

    def attempt_errors(self, event_id: int) -> list[AttemptError]:
        """The error of each failed attempt of one event, oldest first
        (``capabilities.error_history``). Default: none kept (``[]``).

        Raises:
            StoreError: the store failed.
        """
        return []

    def get(self, event_id: int) -> Event | None:
        """One event by id, or None. Default: one ``events`` call.

        Raises:
            StoreError: the store failed.
        """
        page = self.events(after_id=event_id - 1, limit=1)
        return page[0] if page and page[0].id == event_id else None

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead events (of ``topic``, failed at or after ``since``), oldest failure first, at
        most ``limit``, with their records. Default: every event read through ``events``
        (page by page), the dead ones' records through ``records``.

        Raises:
            StoreError: the store failed.
        """
        dead = sorted(
            (event.failed_at, event.id, event)
            for event in _every_event(self, topic)
            if event.failed_at is not None
            and event.published_at is None
            and (since is None or event.failed_at >= since)
        )
        return [
            DeadLetter(
                event=event,
                failed_at=failed_at,
                last_error=event.last_error,
                records=tuple(self.records(event_id)),
            )
            for failed_at, event_id, event in dead[:limit]
        ]

    def stats(self, *, now: datetime | None) -> Stats:
        """Counts by state and topic at ``now`` (None: ``self.now()``), the oldest due
        instant (backoff-parked and leased events excluded) and the keys with a dead event.
        Default: every event read through ``events``, page by page.

        Raises:
            StoreError: the store failed.
        """
        at = now if now is not None else self.now()
        counts: dict[tuple[str, str], int] = {}
        oldest: dict[tuple[str, str], datetime] = {}
        held: set[str] = set()
        for event in _every_event(self, None):
            state = state_of(
                published_at=event.published_at,
                failed_at=event.failed_at,
                locked_until=event.locked_until,
                now=at,
            )
            slot = (event.topic, state.value)
            counts[slot] = counts.get(slot, 0) + 1
            due = event.available_at
            if state is State.PENDING and due is not None and due <= at:
                oldest[slot] = min(due, oldest.get(slot, due))
            if state is State.DEAD and event.key is not None:
                held.add(event.key)
        rows: list[tuple[Any, ...]] = [
            (topic, state, count, oldest.get((topic, state)))
            for (topic, state), count in counts.items()
        ]
        rows.append((None, "held_keys", len(held), None))
        return fold_stats(rows, _as_is)

    def batch(self, *, now: datetime | None) -> AbstractContextManager[BatchTransaction]:
        """One transaction for a claimed batch (``capabilities.batches``). Default: none.

        Raises:
            ConfigurationError: the store has no batches (always, by default).
        """
        raise ConfigurationError(
            f"{self!r} has no batches (capabilities.batches is false): deliver with "
            'transaction="per_event"'
        )

    def rounds(self, *, concurrency: int = 1) -> AbstractContextManager[Deliveries]:
        """The ``Deliveries`` of one per-event round (see ``Store.rounds``). Default: the
        store itself, whatever ``concurrency`` (each delivery its own transaction)."""
        return nullcontext(self)

    def make_waiter(self) -> ClosingWaiter | None:
        """A waiter that also wakes on commits in other processes. Default: None (pollers
        poll at their interval; an enqueue in the same process wakes them directly)."""
        return None

    def async_store(self) -> AsyncStore:
        """The store's asyncio side (``capabilities.asyncio``). Default: none.

        Raises:
            ConfigurationError: the store has no asyncio side (always, by default).
        """
        raise ConfigurationError(
            f"{self!r} has no asyncio side (capabilities.asyncio is false): enqueue with "
            "outbox.enqueue() and run the blocking poller"
        )


def _every_event(store: StoreBase, topic: str | None) -> Iterator[Event]:
    """Every event (of ``topic``), in id order, read ``PAGE_SIZE`` at a time."""
    after_id = 0
    while True:
        page = store.events(after_id=after_id, topic=topic, limit=PAGE_SIZE)
        yield from page
        if len(page) < PAGE_SIZE:
            return
        after_id = page[-1].id


def _as_is(instant: Any) -> datetime:
    """``fold_stats``' converter for instants that are datetimes already."""
    value: datetime = instant
    return value


# -- the asyncio side -------------------------------------------------------------------------


class AsyncDeliveriesBase(ABC):
    """``DeliveriesBase`` for async code (``AsyncDeliveries``)."""

    @abstractmethod
    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractAsyncContextManager[AsyncDeliveryTransaction]:
        """``DeliveriesBase.delivery`` as an async context manager.

        Raises:
            LeaseLostError: the token is stale; nothing is written.
        """

    @abstractmethod
    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        """``DeliveriesBase.extend``."""

    @abstractmethod
    async def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``DeliveriesBase.settle_many``."""

    async def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """``DeliveriesBase.record_many``. Default: one ``delivery`` and ``record`` per claim.

        Returns:
            Per claim, whether its record was written (False: its token was stale).

        Raises:
            StoreError: the store failed.
        """
        written: list[bool] = []
        for claim in claims:
            try:
                async with self.delivery(claim, now=now) as tx:
                    await tx.record(handler, Outcome.SUCCEEDED)
            except LeaseLostError:
                written.append(False)
            else:
                written.append(True)
        return written


class AsyncBatchBase(AsyncDeliveriesBase):
    """``BatchBase`` for async code (``AsyncBatchTransaction``)."""

    async def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``BatchBase.settle_last``. Default: ``settle_many``.

        Returns:
            Which items were settled (true once the batch commits).
        """
        return await self.settle_many(items, now=now)

    async def claimed(self, claims: Sequence[Claim]) -> None:
        """``BatchBase.claimed``. Default: nothing."""
        return None


class AsyncStoreBase(AsyncDeliveriesBase):
    """A store's asyncio side (``AsyncStore``, what ``StoreBase.async_store`` returns for a
    store with ``capabilities.asyncio``): ``enqueue``, ``claim``, ``release`` and the three
    methods of ``AsyncDeliveriesBase``; the rest has defaults."""

    @abstractmethod
    async def enqueue(
        self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """``StoreBase.enqueue`` through the app's async connection, inside its transaction."""

    @abstractmethod
    async def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        """``StoreBase.claim``."""

    @abstractmethod
    async def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        """``StoreBase.release``."""

    def batch(self, *, now: datetime | None) -> AbstractAsyncContextManager[AsyncBatchTransaction]:
        """``StoreBase.batch`` as an async context manager. Default: none.

        Raises:
            ConfigurationError: the side has no batches (always, by default).
        """
        raise ConfigurationError(
            f"{self!r} has no batches (capabilities.batches is false): deliver with "
            'transaction="per_event"'
        )

    def rounds(self, *, concurrency: int = 1) -> AbstractAsyncContextManager[AsyncDeliveries]:
        """``StoreBase.rounds`` as an async context manager. Default: the side itself."""
        return nullcontext(self)

    def make_waiter(self) -> AsyncClosingWaiter | None:
        """``StoreBase.make_waiter`` for async code. Default: None."""
        return None

    async def close(self) -> None:
        """Release the side's async connections. Default: nothing."""


if TYPE_CHECKING:  # each base is what its protocol asks for (mypy checks these)

    def _is_store(store: StoreBase) -> Store:
        return store

    def _is_batch(batch: BatchBase) -> BatchTransaction:
        return batch

    def _is_async_store(side: AsyncStoreBase) -> AsyncStore:
        return side

    def _is_async_batch(batch: AsyncBatchBase) -> AsyncBatchTransaction:
        return batch
