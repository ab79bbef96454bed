"""Delivery transactions (R5, R6): records and follow-ups commit together or not at all, one
record per event and handler, and recorded handlers come back with the next claim."""

from __future__ import annotations

import pytest

from outboxkit import FrozenClock, Outcome, Store
from outboxkit.core.machine import Retry
from outboxkit.core.payload import build_event
from outboxkit.store import settle_one

from ._base import ConformanceBase, S

__all__ = ["DeliveryTests"]


class DeliveryTests(ConformanceBase):
    """One event's delivery transaction on the store itself (``transaction="per_event"``)."""

    def test_delivery_commits_records_and_follow_ups(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        with store.delivery(claim, now=clock.now()) as tx:
            (follow_up,) = tx.enqueue([build_event("next", {"from": event_id})])
            tx.record("h1", Outcome.SUCCEEDED)
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("h2", Outcome.REJECTED, reason="no stock")
        records = {r.handler: r for r in store.records(event_id)}
        assert records["h1"].outcome is Outcome.SUCCEEDED
        assert records["h1"].attempt == 1
        assert records["h1"].recorded_at == clock.now()
        assert records["h2"].outcome is Outcome.REJECTED
        assert records["h2"].reason == "no stock"
        got = store.get(follow_up)
        assert got is not None and got.topic == "next" and got.payload == {"from": event_id}

    def test_failed_delivery_rolls_back(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        event_id = claim.event.id
        follow_up: list[int] = []
        with (
            pytest.raises(RuntimeError, match="handler failed"),
            store.delivery(claim, now=clock.now()) as tx,
        ):
            follow_up = tx.enqueue([build_event("next", 1)])
            tx.record("h1", Outcome.SUCCEEDED)
            raise RuntimeError("handler failed")
        assert store.records(event_id) == []
        assert store.get(follow_up[0]) is None
        assert store.stats(now=clock.now()).total == 1

    def test_records_of_deliveries_that_never_took_the_connection(
        self, store: Store, clock: FrozenClock
    ) -> None:
        """A delivery whose block only records (a store may write it as one fenced statement)
        commits its record, and a rejection's reason, like any other."""
        (first, second) = self.put(store, clock.now(), ("t", 1), ("t", 2))
        claims = self.claim(store, clock.now())
        with store.delivery(claims[0], now=clock.now()) as tx:
            tx.record("h", Outcome.SUCCEEDED)
        with store.delivery(claims[1], now=clock.now()) as tx:
            tx.record("h", Outcome.REJECTED, reason="no stock")
        (one,) = store.records(first)
        (two,) = store.records(second)
        assert (one.handler, one.outcome, one.attempt) == ("h", Outcome.SUCCEEDED, 1)
        assert one.recorded_at == clock.now()
        assert two.outcome is Outcome.REJECTED
        assert two.reason == "no stock"

    def test_recorded_handlers_come_back_with_the_claim(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("ok", Outcome.SUCCEEDED)
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("no", Outcome.REJECTED, reason="r")
        retry = Retry(delay=5 * S, retry=1)
        assert settle_one(store, claim, retry, error="other: boom", now=clock.now()) is True
        (again,) = self.claim(store, clock.now() + 5 * S)
        assert again.event.id == event_id
        assert dict(again.done) == {"ok": Outcome.SUCCEEDED, "no": Outcome.REJECTED}
        assert again.attempt == 2

    def test_delivery_record_is_unique_per_event_and_handler(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("h", Outcome.SUCCEEDED)
        with pytest.raises(Exception), store.delivery(claim, now=clock.now()) as tx:  # noqa: B017
            tx.record("h", Outcome.SUCCEEDED)
        assert len(store.records(event_id)) == 1
