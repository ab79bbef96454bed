"""Batches (``capabilities.batches``): one transaction for a claimed batch, a savepoint per
delivery, settlements and lease extensions inside it, everything committed once."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from outboxkit import FrozenClock, LeaseLostError, Outcome, Store
from outboxkit.core.machine import Publish, Retry
from outboxkit.core.payload import build_event
from outboxkit.store import SettleItem, settle_one

from ._base import LEASE, ConformanceBase, S

__all__ = ["BatchTests"]


class BatchTests(ConformanceBase):
    """``store.batch()``: skipped for a store without the ``batches`` capability."""

    def test_batch_commits_once_and_a_savepoint_rolls_back_one_delivery(
        self, store: Store, clock: FrozenClock
    ) -> None:
        self.require(store, "batches")
        ids = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3))
        claims = self.claim(store, clock.now())
        follow_ups: list[int] = []
        with store.batch(now=clock.now()) as batch:
            with batch.delivery(claims[0], now=clock.now()) as tx:
                follow_ups += tx.enqueue([build_event("next", 1)])
                tx.record("h", Outcome.SUCCEEDED)
            with (
                pytest.raises(RuntimeError, match="second fails"),
                batch.delivery(claims[1], now=clock.now()) as tx,
            ):
                follow_ups += tx.enqueue([build_event("next", 2)])
                tx.record("h", Outcome.SUCCEEDED)
                raise RuntimeError("second fails")
            with batch.delivery(claims[2], now=clock.now()) as tx:
                tx.record("h", Outcome.REJECTED, reason="no")
            assert settle_one(batch, claims[0], Publish(), error=None, now=clock.now()) is True
            retry = Retry(delay=5 * S, retry=1)
            assert settle_one(batch, claims[1], retry, error="h: boom", now=clock.now()) is True
            assert settle_one(batch, claims[2], Publish(), error=None, now=clock.now()) is True
            kept = batch.extend(claims, lease=LEASE, now=clock.now())
            assert self.ids(kept) == []  # all three settled already (in this transaction)
        one, two, three = (store.get(i) for i in ids)
        assert one is not None and one.published_at == clock.now()
        assert two is not None and two.published_at is None and two.last_error == "h: boom"
        assert two.available_at == clock.now() + 5 * S
        assert three is not None and three.published_at == clock.now()
        assert [r.outcome for r in store.records(ids[0])] == [Outcome.SUCCEEDED]
        assert store.records(ids[1]) == []
        assert [r.reason for r in store.records(ids[2])] == ["no"]
        assert store.get(follow_ups[0]) is not None
        assert store.get(follow_ups[1]) is None

    def test_batch_settle_many_writes_in_the_batch(self, store: Store, clock: FrozenClock) -> None:
        """A batch's events are settled with one ``settle_many`` inside the batch: fenced by
        token, true once the batch commits, undone if it rolls back."""
        self.require(store, "batches")
        ids = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3))
        claims = self.claim(store, clock.now(), batch_size=2)
        at = clock.now() + S
        with (
            pytest.raises(RuntimeError, match="batch dies"),
            store.batch(now=at) as batch,
        ):
            assert batch.settle_many([(claims[0], Publish(), None)], now=at) == [True]
            raise RuntimeError("batch dies")
        undone = store.get(ids[0])
        assert undone is not None and undone.published_at is None
        (other,) = self.claim(store, clock.now(), batch_size=1)  # the third, not in the batch
        with store.batch(now=at) as batch:
            for claim in claims:
                with batch.delivery(claim, now=at) as tx:
                    tx.record("h", Outcome.SUCCEEDED)
            done = batch.settle_many(
                [
                    (claims[0], Publish(), None),
                    (claims[1], Retry(delay=5 * S, retry=1), "h: boom"),
                    (replace(other, token=claims[0].token), Publish(), None),
                ],
                now=at,
            )
            assert batch.settle_many([], now=at) == []
        assert done == [True, True, False]
        one, two, three = (store.get(i) for i in ids)
        assert one is not None and one.published_at == at
        assert two is not None and two.available_at == at + 5 * S and two.last_error == "h: boom"
        assert three is not None and three.published_at is None  # a foreign token settles nothing
        assert settle_one(store, other, Publish(), error=None, now=at) is True

    def test_batch_settle_last_commits_everything_the_batch_wrote(
        self, store: Store, clock: FrozenClock
    ) -> None:
        """The settlement as the batch's last write (``settle_last``; ``BatchBase``'s default
        is ``settle_many``): fenced by token, committed with the batch's records and its
        deliveries' writes, whether or not a delivery took the connection."""
        self.require(store, "batches")
        ids = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3))
        claims = self.claim(store, clock.now(), batch_size=2)
        at = clock.now() + S
        with store.batch(now=at) as batch:  # no delivery takes the connection
            for claim in claims:
                with batch.delivery(claim, now=at) as tx:
                    tx.record("h", Outcome.SUCCEEDED)
            stale = replace(claims[1], token=claims[0].token)
            first = [(claims[0], Publish(), None), (stale, Publish(), None)]
            assert batch.settle_last(first, now=at) == [True, False]
        one, two, three = (store.get(i) for i in ids)
        assert one is not None and one.published_at == at
        assert [(r.handler, r.outcome) for r in store.records(ids[0])] == [("h", Outcome.SUCCEEDED)]
        assert two is not None and two.published_at is None  # its settlement was stale
        (other,) = self.claim(store, clock.now(), batch_size=1)  # the third
        follow_ups: list[int] = []
        with store.batch(now=at) as batch:  # the deliveries take the connection
            for claim in (claims[1], other):
                with batch.delivery(claim, now=at) as tx:
                    follow_ups += tx.enqueue([build_event("next", claim.event.id)])
                    tx.record("h2", Outcome.SUCCEEDED)
            retry = Retry(delay=5 * S, retry=1)
            items: list[SettleItem] = [(claims[1], Publish(), None), (other, retry, "h2: boom")]
            assert batch.settle_last(items, now=at) == [True, True]
        two, three = store.get(ids[1]), store.get(ids[2])
        assert two is not None and two.published_at == at
        assert three is not None and three.available_at == at + 5 * S
        assert three.last_error == "h2: boom"
        assert all(store.get(i) is not None for i in follow_ups) and len(follow_ups) == 2
        assert [(r.handler, r.outcome) for r in store.records(ids[2])] == [
            ("h2", Outcome.SUCCEEDED)
        ]
        with store.batch(now=at) as batch:  # nothing to settle: nothing written
            assert batch.settle_last([], now=at) == []
        assert store.stats(now=at).published == 2

    def test_batch_that_raises_leaves_nothing(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "batches")
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        with (
            pytest.raises(RuntimeError, match="poller died"),
            store.batch(now=clock.now()) as batch,
        ):
            with batch.delivery(claim, now=clock.now()) as tx:
                tx.enqueue([build_event("next", 1)])
                tx.record("h", Outcome.SUCCEEDED)
            assert settle_one(batch, claim, Publish(), error=None, now=clock.now()) is True
            raise RuntimeError("poller died")
        event = store.get(event_id)
        assert event is not None and event.published_at is None
        assert store.records(event_id) == []
        assert store.stats(now=clock.now()).total == 1  # no follow-up
        # The claim still holds: once its lease passes, another poller takes the event over.
        assert self.claim(store, clock.now()) == []
        (again,) = self.claim(store, clock.now() + LEASE)
        assert (again.event.id, again.attempt, dict(again.done)) == (event_id, 2, {})

    def test_batch_refuses_a_stale_token(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "batches")
        self.put(store, clock.now(), ("t", 1))
        (stale,) = self.claim(store, clock.now())
        (fresh,) = self.claim(store, clock.now() + LEASE)
        with store.batch(now=clock.now() + LEASE) as batch:
            with pytest.raises(LeaseLostError), batch.delivery(stale, now=clock.now() + LEASE):
                pass
            assert settle_one(batch, stale, Publish(), error=None, now=clock.now() + LEASE) is False
            assert batch.extend([stale], lease=LEASE, now=clock.now() + LEASE) == []
        assert settle_one(store, fresh, Publish(), error=None, now=clock.now() + LEASE) is True

    @pytest.mark.parametrize("swallows", [False, True], ids=["records", "swallows-refusal"])
    def test_a_stale_claims_record_in_a_batch_is_never_written(
        self, store: Store, clock: FrozenClock, swallows: bool
    ) -> None:
        """A store may open a delivery lazily and keep its record for the batch's end: then the
        stale token shows there (no record, the settlement refused), not at the delivery. A
        handler that takes the connection, catches its ``LeaseLostError`` and goes on
        (``swallows``) has nothing committed either (R6); the batch's other deliveries commit."""
        self.require(store, "batches")
        (event_id, other) = self.put(store, clock.now(), ("t", 1), ("t", 2))
        (stale, mine) = self.claim(store, clock.now())
        later = clock.now() + LEASE
        (fresh,) = self.claim(store, later, batch_size=1)
        assert fresh.event.id == event_id
        with store.batch(now=later) as batch:
            try:
                with batch.delivery(stale, now=later) as tx:
                    if swallows:
                        with contextlib.suppress(LeaseLostError):
                            _ = tx.connection
                    tx.record("h", Outcome.SUCCEEDED)
            except LeaseLostError:
                pass  # refused at once, or as the block ends: as good
            with batch.delivery(mine, now=later) as tx:
                tx.record("h", Outcome.SUCCEEDED)
            settled = batch.settle_many(
                [(stale, Publish(), None), (mine, Publish(), None)], now=later
            )
        assert settled == [False, True]
        assert store.records(event_id) == []
        assert [r.handler for r in store.records(other)] == ["h"]
        assert settle_one(store, fresh, Publish(), error=None, now=later) is True
