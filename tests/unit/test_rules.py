"""One test (or a few) per lifecycle rule R1-R14 (docs/lifecycle.md), on the memory store.

Each test drives the production path (``Outbox.enqueue`` -> ``Poller.run_once``) under a
``FrozenClock`` and asserts the exact state after each step: attempts, ``available_at``, the
published/failed timestamps, the delivery records and the observer events. The seed scenarios
close the file.

``Event`` does not carry ``published_at``, ``failed_at``, ``locked_until`` or ``last_error``; for
those exact values the tests read the memory store's row through ``row()``.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outboxkit import (
    Claimed,
    DeadLetter,
    DeadLettered,
    Delivery,
    DeliveryRecord,
    Event,
    EventBus,
    ExponentialBackoff,
    FrozenClock,
    HandlerFailed,
    HandlerRejected,
    HandlerStarted,
    HandlerSucceeded,
    InvalidEvent,
    LeaseLost,
    LeaseLostError,
    MemoryStore,
    MemoryTransaction,
    Message,
    Outbox,
    Outcome,
    Published,
    Reject,
    RetryScheduled,
    Stats,
    StoreError,
    Unrouted,
    hookimpl,
)
from outboxkit.core.machine import Publish
from outboxkit.store import settle_one

T0 = datetime(2030, 1, 1, tzinfo=UTC)
LEASE = timedelta(seconds=30)
US = timedelta(microseconds=1)
DAY = timedelta(days=1)


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def row(store: MemoryStore, event_id: int) -> Any:
    """The memory store's row, for the timestamps ``Event`` does not carry."""
    return store.tables.events[event_id]


def enqueue(store: MemoryStore, outbox: Outbox, topic: str = "t", payload: Any = None, **kw: Any):
    with store.transaction() as tx:
        return outbox.enqueue(tx, topic, {"n": 1} if payload is None else payload, **kw)


def make_outbox(store, bus, clock, recorder, **options) -> Outbox:
    return Outbox(store, bus, clock=clock, plugins=[recorder], **options)


def failing(calls: list[Any], exc: Exception):
    def handler(event, ctx):
        calls.append((event.id, ctx.attempt))
        raise exc

    return handler


def ok(calls: list[Any]):
    def handler(event, ctx):
        calls.append((event.id, ctx.handler, ctx.attempt))

    return handler


def retry_gaps(poller, store: MemoryStore, clock: FrozenClock, event_id: int) -> list[timedelta]:
    """Run the event to its end, one attempt at its exact ``available_at``; the retry gaps seen.

    A microsecond before each retry is due, a poll must claim nothing.
    """
    gaps = []
    while True:
        report = poller.run_once()
        assert report.claimed == [event_id]
        if report.dead_lettered or report.published:
            return gaps
        assert report.retried == [event_id]
        gap = store.get(event_id).available_at - clock.now()
        gaps.append(gap)
        clock.advance(gap - US)
        assert not poller.run_once()
        clock.advance(US)


# -- R1 enqueue ---------------------------------------------------------------------------------


def test_r1_enqueue_never_commits_or_rolls_back(store, outbox, recorder):
    tx = store.begin()
    tx.insert("orders", {"id": 42})
    event_id = outbox.enqueue(tx, "order.placed", {"order_id": 42}, headers={"h": "v"}, key="k")
    assert tx.open  # neither committed nor rolled back
    assert store.get(event_id) is None  # invisible until the caller commits
    assert store.stats(now=T0).total == 0
    assert store.claim(batch_size=10, lease=LEASE, now=T0) == []
    tx.insert("orders", {"id": 43})  # the caller's transaction goes on
    tx.commit()
    assert store.get(event_id) == Event(
        id=event_id,
        topic="order.placed",
        payload={"order_id": 42},
        headers={"h": "v"},
        key="k",
        created_at=T0,
        available_at=T0,
        attempts=0,
    )
    assert store.rows("orders") == [{"id": 42}, {"id": 43}]
    assert store.records(event_id) == []
    assert recorder.events == []


def test_r1_enqueue_never_begins_a_transaction(store, outbox):
    tx = store.begin()
    tx.commit()
    with pytest.raises(StoreError, match="already committed"):
        outbox.enqueue(tx, "t", {"n": 1})
    with pytest.raises(ValueError, match="transaction"):
        outbox.enqueue(None, "t", {"n": 1})
    assert store.stats(now=T0).total == 0


def test_r1_rolled_back_event_never_existed(store, bus, outbox, recorder):
    calls: list[Any] = []
    bus.subscribe("t", ok(calls), name="h")
    seen: list[Any] = []

    def app_work() -> None:
        with store.transaction() as tx:
            seen.extend([tx, outbox.enqueue(tx, "t", {"n": 1})])
            tx.insert("orders", {"id": 1})
            raise RuntimeError("app failed")

    with pytest.raises(RuntimeError, match="app failed"):
        app_work()
    tx, event_id = seen
    assert not tx.open
    assert store.get(event_id) is None
    assert store.rows("orders") == []
    assert store.stats(now=T0) == Stats()
    report = outbox.poller().run_once()
    assert report.claimed == []
    assert calls == []
    assert recorder.events == []


@pytest.mark.parametrize(
    "payload",
    [
        float("nan"),
        {"x": float("inf")},
        [float("-inf")],
        "a\x00b",
        {"k\x00": 1},
        "\ud800",
        {"lone": "x\udfff"},
        {1: "int key"},
        {"when": T0},
        b"bytes",
        {1, 2},
    ],
    ids=repr,
)
def test_r1_invalid_payload_raises_and_transaction_stays_usable(store, outbox, payload):
    tx = store.begin()
    tx.insert("orders", {"id": 1})
    first = outbox.enqueue(tx, "t", {"ok": True})
    with pytest.raises(InvalidEvent) as raised:
        outbox.enqueue(tx, "t", payload)
    assert isinstance(raised.value, ValueError)
    assert tx.open
    second = outbox.enqueue(tx, "t", {"ok": 2})
    tx.commit()
    assert store.stats(now=T0).total == 2
    assert store.get(first).payload == {"ok": True}
    assert store.get(second).payload == {"ok": 2}
    assert store.rows("orders") == [{"id": 1}]


def test_r1_payload_at_most_max_payload_bytes(store, bus, clock, recorder, outbox):
    limit = 1024 * 1024
    with store.transaction() as tx:
        fits = outbox.enqueue(tx, "t", "x" * (limit - 2))  # two quotes: exactly 1 MiB
        with pytest.raises(InvalidEvent, match="max_payload_bytes"):
            outbox.enqueue(tx, "t", "x" * (limit - 1))
    assert store.stats(now=T0).total == 1
    assert len(store.get(fits).payload) == limit - 2

    small = make_outbox(store, bus, clock, recorder, max_payload_bytes=10)
    with store.transaction() as tx:
        small.enqueue(tx, "t", "é" * 4)  # 8 bytes of UTF-8 and two quotes
        with pytest.raises(InvalidEvent, match="11 bytes"):
            small.enqueue(tx, "t", "x" * 9)
    assert store.stats(now=T0).total == 2


def test_r1_enqueue_many_writes_a_batch_in_one_statement(store, outbox, monkeypatch):
    statements: list[int] = []
    real = store.enqueue

    def counting(conn, events, *, now):
        statements.append(len(events))
        return real(conn, events, now=now)

    monkeypatch.setattr(store, "enqueue", counting)
    with store.transaction() as tx:
        ids = outbox.enqueue_many(
            tx,
            [("a", {"n": 1}), Message("b", [1, 2], headers={"x": "y"}, key="k", delay=5)],
        )
        assert tx.open
        assert store.get(ids[0]) is None
    assert statements == [2]
    assert ids == [1, 2]
    assert store.get(1) == Event(1, "a", {"n": 1}, {}, None, T0, T0, 0)
    assert store.get(2) == Event(2, "b", [1, 2], {"x": "y"}, "k", T0, T0 + s(5), 0)


def test_r1_enqueue_many_one_bad_event_writes_none(store, outbox):
    tx = store.begin()
    with pytest.raises(InvalidEvent, match="event #1"):
        outbox.enqueue_many(tx, [("a", {"n": 1}), ("b", float("nan")), ("c", {})])
    assert tx.open
    assert outbox.enqueue_many(tx, []) == []
    tx.commit()
    assert store.stats(now=T0).total == 0


# -- R2 due -------------------------------------------------------------------------------------


def test_r2_due_only_once_available(store, bus, outbox, clock):
    calls: list[Any] = []
    bus.subscribe("t", ok(calls), name="h")
    event_id = enqueue(store, outbox, delay=10)
    assert store.get(event_id).available_at == T0 + s(10)
    assert store.stats(now=T0) == Stats(pending=1, by_topic={"t": {"pending": 1}})
    poller = outbox.poller()
    clock.advance(s(10) - US)
    assert not poller.run_once()
    assert calls == []
    clock.advance(US)  # available_at == now: due
    assert store.stats(now=clock.now()).oldest_due_at == T0 + s(10)
    report = poller.run_once()
    assert report.claimed == [event_id]
    assert calls == [(event_id, "h", 1)]


def test_r2_leased_event_not_due_until_lease_passes(store, outbox, clock):
    event_id = enqueue(store, outbox)
    (first,) = store.claim(batch_size=10, lease=LEASE, now=T0)
    assert first.locked_until == T0 + LEASE
    assert store.claim(batch_size=10, lease=LEASE, now=T0) == []
    clock.advance(LEASE - US)
    assert store.claim(batch_size=10, lease=LEASE, now=clock.now()) == []
    assert store.stats(now=clock.now()) == Stats(claimed=1, by_topic={"t": {"claimed": 1}})
    clock.advance(US)  # locked_until == now: no longer leased
    assert store.stats(now=clock.now()) == Stats(
        pending=1, by_topic={"t": {"pending": 1}}, oldest_due_at=T0
    )
    (second,) = store.claim(batch_size=10, lease=LEASE, now=clock.now())
    assert second.event.id == event_id
    assert second.attempt == 2
    assert second.token != first.token
    assert second.locked_until == T0 + 2 * LEASE


def test_r2_published_and_dead_events_are_never_due(store, bus, outbox, clock):
    bus.subscribe("good", ok([]), name="h")
    bus.subscribe("bad", failing([], RuntimeError("down")), name="h")
    good = enqueue(store, outbox, "good")
    bad = enqueue(store, outbox, "bad")
    poller = outbox.poller(max_retries=0)
    report = poller.run_once()
    assert report.published == [good]
    assert report.dead_lettered == [bad]
    clock.advance(DAY)
    assert store.claim(batch_size=10, lease=LEASE, now=clock.now()) == []
    assert not poller.run_once()
    stats = store.stats(now=clock.now())
    assert (stats.pending, stats.claimed, stats.published, stats.dead) == (0, 0, 1, 1)
    assert stats.oldest_due_at is None


# -- R3 claim -----------------------------------------------------------------------------------


def test_r3_claim_takes_batch_size_oldest_available_first(store, bus, outbox, clock, recorder):
    order: list[Any] = []
    bus.subscribe("t", ok(order), name="h")
    e1 = enqueue(store, outbox, delay=5)
    e2 = enqueue(store, outbox)
    e3 = enqueue(store, outbox)
    e4 = enqueue(store, outbox, delay=5)
    clock.advance(5)
    poller = outbox.poller(batch_size=3)
    report = poller.run_once()
    assert report.claimed == [e2, e3, e1]  # by (available_at, id)
    assert [c[0] for c in order] == [e2, e3, e1]
    assert recorder.of(Claimed) == [Claimed(e, "t", 1) for e in (e2, e3, e1)]
    assert poller.run_once().claimed == [e4]
    assert not poller.run_once()


def test_r3_claim_sets_lease_attempt_and_fresh_token_atomically(store, outbox, clock):
    ids = [enqueue(store, outbox) for _ in range(3)]
    claims = store.claim(batch_size=2, lease=LEASE, now=T0)
    assert [c.event.id for c in claims] == ids[:2]
    assert [c.attempt for c in claims] == [1, 1]
    assert [c.locked_until for c in claims] == [T0 + LEASE] * 2
    assert all(c.token for c in claims)
    assert claims[0].token != claims[1].token
    assert [store.get(i).attempts for i in ids] == [1, 1, 0]
    assert [row(store, i).locked_until for i in ids] == [T0 + LEASE, T0 + LEASE, None]
    (third,) = store.claim(batch_size=2, lease=LEASE, now=T0)
    assert third.event.id == ids[2]
    assert third.token not in {c.token for c in claims}


def test_r3_claim_commits_before_any_handler_runs(store, bus, outbox, clock):
    seen: list[Any] = []

    def handler(event, ctx):
        seen.append(
            (
                store.get(event.id).attempts,
                store.stats(now=clock.now()).claimed,
                store.claim(batch_size=10, lease=LEASE, now=clock.now()),
            )
        )

    bus.subscribe("t", handler, name="h")
    event_id = enqueue(store, outbox)
    assert outbox.poller().run_once().published == [event_id]
    assert seen == [(1, 1, [])]


def test_r3_two_claimers_never_get_the_same_event(store, outbox):
    ids = [enqueue(store, outbox) for _ in range(60)]
    start = threading.Barrier(4)
    got: list[list[int]] = [[] for _ in range(4)]

    def claimer(mine: list[int]) -> None:
        start.wait()
        while claims := store.claim(batch_size=3, lease=LEASE, now=T0):
            mine.extend(c.event.id for c in claims)

    threads = [threading.Thread(target=claimer, args=(mine,)) for mine in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [i for mine in got for i in mine]
    assert sorted(everything) == ids  # each event once, none lost
    assert all(store.get(i).attempts == 1 for i in ids)


# -- R4 attempt counted at claim ----------------------------------------------------------------


def test_r4_attempt_counted_at_claim(store, bus, outbox, clock, recorder):
    seen: list[Any] = []

    def handler(event, ctx):
        seen.append((event.attempts, ctx.attempt, store.get(event.id).attempts))

    bus.subscribe("t", handler, name="h")
    event_id = enqueue(store, outbox)
    (claim,) = store.claim(batch_size=1, lease=LEASE, now=T0)  # a poller claims, then dies
    assert claim.attempt == 1
    assert store.get(event_id).attempts == 1
    clock.advance(LEASE)
    report = outbox.poller().run_once()
    assert report.published == [event_id]
    assert seen == [(2, 2, 2)]
    assert store.get(event_id).attempts == 2
    assert recorder.events == [
        Claimed(event_id, "t", 2),
        HandlerStarted(event_id, "t", "h", 2),
        HandlerSucceeded(event_id, "t", "h", 2),
        Published(event_id, "t", 2),
    ]


def test_r4_crash_after_claim_uses_an_attempt_up(store, bus, outbox, clock, recorder):
    calls: list[Any] = []
    bus.subscribe("t", failing(calls, RuntimeError("down")), name="h")
    event_id = enqueue(store, outbox)
    store.claim(batch_size=1, lease=LEASE, now=T0)  # attempt 1, lost in a crash
    clock.advance(LEASE)
    report = outbox.poller(max_retries=1).run_once()
    assert calls == [(event_id, 2)]  # the handler ran once, yet this was the last attempt
    assert report.dead_lettered == [event_id]
    assert recorder.of(DeadLettered) == [DeadLettered(event_id, "t", 2, "h: RuntimeError: down")]


# -- R5 deliver ---------------------------------------------------------------------------------


def test_r5_deliver_in_claim_order_then_subscription_order(store, bus, outbox):
    calls: list[Any] = []
    for name in ("c", "a", "b"):
        bus.subscribe("x", ok(calls), name=name)
    bus.subscribe("y", ok(calls), name="z")
    e1 = enqueue(store, outbox, "x")
    e2 = enqueue(store, outbox, "y")
    e3 = enqueue(store, outbox, "x")
    report = outbox.poller().run_once()
    expected = [
        (e1, "c", 1),
        (e1, "a", 1),
        (e1, "b", 1),
        (e2, "z", 1),
        (e3, "c", 1),
        (e3, "a", 1),
        (e3, "b", 1),
    ]
    assert calls == expected
    assert [(d.event_id, d.handler, d.attempt) for d in report.deliveries] == expected
    assert report.published == [e1, e2, e3]
    assert [r.handler for r in store.records(e1)] == ["c", "a", "b"]


def test_r5_one_failure_does_not_stop_the_other_handlers(store, bus, outbox, clock, recorder):
    calls: list[Any] = []
    state = {"fail": True}

    def flaky(event, ctx):
        calls.append((event.id, "flaky", ctx.attempt))
        if state["fail"]:
            raise RuntimeError("down")

    def rejecting(event, ctx):
        calls.append((event.id, "rejecting", ctx.attempt))
        raise Reject("no")

    bus.subscribe("t", flaky, name="flaky")
    bus.subscribe("t", ok(calls), name="ok")
    bus.subscribe("t", rejecting, name="rejecting")
    event_id = enqueue(store, outbox)
    poller = outbox.poller()
    report = poller.run_once()
    assert calls == [(event_id, "flaky", 1), (event_id, "ok", 1), (event_id, "rejecting", 1)]
    assert [d.outcome for d in report.deliveries] == [
        Outcome.FAILED,
        Outcome.SUCCEEDED,
        Outcome.REJECTED,
    ]
    assert report.retried == [event_id]
    assert store.records(event_id) == [
        DeliveryRecord(event_id, "ok", Outcome.SUCCEEDED, 1, T0),
        DeliveryRecord(event_id, "rejecting", Outcome.REJECTED, 1, T0, "no"),
    ]
    # The retry runs only the handler without a record.
    state["fail"] = False
    clock.advance(1)
    calls.clear()
    report = poller.run_once()
    assert calls == [(event_id, "flaky", 2)]
    assert report.published == [event_id]
    assert [(r.handler, r.outcome, r.attempt) for r in store.records(event_id)] == [
        ("ok", Outcome.SUCCEEDED, 1),
        ("rejecting", Outcome.REJECTED, 1),
        ("flaky", Outcome.SUCCEEDED, 2),
    ]


# -- R6 transactional handler -------------------------------------------------------------------


def test_r6_handler_writes_and_success_record_commit_together(store, bus, outbox, recorder):
    during: list[Any] = []

    def handler(event, ctx):
        ctx.connection.insert("receipts", {"order": event.payload["order_id"]})
        ctx.enqueue("receipt.sent", {"order": 42})
        during.append(
            (
                type(ctx.connection),
                ctx.connection.rows("receipts"),
                store.rows("receipts"),
                store.records(event.id),
                store.stats(now=T0).total,
            )
        )

    bus.subscribe("order.placed", handler, name="receipt")
    event_id = enqueue(store, outbox, "order.placed", {"order_id": 42})
    report = outbox.poller().run_once()
    # Inside the handler nothing was visible to others yet.
    assert during == [(MemoryTransaction, [{"order": 42}], [], [], 1)]
    assert store.rows("receipts") == [{"order": 42}]
    assert store.records(event_id) == [
        DeliveryRecord(event_id, "receipt", Outcome.SUCCEEDED, 1, T0)
    ]
    assert store.get(event_id + 1) == Event(
        event_id + 1, "receipt.sent", {"order": 42}, {}, None, T0, T0, 0
    )
    assert report.published == [event_id]
    assert report.deliveries == [
        Delivery(event_id, "order.placed", "receipt", 1, Outcome.SUCCEEDED, T0)
    ]
    assert row(store, event_id).published_at == T0
    assert recorder.events == [
        Claimed(event_id, "order.placed", 1),
        HandlerStarted(event_id, "order.placed", "receipt", 1),
        HandlerSucceeded(event_id, "order.placed", "receipt", 1),
        Published(event_id, "order.placed", 1),
    ]


def test_r6_reject_rolls_back_and_records_rejected(store, bus, outbox, clock, recorder):
    calls: list[int] = []

    def handler(event, ctx):
        calls.append(ctx.attempt)
        ctx.connection.insert("stock", {"sku": "x"})
        ctx.enqueue("stock.reserved", {"sku": "x"})
        raise Reject("out of stock")

    bus.subscribe("t", handler, name="reserve")
    event_id = enqueue(store, outbox)
    poller = outbox.poller()
    report = poller.run_once()
    assert store.rows("stock") == []
    assert store.stats(now=T0).total == 1  # the follow-up rolled back too
    assert store.records(event_id) == [
        DeliveryRecord(event_id, "reserve", Outcome.REJECTED, 1, T0, "out of stock")
    ]
    assert report.rejected == [
        Delivery(event_id, "t", "reserve", 1, Outcome.REJECTED, T0, "out of stock")
    ]
    assert report.published == [event_id]
    assert report.retried == []
    assert row(store, event_id).published_at == T0
    assert recorder.events == [
        Claimed(event_id, "t", 1),
        HandlerStarted(event_id, "t", "reserve", 1),
        HandlerRejected(event_id, "t", "reserve", 1, "out of stock"),
        Published(event_id, "t", 1),
    ]
    clock.advance(DAY)
    assert not poller.run_once()  # never retried
    assert calls == [1]


def test_r6_exception_rolls_back_without_a_record(store, bus, outbox, recorder):
    boom = ValueError("boom")

    def handler(event, ctx):
        ctx.connection.insert("stock", {"sku": "x"})
        ctx.enqueue("stock.reserved", {"sku": "x"})
        raise boom

    bus.subscribe("t", handler, name="reserve")
    event_id = enqueue(store, outbox)
    report = outbox.poller().run_once()
    assert store.rows("stock") == []
    assert store.records(event_id) == []
    assert store.stats(now=T0).total == 1
    assert report.failed == [
        Delivery(event_id, "t", "reserve", 1, Outcome.FAILED, T0, "ValueError: boom")
    ]
    assert report.failed[0].exception is boom
    assert report.retried == [event_id]
    assert store.get(event_id).attempts == 1
    assert store.get(event_id).available_at == T0 + s(1)
    assert row(store, event_id).last_error == "reserve: ValueError: boom"
    assert row(store, event_id).locked_until is None
    assert recorder.events == [
        Claimed(event_id, "t", 1),
        HandlerStarted(event_id, "t", "reserve", 1),
        HandlerFailed(event_id, "t", "reserve", 1, "ValueError: boom"),
        RetryScheduled(event_id, "t", 1, s(1), "reserve: ValueError: boom"),
    ]


def test_r6_base_exception_rolls_back_records_nothing_and_reraises(
    store, bus, outbox, clock, recorder
):
    calls: list[Any] = []

    def handler(event, ctx):
        calls.append((event.id, ctx.attempt))
        ctx.connection.insert("stock", {"event": event.id})
        if event.id == 1 and ctx.attempt == 1:
            raise KeyboardInterrupt

    bus.subscribe("t", handler, name="h")
    e1, e2, e3 = (enqueue(store, outbox) for _ in range(3))
    poller = outbox.poller()
    with pytest.raises(KeyboardInterrupt):
        poller.run_once()
    assert calls == [(e1, 1)]
    assert store.rows("stock") == []
    assert store.records(e1) == []
    # The event in hand keeps its lease and its attempt; the unstarted ones were released.
    assert [store.get(e).attempts for e in (e1, e2, e3)] == [1, 0, 0]
    assert [row(store, e).locked_until for e in (e1, e2, e3)] == [T0 + LEASE, None, None]
    assert store.stats(now=T0) == Stats(
        pending=2, claimed=1, by_topic={"t": {"claimed": 1, "pending": 2}}, oldest_due_at=T0
    )
    assert recorder.events == [
        *(Claimed(e, "t", 1) for e in (e1, e2, e3)),
        HandlerStarted(e1, "t", "h", 1),  # it started, then raised: no outcome is emitted
    ]

    report = poller.run_once()
    assert report.claimed == [e2, e3]
    assert report.published == [e2, e3]
    clock.advance(LEASE - US)
    assert not poller.run_once()
    clock.advance(US)
    report = poller.run_once()
    assert report.published == [e1]
    assert store.get(e1).attempts == 2
    assert store.records(e1) == [DeliveryRecord(e1, "h", Outcome.SUCCEEDED, 2, T0 + LEASE)]
    assert store.rows("stock") == [{"event": e2}, {"event": e3}, {"event": e1}]


def test_r6_delivery_checks_the_claim_token_first(store, outbox, clock):
    event_id = enqueue(store, outbox)
    (stale,) = store.claim(batch_size=1, lease=LEASE, now=T0)
    clock.advance(LEASE)
    (fresh,) = store.claim(batch_size=1, lease=LEASE, now=clock.now())
    opening = store.delivery(stale, now=clock.now())
    with pytest.raises(LeaseLostError):
        opening.__enter__()
    assert store.records(event_id) == []
    with store.delivery(fresh, now=clock.now()) as tx:
        tx.record("h", Outcome.SUCCEEDED)
    assert store.records(event_id) == [
        DeliveryRecord(event_id, "h", Outcome.SUCCEEDED, 2, T0 + LEASE)
    ]


# -- R7 non-transactional handler ---------------------------------------------------------------


def test_r7_non_transactional_handler_runs_outside_any_transaction(
    store, bus, outbox, clock, recorder
):
    during: list[Any] = []

    def handler(event, ctx):
        ctx.enqueue("email.sent", {"to": "a@example.com"}, delay=2)
        during.append((ctx.connection, store.stats(now=clock.now()).total, store.records(event.id)))
        clock.advance(5)  # the outside world is slow

    bus.subscribe("t", handler, name="mailer", transactional=False)
    event_id = enqueue(store, outbox)
    report = outbox.poller().run_once()
    assert during == [(None, 1, [])]  # follow-up buffered, no record yet
    # The record and the follow-up commit together, after the handler returned.
    assert store.records(event_id) == [
        DeliveryRecord(event_id, "mailer", Outcome.SUCCEEDED, 1, T0 + s(5))
    ]
    assert store.get(event_id + 1) == Event(
        event_id + 1, "email.sent", {"to": "a@example.com"}, {}, None, T0 + s(5), T0 + s(7), 0
    )
    assert report.published == [event_id]
    assert row(store, event_id).published_at == T0 + s(5)
    assert recorder.events == [
        Claimed(event_id, "t", 1),
        HandlerStarted(event_id, "t", "mailer", 1),
        HandlerSucceeded(event_id, "t", "mailer", 1),
        Published(event_id, "t", 1),
    ]


def test_r7_non_transactional_failure_drops_its_follow_ups(store, bus, outbox, recorder):
    def handler(event, ctx):
        ctx.enqueue("email.sent", {})
        raise ConnectionError("smtp down")

    bus.subscribe("t", handler, name="mailer", transactional=False)
    event_id = enqueue(store, outbox)
    report = outbox.poller().run_once()
    assert store.stats(now=T0).total == 1
    assert store.records(event_id) == []
    assert report.retried == [event_id]
    assert store.get(event_id).available_at == T0 + s(1)
    assert recorder.of(HandlerFailed) == [
        HandlerFailed(event_id, "t", "mailer", 1, "ConnectionError: smtp down")
    ]


def test_r7_non_transactional_reject_records_rejected_without_follow_ups(store, bus, outbox):
    def handler(event, ctx):
        ctx.enqueue("email.sent", {})
        raise Reject("bounced")

    bus.subscribe("t", handler, name="mailer", transactional=False)
    event_id = enqueue(store, outbox)
    report = outbox.poller().run_once()
    assert store.stats(now=T0).total == 1
    assert store.records(event_id) == [
        DeliveryRecord(event_id, "mailer", Outcome.REJECTED, 1, T0, "bounced")
    ]
    assert report.published == [event_id]


# -- R8 settle ----------------------------------------------------------------------------------


def test_r8_settle_publishes_when_every_handler_has_a_record(store, bus, outbox, clock, recorder):
    def slow(event, ctx):
        clock.advance(2)

    bus.subscribe("t", slow, name="slow")
    bus.subscribe("t", ok([]), name="fast")
    event_id = enqueue(store, outbox)
    report = outbox.poller().run_once()
    assert report.published == [event_id]
    r = row(store, event_id)
    assert (r.published_at, r.failed_at, r.locked_until, r.token) == (T0 + s(2), None, None, None)
    assert store.get(event_id).attempts == 1
    assert recorder.of(Published) == [Published(event_id, "t", 1)]
    assert store.stats(now=clock.now()).published == 1


def test_r8_settle_retries_after_backoff_and_clears_the_lease(store, bus, outbox, clock, recorder):
    def a(event, ctx):
        clock.advance(3)
        raise ValueError("x")

    def b(event, ctx):
        raise RuntimeError("y")

    bus.subscribe("t", a, name="a")
    bus.subscribe("t", b, name="b")
    event_id = enqueue(store, outbox)
    poller = outbox.poller()
    report = poller.run_once()
    assert report.retried == [event_id]
    r = row(store, event_id)
    assert r.available_at == T0 + s(3) + s(1)  # now at settle + backoff(1)
    assert r.last_error == "a: ValueError: x; b: RuntimeError: y"
    assert (r.locked_until, r.token, r.published_at, r.failed_at) == (None, None, None, None)
    assert recorder.of(RetryScheduled) == [
        RetryScheduled(event_id, "t", 1, s(1), "a: ValueError: x; b: RuntimeError: y")
    ]
    clock.advance(s(1) - US)
    assert not poller.run_once()
    clock.advance(US)
    assert poller.run_once().claimed == [event_id]


def test_r8_settle_dead_letters_when_retries_are_used_up(store, bus, outbox, clock, recorder):
    def broken(event, ctx):
        clock.advance(2)
        raise RuntimeError("down")

    bus.subscribe("t", ok([]), name="fine")
    bus.subscribe("t", broken, name="broken")
    event_id = enqueue(store, outbox)
    report = outbox.poller(max_retries=0).run_once()
    assert report.dead_lettered == [event_id]
    r = row(store, event_id)
    assert (r.failed_at, r.published_at, r.locked_until, r.token) == (T0 + s(2), None, None, None)
    assert store.dead_letters() == [
        DeadLetter(
            event=Event(
                event_id,
                "t",
                {"n": 1},
                {},
                None,
                T0,
                T0,
                1,
                failed_at=T0 + s(2),
                last_error="broken: RuntimeError: down",
            ),
            failed_at=T0 + s(2),
            last_error="broken: RuntimeError: down",
            records=(DeliveryRecord(event_id, "fine", Outcome.SUCCEEDED, 1, T0),),
        )
    ]
    assert recorder.of(DeadLettered) == [
        DeadLettered(event_id, "t", 1, "broken: RuntimeError: down")
    ]
    assert recorder.of(RetryScheduled) == []


class TakeOver:
    """An observer that lets another poller take the event over once its handler succeeded."""

    def __init__(self, store: MemoryStore, clock: FrozenClock) -> None:
        self.store = store
        self.clock = clock
        self.claims: list[Any] = []

    @hookimpl
    def outboxkit_on_event(self, event: Any) -> None:
        if isinstance(event, HandlerSucceeded) and not self.claims:
            self.clock.advance(LEASE)
            self.claims += self.store.claim(batch_size=1, lease=LEASE, now=self.clock.now())


def test_r8_stale_settle_changes_nothing_and_emits_lease_lost(store, bus, outbox, clock, recorder):
    # The round's settle comes after the deliveries: the window this test opens.
    bus.subscribe("t", ok([]), name="h")
    event_id = enqueue(store, outbox)
    takeover = TakeOver(store, clock)
    outbox.add_observer(takeover)
    report = outbox.poller().run_once()
    (fresh,) = takeover.claims
    assert fresh.attempt == 2
    assert fresh.done == {"h": Outcome.SUCCEEDED}
    assert report.lease_lost == [event_id]
    assert report.published == []
    r = row(store, event_id)
    assert (r.attempts, r.locked_until, r.token) == (2, T0 + 2 * LEASE, fresh.token)
    assert (r.published_at, r.failed_at, r.last_error) == (None, None, None)
    assert recorder.events == [
        Claimed(event_id, "t", 1),
        HandlerStarted(event_id, "t", "h", 1),
        HandlerSucceeded(event_id, "t", "h", 1),
        LeaseLost(event_id, "t", 1, None),
    ]
    # The new owner's settle goes through.
    assert settle_one(store, fresh, Publish(), error=None, now=clock.now())
    assert row(store, event_id).published_at == T0 + LEASE
    assert not settle_one(store, fresh, Publish(), error=None, now=clock.now())


# -- R9 unrouted --------------------------------------------------------------------------------


def test_r9_topic_without_handlers_is_published_at_once(store, outbox, recorder, caplog):
    caplog.set_level(logging.INFO, logger="outboxkit")
    event_id = enqueue(store, outbox, "nobody.listens")
    report = outbox.poller().run_once()
    assert report.claimed == [event_id]
    assert report.published == [event_id]
    assert report.deliveries == []
    assert store.records(event_id) == []
    assert store.get(event_id).attempts == 1
    assert row(store, event_id).published_at == T0
    assert recorder.events == [
        Claimed(event_id, "nobody.listens", 1),
        Unrouted(event_id, "nobody.listens"),
        Published(event_id, "nobody.listens", 1),
    ]
    assert "no handler subscribed" in caplog.text


# -- R10 backoff --------------------------------------------------------------------------------


def test_r10_default_backoff_doubles_from_one_second_up_to_300():
    policy = ExponentialBackoff()
    expected = [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]
    assert [policy(n) for n in range(1, 13)] == expected
    assert [policy(n) for n in range(1, 13)] == expected  # no jitter: the same every time
    assert policy(10_000) == 300


def test_r10_a_callable_replaces_the_default(store, bus, outbox, clock, recorder):
    bus.subscribe("t", failing([], RuntimeError("down")), name="h")
    asked: list[int] = []

    def backoff(retry: int) -> timedelta:
        asked.append(retry)
        return s(7 * retry)

    event_id = enqueue(store, outbox)
    gaps = retry_gaps(outbox.poller(backoff=backoff, max_retries=3), store, clock, event_id)
    assert gaps == [s(7), s(14), s(21)]
    assert asked == [1, 2, 3]
    assert [e.delay for e in recorder.of(RetryScheduled)] == gaps


def test_r10_backoff_may_return_float_seconds_or_be_a_constant(store, bus, outbox, clock):
    bus.subscribe("t", failing([], RuntimeError("down")), name="h")
    first = enqueue(store, outbox)
    gaps = retry_gaps(outbox.poller(backoff=lambda n: 0.25 * n, max_retries=2), store, clock, first)
    assert gaps == [s(0.25), s(0.5)]
    second = enqueue(store, outbox)
    gaps = retry_gaps(outbox.poller(backoff=5, max_retries=2), store, clock, second)
    assert gaps == [s(5), s(5)]
    third = enqueue(store, outbox)
    policy = ExponentialBackoff(base=2, max=10)
    gaps = retry_gaps(outbox.poller(backoff=policy, max_retries=4), store, clock, third)
    assert gaps == [s(2), s(4), s(8), s(10)]


# -- R11 max_retries ----------------------------------------------------------------------------


def test_r11_dead_letter_after_max_retries(store, bus, outbox, clock, recorder):
    calls: list[Any] = []
    bus.subscribe("t", failing(calls, RuntimeError("down")), name="h")
    event_id = enqueue(store, outbox)
    poller = outbox.poller()  # max_retries defaults to 10
    assert poller.options.max_retries == 10
    gaps = retry_gaps(poller, store, clock, event_id)
    assert len(calls) == 11
    assert [attempt for _, attempt in calls] == list(range(1, 12))
    assert len(gaps) == 10
    failed_at = T0 + sum(gaps, timedelta(0))
    assert failed_at == T0 + s(811)  # 1 + 2 + ... + 256 + 300
    (dead,) = store.dead_letters()
    assert (dead.event.id, dead.event.attempts, dead.failed_at) == (event_id, 11, failed_at)
    assert dead.last_error == "h: RuntimeError: down"
    assert recorder.of(DeadLettered) == [DeadLettered(event_id, "t", 11, "h: RuntimeError: down")]
    assert [e.attempt for e in recorder.of(RetryScheduled)] == list(range(1, 11))
    clock.advance(DAY)
    assert not poller.run_once()
    assert len(calls) == 11


def test_r11_max_retries_zero_means_one_attempt(store, bus, outbox, clock, recorder):
    calls: list[Any] = []
    bus.subscribe("t", failing(calls, RuntimeError("down")), name="h")
    event_id = enqueue(store, outbox)
    poller = outbox.poller(max_retries=0)
    report = poller.run_once()
    assert report.dead_lettered == [event_id]
    assert calls == [(event_id, 1)]
    assert row(store, event_id).failed_at == T0
    clock.advance(DAY)
    assert not poller.run_once()
    assert recorder.of(RetryScheduled) == []
    assert recorder.of(DeadLettered) == [DeadLettered(event_id, "t", 1, "h: RuntimeError: down")]


# -- R12 requeue --------------------------------------------------------------------------------


def test_r12_dead_event_never_claimed_until_requeued(store, bus, outbox, clock, recorder):
    calls: list[Any] = []
    state = {"fail": True}

    def flaky(event, ctx):
        calls.append((event.id, "flaky", ctx.attempt))
        if state["fail"]:
            raise RuntimeError("down")

    bus.subscribe("t", ok(calls), name="fine")
    bus.subscribe("t", flaky, name="flaky")
    event_id = enqueue(store, outbox)
    poller = outbox.poller(max_retries=0)
    assert poller.run_once().dead_lettered == [event_id]
    clock.advance(DAY)
    assert store.claim(batch_size=10, lease=LEASE, now=clock.now()) == []
    assert not poller.run_once()
    assert outbox.requeue([event_id, 999]) == 1
    assert outbox.requeue([event_id]) == 0  # no longer dead
    r = row(store, event_id)
    assert (r.attempts, r.available_at, r.failed_at, r.locked_until) == (0, T0 + DAY, None, None)
    assert store.records(event_id) == [DeliveryRecord(event_id, "fine", Outcome.SUCCEEDED, 1, T0)]
    state["fail"] = False
    calls.clear()
    report = poller.run_once()
    assert report.published == [event_id]
    assert calls == [(event_id, "flaky", 1)]  # "fine" stays done
    assert recorder.events[-4:] == [
        Claimed(event_id, "t", 1),
        HandlerStarted(event_id, "t", "flaky", 1),
        HandlerSucceeded(event_id, "t", "flaky", 1),
        Published(event_id, "t", 1),
    ]
    assert row(store, event_id).published_at == T0 + DAY


# -- R13 lease ----------------------------------------------------------------------------------


def test_r13_event_of_a_dead_poller_is_due_once_the_lease_passes(store, bus, outbox, clock):
    calls: list[Any] = []
    bus.subscribe("t", ok(calls), name="h")
    event_id = enqueue(store, outbox)
    (dead_poller,) = store.claim(batch_size=1, lease=LEASE, now=T0)
    poller = outbox.poller()
    clock.advance(LEASE - US)
    assert not poller.run_once()
    clock.advance(US)
    report = poller.run_once()
    assert report.published == [event_id]
    assert calls == [(event_id, "h", 2)]
    # The dead poller's token changes nothing any more.
    assert not settle_one(store, dead_poller, Publish(), error=None, now=clock.now())
    assert store.extend([dead_poller], lease=LEASE, now=clock.now()) == []
    assert row(store, event_id).published_at == T0 + LEASE


def test_r13_long_batch_extends_the_leases_it_has_not_delivered(
    store, bus, outbox, clock, recorder
):
    seen: list[Any] = []

    def slow(event, ctx):
        # Non-transactional, so no row lock: only the lease keeps others off the batch.
        seen.append((event.id, clock.now(), [row(store, i).locked_until for i in (1, 2, 3)]))
        clock.advance(16)
        seen.append(store.claim(batch_size=10, lease=LEASE, now=clock.now()))

    bus.subscribe("t", slow, name="slow", transactional=False)
    ids = [enqueue(store, outbox) for _ in range(3)]
    report = outbox.poller(lease=LEASE).run_once()
    assert report.published == ids
    assert report.lease_lost == []
    assert seen == [
        (1, T0, [T0 + LEASE] * 3),
        [],
        # 14 s left (< half a lease): the batch was extended to now + lease, the delivered
        # event too (it waits for the round's settle).
        (2, T0 + s(16), [T0 + s(46)] * 3),
        [],  # at T0 + 32 the original lease (T0 + 30) would have let another poller in
        (3, T0 + s(32), [T0 + s(62)] * 3),
        [],
    ]
    # One settle for the round, when it ends.
    assert [row(store, i).published_at for i in ids] == [T0 + s(48)] * 3
    assert [store.get(i).attempts for i in ids] == [1, 1, 1]
    assert recorder.of(LeaseLost) == []


def test_r13_never_starts_a_handler_once_the_lease_is_gone(store, bus, outbox, clock, recorder):
    calls: list[Any] = []

    def handler(event, ctx):
        calls.append((event.id, ctx.attempt))
        if len(calls) == 1:
            clock.advance(LEASE + s(1))

    bus.subscribe("t", handler, name="h")
    e1 = enqueue(store, outbox)
    e2 = enqueue(store, outbox)
    poller = outbox.poller(lease=LEASE)
    report = poller.run_once()
    assert calls == [(e1, 1)]
    assert report.published == [e1]
    assert report.lease_lost == [e2]
    assert recorder.events == [
        Claimed(e1, "t", 1),
        Claimed(e2, "t", 1),
        HandlerStarted(e1, "t", "h", 1),
        HandlerSucceeded(e1, "t", "h", 1),
        LeaseLost(e2, "t", 1, None),
        Published(e1, "t", 1),  # the round's settle, once it ends
    ]
    r = row(store, e2)
    assert (r.attempts, r.locked_until, r.published_at) == (1, T0 + LEASE, None)
    assert store.records(e2) == []
    report = poller.run_once()  # the lease is gone: due again
    assert report.published == [e2]
    assert calls == [(e1, 1), (e2, 2)]


def test_r13_lease_gone_between_two_handlers_of_one_event(store, bus, outbox, clock, recorder):
    calls: list[Any] = []

    def first(event, ctx):
        calls.append(("first", ctx.attempt))
        clock.advance(LEASE)

    def second(event, ctx):
        calls.append(("second", ctx.attempt))

    bus.subscribe("t", first, name="first")
    bus.subscribe("t", second, name="second")
    event_id = enqueue(store, outbox)
    poller = outbox.poller(lease=LEASE)
    report = poller.run_once()
    assert calls == [("first", 1)]
    assert report.lease_lost == [event_id]
    assert report.published == report.retried == []
    assert recorder.of(LeaseLost) == [LeaseLost(event_id, "t", 1, None)]
    assert store.records(event_id) == [DeliveryRecord(event_id, "first", Outcome.SUCCEEDED, 1, T0)]
    report = poller.run_once()
    assert report.published == [event_id]
    assert calls == [("first", 1), ("second", 2)]


# -- R14 options --------------------------------------------------------------------------------


def test_r14_default_options(outbox):
    options = outbox.poller().options
    assert options.interval == s(0.5)
    assert options.batch_size == 100
    assert options.lease == s(30)
    assert options.max_retries == 10
    assert options.backoff == ExponentialBackoff()


BAD_OPTIONS = [
    ("batch_size", 0),
    ("batch_size", 1.5),
    ("batch_size", True),
    ("lease", 0),
    ("lease", -1),
    ("lease", float("nan")),
    ("interval", 0),
    ("interval", timedelta(0)),
    ("interval", "fast"),
    ("max_retries", -1),
    ("max_retries", 2.0),
    ("backoff", -1),
    ("backoff", "exponential"),
]


@pytest.mark.parametrize(("name", "value"), BAD_OPTIONS, ids=repr)
def test_r14_invalid_poller_option_raises_value_error_naming_it(outbox, name, value):
    with pytest.raises(ValueError, match=name):
        outbox.poller(**{name: value})


@pytest.mark.parametrize(("name", "value"), BAD_OPTIONS, ids=repr)
def test_r14_invalid_outbox_default_raises_value_error_naming_it(store, bus, clock, name, value):
    with pytest.raises(ValueError, match=name):
        Outbox(store, bus, clock=clock, **{name: value})


def test_r14_unknown_option_and_bad_backoff_bounds_are_named(outbox):
    with pytest.raises(ValueError, match="retries"):
        outbox.poller(retries=3)
    with pytest.raises(ValueError, match="base"):
        ExponentialBackoff(base=0)
    with pytest.raises(ValueError, match="max"):
        ExponentialBackoff(max=0)


def test_r14_poller_option_beats_outbox_default(store, bus, clock, recorder):
    outbox = make_outbox(
        store, bus, clock, recorder, max_retries=5, lease=10, batch_size=2, interval=1, backoff=7
    )
    defaults = outbox.poller().options
    assert (defaults.max_retries, defaults.lease, defaults.batch_size) == (5, s(10), 2)
    assert defaults.interval == s(1)
    assert defaults.backoff(1) == s(7)
    options = outbox.poller(max_retries=1, lease=timedelta(seconds=45), backoff=s(3)).options
    assert (options.max_retries, options.lease, options.batch_size) == (1, s(45), 2)
    assert options.interval == s(1)
    assert options.backoff(1) == s(3)
    assert outbox.poller(max_retries=None).options.max_retries == 5  # None keeps the default
    # Behaviour follows the options: the lease the store sets, the events a poll takes.
    for _ in range(3):
        enqueue(store, outbox)
    assert outbox.poller(batch_size=1, lease=45).run_once().claimed == [1]
    assert row(store, 1).published_at == T0
    assert outbox.poller().run_once().claimed == [2, 3]


# -- seed scenarios ------------------------------------------------------------------------------


def test_seed_succeeded_handler_not_rerun_when_a_later_handler_fails(store, bus, outbox, clock):
    calls: list[Any] = []
    state = {"fail": True}

    def later(event, ctx):
        calls.append(("later", ctx.attempt))
        if state["fail"]:
            raise RuntimeError("down")

    def earlier(event, ctx):
        calls.append(("earlier", ctx.attempt))
        ctx.connection.insert("effects", {"by": "earlier"})

    bus.subscribe("t", earlier, name="earlier")
    bus.subscribe("t", later, name="later")
    event_id = enqueue(store, outbox)
    poller = outbox.poller()
    assert poller.run_once().retried == [event_id]
    clock.advance(1)
    assert poller.run_once().retried == [event_id]
    state["fail"] = False
    clock.advance(2)
    assert poller.run_once().published == [event_id]
    assert calls == [("earlier", 1), ("later", 1), ("later", 2), ("later", 3)]
    assert store.rows("effects") == [{"by": "earlier"}]  # its write happened exactly once
    assert store.records(event_id) == [
        DeliveryRecord(event_id, "earlier", Outcome.SUCCEEDED, 1, T0),
        DeliveryRecord(event_id, "later", Outcome.SUCCEEDED, 3, T0 + s(3)),
    ]


def test_seed_crash_after_claim_leaves_event_claimable_after_the_lease(
    store, bus, outbox, clock, recorder
):
    calls: list[Any] = []
    bus.subscribe("t", ok(calls), name="h")
    event_id = enqueue(store, outbox)
    store.claim(batch_size=100, lease=LEASE, now=T0)  # a poller claims, then is never heard of
    assert store.get(event_id).attempts == 1
    poller = outbox.poller()
    clock.advance(LEASE - US)
    assert not poller.run_once()
    clock.advance(US)
    report = poller.run_once()
    assert report.claimed == [event_id]
    assert report.published == [event_id]
    assert calls == [(event_id, "h", 2)]  # the crashed attempt was used up
    assert store.get(event_id).attempts == 2
    assert recorder.events == [
        Claimed(event_id, "t", 2),
        HandlerStarted(event_id, "t", "h", 2),
        HandlerSucceeded(event_id, "t", "h", 2),
        Published(event_id, "t", 2),
    ]


def test_seed_poller_abandoned_mid_delivery_recovers_after_the_lease(
    store, bus, outbox, clock, recorder
):
    calls: list[Any] = []

    def handler(event, ctx):
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise SystemExit(1)

    bus.subscribe("t", handler, name="h")
    event_id = enqueue(store, outbox)
    poller = outbox.poller()
    with pytest.raises(SystemExit):
        poller.run_once()
    assert store.get(event_id).attempts == 1
    assert store.records(event_id) == []
    clock.advance(LEASE - US)
    assert not outbox.poller().run_once()
    clock.advance(US)
    assert outbox.poller().run_once().published == [event_id]
    assert calls == [1, 2]
    assert store.get(event_id).attempts == 2
    assert recorder.of(Claimed) == [Claimed(event_id, "t", 1), Claimed(event_id, "t", 2)]


def test_seed_max_retries_2_calls_an_always_failing_handler_3_times(store, bus, clock, recorder):
    calls: list[Any] = []
    bus.subscribe("t", failing(calls, RuntimeError("down")), name="h")
    outbox = make_outbox(store, bus, clock, recorder, max_retries=2)
    event_id = enqueue(store, outbox)
    poller = outbox.poller()
    gaps = retry_gaps(poller, store, clock, event_id)
    assert gaps == [s(1), s(2)]
    assert calls == [(event_id, 1), (event_id, 2), (event_id, 3)]
    assert [d.event.id for d in store.dead_letters()] == [event_id]
    assert recorder.of(DeadLettered) == [DeadLettered(event_id, "t", 3, "h: RuntimeError: down")]
    clock.advance(DAY)
    assert not poller.run_once()
    assert len(calls) == 3


def test_seed_default_backoff_gives_1_2_4_up_to_256_then_300(store, bus, outbox, clock):
    bus.subscribe("t", failing([], RuntimeError("down")), name="h")
    event_id = enqueue(store, outbox)
    gaps = retry_gaps(outbox.poller(max_retries=11), store, clock, event_id)
    assert gaps == [s(x) for x in (1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300)]


def test_seed_outbox_max_retries_is_overridden_by_the_poller_option(store, clock, recorder):
    bus = EventBus()
    calls: list[Any] = []
    bus.subscribe("t", failing(calls, RuntimeError("down")), name="h")
    outbox = make_outbox(store, bus, clock, recorder, max_retries=5)
    overridden = enqueue(store, outbox)
    retry_gaps(outbox.poller(max_retries=1), store, clock, overridden)
    assert calls == [(overridden, 1), (overridden, 2)]
    assert recorder.of(DeadLettered) == [DeadLettered(overridden, "t", 2, "h: RuntimeError: down")]
    calls.clear()
    by_default = enqueue(store, outbox)
    retry_gaps(outbox.poller(), store, clock, by_default)
    assert calls == [(by_default, n) for n in range(1, 7)]
    assert recorder.of(DeadLettered)[-1] == DeadLettered(
        by_default, "t", 6, "h: RuntimeError: down"
    )
