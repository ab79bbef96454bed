"""Per-key ordering (R15) and dead keys (``capabilities.ordering``).

The events of one ``key`` are claimed one at a time, in the order their transactions
committed; unkeyed events and other keys never wait for them. A dead head releases its key
(``dead_key="release"``) or holds it until it is requeued or purged (``"hold"``). A store
without the ``ordering`` capability skips every check here.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any

import pytest

from outboxkit import Event, EventBus, FrozenClock, Outbox, Store
from outboxkit.core.machine import DeadLetter, Publish, Retry
from outboxkit.core.payload import build_event
from outboxkit.store import settle_one

from ._base import ConformanceBase, S

__all__ = ["OrderingTests"]


class OrderingTests(ConformanceBase):
    """R15 on the store, and end to end through the outbox in every mode."""

    @staticmethod
    def put_keyed(
        store: Store, now: datetime | None, *events: tuple[str, Any, str | None]
    ) -> list[int]:
        built = [build_event(topic, payload, key=key) for topic, payload, key in events]
        with store.transaction() as conn:
            return store.enqueue(conn, built, now=now)

    def test_r15_one_event_of_a_key_at_a_time(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "ordering")
        k1, k2, j1, u = self.put_keyed(
            store, clock.now(), ("t", 1, "K"), ("t", 2, "K"), ("t", 3, "J"), ("t", 4, None)
        )
        claims = self.claim(store, clock.now())
        assert self.ids(claims) == [k1, j1, u]  # K#2 waits; J and unkeyed do not
        by_id = {c.event.id: c for c in claims}
        # K#1 retrying: K#2 still waits, after the backoff and after its lease too
        assert settle_one(
            store, by_id[k1], Retry(delay=5 * S, retry=1), error="boom", now=clock.now()
        )
        assert self.claim(store, clock.now() + 2 * S) == []
        (again,) = self.claim(store, clock.now() + 5 * S)
        assert again.event.id == k1
        assert settle_one(store, again, Publish(), error=None, now=clock.now() + 5 * S)
        assert self.ids(self.claim(store, clock.now() + 5 * S)) == [k2]

    @pytest.mark.parametrize("dead_key", ["release", "hold"])
    def test_r15_dead_key(self, store: Store, clock: FrozenClock, dead_key: str) -> None:
        self.require(store, "ordering")
        k1, k2 = self.put_keyed(store, clock.now(), ("t", 1, "K"), ("t", 2, "K"))
        (claim,) = store.claim(batch_size=10, lease=30 * S, now=clock.now(), dead_key=dead_key)  # type: ignore[arg-type]
        assert settle_one(store, claim, DeadLetter(), error="boom", now=clock.now())
        assert store.stats(now=clock.now()).held_keys == 1
        got = store.claim(batch_size=10, lease=30 * S, now=clock.now(), dead_key=dead_key)  # type: ignore[arg-type]
        if dead_key == "release":
            assert self.ids(got) == [k2]
            return
        assert got == []
        assert store.requeue([k1], now=clock.now()) == 1  # requeued: the head again
        (head,) = store.claim(batch_size=10, lease=30 * S, now=clock.now(), dead_key="hold")
        assert head.event.id == k1
        assert settle_one(store, head, DeadLetter(), error="again", now=clock.now())
        assert store.purge_dead(ids=[k1], limit=10) == 1  # purged: the key goes on
        assert store.stats(now=clock.now()).held_keys == 0
        got = store.claim(batch_size=10, lease=30 * S, now=clock.now(), dead_key="hold")
        assert self.ids(got) == [k2]

    def test_r15_overlapping_transactions_keep_commit_order(
        self, store: Store, clock: FrozenClock
    ) -> None:
        """T1 enqueues K#a, T2 enqueues K#b and tries to commit first. A store whose second
        enqueuer of a key waits (PostgreSQL's key row, SQLite's write lock) commits T1 first;
        one that does not (memory) commits T2 first. Either way the claim follows commit order."""
        self.require(store, "ordering")
        self.require(store, "concurrent_claimers", "two transactions enqueue from two threads")
        committed: list[str] = []
        enqueued = threading.Event()
        errors: list[BaseException] = []

        def second() -> None:
            try:
                with store.transaction() as conn:
                    store.enqueue(conn, [build_event("t", "b", key="K")], now=clock.now())
                    enqueued.set()
                committed.append("b")
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        with store.transaction() as conn:
            store.enqueue(conn, [build_event("t", "a", key="K")], now=clock.now())
            thread = threading.Thread(target=second)
            thread.start()
            # Not a timing assumption: whichever way this wait ends, the check below follows
            # the order the transactions really committed in.
            if enqueued.wait(timeout=2):
                thread.join(timeout=60)
            committed.append("a")
        thread.join(timeout=60)
        assert not thread.is_alive() and errors == []
        order = []
        at = clock.now()
        while claims := self.claim(store, at):
            for claim in claims:
                order.append(claim.event.payload)
                assert settle_one(store, claim, Publish(), error=None, now=at)
        assert order == committed

    def test_r15_drain_keeps_key_order(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        self.require(store, "ordering")
        ran: list[tuple[str, int]] = []
        failures = {1: 2}  # K#1 fails twice, then succeeds

        @bus.handler("t", name="h")
        def handler(event: Event, ctx: Any) -> None:
            n = event.payload["n"]
            ran.append((event.key or "-", n))
            if failures.get(n, 0) > 0:
                failures[n] -= 1
                raise RuntimeError(f"fail {n}")

        with store.transaction() as conn:
            for n, key in [(1, "K"), (2, "K"), (3, None), (4, "J"), (5, "K")]:
                outbox.enqueue(conn, "t", {"n": n}, key=key)
        self.drain(outbox, clock)
        firsts = [n for i, (key, n) in enumerate(ran) if key == "K" and (key, n) not in ran[:i]]
        assert firsts == [1, 2, 5]
        # K#2 started only after K#1's last (successful) run
        assert ran.index(("K", 2)) > max(i for i, r in enumerate(ran) if r == ("K", 1))
        assert ran.index(("-", 3)) < ran.index(("K", 2))  # not held up by K
