"""A store may offer the poller's waiter (``make_waiter``, capability ``listen_notify``)."""

from __future__ import annotations

import asyncio
import threading

from outboxkit import MemoryStore, Outbox, ThreadWaiter


class RecordingWaiter(ThreadWaiter):
    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class WakingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[RecordingWaiter] = []

    def make_waiter(self) -> RecordingWaiter:
        waiter = RecordingWaiter()
        self.made.append(waiter)
        return waiter


def run_until_stopped(outbox: Outbox, **kwargs: object) -> object:
    poller = outbox.poller(interval=3600, **kwargs)  # type: ignore[arg-type]
    runner = threading.Thread(target=poller.run_forever)
    runner.start()
    poller.stop()
    runner.join(30)
    assert not runner.is_alive()
    return poller


def test_the_poller_uses_and_closes_the_stores_waiter() -> None:
    store = WakingStore()
    poller = run_until_stopped(Outbox(store, load_entry_points=False))
    (made,) = store.made
    assert poller.waiter is made  # type: ignore[attr-defined]
    assert made.closed == 1


def test_a_given_waiter_wins_and_is_left_open() -> None:
    store = WakingStore()
    mine = RecordingWaiter()
    run_until_stopped(Outbox(store, load_entry_points=False), waiter=mine)
    assert store.made == []
    assert mine.closed == 0


class QuietStore(MemoryStore):
    def make_waiter(self) -> None:
        return None


def test_a_store_without_a_waiter_gets_the_thread_waiter() -> None:
    poller = Outbox(QuietStore(), load_entry_points=False).poller()
    assert type(poller.waiter) is ThreadWaiter


def test_the_memory_stores_waiter_wakes_when_an_enqueue_commits_not_before() -> None:
    # An enqueue wakes this process's pollers before its transaction commits; a poll then
    # finds nothing, and without the commit's wake the event would wait for the interval.
    store = MemoryStore()
    outbox = Outbox(store, load_entry_points=False)
    waiter = store.make_waiter()
    assert waiter is not None
    wakes: list[int] = []
    waiter.wake = lambda: wakes.append(1)  # type: ignore[method-assign]
    with store.transaction() as tx:
        outbox.enqueue(tx, "t", {})
        assert wakes == []  # not committed yet
    assert wakes == [1]
    tx = store.begin()
    outbox.enqueue(tx, "t", {})
    tx.rollback()
    with store.transaction() as tx:
        tx.insert("orders", {"id": 1})  # a commit without events
    assert wakes == [1]
    waiter.close()
    with store.transaction() as tx:
        outbox.enqueue(tx, "t", {})
    assert wakes == [1]  # a closed waiter is left alone


def test_the_memory_stores_async_waiter_is_woken_by_a_commit_from_another_thread() -> None:
    store = MemoryStore()
    outbox = Outbox(store, load_entry_points=False)

    async def main() -> None:
        waiter = store.async_store().make_waiter()
        assert waiter is not None

        def enqueue() -> None:
            with store.transaction() as tx:
                outbox.enqueue(tx, "t", {})

        await asyncio.to_thread(enqueue)  # its commit lands before the wait begins
        await asyncio.wait_for(waiter.wait(3600), 30)  # returns at once: the wake is kept
        await waiter.close()

    asyncio.run(main())


def test_a_pollers_waiter_left_unclosed_goes_with_the_poller() -> None:
    # run_once and run_until_idle never close the waiter the store made: the memory store
    # holds its waiters weakly, so pollers made and dropped (a drain per test) do not pile up.
    import gc

    store = MemoryStore()
    outbox = Outbox(store, load_entry_points=False)
    for _ in range(3):
        outbox.poller().run_until_idle()
    gc.collect()
    assert len(store.tables.waiters) == 0
    kept = outbox.poller()
    assert len(store.tables.waiters) == 1 and kept.waiter in store.tables.waiters
