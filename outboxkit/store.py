"""The Store protocol: what a backend must provide, and nothing more.

A store keeps events, leases and delivery records and applies the core's decisions atomically.
It makes no lifecycle decisions itself: *what* happens is decided by ``outboxkit._machine``; the
store only knows *how* to write it. Every method that writes takes ``now``: the instant from the
outbox's clock, or ``None`` for "use your own production clock" (Postgres: the database clock).

Every store proves itself with the conformance suite (``outboxkit conformance``). Driver errors
must be mapped at the boundary into ``outboxkit.errors`` (``StoreError``/``StoreUnavailable``,
``raise ... from exc``); the poller relies on that to tell a database failure from a handler's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from ._machine import Settlement
from ._model import Claim, DeadLetter, DeliveryRecord, Event, NewEvent, Outcome, Stats

__all__ = ["CAPABILITIES", "BatchTransaction", "DeliveryTransaction", "Store"]

CAPABILITIES: dict[str, str] = {
    "transactional_handlers": "handlers can write in the delivery transaction",
    "concurrent_claimers": "several pollers in several threads may claim at once",
    "multiprocess": "several processes may share the store",
    "database_clock": "now=None means the database's own clock",
    "listen_notify": "the store can wake pollers when an enqueue commits",
    "settle_in_delivery": "a delivery transaction can settle its own event (one commit per event)",
    "batched_delivery": "batch() opens one transaction for a claimed batch, a savepoint per delivery",
    "concurrent_batches": "others may claim while a batch is open (row locks, not a database lock)",
    "batched_settle": "settle_many() settles several events in one transaction",
}
"""The capabilities a store may declare, with what each promises.

A store declaring ``multiprocess`` also has ``url`` and ``options`` attributes such that
``open_store(store.url, **store.options)`` in another process opens the same store.

A store declaring ``listen_notify`` also has ``make_waiter() -> Waiter | None``: a waiter (see
``outboxkit.poller.Waiter``) whose ``wait`` also returns when an enqueue commits, in any process.
A poller given no waiter uses it, and calls its ``close()`` (if it has one) when ``run_forever``
ends. Polling stays the source of truth: the waiter only makes the next poll come sooner.

A store declaring ``settle_in_delivery`` gives its delivery transactions a ``settle`` method
(see ``DeliveryTransaction.settle``): the poller then settles an event in the transaction of its
last delivery, so an event with one handler costs one commit instead of two.

A store declaring ``batched_delivery`` also has ``batch(*, now) -> BatchTransaction``, used by
pollers running with ``transaction="per_batch"``.

A store declaring ``batched_settle`` also has ``settle_many(items, *, now) -> list[bool]``:
``items`` are ``(claim, settlement, error)`` triples, settled as ``settle`` would (each fenced by
its token) in one transaction; the result says which were. A poller delivering per event then
settles a round's events together when the round ends, so each delivery's commit carries only
the handler's writes and the record (the cheapest per-event shape on both SQL stores). If the
store also declares ``batched_delivery``, its ``BatchTransaction`` should have the same
``settle_many``, writing inside the batch's transaction: a poller running
``transaction="per_batch"`` then settles the batch's events in one statement just before the
batch commits (a batch without it has each event settled through ``BatchTransaction.settle``).
"""


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
        """Write the delivery record for ``handler``; it commits with the transaction."""
        ...

    # Stores declaring ``settle_in_delivery`` add:
    #
    #     def settle(self, settlement: Settlement, *, error: str | None) -> None:
    #         """R8 for this transaction's event, committed (or rolled back) with it."""
    #
    # It is not part of the protocol so that stores without it still satisfy it.


class BatchTransaction(Protocol):
    """One transaction for a whole claimed batch (``transaction="per_batch"``).

    Every delivery runs inside its own savepoint of it: a handler's failure or rejection rolls
    back that delivery's writes only. Settlements and lease extensions are written in the same
    transaction, and everything commits once, when the batch's block ends (or rolls back, if it
    raises). Until then the events' rows stay locked (or, on SQLite, the database's write lock
    is held), so another poller cannot take them over while the batch is open.
    """

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractContextManager[DeliveryTransaction]:
        """A savepoint for one delivery, after checking the claim's token (see
        ``Store.delivery``): released on a normal exit, rolled back to on an exception."""
        ...

    def settle(
        self, claim: Claim, settlement: Settlement, *, error: str | None, now: datetime | None
    ) -> bool:
        """``Store.settle`` inside the batch's transaction."""
        ...

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        """``Store.extend`` inside (or alongside, where that cannot deadlock) the batch."""
        ...


@runtime_checkable
class Store(Protocol):
    """A place where events live. See the module docstring for the contract."""

    @property
    def capabilities(self) -> frozenset[str]:
        """Names from ``CAPABILITIES`` this store supports."""
        ...

    def migrate(self) -> None:
        """Create or upgrade the schema. Idempotent.

        Raises:
            SchemaError: the schema is newer than this code.
        """
        ...

    def close(self) -> None:
        """Release connections. The store is unusable afterwards."""
        ...

    def transaction(self) -> AbstractContextManager[Any]:
        """A connection of the store's own in an open transaction: committed when the block
        ends, rolled back if it raises. For apps without a connection of their own, and for
        the conformance suite; ``enqueue`` accepts what it yields.
        """
        ...

    def now(self) -> datetime:
        """The store's production clock: the instant ``now=None`` stands for in the other calls
        (PostgreSQL: the database's clock). Outboxes without a clock of their own compute every
        cutoff from it (``Outbox.now``)."""
        ...

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        """Insert ``events`` through the caller's connection, inside its open transaction.

        Never begins, commits or rolls back the caller's transaction. Returns the new ids.
        """
        ...

    def claim(self, *, batch_size: int, lease: timedelta, now: datetime | None) -> list[Claim]:
        """R3: lease at most ``batch_size`` due events, oldest ``(available_at, id)`` first.

        One atomic step, committed before returning: lease set, attempts + 1, a fresh token.
        """
        ...

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractContextManager[DeliveryTransaction]:
        """Open a delivery transaction after checking ``claim.token`` still owns the event.

        Commits on a normal exit, rolls back and re-raises on an exception.

        Raises:
            LeaseLostError: on entry if the token is stale (nothing is run or written).
        """
        ...

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        """R13: push the leases of ``claims`` to ``now + lease``; returns those still owned."""
        ...

    def settle(
        self,
        claim: Claim,
        settlement: Settlement,
        *,
        error: str | None,
        now: datetime | None,
    ) -> bool:
        """R8: apply the settlement, fenced by the token; clears the lease.

        Returns False (and changes nothing) if the token is stale.
        """
        ...

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        """Hand back unstarted claims: lease cleared, the attempt refunded. Fenced by token."""
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
        """Counts by state and topic, and the oldest due instant (backoff-parked ones excluded)."""
        ...
