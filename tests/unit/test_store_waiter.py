"""A store may offer the poller's waiter (``make_waiter``, capability ``listen_notify``)."""

from __future__ import annotations

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


def test_a_store_without_make_waiter_gets_the_thread_waiter() -> None:
    poller = Outbox(MemoryStore(), load_entry_points=False).poller()
    assert type(poller.waiter) is ThreadWaiter
