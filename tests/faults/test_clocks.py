"""One clock rule.

- Every cutoff (purge, prune, ``dead list --since``) is computed by the clock the store uses for
  claims: the database's on PostgreSQL in production, never the host's wall clock. With the host
  31 days ahead, ``purge(dead_older_than=30d)`` and ``prune()`` once deleted every fresh dead
  letter and published event; now they delete nothing fresh.
- A poller keeps its lease deadlines on a monotonic clock in production (the test clock in tests):
  with the wall clock stepped back an hour mid-batch it still extends its leases in time, and it
  never starts a handler once its own deadline has passed.
- Naive datetimes are refused everywhere, PostgreSQL included: a clock returning one, and a naive
  ``dead_letters(since=...)``.

The host clock is moved by replacing ``SystemClock.now``, the one place outboxkit reads it; the
monotonic clock by replacing what ``MonotonicClock`` reads. Not marked ``faults``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

import outboxkit.clock
from outboxkit import ConfigurationError, Event, EventBus, FrozenClock, LeaseLost, Outbox
from outboxkit.clock import SystemClock
from outboxkit.testing import Recorder
from tests.faults._sites import Site, open_site

REAL_NOW = SystemClock.now


@pytest.fixture
def host_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[timedelta], None]:
    """Set the host's wall clock ahead (or back) of the real time by some amount."""

    def skew(by: timedelta) -> None:
        monkeypatch.setattr(SystemClock, "now", lambda self: REAL_NOW(self) + by)

    return skew


def _fresh_dead_and_published(site: Site, n: int) -> Outbox:
    """``n`` dead letters and ``n`` published events, written just now, on the production clock
    (no clock given: the store's own, the database's on PostgreSQL)."""
    bus = EventBus()

    @bus.handler("dies", name="fails")
    def fails(event: Event, ctx: Any) -> None:
        raise RuntimeError("boom")

    outbox = Outbox(site.store, bus, max_retries=0, load_entry_points=False)
    with site.store.transaction() as conn:
        outbox.enqueue_many(conn, [("dies", i) for i in range(n)])
        outbox.enqueue_many(conn, [("fine", i) for i in range(n)])
    report = outbox.poller(batch_size=2 * n).run_once()
    assert (len(report.dead_lettered), len(report.published)) == (n, n)
    return outbox


@pytest.mark.pg
def test_a_host_clock_31_days_ahead_deletes_nothing_fresh(
    tmp_path: Any, host_clock: Callable[[timedelta], None]
) -> None:
    with open_site("pg", tmp_path) as site:
        outbox = _fresh_dead_and_published(site, 5)
        host_clock(timedelta(days=31))
        assert outbox.clock.now() > REAL_NOW(outbox.clock) + timedelta(days=30)  # the skew holds
        assert outbox.purge(dead_older_than=timedelta(days=30)) == 0
        assert outbox.prune() == 0  # retain_published: 7 days
        assert outbox.prune_if_due() == 0
        assert outbox.purge(published_older_than=timedelta(days=7)) == 0
        stats = outbox.stats()
        assert (stats.dead, stats.published) == (5, 5)
        # The cutoffs are the database's: a day back by its clock keeps them, none back drops them.
        assert len(outbox.dead_letters(since=timedelta(days=1))) == 5
        assert outbox.purge(dead_older_than=0, published_older_than=0) == 10


@pytest.mark.parametrize("backend", ["memory", "sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_a_cutoff_far_in_the_past_selects_nothing_instead_of_overflowing(
    tmp_path: Any, backend: str
) -> None:
    with open_site(backend, tmp_path) as site:
        outbox = _fresh_dead_and_published(site, 2)
        ages = timedelta(days=999_999)
        assert outbox.purge(published_older_than=ages, dead_older_than=ages) == 0
        assert len(outbox.dead_letters(since=ages)) == 2


@pytest.fixture
def monotonic(monkeypatch: pytest.MonkeyPatch) -> FrozenClock:
    """What ``MonotonicClock`` reads, under the test's control (seconds as a FrozenClock)."""
    ticks = FrozenClock(datetime(2000, 1, 1, tzinfo=UTC))
    origin = ticks.now()

    def read() -> float:
        return (ticks.now() - origin).total_seconds()

    monkeypatch.setattr(outboxkit.clock, "time", SimpleNamespace(monotonic=read))
    return ticks


@pytest.mark.parametrize("backend", ["memory", "sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_a_wall_clock_stepped_back_mid_batch_moves_no_lease_deadline(
    tmp_path: Any,
    backend: str,
    monotonic: FrozenClock,
    host_clock: Callable[[timedelta], None],
) -> None:
    """Production clocks (none given): the wall clock steps back an hour after the claim; each
    handler takes 0.6 s of monotonic time against a 1 s lease. The poller extends the batch's
    leases before each handler that would start with less than half a lease left, and once a
    handler overruns the deadline it starts nothing more."""
    with open_site(backend, tmp_path) as site:
        bus = EventBus()
        started: list[int] = []

        @bus.handler("t", name="slow", transactional=False)
        def slow(event: Event, ctx: Any) -> None:
            started.append(event.id)
            if len(started) == 1:
                host_clock(timedelta(hours=-1))  # stepped back mid-batch
            monotonic.advance(2.0 if event.payload == "overrun" else 0.6)

        recorder = Recorder()
        outbox = Outbox(site.store, bus, lease=1.0, plugins=[recorder], load_entry_points=False)
        extends: list[int] = []
        # A SQL store extends through extend_on, whether the poller asks the store or its round
        # (PostgreSQL's per-event deliveries); the memory store through extend.
        name = "extend_on" if hasattr(site.store, "extend_on") else "extend"
        extend = getattr(site.store, name)

        def counted(*args: Any, **kw: Any) -> Any:
            claims = args[1] if name != "extend" else args[0]
            extends.append(len(claims))
            return extend(*args, **kw)

        setattr(site.store, name, counted)
        with site.store.transaction() as conn:
            ids = outbox.enqueue_many(conn, [("t", "ok")] * 3 + [("t", "overrun"), ("t", "ok")])
        report = outbox.poller().run_once()
        # The first handler starts with the full lease; each later one would start with 0.4 s
        # of it left, so the batch's leases are extended first (three times). The fourth
        # handler overran its deadline, so the fifth never started: its lease is lost.
        assert started == ids[:4]
        assert len(extends) == 3
        assert ids[4] in report.lease_lost
        assert [e.event_id for e in recorder.of(LeaseLost)] == [ids[4]]


@pytest.mark.parametrize("backend", ["memory", "sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_a_clock_returning_naive_datetimes_is_refused(tmp_path: Any, backend: str) -> None:
    class NaiveClock:
        def now(self) -> datetime:
            return datetime(2030, 1, 1)  # no tzinfo

    with open_site(backend, tmp_path) as site:
        outbox = Outbox(site.store, EventBus(), clock=NaiveClock(), load_entry_points=False)
        with (
            pytest.raises(ConfigurationError, match="timezone-aware"),
            site.store.transaction() as conn,
        ):
            outbox.enqueue(conn, "t", {})
        with pytest.raises(ConfigurationError, match="timezone-aware"):
            outbox.poller().run_once()
        with pytest.raises(ConfigurationError, match="timezone-aware"):
            outbox.stats()
        assert site.store.stats(now=None).total == 0  # nothing was written


@pytest.mark.parametrize("backend", ["memory", "sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_a_naive_since_is_refused(tmp_path: Any, backend: str) -> None:
    with open_site(backend, tmp_path) as site:
        outbox = Outbox(site.store, EventBus(), clock=FrozenClock(), load_entry_points=False)
        with pytest.raises(ConfigurationError, match="since must be timezone-aware"):
            outbox.dead_letters(since=datetime(2030, 1, 1))
        if backend == "pg":  # the store itself refuses it too
            with pytest.raises(ConfigurationError, match="timezone-aware"):
                site.store.dead_letters(since=datetime(2030, 1, 1))
            with pytest.raises(ConfigurationError, match="timezone-aware"):
                site.store.claim(batch_size=1, lease=timedelta(seconds=1), now=datetime(2030, 1, 1))
