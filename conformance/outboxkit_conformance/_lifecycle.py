"""Lifecycle checks: rules R1-R14 end to end through ``Outbox`` and ``Poller`` on the store.

A handler's "write in the store's database" is a follow-up event (``ctx.enqueue``): it is the one
write every store can make inside a delivery transaction, so exactly-once is checked with it.

Every check runs in every delivery mode of the ``outbox`` fixture of ``ConformanceBase`` (see
``_modes``): the blocking poller ``[per_event]`` and ``[per_batch]``, and the asyncio poller
``[asyncio]``, ``[asyncio-per_batch]`` and ``[asyncio-x4]``, the modes a store cannot deliver in
(no ``batches``, no ``asyncio``) skipped with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest

from outboxkit import (
    DeadLettered,
    Event,
    EventBus,
    FrozenClock,
    HandlerFailed,
    HandlerRejected,
    LeaseLost,
    Outbox,
    Outcome,
    Published,
    Reject,
    RelayError,
    RetryScheduled,
    State,
    Store,
    Unrouted,
)
from outboxkit.testing.recorder import Recorder

from ._base import ConformanceBase, S

__all__ = ["LifecycleTests"]


class LifecycleTests(ConformanceBase):
    """The rules end to end: an ``Outbox`` and its ``Poller`` on the store, in both modes."""

    def enqueue(self, store: Store, outbox: Outbox, topic: str, payload: Any, **kw: Any) -> int:
        with store.transaction() as conn:
            return outbox.enqueue(conn, topic, payload, **kw)

    def follow_ups(self, store: Store, clock: FrozenClock, topic: str) -> int:
        return store.stats(now=clock.now()).by_topic.get(topic, {}).get("pending", 0)

    def test_r1_event_exists_iff_the_transaction_commits(
        self, store: Store, outbox: Outbox, clock: FrozenClock
    ) -> None:
        with pytest.raises(RuntimeError), store.transaction() as conn:
            outbox.enqueue(conn, "t", {"n": 1})
            raise RuntimeError("app failed after enqueue")
        assert store.stats(now=clock.now()).total == 0
        with store.transaction() as conn:
            outbox.enqueue_many(conn, [("t", 1), ("t", 2)])
        assert store.stats(now=clock.now()).pending == 2

    def test_r5_handlers_run_in_order_and_recorded_ones_are_skipped(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        calls: list[tuple[str, int]] = []

        def make(name: str, fail_until: int) -> None:
            def handler(event: Event, ctx: Any) -> None:
                calls.append((name, ctx.attempt))
                if ctx.attempt < fail_until:
                    raise RuntimeError(f"{name} not yet")

            bus.subscribe("t", handler, name=name)

        make("first", 0)
        make("second", 2)  # fails on attempt 1 only
        make("third", 0)
        event_id = self.enqueue(store, outbox, "t", {})
        poller = outbox.poller()
        report = poller.run_once()
        assert report.retried == [event_id]
        assert calls == [("first", 1), ("second", 1), ("third", 1)]
        clock.advance(1)
        report = poller.run_once()
        assert report.published == [event_id]
        assert calls[3:] == [("second", 2)]  # first and third recorded: not re-run
        assert {r.handler: r.attempt for r in store.records(event_id)} == {
            "first": 1,
            "third": 1,
            "second": 2,
        }

    def test_r6_transactional_handler_writes_exactly_once(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        @bus.handler("order", name="ledger")
        def ledger(event: Event, ctx: Any) -> None:
            ctx.enqueue("ledger.row", {"order": event.payload["id"]})

        @bus.handler("order", name="flaky")
        def flaky(event: Event, ctx: Any) -> None:
            if ctx.attempt < 3:
                raise RuntimeError("flaky")

        self.enqueue(store, outbox, "order", {"id": 7})
        self.drain(outbox, clock)
        assert (
            self.follow_ups(store, clock, "ledger.row")
            + store.stats(now=clock.now()).by_topic.get("ledger.row", {}).get("published", 0)
            == 1
        )

    def test_r6_reject_rolls_back_and_is_never_retried(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock, recorder: Recorder
    ) -> None:
        calls = []

        @bus.handler("t", name="picky")
        def picky(event: Event, ctx: Any) -> None:
            calls.append(ctx.attempt)
            ctx.enqueue("side.effect", {})
            raise Reject("not today")

        event_id = self.enqueue(store, outbox, "t", {})
        report = outbox.poller().run_once()
        assert report.published == [event_id]
        assert [d.outcome for d in report.deliveries] == [Outcome.REJECTED]
        (record,) = store.records(event_id)
        assert (record.handler, record.outcome, record.reason) == (
            "picky",
            Outcome.REJECTED,
            "not today",
        )
        assert "side.effect" not in store.stats(now=clock.now()).by_topic  # rolled back
        assert [e.reason for e in recorder.of(HandlerRejected)] == ["not today"]
        clock.advance(timedelta(days=1))
        assert outbox.poller().run_once().claimed == []
        assert calls == [1]

    def test_r6_failure_rolls_back_and_records_nothing(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock, recorder: Recorder
    ) -> None:
        @bus.handler("t", name="broken")
        def broken(event: Event, ctx: Any) -> None:
            ctx.enqueue("side.effect", {})
            raise ValueError("bad data")

        event_id = self.enqueue(store, outbox, "t", {})
        report = outbox.poller().run_once()
        assert report.retried == [event_id]
        assert store.records(event_id) == []
        assert "side.effect" not in store.stats(now=clock.now()).by_topic
        (failed,) = recorder.of(HandlerFailed)
        assert failed.error == "ValueError: bad data"
        (retry,) = recorder.of(RetryScheduled)
        assert retry.delay == S and retry.error == "broken: ValueError: bad data"

    def test_r6_base_exception_rolls_back_and_reraises(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        interrupt = [True]

        @bus.handler("t", name="h")
        def handler(event: Event, ctx: Any) -> None:
            ctx.enqueue("side.effect", {})
            if interrupt[0]:
                raise KeyboardInterrupt

        first = self.enqueue(store, outbox, "t", {"n": 1})
        second = self.enqueue(store, outbox, "t", {"n": 2})
        with pytest.raises(KeyboardInterrupt):
            outbox.poller(lease=30).run_once()
        assert store.records(first) == []
        assert "side.effect" not in store.stats(now=clock.now()).by_topic
        interrupt[0] = False
        if self.concurrency(outbox) == 1:
            # The unstarted event was released at once; the interrupted one waits for its lease.
            assert outbox.poller().run_once().published == [second]
        # (Delivered at once, the second event may have been in hand too: it waits as well.)
        clock.advance(30)
        report = outbox.poller().run_once()
        assert report.claimed[0] == first  # then the follow-ups the deliveries enqueued
        assert first in report.published
        assert store.get(first).attempts == 2  # type: ignore[union-attr]
        assert store.get(second).published_at is not None  # type: ignore[union-attr]

    def test_r7_non_transactional_handler(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        seen: list[Any] = []

        @bus.handler("t", name="mailer", transactional=False)
        def mailer(event: Event, ctx: Any) -> None:
            seen.append(ctx.connection)
            ctx.enqueue("mail.sent", {"to": event.payload["to"]})

        event_id = self.enqueue(store, outbox, "t", {"to": "a@example.com"})
        assert outbox.poller().run_once().published == [event_id]
        assert seen == [None]
        (record,) = store.records(event_id)
        assert record.outcome is Outcome.SUCCEEDED
        assert self.follow_ups(store, clock, "mail.sent") == 1

    def test_r7_a_relay_publishes_a_batch_once_and_records_each_confirm(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        """A relay gets the batch's events together (in every mode, ``concurrency`` too: one
        publish per batch); each confirmed event is recorded once (the store's ``record_many``
        where it has one), an unconfirmed one is retried alone."""
        relay = _Relay(refuse_once={"r.third"})
        bus.relay(relay, topics=["r.*"], name="relay")
        topics = ["r.first", "r.second", "r.third", "r.fourth"]
        ids = [self.enqueue(store, outbox, topic, {"n": n}) for n, topic in enumerate(topics)]
        report = outbox.poller(batch_size=10).run_once()
        assert relay.calls == [topics]
        assert sorted(report.published) == sorted([ids[0], ids[1], ids[3]])
        assert report.retried == [ids[2]]
        for event_id in (ids[0], ids[1], ids[3]):
            (record,) = store.records(event_id)
            assert (record.handler, record.outcome, record.attempt) == (
                "relay",
                Outcome.SUCCEEDED,
                1,
            )
        assert store.records(ids[2]) == []
        failed = store.get(ids[2])
        assert failed is not None and failed.last_error is not None
        assert "refused r.third" in failed.last_error
        clock.advance(60)
        assert outbox.poller(batch_size=10).run_once().published == [ids[2]]
        assert relay.calls == [topics, ["r.third"]]
        assert [r.attempt for r in store.records(ids[2])] == [2]

    def test_r8_r11_dead_letter_after_max_retries(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock, recorder: Recorder
    ) -> None:
        calls = []

        @bus.handler("t", name="always-fails")
        def always_fails(event: Event, ctx: Any) -> None:
            calls.append(clock.now())
            raise RuntimeError("down")

        event_id = self.enqueue(store, outbox, "t", {})
        poller = outbox.poller(max_retries=2)
        for _ in range(10):
            poller.run_once()
            clock.advance(1)
        assert len(calls) == 3
        assert [b - a for a, b in itertools.pairwise(calls)] == [S, 2 * S]
        (dead,) = store.dead_letters()
        assert dead.event.id == event_id and dead.event.attempts == 3
        assert dead.last_error == "always-fails: RuntimeError: down"
        (event,) = recorder.of(DeadLettered)
        assert (event.event_id, event.attempt) == (event_id, 3)

    def test_r9_unrouted_topic_is_published(
        self, store: Store, outbox: Outbox, clock: FrozenClock, recorder: Recorder
    ) -> None:
        event_id = self.enqueue(store, outbox, "nobody.listens", {})
        assert outbox.poller().run_once().published == [event_id]
        assert [e.event_id for e in recorder.of(Unrouted)] == [event_id]
        assert [e.event_id for e in recorder.of(Published)] == [event_id]

    def test_r10_backoff_schedule(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        bus.subscribe("t", _fail, name="fails")
        event_id = self.enqueue(store, outbox, "t", {})
        poller = outbox.poller(max_retries=4, backoff=lambda n: 10 * n)
        gaps = []
        for _ in range(4):
            settled_at = clock.now()
            poller.run_once()
            event = store.get(event_id)
            assert event is not None and event.available_at is not None
            gaps.append(event.available_at - settled_at)
            clock.set(event.available_at)
        assert gaps == [10 * S, 20 * S, 30 * S, 40 * S]

    def test_r12_requeue_keeps_recorded_handlers_done(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        calls: list[str] = []
        broken = [True]

        @bus.handler("t", name="ok")
        def ok(event: Event, ctx: Any) -> None:
            calls.append("ok")

        @bus.handler("t", name="fixed-later")
        def fixed_later(event: Event, ctx: Any) -> None:
            calls.append("fixed-later")
            if broken[0]:
                raise RuntimeError("bug")

        event_id = self.enqueue(store, outbox, "t", {})
        outbox.poller(max_retries=0).run_once()
        assert [d.event.id for d in outbox.dead_letters()] == [event_id]
        clock.advance(timedelta(days=1))
        assert outbox.poller().run_once().claimed == []  # dead: never claimed
        broken[0] = False
        assert outbox.requeue([event_id]) == 1
        assert outbox.poller().run_once().published == [event_id]
        assert calls == ["ok", "fixed-later", "fixed-later"]

    def test_r13_lease_lost_mid_batch_fences_the_zombie(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock, recorder: Recorder
    ) -> None:
        if outbox.options.transaction == "per_batch":
            # The second poller claims while the first one's batch is open.
            self.require(store, "concurrent_batches")
        calls: list[int] = []
        # Delivered one after the other, the zombie never starts the second event; delivered at
        # once, both would be in hand from the start: there, one event shows the fencing.
        sequential = self.concurrency(outbox) == 1
        ids: list[int] = []

        @bus.handler("t", name="slow", transactional=False)
        def slow(event: Event, ctx: Any) -> None:
            calls.append(event.id)
            if len(calls) == 1:
                # A pause longer than the lease: another poller takes the events over.
                clock.advance(31)
                other = outbox.poller().run_once()
                assert other.published == ids

        ids.extend(
            self.enqueue(store, outbox, "t", {"n": n}) for n in range(2 if sequential else 1)
        )
        report = outbox.poller(lease=30).run_once()
        # The zombie's record for the first event is fenced, and it never starts the second.
        assert report.lease_lost == ids
        assert report.published == []
        assert calls == [ids[0], *ids]  # the outside effect ran twice: a lost lease
        assert len(recorder.of(LeaseLost)) == len(ids)
        for event_id in ids:
            assert [r.attempt for r in store.records(event_id)] == [2]
        assert store.stats(now=clock.now()).published == len(ids)

    def test_r3_prefetch_claims_ahead_and_delivers_each_event_once(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        """``prefetch=True``: the next batch is claimed while one is delivered, on a store where
        others may claim meanwhile. Every event still runs once and is recorded once at attempt
        1, and the follow-ups the batches in hand enqueue are delivered too (an empty claim made
        ahead is not the end of the work)."""
        self.require(store, "concurrent_claimers")
        self.require(store, "concurrent_batches")
        seen: list[int] = []

        @bus.handler("t", name="orders", transactional=False)
        def orders(event: Event, ctx: Any) -> None:
            seen.append(event.id)
            ctx.enqueue("f", {"of": event.id})

        @bus.handler("f", name="follow-ups", transactional=False)
        def follow_ups(event: Event, ctx: Any) -> None:
            seen.append(event.id)

        ids = [self.enqueue(store, outbox, "t", {"n": n}) for n in range(7)]
        outbox.poller(batch_size=3, prefetch=True).run_until_idle()
        assert len(seen) == 14 and len(set(seen)) == 14
        assert set(ids) <= set(seen)
        for event_id in seen:
            assert [r.attempt for r in store.records(event_id)] == [1]
        stats = store.stats(now=clock.now())
        assert (stats.published, stats.pending, stats.claimed) == (14, 0, 0)

    def test_r3_a_stopping_poller_releases_what_it_prefetched(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        """Stopped in its first batch, a prefetching poller hands the batch it claimed ahead
        back with the rest: no lease left, the attempt refunded."""
        self.require(store, "concurrent_claimers")
        self.require(store, "concurrent_batches")
        seen: list[int] = []
        poller: Any = None

        @bus.handler("t", name="stops", transactional=False)
        def stops(event: Event, ctx: Any) -> None:
            seen.append(event.id)
            poller.stop()

        ids = [self.enqueue(store, outbox, "t", {"n": n}) for n in range(6)]
        poller = outbox.poller(batch_size=3, prefetch=True)
        poller.run_until_idle()
        assert seen and set(seen) <= set(ids[:3])  # only the first batch ever ran
        for event_id in ids[3:]:  # the batch claimed ahead
            event = store.get(event_id)
            assert event is not None
            assert (event.attempts, event.locked_until, event.state) == (0, None, State.PENDING)
        assert store.stats(now=clock.now()).published == len(seen)

    def test_r13_long_batch_extends_its_leases(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        @bus.handler("t", name="slowish")
        def slowish(event: Event, ctx: Any) -> None:
            clock.advance(8)  # three of these outlast one 20 s lease

        ids = [self.enqueue(store, outbox, "t", {"n": n}) for n in range(4)]
        report = outbox.poller(lease=20).run_once()
        assert report.published == ids
        assert report.lease_lost == []
        assert all(store.get(i).attempts == 1 for i in ids)  # type: ignore[union-attr]

    def test_one_events_failure_or_rejection_rolls_back_only_its_own_writes(
        self, store: Store, outbox: Outbox, bus: EventBus, clock: FrozenClock
    ) -> None:
        @bus.handler("t", name="h")
        def handler(event: Event, ctx: Any) -> None:
            ctx.enqueue("written", {"by": event.payload["n"]})
            if event.payload["n"] == 2:
                raise RuntimeError("two fails")
            if event.payload["n"] == 3:
                raise Reject("three is refused")

        ids = [self.enqueue(store, outbox, "t", {"n": n}) for n in (1, 2, 3, 4)]
        report = outbox.poller(max_retries=1, backoff=5).run_once()
        assert report.published == [ids[0], ids[2], ids[3]]
        assert report.retried == [ids[1]]
        # Sorted: at concurrency > 1 the deliveries of 1 and 4 commit in either order.
        written = sorted(e.payload["by"] for e in store.events(topic="written"))
        assert written == [1, 4], written
        assert [r.outcome for r in store.records(ids[2])] == [Outcome.REJECTED]
        assert store.records(ids[1]) == []
        clock.advance(5)
        assert outbox.poller().run_once().dead_lettered == []
        assert sorted(e.payload["by"] for e in store.events(topic="written")) == [1, 4]


def _fail(event: Event, ctx: Any) -> None:
    raise RuntimeError("always")


class _Relay:
    """A relay that confirms every event but those of ``refuse_once``'s topics the first time,
    and notes each publish's topics."""

    def __init__(self, refuse_once: set[str]) -> None:
        self.refuse_once = set(refuse_once)
        self.calls: list[list[str]] = []

    def publish_blocking(self, events: Sequence[Event]) -> list[Exception | None]:
        self.calls.append([e.topic for e in events])
        answers: list[Exception | None] = []
        for event in events:
            if event.topic in self.refuse_once:
                self.refuse_once.discard(event.topic)
                answers.append(RelayError(f"refused {event.topic}"))
            else:
                answers.append(None)
        return answers

    async def publish(self, events: Sequence[Event]) -> list[Exception | None]:
        answers = self.publish_blocking(events)
        # A broker's confirms take a round trip: the poller's other workers run meanwhile.
        for _ in range(10):
            await asyncio.sleep(0)
        return answers
