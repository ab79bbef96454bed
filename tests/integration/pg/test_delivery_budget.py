"""The statement and round-trip budget of a delivery on PostgreSQL, per path: counted exactly
from libpq's protocol trace of the store's connections (statements: ``Query`` and ``Execute``
messages; round trips: ``Query`` and ``Sync``), as the difference between a round of 2N events
and a round of N, so that the round's own claim and settlement drop out. A change that adds a
statement or a round trip to a delivery fails here; one that removes some updates the table.

Also: a delivery whose prepared row lock is gone (psycopg sends ``DEALLOCATE ALL`` after it saw
a handler's ``ROLLBACK``, ``DROP`` or ``ALTER``; a handler may run it itself) prepares it again
and goes on, on both sides and in both transaction modes."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import Event, EventBus, Outbox
from outboxkit.core.payload import build_event
from outboxkit_pg import PostgresStore
from outboxkit_pg.flow import Flow, Statement

from .conftest import migrated_store

pytestmark = pytest.mark.pg

N = 10

# (statements, round trips) per event, a handler subscribed to its topic.
BUDGET = {
    # A handler that writes one row through ctx.connection: BEGIN and the row lock (one sync),
    # the handler's INSERT, then RESET ROLE, the savepoint before the records, the close
    # (prepared: R17's check, the record, R18's reset and the zone set back to UTC in one
    # function call) and COMMIT (one sync).
    ("per_event", "writes"): (7, 3),
    # A handler that never takes the connection: its record, fenced by the token, alone.
    ("per_event", "noop"): (1, 1),
    # In a batch: SAVEPOINT and the row lock (one sync), the INSERT, RESET ROLE, the savepoint
    # before the records, the close and RELEASE (one sync).
    ("per_batch", "writes"): (7, 3),
    # In a batch, a handler that never takes the connection: its record is kept for the
    # batch's settlement (one statement for all).
    ("per_batch", "noop"): (0, 0),
}
ASYNC_BUDGET = {
    # The asyncio poller's deliveries open lazily as well: at the handler's first statement
    # (``AsyncDelivery``: the opening sync is sent before it, under the connection's lock).
    ("per_event", "writes"): (7, 3),
    ("per_batch", "writes"): (7, 3),
    # A handler that never takes the connection: its record, fenced by the token, alone
    # (pipelined on the round's connection), or kept for the batch's settlement.
    ("per_event", "noop"): (1, 1),
    ("per_batch", "noop"): (0, 0),
}


@contextlib.contextmanager
def traced(text: list[str]) -> Iterator[None]:
    """Every psycopg connection (blocking or async) opened inside writes libpq's protocol
    trace; what was written is appended to ``text`` at the end."""
    originals = {
        cls: cls.__dict__["connect"] for cls in (psycopg.Connection, psycopg.AsyncConnection)
    }
    with tempfile.TemporaryFile("w+") as trace:

        def tracing(conn: Any) -> Any:
            conn.pgconn.trace(trace.fileno())
            conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
            return conn

        def blocking(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return tracing(originals[psycopg.Connection].__func__(cls, *args, **kwargs))

        async def asynchronous(cls: Any, *args: Any, **kwargs: Any) -> Any:
            connect = originals[psycopg.AsyncConnection].__func__
            return tracing(await connect(cls, *args, **kwargs))

        psycopg.Connection.connect = classmethod(blocking)  # type: ignore[method-assign,assignment]
        psycopg.AsyncConnection.connect = classmethod(asynchronous)  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            for cls, original in originals.items():
                cls.connect = original  # type: ignore[method-assign]
            trace.flush()
            trace.seek(0)
            text.append(trace.read())


def counts(text: str) -> tuple[int, int]:
    """(statements, round trips) the frontend sent, in a libpq trace. A sync whose one
    statement is the session's ``SET TimeZone`` alone is a connection's set-up (the pool's,
    when it makes a connection), not a delivery's, and is left out: the async pool makes its
    connections when it will."""
    statements = trips = 0
    group: list[str] = []  # the messages since the last Sync
    for line in text.splitlines():
        parts = line.split("\t") if "\t" in line else line.split()
        if len(parts) < 3 or parts[0] != "F":
            continue
        kind = parts[2]
        if kind == "Query":
            if "SET TimeZone TO 'UTC'" not in line:
                statements += 1
                trips += 1
            continue
        if kind == "Sync":
            executes = [m for m in group if m.split(None, 1)[0] == "Execute"]
            setup = len(executes) == 1 and any(
                "SET TimeZone TO 'UTC'" in m for m in group if m.startswith("Parse")
            )
            if executes and not setup:  # a sync that carries no statement is no delivery's
                statements += len(executes)
                trips += 1
            group = []
            continue
        group.append(kind + " " + line)
    return statements, trips


def _bus(table: sql.Identifier, writes: bool, asyncio: bool) -> EventBus:
    # The handler's INSERT unprepared: psycopg prepares a statement on its fifth run on a
    # connection, in a round trip of its own, and which connection of the pool runs which
    # delivery is the pool's to choose; the budget is outboxkit's, not the handler's.
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(table)
    if asyncio:

        async def handle_async(event: Event, ctx: Any) -> None:
            if writes:
                await ctx.connection.execute(insert, (event.id,), prepare=False)

        bus.subscribe("t", handle_async, name="h")
    else:

        def handle(event: Event, ctx: Any) -> None:
            if writes:
                ctx.connection.execute(insert, (event.id,), prepare=False)

        bus.subscribe("t", handle, name="h")
    return bus


def _round(url: str, events: int, transaction: str, writes: bool, asyncio: bool) -> tuple[int, int]:
    """The statements and round trips of a store's life in which a poller delivers a round of
    3 events (warming the connections: the schema check, the first prepares) and then one of
    ``events``. What is not a delivery is the same for every ``events``."""
    text: list[str] = []
    with traced(text), migrated_store(url, notify=False) as store:
        table = sql.Identifier(store.names.schema, "app_rows")
        with store.transaction() as conn:
            conn.execute(sql.SQL("CREATE TABLE {} (event_id bigint PRIMARY KEY)").format(table))
        outbox = Outbox(store, _bus(table, writes, asyncio), load_entry_points=False)
        warm = 3
        with store.transaction() as conn:
            store.enqueue(
                conn, [build_event("t", {"n": n}) for n in range(warm + events)], now=None
            )
        if asyncio:
            import asyncio as aio

            async def run() -> None:
                poller = outbox.async_poller(transaction=transaction, batch_size=warm)
                await poller.run_once()
                poller = outbox.async_poller(transaction=transaction, batch_size=events)
                report = await poller.run_once()
                assert len(report.published) == events
                await store.async_store().close()

            aio.run(run())
        else:
            outbox.poller(transaction=transaction, batch_size=warm).run_once()
            report = outbox.poller(transaction=transaction, batch_size=events).run_once()
            assert len(report.published) == events
        with store.transaction() as conn:
            written = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
        assert written == ((warm + events) if writes else 0,)
    return counts(text[0])


def per_event(url: str, transaction: str, writes: bool, asyncio: bool = False) -> tuple[int, int]:
    """The budget per event: the smallest of three measurements whose difference divides
    evenly (a lease kept alive, or a connection made, on a loaded host adds round trips that
    are no delivery's; a delivery's own are in every measurement)."""
    found: list[tuple[int, int]] = []
    for _ in range(3):
        small = _round(url, N, transaction, writes, asyncio)
        large = _round(url, 2 * N, transaction, writes, asyncio)
        diff = (large[0] - small[0], large[1] - small[1])
        if diff[0] % N == 0 and diff[1] % N == 0:
            found.append((diff[0] // N, diff[1] // N))
    assert found, "no measurement divided evenly by the events"
    return min(found)


@pytest.mark.parametrize(("transaction", "handler"), sorted(BUDGET))
def test_the_delivery_budget_per_event(pg_url: str, transaction: str, handler: str) -> None:
    assert per_event(pg_url, transaction, handler == "writes") == BUDGET[transaction, handler]


@pytest.mark.parametrize(("transaction", "handler"), sorted(ASYNC_BUDGET))
def test_the_asyncio_delivery_budget_per_event(pg_url: str, transaction: str, handler: str) -> None:
    got = per_event(pg_url, transaction, handler == "writes", asyncio=True)
    assert got == ASYNC_BUDGET[transaction, handler]


def _deallocating_bus(table: sql.Identifier, asyncio: bool) -> EventBus:
    """Each handler writes its row and drops every prepared statement of its session."""
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(table)
    if asyncio:

        async def handle_async(event: Event, ctx: Any) -> None:
            await ctx.connection.execute(insert, (event.id,))
            await ctx.connection.execute("DEALLOCATE ALL")

        bus.subscribe("t", handle_async, name="h")
    else:

        def handle(event: Event, ctx: Any) -> None:
            ctx.connection.execute(insert, (event.id,))
            ctx.connection.execute("DEALLOCATE ALL")

        bus.subscribe("t", handle, name="h")
    return bus


@pytest.mark.parametrize("asyncio", [False, True], ids=["blocking", "asyncio"])
@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_a_delivery_whose_prepared_row_lock_is_gone_prepares_it_again(
    pg_store: PostgresStore, transaction: str, asyncio: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    reopened: list[object] = []
    reclosed: list[object] = []
    reopening, reclosing = Flow.reopening, Flow.reclosing

    def counted(flow: Flow[Any]) -> list[bytes]:
        reopened.append(flow)
        return reopening(flow)

    def counted_closing(flow: Flow[Any]) -> Any:
        reclosed.append(flow)
        return reclosing(flow)

    monkeypatch.setattr(Flow, "reopening", counted)
    monkeypatch.setattr(Flow, "reclosing", counted_closing)
    table = sql.Identifier(pg_store.names.schema, "app_rows")
    with pg_store.transaction() as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (event_id bigint PRIMARY KEY)").format(table))
        ids = pg_store.enqueue(conn, [build_event("t", {"n": n}) for n in range(5)], now=None)
    outbox = Outbox(pg_store, _deallocating_bus(table, asyncio), load_entry_points=False)
    if asyncio:
        import asyncio as aio

        async def run() -> Any:
            try:
                return await outbox.async_poller(transaction=transaction).run_once()
            finally:
                await pg_store.async_store().close()

        report = aio.run(run())
    else:
        report = outbox.poller(transaction=transaction).run_once()
    assert sorted(report.published) == ids
    with pg_store.transaction() as conn:
        rows = conn.execute(sql.SQL("SELECT event_id FROM {} ORDER BY 1").format(table))
        assert [r[0] for r in rows] == ids
        records = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE outcome = 'succeeded'").format(
                sql.Identifier(pg_store.names.schema, "outbox_deliveries")
            )
        ).fetchone()
    assert records == (5,)
    if asyncio and transaction == "per_event":
        # Each delivery takes a connection of the async pool: one never used before has no
        # prepared row lock to lose. At least one found its own gone and prepared it again.
        assert 1 <= len(reopened) <= 4
    else:
        assert len(reopened) == 4  # every delivery after the first found it gone
    # The records are prepared too: a delivery on a connection that had prepared them found
    # them gone (its handler deallocated them after its row), went back to the savepoint
    # before its records and wrote them, its row kept (once: checked above).
    assert reclosed == reopened


def test_per_event_and_batch_row_locks_on_one_connection_a_handler_deallocates(
    pg_url: str,
) -> None:
    """One connection, per-event and batch deliveries in turn, a handler dropping every
    prepared statement of the session once: each row lock found gone is prepared again (only
    that one: preparing one that is still there would fail, and abort the transaction), and
    every event is delivered once, none retried."""
    with migrated_store(pg_url, notify=False, pool_min_size=1, pool_max_size=1) as store:
        table = sql.Identifier(store.names.schema, "app_rows")
        insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(table)
        with store.transaction() as conn:
            conn.execute(sql.SQL("CREATE TABLE {} (event_id bigint PRIMARY KEY)").format(table))
            ids = store.enqueue(conn, [build_event("t", {"n": n}) for n in range(4)], now=None)
        bus = EventBus()

        def handle(event: Event, ctx: Any) -> None:
            ctx.connection.execute(insert, (event.id,))
            if event.id == ids[0]:
                ctx.connection.execute("DEALLOCATE ALL")

        bus.subscribe("t", handle, name="h")
        outbox = Outbox(store, bus, load_entry_points=False)
        published = []
        for transaction in ("per_event", "per_batch", "per_event", "per_batch"):
            report = outbox.poller(transaction=transaction, batch_size=1).run_once()
            assert report.retried == [] and report.dead_lettered == [], report
            published += report.published
        assert published == ids


@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_a_handler_rolling_back_to_a_savepoint_of_its_own_keeps_its_writes_and_records(
    pg_url: str, transaction: str
) -> None:
    """A handler that tries something in a savepoint of its own and rolls it back (psycopg's
    ``conn.transaction()`` block raising: psycopg then sends ``DEALLOCATE ALL``, dropping the
    prepared record with its own statements), then writes again: on one connection, every
    delivery commits its row and its record once, none retried."""
    with migrated_store(pg_url, notify=False, pool_min_size=1, pool_max_size=1) as store:
        table = sql.Identifier(store.names.schema, "app_rows")
        insert = sql.SQL("INSERT INTO {} (event_id, attempt) VALUES (%s, %s)").format(table)
        with store.transaction() as conn:
            conn.execute(
                sql.SQL("CREATE TABLE {} (event_id bigint PRIMARY KEY, attempt int)").format(table)
            )
            ids = store.enqueue(conn, [build_event("t", {"n": n}) for n in range(6)], now=None)
        bus = EventBus()

        def handle(event: Event, ctx: Any) -> None:
            conn = ctx.connection
            with contextlib.suppress(psycopg.errors.UniqueViolation), conn.transaction():
                conn.execute(insert, (event.id, 0))
                conn.execute(insert, (event.id, 0))  # fails: back to the savepoint
            conn.execute(insert, (event.id, ctx.attempt))

        bus.subscribe("t", handle, name="h")
        outbox = Outbox(store, bus, load_entry_points=False)
        published = []
        for _ in ids:
            report = outbox.poller(transaction=transaction, batch_size=1).run_once()
            assert report.retried == [] and report.dead_lettered == [], report
            published += report.published
        assert published == ids
        with store.transaction() as conn:
            rows = conn.execute(
                sql.SQL("SELECT event_id, attempt FROM {} ORDER BY 1").format(table)
            )
            assert rows.fetchall() == [(i, 1) for i in ids]
            records = conn.execute(
                sql.SQL("SELECT event_id FROM {} WHERE outcome = 'succeeded' ORDER BY 1").format(
                    sql.Identifier(store.names.schema, store.names.deliveries)
                )
            ).fetchall()
        assert records == [(i,) for i in ids]


def test_a_flight_keeps_what_the_server_prepared_when_a_later_statement_failed(
    pg_url: str,
) -> None:
    """A statement prepared in a sync whose execution failed stays prepared (prepared
    statements are not transactional): the next flight runs it without preparing it again,
    which the server would refuse, aborting that transaction. A statement prepared or
    deallocated behind the flights' back fails one flight (``PREPARED_STALE``, what a delivery
    sends again) and the next one runs."""
    from outboxkit_pg.pipeline import PREPARED_STALE, fly

    divide = Statement(b"SELECT 10 / %(n)s::integer", {"n": 0}, prepare=True)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            fly(conn, [divide])
        (result,) = fly(conn, [Statement(divide.query, {"n": 2}, prepare=True)])
        assert result.rowcount == 1
    other = Statement(b"SELECT 12 / %(n)s::integer", {"n": 3}, prepare=True)
    with (
        psycopg.connect(pg_url, autocommit=True) as conn,
        psycopg.connect(pg_url, autocommit=True) as behind,
    ):
        (result,) = fly(conn, [other])
        assert result.rowcount == 1
        ((name,),) = conn.execute("SELECT name FROM pg_prepared_statements").fetchall()
        # Prepared there already: refused once, then run as it is.
        behind.execute(
            sql.SQL("PREPARE {} AS SELECT 12 / $1::integer").format(sql.Identifier(name))
        )
        with pytest.raises(PREPARED_STALE):
            fly(behind, [other])
        (result,) = fly(behind, [other])
        assert result.rowcount == 1
        # Gone: refused once, then prepared again.
        conn.execute("DEALLOCATE ALL")
        with pytest.raises(PREPARED_STALE):
            fly(conn, [other])
        (result,) = fly(conn, [other])
        assert result.rowcount == 1
