"""What the observer events measure: the event's ``created_at`` on every one, ``HandlerStarted``
with its instant, the outcomes' durations, the claim's batch size; and that none is built when
nobody observes. Both pollers."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from outboxkit import (
    Claimed,
    EventBus,
    FrozenClock,
    HandlerFailed,
    HandlerRejected,
    HandlerStarted,
    HandlerSucceeded,
    MemoryStore,
    Outbox,
    Published,
    Reject,
)
from outboxkit.testing import Recorder


def _run(outbox: Outbox, asyncio_poller: bool) -> None:
    if asyncio_poller:
        asyncio.run(outbox.async_poller().run_until_idle())
    else:
        outbox.poller().run_until_idle()


@pytest.mark.parametrize("asyncio_poller", [False, True], ids=["blocking", "asyncio"])
def test_events_carry_created_at_start_instants_durations_and_batch_sizes(
    asyncio_poller: bool,
) -> None:
    clock = FrozenClock("2030-01-01T00:00:00Z")
    enqueued_at = clock.now()
    bus = EventBus()

    def body(event: Any) -> None:
        clock.advance(event.payload["takes"])  # the handler "takes" this long
        if event.payload.get("reject"):
            raise Reject("no")
        if event.payload.get("fail"):
            raise RuntimeError("boom")

    if asyncio_poller:

        @bus.handler("t", name="h")
        async def ahandler(event: Any, ctx: Any) -> None:
            body(event)

    else:

        @bus.handler("t", name="h")
        def handler(event: Any, ctx: Any) -> None:
            body(event)

    store, recorder = MemoryStore(), Recorder()
    outbox = Outbox(store, bus, clock=clock, plugins=[recorder], load_entry_points=False)
    with store.transaction() as tx:
        ok, rejected, failed = outbox.enqueue_many(
            tx,
            [("t", {"takes": 2}), ("t", {"takes": 3, "reject": 1}), ("t", {"takes": 5, "fail": 1})],
        )
    clock.advance(10)  # the events wait 10 s before the poller comes
    _run(outbox, asyncio_poller)

    assert all(e.created_at == enqueued_at for e in recorder.events)
    claimed = recorder.of(Claimed)
    assert [(c.event_id, c.batch_size, c.position) for c in claimed] == [
        (ok, 3, 0),
        (rejected, 3, 1),
        (failed, 3, 2),
    ]
    started = recorder.of(HandlerStarted)
    assert [(s.event_id, s.handler, s.attempt) for s in started] == [
        (ok, "h", 1),
        (rejected, "h", 1),
        (failed, "h", 1),
    ]
    # Lag: 10 s for the first; each later one also waited for the handlers before it.
    assert [s.started_at - enqueued_at for s in started if s.started_at] == [
        timedelta(seconds=10),
        timedelta(seconds=12),
        timedelta(seconds=15),
    ]
    assert recorder.of(HandlerSucceeded)[0].duration == timedelta(seconds=2)
    assert recorder.of(HandlerRejected)[0].duration == timedelta(seconds=3)
    assert recorder.of(HandlerFailed)[0].duration == timedelta(seconds=5)
    assert [p.event_id for p in recorder.of(Published)] == [ok, rejected]


@pytest.mark.parametrize("asyncio_poller", [False, True], ids=["blocking", "asyncio"])
def test_no_observer_event_is_built_when_nobody_observes(
    asyncio_poller: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import outboxkit.reports

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an observer event was built with no observer")

    for name in ("Claimed", "HandlerStarted", "HandlerSucceeded"):
        monkeypatch.setattr(outboxkit.reports, name, refuse)
    bus = EventBus()
    if asyncio_poller:

        @bus.handler("t", name="h")
        async def ahandler(event: Any, ctx: Any) -> None:
            pass

    else:
        bus.subscribe("t", lambda event, ctx: None, name="h")
    store = MemoryStore()
    outbox = Outbox(store, bus, clock=FrozenClock(), load_entry_points=False)
    assert not outbox.observed
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "t", {})
    _run(outbox, asyncio_poller)
    assert store.get(event_id).published_at is not None
    outbox.add_observer(Recorder())
    assert outbox.observed
