"""``outboxkit.testing.drain``: rounds, cascades, backoff on the virtual clock, ``until``,
``deliver_one``; through the ``outbox_drain`` fixture, as users meet it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, Outbox, Poller, PollReport, Store
from outboxkit.testing import Drain, open_test_store
from tests.integration.pg.conftest import pg_url_from_env, require_server
from tests.integration.pg.conftest import test_url as pg_test_url
from tests.plugin.sample import run


def test_drain_delivers_cascades_and_rejections(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        from apphelpers import enqueue

        def test_order(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            enqueue(outbox, "order.placed", {"order_id": 2, "fraud": True})
            report = outbox_drain()
            assert report.rounds == 2          # the orders, then the stock.reserved follow-ups
            report.assert_delivered("order.placed", handler="reserve-stock", count=2)
            report.assert_rejected("order.placed", handler="fraud-check", count=1)
            report.assert_delivered("stock.reserved", handler="notify-warehouse", count=2)
            assert len(report.published) == 4
            assert report.topics_per_round == [
                ["order.placed", "order.placed"], ["stock.reserved", "stock.reserved"]
            ]
            assert report.advanced.total_seconds() == 0
        """,
    )
    result.assert_outcomes(passed=1)


def test_backoff_to_dead_letter_takes_no_real_time(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import time
        from datetime import timedelta
        from apphelpers import enqueue

        def test_dead(outbox, outbox_drain, outbox_clock, monkeypatch):
            def no_sleep(seconds):
                raise AssertionError(f"slept {seconds}s")
            monkeypatch.setattr(time, "sleep", no_sleep)
            start = outbox_clock.now()
            enqueue(outbox, "email.requested", {"to": "a@example.com"})
            report = outbox_drain(raise_errors=False)
            report.assert_dead_lettered("email.requested", count=1)
            runs = report.deliveries_to(handler="broken-mailer")
            assert [d.attempt for d in runs] == list(range(1, 12))
            gaps = [(b.at - a.at).total_seconds() for a, b in zip(runs, runs[1:])]
            assert gaps == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
            assert runs[0].at == start
            assert report.advanced == timedelta(seconds=sum(gaps))
            (dead,) = outbox.dead_letters()
            assert dead.event.attempts == 11
            assert dead.failed_at == start + report.advanced
        """,
    )
    result.assert_outcomes(passed=1)


def test_infinite_cascade_names_the_topic_chain(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import pytest
        from outboxkit import DrainError
        from apphelpers import enqueue

        def test_loop(outbox, outbox_drain):
            enqueue(outbox, "ping", {})
            with pytest.raises(DrainError) as info:
                outbox_drain(max_rounds=6)
            assert "max_rounds=6" in str(info.value)
            assert "ping -> pong -> ping -> pong -> ping -> pong" in str(info.value)
        """,
    )
    result.assert_outcomes(passed=1)


def test_scheduled_events_wait_for_until(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        from datetime import timedelta
        from apphelpers import enqueue

        def test_later(outbox, outbox_drain, outbox_clock):
            start = outbox_clock.now()
            enqueue(outbox, "stock.reserved", {"order_id": 9}, delay=3600)
            report = outbox_drain()
            assert report.deliveries == []
            assert [e.topic for e in report.pending] == ["stock.reserved"]
            assert outbox_clock.now() == start
            report = outbox_drain(until=timedelta(minutes=59))
            assert report.deliveries == []
            report = outbox_drain(until=timedelta(hours=2))
            report.assert_delivered("stock.reserved")
            assert report.deliveries[0].at == start + timedelta(hours=1)
            assert report.pending == []
        """,
    )
    result.assert_outcomes(passed=1)


def test_deliver_one_runs_a_single_handler(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        from apphelpers import enqueue

        def test_one(outbox, outbox_drain):
            waiting = enqueue(outbox, "order.placed", {"order_id": 7})
            report = outbox_drain.deliver_one("reserve-stock", {"order_id": 8})
            assert [(d.handler, d.outcome.value) for d in report.deliveries] == [
                ("reserve-stock", "succeeded")
            ]
            outbox_drain.assert_enqueued("stock.reserved", {"order_id": 8}, count=1)
            # the event already waiting was not touched: no attempt used, still due
            event = outbox.store.get(waiting)
            assert event.attempts == 0 and event.published_at is None
            everything = outbox_drain()
            everything.assert_delivered("order.placed", handler="fraud-check", count=1)
        """,
    )
    result.assert_outcomes(passed=1)


# -- the drain on its own, without pytester --------------------------------------------------


@pytest.fixture(
    params=[
        pytest.param(None, id="sqlite"),
        pytest.param("memory://", id="memory"),
        pytest.param("pg", id="pg", marks=pytest.mark.pg),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """The default SQLite test store, the memory store, or a PostgreSQL schema of its own."""
    url = request.param
    if url == "pg":
        require_server(pg_url_from_env())
        url = pg_test_url(pg_url_from_env())
    with open_test_store(url, tmp_path, request.node.nodeid) as opened:
        yield opened


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock("2030-01-01T00:00:00Z")


def enqueue(outbox: Outbox, topic: str, payload: Any = None, **options: Any) -> int:
    with outbox.store.transaction() as conn:
        event_id: int = outbox.enqueue(conn, topic, payload or {}, **options)
    return event_id


def test_the_drain_is_the_pollers_drain_loop(
    store: Store, clock: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every poll happens inside Poller.run_until_idle, with the drain's two callbacks.
    calls: list[tuple[bool, bool]] = []
    polls_outside: list[int] = []
    inside = False
    run_until_idle, run_once = Poller.run_until_idle, Poller.run_once

    def spy_until_idle(self: Poller, **callbacks: Any) -> list[PollReport]:
        nonlocal inside
        calls.append((callbacks["on_idle"] is not None, callbacks["on_round"] is not None))
        inside = True
        try:
            return run_until_idle(self, **callbacks)
        finally:
            inside = False

    def spy_once(self: Poller) -> PollReport:
        if not inside:
            polls_outside.append(1)
        return run_once(self)

    monkeypatch.setattr(Poller, "run_until_idle", spy_until_idle)
    monkeypatch.setattr(Poller, "run_once", spy_once)
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: ctx.enqueue("u", {}), name="h")
    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    enqueue(outbox, "t")
    report = Drain(outbox, clock)()
    assert calls == [(True, True)]
    assert polls_outside == []
    assert report.topics_per_round == [["t"], ["u"]]


def test_waiting_out_a_backoff_delivers_what_falls_due_meanwhile_at_its_own_time(
    store: Store, clock: FrozenClock
) -> None:
    start = clock.now()
    failures = {"a": 1}
    bus = EventBus()

    def flaky(event: Any, ctx: Any) -> None:
        if failures["a"]:
            failures["a"] -= 1
            raise ConnectionError("down once")

    bus.subscribe("a", flaky, name="a")
    bus.subscribe("b", lambda event, ctx: None, name="b")
    bus.subscribe("c", lambda event, ctx: None, name="c")
    outbox = Outbox(store, bus, clock=clock, backoff=300, load_entry_points=False)
    drain = Drain(outbox, clock)
    a = enqueue(outbox, "a")
    b = enqueue(outbox, "b", delay=100)
    c = enqueue(outbox, "c", delay=10_000)

    with drain.expect_failures("a"):
        report = drain()
    # B falls due while A's backoff is waited out: delivered at T+100, before A's retry at
    # T+300, as a poller would. C falls due after the last retry: it stays pending.
    assert [
        (d.event_id, d.outcome.value, (d.at - start).total_seconds()) for d in report.deliveries
    ] == [
        (a, "failed", 0),
        (b, "succeeded", 100),
        (a, "succeeded", 300),
    ]
    assert report.topics_per_round == [["a"], ["b"], ["a"]]
    assert report.retried == [a]
    assert report.published == [b, a]
    assert [e.id for e in report.pending] == [c]
    assert report.advanced == timedelta(seconds=300)
    assert clock.now() == start + timedelta(seconds=300)

    # Nothing left to wait out: a drain without until= leaves C (and the clock) alone.
    idle = drain()
    assert idle.deliveries == [] and [e.id for e in idle.pending] == [c]
    assert clock.now() == start + timedelta(seconds=300)

    later = drain(until=start + timedelta(hours=3))
    assert [(d.event_id, (d.at - start).total_seconds()) for d in later.deliveries] == [(c, 10_000)]
    assert later.published == [c]
    assert later.pending == []
    assert clock.now() == start + timedelta(seconds=10_000)  # C's own time, not until's


def test_waiting_out_a_lease_delivers_what_falls_due_meanwhile_at_its_own_time(
    store: Store, clock: FrozenClock
) -> None:
    start = clock.now()
    bus = EventBus()
    for topic in ("a", "b", "c"):
        bus.subscribe(topic, lambda event, ctx: None, name=topic)
    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    drain = Drain(outbox, clock)
    a = enqueue(outbox, "a")
    # A poller took A and went away: its lease runs until T+30.
    (claim,) = store.claim(batch_size=10, lease=timedelta(seconds=30), now=clock.now())
    assert claim.event.id == a
    b = enqueue(outbox, "b", delay=10)
    c = enqueue(outbox, "c", delay=60)

    report = drain()
    assert [(d.event_id, d.attempt, (d.at - start).total_seconds()) for d in report.deliveries] == [
        (b, 1, 10),
        (a, 2, 30),
    ]
    assert [e.id for e in report.pending] == [c]
    assert clock.now() == start + timedelta(seconds=30)


def test_scheduled_events_due_with_the_last_retry_are_delivered_with_it(
    store: Store, clock: FrozenClock
) -> None:
    start = clock.now()
    failures = {"a": 1}
    bus = EventBus()

    def flaky(event: Any, ctx: Any) -> None:
        if failures["a"]:
            failures["a"] -= 1
            raise ConnectionError("down once")

    bus.subscribe("a", flaky, name="a")
    bus.subscribe("b", lambda event, ctx: None, name="b")
    outbox = Outbox(store, bus, clock=clock, backoff=60, load_entry_points=False)
    drain = Drain(outbox, clock)
    a = enqueue(outbox, "a")
    b = enqueue(outbox, "b", delay=60)
    report = drain(raise_errors=False)
    assert [(d.event_id, (d.at - start).total_seconds()) for d in report.deliveries] == [
        (a, 0),
        (a, 60),
        (b, 60),
    ]
    assert report.pending == []


@pytest.mark.parametrize("advance_time", [True, False])
def test_a_drain_ends_on_a_short_batch_without_a_claim_that_finds_nothing(
    advance_time: bool, tmp_path: Path
) -> None:
    """A poll that claimed less than a batch is followed by one read of what is left, not by a
    claim that would find nothing: a follow-up due now is still delivered (a round of its
    own), and a retry in a second is waited out (or, without advancing time, left)."""
    clock = FrozenClock()
    bus = EventBus()
    failed: list[int] = []

    @bus.handler("order", name="orders")
    def order(event: Any, ctx: Any) -> None:
        ctx.enqueue("receipt", {"order": event.id})

    @bus.handler("receipt", name="receipts")
    def receipt(event: Any, ctx: Any) -> None:
        if not failed:
            failed.append(event.id)
            raise RuntimeError("the printer is out of paper")

    with open_test_store("memory://", tmp_path, name="short-batch") as store:
        outbox = Outbox(store, bus, clock=clock, batch_size=10, load_entry_points=False)
        claims: list[int] = []
        claim = store.claim

        def counted(**kwargs: Any) -> Any:
            claimed = claim(**kwargs)
            claims.append(len(claimed))
            return claimed

        store.claim = counted  # type: ignore[method-assign]
        with store.transaction() as tx:
            outbox.enqueue_many(tx, [("order", {"n": i}) for i in range(3)])
        report = Drain(outbox, clock)(advance_time=advance_time, raise_errors=False)

    if advance_time:
        # the orders, their receipts (one fails), its retry a backoff later; no empty claim
        assert claims == [3, 3, 1]
        assert len(report.published) == 6 and not report.pending
    else:
        assert claims == [3, 3]
        assert len(report.published) == 5 and len(report.pending) == 1
        assert report.advanced == timedelta(0)
