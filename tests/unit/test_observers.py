"""``outboxkit.observers.LoggingObserver``: one log line per observer event, at a sensible level."""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from datetime import timedelta
from typing import Any

import pytest

from outboxkit import (
    Claimed,
    ConfigurationError,
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
    hookimpl,
)
from outboxkit.observers import DEFAULT_LEVELS, LoggingObserver, describe
from outboxkit.testing import Recorder


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


# -- async def observers: refused at registration (bug 13) ---------------------------------------


class AsyncObserver:
    """The attack's observer: an ``async def`` hook, which nothing awaits."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    @hookimpl
    async def outboxkit_on_event(self, event: Any) -> None:
        self.calls.append(event)


class AsyncGeneratorObserver:
    @hookimpl
    async def outboxkit_on_event(self, event: Any) -> Any:
        yield event


def _delivered(outbox: Outbox) -> list[int]:
    """Enqueue one event and deliver it with the blocking poller, then the asyncio one."""
    with outbox.store.transaction() as tx:
        first = outbox.enqueue(tx, "t", {})
    published = outbox.poller().run_once().published
    with outbox.store.transaction() as tx:
        second = outbox.enqueue(tx, "t", {})
    published += asyncio.run(outbox.async_poller().run_once()).published
    assert published == [first, second]
    return published


def _unawaited(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "never awaited" in str(w.message)]


@pytest.mark.parametrize("observer_class", [AsyncObserver, AsyncGeneratorObserver])
def test_async_observer_is_refused_at_registration(observer_class: type) -> None:
    """Bug 13: an ``async def`` observer was taken and never ran (0 calls, a "coroutine was
    never awaited" warning per event). It is refused, naming it and what to do, on every way
    in; the outbox (and its other observers) go on, and no warning is left behind."""
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: None, name="h", transactional=False)
    recorder = Recorder()
    observer = observer_class()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ConfigurationError) as refused:
            Outbox(MemoryStore(), bus, plugins=[observer], load_entry_points=False)
        message = str(refused.value)
        assert f"observer plugin {observer_class.__qualname__}" in message
        assert "outboxkit_on_event is an async def, which would never run" in message
        assert "Make it a plain def" in message and "call_soon_threadsafe" in message

        outbox = Outbox(
            MemoryStore(), bus, clock=FrozenClock(), plugins=[recorder], load_entry_points=False
        )
        with pytest.raises(ConfigurationError, match="async def, which would never run"):
            outbox.add_observer(observer)
        assert not outbox.plugins.is_registered(observer)  # left out, not half registered
        copy = outbox.rebind(clock=FrozenClock())
        assert not copy.plugins.is_registered(observer)
        _delivered(outbox)
        gc.collect()
    assert getattr(observer, "calls", []) == []
    assert len(recorder.of(Published)) == 2  # the other observer saw both deliveries
    assert _unawaited(caught) == []


def test_an_observer_returning_a_coroutine_is_not_awaited_and_leaves_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain def that returns a coroutine cannot be told from its signature: the coroutine is
    closed unrun and logged, instead of a "never awaited" warning from the garbage collector."""
    ran: list[Any] = []

    async def later(event: Any) -> None:
        ran.append(event)

    class Sneaky:
        @hookimpl
        def outboxkit_on_event(self, event: Any) -> Any:
            return later(event)

    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: None, name="h", transactional=False)
    outbox = Outbox(
        MemoryStore(), bus, clock=FrozenClock(), plugins=[Sneaky()], load_entry_points=False
    )
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.ERROR):
        warnings.simplefilter("always")
        _delivered(outbox)
        gc.collect()
    assert ran == []
    assert _unawaited(caught) == []
    assert any("returned an awaitable" in r.getMessage() for r in caplog.records)
