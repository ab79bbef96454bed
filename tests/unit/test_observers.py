"""``outboxkit.observers.LoggingObserver``: one log line per observer event, at a sensible level."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest

from outboxkit import (
    Claimed,
    DeadLettered,
    EventBus,
    FrozenClock,
    HandlerFailed,
    HandlerRejected,
    HandlerStarted,
    HandlerSucceeded,
    LeaseLost,
    MemoryStore,
    Outbox,
    Published,
    Reject,
    RetryScheduled,
    Unrouted,
)
from outboxkit.observers import DEFAULT_LEVELS, LoggingObserver, describe


def records_of(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, str]]:
    return [
        (r.levelname, type(r.outboxkit_event).__name__, r.getMessage())
        for r in caplog.records
        if r.name == "outboxkit.events"
    ]


def test_every_event_of_a_delivery_is_logged_at_its_level(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()

    @bus.handler("order.placed", name="check")
    def check(event: Any, ctx: Any) -> None:
        if event.payload.get("reject"):
            raise Reject("too big")

    @bus.handler("order.placed", name="mail", transactional=False)
    def mail(event: Any, ctx: Any) -> None:
        if event.payload.get("fail"):
            raise ConnectionError("busy")

    store = MemoryStore()
    clock = FrozenClock("2030-01-01T00:00:00Z")
    outbox = Outbox(store, bus, clock=clock, max_retries=1, backoff=2, plugins=[LoggingObserver()])
    with store.transaction() as tx:
        ok = outbox.enqueue(tx, "order.placed", {})
        bad = outbox.enqueue(tx, "order.placed", {"reject": 1, "fail": 1})
        lost = outbox.enqueue(tx, "nobody.listens", {})
    with caplog.at_level(logging.DEBUG, logger="outboxkit.events"):
        outbox.poller().run_once()
        clock.advance(2)
        outbox.poller().run_once()
    seen = records_of(caplog)
    assert ("DEBUG", "Claimed", f"event {ok} (order.placed): claimed, attempt 1") in seen
    assert (
        "DEBUG",
        "HandlerSucceeded",
        f"event {ok} (order.placed): check succeeded on attempt 1",
    ) in seen
    assert (
        "DEBUG",
        "Published",
        f"event {ok} (order.placed): published after 1 attempt(s)",
    ) in seen
    assert (
        "INFO",
        "HandlerRejected",
        f"event {bad} (order.placed): check rejected it on attempt 1: too big",
    ) in seen
    assert (
        "WARNING",
        "HandlerFailed",
        f"event {bad} (order.placed): mail failed on attempt 1: ConnectionError: busy",
    ) in seen
    assert (
        "INFO",
        "RetryScheduled",
        f"event {bad} (order.placed): attempt 1 failed, retry in 2s: mail: ConnectionError: busy",
    ) in seen
    assert (
        "ERROR",
        "DeadLettered",
        f"event {bad} (order.placed): dead-lettered after 2 attempt(s): mail: ConnectionError: busy",
    ) in seen
    assert (
        "INFO",
        "Unrouted",
        f"event {lost} (nobody.listens): no handler subscribed; published",
    ) in seen


def test_levels_logger_and_silence(caplog: pytest.LogCaptureFixture) -> None:
    mine = logging.getLogger("myapp.outbox")
    observer = LoggingObserver(mine, levels={Published: logging.INFO})
    with caplog.at_level(logging.INFO, logger="myapp.outbox"):
        observer.outboxkit_on_event(Published(7, "t", 1))
        observer.outboxkit_on_event(Claimed(7, "t", 1))  # DEBUG: below the level, not formatted
        observer.outboxkit_on_event(LeaseLost(7, "t", 2, "mail"))
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("myapp.outbox", "INFO", "event 7 (t): published after 1 attempt(s)"),
        ("myapp.outbox", "WARNING", "event 7 (t): lease lost on attempt 2 during mail"),
    ]
    assert repr(observer) == "LoggingObserver('myapp.outbox')"


def test_every_observer_event_type_has_a_level_and_a_line() -> None:
    events = [
        Claimed(1, "t", 1),
        HandlerStarted(1, "t", "h", 1),
        HandlerSucceeded(1, "t", "h", 1),
        HandlerRejected(1, "t", "h", 1, "no"),
        HandlerFailed(1, "t", "h", 1, "E: x"),
        RetryScheduled(1, "t", 1, timedelta(seconds=4), "E: x"),
        Published(1, "t", 1),
        Unrouted(1, "t"),
        DeadLettered(1, "t", 11, "E: x"),
        LeaseLost(1, "t", 3),
    ]
    assert {type(e) for e in events} == set(DEFAULT_LEVELS)
    for event in events:
        line = describe(event)
        assert line.startswith("event 1 (t): ") and "\n" not in line
