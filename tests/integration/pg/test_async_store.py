"""The PostgreSQL store's asyncio side against the real server: enqueue through the app's
``psycopg.AsyncConnection`` in its transaction (a FastAPI app, through httpx's ASGI transport),
``async def`` transactional handlers on the delivery's ``AsyncConnection`` and the commit
guard, the hot path called directly, its pool's life (first use, loops, ``close()``), and
database failures under a handler."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Annotated, Any

import httpx
import psycopg
import pytest
import pytest_asyncio
from fastapi import Depends, FastAPI, Request
from psycopg import sql
from psycopg_pool import ConnectionPool
from pydantic import BaseModel

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    HandlerCrashed,
    InvalidEvent,
    LeaseLostError,
    Message,
    Outbox,
    Outcome,
    Reject,
    SchemaError,
    StoreError,
    StoreUnavailable,
)
from outboxkit.core.machine import Publish
from outboxkit.core.model import Claim
from outboxkit_pg import PostgresStore
from outboxkit_pg import aio as pg_aio
from outboxkit_pg.aio import AsyncPostgresStore
from outboxkit_pg.flow import Flow, Statement

from ._workers import wait_until

pytestmark = pytest.mark.pg

LEASE = timedelta(seconds=30)


@pytest_asyncio.fixture
async def side(pg_store: PostgresStore) -> AsyncIterator[AsyncPostgresStore]:
    side = pg_store.async_store()
    yield side
    await side.close()


@pytest.fixture
def orders(pg_store: PostgresStore, admin: psycopg.Connection[Any]) -> sql.Identifier:
    """The app's own table, in the store's schema."""
    name = sql.Identifier(pg_store.names.schema, "orders")
    admin.execute(sql.SQL("CREATE TABLE {} (id bigint NOT NULL)").format(name))
    return name


def order_ids(admin: psycopg.Connection[Any], orders: sql.Identifier) -> list[int]:
    return [r[0] for r in admin.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(orders))]


@contextlib.asynccontextmanager
async def app_connection(url: str, **kwargs: Any) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(url, **kwargs) as conn:
        yield conn


async def committed(side: AsyncPostgresStore, outbox: Outbox, topic: str, payload: Any) -> int:
    """One event enqueued and committed, through the store's own async transaction."""
    async with side.transaction() as conn:
        return await outbox.enqueue_async(conn, topic, payload)


# -- enqueue through the app's AsyncConnection (R1) ---------------------------------------------


class OrderIn(BaseModel):
    id: int
    payload: Any
    fail: bool = False


async def request_connection(request: Request) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """The request's own connection (a dependency)."""
    url: str = request.app.state.database_url
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        yield conn


def shop(outbox: Outbox, url: str, orders: sql.Identifier) -> FastAPI:
    """A FastAPI app whose ``POST /orders`` writes the order row and its event in one
    transaction of the request's own ``AsyncConnection`` (a dependency, as apps make them);
    driven through ``httpx.ASGITransport``: no web server."""
    app = FastAPI()
    app.state.database_url = url
    insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders)

    @app.post("/orders", status_code=201)
    async def create_order(
        order: OrderIn, conn: Annotated[psycopg.AsyncConnection[Any], Depends(request_connection)]
    ) -> dict[str, Any]:
        async with conn.transaction():
            await conn.execute(insert, (order.id,))
            try:
                event_id = await outbox.enqueue_async(conn, "order.placed", order.payload)
            except InvalidEvent as exc:  # a bad event is the request's problem, not the order's
                return {"id": order.id, "event": None, "warning": str(exc)}
            if order.fail:
                raise RuntimeError("the request failed after the enqueue")
        return {"id": order.id, "event": event_id}

    return app


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop")


@pytest.mark.asyncio
async def test_an_endpoint_commits_the_event_with_the_app(
    pg_url: str, pg_store: PostgresStore, orders: sql.Identifier, admin: psycopg.Connection[Any]
) -> None:
    async with client(shop(Outbox(pg_store), pg_url, orders)) as http:
        response = await http.post("/orders", json={"id": 1, "payload": {"id": 1}})
    assert response.status_code == 201
    (event,) = pg_store.events()
    assert (event.id, event.topic, event.payload) == (
        response.json()["event"],
        "order.placed",
        {"id": 1},
    )
    assert order_ids(admin, orders) == [1]


@pytest.mark.asyncio
async def test_an_endpoint_that_raises_leaves_no_event(
    pg_url: str, pg_store: PostgresStore, orders: sql.Identifier, admin: psycopg.Connection[Any]
) -> None:
    async with client(shop(Outbox(pg_store), pg_url, orders)) as http:
        with pytest.raises(RuntimeError, match="after the enqueue"):
            await http.post("/orders", json={"id": 1, "payload": {"id": 1}, "fail": True})
    assert pg_store.stats(now=None).total == 0
    assert order_ids(admin, orders) == []


@pytest.mark.asyncio
async def test_a_bad_payload_is_refused_and_the_transaction_still_commits(
    pg_url: str, pg_store: PostgresStore, orders: sql.Identifier, admin: psycopg.Connection[Any]
) -> None:
    async with client(shop(Outbox(pg_store), pg_url, orders)) as http:
        # JSON carries a NUL character; an event may not (PostgreSQL's jsonb refuses it).
        response = await http.post("/orders", json={"id": 7, "payload": {"note": "a\x00b"}})
    assert response.status_code == 201
    body = response.json()
    assert body["event"] is None and "NUL" in body["warning"]
    assert pg_store.stats(now=None).total == 0
    assert order_ids(admin, orders) == [7]  # the order's own write committed


@pytest.mark.asyncio
async def test_enqueue_many_async_in_the_apps_transaction(
    pg_url: str, pg_store: PostgresStore, orders: sql.Identifier, admin: psycopg.Connection[Any]
) -> None:
    outbox = Outbox(pg_store)
    insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders)
    async with app_connection(pg_url) as conn:  # psycopg's default: no autocommit
        await conn.execute(insert, (1,))
        ids = await outbox.enqueue_many_async(
            conn, [Message("t", {"n": n}, key=f"k{n}") for n in range(50)]
        )
        assert pg_store.stats(now=None).total == 0  # not visible before the app commits
        await conn.rollback()
        assert pg_store.stats(now=None).total == 0
        await conn.execute(insert, (2,))
        ids = await outbox.enqueue_many_async(conn, [("t", {"n": n}) for n in range(50)])
        assert await outbox.enqueue_many_async(conn, []) == []
        await conn.commit()
    assert ids == sorted(ids) and len(ids) == 50
    assert [e.payload["n"] for e in pg_store.events()] == list(range(50))
    assert order_ids(admin, orders) == [2]


@pytest.mark.asyncio
async def test_enqueue_async_refuses_what_it_cannot_write_through_and_the_tx_stays_usable(
    pg_url: str, pg_store: PostgresStore, orders: sql.Identifier, admin: psycopg.Connection[Any]
) -> None:
    outbox = Outbox(pg_store)
    insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders)
    with (
        psycopg.connect(pg_url) as blocking,
        pytest.raises(ConfigurationError, match=r"psycopg\.AsyncConnection"),
    ):
        await outbox.enqueue_async(blocking, "t", {})
    with pytest.raises(ConfigurationError, match=r"psycopg\.AsyncConnection"):
        await outbox.enqueue_async(object(), "t", {})
    async with app_connection(pg_url, autocommit=True) as conn:
        with pytest.raises(ConfigurationError, match=r"autocommit.*async with conn\.transaction"):
            await outbox.enqueue_async(conn, "t", {})
        async with conn.transaction():
            await conn.execute(insert, (1,))
            with pytest.raises(ConfigurationError):
                await outbox.enqueue_async(object(), "t", {})
            await outbox.enqueue_async(conn, "t", {"after": "a refusal"})  # the tx is usable
    closed = await psycopg.AsyncConnection.connect(pg_url)
    await closed.close()
    with pytest.raises(ConfigurationError, match="closed"):
        await outbox.enqueue_async(closed, "t", {})
    assert [e.payload for e in pg_store.events()] == [{"after": "a refusal"}]
    assert order_ids(admin, orders) == [1]


@pytest.mark.asyncio
async def test_the_store_transaction_for_apps_without_a_connection(
    pg_store: PostgresStore, side: AsyncPostgresStore
) -> None:
    outbox = Outbox(pg_store)
    async with side.transaction() as conn:
        assert isinstance(conn, psycopg.AsyncConnection)
        await outbox.enqueue_async(conn, "t", 1)
    with pytest.raises(RuntimeError):
        async with side.transaction() as conn:
            await outbox.enqueue_async(conn, "t", 2)
            raise RuntimeError("rolled back")
    assert [e.payload for e in pg_store.events()] == [1]


# -- async transactional handlers on the delivery's AsyncConnection (R6) ------------------------


def writer_bus(orders: sql.Identifier, behaviour: dict[str, Any]) -> EventBus:
    """One ``async def`` transactional handler writing an order row through ``ctx.connection``,
    then doing what ``behaviour`` says for the event's attempt (``raise``, ``reject``,
    ``follow``: a follow-up event)."""
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders)

    @bus.handler("order", name="writer")
    async def writer(event: Event, ctx: Any) -> None:
        assert isinstance(ctx.connection, psycopg.AsyncConnection)
        await ctx.connection.execute(insert, (event.payload["id"],))
        action = behaviour.get(ctx.attempt)
        if action == "follow":
            ctx.enqueue("order.followed", {"of": event.id})
        if action == "raise":
            raise RuntimeError(f"attempt {ctx.attempt} failed")
        if action == "reject":
            raise Reject("not this one")

    return bus


@pytest.mark.asyncio
async def test_an_async_handlers_write_commits_with_its_record_exactly_once(
    pg_store: PostgresStore,
    side: AsyncPostgresStore,
    orders: sql.Identifier,
    admin: psycopg.Connection[Any],
) -> None:
    outbox = Outbox(pg_store, writer_bus(orders, {}))
    event_id = await committed(side, outbox, "order", {"id": 5})
    poller = outbox.async_poller()
    report = await poller.run_once()
    assert report.published == [event_id]
    assert (await poller.run_once()).claimed == []
    assert order_ids(admin, orders) == [5]
    assert [(r.handler, r.outcome) for r in pg_store.records(event_id)] == [
        ("writer", Outcome.SUCCEEDED)
    ]


@pytest.mark.asyncio
async def test_an_async_handler_that_raises_rolls_its_write_back_and_is_retried(
    pg_store: PostgresStore,
    side: AsyncPostgresStore,
    orders: sql.Identifier,
    admin: psycopg.Connection[Any],
) -> None:
    outbox = Outbox(pg_store, writer_bus(orders, {1: "raise"}))
    event_id = await committed(side, outbox, "order", {"id": 5})
    poller = outbox.async_poller(backoff=0)
    first = await poller.run_once()
    assert first.retried == [event_id]
    (failed,) = first.deliveries
    assert failed.outcome is Outcome.FAILED and "attempt 1 failed" in (failed.error or "")
    assert order_ids(admin, orders) == []  # rolled back with the delivery
    assert pg_store.records(event_id) == []
    second = await poller.run_once()
    assert second.published == [event_id]
    assert order_ids(admin, orders) == [5]
    assert [r.attempt for r in pg_store.records(event_id)] == [2]


@pytest.mark.asyncio
async def test_reject_rolls_the_write_back_and_records_the_rejection(
    pg_store: PostgresStore,
    side: AsyncPostgresStore,
    orders: sql.Identifier,
    admin: psycopg.Connection[Any],
) -> None:
    outbox = Outbox(pg_store, writer_bus(orders, {1: "reject"}))
    event_id = await committed(side, outbox, "order", {"id": 5})
    report = await outbox.async_poller().run_once()
    assert report.published == [event_id]
    assert order_ids(admin, orders) == []
    (record,) = pg_store.records(event_id)
    assert (record.outcome, record.reason) == (Outcome.REJECTED, "not this one")


@pytest.mark.asyncio
async def test_a_follow_up_commits_with_the_record(
    pg_store: PostgresStore,
    side: AsyncPostgresStore,
    orders: sql.Identifier,
    admin: psycopg.Connection[Any],
) -> None:
    outbox = Outbox(pg_store, writer_bus(orders, {1: "follow"}))
    event_id = await committed(side, outbox, "order", {"id": 5})
    report = await outbox.async_poller().run_once()
    assert report.published == [event_id]
    followed = [e for e in pg_store.events() if e.topic == "order.followed"]
    assert [e.payload for e in followed] == [{"of": event_id}]
    assert order_ids(admin, orders) == [5]


@pytest.mark.asyncio
async def test_a_follow_up_of_a_failed_attempt_is_rolled_back(
    pg_store: PostgresStore,
    side: AsyncPostgresStore,
    orders: sql.Identifier,
    admin: psycopg.Connection[Any],
) -> None:
    bus = EventBus()

    @bus.handler("order", name="writer")
    async def writer(event: Event, ctx: Any) -> None:
        ctx.enqueue("order.followed", {"attempt": ctx.attempt})
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    outbox = Outbox(pg_store, bus)
    await committed(side, outbox, "order", {"id": 5})
    poller = outbox.async_poller(backoff=0)
    await poller.run_once()
    await poller.run_once()
    followed = [e.payload for e in pg_store.events() if e.topic == "order.followed"]
    assert followed == [{"attempt": 2}]


@pytest.mark.parametrize(
    "breakage", ["commit", "sql-commit", "sql-rollback", "close", "swallowed-error"]
)
@pytest.mark.asyncio
async def test_an_async_handler_that_ends_its_transaction_is_a_handler_crash(
    pg_store: PostgresStore,
    side: AsyncPostgresStore,
    orders: sql.Identifier,
    admin: psycopg.Connection[Any],
    breakage: str,
) -> None:
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (id) VALUES (1)").format(orders)

    @bus.handler("t", name="breaker")
    async def breaker(event: Event, ctx: Any) -> None:
        conn: psycopg.AsyncConnection[Any] = ctx.connection
        await conn.execute(insert)
        if breakage == "commit":
            await conn.commit()  # the commit guard refuses it: everything rolls back
        elif breakage == "sql-commit":
            await conn.execute("COMMIT")
        elif breakage == "sql-rollback":
            await conn.execute("ROLLBACK")
        elif breakage == "close":
            await conn.close()
        else:
            with contextlib.suppress(psycopg.Error):
                await conn.execute("SELECT no_such_column FROM no_such_table")

    outbox = Outbox(pg_store, bus)
    event_id = await committed(side, outbox, "t", {})
    report = await outbox.async_poller().run_once()
    (delivery,) = report.deliveries
    assert delivery.outcome is Outcome.FAILED
    assert isinstance(delivery.exception, HandlerCrashed)
    assert report.retried == [event_id]
    assert pg_store.records(event_id) == []
    assert order_ids(admin, orders) == []  # the handler's write never committed


@pytest.mark.asyncio
async def test_the_handlers_own_failing_sql_is_the_handlers_failure(
    pg_store: PostgresStore, side: AsyncPostgresStore
) -> None:
    bus = EventBus()

    @bus.handler("t", name="divider")
    async def divider(event: Event, ctx: Any) -> None:
        await ctx.connection.execute("SELECT 1/0")

    outbox = Outbox(pg_store, bus)
    event_id = await committed(side, outbox, "t", {})
    report = await outbox.async_poller().run_once()
    (delivery,) = report.deliveries
    assert delivery.outcome is Outcome.FAILED
    assert "DivisionByZero" in (delivery.error or "")
    assert report.retried == [event_id]


@pytest.mark.asyncio
async def test_a_connection_lost_under_an_async_handler_is_the_databases_failure(
    pg_store: PostgresStore, side: AsyncPostgresStore, admin: psycopg.Connection[Any]
) -> None:
    bus = EventBus()

    @bus.handler("t", name="victim")
    async def victim(event: Event, ctx: Any) -> None:
        # The server ends the delivery's session while the handler runs; the handler then
        # fails on it, as any code would.
        pid = ctx.connection.info.backend_pid
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await ctx.connection.execute("SELECT 1")

    outbox = Outbox(pg_store, bus)
    event_id = await committed(side, outbox, "t", {})
    with pytest.raises(StoreUnavailable, match="unavailable"):
        await outbox.async_poller().run_once()
    assert pg_store.records(event_id) == []  # neither success nor failure is recorded
    event = pg_store.get(event_id)
    assert event is not None and event.locked_until is not None  # its lease brings it back
    assert (await side.claim(batch_size=10, lease=LEASE, now=None)) == []  # the store works on


@pytest.mark.asyncio
async def test_the_handlers_own_idle_timeout_is_the_handlers_failure(
    pg_store: PostgresStore, side: AsyncPostgresStore, admin: psycopg.Connection[Any]
) -> None:
    bus = EventBus()
    gone = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"

    @bus.handler("t", name="idler")
    async def idler(event: Event, ctx: Any) -> None:
        conn = ctx.connection
        await conn.execute("SET LOCAL idle_in_transaction_session_timeout = '50ms'")
        pid = conn.info.backend_pid
        # Idle in the delivery transaction until the server has ended the session (25P03).
        assert await asyncio.to_thread(
            wait_until, lambda: admin.execute(gone, (pid,)).fetchone() == (0,), 30, 0.02
        )
        await conn.execute("SELECT 1")

    outbox = Outbox(pg_store, bus)
    event_id = await committed(side, outbox, "t", {})
    report = await outbox.async_poller(backoff=0).run_once()
    (delivery,) = report.deliveries
    assert delivery.outcome is Outcome.FAILED  # retried, then dead-lettered: not an outage
    assert report.retried == [event_id]


# -- the hot path, called directly ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_claim_extend_settle_release_on_the_async_side(
    pg_store: PostgresStore, side: AsyncPostgresStore
) -> None:
    outbox = Outbox(pg_store)
    async with side.transaction() as conn:
        ids = await outbox.enqueue_many_async(conn, [("t", n) for n in range(3)])
    claims = await side.claim(batch_size=10, lease=LEASE, now=None)
    assert [c.event.id for c in claims] == ids
    assert all(c.attempt == 1 for c in claims)
    kept = await side.extend(claims, lease=timedelta(minutes=5), now=None)
    assert [c.token for c in kept] == [c.token for c in claims]
    assert all(k.locked_until > c.locked_until for k, c in zip(kept, claims, strict=True))
    first, *rest = kept
    assert await side.settle_many([(first, Publish(), None)], now=None) == [True]
    assert await side.settle_many([(first, Publish(), None)], now=None) == [False]  # fenced
    assert await side.release(rest, now=None) == 2
    assert await side.release(rest, now=None) == 0
    released = [pg_store.get(c.event.id) for c in rest]
    assert [(e.attempts, e.locked_until) for e in released if e] == [(0, None), (0, None)]
    assert await side.extend([], lease=LEASE, now=None) == []
    assert await side.settle_many([], now=None) == []
    assert await side.release([], now=None) == 0


async def _stale_statement_fails(
    deliveries: Any, claim: Claim, insert: sql.Composed, n: int
) -> None:
    """A delivery of stale ``claim`` whose handler takes the connection: its statement fails,
    and the delivery is lease-lost."""
    with pytest.raises(LeaseLostError, match="stale"):
        async with deliveries.delivery(claim, now=None) as tx:
            await tx.open()
            with pytest.raises(psycopg.errors.InFailedSqlTransaction):
                await tx.connection.execute(insert, (n,))


@pytest.mark.asyncio
async def test_a_stale_token_is_lease_lost_and_nothing_is_written(
    pg_store: PostgresStore,
    side: AsyncPostgresStore,
    orders: sql.Identifier,
    admin: psycopg.Connection[Any],
) -> None:
    """The opening is lazy: a stale token found after the handler took the connection fails
    the transaction (or savepoint) it opened, so the handler's own statements fail, and the
    delivery is lease-lost whatever the handler made of it; nothing it sent is written."""
    insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders)
    await committed(side, Outbox(pg_store), "t", {})
    (claim,) = await side.claim(batch_size=1, lease=LEASE, now=None)
    await side.release([claim], now=None)
    await _stale_statement_fails(side, claim, insert, 1)  # the opening goes before it
    with pytest.raises(LeaseLostError, match="stale"):  # the handler caught it: no matter
        async with side.delivery(claim, now=None) as tx:
            await tx.open()
            with contextlib.suppress(psycopg.Error):
                await tx.connection.execute(insert, (2,))
    with pytest.raises(LeaseLostError, match="stale"):  # never opened: its fenced record
        async with side.delivery(claim, now=None) as tx:
            await tx.record("h", Outcome.SUCCEEDED)
    assert pg_store.records(claim.event.id) == []
    async with side.batch(now=None) as batch:
        await _stale_statement_fails(batch, claim, insert, 3)
        async with batch.delivery(claim, now=None) as tx:  # never opened: kept by the batch
            await tx.record("h", Outcome.SUCCEEDED)
        assert await batch.settle_many([(claim, Publish(), None)], now=None) == [False]
    assert pg_store.records(claim.event.id) == []
    assert order_ids(admin, orders) == []
    # In a batch, the stale delivery's savepoint is rolled back: the batch goes on and commits
    # the next delivery's writes.
    (fresh,) = await side.claim(batch_size=1, lease=LEASE, now=None)
    async with side.batch(now=None) as batch:
        await _stale_statement_fails(batch, claim, insert, 4)
        async with batch.delivery(fresh, now=None) as tx:
            await tx.open()
            await tx.connection.execute(insert, (5,))
            await tx.record("h", Outcome.SUCCEEDED)
        assert await batch.settle_last([(fresh, Publish(), None)], now=None) == [True]
    assert [r.handler for r in pg_store.records(claim.event.id)] == ["h"]
    assert order_ids(admin, orders) == [5]


@pytest.mark.asyncio
async def test_a_lazy_opening_the_database_fails_fails_the_handlers_statements_too(
    pg_store: PostgresStore,
    side: AsyncPostgresStore,
    orders: sql.Identifier,
    admin: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An opening that fails on the database after the handler took the connection leaves
    the handler's statements failing, and the delivery fails as the database's error (not the
    handler's); nothing is written and the connection goes on, rolled back."""
    insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders)
    await committed(side, Outbox(pg_store), "t", {})
    (claim,) = await side.claim(batch_size=1, lease=LEASE, now=None)
    opening = Flow.opening

    def failing(flow: Flow[Any]) -> list[Statement]:
        return [*opening(flow), Statement(b"SELECT 1 / 0")]

    monkeypatch.setattr(Flow, "opening", failing)
    with pytest.raises(StoreError, match="division by zero"):
        async with side.delivery(claim, now=None) as tx:
            await tx.open()
            conn = tx.connection
            with pytest.raises(psycopg.errors.InFailedSqlTransaction):
                await conn.execute(insert, (1,))
            await tx.record("h", Outcome.SUCCEEDED)
    assert not conn.closed  # rolled back, not discarded
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    monkeypatch.setattr(Flow, "opening", opening)
    async with side.delivery(claim, now=None) as tx:
        await tx.open()
        await tx.connection.execute(insert, (2,))
        await tx.record("h", Outcome.SUCCEEDED)
    assert order_ids(admin, orders) == [2]
    assert [r.handler for r in pg_store.records(claim.event.id)] == ["h"]


@pytest.mark.asyncio
async def test_a_delivery_never_opened_is_its_fenced_record_alone(
    pg_store: PostgresStore, side: AsyncPostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await committed(side, Outbox(pg_store), "t", {})
    (claim,) = await side.claim(batch_size=1, lease=LEASE, now=None)
    sent: list[list[bytes]] = []
    real = pg_aio._sync

    async def spy(conn: Any, statements: Any, **kwargs: Any) -> Any:
        sent.append([s.query for s in statements])
        return await real(conn, statements, **kwargs)

    monkeypatch.setattr(pg_aio, "_sync", spy)
    async with side.delivery(claim, now=None) as tx:
        with pytest.raises(StoreError, match="await open"):
            tx.connection  # noqa: B018 - not open yet
        await tx.record("h", Outcome.SUCCEEDED)
    assert sent == [[pg_store.dialect.queries["insert_record_fenced"]]]
    assert [r.handler for r in pg_store.records(claim.event.id)] == ["h"]
    sent.clear()
    await committed(side, Outbox(pg_store), "t", {})
    (claim,) = await side.claim(batch_size=1, lease=LEASE, now=None)
    async with side.delivery(claim, now=None) as tx:
        await tx.open()
        await tx.open()  # idempotent
        await tx.connection.execute("SELECT 1")
        await tx.record("h", Outcome.SUCCEEDED)
    assert len(sent) == 2  # the opening sync, then the record with the commit
    assert [r.handler for r in pg_store.records(claim.event.id)] == ["h"]


@pytest.mark.asyncio
async def test_a_delivery_record_is_written_once(
    pg_store: PostgresStore, side: AsyncPostgresStore
) -> None:
    await committed(side, Outbox(pg_store), "t", {})
    (claim,) = await side.claim(batch_size=1, lease=LEASE, now=None)
    async with side.delivery(claim, now=None) as tx:
        await tx.record("h", Outcome.SUCCEEDED)
    with pytest.raises(StoreError, match="already has a delivery record"):
        async with side.delivery(claim, now=None) as tx:
            await tx.record("h", Outcome.SUCCEEDED)
    assert [r.handler for r in pg_store.records(claim.event.id)] == ["h"]


@pytest.mark.asyncio
async def test_naive_instants_are_refused(side: AsyncPostgresStore) -> None:
    from datetime import datetime

    with pytest.raises(ConfigurationError, match="timezone-aware"):
        await side.claim(batch_size=1, lease=LEASE, now=datetime(2030, 1, 1))


# -- schema, pool, loops, close -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_unmigrated_schema_is_a_schema_error(pg_url: str, pg_schema: str) -> None:
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        with pytest.raises(SchemaError, match="migrate"):
            await store.async_store().claim(batch_size=1, lease=LEASE, now=None)
        async with app_connection(pg_url) as conn:
            with pytest.raises(SchemaError, match="migrate"):
                await Outbox(store).enqueue_async(conn, "t", {})
        await store.async_store().close()
    finally:
        store.close()


@pytest.mark.asyncio
async def test_an_unreachable_server_is_named_without_the_password() -> None:
    store = PostgresStore(
        "postgresql://app:s3cr3t-pw@127.0.0.1:1/app", pool_timeout=0.5, pool_min_size=1
    )
    try:
        with pytest.raises(StoreUnavailable) as raised:
            await store.async_store().claim(batch_size=1, lease=LEASE, now=None)
        message = str(raised.value)
        assert "cannot connect to PostgreSQL at 127.0.0.1:1/app" in message
        assert "s3cr3t" not in message
        await store.async_store().close()
    finally:
        store.close()


def test_the_async_side_is_cached_and_follows_the_event_loop(
    pg_store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    assert pg_store.capabilities.asyncio
    side = pg_store.async_store()
    assert pg_store.async_store() is side

    async def use() -> int:
        async with side.transaction() as conn:
            return await Outbox(pg_store).enqueue_async(conn, "t", {})

    # Two event loops one after the other (asyncio.run twice): the first one's pool ended with
    # its loop; the second opens another.
    first = asyncio.run(use())
    second = asyncio.run(use())
    assert second == first + 1
    pg_store.close()
    with pytest.raises(StoreError, match="closed"):
        pg_store.async_store()
    with pytest.raises(StoreError, match="closed"):
        asyncio.run(use())


def test_a_pool_closed_with_its_tasks_reopens_on_the_same_loop(pg_store: PostgresStore) -> None:
    side = pg_store.async_store()
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(side.claim(batch_size=1, lease=LEASE, now=None)) == []
        # A framework's shutdown cancelling every task of a loop that lives on: the pool's own
        # tasks end, and with them the pool.
        pending = asyncio.all_tasks(loop)
        assert pending  # the pool's workers and its closer
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        assert loop.run_until_complete(side.claim(batch_size=1, lease=LEASE, now=None)) == []
        loop.run_until_complete(side.close())
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_store_close_from_another_thread_closes_the_async_pool(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]
) -> None:
    name = f"okt_async_{pg_schema[-8:]}"
    url = pg_url + ("&" if "?" in pg_url else "?") + f"application_name={name}"
    store = PostgresStore(url, schema=pg_schema, pool_min_size=2)
    store.migrate()
    side = store.async_store()
    waiter = side.make_waiter()
    assert waiter is not None
    await waiter.wait(0)  # connects its listener
    await side.claim(batch_size=1, lease=LEASE, now=None)
    count = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"

    def connections() -> int:
        row = admin.execute(count, (name,)).fetchone()
        return int(row[0]) if row else 0

    assert connections() >= 2
    await asyncio.to_thread(store.close)  # blocking code elsewhere, while this loop runs
    assert await asyncio.to_thread(wait_until, lambda: connections() == 0, 30, 0.05)
    with pytest.raises(StoreError, match="closed"):
        await side.claim(batch_size=1, lease=LEASE, now=None)


def test_store_close_after_the_loop_ended_closes_the_sockets(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]
) -> None:
    name = f"okt_ended_{pg_schema[-8:]}"
    url = pg_url + ("&" if "?" in pg_url else "?") + f"application_name={name}"
    store = PostgresStore(url, schema=pg_schema, pool_min_size=2)
    store.migrate()

    waiters: list[Any] = []  # kept alive, as a poller keeps its own

    async def use() -> None:
        side = store.async_store()
        waiters.append(side.make_waiter())
        await waiters[0].wait(0)  # connects its listener
        await side.claim(batch_size=1, lease=LEASE, now=None)

    asyncio.run(use())  # the loop ends with the pool and the listener still open
    count = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
    store.close()
    assert wait_until(lambda: admin.execute(count, (name,)).fetchone() == (0,), 30, 0.05)


@pytest.mark.asyncio
async def test_two_live_loops_cannot_share_the_async_side(pg_store: PostgresStore) -> None:
    side = pg_store.async_store()
    await side.claim(batch_size=1, lease=LEASE, now=None)
    failure: list[BaseException] = []

    def elsewhere() -> None:
        try:
            asyncio.run(side.claim(batch_size=1, lease=LEASE, now=None))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(30)
    assert len(failure) == 1 and isinstance(failure[0], ConfigurationError)
    assert "another event loop" in str(failure[0])
    await side.close()  # released here, any loop may use it next
    assert (
        await asyncio.to_thread(asyncio.run, side.claim(batch_size=1, lease=LEASE, now=None)) == []
    )


@pytest.fixture
def app_pool(pg_url: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(pg_url, min_size=1, max_size=2, open=True) as pool:
        yield pool


@pytest.mark.asyncio
async def test_an_apps_pool_gives_its_conninfo_to_the_async_pool(
    app_pool: ConnectionPool[Any], pg_schema: str
) -> None:
    store = PostgresStore(app_pool, schema=pg_schema)
    try:
        store.migrate()
        assert store.capabilities.asyncio
        bus = EventBus()
        handled: list[int] = []

        @bus.handler("t", name="h")
        async def h(event: Event, ctx: Any) -> None:
            assert isinstance(ctx.connection, psycopg.AsyncConnection)
            handled.append(event.id)

        outbox = Outbox(store, bus)
        side = store.async_store()
        async with side.transaction() as conn:
            event_id = await outbox.enqueue_async(conn, "t", {})
        assert (await outbox.async_poller().run_once()).published == [event_id]
        assert handled == [event_id]
        await side.close()
    finally:
        store.close()
    assert not app_pool.closed
