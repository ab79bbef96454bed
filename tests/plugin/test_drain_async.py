"""``outbox_drain`` with ``async def`` handlers: in ``async def`` tests under pytest-asyncio and
anyio (``await outbox_drain.async_()``) and in plain tests (``outbox_drain()`` on a loop of its
own), with the virtual clock, cascades, report and assertions of the blocking drain.

Through pytester, as users meet it, on the memory store; the SQLite and PostgreSQL variants
skip while their store has no asyncio side (``capabilities.asyncio`` is false).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outboxkit import (
    ConfigurationError,
    DrainError,
    EventBus,
    FrozenClock,
    MemoryStore,
    Outbox,
    Poller,
    PollReport,
    Store,
)
from outboxkit.aio import AsyncPoller
from outboxkit.testing import Drain, open_test_store
from tests.integration.pg.conftest import pg_url_from_env, require_server
from tests.integration.pg.conftest import test_url as pg_test_url
from tests.plugin.sample import ASYNC_APP, HELPERS, STORE_ARGS, run

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("pg", id="pg", marks=pytest.mark.pg),
]


def store_url(backend: str) -> str | None:
    """The ``outbox_store`` URL of ``backend`` (None: the default SQLite file)."""
    if backend == "memory":
        return "memory://"
    if backend == "sqlite":
        return None
    require_server(pg_url_from_env())
    return pg_test_url(pg_url_from_env())


def require_asyncio_side(backend: str, tmp_path: Path) -> None:
    """Every built-in store a test app can name has an asyncio side."""
    with open_test_store(store_url(backend), tmp_path / "probe", "probe") as store:
        assert store.capabilities.asyncio, f"{type(store).__name__} lost its asyncio side"


@pytest.fixture(params=BACKENDS)
def async_app(
    request: pytest.FixtureRequest, pytester: pytest.Pytester, tmp_path: Path
) -> pytest.Pytester:
    """The async sample app, its ini and the store, in a pytester folder."""
    backend = request.param
    (tmp_path / "probe").mkdir()
    require_asyncio_side(backend, tmp_path)
    pytester.makepyfile(myapp=ASYNC_APP, apphelpers=HELPERS)
    url = store_url(backend)
    pytester.makeini(
        f"""
        [pytest]
        outboxkit_app = myapp:outbox
        filterwarnings = error
        asyncio_default_fixture_loop_scope = function
        {"outboxkit_store = memory://" if backend == "memory" else ""}
        """
    )
    pytester.syspathinsert()
    STORE_ARGS[id(pytester)] = [f"--outbox-store={url}"] if backend == "pg" else []
    return pytester


# The inner tests, written once for the three ways of running them: ``TEST`` starts a test,
# ``DRAIN(`` drains, ``DELIVER_ONE(`` runs one handler (see ``MODES``).
PRELUDE = """
import asyncio
import threading
import time
from datetime import timedelta

import pytest

import myapp
from apphelpers import enqueue
from outboxkit import DrainError
from outboxkit.testing import HandlerErrors


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def nothing_waits_for_real(monkeypatch):
    # Time moves only through the drain's virtual clock: any real wait fails the test.
    real_sleep = asyncio.sleep

    async def no_sleep(delay, result=None):
        if delay > 0:
            raise AssertionError(f"asyncio.sleep({delay})")
        return await real_sleep(0, result)

    def no_time_sleep(seconds):
        raise AssertionError(f"time.sleep({seconds})")

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    monkeypatch.setattr(time, "sleep", no_time_sleep)
    myapp.loops.clear()
    myapp.threads.clear()
"""

COMMON = """

TEST test_a_cascade_with_a_rejection(outbox, outbox_drain):
    enqueue(outbox, "order.placed", {"order_id": 1})
    enqueue(outbox, "order.placed", {"order_id": 2, "fraud": True})
    report = DRAIN()
    assert report.rounds == 2  # the orders, then the stock.reserved follow-ups
    assert report.topics_per_round == [
        ["order.placed", "order.placed"], ["stock.reserved", "stock.reserved"]
    ]
    report.assert_delivered("order.placed", handler="reserve-stock", count=2)
    report.assert_rejected("order.placed", handler="fraud-check", count=1)
    report.assert_delivered("stock.reserved", handler="notify-warehouse", count=2)
    report.assert_delivered("stock.reserved", handler="log-line", count=2)
    with pytest.raises(AssertionError, match="expected delivered 'stock.reserved'"):
        report.assert_delivered("stock.reserved", count=5)
    assert len(report.published) == 4 and report.pending == []
    assert report.advanced == timedelta(0)
    outbox_drain.assert_enqueued("stock.reserved", {"order_id": 2}, count=1)
    assert len(myapp.loops) == 4 and len(set(map(id, myapp.loops))) == 1  # one loop
    # The blocking handler ran in a worker thread, never on the loop's own thread.
    assert len(myapp.threads) == 2 and threading.current_thread() not in myapp.threads


TEST test_backoff_to_dead_letter_takes_no_real_time(outbox, outbox_drain, outbox_clock):
    start = outbox_clock.now()
    enqueue(outbox, "email.requested", {"to": "a@example.com"})
    report = DRAIN(raise_errors=False)
    report.assert_dead_lettered("email.requested", count=1)
    runs = report.deliveries_to(handler="broken-mailer")
    assert [d.attempt for d in runs] == list(range(1, 12))
    gaps = [(b.at - a.at).total_seconds() for a, b in zip(runs, runs[1:])]
    assert gaps == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]  # the real schedule, recorded
    assert runs[0].at == start
    assert report.advanced == timedelta(seconds=sum(gaps))
    assert report.rounds == 11 and len(report.retried) == 10
    (dead,) = outbox.dead_letters()
    assert dead.event.attempts == 11
    assert dead.failed_at == start + report.advanced


TEST test_unexpected_failures_are_raised_together(outbox, outbox_drain):
    enqueue(outbox, "email.requested", {"to": "b@example.com"})
    with pytest.raises(HandlerErrors) as info:
        DRAIN(max_rounds=50)
    assert {type(e) for e in info.value.exceptions} == {ConnectionError}
    info.value.report.assert_dead_lettered("email.requested", count=1)


TEST test_expected_failures_are_let_through(outbox, outbox_drain):
    enqueue(outbox, "email.requested", {"to": "c@example.com"})
    with outbox_drain.expect_failures("broken-mailer"):
        report = DRAIN()
    report.assert_dead_lettered("email.requested")


TEST test_scheduled_events_wait_for_until(outbox, outbox_drain, outbox_clock):
    start = outbox_clock.now()
    enqueue(outbox, "order.placed", {"order_id": 9}, delay=3600)
    report = DRAIN()
    assert report.deliveries == []
    report = DRAIN(until=timedelta(hours=2))
    report.assert_delivered("order.placed", handler="reserve-stock")
    assert report.deliveries[0].at == start + timedelta(hours=1)
    report.assert_delivered("stock.reserved", handler="notify-warehouse")


TEST test_deliver_one_runs_a_single_async_handler(outbox, outbox_drain):
    waiting = enqueue(outbox, "order.placed", {"order_id": 7})
    report = DELIVER_ONE("reserve-stock", {"order_id": 8})
    assert [(d.handler, d.outcome.value) for d in report.deliveries] == [
        ("reserve-stock", "succeeded")
    ]
    outbox_drain.assert_enqueued("stock.reserved", {"order_id": 8}, count=1)
    event = outbox.store.get(waiting)  # the event already waiting was not touched
    assert event.attempts == 0 and event.published_at is None
    report = DRAIN()
    report.assert_delivered("order.placed", handler="fraud-check", count=1)


TEST test_the_cascade_guard_names_the_chain(outbox, outbox_drain):
    enqueue(outbox, "order.placed", {"order_id": 3})
    with pytest.raises(DrainError, match="max_rounds=1.*order.placed"):
        DRAIN(max_rounds=1)
"""

IN_A_LOOP = """

TEST test_the_handlers_run_on_the_tests_own_loop(outbox, outbox_drain):
    enqueue(outbox, "order.placed", {"order_id": 1})
    DRAIN()
    assert myapp.loops and all(loop is asyncio.get_running_loop() for loop in myapp.loops)


TEST test_the_blocking_calls_name_the_async_ones(outbox, outbox_drain):
    enqueue(outbox, "order.placed", {"order_id": 1})
    with pytest.raises(DrainError, match=r"use `report = await outbox_drain\\.async_\\(\\)`"):
        outbox_drain()
    before = len(outbox_drain.enqueued())
    with pytest.raises(DrainError, match=r"await outbox_drain\\.deliver_one_async\\("):
        outbox_drain.deliver_one("reserve-stock", {"order_id": 2})
    assert len(outbox_drain.enqueued()) == before  # refused before anything was written
    report = DRAIN()
    report.assert_delivered("order.placed", handler="reserve-stock", count=1)
"""

WITHOUT_A_LOOP = """

def test_each_drain_runs_on_a_fresh_loop_closed_afterwards(outbox, outbox_drain):
    enqueue(outbox, "order.placed", {"order_id": 1})
    outbox_drain()
    first = set(myapp.loops)
    enqueue(outbox, "order.placed", {"order_id": 2})
    outbox_drain()
    second = set(myapp.loops) - first
    assert len(first) == 1 and len(second) == 1
    assert all(loop.is_closed() for loop in first | second)
"""

MODES = {
    "asyncio": (
        "@pytest.mark.asyncio\nasync def",
        "await outbox_drain.async_(",
        "await outbox_drain.deliver_one_async(",
    ),
    "anyio": (
        "@pytest.mark.anyio\nasync def",
        "await outbox_drain.async_(",
        "await outbox_drain.deliver_one_async(",
    ),
    "sync": ("def", "outbox_drain(", "outbox_drain.deliver_one("),
}


def inner_tests(mode: str) -> str:
    test, drain, deliver_one = MODES[mode]
    body = COMMON + (WITHOUT_A_LOOP if mode == "sync" else IN_A_LOOP)
    body = body.replace("TEST ", f"{test} ").replace("DRAIN(", drain)
    return PRELUDE + body.replace("DELIVER_ONE(", deliver_one)


@pytest.mark.parametrize("mode", list(MODES))
def test_outbox_drain_delivers_async_handlers(async_app: pytest.Pytester, mode: str) -> None:
    result = run(async_app, inner_tests(mode))
    result.assert_outcomes(passed=9 if mode != "sync" else 8)


AIMED = """
import pytest
from outboxkit import ConfigurationError
from apphelpers import enqueue


@pytest.mark.asyncio
async def test_an_aimed_async_drain(outbox, outbox_drain):
    enqueue(outbox, "order.placed", {"order_id": 1})
    enqueue(outbox, "email.requested", {})
    report = await outbox_drain.async_(topics=["order.placed"])
    report.assert_delivered("order.placed", handler="reserve-stock")
    reasons = sorted(left.reason for left in report.left)
    assert reasons == [
        "not aimed at: topic 'email.requested' is not in topics=['order.placed']",
        "not aimed at: topic 'stock.reserved' is not in topics=['order.placed']",
    ]
    report = await outbox_drain.async_(handlers=["notify-warehouse"], limit=1)
    report.assert_delivered("stock.reserved", handler="notify-warehouse", count=1)
    report = await outbox_drain.async_(advance_time=False, raise_errors=False)
    (left,) = report.left  # the mailer's retry, scheduled, the clock where it was
    assert left.reason.startswith("retry (attempt 2) due at")
    with pytest.raises(ConfigurationError, match="limit must be an integer >= 1, got 0"):
        await outbox_drain.async_(limit=0)
"""


def test_the_async_drain_can_be_aimed(async_app: pytest.Pytester) -> None:
    result = run(async_app, AIMED)
    result.assert_outcomes(passed=1)


def test_a_blocking_app_in_an_async_test_keeps_the_blocking_drain(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import pytest
        from apphelpers import enqueue

        @pytest.mark.asyncio
        async def test_blocking_handlers(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            report = outbox_drain()  # no async handler: the blocking poller, as before
            report.assert_delivered("stock.reserved", handler="notify-warehouse")
        """,
    )
    result.assert_outcomes(passed=1)


# -- the drain on its own, without pytester --------------------------------------------------


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    (tmp_path / "probe").mkdir()
    require_asyncio_side(request.param, tmp_path)
    with open_test_store(store_url(request.param), tmp_path, request.node.nodeid) as opened:
        yield opened


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock("2030-01-01T00:00:00Z")


def enqueue(outbox: Outbox, topic: str, payload: Any = None, **options: Any) -> int:
    with outbox.store.transaction() as conn:
        event_id: int = outbox.enqueue(conn, topic, payload or {}, **options)
    return event_id


def cascading_bus() -> EventBus:
    bus = EventBus()

    async def first(event: Any, ctx: Any) -> None:
        ctx.enqueue("u", {})

    async def second(event: Any, ctx: Any) -> None:
        pass

    bus.subscribe("t", first, name="first")
    bus.subscribe("u", second, name="second")
    return bus


@pytest.mark.parametrize("how", ["sync", "async"])
def test_the_drain_is_the_asyncio_pollers_drain_loop(
    store: Store, clock: FrozenClock, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # Every poll happens inside AsyncPoller.run_until_idle, with the drain's two callbacks;
    # the blocking poller is not used at all.
    calls: list[tuple[bool, bool]] = []
    run_until_idle = AsyncPoller.run_until_idle

    async def spy(self: AsyncPoller, **callbacks: Any) -> list[PollReport]:
        calls.append((callbacks["on_idle"] is not None, callbacks["on_round"] is not None))
        return await run_until_idle(self, **callbacks)

    def refuse(self: Poller, **callbacks: Any) -> list[PollReport]:
        raise AssertionError("the blocking poller drained an app with async handlers")

    monkeypatch.setattr(AsyncPoller, "run_until_idle", spy)
    monkeypatch.setattr(Poller, "run_until_idle", refuse)
    outbox = Outbox(store, cascading_bus(), clock=clock, load_entry_points=False)
    drain = Drain(outbox, clock)
    enqueue(outbox, "t")
    report = drain() if how == "sync" else asyncio.run(drain.async_())
    assert calls == [(True, True)]
    assert report.topics_per_round == [["t"], ["u"]]


def test_the_sync_drain_leaves_the_threads_event_loop_alone(
    store: Store, clock: FrozenClock
) -> None:
    mine = asyncio.new_event_loop()
    asyncio.set_event_loop(mine)
    try:
        outbox = Outbox(store, cascading_bus(), clock=clock, load_entry_points=False)
        enqueue(outbox, "t")
        Drain(outbox, clock)().assert_delivered("u", handler="second")
        assert asyncio.get_event_loop_policy().get_event_loop() is mine
        assert not mine.is_closed()
    finally:
        asyncio.set_event_loop(None)
        mine.close()


def without_asyncio_side() -> MemoryStore:
    store = MemoryStore()
    store.capabilities = dataclasses.replace(store.capabilities, asyncio=False)
    return store


def test_async_handlers_on_a_store_without_an_asyncio_side_are_refused_clearly(
    clock: FrozenClock,
) -> None:
    store = without_asyncio_side()
    outbox = Outbox(store, cascading_bus(), clock=clock, load_entry_points=False)
    drain = Drain(outbox, clock)
    event_id = enqueue(outbox, "t")
    message = (
        r"async def handlers \('first', 'second'\) run on the asyncio poller, which needs a "
        r"store with an asyncio side; .* has none \(capabilities\.asyncio is false\): test on "
        r"one that has, such as the memory store \(ini outboxkit_store = memory://"
    )
    with pytest.raises(ConfigurationError, match=message):
        drain()
    with pytest.raises(ConfigurationError, match=r"async def handlers \('first'\)"):
        drain.deliver_one("first", {})
    with pytest.raises(ConfigurationError, match="async_\\(\\) drains with the asyncio poller"):
        asyncio.run(Drain(Outbox(store, EventBus(), clock=clock), clock).async_())
    assert [e.id for e in drain.enqueued()] == [event_id]  # nothing written by the refusals


def test_async_drain_refuses_a_blocking_transactional_handler(clock: FrozenClock) -> None:
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: None, name="blocking")
    outbox = Outbox(MemoryStore(), bus, clock=clock, load_entry_points=False)
    drain = Drain(outbox, clock)
    with pytest.raises(ConfigurationError, match=r"'blocking' .* is a blocking transactional"):
        asyncio.run(drain.async_())
    with pytest.raises(ConfigurationError, match=r"'blocking' .* is a blocking transactional"):
        asyncio.run(drain.deliver_one_async("blocking", {}))
    assert drain.enqueued() == []
    enqueue(outbox, "t")
    drain().assert_delivered("t", handler="blocking")  # the blocking drain, as before


def test_drain_error_in_a_running_loop_is_raised_before_any_coroutine_is_made(
    clock: FrozenClock,
) -> None:
    outbox = Outbox(MemoryStore(), cascading_bus(), clock=clock, load_entry_points=False)
    drain = Drain(outbox, clock)

    async def inside() -> None:
        with pytest.raises(DrainError, match=r"await outbox_drain\.async_\(\)"):
            drain()

    asyncio.run(inside())  # filterwarnings = error: an unawaited coroutine would fail here
