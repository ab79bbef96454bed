"""``prefetch``: the next batch claimed while one is delivered. Every event is still delivered
once, follow-ups enqueued by the batch in hand are not missed by an empty prefetched claim, a
stopping poller hands its prefetched claims back, and a store where a claim would wait for the
batch's lock (SQLite) claims as usual. The memory store lets others claim while a batch is
open, as PostgreSQL does (``tests/integration/pg/test_prefetch_pg.py``)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    MemoryStore,
    Outbox,
    State,
)
from outboxkit.core.machine import prefetches
from outboxkit.testing import Drain
from outboxkit_sqlite import SQLiteStore


@pytest.mark.parametrize(
    ("enabled", "claimed", "batch_size", "expected"),
    [(True, 50, 50, True), (True, 49, 50, False), (False, 50, 50, False), (True, 0, 1, False)],
)
def test_a_poller_prefetches_only_after_a_full_claim(
    enabled: bool, claimed: int, batch_size: int, expected: bool
) -> None:
    assert prefetches(enabled=enabled, claimed=claimed, batch_size=batch_size) is expected


def test_prefetch_must_be_a_flag() -> None:
    outbox = Outbox(MemoryStore(), EventBus(), load_entry_points=False)
    with pytest.raises(ConfigurationError, match="prefetch must be True or False, got 'yes'"):
        outbox.poller(prefetch="yes")


class Claims:
    """Records the thread of every claim the store answers."""

    def __init__(self, store: Any) -> None:
        self.threads: list[str] = []
        claim = store.claim

        def recording(**kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            return claim(**kwargs)

        store.claim = recording

    @property
    def prefetched(self) -> int:
        return sum(name.startswith("outboxkit-prefetch") for name in self.threads)


def follow_up_outbox(store: Any, seen: Counter[int]) -> Outbox:
    """``order`` events each enqueue one ``receipt`` follow-up; both topics are counted."""
    bus = EventBus()

    @bus.handler("order", name="orders")
    def order(event: Event, ctx: Any) -> None:
        seen[event.id] += 1
        ctx.enqueue("receipt", {"order": event.id})

    @bus.handler("receipt", name="receipts")
    def receipt(event: Event, ctx: Any) -> None:
        seen[event.id] += 1

    return Outbox(store, bus, load_entry_points=False)


@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_every_event_and_every_follow_up_is_delivered_once(transaction: str) -> None:
    store = MemoryStore()
    claims = Claims(store)
    seen: Counter[int] = Counter()
    outbox = follow_up_outbox(store, seen)
    with store.transaction() as tx:
        ids = outbox.enqueue_many(tx, [("order", {"n": i}) for i in range(200)])
    poller = outbox.poller(batch_size=50, transaction=transaction, prefetch=True)
    poller.run_until_idle()
    stats = store.stats(now=None)
    assert stats.published == 400 and stats.pending == stats.claimed == 0
    assert len(seen) == 400 and set(seen.values()) == {1}
    assert set(ids) <= set(seen)
    assert claims.prefetched >= 3  # the claims after full batches ran on the prefetch thread


def test_the_asyncio_poller_prefetches_in_a_task_and_delivers_everything_once() -> None:
    store = MemoryStore()
    seen: Counter[int] = Counter()
    bus = EventBus()

    @bus.handler("order", name="orders")
    async def order(event: Event, ctx: Any) -> None:
        seen[event.id] += 1
        ctx.enqueue("receipt", {"order": event.id})

    @bus.handler("receipt", name="receipts")
    async def receipt(event: Event, ctx: Any) -> None:
        seen[event.id] += 1

    outbox = Outbox(store, bus, load_entry_points=False)
    with store.transaction() as tx:
        outbox.enqueue_many(tx, [("order", {"n": i}) for i in range(120)])
    poller = outbox.async_poller(batch_size=40, prefetch=True, concurrency=4)
    reports = asyncio.run(poller.run_until_idle())
    assert len(seen) == 240 and set(seen.values()) == {1}
    assert sum(len(r.claimed) for r in reports) == 240
    assert store.stats(now=None).published == 240


@pytest.mark.parametrize("side", ["blocking", "asyncio"])
def test_a_stopping_poller_hands_its_prefetched_claims_back(side: str) -> None:
    """Stopped on the first event: the prefetched batch is released (leases cleared, attempts
    refunded), as the unstarted rest of the batch in hand is."""
    store = MemoryStore()
    bus = EventBus()
    delivered: list[int] = []
    poller: Any = None

    def stop_at_once(event: Event, ctx: Any) -> None:
        delivered.append(event.id)
        poller.stop()

    async def stop_at_once_async(event: Event, ctx: Any) -> None:
        stop_at_once(event, ctx)

    bus.subscribe("order", stop_at_once if side == "blocking" else stop_at_once_async, name="h")
    outbox = Outbox(store, bus, load_entry_points=False)
    with store.transaction() as tx:
        outbox.enqueue_many(tx, [("order", {"n": i}) for i in range(30)])
    claims = Claims(store)
    if side == "blocking":
        poller = outbox.poller(batch_size=10, prefetch=True)
        poller.run_until_idle()
    else:
        poller = outbox.async_poller(batch_size=10, prefetch=True)
        asyncio.run(poller.run_until_idle())
    assert len(claims.threads) == 2  # the batch in hand, and the one prefetched
    assert delivered == [delivered[0]]
    events = store.events()
    assert [e.state for e in events].count(State.PUBLISHED) == 1
    pending = [e for e in events if e.id not in delivered]
    assert len(pending) == 29
    assert all(e.state is State.PENDING and e.locked_until is None for e in pending)
    assert {e.attempts for e in pending} == {0}  # unstarted: the attempt refunded


def test_sqlite_claims_as_usual_with_prefetch(tmp_path: Path) -> None:
    """SQLite's batch holds the database's write lock: a claim from another thread would only
    wait for it, so the option claims in the poller's own thread there."""
    store = SQLiteStore(tmp_path / "outbox.db")
    claims = Claims(store)
    seen: Counter[int] = Counter()
    outbox = follow_up_outbox(store, seen)
    with store.transaction() as tx:
        outbox.enqueue_many(tx, [("order", {"n": i}) for i in range(60)])
    outbox.poller(batch_size=20, transaction="per_batch", prefetch=True).run_until_idle()
    store.close()
    assert len(seen) == 120 and set(seen.values()) == {1}
    assert claims.prefetched == 0 and len(claims.threads) >= 6


@pytest.mark.parametrize("side", ["blocking", "asyncio"])
def test_the_test_kit_drains_without_prefetch_whatever_the_app_says(side: str) -> None:
    """A drain's batches are the same on every run: the kit's poller never prefetches, even
    for an app whose ``Outbox`` does by default."""
    clock = FrozenClock()
    store = MemoryStore()
    bus = EventBus()
    seen: list[int] = []
    if side == "blocking":
        bus.subscribe("order", lambda event, ctx: seen.append(event.id), name="h")
    else:

        async def record(event: Event, ctx: Any) -> None:
            seen.append(event.id)

        bus.subscribe("order", record, name="h")
    outbox = Outbox(store, bus, clock=clock, batch_size=10, prefetch=True, load_entry_points=False)
    with store.transaction() as tx:
        outbox.enqueue_many(tx, [("order", {"n": i}) for i in range(35)])
    claims = Claims(store)
    Drain(outbox, clock)()
    assert len(seen) == 35
    # 10, 10, 10, then 5: a short batch, after which the drain reads what is left instead
    # of claiming nothing
    assert claims.prefetched == 0 and len(claims.threads) == 4


@pytest.mark.parametrize(
    ("side", "transaction"),
    [("blocking", "per_event"), ("blocking", "per_batch"), ("asyncio", "per_event")],
)
def test_the_prefetched_batch_keeps_its_leases_while_it_waits(side: str, transaction: str) -> None:
    """Item 6: ``lease=1``, ``batch_size=5``, a 0.3 s handler, ``max_retries=0``. The batch in
    hand takes 1.5 s, longer than the prefetched batch's lease: its leases are extended while
    it waits, as the batch in hand's are, so every event runs once and none is dead-lettered
    with "attempts used up" (before: 10 of 20 dead, their handler never run)."""
    store = MemoryStore()
    clock = FrozenClock()
    prefetched = threading.Event()
    claim = store.claim

    def claiming(**kwargs: Any) -> Any:
        claims = claim(**kwargs)
        if threading.current_thread() is not threading.main_thread() or side == "asyncio":
            prefetched.set()
        return claims

    store.claim = claiming  # type: ignore[method-assign]
    seen: Counter[int] = Counter()
    bus = EventBus()

    if side == "asyncio":

        @bus.handler("t", name="slow")
        async def slow_async(event: Event, ctx: Any) -> None:
            for _ in range(20):  # the prefetch task claims before the clock moves
                await asyncio.sleep(0)
            seen[event.id] += 1
            clock.advance(0.3)

    else:

        @bus.handler("t", name="slow")
        def slow(event: Event, ctx: Any) -> None:
            assert prefetched.wait(timeout=10)  # the prefetch claimed before the clock moves
            seen[event.id] += 1
            clock.advance(0.3)

    outbox = Outbox(store, bus, clock=clock, max_retries=0, load_entry_points=False)
    with store.transaction() as tx:
        ids = outbox.enqueue_many(tx, [("t", {"n": i}) for i in range(20)])
    options: dict[str, Any] = {"batch_size": 5, "lease": 1.0, "prefetch": True}
    if side == "asyncio":
        asyncio.run(outbox.async_poller(**options).run_until_idle())
    else:
        outbox.poller(transaction=transaction, **options).run_until_idle()
    stats = store.stats(now=None)
    assert stats.dead == 0 and stats.published == 20
    assert seen == Counter(ids)  # every handler ran, once
