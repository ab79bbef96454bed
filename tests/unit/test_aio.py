"""The asyncio poller on the memory store: the rules hold at every concurrency, and what it
refuses at construction. Time moves through a ``FrozenClock``; no test sleeps."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    LeaseLost,
    MemoryStore,
    Outbox,
    Outcome,
    Reject,
)
from outboxkit.testing import Recorder
from outboxkit.waiter import LoopWaiter

LEASE = timedelta(seconds=30)


def _outbox(bus: EventBus, **options: Any) -> tuple[Outbox, MemoryStore, Recorder, FrozenClock]:
    store, recorder, clock = MemoryStore(), Recorder(), FrozenClock()
    outbox = Outbox(store, bus, clock=clock, plugins=[recorder], load_entry_points=False, **options)
    return outbox, store, recorder, clock


def _enqueue(outbox: Outbox, store: MemoryStore, *events: tuple[str, Any]) -> list[int]:
    with store.transaction() as tx:
        return outbox.enqueue_many(tx, list(events))


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_every_rule_holds_at_any_concurrency(concurrency: int) -> None:
    bus = EventBus()
    order: list[tuple[int, str]] = []
    running = 0
    most = 0

    def make(name: str) -> Any:
        async def handler(event: Event, ctx: Any) -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            await asyncio.sleep(0)  # let the other workers in
            order.append((event.id, name))
            running -= 1
            if event.payload == "reject" and name == "second":
                raise Reject("no")
            if event.payload == "fail" and name == "second" and ctx.attempt == 1:
                raise RuntimeError("once")
            ctx.enqueue("done", {"by": name})

        return handler

    bus.subscribe("t", make("first"), name="first")
    bus.subscribe("t", make("second"), name="second")
    outbox, store, _, clock = _outbox(bus, backoff=1)
    ids = _enqueue(outbox, store, *[("t", "ok")] * 20, ("t", "reject"), ("t", "fail"))

    async def drain() -> None:
        poller = outbox.async_poller(concurrency=concurrency, batch_size=10)
        await poller.run_until_idle()
        clock.advance(1)
        await poller.run_until_idle()

    asyncio.run(drain())
    # Each event's handlers ran in subscription order, a recorded one never again.
    for event_id in ids:
        names = [n for i, n in order if i == event_id]
        expected = ["first", "second", "second"] if event_id == ids[-1] else ["first", "second"]
        assert names == expected, (event_id, names)
    assert Counter(r.handler for i in ids for r in store.records(i)) == {
        "first": 22,
        "second": 22,
    }
    assert store.records(ids[-2])[1].outcome is Outcome.REJECTED
    stats = store.stats(now=clock.now())
    assert stats.by_topic["t"] == {"published": 22}
    # 22 by "first", 21 by "second": the rejection's and the failure's follow-ups rolled back.
    assert sum(stats.by_topic["done"].values()) == 43
    assert most == min(concurrency, 10)  # so many events at once, never more than the batch


def test_blocking_non_transactional_handlers_run_in_a_worker_thread() -> None:
    bus = EventBus()
    threads: list[int] = []

    @bus.handler("t", name="call-out", transactional=False)
    def call_out(event: Event, ctx: Any) -> None:
        threads.append(threading.get_ident())
        ctx.enqueue("sent", {})

    outbox, store, _, _ = _outbox(bus)
    (event_id,) = _enqueue(outbox, store, ("t", {}))
    report = asyncio.run(outbox.async_poller().run_once())
    assert report.published == [event_id]
    assert threads and threads[0] != threading.get_ident()  # not the loop's thread
    assert store.stats(now=None).by_topic["sent"] == {"pending": 1}  # the follow-up committed


def test_stop_mid_batch_finishes_the_events_in_hand_and_releases_the_rest() -> None:
    bus = EventBus()
    started: list[int] = []
    poller_box: list[Any] = []

    @bus.handler("t", name="slow")
    async def slow(event: Event, ctx: Any) -> None:
        started.append(event.id)
        if len(started) == 2:
            poller_box[0].stop()  # from inside: the two in hand finish, no third starts
        await asyncio.sleep(0)

    outbox, store, _, _ = _outbox(bus)
    ids = _enqueue(outbox, store, *[("t", n) for n in range(8)])
    poller = outbox.async_poller(concurrency=2)
    poller_box.append(poller)
    report = asyncio.run(poller.run_once())
    assert sorted(report.published) == sorted(started) == ids[:2]
    assert sorted(report.released) == ids[2:]
    for event_id in ids[2:]:
        event = store.get(event_id)
        assert event is not None and event.attempts == 0  # refunded, due again at once
    assert store.stats(now=None).pending == 6


def test_leases_of_waiting_events_are_extended_once_for_all_workers() -> None:
    bus = EventBus()
    extends: list[Any] = []
    outbox, store, recorder, clock = _outbox(bus, lease=LEASE)

    @bus.handler("t", name="slow", transactional=False)
    async def slow(event: Event, ctx: Any) -> None:
        clock.advance(10)  # each handler takes 10 s of a 30 s lease
        await asyncio.sleep(0)

    extend = store.extend

    def counted(claims: Any, **kw: Any) -> Any:
        extends.append((clock.now(), len(claims)))
        return extend(claims, **kw)

    store.extend = counted  # type: ignore[method-assign]
    ids = _enqueue(outbox, store, *[("t", n) for n in range(8)])
    report = asyncio.run(outbox.async_poller(concurrency=4).run_once())
    assert sorted(report.published) == ids
    assert recorder.of(LeaseLost) == []  # every event kept its lease through 80 s of handlers
    # Each time the lease ran low the whole batch was extended once, for every worker that
    # found it low at that moment (they share one extension): never twice at one instant.
    assert 2 <= len(extends) < 8
    assert len({at for at, _ in extends}) == len(extends)
    assert {n for _, n in extends} == {8}  # the events running, waiting and not yet started


def test_a_base_exception_in_a_handler_releases_the_unstarted_and_is_re_raised() -> None:
    bus = EventBus()

    @bus.handler("t", name="interrupted")
    async def interrupted(event: Event, ctx: Any) -> None:
        if event.payload == 1:
            raise KeyboardInterrupt

    outbox, store, _, _ = _outbox(bus)
    ids = _enqueue(outbox, store, ("t", 0), ("t", 1), ("t", 2), ("t", 3))
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(outbox.async_poller().run_once())
    # The one before was settled, the one in hand waits for its lease, the rest were released.
    first, in_hand, *rest = (store.get(i) for i in ids)
    assert first is not None and first.published_at is not None
    assert in_hand is not None and in_hand.attempts == 1 and in_hand.published_at is None
    assert all(e is not None and e.attempts == 0 for e in rest)


def test_run_forever_wakes_on_an_enqueue_from_another_thread_and_stops_when_told() -> None:
    bus = EventBus()
    delivered = threading.Event()

    @bus.handler("t", name="h")
    async def h(event: Event, ctx: Any) -> None:
        delivered.set()

    outbox, store, _, _ = _outbox(bus, interval=3600)  # no poll would come by the interval

    async def main() -> None:
        poller = outbox.async_poller()
        task = asyncio.create_task(poller.run_forever())
        await asyncio.sleep(0)  # the first poll, finding nothing, then the long wait

        def enqueue_then_stop() -> None:
            _enqueue(outbox, store, ("t", {}))  # wakes the waiting poller (thread-safe)
            assert delivered.wait(30)
            poller.stop()

        await asyncio.to_thread(enqueue_then_stop)
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert store.stats(now=None).published == 1


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"concurrency": 0}, "concurrency must be an integer from 1"),
        ({"concurrency": True}, "concurrency must be an integer from 1"),
        ({"concurrency": 2, "transaction": "per_batch"}, "cannot deliver events at once"),
    ],
)
def test_bad_concurrency_is_refused(options: dict[str, Any], match: str) -> None:
    outbox, _, _, _ = _outbox(EventBus())
    with pytest.raises(ConfigurationError, match=match):
        outbox.async_poller(**options)


def test_a_blocking_transactional_handler_is_refused_by_the_asyncio_poller() -> None:
    bus = EventBus()
    bus.subscribe("order.placed", lambda event, ctx: None, name="ledger")
    outbox, _, _, _ = _outbox(bus)
    with pytest.raises(ConfigurationError, match=r"'ledger' \(topic 'order.placed'\)"):
        outbox.async_poller()


def test_a_store_without_an_asyncio_side_is_refused() -> None:
    class Blocking(MemoryStore):
        capabilities = MemoryStore.capabilities.__class__(batches=True)

    outbox = Outbox(Blocking(), EventBus(), clock=FrozenClock(), load_entry_points=False)
    with pytest.raises(ConfigurationError, match="needs a store with an asyncio side"):
        outbox.async_poller()
    with pytest.raises(ConfigurationError, match="has no asyncio side"):
        asyncio.run(outbox.enqueue_async(None, "t", {}))


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
def test_loop_waiter_wakes_from_a_plain_signal_handler_while_the_loop_sleeps() -> None:
    # signal.signal handlers run in the main thread between bytecodes; with the loop asleep in
    # its selector, only a write to its self-pipe ends the wait before its timeout.
    waiter = LoopWaiter()
    main_thread = threading.get_ident()
    go = threading.Event()

    def send() -> None:
        go.wait(30)
        signal.pthread_kill(main_thread, signal.SIGUSR1)

    async def main() -> None:
        waiting = asyncio.create_task(waiter.wait(3600))
        await asyncio.sleep(0)  # the wait has begun
        sender = threading.Thread(target=send)
        sender.start()
        go.set()  # the loop now sleeps in its selector until woken
        try:
            done, _ = await asyncio.wait({waiting}, timeout=30)
            assert done == {waiting}, "the wake did not end the wait"
        finally:
            waiting.cancel()
            await asyncio.to_thread(sender.join)

    previous = signal.signal(signal.SIGUSR1, lambda *_: waiter.wake())
    try:
        asyncio.run(main())
    finally:
        signal.signal(signal.SIGUSR1, previous)
