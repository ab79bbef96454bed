"""How a poller settles, by what the store declares (``outboxkit.store.CAPABILITIES``).

On the memory store with ``settle_many`` added: per event, a round's settlements go in one
``settle_many``; in a batch whose ``BatchTransaction`` has no ``settle_many`` (a custom store
that declares ``batched_settle`` but implemented it on the store only), each event is settled
through the batch on its own instead of failing.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import pytest

from outboxkit import Claim, Event, EventBus, FrozenClock, MemoryStore, Outbox
from outboxkit._machine import Settlement


class ManySettlingStore(MemoryStore):
    """The memory store with a store-level ``settle_many`` (its batches have none)."""

    capabilities = MemoryStore.capabilities | {"batched_settle"}

    def __init__(self) -> None:
        super().__init__()
        self.settle_many_calls: list[list[int]] = []

    def settle_many(
        self, items: Sequence[tuple[Claim, Settlement, str | None]], *, now: datetime | None
    ) -> list[bool]:
        self.settle_many_calls.append([claim.event.id for claim, _, _ in items])
        return [self.settle(c, s, error=e, now=now) for c, s, e in items]


@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_the_poller_settles_through_settle_many_where_it_can(transaction: str) -> None:
    store = ManySettlingStore()
    bus = EventBus()
    seen: list[int] = []

    @bus.handler("t", name="h")
    def handle(event: Event, ctx: object) -> None:
        seen.append(event.id)

    outbox = Outbox(store, bus, clock=FrozenClock(), load_entry_points=False)
    with store.transaction() as tx:
        ids = outbox.enqueue_many(tx, [("t", n) for n in range(5)])
    report = outbox.poller(transaction=transaction, batch_size=10).run_once()
    assert report.published == ids and seen == ids
    for event_id in ids:
        event = store.get(event_id)
        assert event is not None and event.published_at is not None
    # Per event: one settle_many for the round. In a batch without it: none, and no failure.
    assert store.settle_many_calls == ([ids] if transaction == "per_event" else [])
