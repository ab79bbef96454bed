"""``outboxkit.testing.recorder``: the public ``Recorder`` observer."""

from __future__ import annotations

from outboxkit import (
    EventBus,
    FrozenClock,
    HandlerSucceeded,
    MemoryStore,
    ObserverEvent,
    Outbox,
    Published,
)
from outboxkit.testing import Recorder


def test_a_recorder_keeps_every_event_in_order_and_filters_by_type() -> None:
    recorder = Recorder()
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: None, name="h")
    outbox = Outbox(
        MemoryStore(), bus, clock=FrozenClock(), plugins=[recorder], load_entry_points=False
    )
    with outbox.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    outbox.poller().run_once()
    assert [type(e).__name__ for e in recorder.events] == [
        "Claimed",
        "HandlerStarted",
        "HandlerSucceeded",
        "Published",
    ]
    assert recorder.of(Published) == [Published(event_id, "t", 1)]
    assert recorder.of(HandlerSucceeded) == [HandlerSucceeded(event_id, "t", "h", 1)]
    assert recorder.of(ObserverEvent) == recorder.events  # subclasses count
    assert repr(recorder) == "Recorder(4 events)"
    recorder.clear()
    assert recorder.events == []


def test_recorders_compare_by_identity() -> None:
    # Two empty recorders are two observers: a plugin manager must keep both.
    a, b = Recorder(), Recorder()
    assert a != b and a == a
    assert len({a, b}) == 2
