"""The Store protocol: what a backend must provide, and nothing more.

A store keeps events, leases and delivery records and writes the core's decisions atomically.
It makes no lifecycle decision itself: *what* happens is decided by ``outboxkit.core.machine``;
the store only knows *how* to write it, and every state it writes is one of the machine's
``TRANSITIONS``. Every method that writes takes ``now``: the instant from the outbox's clock,
or ``None`` for "use your own production clock" (``now()``; on PostgreSQL the database's).

The seam is small:

- ``Store``: enqueue through the app's connection, claim, release, the operations (requeue,
  listings, purges, stats), ``batch()``, ``rounds()`` and ``make_waiter()``; and, as
  ``Deliveries``:
- ``delivery`` / ``extend`` / ``settle_many`` / ``record_many``: how one round's events are
  delivered, kept and settled. A poller running ``transaction="per_event"`` calls them on what
  ``store.rounds()`` yields (the store itself, unless the store keeps a round's own context);
  one running ``"per_batch"`` on the ``BatchTransaction`` that ``store.batch()`` opens
  (everything in one transaction, each delivery a savepoint), whose ``settle_last`` is the
  round's last write. Either way a round's settlements are written by one ``settle_many`` (or
  ``settle_last``): there is no other path.

Capabilities are typed and few (``Capabilities``, ``outboxkit.capabilities``): a store either
offers batches, a waiter, per-key order, dedupe keys, or it does not; the poller never probes
for a method to learn what it may do. The other fields describe the store for the conformance
suite, which runs the checks each one promises.

A store author derives from ``outboxkit.storekit.StoreBase``, which implements this protocol
with defaults for everything but twelve methods (see ``outboxkit.storekit``). Every store
proves itself with the conformance suite (``outboxkit conformance``). Driver errors must be
mapped at the boundary into ``outboxkit.errors`` (``StoreError``/``StoreUnavailable``,
``raise ... from exc``); the poller relies on that to tell a database failure from a handler's.

The optional protocols of earlier versions (``Rounds``, ``RecordsMany``, ``AsyncRecordsMany``,
``SettlesLast``, ``AsyncSettlesLast``) and their helpers (``record_each``,
``record_each_async``, ``settle_last``, ``settle_last_async``) are deprecated: the methods
are part of the protocols now. The names still import, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from .capabilities import CAPABILITIES, Capabilities
from .core.machine import Settlement
from .core.model import (
    Claim,
    DeadKey,
    DeadLetter,
    DeliveryRecord,
    Event,
    Migration,
    NewEvent,
    Outcome,
    Stats,
)
from .errors import LeaseLostError
from .waiter import AsyncClosingWaiter, ClosingWaiter

__all__ = [
    "CAPABILITIES",
    "AsyncBatchTransaction",
    "AsyncDeliveries",
    "AsyncDeliveryTransaction",
    "AsyncStore",
    "BatchTransaction",
    "Capabilities",
    "Deliveries",
    "DeliveryTransaction",
    "SettleItem",
    "Store",
    "settle_one",
]

SettleItem = tuple[Claim, Settlement, "str | None"]
"""One settlement to write: the claim (its token fences the write), the decision, the event's
error text (kept for a retry or a dead letter)."""


class DeliveryTransaction(Protocol):
    """One open delivery transaction for one claimed event, its token already checked."""

    @property
    def connection(self) -> Any:
        """What a transactional handler gets as ``ctx.connection``."""
        ...

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Enqueue follow-up events inside this transaction."""
        ...

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """Write the delivery record for ``handler``; it commits with the transaction.

        Raises:
            ConfigurationError: ``outcome`` is not one that is recorded (succeeded, rejected).
        """
        ...


class Deliveries(Protocol):
    """Where one round's deliveries, lease extensions and settlements go: the store itself
    (``transaction="per_event"``) or a batch's transaction (``"per_batch"``)."""

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractContextManager[DeliveryTransaction]:
        """A delivery transaction (a savepoint, in a batch) in which nothing commits unless
        ``claim.token`` still owns the event. Commits (releases) on a normal exit, rolls back
        and re-raises on an exception.

        The token may be checked on entry, or when ``tx.connection`` is first taken (a store
        that opens the transaction lazily); a block that never took it may end with its record
        fenced by the token in one statement, or, in a batch, kept and written before the
        batch settles (then a stale token shows as a refused settlement).

        Raises:
            LeaseLostError: the token is stale (on entry, when the connection is taken, or at
                the exit of a block that only recorded); nothing is written.
            StoreUnavailable: the database failed under the handler, whatever it raised.
        """
        ...

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        """R13: push the leases of ``claims`` to ``now + lease``; returns those still owned."""
        ...

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """R8 for a round's events, in one write: each item's settlement (its state by the
        machine's table), fenced by its token, the lease cleared. Returns which were settled
        (False: the token was stale, nothing changed)."""
        ...

    def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """Record ``handler`` as succeeded for each of ``claims`` (the confirmed events of a
        relay's publish: runs that used no connection), each fenced by its claim's token, as
        ``delivery`` + ``record`` would one by one (``storekit.DeliveriesBase``'s default).

        Returns:
            Per claim, False where its token was found stale (nothing written for it). A batch
            may keep the records for its settlement and answer True: a stale token then shows
            as a refused settlement, as with a delivery's kept record.
        """
        ...


class BatchTransaction(Deliveries, Protocol):
    """One transaction for a whole claimed batch (``transaction="per_batch"``).

    Every delivery runs inside its own savepoint of it: a handler's failure or rejection rolls
    back that delivery's writes only. Settlements and lease extensions are written in the same
    transaction, and everything commits once, when the batch's block ends (or rolls back, if it
    raises). Until then the events' rows stay locked (or, on SQLite, the database's write lock
    is held), so another poller cannot take them over while the batch is open.
    """

    def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``settle_many`` as the batch's last write: the block writes nothing more and ends
        (if it raises instead, what this wrote may already be committed).

        Both pollers settle a ``per_batch`` round through it. Told so, a store may spare the
        batch's own ``BEGIN`` and ``COMMIT`` when the settlement is all there is to write (the
        PostgreSQL store: one statement, its own transaction). Either way the settlement
        commits with everything else the batch wrote, or not at all. Default
        (``storekit.BatchBase``): ``settle_many``.
        """
        ...

    def claimed(self, claims: Sequence[Claim]) -> None:
        """The batch's claims, in claim order, before its first delivery (both pollers tell
        it, when the batch has this method). A store may check their tokens and lock their
        rows here, all at once, so that a delivery need not (the MariaDB/MySQL store); a
        delivery of a claim found stale is then refused without asking the database. Default
        (``storekit.BatchBase``): nothing.
        """
        ...


@runtime_checkable
class Store(Deliveries, Protocol):
    """A place where events live. See the module docstring for the contract."""

    @property
    def capabilities(self) -> Capabilities:
        """What this store offers (see ``Capabilities``)."""
        ...

    @property
    def url(self) -> str | None:
        """A URL that ``open_store(store.url, **store.options)`` opens this store with in
        another process, or None when there is none (an in-memory store, a pool of the app's)."""
        ...

    @property
    def options(self) -> Mapping[str, Any]:
        """The options that go with ``url``."""
        ...

    def migrate(self) -> Migration | None:
        """Create or upgrade the schema. Idempotent.

        Returns:
            What was done (the version found, the version left), or None for a store without
            a versioned schema (the memory store; ``outboxkit migrate`` then says "up to date").

        Raises:
            SchemaError: the schema is newer than this code.
        """
        ...

    def close(self) -> None:
        """Release connections. The store is unusable afterwards."""
        ...

    def now(self) -> datetime:
        """The store's production clock: the instant ``now=None`` stands for in the other calls
        (PostgreSQL: the database's clock). Outboxes without a clock of their own compute every
        cutoff from it (``Outbox.now``)."""
        ...

    def transaction(self) -> AbstractContextManager[Any]:
        """A connection of the store's own in an open transaction: committed when the block
        ends, rolled back if it raises. For apps without a connection of their own, and for
        the conformance suite; ``enqueue`` accepts what it yields.
        """
        ...

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        """Insert ``events`` through the caller's connection, inside its open transaction.

        Never begins, commits or rolls back the caller's transaction. Returns the new ids, in
        ``events`` order. R15: a keyed event takes its place in its key's order when the
        transaction commits (a store where transactions may commit out of enqueue order makes
        a later enqueuer of the same key wait, see ``docs/lifecycle.md``). R16: an event whose
        ``dedupe_key`` an existing event (or an earlier one of ``events``) has is not written;
        its place in the result is that event's id; concurrent enqueuers of one dedupe key
        end with one event, and the caller's transaction stays usable.
        """
        ...

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        """R3: lease at most ``batch_size`` due events, oldest ``(available_at, id)`` first.

        One atomic step, committed before returning: lease set, attempts + 1, a fresh token.
        R15: an event with a ``key`` is claimed only while no earlier event of its key (in
        commit order) is unsettled: pending, leased or waiting for a retry, or, with
        ``dead_key="hold"``, dead. So a claim holds at most one event of each key.
        """
        ...

    def batch(self, *, now: datetime | None) -> AbstractContextManager[BatchTransaction]:
        """One transaction for a claimed batch (``capabilities.batches``).

        Raises:
            ConfigurationError: the store has no batches.
        """
        ...

    def rounds(self, *, concurrency: int = 1) -> AbstractContextManager[Deliveries]:
        """The ``Deliveries`` of one per-event round (``transaction="per_event"``), with up to
        ``concurrency`` deliveries committing at once (the poller's option). A store may keep
        a context of the round's own: one connection held for the round, a delivery's record
        sent without waiting for its commit and read back before anything else uses that
        connection and before the round's settlement (the PostgreSQL store's pipeline). Each
        delivery still commits on its own; a record its token refused shows as the event's
        refused settlement. When the block ends, everything written in it has been answered
        (a failure raises ``StoreError``). Default (``storekit.StoreBase``): the store itself.
        """
        ...

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        """Hand back unstarted claims: lease cleared, the attempt refunded. Fenced by token."""
        ...

    def make_waiter(self) -> ClosingWaiter | None:
        """A waiter that also returns when an enqueue commits in any process
        (``capabilities.waiter``), or None. The poller that asked closes it when done."""
        ...

    def async_store(self) -> AsyncStore:
        """The store's asyncio side (``capabilities.asyncio``), made on first use and closed
        with the store: the same tables, SQL and error mapping, on async connections.

        Raises:
            ConfigurationError: the store has no asyncio side.
        """
        ...

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        """R12: make dead events due again with attempts reset; records stay. Returns the count."""
        ...

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead events, oldest failure first."""
        ...

    def get(self, event_id: int) -> Event | None:
        """One event by id (any state), or None."""
        ...

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        """Events of any state with ``id > after_id`` (and the topic), in id order, at most
        ``limit``; for the test kit and operators. Page with ``after_id``."""
        ...

    def records(self, event_id: int) -> list[DeliveryRecord]:
        """The delivery records of one event, in the order they were written."""
        ...

    def purge_published(self, *, before: datetime, limit: int) -> int:
        """Delete at most ``limit`` events published before ``before``, with their records."""
        ...

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        """Delete at most ``limit`` dead events (the given ids, or failed before ``before``)."""
        ...

    def stats(self, *, now: datetime | None) -> Stats:
        """Counts by state and topic, the oldest due instant (backoff-parked ones excluded),
        and the keys with a dead event (``held_keys``)."""
        ...


# -- the asyncio side: the hot path, name for name ---------------------------------------------


class AsyncDeliveryTransaction(Protocol):
    """``DeliveryTransaction`` for async code: ``connection`` is the async connection of the
    delivery transaction (psycopg's ``AsyncConnection``, aiosqlite's ``Connection``).

    A property cannot await, so the poller awaits ``open`` before it hands ``connection`` to a
    transactional handler; a store may open the transaction then, or later, as long as every
    statement the handler sends on ``connection`` runs in it (PostgreSQL opens it when the
    handler first takes ``connection``, ahead of the handler's first statement). A delivery never
    opened (a non-transactional handler's record, a rejection) may end as its record alone,
    fenced by the token in one statement, as a blocking delivery whose handler never took the
    connection does. A store whose deliveries open at once makes ``open`` a no-op.
    """

    async def open(self) -> None:
        """Make the delivery transaction ready for the handler (idempotent): open it now, or
        arrange that it opens before the handler's first statement on ``connection``.

        Raises:
            LeaseLostError: the token is stale (nothing was written); a store that opens later
                makes the handler's statements fail instead, and the delivery ends with it.
            StoreError: the database failed.
        """
        ...

    @property
    def connection(self) -> Any:
        """The delivery transaction's async connection, once ``open`` was awaited."""
        ...

    async def enqueue(self, events: Sequence[NewEvent]) -> list[int]: ...

    async def record(
        self, handler: str, outcome: Outcome, *, reason: str | None = None
    ) -> None: ...


class AsyncDeliveries(Protocol):
    """``Deliveries`` for async code: the store's asyncio side, or its async batch."""

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractAsyncContextManager[AsyncDeliveryTransaction]: ...

    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]: ...

    async def settle_many(
        self, items: Sequence[SettleItem], *, now: datetime | None
    ) -> list[bool]: ...

    async def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """``Deliveries.record_many`` for async code."""
        ...


class AsyncBatchTransaction(AsyncDeliveries, Protocol):
    """``BatchTransaction`` for async code."""

    async def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``BatchTransaction.settle_last`` for async code."""
        ...

    async def claimed(self, claims: Sequence[Claim]) -> None:
        """``BatchTransaction.claimed`` for async code."""
        ...


class AsyncStore(AsyncDeliveries, Protocol):
    """A store's asyncio side (``Store.async_store()``): what the asyncio poller and
    ``Outbox.enqueue_async`` need, each method the async twin of the store's own."""

    async def enqueue(
        self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """``Store.enqueue`` through the app's async connection, inside its transaction."""
        ...

    async def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]: ...

    def batch(
        self, *, now: datetime | None
    ) -> AbstractAsyncContextManager[AsyncBatchTransaction]: ...

    async def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int: ...

    def rounds(self, *, concurrency: int = 1) -> AbstractAsyncContextManager[AsyncDeliveries]:
        """``Store.rounds`` for async code: the ``AsyncDeliveries`` of one per-event round
        (default, ``storekit.AsyncStoreBase``: the side itself)."""
        ...

    def make_waiter(self) -> AsyncClosingWaiter | None:
        """An async waiter that also wakes on commits elsewhere, or None."""
        ...

    async def close(self) -> None:
        """Release the async connections (the store's ``close`` does it too)."""
        ...


def settle_one(
    deliveries: Deliveries,
    claim: Claim,
    settlement: Settlement,
    *,
    error: str | None = None,
    now: datetime | None,
) -> bool:
    """``settle_many`` for one event: whether it was settled (for operators and tests)."""
    (settled,) = deliveries.settle_many([(claim, settlement, error)], now=now)
    return settled


# -- deprecated names (the optional protocols and helpers of earlier versions) ------------------


@runtime_checkable
class _Rounds(Protocol):
    """Deprecated: ``Store.rounds``."""

    def deliveries(self, *, concurrency: int = 1) -> AbstractContextManager[Deliveries]: ...


@runtime_checkable
class _RecordsMany(Protocol):
    """Deprecated: ``Deliveries.record_many``."""

    def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]: ...


@runtime_checkable
class _AsyncRecordsMany(Protocol):
    """Deprecated: ``AsyncDeliveries.record_many``."""

    async def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]: ...


@runtime_checkable
class _SettlesLast(Protocol):
    """Deprecated: ``BatchTransaction.settle_last``."""

    def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]: ...


@runtime_checkable
class _AsyncSettlesLast(Protocol):
    """Deprecated: ``AsyncBatchTransaction.settle_last``."""

    async def settle_last(
        self, items: Sequence[SettleItem], *, now: datetime | None
    ) -> list[bool]: ...


def _record_each(
    deliveries: Any, handler: str, claims: Sequence[Claim], *, now: datetime | None
) -> list[bool]:
    """Deprecated: ``deliveries.record_many(handler, claims, now=now)``."""
    record_many = getattr(deliveries, "record_many", None)
    if record_many is not None:
        written: list[bool] = record_many(handler, claims, now=now)
        return written
    written = []
    for claim in claims:
        try:
            with deliveries.delivery(claim, now=now) as tx:
                tx.record(handler, Outcome.SUCCEEDED)
        except LeaseLostError:
            written.append(False)
        else:
            written.append(True)
    return written


async def _record_each_async(
    deliveries: Any, handler: str, claims: Sequence[Claim], *, now: datetime | None
) -> list[bool]:
    """Deprecated: ``await deliveries.record_many(handler, claims, now=now)``."""
    record_many = getattr(deliveries, "record_many", None)
    if record_many is not None:
        written: list[bool] = await record_many(handler, claims, now=now)
        return written
    written = []
    for claim in claims:
        try:
            async with deliveries.delivery(claim, now=now) as tx:
                await tx.record(handler, Outcome.SUCCEEDED)
        except LeaseLostError:
            written.append(False)
        else:
            written.append(True)
    return written


def _settle_last(
    deliveries: Any, items: Sequence[SettleItem], *, now: datetime | None
) -> list[bool]:
    """Deprecated: ``batch.settle_last(items, now=now)``."""
    settle = getattr(deliveries, "settle_last", None) or deliveries.settle_many
    settled: list[bool] = settle(items, now=now)
    return settled


async def _settle_last_async(
    deliveries: Any, items: Sequence[SettleItem], *, now: datetime | None
) -> list[bool]:
    """Deprecated: ``await batch.settle_last(items, now=now)``."""
    settle = getattr(deliveries, "settle_last", None) or deliveries.settle_many
    settled: list[bool] = await settle(items, now=now)
    return settled


_DEPRECATED: dict[str, tuple[object, str]] = {
    "Rounds": (_Rounds, "Store.rounds(concurrency=...) (outboxkit.storekit.StoreBase has it)"),
    "RecordsMany": (_RecordsMany, "Deliveries.record_many (outboxkit.storekit.DeliveriesBase)"),
    "AsyncRecordsMany": (
        _AsyncRecordsMany,
        "AsyncDeliveries.record_many (outboxkit.storekit.AsyncDeliveriesBase)",
    ),
    "SettlesLast": (_SettlesLast, "BatchTransaction.settle_last (outboxkit.storekit.BatchBase)"),
    "AsyncSettlesLast": (
        _AsyncSettlesLast,
        "AsyncBatchTransaction.settle_last (outboxkit.storekit.AsyncBatchBase)",
    ),
    "record_each": (_record_each, "deliveries.record_many(handler, claims, now=now)"),
    "record_each_async": (
        _record_each_async,
        "await deliveries.record_many(handler, claims, now=now)",
    ),
    "settle_last": (_settle_last, "batch.settle_last(items, now=now)"),
    "settle_last_async": (_settle_last_async, "await batch.settle_last(items, now=now)"),
}
"""Each deprecated name, what it still gives, and what to use instead."""


def __getattr__(name: str) -> Any:
    """The deprecated names, each with a ``DeprecationWarning`` naming its replacement."""
    try:
        value, instead = _DEPRECATED[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    warnings.warn(
        f"outboxkit.store.{name} is deprecated: use {instead}", DeprecationWarning, stacklevel=2
    )
    return value
