"""Operations: dead letters and requeue (R12), purges, stats and migrate."""

from __future__ import annotations

from datetime import timedelta

from outboxkit import FrozenClock, Outcome, Store
from outboxkit.core.machine import DeadLetter, Publish
from outboxkit.store import settle_one

from ._base import ConformanceBase, S

__all__ = ["OperationsTests"]


class OperationsTests(ConformanceBase):
    """What an operator does to a store: requeue, list dead letters, purge, count, migrate."""

    def test_dead_letter_is_never_claimed_until_requeued(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", {"p": 1}))
        (claim,) = self.claim(store, clock.now())
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("done-handler", Outcome.SUCCEEDED)
        assert settle_one(store, claim, DeadLetter(), error="h: boom", now=clock.now())
        far = clock.now() + timedelta(days=365)
        assert self.claim(store, far) == []
        (dead,) = store.dead_letters()
        assert dead.event.id == event_id
        assert dead.failed_at == clock.now()
        assert dead.last_error == "h: boom"
        assert [r.handler for r in dead.records] == ["done-handler"]
        assert store.stats(now=far).dead == 1
        assert store.requeue([event_id, 999_999], now=far) == 1
        (again,) = self.claim(store, far)
        assert again.event.id == event_id
        assert again.attempt == 1  # attempts reset
        assert dict(again.done) == {"done-handler": Outcome.SUCCEEDED}
        assert store.dead_letters() == []

    def test_requeue_ignores_events_that_are_not_dead(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (pending,) = self.put(store, clock.now(), ("t", 1))
        assert store.requeue([pending], now=clock.now()) == 0
        event = store.get(pending)
        assert event is not None and event.attempts == 0

    def test_dead_letters_filter_by_topic_and_since(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("a", 1), ("b", 2))
        claims = self.claim(store, clock.now())
        for offset, claim in enumerate(claims):
            settle_one(store, claim, DeadLetter(), error="x", now=clock.now() + offset * S)
        assert [d.event.topic for d in store.dead_letters()] == ["a", "b"]
        assert [d.event.topic for d in store.dead_letters(topic="b")] == ["b"]
        assert [d.event.topic for d in store.dead_letters(since=clock.now() + S)] == ["b"]
        assert len(store.dead_letters(limit=1)) == 1

    def test_purge_published_leaves_pending_and_dead(
        self, store: Store, clock: FrozenClock
    ) -> None:
        now = clock.now()
        old, new, dead, _pending_id = self.put(store, now, ("t", 1), ("t", 2), ("t", 3), ("t", 4))
        claims = {c.event.id: c for c in self.claim(store, now, batch_size=3)}
        with store.delivery(claims[old], now=now) as tx:
            tx.record("h", Outcome.SUCCEEDED)
        settle_one(store, claims[old], Publish(), error=None, now=now)
        settle_one(store, claims[new], Publish(), error=None, now=now + 10 * S)
        settle_one(store, claims[dead], DeadLetter(), error="x", now=now)
        deleted = store.purge_published(before=now + 5 * S, limit=1000)
        assert deleted == 1
        assert store.get(old) is None
        assert store.records(old) == []
        assert store.get(new) is not None
        stats = store.stats(now=now + 10 * S)
        assert (stats.published, stats.dead, stats.pending) == (1, 1, 1)

    def test_purge_published_in_pages(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), *[("t", i) for i in range(5)])
        for claim in self.claim(store, clock.now()):
            settle_one(store, claim, Publish(), error=None, now=clock.now())
        later = clock.now() + S
        assert store.purge_published(before=later, limit=2) == 2
        assert store.purge_published(before=later, limit=2) == 2
        assert store.purge_published(before=later, limit=2) == 1
        assert store.purge_published(before=later, limit=2) == 0

    def test_purge_dead_by_id_and_age(self, store: Store, clock: FrozenClock) -> None:
        a, b, c = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3))
        for offset, claim in enumerate(self.claim(store, clock.now())):
            settle_one(store, claim, DeadLetter(), error="x", now=clock.now() + offset * 10 * S)
        assert store.purge_dead(ids=[b], limit=100) == 1
        assert store.purge_dead(before=clock.now() + 15 * S, limit=100) == 1  # a only
        assert [d.event.id for d in store.dead_letters()] == [c]
        assert store.get(a) is None and store.get(b) is None

    def test_stats_counts_by_state_and_topic(self, store: Store, clock: FrozenClock) -> None:
        now = clock.now()
        self.put(store, now - 10 * S, ("a", 1))
        self.put(store, now, ("a", 2), ("b", 3), ("b", 4), ("c", 5, 60))
        c1, c2, c3 = self.claim(store, now, batch_size=3)
        settle_one(store, c1, Publish(), error=None, now=now)
        settle_one(store, c2, DeadLetter(), error="x", now=now)
        # c3 stays claimed; one "b" is pending and due; "c" is pending but delayed.
        assert c3.event.topic == "b"
        stats = store.stats(now=now)
        assert (stats.pending, stats.claimed, stats.published, stats.dead) == (2, 1, 1, 1)
        assert dict(stats.by_topic["a"]) == {"published": 1, "dead": 1}
        assert dict(stats.by_topic["b"]) == {"claimed": 1, "pending": 1}
        assert dict(stats.by_topic["c"]) == {"pending": 1}
        assert stats.oldest_due_at == now  # the delayed "c" event does not count

    def test_migrate_is_idempotent(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        store.migrate()
        store.migrate()
        assert store.get(event_id) is not None
        assert store.stats(now=clock.now()).pending == 1
