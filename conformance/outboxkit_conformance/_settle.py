"""Settle (R8, R10): publish, retry and dead-letter through ``settle_many``, each item fenced
by its claim's token, each written once."""

from __future__ import annotations

from outboxkit import FrozenClock, Outbox, Store
from outboxkit.core.machine import DeadLetter, Publish, Retry
from outboxkit.store import settle_one

from ._base import LEASE, ConformanceBase, S

__all__ = ["SettleTests"]


class SettleTests(ConformanceBase):
    """What each settlement writes, on the store itself."""

    def test_publish_sets_published_at(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        at = clock.now() + 3 * S
        assert settle_one(store, claim, Publish(), error=None, now=at) is True
        stats = store.stats(now=at)
        assert (stats.published, stats.pending, stats.claimed) == (1, 0, 0)
        assert self.claim(store, at + 1000 * LEASE) == []
        assert store.get(event_id) is not None

    def test_retry_schedules_available_at(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        at = clock.now() + 2 * S
        assert settle_one(store, claim, Retry(delay=8 * S, retry=1), error="h: boom", now=at)
        event = store.get(event_id)
        assert event is not None
        assert event.available_at == at + 8 * S
        assert event.attempts == 1
        assert self.claim(store, at + 7 * S) == []  # lease cleared, but not yet available
        (again,) = self.claim(store, at + 8 * S)
        assert again.attempt == 2

    def test_each_failed_attempt_keeps_its_error(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "error_history")
        outbox = Outbox(store, load_entry_points=False)
        failing, fine = self.put(store, clock.now(), ("t", 1), ("t", 2))
        first, ok = self.claim(store, clock.now(), batch_size=2)
        t1 = clock.now() + S
        assert settle_one(store, first, Retry(delay=S, retry=1), error="h: first", now=t1)
        assert settle_one(store, ok, Publish(), error=None, now=t1)
        (second,) = self.claim(store, t1 + S)
        t2 = t1 + 2 * S
        assert settle_one(store, second, DeadLetter(), error="h: second", now=t2)
        kept = [(e.attempt, e.at, e.error) for e in outbox.attempt_errors(failing)]
        assert kept == [(1, t1, "h: first"), (2, t2, "h: second")]
        assert outbox.attempt_errors(fine) == []
        assert store.requeue([failing], now=t2) == 1  # a requeue keeps the history
        assert len(outbox.attempt_errors(failing)) == 2

    def test_settle_twice_is_refused(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        assert settle_one(store, claim, Publish(), error=None, now=clock.now()) is True
        assert settle_one(store, claim, DeadLetter(), error="x", now=clock.now()) is False
        assert store.stats(now=clock.now()).published == 1
        assert store.stats(now=clock.now()).dead == 0

    def test_settle_many_settles_each_fenced_by_its_token(
        self, store: Store, clock: FrozenClock
    ) -> None:
        ids = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3), ("t", 4))
        claims = self.claim(store, clock.now(), batch_size=3)
        (stale,) = self.claim(store, clock.now(), batch_size=1)
        assert store.release([stale], now=clock.now()) == 1
        (fresh,) = self.claim(store, clock.now(), batch_size=1)  # the 4th, a new token
        assert (fresh.event.id, fresh.attempt) == (stale.event.id, 1)
        later = clock.now() + S
        done = store.settle_many(
            [
                (claims[0], Publish(), None),
                (claims[1], Retry(delay=5 * S, retry=1), "h: boom"),
                (claims[2], DeadLetter(), "h: always"),
                (stale, Publish(), None),
            ],
            now=later,
        )
        assert done == [True, True, True, False]
        one, two, three, four = (store.get(i) for i in ids)
        assert one is not None and one.published_at == later
        assert two is not None and two.available_at == later + 5 * S
        assert two.last_error == "h: boom" and two.published_at is None
        assert three is not None and three.failed_at == later and three.last_error == "h: always"
        assert four is not None and four.published_at is None  # the stale token changed nothing
        assert store.settle_many([(fresh, Publish(), None)], now=later) == [True]
        assert store.settle_many([], now=later) == []
