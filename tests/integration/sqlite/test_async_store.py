"""The SQLite store's asyncio side (``store.async_store()``, on aiosqlite), on real files.

Enqueue through the app's aiosqlite connection inside its transaction; ``async def``
transactional handlers writing through ``ctx.connection`` (the delivery's aiosqlite connection);
the asyncio poller per event (concurrency 1 and 4) and per batch; a stop in the middle of a
batch. No timing: a frozen clock, and ``asyncio.Event``s where tasks must meet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    HandlerCrashed,
    InvalidEvent,
    LeaseLostError,
    Message,
    Outbox,
    Reject,
    StoreError,
    StoreUnavailable,
)
from outboxkit.core.machine import Publish
from outboxkit.core.model import Outcome
from outboxkit_sqlite import SQLiteStore, aio

LEASE = timedelta(seconds=30)
TOPIC = "order.placed"
LEDGER = "INSERT INTO ledger (event_id, handler) VALUES (?, ?)"
BOUND = 30.0  # seconds: a test that waits for tasks to meet fails by then instead of hanging

AppTransaction = Callable[[Path], AbstractAsyncContextManager[aiosqlite.Connection]]


@asynccontextmanager
async def default_isolation(path: Path) -> AsyncIterator[aiosqlite.Connection]:
    """aiosqlite with Python's default handling: the driver begins before the first write."""
    async with aiosqlite.connect(path, timeout=30) as conn:
        try:
            yield conn
        except BaseException:
            await conn.rollback()
            raise
        await conn.commit()


@asynccontextmanager
async def explicit_begin(path: Path) -> AsyncIterator[aiosqlite.Connection]:
    """``isolation_level=None`` and the app's own BEGIN / COMMIT / ROLLBACK."""
    async with aiosqlite.connect(path, timeout=30, isolation_level=None) as conn:
        await conn.execute("BEGIN")
        try:
            yield conn
        except BaseException:
            await conn.execute("ROLLBACK")
            raise
        await conn.execute("COMMIT")


STYLES = [
    pytest.param(default_isolation, id="python-default-isolation"),
    pytest.param(explicit_begin, id="isolation-none-explicit-begin"),
]


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock("2030-01-01T00:00:00Z")


def make_outbox(store: SQLiteStore, bus: EventBus, clock: FrozenClock) -> Outbox:
    return Outbox(store, bus, clock=clock, load_entry_points=False)


@pytest.fixture
def outbox(store: SQLiteStore, clock: FrozenClock) -> Outbox:
    """An outbox with no handlers, to enqueue with."""
    return make_outbox(store, EventBus(), clock)


def committed(path: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows read on a fresh connection: only what was committed."""
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchall()


def counts(path: Path) -> tuple[int, int]:
    """(app rows, outbox events), committed."""
    ((orders, events),) = committed(
        path, "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox_events)"
    )
    return orders, events


def ledger_rows(path: Path) -> list[tuple[Any, ...]]:
    return committed(path, "SELECT event_id, handler FROM ledger ORDER BY rowid")


def records_of(store: SQLiteStore, event_id: int) -> list[tuple[str, Outcome, str | None]]:
    return [(r.handler, r.outcome, r.reason) for r in store.records(event_id)]


def enqueue(store: SQLiteStore, outbox: Outbox, count: int = 1) -> list[int]:
    with store.transaction() as conn:
        return outbox.enqueue_many(conn, [(TOPIC, {"n": n}) for n in range(count)])


class AppFailed(Exception):
    pass


# -- the side itself ------------------------------------------------------------------------------


def test_a_file_store_has_an_asyncio_side(store: SQLiteStore) -> None:
    assert "asyncio" in store.capabilities
    side = store.async_store()
    assert store.async_store() is side
    assert side.make_waiter() is None  # SQLite has no notifications


def test_memory_has_no_asyncio_side(clock: FrozenClock) -> None:
    with SQLiteStore(":memory:") as store:
        assert "asyncio" not in store.capabilities
        with pytest.raises(ConfigurationError, match=":memory:"):
            store.async_store()
        with pytest.raises(ConfigurationError, match="asyncio side"):
            make_outbox(store, EventBus(), clock).async_poller()


@pytest.mark.asyncio
async def test_closing_the_store_closes_its_asyncio_side(path: Path) -> None:
    store = SQLiteStore(path)
    side = store.async_store()
    assert await side.claim(batch_size=1, lease=LEASE, now=None) == []
    store.close()
    assert side.closed
    with pytest.raises(StoreError, match="closed"):
        await side.claim(batch_size=1, lease=LEASE, now=None)
    with pytest.raises(StoreError, match="closed"):
        store.async_store()


@pytest.mark.asyncio
async def test_a_closed_asyncio_side_is_made_anew(store: SQLiteStore) -> None:
    side = store.async_store()
    assert await side.claim(batch_size=1, lease=LEASE, now=None) == []
    await side.close()
    with pytest.raises(StoreError, match="closed"):
        await side.claim(batch_size=1, lease=LEASE, now=None)
    again = store.async_store()
    assert again is not side
    assert await again.claim(batch_size=1, lease=LEASE, now=None) == []


def test_one_side_serves_one_event_loop_after_another(
    store: SQLiteStore, clock: FrozenClock, outbox: Outbox
) -> None:
    # Each asyncio.run() is a new loop: the side's connections and its turn serve each in turn.
    side = store.async_store()
    (first, second) = enqueue(store, outbox, 2)

    async def claim_one() -> list[int]:
        claims = await side.claim(batch_size=1, lease=LEASE, now=clock.now())
        return [c.event.id for c in claims]

    assert asyncio.run(claim_one()) == [first]
    assert asyncio.run(claim_one()) == [second]


def test_aiosqlite_is_imported_only_by_the_asyncio_side(path: Path) -> None:
    script = (
        "import sys\n"
        "from outboxkit import open_store\n"
        f"store = open_store({'sqlite:///' + path.as_posix()!r})\n"
        "print('aiosqlite' in sys.modules)\n"
        "store.async_store()\n"
        "print('aiosqlite' in sys.modules)\n"
        "store.close()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.split() == ["False", "True"]


def test_an_aiosqlite_without_what_the_side_uses_is_refused(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    aio.check_aiosqlite()  # the installed one has it
    monkeypatch.setattr(aio, "_STOP", None)
    with pytest.raises(ConfigurationError, match=r"needs aiosqlite 0\.22"):
        store.async_store()


# -- enqueue through the app's aiosqlite connection -----------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("style", STYLES)
async def test_enqueue_commits_with_the_app(
    path: Path, store: SQLiteStore, outbox: Outbox, style: AppTransaction
) -> None:
    async with style(path) as conn:
        await conn.execute("INSERT INTO orders (id, item) VALUES (1, 'book')")
        event_id = await outbox.enqueue_async(conn, TOPIC, {"order": 1})
        more = await outbox.enqueue_many_async(conn, [Message(TOPIC, {"n": n}) for n in range(3)])
        assert counts(path) == (0, 0)  # nothing is visible before the app commits
    assert counts(path) == (1, 4)
    assert more == [event_id + 1, event_id + 2, event_id + 3]
    event = store.get(event_id)
    assert event is not None and event.payload == {"order": 1}


@pytest.mark.asyncio
@pytest.mark.parametrize("style", STYLES)
async def test_enqueue_rolls_back_with_the_app(
    path: Path, store: SQLiteStore, outbox: Outbox, style: AppTransaction
) -> None:
    with pytest.raises(AppFailed):
        async with style(path) as conn:
            await conn.execute("INSERT INTO orders (id, item) VALUES (1, 'book')")
            await outbox.enqueue_async(conn, TOPIC, {"order": 1})
            raise AppFailed
    assert counts(path) == (0, 0)


@pytest.mark.asyncio
async def test_a_bad_event_is_refused_and_the_transaction_goes_on(
    path: Path, store: SQLiteStore, outbox: Outbox
) -> None:
    async with default_isolation(path) as conn:
        await conn.execute("INSERT INTO orders (id, item) VALUES (1, 'book')")
        with pytest.raises(InvalidEvent):
            await outbox.enqueue_async(conn, TOPIC, {"not json": object()})
        with pytest.raises(InvalidEvent, match="1"):
            await outbox.enqueue_many_async(conn, [(TOPIC, {}), (TOPIC, {"x": object()})])
        await outbox.enqueue_async(conn, TOPIC, {"order": 1})
    assert counts(path) == (1, 1)


@pytest.mark.asyncio
async def test_enqueue_refuses_what_is_no_open_transaction(
    path: Path, store: SQLiteStore, outbox: Outbox
) -> None:
    with closing(sqlite3.connect(path)) as blocking:
        for wrong in (object(), blocking):
            with pytest.raises(ConfigurationError, match=r"aiosqlite\.Connection"):
                await outbox.enqueue_async(wrong, TOPIC, {})
    with pytest.raises(ConfigurationError, match="not yet opened"):
        await outbox.enqueue_async(aiosqlite.connect(path), TOPIC, {})
    closed = await aiosqlite.connect(path)
    await closed.close()
    with pytest.raises(ConfigurationError, match="closed"):
        await outbox.enqueue_async(closed, TOPIC, {})
    async with aiosqlite.connect(path, isolation_level=None) as autocommit:
        with pytest.raises(ConfigurationError, match=r"autocommit.*Nothing was written"):
            await outbox.enqueue_async(autocommit, TOPIC, {})
        with pytest.raises(ConfigurationError, match="autocommit"):
            await outbox.enqueue_many_async(autocommit, [(TOPIC, {})])
    assert counts(path) == (0, 0)


# -- async transactional handlers -----------------------------------------------------------------


Then = Callable[[Event, Any], Awaitable[None]]


async def _nothing(event: Event, ctx: Any) -> None:
    return None


def one_ledger_event(
    store: SQLiteStore, clock: FrozenClock, then: Then = _nothing
) -> tuple[Outbox, int]:
    """An outbox whose one handler, ``ledger`` (async, transactional), writes its row through
    ``ctx.connection`` and then awaits ``then(event, ctx)``; and one event enqueued."""
    bus = EventBus()

    @bus.handler(TOPIC, name="ledger")
    async def ledger(event: Event, ctx: Any) -> None:
        assert isinstance(ctx.connection, aiosqlite.Connection)
        await ctx.connection.execute(LEDGER, (event.id, "ledger"))
        await then(event, ctx)

    outbox = make_outbox(store, bus, clock)
    (event_id,) = enqueue(store, outbox)
    return outbox, event_id


@pytest.mark.asyncio
async def test_an_async_handler_writes_in_the_delivery_transaction(
    path: Path, store: SQLiteStore, clock: FrozenClock
) -> None:
    outbox, event_id = one_ledger_event(store, clock)
    poller = outbox.async_poller()
    assert (await poller.run_once()).published == [event_id]
    assert ledger_rows(path) == [(event_id, "ledger")]
    assert records_of(store, event_id) == [("ledger", Outcome.SUCCEEDED, None)]
    assert (await poller.run_once()).claimed == []


@pytest.mark.asyncio
async def test_a_raising_handler_is_rolled_back_and_retried(
    path: Path, store: SQLiteStore, clock: FrozenClock
) -> None:
    failing = [True]

    async def follow_up_then_fail(event: Event, ctx: Any) -> None:
        ctx.enqueue("order.shipped", {"order": event.id})
        if failing[0]:
            raise RuntimeError("payment service down")

    outbox, event_id = one_ledger_event(store, clock, follow_up_then_fail)
    poller = outbox.async_poller()
    report = await poller.run_once()
    assert report.retried == [event_id]
    assert "payment service down" in (report.failed[0].error or "")
    assert ledger_rows(path) == []
    assert records_of(store, event_id) == []
    assert store.stats(now=None).total == 1  # the follow-up went with the rollback
    failing[0] = False
    clock.advance(timedelta(hours=1))
    assert (await poller.run_once()).published == [event_id]
    assert ledger_rows(path) == [(event_id, "ledger")]
    assert records_of(store, event_id) == [("ledger", Outcome.SUCCEEDED, None)]
    # The follow-up committed with the record: it is there, once.
    (follow_up,) = store.events(topic="order.shipped")
    assert follow_up.payload == {"order": event_id}


@pytest.mark.asyncio
async def test_a_rejection_rolls_back_and_is_recorded(
    path: Path, store: SQLiteStore, clock: FrozenClock
) -> None:
    async def reject(event: Event, ctx: Any) -> None:
        raise Reject("out of stock")

    outbox, event_id = one_ledger_event(store, clock, reject)
    report = await outbox.async_poller().run_once()
    assert [d.outcome for d in report.deliveries] == [Outcome.REJECTED]
    assert report.retried == []
    assert ledger_rows(path) == []
    assert records_of(store, event_id) == [("ledger", Outcome.REJECTED, "out of stock")]


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["commit", "rollback", "execute-commit", "close"])
async def test_a_handler_cannot_end_its_delivery_transaction(
    path: Path, store: SQLiteStore, clock: FrozenClock, how: str
) -> None:
    broken = [True]

    async def end_it(event: Event, ctx: Any) -> None:
        conn = ctx.connection
        if not broken[0]:
            return
        if how == "commit":
            await conn.commit()
        elif how == "rollback":
            await conn.rollback()
        elif how == "execute-commit":
            await conn.execute("COMMIT")
        else:
            await conn.close()

    outbox, event_id = one_ledger_event(store, clock, end_it)
    poller = outbox.async_poller()
    report = await poller.run_once()
    (delivery,) = report.deliveries
    assert delivery.outcome is Outcome.FAILED
    assert "HandlerCrashed" in (delivery.error or "")
    assert report.retried == [event_id]
    assert ledger_rows(path) == []
    broken[0] = False
    clock.advance(timedelta(hours=1))
    assert (await poller.run_once()).published == [event_id]
    assert ledger_rows(path) == [(event_id, "ledger")]


@pytest.mark.asyncio
async def test_a_full_disk_under_an_async_handler_is_a_store_failure(
    path: Path, store: SQLiteStore, clock: FrozenClock
) -> None:
    async def fill_the_disk(event: Event, ctx: Any) -> None:
        conn = ctx.connection
        async with conn.execute("PRAGMA page_count") as cursor:
            (pages,) = await cursor.fetchone()
        await conn.execute(f"PRAGMA max_page_count = {int(pages)}")  # SQLITE_FULL from here
        try:
            await conn.execute("CREATE TABLE IF NOT EXISTS filler (blob BLOB)")
            await conn.execute("INSERT INTO filler VALUES (zeroblob(1000000))")
        finally:
            await conn.execute("PRAGMA max_page_count = 1073741823")

    outbox, event_id = one_ledger_event(store, clock, fill_the_disk)
    with pytest.raises(StoreUnavailable, match="while a handler ran"):
        await outbox.async_poller().run_once()
    assert records_of(store, event_id) == []
    assert ledger_rows(path) == []


@pytest.mark.asyncio
async def test_only_the_store_ends_its_own_transactions(
    store: SQLiteStore, clock: FrozenClock
) -> None:
    bus = EventBus()
    tried: list[str] = []

    @bus.handler(TOPIC, name="h")
    async def handler(event: Event, ctx: Any) -> None:
        for statement in ("COMMIT", "ROLLBACK", "END", "BEGIN"):
            with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
                await ctx.connection.execute(statement)
            tried.append(statement)
        await ctx.connection.execute("SAVEPOINT inner")  # savepoints are the handler's own
        await ctx.connection.execute("RELEASE inner")

    outbox = make_outbox(store, bus, clock)
    (event_id,) = enqueue(store, outbox)
    report = await outbox.async_poller().run_once()
    # R17: refused, and the delivery fails all the same (see the blocking store's test).
    (delivery,) = report.deliveries
    assert isinstance(delivery.exception, HandlerCrashed)
    assert report.retried == [event_id]
    assert tried == ["COMMIT", "ROLLBACK", "END", "BEGIN"]


# -- the side's transactions ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_stale_claim_runs_nothing(
    store: SQLiteStore, clock: FrozenClock, outbox: Outbox
) -> None:
    side = store.async_store()
    enqueue(store, outbox)
    (claim,) = await side.claim(batch_size=1, lease=LEASE, now=clock.now())
    stale = dataclasses.replace(claim, token="0" * 32)
    with pytest.raises(LeaseLostError):
        async with side.delivery(stale, now=clock.now()):
            pytest.fail("the block ran")
    # Nothing was left holding the write lock: the live claim delivers, settles, and is done.
    async with side.delivery(claim, now=clock.now()) as tx:
        await tx.record("h", Outcome.SUCCEEDED)
    assert await side.settle_many([(claim, Publish(), None)], now=clock.now()) == [True]
    assert await side.settle_many([(claim, Publish(), None)], now=clock.now()) == [False]
    assert records_of(store, claim.event.id) == [("h", Outcome.SUCCEEDED, None)]


@pytest.mark.asyncio
async def test_release_and_extend(store: SQLiteStore, clock: FrozenClock, outbox: Outbox) -> None:
    side = store.async_store()
    enqueue(store, outbox, 2)
    first, second = await side.claim(batch_size=2, lease=LEASE, now=clock.now())
    (kept,) = await side.extend([first], lease=LEASE * 2, now=clock.now())
    assert kept.locked_until == clock.now() + LEASE * 2
    assert await side.release([first, second], now=clock.now()) == 2
    assert await side.release([first], now=clock.now()) == 0  # the token is spent
    for event_id in (first.event.id, second.event.id):
        event = store.get(event_id)
        assert event is not None and event.attempts == 0 and event.locked_until is None


@pytest.mark.asyncio
async def test_a_cancelled_delivery_rolls_back_and_frees_the_file(
    path: Path, store: SQLiteStore, clock: FrozenClock, outbox: Outbox
) -> None:
    side = store.async_store()
    enqueue(store, outbox)
    (claim,) = await side.claim(batch_size=1, lease=LEASE, now=clock.now())
    inside = asyncio.Event()

    async def deliver() -> None:
        async with side.delivery(claim, now=clock.now()) as tx:
            await tx.connection.execute(LEDGER, (claim.event.id, "h"))
            inside.set()
            await asyncio.Event().wait()  # until cancelled

    task = asyncio.create_task(deliver())
    async with asyncio.timeout(BOUND):
        await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ledger_rows(path) == []
    with closing(sqlite3.connect(path, timeout=0, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")  # at once: nobody holds the write lock any more
        other.execute("ROLLBACK")
    async with side.delivery(claim, now=clock.now()) as tx:
        await tx.record("h", Outcome.SUCCEEDED)
    assert records_of(store, claim.event.id) == [("h", Outcome.SUCCEEDED, None)]


@pytest.mark.asyncio
async def test_one_write_transaction_at_a_time_per_loop(path: Path, clock: FrozenClock) -> None:
    with SQLiteStore(path, busy_timeout=0.05) as store:
        side = store.async_store()
        enqueue(store, make_outbox(store, EventBus(), clock))
        (claim,) = await side.claim(batch_size=1, lease=LEASE, now=clock.now())
        inside, leave = asyncio.Event(), asyncio.Event()

        async def deliver() -> None:
            async with side.delivery(claim, now=clock.now()) as tx:
                inside.set()
                await leave.wait()
                await tx.record("h", Outcome.SUCCEEDED)

        task = asyncio.create_task(deliver())
        async with asyncio.timeout(BOUND):
            await inside.wait()
        # The other task's turn waits on the loop, up to busy_timeout, as SQLite's would.
        with pytest.raises(StoreUnavailable, match="busy_timeout"):
            await side.claim(batch_size=1, lease=LEASE, now=clock.now())
        leave.set()
        await task
        assert await side.settle_many([(claim, Publish(), None)], now=clock.now()) == [True]


@pytest.mark.asyncio
async def test_a_lock_held_elsewhere_past_busy_timeout_is_store_unavailable(path: Path) -> None:
    with (
        SQLiteStore(path, busy_timeout=0.05) as store,
        closing(sqlite3.connect(path, isolation_level=None)) as other,
    ):
        side = store.async_store()
        other.execute("BEGIN IMMEDIATE")  # another process holding the write lock
        with pytest.raises(StoreUnavailable, match="locked") as info:
            await side.claim(batch_size=10, lease=LEASE, now=None)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
        other.execute("ROLLBACK")
        assert await side.claim(batch_size=10, lease=LEASE, now=None) == []


# -- the asyncio poller ---------------------------------------------------------------------------


def draining_bus(notified: Counter[int], concurrency: int) -> EventBus:
    """``notify`` (async, outside the transaction; the first ``concurrency`` of them wait until
    all are running, so they must run at once) then ``ledger`` (async, transactional)."""
    bus = EventBus()
    running: set[int] = set()
    all_in = asyncio.Event()

    @bus.handler(TOPIC, name="notify", transactional=False)
    async def notify(event: Event, ctx: Any) -> None:
        if not all_in.is_set():
            running.add(event.id)
            if len(running) == concurrency:
                all_in.set()
            async with asyncio.timeout(BOUND):
                await all_in.wait()
        notified[event.id] += 1

    @bus.handler(TOPIC, name="ledger")
    async def ledger(event: Event, ctx: Any) -> None:
        await ctx.connection.execute(LEDGER, (event.id, "ledger"))

    return bus


def check_drained(path: Path, store: SQLiteStore, ids: list[int], notified: Counter[int]) -> None:
    """Every (event, handler) recorded once; the ledger row written once."""
    records = committed(path, "SELECT event_id, handler FROM outbox_deliveries")
    assert Counter(records) == {(i, h): 1 for i in ids for h in ("notify", "ledger")}
    assert Counter(ledger_rows(path)) == {(i, "ledger"): 1 for i in ids}
    assert notified == dict.fromkeys(ids, 1)
    stats = store.stats(now=None)
    assert stats.published == len(ids) and stats.pending == stats.claimed == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("concurrency", [1, 4])
async def test_the_asyncio_poller_drains_every_event_once(
    path: Path, store: SQLiteStore, clock: FrozenClock, concurrency: int
) -> None:
    notified: Counter[int] = Counter()
    outbox = make_outbox(store, draining_bus(notified, concurrency), clock)
    ids = enqueue(store, outbox, 45)
    poller = outbox.async_poller(concurrency=concurrency, batch_size=10)
    reports = await poller.run_until_idle()
    assert sorted(i for r in reports for i in r.published) == ids
    check_drained(path, store, ids, notified)


@pytest.mark.asyncio
async def test_the_asyncio_poller_drains_per_batch(
    path: Path, store: SQLiteStore, clock: FrozenClock
) -> None:
    notified: Counter[int] = Counter()
    bus = draining_bus(notified, 1)
    failed_once: set[int] = set()

    @bus.handler(TOPIC, name="audit")
    async def audit(event: Event, ctx: Any) -> None:
        await ctx.connection.execute(LEDGER, (event.id, "audit"))
        if event.id % 7 == 0 and event.id not in failed_once:
            failed_once.add(event.id)
            raise RuntimeError("audit failed")  # rolls back this delivery's savepoint only

    outbox = make_outbox(store, bus, clock)
    ids = enqueue(store, outbox, 30)
    poller = outbox.async_poller(transaction="per_batch", batch_size=10)
    reports = await poller.run_until_idle()
    retried = sorted(i for r in reports for i in r.retried)
    assert retried == sorted(failed_once) and retried
    clock.advance(timedelta(hours=1))
    await poller.run_until_idle()
    records = committed(path, "SELECT event_id, handler FROM outbox_deliveries")
    assert Counter(records) == {(i, h): 1 for i in ids for h in ("notify", "ledger", "audit")}
    assert Counter(ledger_rows(path)) == {(i, h): 1 for i in ids for h in ("ledger", "audit")}
    assert notified == dict.fromkeys(ids, 1)


@pytest.mark.asyncio
@pytest.mark.parametrize("concurrency", [1, 4])
async def test_stop_mid_batch_releases_the_unstarted(
    path: Path, store: SQLiteStore, clock: FrozenClock, concurrency: int
) -> None:
    bus = EventBus()

    @bus.handler(TOPIC, name="ledger")
    async def ledger(event: Event, ctx: Any) -> None:
        await ctx.connection.execute(LEDGER, (event.id, "ledger"))
        if event.id == ids[0]:
            poller.stop()

    outbox = make_outbox(store, bus, clock)
    ids = enqueue(store, outbox, 10)
    poller = outbox.async_poller(concurrency=concurrency, batch_size=10)
    report = await poller.run_once()
    # The events in hand when the stop came are finished (one per worker, at most); the rest
    # are handed back at once, with the attempt refunded.
    started = len(report.published)
    assert 1 <= started <= concurrency
    assert report.published == ids[:started]
    assert report.released == ids[started:]
    for event_id in report.released:
        event = store.get(event_id)
        assert event is not None and event.attempts == 0 and event.locked_until is None
    reports = await outbox.async_poller(concurrency=concurrency).run_until_idle()
    assert sorted(i for r in reports for i in r.published) == ids[started:]
    assert Counter(ledger_rows(path)) == {(i, "ledger"): 1 for i in ids}
