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

from outboxkit import (
    Event,
    EventBus,
    FrozenClock,
    Outbox,
    Outcome,
    StoreError,
    StoreUnavailable,
)
from outboxkit_pg import PostgresStore
from outboxkit_pg.aio import AsyncPostgresStore, AsyncRound
from outboxkit_pg.pipeline import RecordPipeline
from outboxkit_pg.pool import AsyncPool

from .conftest import migrated_store
from .test_async_poller import two_handlers
from .test_rounds_pg import _enqueue, _records

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
        assert recorded == (handlers or ["ledger", "mailer"])
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
    ids = _enqueue(store, 30, topic="order")
    outbox = Outbox(store, two_handlers(ledger, []), load_entry_points=False)
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
    bus = two_handlers(ledger, [])

    @bus.handler("order", name="slow", transactional=False)
    async def slow(event: Event, ctx: Any) -> None:
        clock.advance(20)  # past half the lease: the next handler's start extends it

    original = AsyncRound.extend

    async def extend(self: AsyncRound, claims: Any, **kwargs: Any) -> Any:
        extended.append(len(claims))
        return await original(self, claims, **kwargs)

    ids = _enqueue(store, 12, topic="order")
    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    poller = outbox.async_poller(concurrency=4, batch_size=12, lease=30)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AsyncRound, "extend", extend)
        report = await poller.run_once()
    await store.async_store().close()
    assert sorted(report.published) == ids
    assert extended  # the extensions ran on the round (its one connection)
    _check_once(store, admin, ledger, ids, handlers=["ledger", "mailer", "slow"])


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


def _pipelined(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """The records sent pipelined, by the backend they went to (event ids, in order)."""
    sent: dict[int, list[int]] = {}
    original = RecordPipeline.send

    def send(self: RecordPipeline, claim: Any, params: Any) -> None:
        sent.setdefault(self.pgconn.backend_pid, []).append(claim.event.id)
        original(self, claim, params)

    monkeypatch.setattr(RecordPipeline, "send", send)
    return sent


@pytest.mark.parametrize("store", [{"pool_max_size": 6}], indirect=True)
@pytest.mark.asyncio
async def test_records_are_pipelined_on_the_rounds_connections_and_read_before_settling(
    store: PostgresStore, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that never takes the connection: its record is sent without waiting, on up
    to ``concurrency`` connections (a new one while every idle one has records in flight);
    the records of every connection are read back before the round settles."""
    sent = _pipelined(monkeypatch)
    steps: list[tuple[str, int]] = []
    finish = RecordPipeline.finish

    def finished(self: RecordPipeline) -> None:
        steps.append(("read back", self.pgconn.backend_pid))
        finish(self)

    settle_many_on = AsyncPostgresStore.settle_many_on

    async def settling(self: AsyncPostgresStore, conn: Any, *args: Any) -> Any:
        steps.append(("settle", conn.info.backend_pid))
        return await settle_many_on(self, conn, *args)

    monkeypatch.setattr(RecordPipeline, "finish", finished)
    monkeypatch.setattr(AsyncPostgresStore, "settle_many_on", settling)
    bus = EventBus()
    bus.subscribe("t", _noop, name="h", transactional=False)
    ids = _enqueue(store, 40)
    report = (
        await Outbox(store, bus, load_entry_points=False)
        .async_poller(concurrency=4, batch_size=40)
        .run_once()
    )
    await store.async_store().close()
    assert sorted(report.published) == ids
    assert sorted(i for sent_on in sent.values() for i in sent_on) == ids
    assert 2 <= len(sent) <= 4  # spread over the round's connections, at most concurrency
    settled_at = steps.index(next(step for step in steps if step[0] == "settle"))
    assert {pid for what, pid in steps[:settled_at] if what == "read back"} == set(sent)
    assert _records(admin, store) == [(i, "h") for i in ids]


async def _noop(event: Event, ctx: Any) -> None:
    pass


@pytest.mark.asyncio
async def test_a_record_the_token_refuses_is_a_lost_lease_and_nothing_is_settled(
    store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    events = sql.Identifier(store.names.schema, store.names.events)
    bus = EventBus()

    @bus.handler("t", name="h", transactional=False)
    async def taken_over(event: Event, ctx: Any) -> None:
        if event.payload["n"] == 1:  # another poller takes the lease over meanwhile
            admin.execute(
                sql.SQL("UPDATE {} SET claim_token = gen_random_uuid() WHERE id = %s").format(
                    events
                ),
                (event.id,),
            )

    ids = _enqueue(store, 3)
    report = await Outbox(store, bus, load_entry_points=False).async_poller().run_once()
    await store.async_store().close()
    assert sorted(report.published) == [ids[0], ids[2]]
    assert report.lease_lost == [ids[1]]
    assert _records(admin, store) == [(ids[0], "h"), (ids[2], "h")]
    (stolen,) = [e for e in store.events() if e.id == ids[1]]
    assert stolen.published_at is None


@pytest.mark.asyncio
async def test_a_failed_record_ends_the_round_without_settling_and_recovers_by_the_lease(
    store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    clock = FrozenClock()
    runs: list[int] = []
    bus = EventBus()

    @bus.handler("t", name="h", transactional=False)
    async def handler(event: Event, ctx: Any) -> None:
        runs.append(event.payload["n"])
        if event.payload["n"] == 1:  # a record of h appears meanwhile: the pipelined
            deliveries = sql.Identifier(store.names.schema, store.names.deliveries)
            admin.execute(  # insert fails on the primary key
                sql.SQL(
                    "INSERT INTO {} (event_id, handler, outcome, attempt, recorded_at)"
                    " VALUES (%s, 'h', 'succeeded', 1, now())"
                ).format(deliveries),
                (event.id,),
            )

    ids = _enqueue(store, 3)
    poller = Outbox(store, bus, clock=clock, load_entry_points=False).async_poller(lease=30)
    with pytest.raises(StoreError, match=f"event {ids[1]} already has a delivery record"):
        await poller.run_once()
    assert store.stats(now=clock.now()).published == 0  # nothing settled
    clock.advance(timedelta(seconds=31))  # the leases run out
    report = await poller.run_once()
    await store.async_store().close()
    assert sorted(report.published) == ids
    assert runs == [0, 1, 2]  # each recorded once: none runs again
    assert _records(admin, store) == [(i, "h") for i in ids]


@pytest.mark.asyncio
async def test_a_connection_lost_with_records_unanswered_settles_nothing(
    store: PostgresStore, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FrozenClock()
    sent = _pipelined(monkeypatch)
    runs: list[int] = []
    killed: list[int] = []
    bus = EventBus()

    @bus.handler("t", name="h", transactional=False)
    async def handler(event: Event, ctx: Any) -> None:
        n = event.payload["n"]
        runs.append(n)
        if n == 3 and not killed:  # the server ends the connections the records went to
            killed.extend(sent)
            for pid in killed:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    ids = _enqueue(store, 5)
    poller = Outbox(store, bus, clock=clock, load_entry_points=False).async_poller(lease=30)
    with pytest.raises(StoreUnavailable):
        await poller.run_once()
    assert store.stats(now=clock.now()).published == 0  # nothing settled past the loss
    recorded = {event_id for event_id, _ in _records(admin, store)}
    first = list(runs)
    assert first[:4] == [0, 1, 2, 3]
    assert {ids[n] for n in first} >= recorded
    clock.advance(timedelta(seconds=31))
    report = await poller.run_once()
    await store.async_store().close()
    assert sorted(report.published) == ids
    assert _records(admin, store) == [(i, "h") for i in ids]  # one record each
    # Run again: exactly the events whose record had not committed before the loss.
    assert runs[len(first) :] == [n for n, i in enumerate(ids) if i not in recorded]


@pytest.mark.asyncio
async def test_deliveries_that_open_read_the_pipelined_records_back_first(
    store: PostgresStore, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transactional handler that takes the connection (its delivery opens) after pipelined
    records reads them back first; a failing one rolls back, after which psycopg deallocates
    every prepared statement: the next pipelined record prepares its statement again. One that
    never takes it opens nothing: its record is pipelined too."""
    sent = _pipelined(monkeypatch)
    table = sql.Identifier(store.names.schema, "ledger")
    admin.execute(sql.SQL("CREATE TABLE {} (n bigint)").format(table))
    bus = EventBus()

    @bus.handler("t", name="writes")
    async def writes(event: Event, ctx: Any) -> None:
        n = event.payload["n"]
        if n % 3 == 1:
            await ctx.connection.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(table), (n,))
        if n % 3 == 2:
            await ctx.connection.execute("SELECT 1")
            raise RuntimeError("rolled back")

    @bus.handler("t", name="notes", transactional=False)
    async def notes(event: Event, ctx: Any) -> None:
        pass

    ids = _enqueue(store, 9)
    report = await Outbox(store, bus, load_entry_points=False).async_poller().run_once()
    await store.async_store().close()
    assert sorted(report.published) == [ids[n] for n in range(9) if n % 3 != 2]
    assert sorted(report.retried) == [ids[n] for n in range(9) if n % 3 == 2]
    # Every "notes" record, and the records of "writes" where it never took the connection.
    assert sorted(i for on in sent.values() for i in on) == sorted(
        ids + [i for n, i in enumerate(ids) if n % 3 == 0]
    )
    rows = admin.execute(sql.SQL("SELECT n FROM {} ORDER BY n").format(table)).fetchall()
    assert [r[0] for r in rows] == [1, 4, 7]
    expected = [
        (i, h) for n, i in enumerate(ids) for h in ("notes", "writes") if n % 3 != 2 or h == "notes"
    ]
    assert _records(admin, store) == expected
