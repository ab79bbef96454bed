"""R17 and R18 on PostgreSQL, on every connection source (the store's own pool, a psycopg pool
of the app's, a SQLAlchemy engine) and in every mode (per event, per batch, asyncio).

R17, the delivery transaction's integrity: a handler that rolls its delivery transaction back
(``ctx.connection.rollback()``, psycopg's usual recovery from a failed statement, or a raw
``ROLLBACK``) and writes again has failed its delivery: nothing it wrote commits, no record is
written, and it is retried. Before, on an app's pool the writes after the rollback committed
with a success record (the earlier ones lost), and on the store's own autocommit connections
each write after the rollback committed at once, on every attempt. In ``per_batch`` such a
handler costs its own delivery only: the batch goes on, and the events whose work the rollback
took with it are handed back and delivered again.

R18, no session state crosses deliveries: a handler's ``SET ROLE``, ``SET statement_timeout``
and ``SET search_path`` are gone before the next delivery on the same connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg_pool import ConnectionPool

from outboxkit import (
    BatchRolledBack,
    Event,
    EventBus,
    FrozenClock,
    HandlerCrashed,
    Outbox,
    Outcome,
    open_store,
)
from outboxkit_pg import PostgresStore

SOURCES = ["own-pool", "app-pool", "engine"]
MODES = ["per_event", "per_batch", "asyncio"]


@contextmanager
def opened(source: str, url: str, schema: str, *, size: int = 4) -> Iterator[Any]:
    """The store on ``source``, migrated; what it was opened on is closed afterwards."""
    if source == "own-pool":
        store: Any = PostgresStore(url, schema=schema, pool_min_size=1, pool_max_size=size)
        try:
            store.migrate()
            yield store
        finally:
            store.close()
    elif source == "app-pool":
        with ConnectionPool(url, min_size=1, max_size=size, open=True) as pool:
            store = PostgresStore(pool, schema=schema)
            try:
                store.migrate()
                yield store
            finally:
                store.close()
    else:
        from sqlalchemy import create_engine

        engine = create_engine(
            "postgresql+psycopg://" + url.split("://", 1)[1], pool_size=size, max_overflow=0
        )
        try:
            store = open_store(engine, schema=schema)
            try:
                store.migrate()
                yield store
            finally:
                store.close()
        finally:
            engine.dispose()


@pytest.fixture
def ledger(admin: psycopg.Connection[Any], pg_schema: str) -> sql.Composed:
    """An app table the handlers write to (no unique key: a doubled write shows)."""
    table = sql.Identifier(pg_schema, "ledger")
    admin.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(pg_schema)))
    admin.execute(sql.SQL("CREATE TABLE {} (event_id bigint, label text)").format(table))
    return sql.SQL("INSERT INTO {} (event_id, label) VALUES (%s, %s)").format(table)


def rows_of(admin: psycopg.Connection[Any], schema: str) -> list[tuple[int, str]]:
    table = sql.Identifier(schema, "ledger")
    query = sql.SQL("SELECT event_id, label FROM {} ORDER BY event_id, label").format(table)
    return [(int(r[0]), str(r[1])) for r in admin.execute(query).fetchall()]


def drain(outbox: Outbox, clock: FrozenClock, mode: str, rounds: int = 12) -> list[Any]:
    """Run rounds until nothing is claimed, moving the clock past every backoff."""
    reports = []
    for _ in range(rounds):
        if mode == "asyncio":
            report = asyncio.run(outbox.async_poller().run_once())
        else:
            report = outbox.poller(transaction=mode).run_once()
        if not report.claimed:
            break
        reports.append(report)
        clock.advance(60)
    return reports


def recovering_handler(bus: EventBus, insert: sql.Composed, how: str, *, asyncio_: bool) -> None:
    """A handler that writes, fails a statement, recovers by rolling its transaction back
    (``how``: psycopg's ``rollback()`` or a raw ``ROLLBACK``), writes again and returns."""

    if asyncio_:

        @bus.handler("t", name="ledger")
        async def ledger_async(event: Event, ctx: Any) -> None:
            conn = ctx.connection
            await conn.execute(insert, (event.id, "before"))
            try:
                await conn.execute("SELECT 1/0")
            except pg_errors.DivisionByZero:
                if how == "rollback()":
                    await conn.rollback()
                else:
                    await conn.execute("ROLLBACK")
            await conn.execute(insert, (event.id, "after"))

        return

    @bus.handler("t", name="ledger")
    def ledger(event: Event, ctx: Any) -> None:
        conn = ctx.connection
        conn.execute(insert, (event.id, "before"))
        try:
            conn.execute("SELECT 1/0")
        except pg_errors.DivisionByZero:
            if how == "rollback()":
                conn.rollback()
            else:
                conn.execute("ROLLBACK")
        conn.execute(insert, (event.id, "after"))


@pytest.mark.parametrize("how", ["rollback()", "raw ROLLBACK"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", SOURCES)
def test_a_handler_that_rolls_back_and_writes_again_commits_nothing_on_any_attempt(
    source: str,
    mode: str,
    how: str,
    pg_url: str,
    pg_schema: str,
    ledger: sql.Composed,
    admin: psycopg.Connection[Any],
) -> None:
    """Items 3 and 4: the handler's writes before and after its rollback are both lost with
    its delivery; no record; after ``max_retries`` the event is dead, and the table holds
    nothing of it (before: 1 row with a success record on an app's pool, 3 rows of a dead
    event on the store's own)."""
    with opened(source, pg_url, pg_schema) as store:
        if mode == "asyncio" and not store.capabilities.asyncio:
            pytest.skip(f"{source}: the store has no asyncio side")
        bus = EventBus()
        recovering_handler(bus, ledger, how, asyncio_=mode == "asyncio")
        clock = FrozenClock()
        outbox = Outbox(store, bus, clock=clock, max_retries=2)
        with store.transaction() as conn:
            event_id = outbox.enqueue(conn, "t", {"n": 1})
        reports = drain(outbox, clock, mode)
        deliveries = [d for r in reports for d in r.deliveries]
        assert [d.outcome for d in deliveries] == [Outcome.FAILED] * 3
        # Failed for the rollback: found by the store (HandlerCrashed), or refused by psycopg
        # inside the batch's own psycopg transaction on an app's pool.
        for delivery in deliveries:
            assert isinstance(delivery.exception, HandlerCrashed) or (
                "rollback() forbidden" in (delivery.error or "")
            )
        assert reports[-1].dead_lettered == [event_id]
        assert rows_of(admin, pg_schema) == []  # lost = 0 of nothing, duplicates = 0
        assert store.records(event_id) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", SOURCES)
def test_the_delivery_after_a_refused_rollback_writes_exactly_once(
    source: str,
    mode: str,
    pg_url: str,
    pg_schema: str,
    ledger: sql.Composed,
    admin: psycopg.Connection[Any],
) -> None:
    """The retry of a delivery refused for its rollback, on the same connections, writes its
    row once, with its record: the connection came back clean (not read-only, no stale
    transaction)."""
    with opened(source, pg_url, pg_schema, size=1 if source != "app-pool" else 2) as store:
        if mode == "asyncio" and not store.capabilities.asyncio:
            pytest.skip(f"{source}: the store has no asyncio side")
        bus = EventBus()
        insert = ledger

        if mode == "asyncio":

            @bus.handler("t", name="ledger")
            async def ledger_async(event: Event, ctx: Any) -> None:
                conn = ctx.connection
                await conn.execute(insert, (event.id, f"attempt {ctx.attempt}"))
                if ctx.attempt == 1:
                    await conn.rollback()
                    await conn.execute(insert, (event.id, "after the rollback"))

        else:

            @bus.handler("t", name="ledger")
            def ledger_sync(event: Event, ctx: Any) -> None:
                conn = ctx.connection
                conn.execute(insert, (event.id, f"attempt {ctx.attempt}"))
                if ctx.attempt == 1:
                    conn.rollback()
                    conn.execute(insert, (event.id, "after the rollback"))

        clock = FrozenClock()
        outbox = Outbox(store, bus, clock=clock)
        with store.transaction() as conn:
            first, second = outbox.enqueue_many(conn, [("t", {"n": 1}), ("t", {"n": 2})])
        drain(outbox, clock, mode)
        assert rows_of(admin, pg_schema) == [(first, "attempt 2"), (second, "attempt 2")]
        for event_id in (first, second):
            (record,) = store.records(event_id)
            assert record.outcome is Outcome.SUCCEEDED and record.attempt == 2


@pytest.mark.parametrize("end", ["rollback()", "raw ROLLBACK", "raw COMMIT"])
@pytest.mark.parametrize("source", SOURCES)
def test_a_handler_that_ends_the_batch_transaction_costs_its_own_delivery_only(
    source: str,
    end: str,
    pg_url: str,
    pg_schema: str,
    ledger: sql.Composed,
    admin: psycopg.Connection[Any],
) -> None:
    """Item 8: in ``per_batch``, the second of three events ends the batch's transaction and
    writes again. ``run_once`` does not raise: that delivery fails (``BatchRolledBack``), the
    first event, whose delivery the rollback took with it, is handed back (its attempt
    refunded), the third is delivered and published in the same round. Every event ends with
    exactly one row and one record (the breaker succeeds on its retry); none is dead."""
    with opened(source, pg_url, pg_schema) as store:
        bus = EventBus()
        insert = ledger

        @bus.handler("t", name="ledger")
        def ledger_sync(event: Event, ctx: Any) -> None:
            conn = ctx.connection
            conn.execute(insert, (event.id, "row"))
            if event.payload["breaks"] and ctx.attempt == 1:
                if end == "rollback()":
                    conn.rollback()
                elif end == "raw ROLLBACK":
                    conn.execute("ROLLBACK")
                else:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute("COMMIT")  # refused by the commit guard: all rolled back
                conn.execute(insert, (event.id, "after"))

        clock = FrozenClock()
        outbox = Outbox(store, bus, clock=clock, max_retries=0 if end == "x" else 3)
        with store.transaction() as conn:
            first, second, third = outbox.enqueue_many(
                conn, [("t", {"breaks": False}), ("t", {"breaks": True}), ("t", {"breaks": False})]
            )
        report = outbox.poller(transaction="per_batch").run_once()
        (broken,) = [d for d in report.deliveries if d.event_id == second]
        assert broken.outcome is Outcome.FAILED
        assert report.retried == [second]
        assert report.dead_lettered == []
        if source != "own-pool" and end == "rollback()":
            # The batch on an app's connection is a psycopg transaction: psycopg refuses the
            # rollback() itself, and the handler's delivery fails as any failure does.
            assert "rollback() forbidden" in (broken.error or "")
            assert report.published == [first, third]
        else:
            assert isinstance(broken.exception, BatchRolledBack)
            assert [token for token, _ in broken.exception.undone] != []
            assert report.released == [first]
            assert report.published == [third]
            event = store.get(first)
            assert event is not None and event.attempts == 0 and event.locked_until is None
        clock.advance(60)  # past the second's backoff
        drain(outbox, clock, "per_batch")
        assert rows_of(admin, pg_schema) == [(first, "row"), (second, "row"), (third, "row")]
        for event_id in (first, second, third):
            (record,) = store.records(event_id)
            assert record.outcome is Outcome.SUCCEEDED
            settled = store.get(event_id)
            assert settled is not None and settled.published_at is not None


@pytest.mark.parametrize("source", SOURCES)
def test_a_batch_whose_lease_extension_is_rolled_back_goes_back_to_the_claims_deadline(
    source: str, pg_url: str, pg_schema: str, ledger: sql.Composed
) -> None:
    """A lease extension written in the batch's transaction is undone by a handler's
    rollback: the poller then goes by the claim's own deadline again, and extends anew before
    the next handler starts, instead of trusting the lost extension (the event row's lease,
    read by that handler, runs a full lease from its start)."""
    with opened(source, pg_url, pg_schema) as store:
        bus = EventBus()
        clock = FrozenClock()
        insert = ledger
        lease = 10.0
        leases: dict[int, Any] = {}
        lease_of = sql.SQL("SELECT locked_until FROM {} WHERE id = %s").format(
            sql.Identifier(store.names.schema, store.names.events)
        )

        @bus.handler("t", name="slow")
        def slow(event: Event, ctx: Any) -> None:
            conn = ctx.connection
            conn.execute(insert, (event.id, "row"))
            leases[event.id] = (conn.execute(lease_of, (event.id,)).fetchone() or [None])[0]
            clock.advance(event.payload["takes"])
            if event.payload["breaks"] and ctx.attempt == 1:
                conn.execute("ROLLBACK")

        outbox = Outbox(store, bus, clock=clock, lease=lease)
        takes = [6, 1, 1, 1]  # the first runs past half the lease: the second start extends
        with store.transaction() as conn:
            ids = outbox.enqueue_many(
                conn, [("t", {"takes": t, "breaks": i == 1}) for i, t in enumerate(takes)]
            )
        start = clock.now()
        report = outbox.poller(transaction="per_batch").run_once()
        assert report.lease_lost == []
        assert report.released == [ids[0]]
        assert report.published == [ids[2], ids[3]]
        # The third started 7 s in, 3 s before the claim's own deadline: extended again.
        assert leases[ids[2]] == start + timedelta(seconds=7 + lease)
        for event_id in (ids[2], ids[3]):
            (record,) = store.records(event_id)
            assert record.outcome is Outcome.SUCCEEDED


def _observe(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT current_user, current_setting('statement_timeout'), "
        "current_setting('search_path'), pg_backend_pid()"
    ).fetchone()
    assert row is not None
    return tuple(row)


@pytest.mark.parametrize("how", ["in its transaction", "after rolling it back"])
@pytest.mark.parametrize("mode", ["per_event", "per_batch"])
@pytest.mark.parametrize("source", SOURCES)
def test_a_handlers_session_settings_do_not_reach_the_next_delivery(
    source: str, mode: str, how: str, pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]
) -> None:
    """R18 (item 10): the first event's handler sets a role, a statement timeout and a
    search path; the next deliveries, on the same connection, see the session's defaults."""
    role = f"okt_tenant_{uuid.uuid4().hex[:8]}"
    admin.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    try:
        with opened(source, pg_url, pg_schema, size=1) as store:
            seen: dict[int, tuple[Any, ...]] = {}
            bus = EventBus()

            @bus.handler("t", name="tenant")
            def tenant(event: Event, ctx: Any) -> None:
                conn = ctx.connection
                if event.payload["sets"]:
                    if how == "after rolling it back":
                        conn.execute("ROLLBACK")
                    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
                    conn.execute("SET statement_timeout = '4321ms'")
                    conn.execute("SET search_path = pg_catalog")
                seen[event.id] = _observe(conn)

            outbox = Outbox(store, bus, clock=FrozenClock())
            with store.transaction() as conn:
                ids = outbox.enqueue_many(conn, [("t", {"sets": i == 0}) for i in range(3)])
                defaults = _observe(conn)
            outbox.poller(transaction=mode).run_once()
            setter, *others = ids
            assert seen[setter][:3] == (role, "4321ms", "pg_catalog")  # the setting took
            for event_id in others:
                assert seen[event_id][3] == seen[setter][3]  # the same connection...
                assert seen[event_id][:3] == defaults[:3]  # ...and none of its settings
            with store.transaction() as conn:
                assert _observe(conn)[:3] == defaults[:3]  # nor for the store's own work
    finally:
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.parametrize("source", ["own-pool", "app-pool"])
def test_the_asyncio_batch_goes_on_after_a_handler_ends_its_transaction(
    source: str, pg_url: str, pg_schema: str, ledger: sql.Composed, admin: psycopg.Connection[Any]
) -> None:
    """Item 8 on the asyncio poller: its batch, too, begins afresh and goes on."""
    with opened(source, pg_url, pg_schema) as store:
        bus = EventBus()
        insert = ledger

        @bus.handler("t", name="ledger")
        async def ledger_async(event: Event, ctx: Any) -> None:
            conn = ctx.connection
            await conn.execute(insert, (event.id, "row"))
            if event.payload["breaks"] and ctx.attempt == 1:
                await conn.execute("ROLLBACK")
                await conn.execute(insert, (event.id, "after"))

        clock = FrozenClock()
        outbox = Outbox(store, bus, clock=clock)
        with store.transaction() as conn:
            first, second, third = outbox.enqueue_many(
                conn, [("t", {"breaks": False}), ("t", {"breaks": True}), ("t", {"breaks": False})]
            )
        poller = outbox.async_poller(transaction="per_batch")
        report = asyncio.run(poller.run_once())
        (broken,) = [d for d in report.deliveries if d.event_id == second]
        assert isinstance(broken.exception, BatchRolledBack)
        assert (report.released, report.retried, report.published) == ([first], [second], [third])
        clock.advance(60)
        asyncio.run(outbox.async_poller(transaction="per_batch").run_once())
        assert rows_of(admin, pg_schema) == [(first, "row"), (second, "row"), (third, "row")]


@pytest.mark.parametrize("side", ["blocking", "asyncio"])
@pytest.mark.parametrize("source", SOURCES)
def test_a_handler_rolling_back_to_the_batchs_savepoint_fails_its_delivery_alone(
    source: str,
    side: str,
    pg_url: str,
    pg_schema: str,
    ledger: sql.Composed,
    admin: psycopg.Connection[Any],
) -> None:
    """R17 in a batch: a ``ROLLBACK TO`` the store's savepoint takes the delivery's mark with
    the handler's writes; the record's insert finds it gone, so what the handler wrote after
    it never commits and nothing is recorded, while the batch's other event commits its row
    and its record."""
    with opened(source, pg_url, pg_schema) as store:
        if side == "asyncio" and not store.capabilities.asyncio:
            pytest.skip(f"{source}: the store has no asyncio side")
        bus = EventBus()

        if side == "asyncio":

            @bus.handler("t", name="ledger")
            async def ledger_async(event: Event, ctx: Any) -> None:
                await ctx.connection.execute(ledger, (event.id, "before"))
                if event.payload["n"] == 1:
                    await ctx.connection.execute("ROLLBACK TO SAVEPOINT outboxkit_delivery")
                    await ctx.connection.execute(ledger, (event.id, "after"))

        else:

            @bus.handler("t", name="ledger")
            def ledger_blocking(event: Event, ctx: Any) -> None:
                ctx.connection.execute(ledger, (event.id, "before"))
                if event.payload["n"] == 1:
                    ctx.connection.execute("ROLLBACK TO SAVEPOINT outboxkit_delivery")
                    ctx.connection.execute(ledger, (event.id, "after"))

        clock = FrozenClock()
        outbox = Outbox(store, bus, clock=clock, max_retries=1)
        with store.transaction() as conn:
            rolling = outbox.enqueue(conn, "t", {"n": 1})
            plain = outbox.enqueue(conn, "t", {"n": 2})
        reports = []
        for _ in range(4):
            if side == "asyncio":
                report = asyncio.run(outbox.async_poller(transaction="per_batch").run_once())
            else:
                report = outbox.poller(transaction="per_batch").run_once()
            if not report.claimed:
                break
            reports.append(report)
            clock.advance(60)
        failed = [d for r in reports for d in r.deliveries if d.event_id == rolling]
        assert [d.outcome for d in failed] == [Outcome.FAILED] * 2
        assert all(isinstance(d.exception, HandlerCrashed) for d in failed)
        assert reports[0].published == [plain]
        assert reports[-1].dead_lettered == [rolling]
        assert rows_of(admin, pg_schema) == [(plain, "before")]
        assert store.records(rolling) == []
        assert [r.outcome for r in store.records(plain)] == [Outcome.SUCCEEDED]
