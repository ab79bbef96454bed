"""Idempotent enqueue (R16, ``capabilities.dedupe``): while an event with a dedupe key exists,
another enqueue with it writes nothing and returns that event's id; once it is purged, the key
is free again. A store without the ``dedupe`` capability skips the checks here."""

from __future__ import annotations

from outboxkit import FrozenClock, Store
from outboxkit.core.machine import DeadLetter
from outboxkit.core.payload import build_event
from outboxkit.store import settle_one

from ._base import ConformanceBase

__all__ = ["DedupeTests"]


class DedupeTests(ConformanceBase):
    """R16 on the store."""

    def test_r16_dedupe_key(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "dedupe")
        first = build_event("t", 1, dedupe_key="order-42-placed")
        with store.transaction() as conn:
            (a,) = store.enqueue(conn, [first], now=clock.now())
        with store.transaction() as conn:
            b, c, d = store.enqueue(
                conn,
                [
                    build_event("t", 2, dedupe_key="order-42-placed"),
                    build_event("t", 3, dedupe_key="other"),
                    build_event("t", 4, dedupe_key="other"),
                ],
                now=clock.now(),
            )
        assert b == a and d == c and c != a
        assert store.stats(now=clock.now()).total == 2
        (claim,) = [c for c in self.claim(store, clock.now()) if c.event.id == a]
        assert settle_one(store, claim, DeadLetter(), error="x", now=clock.now())
        assert store.purge_dead(ids=[a], limit=10) == 1  # purged: the key is free again
        with store.transaction() as conn:
            (e,) = store.enqueue(conn, [first], now=clock.now())
        assert e not in (a, c)
