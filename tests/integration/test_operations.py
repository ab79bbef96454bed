"""Retention and dead-letter operations on ``Outbox``, on the memory, SQLite and Postgres stores.

The pruner deletes only published events past the cut-off, in pages,
and leaves dead letters and pending events alone.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import (
    ConfigurationError,
    EventBus,
    FrozenClock,
    Outbox,
    State,
    Store,
    StoreUnavailable,
)
from outboxkit.outbox import DEFAULT_RETAIN_PUBLISHED, PRUNE_EVERY, PURGE_PAGE_SIZE
from tests.backends import ALL_BACKENDS, migrated_store

START = datetime(2030, 6, 1, tzinfo=UTC)


@pytest.fixture(params=ALL_BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    with migrated_store(request.param, tmp_path) as opened:
        yield opened


def make_bus() -> EventBus:
    bus = EventBus()

    @bus.handler("order.placed", name="ship")
    def ship(event: Any, ctx: Any) -> None:
        if event.payload.get("fail"):
            raise RuntimeError("no truck")

    return bus


class Calls:
    """Wraps a store method, keeping each call's keyword arguments and result."""

    def __init__(self, method: Callable[..., int]) -> None:
        self.method = method
        self.calls: list[tuple[dict[str, Any], int]] = []

    def __call__(self, **kwargs: Any) -> int:
        result = self.method(**kwargs)
        self.calls.append((kwargs, result))
        return result


def enqueue(outbox: Outbox, *payloads: dict[str, Any]) -> list[int]:
    with outbox.store.transaction() as conn:
        return [outbox.enqueue(conn, "order.placed", p) for p in payloads]


def seed(store: Store, clock: FrozenClock, outbox: Outbox) -> dict[str, list[int]]:
    """At START - 30 d: a dead letter and a pending event that was never polled; at START - 10 d:
    seven published events; at START - 1 d: two more published. The clock ends at START."""
    clock.set(START - timedelta(days=30))
    dead = enqueue(outbox, {"fail": True})
    assert outbox.poller(max_retries=0).run_once().dead_lettered == dead
    pending = enqueue(outbox, {}, {})  # enqueued at the same instant, never polled
    clock.set(START - timedelta(days=10))
    old = enqueue(outbox, *[{"n": n} for n in range(7)])
    # Claim only the seven (batch ordering is by available_at: the pending pair is older).
    claims = store.claim(batch_size=100, lease=timedelta(minutes=1), now=clock.now())
    store.release([c for c in claims if c.event.id not in old], now=clock.now())
    outbox.poller().process([c for c in claims if c.event.id in old], claimed_at=clock.now())
    clock.set(START - timedelta(days=1))
    recent = enqueue(outbox, {"n": 7}, {"n": 8})
    claims = store.claim(batch_size=100, lease=timedelta(minutes=1), now=clock.now())
    store.release([c for c in claims if c.event.id not in recent], now=clock.now())
    outbox.poller().process([c for c in claims if c.event.id in recent], claimed_at=clock.now())
    clock.set(START)
    return {"dead": dead, "pending": pending, "old": old, "recent": recent}


def test_the_pruner_deletes_only_published_events_past_the_cutoff_in_pages(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FrozenClock(START)
    outbox = Outbox(store, make_bus(), clock=clock, retain_published=timedelta(days=7))
    ids = seed(store, clock, outbox)
    assert store.stats(now=clock.now()).published == 9

    spy = Calls(store.purge_published)
    monkeypatch.setattr(store, "purge_published", spy)
    assert outbox.prune(page_size=3) == 7
    # Pages of at most 3 rows, until a page comes back empty; the cut-off is START - 7 d.
    assert [(kw["limit"], n) for kw, n in spy.calls] == [(3, 3), (3, 3), (3, 1), (3, 0)]
    assert {kw["before"] for kw, _ in spy.calls} == {START - timedelta(days=7)}

    for event_id in ids["old"]:
        assert store.get(event_id) is None
        assert store.records(event_id) == []
    for event_id in ids["recent"]:
        event = store.get(event_id)
        assert event is not None and event.state is State.PUBLISHED
        assert [r.handler for r in store.records(event_id)] == ["ship"]
    # Dead letters and pending events are older than the cut-off, and untouched.
    (dead,) = ids["dead"]
    letter = outbox.dead_letter(dead)
    assert letter is not None and letter.last_error == "ship: RuntimeError: no truck"
    for event_id in ids["pending"]:
        event = store.get(event_id)
        assert event is not None and event.state is State.PENDING
    stats = store.stats(now=clock.now())
    assert (stats.published, stats.dead, stats.pending) == (2, 1, 2)

    # The default page is 1,000 rows.
    spy.calls.clear()
    assert outbox.prune() == 0
    assert [kw["limit"] for kw, _ in spy.calls] == [PURGE_PAGE_SIZE] == [1000]


def test_retain_published_none_keeps_everything(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FrozenClock(START)
    outbox = Outbox(store, make_bus(), clock=clock, retain_published=None)
    seed(store, clock, outbox)
    spy = Calls(store.purge_published)
    monkeypatch.setattr(store, "purge_published", spy)
    assert outbox.prune() == 0
    assert outbox.prune_if_due() == 0
    assert spy.calls == []
    assert store.stats(now=clock.now()).published == 9


def test_dead_letter_and_requeue_dead(store: Store) -> None:
    clock = FrozenClock(START)
    bus = make_bus()

    @bus.handler("invoice.due", name="bill")
    def bill(event: Any, ctx: Any) -> None:
        raise RuntimeError("declined")

    outbox = Outbox(store, bus, clock=clock, max_retries=0)
    orders = enqueue(outbox, {"fail": True}, {"fail": True}, {})
    with store.transaction() as conn:
        invoice = outbox.enqueue(conn, "invoice.due", {})
    outbox.poller().run_once()
    assert outbox.dead_letter(orders[2]) is None  # published
    assert outbox.dead_letter(999_999) is None  # no such event
    letter = outbox.dead_letter(orders[0])
    assert letter is not None and letter.event.id == orders[0] and letter.failed_at == START
    with pytest.raises(ConfigurationError):
        outbox.dead_letter("1")  # type: ignore[arg-type]

    assert outbox.requeue_dead(topic="invoice.due") == 1
    assert outbox.dead_letter(invoice) is None
    assert outbox.requeue_dead(page_size=1) == 2  # two pages of one
    assert store.stats(now=clock.now()).dead == 0
    assert outbox.requeue_dead() == 0
    with pytest.raises(ConfigurationError):
        outbox.requeue_dead(page_size=0)


def test_a_dry_run_counts_what_purge_and_requeue_dead_would_touch(store: Store) -> None:
    clock = FrozenClock(START)
    outbox = Outbox(store, make_bus(), clock=clock, retain_published=None)
    ids = seed(store, clock, outbox)
    everything = [(e, store.records(e.id)) for e in store.events()]
    # The same cutoffs as the real thing: 7 published 10 days ago, 9 within 30 days; the one
    # dead letter failed 30 days ago.
    assert outbox.purge(published_older_than=timedelta(days=7), dry_run=True) == 7
    assert outbox.purge(published_older_than=timedelta(hours=1), dry_run=True) == 9
    assert outbox.purge(dead_older_than=timedelta(days=29), dry_run=True) == 1
    assert outbox.purge(dead_older_than=timedelta(days=31), dry_run=True) == 0
    not_dead = ids["old"][0]
    assert outbox.purge(dead_ids=[*ids["dead"], not_dead], dry_run=True) == 1
    both = {"published_older_than": timedelta(days=7), "dead_older_than": timedelta(days=29)}
    assert outbox.purge(**both, dry_run=True) == 8
    assert outbox.requeue_dead(dry_run=True) == 1
    assert outbox.requeue_dead(topic="invoice.due", dry_run=True) == 0
    assert [(e, store.records(e.id)) for e in store.events()] == everything  # nothing changed
    assert outbox.purge(**both) == 8  # and the real purge agrees


DEAD = 500
PAGE = 7


@pytest.mark.parametrize("clock_moves", [True, False], ids=["clock-moves", "clock-stands"])
def test_requeue_dead_all_returns_while_pollers_fail_them_again(
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    clock_moves: bool,
) -> None:
    """Bug 5: ``requeue_dead`` paged until no dead letter was left, and the events a poller
    (``max_retries=0``) dead-lettered again came back into its pages: it never returned. Now
    it takes the dead letters of the instant it starts. Between every two pages a poller
    delivers what was just requeued and dead-letters it again; each of the 500 is requeued
    exactly once, and the call returns after 500 / 7 pages. With a clock that moves (the
    deaths come later than the snapshot) and with one that stands still (they come at the
    snapshot's instant, behind the cursor)."""
    clock = FrozenClock(START)
    bus = EventBus()
    runs: Counter[int] = Counter()

    @bus.handler("mail.send", name="send")
    def send(event: Any, ctx: Any) -> None:
        runs[event.id] += 1
        raise RuntimeError("smtp busy")

    outbox = Outbox(store, bus, clock=clock, max_retries=0, load_entry_points=False)
    with store.transaction() as conn:
        ids = outbox.enqueue_many(conn, [("mail.send", {"n": n}) for n in range(DEAD)])
    poller = outbox.poller(batch_size=100)
    assert sum(len(r.dead_lettered) for r in poller.run_until_idle()) == DEAD

    requeued_ids: Counter[int] = Counter()
    pages: list[int] = []
    real_requeue = store.requeue

    def requeue_then_fail_again(ids: Any, *, now: Any) -> int:
        wanted = list(ids)
        assert len(pages) < DEAD, "requeue_dead does not end"  # a guard: fails, never hangs
        count = real_requeue(wanted, now=now)
        requeued_ids.update(wanted)
        pages.append(count)
        if clock_moves:
            clock.advance(timedelta(seconds=1))
        again = sum(len(r.dead_lettered) for r in poller.run_until_idle())
        assert again == count  # every event just requeued is dead again before the next page
        return count

    reads: list[int] = []
    real_dead_letters = store.dead_letters

    def counted_dead_letters(**kwargs: Any) -> Any:
        page = real_dead_letters(**kwargs)
        reads.append(len(page))
        return page

    monkeypatch.setattr(store, "requeue", requeue_then_fail_again)
    monkeypatch.setattr(store, "dead_letters", counted_dead_letters)
    assert outbox.requeue_dead(page_size=PAGE) == DEAD
    assert set(requeued_ids) == set(ids) and set(requeued_ids.values()) == {1}  # once each
    assert len(pages) == -(-DEAD // PAGE) and sum(pages) == DEAD
    assert set(runs.values()) == {2}  # its first attempt, and one after its one requeue
    assert store.stats(now=clock.now()).dead == DEAD  # all dead again: nothing lost
    with capsys.disabled():
        print(
            f"\n[requeue-dead:{type(store).__name__}:{'moves' if clock_moves else 'stands'}] "
            f"{DEAD} dead, requeued {sum(pages)} once each, returned after {len(pages)} pages "
            f"of {PAGE} ({len(reads)} reads of {sum(reads)} dead letters); "
            f"{sum(runs.values()) - DEAD} handler runs after the requeues"
        )


def test_requeue_dead_takes_the_dead_letters_of_as_of(store: Store) -> None:
    """``as_of``: only what had failed by then (the CLI counts and requeues one snapshot)."""
    clock = FrozenClock(START)
    outbox = Outbox(store, make_bus(), clock=clock, max_retries=0, load_entry_points=False)
    early = enqueue(outbox, {"fail": True}, {"fail": True})
    assert outbox.poller().run_once().dead_lettered == early
    clock.advance(timedelta(minutes=1))
    late = enqueue(outbox, {"fail": True})
    assert outbox.poller().run_once().dead_lettered == late
    assert outbox.requeue_dead(as_of=START, dry_run=True) == 2
    assert outbox.requeue_dead(as_of=START, page_size=1) == 2
    assert [d.event.id for d in outbox.dead_letters()] == late
    with pytest.raises(ConfigurationError, match="as_of"):
        outbox.requeue_dead(as_of=datetime(2030, 1, 1))  # naive


def test_max_retries_lowered_keeps_the_real_error(store: Store) -> None:
    """Bug 9: an event failed once ("smtp busy"); polled again with max_retries=0 it is dead
    without its handler running (its attempts are used up), and its last error is still the
    handler's, first, not "attempt 1 crashed or lost its lease"."""
    clock = FrozenClock(START)
    bus = EventBus()
    runs: list[int] = []

    @bus.handler("mail.send", name="send")
    def send(event: Any, ctx: Any) -> None:
        runs.append(ctx.attempt)
        raise RuntimeError("smtp busy")

    outbox = Outbox(store, bus, clock=clock, max_retries=3)
    with store.transaction() as conn:
        event_id = outbox.enqueue(conn, "mail.send", {"to": "a@example.com"})
    assert outbox.poller().run_once().retried == [event_id]
    failed = store.get(event_id)
    assert failed is not None and failed.last_error == "send: RuntimeError: smtp busy"

    clock.advance(timedelta(hours=1))  # past the backoff
    report = outbox.poller(max_retries=0).run_once()
    assert report.dead_lettered == [event_id]
    assert runs == [1]  # attempt 2 had no attempt left: the handler did not run
    letter = outbox.dead_letter(event_id)
    assert letter is not None
    assert letter.last_error == (
        "send: RuntimeError: smtp busy; no attempt left to run it (attempt 2, max_retries=0)"
    )
    assert "crashed" not in (letter.last_error or "")


# -- the pruner in the poller loop (memory store: the timing is the clock's) --------------------


class StepWaiter:
    """A waiter that moves the clock ``step`` per wait and stops the poller after ``waits``."""

    def __init__(self, clock: FrozenClock, step: timedelta, waits: int) -> None:
        self.clock = clock
        self.step = step
        self.left = waits
        self.stop: Callable[[], None] = lambda: None

    def wait(self, timeout: float) -> None:
        self.clock.advance(self.step)
        self.left -= 1
        if self.left == 0:
            self.stop()

    def wake(self) -> None:
        pass


def test_run_forever_prunes_at_most_once_a_minute_by_the_outbox_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outboxkit import MemoryStore

    clock = FrozenClock(START)
    store = MemoryStore()
    outbox = Outbox(store, make_bus(), clock=clock)  # retain_published: the default 7 days
    assert outbox.retain_published == DEFAULT_RETAIN_PUBLISHED == timedelta(days=7)
    clock.set(START - timedelta(days=8))
    (old,) = enqueue(outbox, {})
    outbox.poller().run_once()
    clock.set(START)

    prunes: list[datetime] = []
    real_prune = outbox.prune

    def counting_prune(**kwargs: Any) -> int:
        prunes.append(clock.now())
        return real_prune(**kwargs)

    monkeypatch.setattr(outbox, "prune", counting_prune)
    # Ten polls, 20 s apart on the outbox clock: t = 0, 20, ..., 180 s.
    waiter = StepWaiter(clock, timedelta(seconds=20), waits=10)
    poller = outbox.poller(waiter=waiter)
    waiter.stop = poller.stop
    poller.run_forever()
    assert timedelta(minutes=1) == PRUNE_EVERY
    assert [(t - START).total_seconds() for t in prunes] == [0, 60, 120, 180]
    assert store.get(old) is None  # pruned on the first poll


def test_a_failing_prune_is_logged_and_the_poller_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from outboxkit import MemoryStore

    clock = FrozenClock(START)
    store = MemoryStore()
    outbox = Outbox(store, make_bus(), clock=clock)

    def down(**kwargs: Any) -> int:
        raise StoreUnavailable("the database is down")

    monkeypatch.setattr(store, "purge_published", down)
    with caplog.at_level(logging.WARNING, logger="outboxkit"):
        assert outbox.prune_if_due() == 0
    assert "pruning published events failed; trying again in a minute" in caplog.text
    assert outbox.prune_if_due() == 0  # not due again before a minute has passed
    assert caplog.text.count("pruning published events failed") == 1


@pytest.mark.parametrize("bad", [0, -1, timedelta(0), "7d", float("nan")])
def test_retain_published_must_be_a_positive_duration(bad: Any) -> None:
    from outboxkit import MemoryStore

    with pytest.raises(ConfigurationError, match="retain_published"):
        Outbox(MemoryStore(), retain_published=bad)


def test_rebind_gets_its_own_prune_schedule() -> None:
    from outboxkit import MemoryStore

    clock = FrozenClock(START)
    outbox = Outbox(MemoryStore(), clock=clock)
    outbox.prune_if_due()
    copy = outbox.rebind(store=MemoryStore())
    assert copy._next_prune_at is None and outbox._next_prune_at == START + PRUNE_EVERY
