"""The blocking poller as a shell: what it refuses at construction, and the error contract of
its loop (nothing but an ``OutboxError`` leaves ``run_once``; ``run_forever`` never dies of an
app's bad backoff)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    HandlerFailed,
    MemoryStore,
    Outbox,
)
from outboxkit.testing import Recorder


class _StopAfter:
    """A waiter that moves the clock instead of sleeping, and stops the poller after ``n``
    waits (so ``run_forever`` runs a bounded number of polls)."""

    def __init__(self, clock: FrozenClock, n: int) -> None:
        self.clock = clock
        self.left = n
        self.poller: Any = None

    def wait(self, timeout: float) -> None:
        self.clock.advance(max(timeout, 1.0))
        self.left -= 1
        if self.left <= 0:
            self.poller.stop()

    def wake(self) -> None:
        pass


BAD_BACKOFFS = {
    "negative": lambda retry: -5,
    "nan": lambda retry: float("nan"),
    "str": lambda retry: "soon",
    "huge": lambda retry: 10**400,
    "raises": lambda retry: 1 / 0,
}


@pytest.mark.parametrize("kind", BAD_BACKOFFS)
def test_a_bad_backoff_never_escapes_and_the_event_ends_retried_then_dead(kind: str) -> None:
    store = MemoryStore()
    bus = EventBus()

    @bus.handler("t", name="fails")
    def fails(event: Event, ctx: Any) -> None:
        raise RuntimeError("down")

    clock = FrozenClock()
    outbox = Outbox(store, bus, clock=clock, max_retries=1, backoff=BAD_BACKOFFS[kind])
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "t", {})
    poller = outbox.poller()
    report = poller.run_once()  # raises nothing (it once raised a bare ValueError)
    assert report.retried == [event_id]
    event = store.get(event_id)
    assert event is not None and event.last_error is not None
    assert event.last_error.startswith("fails: RuntimeError: down; backoff <lambda> failed for")
    assert event.last_error.endswith("retried after the default 1s")
    assert event.available_at == clock.now() + timedelta(seconds=1)
    # run_forever keeps polling: the retry comes, the event is dead, the loop stops when told.
    waiter = _StopAfter(clock, 3)
    looping = outbox.poller(waiter=waiter)
    waiter.poller = looping
    looping.run_forever()
    (letter,) = outbox.dead_letters()
    assert letter.event.id == event_id and letter.last_error == "fails: RuntimeError: down"


async def _async_handler(event: Event, ctx: Any) -> None:
    raise AssertionError("never awaited by the blocking poller")


class _AsyncCallable:
    async def __call__(self, event: Event, ctx: Any) -> None:
        raise AssertionError("never awaited by the blocking poller")


@pytest.mark.parametrize("handler", [_async_handler, _AsyncCallable()], ids=["def", "callable"])
def test_an_async_handler_is_refused_by_the_blocking_poller(handler: Any) -> None:
    bus = EventBus()
    bus.subscribe("order.placed", handler, name="notify-async")
    outbox = Outbox(MemoryStore(), bus, clock=FrozenClock())
    with pytest.raises(ConfigurationError, match=r"'notify-async' \(topic 'order.placed'\)"):
        outbox.poller()


def test_a_handler_returning_an_awaitable_is_a_failure_never_a_success() -> None:
    store = MemoryStore()
    bus = EventBus()

    def sneaky(event: Event, ctx: Any) -> Any:
        return asyncio.sleep(0)  # a coroutine from a plain function: never awaited here

    bus.subscribe("t", sneaky, name="sneaky")
    recorder = Recorder()
    outbox = Outbox(store, bus, clock=FrozenClock(), plugins=[recorder], max_retries=0)
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "t", {})
    report = outbox.poller().run_once()
    assert report.dead_lettered == [event_id]
    assert store.records(event_id) == []  # never recorded as run
    (failed,) = recorder.of(HandlerFailed)
    assert "returned coroutine, an awaitable" in failed.error
