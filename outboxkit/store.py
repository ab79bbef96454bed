"""The Store protocol: what a backend must provide, and nothing more.

A store keeps events, leases and delivery records and writes the core's decisions atomically.
It makes no lifecycle decision itself: *what* happens is decided by ``outboxkit.core.machine``;
the store only knows *how* to write it, and every state it writes is one of the machine's
``TRANSITIONS``. Every method that writes takes ``now``: the instant from the outbox's clock,
or ``None`` for "use your own production clock" (``now()``; on PostgreSQL the database's).

The seam is small:

- ``Store``: enqueue through the app's connection, claim, release, the operations (requeue,
  listings, purges, stats), ``batch()`` and ``make_waiter()``; and, as ``Deliveries``:
- ``delivery`` / ``extend`` / ``settle_many``: how one round's events are delivered, kept and
  settled. A poller running ``transaction="per_event"`` calls them on the store itself (each in a
  transaction of its own); one running ``"per_batch"`` on the ``BatchTransaction`` that
  ``store.batch()`` opens (everything in one transaction, each delivery a savepoint). Either
  way a round's settlements are written by one ``settle_many``: there is no other path.

Capabilities are typed and few (``Capabilities``): a store either offers batches and a waiter,
or it does not; the poller never probes for a method to learn what it may do. The other fields
describe the store for the conformance suite, which runs the checks each one promises. Three
parts are optional, protocols a shell checks with ``isinstance``; without them a store works
the same, only slower: ``Rounds`` (a per-event round's own context), ``RecordsMany`` (many
records at once) and ``SettlesLast`` (a batch's settlement as its last write).

Every store proves itself with the conformance suite (``outboxkit conformance``). Driver errors
must be mapped at the boundary into ``outboxkit.errors`` (``StoreError``/``StoreUnavailable``,
``raise ... from exc``); the poller relies on that to tell a database failure from a handler's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

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
    "AsyncRecordsMany",
    "AsyncSettlesLast",
    "BatchTransaction",
    "Capabilities",
    "Deliveries",
    "DeliveryTransaction",
    "RecordsMany",
    "Rounds",
    "SettleItem",
    "SettlesLast",
    "Store",
    "record_each",
    "record_each_async",
    "settle_last",
    "settle_last_async",
    "settle_one",
]

SettleItem = tuple[Claim, Settlement, "str | None"]
"""One settlement to write: the claim (its token fences the write), the decision, the event's
error text (kept for a retry or a dead letter)."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store offers. Two fields change what a poller does; the rest describe the store
    (the conformance suite checks what each promises, and skips the checks of a missing one).

    Attributes:
        batches: ``batch()`` opens one transaction for a claimed batch, a savepoint per
            delivery (``transaction="per_batch"``). Without it a poller asking for batches is a
            ``ConfigurationError`` at construction, and ``batch()`` raises it too.
        waiter: ``make_waiter()`` returns a waiter that also wakes on commits in other
            processes (PostgreSQL ``LISTEN``); without it, it returns None.
        transactional_handlers: handlers can write in the delivery transaction.
        concurrent_claimers: several pollers in several threads may claim at once.
        multiprocess: several processes may share the store; it then has ``url`` and
            ``options`` such that ``open_store(store.url, **store.options)`` opens it elsewhere.
        database_clock: ``now=None`` means a clock shared by every host (the database's).
        concurrent_batches: others may claim while a batch is open (row locks, not a database
            lock). With ``concurrent_claimers``, the pollers' ``prefetch`` claims the next batch
            on another thread (or task) while one is delivered.
        asyncio: ``async_store()`` returns the store's asyncio side (``AsyncStore``): enqueue
            from async code, the asyncio poller, ``async def`` transactional handlers on an
            async connection. Without it ``async_store()`` raises ``ConfigurationError``.
    """

    batches: bool = False
    waiter: bool = False
    asyncio: bool = False
    transactional_handlers: bool = True
    concurrent_claimers: bool = False
    multiprocess: bool = False
    database_clock: bool = False
    concurrent_batches: bool = False

    def names(self) -> frozenset[str]:
        """The fields that are true, by name."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name))

    def __contains__(self, name: object) -> bool:
        """``"batches" in store.capabilities``; the names of earlier versions work too."""
        alias = _OLD_NAMES.get(name, name) if isinstance(name, str) else name
        return alias is True or alias in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.names()))


_OLD_NAMES: dict[str, str | bool] = {
    "listen_notify": "waiter",
    "batched_delivery": "batches",
    "batched_settle": True,  # every store settles a round in one settle_many now
}
"""Capability names of earlier versions, kept for ``"name" in store.capabilities``."""

CAPABILITIES: dict[str, str] = {
    "batches": "batch() opens one transaction for a claimed batch, a savepoint per delivery",
    "waiter": "make_waiter() wakes pollers when an enqueue commits in any process",
    "transactional_handlers": "handlers can write in the delivery transaction",
    "concurrent_claimers": "several pollers in several threads may claim at once",
    "multiprocess": "several processes may share the store (url and options reopen it)",
    "database_clock": "now=None means a clock every host shares (the database's)",
    "concurrent_batches": "others may claim while a batch is open (row locks, not a db lock)",
    "asyncio": "async_store() gives the asyncio side: async enqueue, the asyncio poller",
}
"""Each capability's name and what it promises (the fields of ``Capabilities``)."""


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


class BatchTransaction(Deliveries, Protocol):
    """One transaction for a whole claimed batch (``transaction="per_batch"``).

    Every delivery runs inside its own savepoint of it: a handler's failure or rejection rolls
    back that delivery's writes only. Settlements and lease extensions are written in the same
    transaction, and everything commits once, when the batch's block ends (or rolls back, if it
    raises). Until then the events' rows stay locked (or, on SQLite, the database's write lock
    is held), so another poller cannot take them over while the batch is open.
    """


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

    A property cannot await, so the transaction opens lazily through ``open``: the poller
    awaits it before it hands ``connection`` to a transactional handler. A delivery never
    opened (a non-transactional handler's record, a rejection) may end as its record alone,
    fenced by the token in one statement, as a blocking delivery whose handler never took the
    connection does. A store whose deliveries open at once makes ``open`` a no-op.
    """

    async def open(self) -> None:
        """Open the delivery transaction now, if it is not open yet (idempotent).

        Raises:
            LeaseLostError: the token is stale (nothing was written).
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


class AsyncBatchTransaction(AsyncDeliveries, Protocol):
    """``BatchTransaction`` for async code."""


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


# -- a per-event round's deliveries (optional) --------------------------------------------------


@runtime_checkable
class Rounds(Protocol):
    """What a store may also offer for ``transaction="per_event"``: a round's deliveries,
    lease extensions and settlement in a context of the round's own, where the store may keep
    one connection for the round and write a delivery's record without waiting for its
    commit, reading the answers before anything else uses that connection and before the
    round's settlement (PostgreSQL's pipeline mode). Each delivery still commits on its own; a
    record its token refused shows as the event's refused settlement, as a batch's kept record
    does. A store without it serves the round itself."""

    def deliveries(self, *, concurrency: int = 1) -> AbstractContextManager[Deliveries]:
        """The ``Deliveries`` of one per-event round, with up to ``concurrency`` deliveries
        committing at once (the poller's option); when the block ends, everything written in
        it has been answered (a failure raises ``StoreError``)."""
        ...


# -- many records at once (optional) ----------------------------------------------------------


@runtime_checkable
class RecordsMany(Protocol):
    """What ``Deliveries`` may also offer: the success records of many runs that used no
    connection at once (a relay's confirmed publishes). The SQL stores' batches have it; the
    shell does without it through ``record_each``."""

    def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """Record ``handler`` as succeeded for each of ``claims``, each fenced by its claim's
        token, as ``delivery`` + ``record`` would one by one.

        Returns:
            Per claim, False where its token was found stale (nothing written for it). A batch
            keeps the records for its settlement and answers True: a stale token then shows
            as a refused settlement, as with a delivery's kept record.
        """
        ...


@runtime_checkable
class AsyncRecordsMany(Protocol):
    """``RecordsMany`` for ``AsyncDeliveries``."""

    async def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]: ...


def record_each(
    deliveries: Deliveries, handler: str, claims: Sequence[Claim], *, now: datetime | None
) -> list[bool]:
    """``RecordsMany.record_many`` through ``deliveries.delivery``, one claim at a time."""
    if isinstance(deliveries, RecordsMany):
        return deliveries.record_many(handler, claims, now=now)
    written: list[bool] = []
    for claim in claims:
        try:
            with deliveries.delivery(claim, now=now) as tx:
                tx.record(handler, Outcome.SUCCEEDED)
        except LeaseLostError:
            written.append(False)
        else:
            written.append(True)
    return written


async def record_each_async(
    deliveries: AsyncDeliveries, handler: str, claims: Sequence[Claim], *, now: datetime | None
) -> list[bool]:
    """``record_each`` for ``AsyncDeliveries``."""
    if isinstance(deliveries, AsyncRecordsMany):
        return await deliveries.record_many(handler, claims, now=now)
    written: list[bool] = []
    for claim in claims:
        try:
            async with deliveries.delivery(claim, now=now) as tx:
                await tx.record(handler, Outcome.SUCCEEDED)
        except LeaseLostError:
            written.append(False)
        else:
            written.append(True)
    return written


# -- a batch's last write (optional) ------------------------------------------------------------


@runtime_checkable
class SettlesLast(Protocol):
    """What a ``BatchTransaction`` may also offer: its settlement as the batch's last write.

    A poller in ``transaction="per_batch"`` settles its round once, at the end of the batch's
    block, and writes nothing after it. Told so, a store may spare the batch's own ``BEGIN``
    and ``COMMIT`` when the settlement is all there is to write (no delivery took the
    connection): the settlement, with the kept records, is then one statement that is its own
    transaction (the PostgreSQL store: two round trips fewer per batch). Otherwise it is
    ``settle_many`` and the block's end commits, as ever. Either way the settlement commits
    with everything else the batch wrote, or not at all."""

    def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``settle_many`` as the batch's last write: the block writes nothing more and ends
        (if it raises instead, what this wrote may already be committed)."""
        ...


@runtime_checkable
class AsyncSettlesLast(Protocol):
    """``SettlesLast`` for ``AsyncBatchTransaction``."""

    async def settle_last(
        self, items: Sequence[SettleItem], *, now: datetime | None
    ) -> list[bool]: ...


def settle_last(
    deliveries: Deliveries, items: Sequence[SettleItem], *, now: datetime | None
) -> list[bool]:
    """A batch's settlement as its last write: ``SettlesLast.settle_last`` where the batch
    has it, else ``settle_many``."""
    if isinstance(deliveries, SettlesLast):
        return deliveries.settle_last(items, now=now)
    return deliveries.settle_many(items, now=now)


async def settle_last_async(
    deliveries: AsyncDeliveries, items: Sequence[SettleItem], *, now: datetime | None
) -> list[bool]:
    """``settle_last`` for ``AsyncDeliveries``."""
    if isinstance(deliveries, AsyncSettlesLast):
        return await deliveries.settle_last(items, now=now)
    return await deliveries.settle_many(items, now=now)
