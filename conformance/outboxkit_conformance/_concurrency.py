"""Concurrency: claimers in several threads (``concurrent_claimers``) or processes
(``multiprocess``) never claim the same event twice."""

from __future__ import annotations

import multiprocessing
import threading

from outboxkit import FrozenClock, Store
from outboxkit.core.machine import Publish
from outboxkit.store import settle_one

from ._base import ConformanceBase
from ._procs import claim_until_empty

__all__ = ["ConcurrencyTests"]


class ConcurrencyTests(ConformanceBase):
    """Two claimers at once, each event claimed by one of them."""

    def test_two_threads_never_claim_the_same_event(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "concurrent_claimers")
        total = 1000
        for start in range(0, total, 250):
            self.put(store, clock.now(), *[("t", i) for i in range(start, start + 250)])
        seen: list[list[int]] = [[], []]
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def work(slot: int) -> None:
            try:
                barrier.wait(timeout=30)
                while claims := self.claim(store, clock.now(), batch_size=7):
                    seen[slot].extend(self.ids(claims))
                    for claim in claims:
                        assert settle_one(store, claim, Publish(), error=None, now=clock.now())
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(slot,)) for slot in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "claimer threads did not finish"
        assert errors == []
        both = seen[0] + seen[1]
        assert len(both) == total
        assert len(set(both)) == total
        assert set(seen[0]).isdisjoint(seen[1])
        assert store.stats(now=clock.now()).published == total

    def test_two_processes_never_claim_the_same_event(
        self, store: Store, clock: FrozenClock
    ) -> None:
        self.require(store, "multiprocess")
        total = 1000
        for start in range(0, total, 250):
            self.put(store, clock.now(), *[("t", i) for i in range(start, start + 250)])
        url, options = store.url, dict(store.options)
        context = multiprocessing.get_context("spawn")
        with context.Pool(2) as pool:
            jobs = [
                pool.apply_async(claim_until_empty, (url, options, clock.now().isoformat(), 7))
                for _ in range(2)
            ]
            seen = [job.get(timeout=300) for job in jobs]
        both = seen[0] + seen[1]
        assert len(both) == total
        assert len(set(both)) == total
        assert store.stats(now=clock.now()).published == total
