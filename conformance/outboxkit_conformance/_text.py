"""Text: what outboxkit stores besides events (rejection reasons, error texts) is kept exactly."""

from __future__ import annotations

from outboxkit import FrozenClock, Outcome, Store
from outboxkit.core.machine import DeadLetter, Publish
from outboxkit.store import settle_one

from ._base import ConformanceBase

__all__ = ["TextTests"]


class TextTests(ConformanceBase):
    """Storable text round-trips through delivery records and dead letters."""

    def test_any_storable_text_round_trips(self, store: Store, clock: FrozenClock) -> None:
        # What outboxkit stores besides validated events - error texts, rejection reasons -
        # passes through outboxkit.core.text.storable first: no NUL, no lone surrogate, but
        # anything else a store must keep exactly.
        text = "quotes ' \" back\\slash %s %(x)s ; -- \x01\x1b[2J\t\n 日本 😀 \u202e x" * 20
        (reject_id, dead_id) = self.put(store, clock.now(), ("t", 1), ("t", 2))
        claims = {c.event.id: c for c in self.claim(store, clock.now())}
        with store.delivery(claims[reject_id], now=clock.now()) as tx:
            tx.record("h", Outcome.REJECTED, reason=text)
        assert settle_one(store, claims[reject_id], Publish(), error=None, now=clock.now())
        assert settle_one(store, claims[dead_id], DeadLetter(), error=text, now=clock.now())
        assert [r.reason for r in store.records(reject_id)] == [text]
        (letter,) = store.dead_letters()
        assert letter.last_error == text
