"""What a store offers: ``Capabilities``, typed and few, and what each one promises.

A store declares them (``store.capabilities``); the pollers and ``Outbox`` read them instead of
probing for methods, and the conformance suite runs the checks each one promises and skips, with
the reason, those of a capability the store does not declare. Store authors import them from
``outboxkit.storekit``; ``outboxkit.store`` re-exports them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

__all__ = ["CAPABILITIES", "Capabilities"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store offers. Some fields change what a poller (or ``Outbox``) does; the rest
    describe the store (the conformance suite checks what each promises, and skips the checks
    of a missing one). A bare ``Capabilities()`` is the least a store can be: per-event
    deliveries in transactions of its own, no batches, no asyncio side, no per-key order, no
    dedupe keys.

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
        ordering: R15: the events of one ``key`` are claimed one at a time, in the order their
            transactions committed, and a claim honours ``dead_key="hold"``. Without it
            ``Outbox`` refuses an enqueue with a ``key`` and ``dead_key="hold"``.
        dedupe: R16: an enqueue whose ``dedupe_key`` an existing event holds writes nothing
            and returns that event's id. Without it ``Outbox`` refuses a ``dedupe_key``.
        error_history: ``attempt_errors(event_id)`` lists the error of each failed attempt
            of an event, oldest first (``StoreBase`` gives the method; without the
            capability ``Outbox.attempt_errors`` returns only ``last_error``'s attempt).
    """

    batches: bool = False
    waiter: bool = False
    asyncio: bool = False
    transactional_handlers: bool = True
    concurrent_claimers: bool = False
    multiprocess: bool = False
    database_clock: bool = False
    concurrent_batches: bool = False
    ordering: bool = False
    dedupe: bool = False
    error_history: bool = False

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
    "ordering": "the events of one key are claimed one at a time, in commit order (R15), "
    'and dead_key="hold" holds a key behind its dead event',
    "dedupe": "an enqueue with a dedupe key an existing event holds writes nothing (R16)",
    "error_history": "attempt_errors(event_id) lists the error of each failed attempt",
}
"""Each capability's name and what it promises (the fields of ``Capabilities``)."""
