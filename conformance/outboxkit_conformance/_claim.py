"""Claim (R2-R4) and its leases: what is due, in which order, how many; attempts, leases and
tokens; extend and release; a stale token changes nothing."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest

from outboxkit import FrozenClock, LeaseLostError, Outcome, Store
from outboxkit.core.machine import DeadLetter, Publish
from outboxkit.store import settle_one

from ._base import LEASE, ConformanceBase, S

__all__ = ["ClaimTests"]


class ClaimTests(ConformanceBase):
    """Due-ness, order, batch limits, leases and fencing by token."""

    def test_claim_takes_due_events_oldest_first(self, store: Store, clock: FrozenClock) -> None:
        now = clock.now()
        late = self.put(store, now, ("t", "late", 10))
        first = self.put(store, now - 5 * S, ("t", "first"))
        second = self.put(store, now - 5 * S, ("t", "second"))
        third = self.put(store, now, ("t", "third"))
        claims = self.claim(store, now)
        assert self.ids(claims) == first + second + third
        assert late[0] not in self.ids(claims)

    def test_delayed_event_is_due_at_its_time(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1, 60))
        assert self.claim(store, clock.now() + 59 * S) == []
        assert self.ids(self.claim(store, clock.now() + 60 * S)) == [event_id]

    def test_batch_limit_holds(self, store: Store, clock: FrozenClock) -> None:
        ids = self.put(store, clock.now(), *[("t", i) for i in range(7)])
        assert self.ids(self.claim(store, clock.now(), batch_size=3)) == ids[:3]
        assert self.ids(self.claim(store, clock.now(), batch_size=3)) == ids[3:6]
        assert self.ids(self.claim(store, clock.now(), batch_size=3)) == ids[6:]
        assert self.claim(store, clock.now(), batch_size=3) == []

    def test_claim_counts_the_attempt_and_sets_the_lease(
        self, store: Store, clock: FrozenClock
    ) -> None:
        self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now(), lease=timedelta(seconds=45))
        assert claim.attempt == 1
        assert claim.locked_until == clock.now() + timedelta(seconds=45)
        assert claim.token
        assert claim.done == {}
        event = store.get(claim.event.id)
        assert event is not None and event.attempts == 1
        assert store.stats(now=clock.now()).claimed == 1

    def test_leased_event_is_not_claimed_again(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("t", 1))
        assert len(self.claim(store, clock.now())) == 1
        assert self.claim(store, clock.now() + LEASE - S) == []

    def test_lease_expiry_makes_the_event_claimable(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (first,) = self.claim(store, clock.now())
        (second,) = self.claim(store, clock.now() + LEASE)
        assert second.event.id == event_id
        assert second.attempt == 2  # R4: the crashed attempt is used up
        assert second.token != first.token

    def test_claims_return_distinct_fresh_tokens(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), *[("t", i) for i in range(10)])
        tokens = [c.token for c in self.claim(store, clock.now())]
        assert len(set(tokens)) == 10

    def test_extend_pushes_the_lease(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("t", 1), ("t", 2))
        claims = self.claim(store, clock.now())
        later = clock.now() + 20 * S
        kept = store.extend(claims, lease=LEASE, now=later)
        assert sorted(self.ids(kept)) == sorted(self.ids(claims))
        assert all(c.locked_until == later + LEASE for c in kept)
        assert self.claim(store, clock.now() + LEASE + S) == []  # the old lease end passed
        assert len(self.claim(store, later + LEASE)) == 2

    def test_release_refunds_the_attempt(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        claims = self.claim(store, clock.now())
        assert store.release(claims, now=clock.now()) == 1
        (again,) = self.claim(store, clock.now())  # at once, no lease to wait out
        assert again.event.id == event_id
        assert again.attempt == 1

    def test_stale_token_changes_nothing(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (stale,) = self.claim(store, clock.now())
        later = clock.now() + LEASE
        (fresh,) = self.claim(store, later)
        assert settle_one(store, stale, Publish(), error=None, now=later) is False
        assert settle_one(store, stale, DeadLetter(), error="x", now=later) is False
        assert store.extend([stale], lease=LEASE, now=later) == []
        assert store.release([stale], now=later) == 0
        with pytest.raises(LeaseLostError), store.delivery(stale, now=later) as tx:
            tx.record("h", Outcome.SUCCEEDED)  # pragma: no cover - never reached
        event = store.get(event_id)
        assert event is not None and event.attempts == 2
        assert store.records(event_id) == []
        assert store.stats(now=later).claimed == 1
        # The new owner is unaffected.
        assert settle_one(store, fresh, Publish(), error=None, now=later) is True
        assert store.stats(now=later).published == 1

    def test_a_refused_connection_stays_refused_when_the_refusal_is_swallowed(
        self, store: Store, clock: FrozenClock
    ) -> None:
        """R6: a handler that catches the ``LeaseLostError`` its stale ``tx.connection`` raised
        and goes on, writes nothing: the delivery still ends refused, its record unwritten."""
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (stale,) = self.claim(store, clock.now())
        later = clock.now() + LEASE
        (fresh,) = self.claim(store, later)
        with pytest.raises(LeaseLostError), store.delivery(stale, now=later) as tx:
            with contextlib.suppress(LeaseLostError):
                _ = tx.connection
            tx.record("h", Outcome.SUCCEEDED)
        assert store.records(event_id) == []
        assert settle_one(store, fresh, Publish(), error=None, now=later) is True
