"""One settlement path: a round's settlements are written by one ``settle_many``, on the store
(``transaction="per_event"``) or inside the batch's transaction (``"per_batch"``), whatever the
events' outcomes; nothing else settles.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import pytest

from outboxkit import Event, EventBus, FrozenClock, MemoryStore, Outbox, Reject
from outboxkit.store import SettleItem


class CountingStore(MemoryStore):
    """The memory store, counting the settle_many calls on it and on its batches."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        self.calls.append(("store", [claim.event.id for claim, _, _ in items]))
        return super().settle_many(items, now=now)

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[Any]:
        with super().batch(now=now) as batch:
            settle_many = batch.settle_many

            def counted(items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
                self.calls.append(("batch", [claim.event.id for claim, _, _ in items]))
                return settle_many(items, now=now)

            batch.settle_many = counted
            yield batch


@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_a_round_is_settled_by_one_settle_many(transaction: str) -> None:
    store = CountingStore()
    bus = EventBus()

    @bus.handler("t", name="h")
    def handle(event: Event, ctx: object) -> None:
        if event.payload == "reject":
            raise Reject("no")
        if event.payload == "fail":
            raise RuntimeError("boom")

    outbox = Outbox(store, bus, clock=FrozenClock(), max_retries=1, load_entry_points=False)
    with store.transaction() as tx:
        ids = outbox.enqueue_many(
            tx, [("t", "ok"), ("t", "reject"), ("t", "fail"), ("unrouted", "ok")]
        )
    report = outbox.poller(transaction=transaction, batch_size=10).run_once()
    assert sorted(report.published) == [ids[0], ids[1], ids[3]]
    assert report.retried == [ids[2]]
    where = "store" if transaction == "per_event" else "batch"
    assert store.calls == [(where, ids)]
