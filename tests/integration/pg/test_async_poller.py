"""The asyncio poller on PostgreSQL: events delivered one and eight at a time (per event) and in
batches, a stop in the middle of a batch, and the ``LISTEN`` waiter (woken by a commit
elsewhere, by ``wake()`` from another thread or a signal handler, and surviving its
connection). Orchestrated with events and deadlines, never with fixed sleeps."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import Event, EventBus, Outbox, Outcome
from outboxkit_pg import PostgresStore

from ._workers import wait_until

pytestmark = pytest.mark.pg

EVENTS = 120


@pytest.fixture
def ledger(pg_store: PostgresStore, admin: psycopg.Connection[Any]) -> sql.Identifier:
    """The transactional handler's table: no constraint, so that a duplicate would show."""
    name = sql.Identifier(pg_store.names.schema, "ledger")
    admin.execute(sql.SQL("CREATE TABLE {} (event_id bigint NOT NULL)").format(name))
    return name


def two_handlers(ledger: sql.Identifier, seen: list[int]) -> EventBus:
    """``ledger`` (async, transactional: a row through ``ctx.connection``) and ``mailer`` (not
    transactional) on topic ``order``."""
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(ledger)

    @bus.handler("order", name="ledger")
    async def write_ledger(event: Event, ctx: Any) -> None:
        await ctx.connection.execute(insert, (event.id,))

    @bus.handler("order", name="mailer", transactional=False)
    async def mail(event: Event, ctx: Any) -> None:
        seen.append(event.id)

    return bus


def check_every_event_once(
    pg_store: PostgresStore, admin: psycopg.Connection[Any], ledger: sql.Identifier, ids: list[int]
) -> None:
    """Every (event, handler) recorded once, as succeeded; the ledger exact; all published."""
    schema = pg_store.names.schema
    records = admin.execute(
        sql.SQL("SELECT event_id, handler, outcome FROM {} ORDER BY event_id, handler").format(
            sql.Identifier(schema, "outbox_deliveries")
        )
    ).fetchall()
    assert records == [(i, h, "succeeded") for i in ids for h in ("ledger", "mailer")]
    rows = admin.execute(sql.SQL("SELECT event_id FROM {} ORDER BY 1").format(ledger)).fetchall()
    assert [r[0] for r in rows] == ids
    stats = pg_store.stats(now=None)
    assert (stats.published, stats.pending, stats.claimed, stats.dead) == (len(ids), 0, 0, 0)


async def enqueue_orders(pg_store: PostgresStore, outbox: Outbox, count: int) -> list[int]:
    async with pg_store.async_store().transaction() as conn:
        return await outbox.enqueue_many_async(conn, [("order", {"n": n}) for n in range(count)])


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.asyncio
async def test_every_event_and_handler_once_per_event(
    pg_store: PostgresStore,
    admin: psycopg.Connection[Any],
    ledger: sql.Identifier,
    concurrency: int,
) -> None:
    seen: list[int] = []
    outbox = Outbox(pg_store, two_handlers(ledger, seen))
    ids = await enqueue_orders(pg_store, outbox, EVENTS)
    poller = outbox.async_poller(concurrency=concurrency, batch_size=25, lease=30)
    reports = await poller.run_until_idle()
    await pg_store.async_store().close()
    assert sorted(i for r in reports for i in r.published) == ids
    assert sorted(seen) == ids
    check_every_event_once(pg_store, admin, ledger, ids)


@pytest.mark.asyncio
async def test_every_event_and_handler_once_per_batch(
    pg_store: PostgresStore, admin: psycopg.Connection[Any], ledger: sql.Identifier
) -> None:
    seen: list[int] = []
    outbox = Outbox(pg_store, two_handlers(ledger, seen))
    ids = await enqueue_orders(pg_store, outbox, EVENTS)
    poller = outbox.async_poller(transaction="per_batch", batch_size=25, lease=30)
    reports = await poller.run_until_idle()
    await pg_store.async_store().close()
    assert [len(r.published) for r in reports] == [25, 25, 25, 25, 20]
    check_every_event_once(pg_store, admin, ledger, ids)


@pytest.mark.asyncio
async def test_a_batch_rolls_back_one_delivery_and_commits_the_rest(
    pg_store: PostgresStore, admin: psycopg.Connection[Any], ledger: sql.Identifier
) -> None:
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(ledger)

    @bus.handler("order", name="ledger")
    async def write_ledger(event: Event, ctx: Any) -> None:
        await ctx.connection.execute(insert, (event.id,))
        ctx.enqueue("order.followed", {"of": event.id})
        if event.payload["n"] == 1:
            raise RuntimeError("this one fails")

    outbox = Outbox(pg_store, bus)
    ids = await enqueue_orders(pg_store, outbox, 3)
    report = await outbox.async_poller(transaction="per_batch").run_once()
    await pg_store.async_store().close()
    assert report.published == [ids[0], ids[2]] and report.retried == [ids[1]]
    rows = admin.execute(sql.SQL("SELECT event_id FROM {} ORDER BY 1").format(ledger)).fetchall()
    assert [r[0] for r in rows] == [ids[0], ids[2]]  # the failed savepoint's write is gone
    followed = sorted(e.payload["of"] for e in pg_store.events() if e.topic == "order.followed")
    assert followed == [ids[0], ids[2]]
    assert [r.outcome for r in pg_store.records(ids[0])] == [Outcome.SUCCEEDED]
    assert pg_store.records(ids[1]) == []


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.asyncio
async def test_stop_mid_batch_releases_the_unstarted_with_the_attempt_refunded(
    pg_store: PostgresStore, concurrency: int
) -> None:
    bus = EventBus()
    outbox = Outbox(pg_store, bus)
    poller = outbox.async_poller(concurrency=concurrency, batch_size=20)
    handled: list[int] = []

    @bus.handler("order", name="h")
    async def h(event: Event, ctx: Any) -> None:
        handled.append(event.id)
        if len(handled) == 1:
            poller.stop()  # from inside the batch: the events not yet started are handed back

    ids = await enqueue_orders(pg_store, outbox, 20)
    report = await poller.run_once()
    await pg_store.async_store().close()
    released = sorted(set(ids) - set(handled))
    assert sorted(report.published) == sorted(handled)
    assert 1 <= len(handled) <= concurrency
    assert sorted(report.released) == released and len(released) >= 20 - concurrency
    for event_id in released:
        event = pg_store.get(event_id)
        assert event is not None
        assert (event.attempts, event.locked_until, event.published_at) == (0, None, None)


@pytest.mark.asyncio
async def test_the_listen_waiter_wakes_a_waiting_run_forever_on_a_commit_elsewhere(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]
) -> None:
    channel = f"okt_wake_{uuid.uuid4().hex[:12]}"  # ours alone, to see when it is listened to
    store = PostgresStore(pg_url, schema=pg_schema, channel=channel)
    elsewhere = PostgresStore(pg_url, schema=pg_schema, channel=channel)
    try:
        store.migrate()
        handled = asyncio.Event()
        bus = EventBus()

        @bus.handler("t", name="h")
        async def h(event: Event, ctx: Any) -> None:
            handled.set()

        poller = Outbox(store, bus).async_poller(interval=3600)  # only a notification wakes it
        runner = asyncio.create_task(poller.run_forever())
        listening = "SELECT count(*) FROM pg_stat_activity WHERE query = %s"
        query = f'LISTEN "{channel}"'
        # The poller listens once its first poll found nothing: from then on only a
        # notification can make it poll again within the hour.
        assert await asyncio.to_thread(
            wait_until, lambda: admin.execute(listening, (query,)).fetchone() == (1,), 30, 0.05
        )
        assert not runner.done()

        def commit_elsewhere() -> None:  # another store and outbox: no in-process wake-up
            with psycopg.connect(pg_url) as conn:
                Outbox(elsewhere).enqueue(conn, "t", {})

        await asyncio.to_thread(commit_elsewhere)
        await asyncio.wait_for(handled.wait(), 30)
        poller.stop()
        await asyncio.wait_for(runner, 30)
        # The poller closed its listener when it stopped.
        assert await asyncio.to_thread(
            wait_until, lambda: admin.execute(listening, (query,)).fetchone() == (0,), 30, 0.05
        )
    finally:
        await store.async_store().close()
        elsewhere.close()
        store.close()


@pytest.fixture
def usr1() -> Iterator[list[Any]]:
    """SIGUSR1 calls each callable in the list (a signal handler, in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread")
    calls: list[Any] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: [c() for c in calls])
    try:
        yield calls
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.asyncio
async def test_wake_from_a_signal_handler_and_another_thread_ends_a_wait(
    pg_store: PostgresStore, usr1: list[Any]
) -> None:
    side = pg_store.async_store()
    waiter = side.make_waiter()
    assert waiter is not None
    try:
        await waiter.wait(0)  # connects: the next wait blocks on its sockets at once
        usr1.append(waiter.wake)
        waiting = asyncio.create_task(waiter.wait(3600))
        for _ in range(5):  # let the task reach its wait (turns of the loop, not time)
            await asyncio.sleep(0)
        assert not waiting.done()
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.wait_for(waiting, 30)

        waiting = asyncio.create_task(waiter.wait(3600))
        for _ in range(5):
            await asyncio.sleep(0)
        threading.Thread(target=waiter.wake).start()
        await asyncio.wait_for(waiting, 30)

        waiter.wake()  # a wake before the wait: the wait returns at once
        await asyncio.wait_for(waiter.wait(3600), 30)
    finally:
        await waiter.close()
        await side.close()


@pytest.mark.asyncio
async def test_stop_from_a_signal_handler_ends_run_forever(
    pg_store: PostgresStore, usr1: list[Any]
) -> None:
    poller = Outbox(pg_store).async_poller(interval=3600)
    usr1.append(poller.stop)
    runner = asyncio.create_task(poller.run_forever())
    for _ in range(20):
        await asyncio.sleep(0)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.wait_for(runner, 30)
    await pg_store.async_store().close()


@pytest.mark.asyncio
async def test_a_lost_listener_is_replaced_and_the_wait_still_returns(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]
) -> None:
    channel = f"okt_lost_{uuid.uuid4().hex[:12]}"
    store = PostgresStore(pg_url, schema=pg_schema, channel=channel)
    store.migrate()
    side = store.async_store()
    waiter = side.make_waiter()
    assert waiter is not None
    pids = "SELECT pid FROM pg_stat_activity WHERE query = %s"
    query = f'LISTEN "{channel}"'
    try:
        await waiter.wait(0)
        (pid,) = admin.execute(pids, (query,)).fetchone() or (None,)
        assert pid is not None
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # The server's goodbye makes the listener readable: the wait returns early; reading
        # it finds the connection lost (psycopg notices at the end of the stream, the read
        # after the FATAL message) and drops it; a later wait listens on a new connection.
        await asyncio.wait_for(waiter.wait(3600), 30)
        again = None
        for _ in range(10):  # each wait returns at once while there is something to read
            await asyncio.wait_for(waiter.wait(1), 30)
            (again,) = admin.execute(pids, (query,)).fetchone() or (None,)
            if again is not None:
                break
        assert again is not None and again != pid
    finally:
        await waiter.close()
        await side.close()
        store.close()


@pytest.mark.asyncio
async def test_no_waiter_without_notifications(pg_url: str, pg_schema: str) -> None:
    store = PostgresStore(pg_url, schema=pg_schema, notify=False)
    try:
        assert store.async_store().make_waiter() is None
    finally:
        store.close()
