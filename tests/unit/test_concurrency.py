"""Pollers in threads, and the ``run_forever`` / ``stop`` loop, on the memory store.

Nothing here sleeps. Threads are joined with a timeout; the loop waits through a fake waiter that
moves a ``FrozenClock`` instead of sleeping.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest

from outboxkit import (
    Claim,
    Event,
    EventBus,
    FrozenClock,
    MemoryStore,
    Outbox,
    Outcome,
    Poller,
    PollReport,
    Published,
    SchemaError,
    StoreUnavailable,
    ThreadWaiter,
)
from outboxkit.core.model import DeadKey
from outboxkit.store import SettleItem
from outboxkit.testing import Recorder

JOIN_TIMEOUT = 60.0


def _run_in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _enqueue(store: MemoryStore, outbox: Outbox, topic: str, count: int) -> list[int]:
    with store.transaction() as tx:
        return [outbox.enqueue(tx, topic, {"n": n}) for n in range(count)]


# -- two pollers, two threads, one store -----------------------------------------------------------


class LoggingStore(MemoryStore):
    """Logs claims and settlements without taking the store's lock (so it cannot mask a race).

    A claim is logged after it returns and a settlement just before it is made: so for any one
    event the log order is the true order, and an event logged as claimed twice without a
    settlement in between was held by two claims at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int, str]] = []  # (what, event id, token)

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        claims = super().claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)
        self.log.extend(("claim", c.event.id, c.token) for c in claims)
        return claims

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        self.log.extend(("settle", claim.event.id, claim.token) for claim, _, _ in items)
        settled = super().settle_many(items, now=now)
        self.log.extend(
            ("stale settle", claim.event.id, claim.token)
            for (claim, _, _), ok in zip(items, settled, strict=True)
            if not ok
        )
        return settled

    def release(self, claims: Any, *, now: datetime | None) -> int:
        self.log.extend(("release", c.event.id, c.token) for c in claims)
        return super().release(claims, now=now)


def test_two_pollers_in_two_threads_never_hold_the_same_event_at_once() -> None:
    total = 1000
    clock = FrozenClock("2030-01-01T00:00:00Z")  # never moves: no lease can run out
    store = LoggingStore()
    bus = EventBus()
    lock = threading.Lock()
    calls: Counter[tuple[int, str]] = Counter()
    # Each thread waits here inside its first handler, so both hold claims at the same time.
    both_busy = threading.Barrier(2, timeout=JOIN_TIMEOUT)
    local = threading.local()

    def first(event: Event, ctx: Any) -> None:
        if not getattr(local, "met", False):
            local.met = True
            both_busy.wait()
        with lock:
            calls[(event.id, "first")] += 1
        ctx.connection.insert("effects", {"event": event.id, "handler": "first"})

    def second(event: Event, ctx: Any) -> None:
        with lock:
            calls[(event.id, "second")] += 1
            n = calls[(event.id, "second")]
        if event.id % 7 == 0 and n == 1:
            raise RuntimeError("first attempt fails")  # retried at once (backoff 0)
        ctx.connection.insert("effects", {"event": event.id, "handler": "second"})

    bus.subscribe("t", first, name="first")
    bus.subscribe("t", second, name="second")
    recorders = [Recorder(), Recorder()]
    outboxes = [
        Outbox(store, bus, clock=clock, backoff=0.0, plugins=[r], load_entry_points=False)
        for r in recorders
    ]
    ids = _enqueue(store, outboxes[0], "t", total)
    reports: list[list[PollReport]] = [[], []]

    def work(poller: Poller, out: list[PollReport]) -> None:
        for _ in range(20 * total):  # a bound, far above the rounds needed
            report = poller.run_once()
            out.append(report)
            if not report.claimed and store.stats(now=clock.now()).published == total:
                return

    threads = [
        _run_in_thread(lambda o=o, out=out: work(o.poller(batch_size=7), out))
        for o, out in zip(outboxes, reports, strict=True)
    ]
    for thread, _ in threads:
        thread.join(JOIN_TIMEOUT)
    assert not any(thread.is_alive() for thread, _ in threads)
    assert [errors for _, errors in threads] == [[], []]
    assert not both_busy.broken

    # Both pollers did work, and no event was ever held under two tokens at once.
    claimed = [[eid for r in rs for eid in r.claimed] for rs in reports]
    assert all(claimed), "each poller claimed events"
    holder: dict[int, str] = {}
    for what, eid, token in store.log:
        if what == "claim":
            assert eid not in holder, f"event {eid} claimed while {holder.get(eid)} held it"
            holder[eid] = token
        else:
            assert holder.pop(eid) == token
    assert holder == {}
    assert Counter(what for what, _, _ in store.log) == {
        "claim": total + total // 7,
        "settle": total + total // 7,
    }
    claims = [(eid, token) for what, eid, token in store.log if what == "claim"]
    assert len(set(claims)) == len(claims)
    assert len({token for _, token in claims}) == len(claims)

    # Each event published exactly once; each handler recorded (and its writes made) exactly once.
    stats = store.stats(now=clock.now())
    assert (stats.published, stats.pending, stats.claimed, stats.dead) == (total, 0, 0, 0)
    published = Counter(e.event_id for r in recorders for e in r.of(Published))
    assert published == Counter(ids)
    assert sorted(eid for rs in reports for r in rs for eid in r.published) == ids
    for eid in ids:
        records = store.records(eid)
        assert [(r.handler, r.outcome) for r in records] == [
            ("first", Outcome.SUCCEEDED),
            ("second", Outcome.SUCCEEDED),
        ]
    effects = Counter((row["event"], row["handler"]) for row in store.rows("effects"))
    assert effects == Counter({(eid, h): 1 for eid in ids for h in ("first", "second")})
    assert calls == Counter(
        {(eid, "first"): 1 for eid in ids}
        | {(eid, "second"): 2 if eid % 7 == 0 else 1 for eid in ids}
    )


# -- run_forever / stop ----------------------------------------------------------------------------


class ClockWaiter:
    """A waiter that advances the frozen clock instead of sleeping.

    It stops its poller after ``stop_after`` waits (or when ``until()`` is true), and raises if
    the loop waits far more often than that, so a broken loop cannot run for ever.
    """

    def __init__(
        self,
        clock: FrozenClock,
        *,
        stop_after: int = 1000,
        until: Callable[[], bool] = lambda: False,
        on_wait: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.clock = clock
        self.stop_after = stop_after
        self.until = until
        self.on_wait = on_wait
        self.poller: Poller | None = None
        self.waits: list[float] = []
        self.wakes = 0

    def wait(self, timeout: float) -> None:
        assert self.poller is not None
        self.waits.append(timeout)
        if len(self.waits) > self.stop_after + 100:
            raise AssertionError("the poller kept waiting after it was stopped")
        self.on_wait(len(self.waits))
        self.clock.advance(timeout)
        if len(self.waits) >= self.stop_after or self.until():
            self.poller.stop()

    def wake(self) -> None:
        self.wakes += 1


def _loop(outbox: Outbox, waiter: ClockWaiter, **options: Any) -> Poller:
    poller = outbox.poller(waiter=waiter, **options)
    waiter.poller = poller
    return poller


def _run_forever(poller: Poller) -> list[BaseException]:
    thread, errors = _run_in_thread(poller.run_forever)
    thread.join(JOIN_TIMEOUT)
    if thread.is_alive():
        poller.stop()
        thread.join(JOIN_TIMEOUT)
        pytest.fail("run_forever did not return")
    return errors


def test_run_forever_drains_waits_out_a_retry_and_returns_on_stop(
    store: MemoryStore, bus: EventBus, clock: FrozenClock, recorder: Recorder
) -> None:
    calls: list[tuple[int, int, float]] = []  # (event, attempt, seconds since the start)
    start = clock.now()

    @bus.handler("t", name="flaky")
    def flaky(event: Event, ctx: Any) -> None:
        calls.append((event.id, ctx.attempt, (clock.now() - start).total_seconds()))
        if event.id == 1 and ctx.attempt == 1:
            raise RuntimeError("try again")

    outbox = Outbox(store, bus, clock=clock, plugins=[recorder], load_entry_points=False)
    ids = _enqueue(store, outbox, "t", 5)
    waiter = ClockWaiter(clock, until=lambda: store.stats(now=clock.now()).published == len(ids))
    poller = _loop(outbox, waiter, batch_size=2, interval=1.0, backoff=2.0)

    assert _run_forever(poller) == []

    # Full batches are followed at once by the next poll; an idle poll waits one interval,
    # on the frozen clock, until the retry of event 1 is due 2 s later.
    assert calls == [(1, 1, 0.0), (2, 1, 0.0), (3, 1, 0.0), (4, 1, 0.0), (5, 1, 0.0), (1, 2, 2.0)]
    assert waiter.waits == [1.0, 1.0, 1.0]
    assert clock.now() == start + timedelta(seconds=3)
    assert [e.event_id for e in recorder.of(Published)] == [2, 3, 4, 5, 1]
    stats = store.stats(now=clock.now())
    assert (stats.published, stats.pending, stats.claimed) == (len(ids), 0, 0)
    assert poller.stopping


def test_stop_mid_batch_finishes_the_event_in_hand_and_releases_the_rest(
    store: MemoryStore, bus: EventBus, clock: FrozenClock
) -> None:
    calls: list[tuple[int, str]] = []
    pollers: list[Poller] = []

    @bus.handler("t", name="first")
    def first(event: Event, ctx: Any) -> None:
        calls.append((event.id, "first"))
        if event.id == 1:
            pollers[0].stop()

    @bus.handler("t", name="second")
    def second(event: Event, ctx: Any) -> None:
        calls.append((event.id, "second"))

    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    ids = _enqueue(store, outbox, "t", 3)
    pollers.append(outbox.poller(batch_size=3, lease=30.0))

    report = pollers[0].run_once()

    assert report.claimed == ids
    assert calls == [(1, "first"), (1, "second")]  # the event in hand is finished
    assert report.published == [1]
    assert report.released == [2, 3]
    for eid in (2, 3):
        event = store.get(eid)
        assert event is not None
        assert event.attempts == 0  # the attempt is refunded
        assert store.records(eid) == []
    # Claimable at once, without moving the clock past the lease.
    again = store.claim(batch_size=10, lease=timedelta(seconds=30), now=clock.now())
    assert [(c.event.id, c.attempt) for c in again] == [(2, 1), (3, 1)]


def test_stop_mid_batch_in_run_forever_returns_without_waiting(
    store: MemoryStore, bus: EventBus, clock: FrozenClock
) -> None:
    calls: list[int] = []
    waiter = ClockWaiter(clock)

    @bus.handler("t", name="h")
    def handle(event: Event, ctx: Any) -> None:
        calls.append(event.id)
        if event.id == 2:
            assert waiter.poller is not None
            waiter.poller.stop()

    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    _enqueue(store, outbox, "t", 4)
    poller = _loop(outbox, waiter, batch_size=10, interval=5.0)

    assert _run_forever(poller) == []

    assert calls == [1, 2]
    assert waiter.waits == []
    assert waiter.wakes == 1  # stop() nudged the waiter
    stats = store.stats(now=clock.now())
    assert (stats.published, stats.pending, stats.claimed) == (2, 2, 0)
    again = store.claim(batch_size=10, lease=timedelta(seconds=30), now=clock.now())
    assert [(c.event.id, c.attempt) for c in again] == [(3, 1), (4, 1)]


def test_an_in_process_enqueue_wakes_the_waiting_poller(
    store: MemoryStore, bus: EventBus, clock: FrozenClock
) -> None:
    delivered: list[int] = []
    bus.subscribe("t", lambda event, ctx: delivered.append(event.id), name="h")
    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    wakes_at_enqueue: list[int] = []

    def enqueue_on_first_wait(n: int) -> None:
        if n == 1:
            before = waiter.wakes
            _enqueue(store, outbox, "t", 1)
            wakes_at_enqueue.append(waiter.wakes - before)

    waiter = ClockWaiter(clock, stop_after=2, on_wait=enqueue_on_first_wait)
    poller = _loop(outbox, waiter, interval=60.0)

    assert _run_forever(poller) == []

    assert wakes_at_enqueue == [1]  # Outbox.enqueue -> waiter.wake
    assert delivered == [1]
    # Once the loop has returned, its waiter is no longer nudged.
    wakes = waiter.wakes
    _enqueue(store, outbox, "t", 1)
    assert waiter.wakes == wakes


def test_thread_waiter_returns_early_when_woken(
    store: MemoryStore, bus: EventBus, clock: FrozenClock
) -> None:
    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    waiter = ThreadWaiter()
    outbox.add_waiter(waiter)
    thread, errors = _run_in_thread(lambda: waiter.wait(3600))
    _enqueue(store, outbox, "t", 1)  # the enqueue nudges every registered waiter
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive()
    assert errors == []


class FailingClaims:
    """Wraps a store; its ``claim`` raises the given errors, one per call, then works."""

    def __init__(self, inner: MemoryStore, errors: list[Exception]) -> None:
        self._inner = inner
        self._errors = list(errors)
        self.claim_calls = 0

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        self.claim_calls += 1
        if self._errors:
            raise self._errors.pop(0)
        return self._inner.claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_run_forever_survives_a_store_outage_and_logs_it_once(
    store: MemoryStore, bus: EventBus, clock: FrozenClock, caplog: pytest.LogCaptureFixture
) -> None:
    delivered: list[int] = []
    bus.subscribe("t", lambda event, ctx: delivered.append(event.id), name="h")
    flaky = FailingClaims(store, [StoreUnavailable("database is down")] * 3)
    outbox = Outbox(flaky, bus, clock=clock, load_entry_points=False)
    _enqueue(store, outbox, "t", 2)
    waiter = ClockWaiter(clock, until=lambda: store.stats(now=clock.now()).published == 2)
    poller = _loop(outbox, waiter, interval=1.0, batch_size=10)

    with caplog.at_level(logging.INFO, logger="outboxkit"):
        assert _run_forever(poller) == []

    assert delivered == [1, 2]
    assert flaky.claim_calls == 4
    assert waiter.waits == [2.0, 4.0, 8.0, 1.0]  # backoff through the outage, then the interval
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "store unavailable, retrying with backoff: database is down"
    ]
    recovered = [r for r in caplog.records if "available again" in r.getMessage()]
    assert len(recovered) == 1
    assert "3 failed poll(s)" in recovered[0].getMessage()


def test_run_forever_raises_a_schema_error_at_once(
    store: MemoryStore, bus: EventBus, clock: FrozenClock
) -> None:
    broken = FailingClaims(store, [SchemaError("schema version 99 is newer than this code")])
    outbox = Outbox(broken, bus, clock=clock, load_entry_points=False)
    waiter = ClockWaiter(clock)
    poller = _loop(outbox, waiter)

    errors = _run_forever(poller)

    assert [type(e) for e in errors] == [SchemaError]
    assert broken.claim_calls == 1
    assert waiter.waits == []
    # The loop is gone: its waiter is no longer registered for in-process nudges.
    outbox.wake()
    assert waiter.wakes == 0
