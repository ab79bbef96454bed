"""A per-event round on PostgreSQL's asyncio side (``AsyncPostgresStore.rounds``): the round
holds its deliveries' connections from one delivery to the next instead of taking one from the
pool for each, runs its lease extensions and settlement on them, never holds more than it may
(so that nothing waits on a connection the round keeps idle), and gives back to the pool at
once a connection a delivery left unusable."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import Event, EventBus, FrozenClock, Outbox, Outcome, StoreUnavailable
from outboxkit.core.payload import build_event
from outboxkit_pg import PostgresStore
from outboxkit_pg.aio import AsyncRound
from outboxkit_pg.pool import AsyncPool

from .conftest import migrated_store

pytestmark = pytest.mark.pg


def _takes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count the connections taken from the asyncio side's pool (what each was for)."""
    taken: list[str] = []
    original = AsyncPool.connection

    def connection(self: AsyncPool, doing: str) -> Any:
        taken.append(doing)
        return original(self, doing)

    monkeypatch.setattr(AsyncPool, "connection", connection)
    return taken


def _bus(ledger: sql.Identifier) -> EventBus:
    """A transactional handler writing a row through ``ctx.connection``, and one that never
    takes the connection (its record is one fenced statement)."""
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(ledger)

    @bus.handler("t", name="ledger")
    async def write(event: Event, ctx: Any) -> None:
        await ctx.connection.execute(insert, (event.id,))

    @bus.handler("t", name="noop", transactional=False)
    async def noop(event: Event, ctx: Any) -> None:
        pass

    return bus


@pytest.fixture
def store(pg_url: str, request: pytest.FixtureRequest) -> Iterator[PostgresStore]:
    options = getattr(request, "param", {})
    with migrated_store(pg_url, notify=False, pool_timeout=5, **options) as made:
        yield made


@pytest.fixture
def ledger(store: PostgresStore, admin: psycopg.Connection[Any]) -> sql.Identifier:
    name = sql.Identifier(store.names.schema, "ledger")
    admin.execute(sql.SQL("CREATE TABLE {} (event_id bigint NOT NULL)").format(name))
    return name


def _enqueue(store: PostgresStore, n: int) -> list[int]:
    with store.transaction() as conn:
        return store.enqueue(conn, [build_event("t", {"n": i}) for i in range(n)], now=None)


def _check_once(
    store: PostgresStore,
    admin: psycopg.Connection[Any],
    ledger: sql.Identifier,
    ids: list[int],
    handlers: list[str] | None = None,
) -> None:
    """Every event published; each handler recorded once; the ledger exact."""
    rows = admin.execute(sql.SQL("SELECT event_id FROM {} ORDER BY 1").format(ledger)).fetchall()
    assert [r[0] for r in rows] == ids
    for event_id in ids:
        recorded = sorted(r.handler for r in store.records(event_id))
        assert recorded == (handlers or ["ledger", "noop"])
    stats = store.stats(now=None)
    assert (stats.published, stats.pending, stats.claimed) == (len(ids), 0, 0)


@pytest.mark.parametrize(
    ("store", "concurrency", "held"),
    [
        ({"pool_max_size": 5}, 1, 1),
        ({"pool_max_size": 5}, 3, 3),
        ({"pool_max_size": 4}, 8, 2),  # held to pool_max_size - 2
    ],
    indirect=["store"],
)
@pytest.mark.asyncio
async def test_a_round_takes_its_connections_from_the_pool_once(
    store: PostgresStore,
    admin: psycopg.Connection[Any],
    ledger: sql.Identifier,
    monkeypatch: pytest.MonkeyPatch,
    concurrency: int,
    held: int,
) -> None:
    ids = _enqueue(store, 30)
    outbox = Outbox(store, _bus(ledger), load_entry_points=False)
    side = store.async_store()
    async with side.transaction():
        pass  # the pool opened, the schema checked
    taken = _takes(monkeypatch)
    report = await outbox.async_poller(concurrency=concurrency, batch_size=30).run_once()
    await side.close()
    assert sorted(report.published) == ids
    # The claim's connection, then the round's: 60 deliveries and the settlement on at most
    # `held` connections (before: one from the pool per delivery, and one to settle).
    assert taken[0] == "claim events"
    assert 1 <= len(taken) - 1 <= held
    assert all(doing.startswith("deliver event") for doing in taken[1:])
    _check_once(store, admin, ledger, ids)


@pytest.mark.parametrize("store", [{"pool_max_size": 1}], indirect=True)
@pytest.mark.asyncio
async def test_with_one_connection_in_the_pool_the_deliveries_take_turns(
    store: PostgresStore, admin: psycopg.Connection[Any], ledger: sql.Identifier
) -> None:
    """The round holds the pool's only connection: its other deliveries, its lease extensions
    and its settlement wait for that one, never for the pool (which would time out)."""
    clock = FrozenClock()
    extended: list[int] = []
    bus = _bus(ledger)

    @bus.handler("t", name="slow", transactional=False)
    async def slow(event: Event, ctx: Any) -> None:
        clock.advance(20)  # past half the lease: the next handler's start extends it

    original = AsyncRound.extend

    async def extend(self: AsyncRound, claims: Any, **kwargs: Any) -> Any:
        extended.append(len(claims))
        return await original(self, claims, **kwargs)

    ids = _enqueue(store, 12)
    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    poller = outbox.async_poller(concurrency=4, batch_size=12, lease=30)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AsyncRound, "extend", extend)
        report = await poller.run_once()
    await store.async_store().close()
    assert sorted(report.published) == ids
    assert extended  # the extensions ran on the round (its one connection)
    _check_once(store, admin, ledger, ids, handlers=["ledger", "noop", "slow"])


@pytest.mark.parametrize("store", [{"pool_max_size": 3}], indirect=True)
@pytest.mark.asyncio
async def test_a_connection_a_delivery_broke_goes_back_and_frees_its_place(
    store: PostgresStore, admin: psycopg.Connection[Any], ledger: sql.Identifier
) -> None:
    """A handler's statement kills its own session: the delivery fails as the database's
    failure, that connection goes back to the pool (which discards it), and the round's next
    delivery takes a new one in its place."""
    insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(ledger)
    ids = _enqueue(store, 2)
    side = store.async_store()
    claims = await side.claim(batch_size=2, lease=timedelta(seconds=30), now=None)
    pids: list[int] = []
    async with side.rounds(concurrency=1) as round_:
        with pytest.raises(StoreUnavailable):
            async with round_.delivery(claims[0], now=None) as tx:
                await tx.open()
                pids.append(tx.connection.info.backend_pid)
                await tx.connection.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        async with round_.delivery(claims[1], now=None) as tx:
            await tx.open()
            pids.append(tx.connection.info.backend_pid)
            await tx.connection.execute(insert, (claims[1].event.id,))
            await tx.record("ledger", Outcome.SUCCEEDED)
    await side.close()
    assert pids[0] != pids[1]
    rows = admin.execute(sql.SQL("SELECT event_id FROM {} ORDER BY 1").format(ledger)).fetchall()
    assert [r[0] for r in rows] == [ids[1]]
    assert [r.handler for r in store.records(ids[1])] == ["ledger"]
    assert store.records(ids[0]) == []


@pytest.mark.parametrize("when", ["waiting", "given"])
@pytest.mark.parametrize("store", [{"pool_max_size": 3}], indirect=True)
@pytest.mark.asyncio
async def test_a_cancelled_wait_hands_its_connection_on(store: PostgresStore, when: str) -> None:
    """Three deliveries want the round's one connection: the second is cancelled while it
    waits, or once it was given the connection and before it ran again; either way it takes
    nothing with it, and the third gets the connection."""
    ids = _enqueue(store, 3)
    side = store.async_store()
    claims = await side.claim(batch_size=3, lease=timedelta(seconds=30), now=None)
    order: list[int] = []
    first_in = asyncio.Event()
    first_may_end = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def deliver(round_: AsyncRound, index: int) -> None:
        async with round_.delivery(claims[index], now=None) as tx:
            order.append(index)
            if index == 0:
                first_in.set()
                await first_may_end.wait()
            await tx.record("h", Outcome.SUCCEEDED)
        if index == 0 and when == "given":
            tasks[0].cancel()  # the second was just given the connection, and has not run

    async with side.rounds(concurrency=1) as round_:
        first = asyncio.create_task(deliver(round_, 0))
        await first_in.wait()
        tasks.append(asyncio.create_task(deliver(round_, 1)))
        third = asyncio.create_task(deliver(round_, 2))
        await _until_waiting(round_, 2)
        if when == "waiting":
            tasks[0].cancel()
        first_may_end.set()
        await first
        # A bound, not a timing: without the hand-over the third would wait for ever.
        await asyncio.wait_for(third, timeout=30)
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
    await side.close()
    assert order == [0, 2]
    assert [len(store.records(i)) for i in ids] == [1, 0, 1]


async def _until_waiting(round_: AsyncRound, count: int) -> None:
    """Let the tasks run until ``count`` of them wait for the round's connection."""
    for _ in range(1000):
        if round_.waiting >= count:
            return
        await asyncio.sleep(0)  # one turn of the event loop, not a timed wait
    raise AssertionError(f"never {count} deliveries waiting")
