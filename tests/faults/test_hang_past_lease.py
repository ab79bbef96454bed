"""A handler hanging past its lease, on the memory store, SQLite and PostgreSQL.

One process, a ``FrozenClock`` that the handlers themselves move (the hang), and a second poller
on a second store object opened on the same database (another "process": its own connections),
run from inside the hanging handler:

- A *non-transactional* handler holds nothing while it runs: once the clock passes the lease the
  other poller claims the event and delivers it; when the hung one wakes, its record and its
  settle are fenced by its stale token: it changes nothing (no record, no follow-up event, no
  settle), reports ``LeaseLost``, and only its outside effect is repeated (the README's allowed
  duplicate after a lost lease). Its stale claim is refused by the store directly as well.
- A *transactional* handler's delivery transaction holds its event (a row lock on the memory store
  and PostgreSQL, SQLite's single write lock): no other poller can take the event while it hangs,
  even past the lease, so its write and record commit under a token that is still current.
- R13: an event whose lease runs low between two of its handlers has its lease extended before
  the second one starts, so ownership is kept through a run longer than one lease.

Fast and single-process: default tier (no ``faults`` marker).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outboxkit import (
    Event,
    EventBus,
    FrozenClock,
    LeaseLost,
    LeaseLostError,
    Outbox,
    Outcome,
    Store,
    StoreUnavailable,
    open_store,
)
from outboxkit.core.machine import Publish
from outboxkit.store import settle_one
from outboxkit.testing import Recorder
from tests.faults._sites import BACKENDS, Site

LEASE = timedelta(seconds=30)
T0 = datetime(2030, 1, 1, tzinfo=UTC)
FOLLOW_UP = "t.sent"


class _Published:
    """Equal to any instant: when a settle stamps ``published_at`` is not this test's subject
    (the delivery's start or the settle's own instant, store by store)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, datetime)

    def __hash__(self) -> int:  # pragma: no cover - never hashed
        return 0

    def __repr__(self) -> str:
        return "<published>"


PUBLISHED = _Published()
SUCCEEDED = Outcome.SUCCEEDED
# The records after the takeover: the hung poller's ledger row (attempt 1) when it ran first;
# everything else by the poller that took the event over (attempt 2).
RECORDS = {
    "ledger-first": [("ledger", SUCCEEDED, 1), ("mailer", SUCCEEDED, 2)],
    "mailer-first": [("mailer", SUCCEEDED, 2), ("ledger", SUCCEEDED, 2)],
}


@contextmanager
def second_store(site: Site) -> Iterator[Store]:
    """Another store object on the site's database, as another process would open it (the
    memory store has no other: it is the same object). On SQLite it does not wait for the write
    lock, so that a lock held by the first poller shows at once instead of after 30 s."""
    if site.backend == "memory":
        yield site.store
        return
    options = dict(site.options)
    if site.backend == "sqlite":
        options["busy_timeout"] = 0
    other: Store = open_store(site.url, **options)
    try:
        yield other
    finally:
        other.close()


def _state(site: Site, event_id: int) -> tuple[Any, ...]:
    """Everything the outbox and the app's database say about the event."""
    event = site.store.get(event_id)
    assert event is not None
    return (
        (event.attempts, event.published_at, event.failed_at, event.locked_until),
        [(r.handler, r.outcome, r.attempt) for r in site.store.records(event_id)],
        site.committed_orders(),
        [e.payload for e in site.store.events(topic=FOLLOW_UP)],
    )


@pytest.mark.parametrize("site", BACKENDS, indirect=True)
@pytest.mark.parametrize("order", ["ledger-first", "mailer-first"])
def test_a_non_transactional_handler_hanging_past_its_lease_is_overtaken_and_fenced(
    site: Site, order: str
) -> None:
    clock = FrozenClock(T0)
    bus = EventBus()
    mails: list[tuple[int, int]] = []
    seen: dict[str, Any] = {}

    def ledger(event: Event, ctx: Any) -> None:
        site.write_order(ctx.connection)

    def mailer(event: Event, ctx: Any) -> None:
        mails.append((event.id, ctx.attempt))
        ctx.enqueue(FOLLOW_UP, {"event": event.id, "attempt": ctx.attempt})
        if ctx.attempt == 1:  # the first poller hangs here, past its lease
            clock.advance(LEASE + timedelta(seconds=1))
            seen["overtaker"] = overtaker.poller().run_once()
            seen["state"] = _state(site, event.id)

    handlers = [("ledger", ledger, True), ("mailer", mailer, False)]
    if order == "mailer-first":
        handlers.reverse()
    for name, fn, transactional in handlers:
        bus.subscribe("t", fn, name=name, transactional=transactional)

    recorder = Recorder()
    outbox = Outbox(
        site.store, bus, clock=clock, lease=LEASE, plugins=[recorder], load_entry_points=False
    )
    with site.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {"n": 1})
    with second_store(site) as other:
        overtaker = Outbox(other, bus, clock=clock, lease=LEASE, load_entry_points=False)
        zombie = outbox.poller()
        claims = site.store.claim(batch_size=10, lease=LEASE, now=clock.now())
        (stale,) = claims
        report = zombie.process(claims, claimed_at=T0)

        # The other poller took the event over once the lease had passed, and finished it.
        taken = seen["overtaker"]
        assert taken.claimed == taken.published == [event_id]
        after_takeover = seen["state"]
        assert after_takeover == (
            (2, PUBLISHED, None, None),
            RECORDS[order],
            1,
            [{"event": event_id, "attempt": 2}],
        )
        # The hung poller woke: its record (with its follow-up) and settle changed nothing.
        assert _state(site, event_id) == after_takeover
        assert report.lease_lost == [event_id]
        assert report.published == report.retried == report.dead_lettered == []
        assert report.deliveries[-1].handler == "mailer"
        assert report.deliveries[-1].outcome is Outcome.LEASE_LOST
        assert recorder.of(LeaseLost) == [LeaseLost(event_id, "t", 1, "mailer")]
        # Only the outside effect happened twice: the duplicate allowed after a lost lease.
        assert mails == [(event_id, 1), (event_id, 2)]

        # Its stale claim, used directly, is refused by the store: no write, no settle.
        with pytest.raises(LeaseLostError), site.store.delivery(stale, now=clock.now()) as tx:
            site.write_order(tx.connection)  # pragma: no cover - never reached
        assert not settle_one(site.store, stale, Publish(), error=None, now=clock.now())
        assert site.store.extend([stale], lease=LEASE, now=clock.now()) == []
        assert _state(site, event_id) == after_takeover


@pytest.mark.parametrize("site", BACKENDS, indirect=True)
def test_a_transactional_handler_hanging_past_its_lease_keeps_its_event(site: Site) -> None:
    clock = FrozenClock(T0)
    bus = EventBus()
    seen: dict[str, Any] = {}

    @bus.handler("t", name="ledger")
    def ledger(event: Event, ctx: Any) -> None:
        site.write_order(ctx.connection)
        clock.advance(LEASE + timedelta(seconds=1))  # hangs past its lease, transaction open
        try:
            seen["overtaker"] = overtaker.poller().run_once().claimed
        except StoreUnavailable as exc:  # SQLite: the write lock is held by this transaction
            seen["overtaker"] = exc

    recorder = Recorder()
    outbox = Outbox(
        site.store, bus, clock=clock, lease=LEASE, plugins=[recorder], load_entry_points=False
    )
    with site.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {"n": 1})
    with second_store(site) as other:
        overtaker = Outbox(other, bus, clock=clock, lease=LEASE, load_entry_points=False)
        report = outbox.poller().run_once()

    if site.backend == "sqlite":
        # One writer at a time: the other poller could not even claim (busy_timeout=0 here; a
        # real poller waits up to busy_timeout, 30 s, and then logs a store outage).
        assert isinstance(seen["overtaker"], StoreUnavailable)
        assert "locked" in str(seen["overtaker"])
    else:
        # The event's row is held by the delivery transaction: claims skip it.
        assert seen["overtaker"] == []
    # Nobody took it over, so the hung poller's token is still current: its write, record and
    # settle commit, exactly once, on the first attempt.
    assert report.published == [event_id]
    assert report.lease_lost == []
    assert recorder.of(LeaseLost) == []
    assert _state(site, event_id) == (
        (1, PUBLISHED, None, None),
        [("ledger", Outcome.SUCCEEDED, 1)],
        1,
        [],
    )


@pytest.mark.parametrize("site", BACKENDS, indirect=True)
def test_r13_a_lease_running_low_between_handlers_is_extended(site: Site) -> None:
    clock = FrozenClock(T0)
    bus = EventBus()
    step = LEASE * 0.6  # after one handler less than half a lease is left (R13: extend)
    seen: dict[str, Any] = {}

    @bus.handler("t", name="first")
    def first(event: Event, ctx: Any) -> None:
        site.write_order(ctx.connection)
        clock.advance(step)

    @bus.handler("t", name="second", transactional=False)
    def second(event: Event, ctx: Any) -> None:
        # Non-transactional: no lock held, only the lease keeps the other poller off.
        held = site.store.get(event.id)
        assert held is not None
        seen["locked_until"] = held.locked_until
        clock.advance(step)  # now past the original lease, inside the extended one
        seen["overtaker"] = overtaker.poller().run_once().claimed

    recorder = Recorder()
    outbox = Outbox(
        site.store, bus, clock=clock, lease=LEASE, plugins=[recorder], load_entry_points=False
    )
    with site.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {"n": 1})
    with second_store(site) as other:
        overtaker = Outbox(other, bus, clock=clock, lease=LEASE, load_entry_points=False)
        report = outbox.poller().run_once()

    assert seen["locked_until"] == T0 + step + LEASE  # extended before "second" started
    assert seen["overtaker"] == []  # at T0 + 36 s the original lease (T0 + 30 s) had passed
    assert report.published == [event_id]
    assert report.lease_lost == []
    assert recorder.of(LeaseLost) == []
    assert _state(site, event_id) == (
        (1, PUBLISHED, None, None),
        [("first", Outcome.SUCCEEDED, 1), ("second", Outcome.SUCCEEDED, 1)],
        1,
        [],
    )
