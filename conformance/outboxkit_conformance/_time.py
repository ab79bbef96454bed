"""Time: a store uses the instant it is given (``now=...``) and nothing else; ``now=None``
means its production clock, ``store.now()``; an event scheduled for an absolute instant
(``available_at``) is due then, in due order."""

from __future__ import annotations

from datetime import timedelta

import pytest

from outboxkit import FrozenClock, InvalidEvent, Outbox, Store
from outboxkit.core.machine import Publish
from outboxkit.store import settle_one

from ._base import LEASE, ConformanceBase, S

__all__ = ["TimeTests"]


class TimeTests(ConformanceBase):
    """Given time, the production clock path, ``now()``, and absolute scheduling."""

    def test_store_honours_the_given_time(self, store: Store) -> None:
        y2001 = FrozenClock("2001-01-01T00:00:00Z").now()
        y2099 = FrozenClock("2099-06-01T12:00:00Z").now()
        (event_id,) = self.put(store, y2001, ("t", 1))
        event = store.get(event_id)
        assert event is not None
        assert event.created_at == y2001 and event.available_at == y2001
        assert self.claim(store, y2001 - S) == []
        (claim,) = self.claim(store, y2001)
        assert claim.locked_until == y2001 + LEASE
        (again,) = self.claim(store, y2099)  # the 2001 lease is long gone
        assert again.attempt == 2
        assert again.locked_until == y2099 + LEASE
        assert settle_one(store, again, Publish(), error=None, now=y2099) is True
        (future,) = self.put(store, y2099, ("t", 2, 3600))
        assert self.claim(store, y2099) == []
        assert self.ids(self.claim(store, y2099 + timedelta(hours=1))) == [future]

    def test_production_clock_path(self, store: Store) -> None:
        # now=None: the store's own clock (the database clock where it has one).
        (event_id,) = self.put(store, None, ("t", 1))
        (claim,) = self.claim(store, None)
        assert claim.event.id == event_id
        assert settle_one(store, claim, Publish(), error=None, now=None) is True
        assert store.stats(now=None).published == 1

    def test_now_is_the_stores_production_clock(self, store: Store) -> None:
        # What now=None means: an aware instant; an event enqueued with now=None is stamped
        # with it (the store's clock is where every cutoff comes from).
        before = store.now()
        assert before.utcoffset() is not None
        (event_id,) = self.put(store, None, ("t", 1))
        after = store.now()
        event = store.get(event_id)
        assert event is not None and event.created_at is not None
        slack = timedelta(seconds=5)  # a database clock is read at its own statement's start
        assert before - slack <= event.created_at <= after + slack

    def test_available_at(self, store: Store, outbox: Outbox, clock: FrozenClock) -> None:
        now = clock.now()
        with store.transaction() as conn:
            later = outbox.enqueue(conn, "t", "later", available_at=now + 10 * S)
            at_now = outbox.enqueue(conn, "t", "now", available_at=now)
            past = outbox.enqueue(conn, "t", "past", available_at=now - 60 * S)
            with pytest.raises(InvalidEvent, match="naive"):
                outbox.enqueue(conn, "t", "x", available_at=now.replace(tzinfo=None))
            with pytest.raises(InvalidEvent, match="not both"):
                outbox.enqueue(conn, "t", "x", available_at=now, delay=1)
        assert self.ids(self.claim(store, now)) == [past, at_now]  # due order, not id order
        assert self.claim(store, now + 9 * S) == []
        assert self.ids(self.claim(store, now + timedelta(seconds=10))) == [later]
