"""The seam for store authors: everything a store needs, from one import.

A store keeps events, their leases and their delivery records, and writes what the core
decides (``outboxkit.core.machine``) atomically. Derive it from ``StoreBase``, write the twelve
methods below, declare what else it offers in ``capabilities``, and prove it with the
conformance suite (``outboxkit conformance mypkg.stores:make_store``, or a subclass of
``outboxkit_conformance.StoreConformance``)::

    from outboxkit.storekit import Capabilities, StoreBase

    class MyStore(StoreBase):
        capabilities = Capabilities()  # the least a store can be; declare more as you add it
        ...  # the twelve methods

Every method that writes takes ``now``: the instant to write with (the outbox's clock in
tests), or None for the store's production clock (``now()``). A driver's errors are mapped at
the boundary to ``StoreError`` (``StoreUnavailable`` for an outage that may pass), ``raise
... from exc``: the pollers tell a database failure from a handler's by it.

The twelve required methods (abstract in ``StoreBase``)
--------------------------------------------------------

``enqueue(conn, events, *, now)``
    R1: insert ``events`` (``NewEvent``: topic, ``payload_json``, headers, key, delay or
    ``available_at``, dedupe key) through the caller's connection, inside its open
    transaction: never begin, commit or roll it back. Return the new ids in ``events`` order.
    Each event is due at ``available_at``, else ``now + delay``; its ``message_id`` is drawn
    here (a UUID's text), unique across stores. With ``ordering`` a keyed event takes its
    place in its key's commit order; with ``dedupe`` an event whose dedupe key an existing
    event (or an earlier one of ``events``) holds is not written, its id is that event's.
``transaction()``
    A context manager yielding a connection of the store's own in an open transaction,
    committed when the block ends, rolled back if it raises; ``enqueue`` takes it.
``claim(*, batch_size, lease, now, dead_key="release")``
    R3: lease at most ``batch_size`` due events (neither published nor dead, ``available_at
    <= now``, no lease running at ``now``), oldest ``(available_at, id)`` first: lease until
    ``now + lease``, attempts + 1, a fresh token; committed before returning. Each ``Claim``
    (``make_claim(event, token, locked_until, done)``) carries the handlers already recorded
    (``done``). With ``ordering``: only the first unsettled event of each key (R15), a dead one
    holding its key under ``dead_key="hold"``.
``delivery(claim, *, now)``
    A context manager yielding a ``DeliveryTransaction`` (``connection``, ``enqueue`` for
    follow-ups, ``record(handler, outcome, reason=...)``) in which nothing commits unless
    ``claim.token`` still owns the event: it commits on a normal exit, rolls back and
    re-raises on an exception, and raises ``LeaseLostError`` (writing nothing) for a stale
    token, on entry or at the commit.
``extend(claims, *, lease, now)``
    R13: push the leases of the claims still owned to ``now + lease``; return those claims
    with their new ``locked_until``.
``settle_many(items, *, now)``
    R8: for each ``(claim, settlement, error)`` (a ``SettleItem``) whose token still owns the
    event: ``PublishSettlement`` sets ``published_at``; ``RetrySettlement`` makes it due at
    ``now + settlement.delay`` with ``last_error``; ``DeadLetterSettlement`` sets
    ``failed_at`` and ``last_error``; the lease and token cleared. Return which were settled.
``release(claims, *, now)``
    Hand back unstarted claims (fenced by token): lease cleared, the attempt refunded.
    Return how many.
``requeue(ids, *, now)``
    R12: dead events of ``ids`` due again at ``now``, attempts reset to 0, their records kept.
    Return how many (ids that are not dead are ignored).
``events(*, after_id=0, topic=None, limit=1000)``
    Events of any state with ``id > after_id`` (and the topic), in id order, at most
    ``limit``, with ``attempts``, ``published_at``, ``failed_at``, ``locked_until`` and
    ``last_error`` filled in. The defaults below page through it.
``records(event_id)``
    The event's ``DeliveryRecord`` objects, in the order they were written.
``purge_published(*, before, limit)``
    Delete at most ``limit`` events published before ``before``, with their records.
``purge_dead(*, ids=None, before=None, limit)``
    Delete at most ``limit`` dead events (of ``ids``, failed before ``before``), with their
    records.

The defaults (override any of them)
-----------------------------------

- ``capabilities = Capabilities()``, ``url = None``, ``options = {}``.
- ``migrate()``: nothing, returns None (no versioned schema). ``close()``: nothing.
- ``now()``: this host's wall clock, in UTC.
- ``get(event_id)``: one ``events(after_id=event_id - 1, limit=1)`` call.
- ``dead_letters(*, topic, since, limit)``: every event read through ``events``, page by
  page; the dead ones, oldest failure first, with their ``records``.
- ``stats(*, now)``: every event read through ``events``: counts by state and topic, the
  oldest due instant, the keys with a dead event, as the built-in stores count them.
- ``batch(*, now)``: raises ``ConfigurationError`` (no batches).
- ``rounds(*, concurrency=1)``: a context manager yielding the ``Deliveries`` of one per-event
  round: the store itself. A store that keeps a round's own context (a connection held for
  the round, records pipelined: the PostgreSQL store) yields that instead.
- ``record_many(handler, claims, *, now)`` (``DeliveriesBase``, so on batches too): one
  ``delivery`` and ``record`` per claim, False where ``LeaseLostError``.
- ``make_waiter()``: None. ``async_store()``: raises ``ConfigurationError`` (no asyncio side).
- ``attempt_errors(event_id)``: none kept (``[]``); a store declaring ``error_history``
  returns each failed attempt's ``AttemptError``, oldest first.

A batch transaction (``capabilities.batches``) derives from ``BatchBase``: ``delivery`` (a
savepoint of the batch), ``extend`` and ``settle_many`` in the batch's one transaction, with
the defaults ``record_many`` and ``settle_last(items, *, now)`` (the settlement as the batch's
last write; default ``settle_many``). The asyncio side (``capabilities.asyncio``) derives
from ``AsyncStoreBase`` (``enqueue``, ``claim``, ``release``, ``delivery``, ``extend``,
``settle_many``; the defaults ``batch``, ``rounds`` yielding the side itself,
``record_many``, ``make_waiter`` and ``close`` as coroutines where the protocol awaits), its
batches from ``AsyncBatchBase``. The pollers call ``rounds``, ``record_many`` and
``settle_last`` on every store: the defaults are how a store without a faster way does them.

Capabilities (``Capabilities``; ``CAPABILITIES`` says what each promises)
------------------------------------------------------------------------

- ``batches``: ``batch()`` works; pollers may run ``transaction="per_batch"``.
- ``asyncio``: ``async_store()`` works; ``Outbox.enqueue_async`` and the asyncio poller.
- ``waiter``: ``make_waiter()`` wakes pollers on commits in other processes.
- ``ordering``: per-key order (R15) and ``dead_key="hold"``. Without it ``Outbox`` refuses an
  enqueue with a ``key`` and ``Outbox(..., dead_key="hold")`` (``ConfigurationError``).
- ``dedupe``: dedupe keys (R16). Without it ``Outbox`` refuses an enqueue with a
  ``dedupe_key``.
- ``error_history``: ``attempt_errors(event_id)`` lists the error of each failed attempt
  (``Outbox.attempt_errors``, the dashboard's event page).
- ``transactional_handlers`` (true by default), ``concurrent_claimers``,
  ``concurrent_batches``, ``multiprocess``, ``database_clock``: what the store is safe for.

The conformance suite runs the checks of each declared capability and skips the others,
naming the capability.

Registering the store
---------------------

A store package registers its URL schemes through the ``outboxkit`` entry-point group: a module
with a ``hookimpl``-marked ``outboxkit_register_stores(register: RegisterStore)`` that calls
``register(name, factory, schemes=(...))``. A factory whose driver is missing raises
``MissingDependency`` naming the extra to install. ``SchemaError`` (with ``migrate_hint()``)
says the database has no schema, or an older one; ``Reject`` is what a handler raises to
reject an event, which a store never records as a failure of its own.
"""

from __future__ import annotations

from ..capabilities import CAPABILITIES, Capabilities
from ..core.machine import DeadLetter as DeadLetterSettlement
from ..core.machine import Publish as PublishSettlement
from ..core.machine import Retry as RetrySettlement
from ..core.machine import Settlement
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
    decode_payload,
    make_claim,
)
from ..errors import (
    BatchRolledBack,
    ConfigurationError,
    HandlerCrashed,
    LeaseLostError,
    MissingDependency,
    Reject,
    SchemaError,
    StoreError,
    StoreUnavailable,
    migrate_hint,
)
from ..hookspecs import RegisterStore, hookimpl
from ..store import (
    AsyncBatchTransaction,
    AsyncDeliveries,
    AsyncDeliveryTransaction,
    AsyncStore,
    BatchTransaction,
    Deliveries,
    DeliveryTransaction,
    SettleItem,
    Store,
    settle_one,
)
from ..waiter import AsyncClosingWaiter, ClosingWaiter
from .bases import (
    AsyncBatchBase,
    AsyncDeliveriesBase,
    AsyncStoreBase,
    BatchBase,
    DeliveriesBase,
    StoreBase,
)

__all__ = [
    "CAPABILITIES",
    "AsyncBatchBase",
    "AsyncBatchTransaction",
    "AsyncClosingWaiter",
    "AsyncDeliveries",
    "AsyncDeliveriesBase",
    "AsyncDeliveryTransaction",
    "AsyncStore",
    "AsyncStoreBase",
    "AttemptError",
    "BatchBase",
    "BatchRolledBack",
    "BatchTransaction",
    "Capabilities",
    "Claim",
    "ClosingWaiter",
    "ConfigurationError",
    "DeadKey",
    "DeadLetter",
    "DeadLetterSettlement",
    "Deliveries",
    "DeliveriesBase",
    "DeliveryRecord",
    "DeliveryTransaction",
    "Event",
    "HandlerCrashed",
    "LeaseLostError",
    "Migration",
    "MissingDependency",
    "NewEvent",
    "Outcome",
    "PublishSettlement",
    "RegisterStore",
    "Reject",
    "RetrySettlement",
    "SchemaError",
    "SettleItem",
    "Settlement",
    "State",
    "Stats",
    "Store",
    "StoreBase",
    "StoreError",
    "StoreUnavailable",
    "decode_payload",
    "hookimpl",
    "make_claim",
    "migrate_hint",
    "settle_one",
]
