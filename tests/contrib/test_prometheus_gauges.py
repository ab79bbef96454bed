"""The store's gauges (``StoreCollector``): read from ``outbox.stats()`` at each collection,
held keys included."""

from __future__ import annotations

from typing import Any

from outboxkit import EventBus, FrozenClock, MemoryStore, Outbox
from outboxkit.contrib.prometheus import StoreCollector


def gauges(outbox: Outbox) -> dict[str, float]:
    return {family.name: family.samples[0].value for family in StoreCollector(outbox).collect()}


def test_the_gauges_follow_the_store_and_count_held_keys() -> None:
    store = MemoryStore()
    bus = EventBus()

    @bus.handler("t", name="h")
    def fail(event: Any, ctx: Any) -> None:
        raise RuntimeError("down")

    outbox = Outbox(
        store, bus, clock=FrozenClock(), max_retries=0, dead_key="hold", load_entry_points=False
    )
    with store.transaction() as tx:
        outbox.enqueue(tx, "t", {}, key="order-1")
        outbox.enqueue(tx, "t", {}, key="order-1")
    before = gauges(outbox)
    assert before["outboxkit_store_up"] == 1
    assert before["outboxkit_pending_events"] == 2
    assert before["outboxkit_held_keys"] == 0
    assert outbox.poller().run_once().dead_lettered  # the key's head dies; the key is held
    after = gauges(outbox)
    assert after["outboxkit_dead_letter_events"] == 1
    assert after["outboxkit_pending_events"] == 1
    assert after["outboxkit_held_keys"] == 1
