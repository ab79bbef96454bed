"""The PostgreSQL store through PgBouncer in transaction pooling mode (``tests/pgbouncer.py``,
Debian's ``pgbouncer``): the conformance suite, the pollers' paths (per event, per batch,
asyncio), the sessions' time zone, ``LISTEN`` on a direct connection, and one fault (the server
connections behind the pooler terminated mid-drain).

Each store here is made as a user behind a pooler makes it: ``prepare_threshold=None``, and
``listen_conninfo`` pointing at the server itself (or ``notify=False``). Nothing is set in the
environment: the store's own connections send no startup ``options``, which PgBouncer refuses.
The schema is migrated through a direct URL, as the README says to. Two server connections
only, so that every client's transactions keep landing on connections other clients used.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest
from psycopg import sql

from outboxkit import EventBus, Outbox, StoreError
from outboxkit_conformance import StoreConformance
from outboxkit_pg import PostgresStore
from tests.pgbouncer import PgBouncer, running_pgbouncer

from .conftest import fresh_schema, new_schema_name

pytestmark = pytest.mark.pg

EVENTS = 120


@pytest.fixture(scope="module")
def bouncer(pg_url: str) -> Iterator[PgBouncer]:
    with running_pgbouncer(pg_url, pool_size=2) as running:
        yield running


@pytest.fixture(autouse=True)
def _no_session_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PGTZ", "PGOPTIONS"):  # the store must do without them
        monkeypatch.delenv(name, raising=False)


def _behind(
    bouncer: PgBouncer, pg_url: str, schema: str, application_name: str = "outboxkit"
) -> PostgresStore:
    url = f"{bouncer.url()}?application_name={application_name}"
    return PostgresStore(url, schema=schema, prepare_threshold=None, listen_conninfo=pg_url)


@contextmanager
def _migrated(pg_url: str) -> Iterator[str]:
    """A fresh schema, migrated through the direct URL (and dropped at the end)."""
    with fresh_schema(pg_url) as schema:
        direct = PostgresStore(pg_url, schema=schema)
        try:
            direct.migrate()
        finally:
            direct.close()
        yield schema


# -- the conformance suite ----------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _conformance_target(bouncer: PgBouncer, pg_url: str) -> None:
    TestPgBouncerConformance.bouncer, TestPgBouncerConformance.direct_url = bouncer, pg_url


class TestPgBouncerConformance(StoreConformance):
    """Every conformance check, the store's connections through PgBouncer."""

    bouncer: ClassVar[PgBouncer]
    direct_url: ClassVar[str]

    @contextmanager
    def make_store(self, tmp_path: Path) -> Iterator[PostgresStore]:  # type: ignore[override]
        schema = new_schema_name("okb")
        direct = PostgresStore(self.direct_url, schema=schema)
        try:
            direct.migrate()
            store = _behind(self.bouncer, self.direct_url, schema)
            try:
                yield store
            finally:
                store.close()
        finally:
            try:
                direct.drop_schema()
            finally:
                direct.close()


# -- the pollers' paths -------------------------------------------------------------------------


def _counting_bus(table: sql.Composed) -> EventBus:
    """A handler that writes one row per event through ``ctx.connection`` (exactly once)."""
    bus = EventBus()

    @bus.handler("order.placed", name="book")
    def book(event: Any, ctx: Any) -> None:
        ctx.connection.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(table), [event.id])

    return bus


@contextmanager
def _ledger(pg_url: str, schema: str) -> Iterator[sql.Composed]:
    table = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier("ledger"))
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE TABLE {} (event_id bigint PRIMARY KEY)").format(table))
    yield table


def _booked(pg_url: str, table: sql.Composed) -> list[int]:
    with psycopg.connect(pg_url, autocommit=True) as admin:
        rows = admin.execute(sql.SQL("SELECT event_id FROM {} ORDER BY 1").format(table))
        return [row[0] for row in rows]


def _enqueue(store: PostgresStore, outbox: Outbox, count: int) -> list[int]:
    ids: list[int] = []
    for first in range(0, count, 20):  # several transactions, on whichever server connection
        with store.transaction() as conn:
            batch = [("order.placed", {"n": n}) for n in range(first, first + 20)]
            ids += outbox.enqueue_many(conn, batch)
    return ids


@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_every_event_once_through_the_pooler(
    bouncer: PgBouncer, pg_url: str, transaction: str
) -> None:
    with _migrated(pg_url) as schema, _ledger(pg_url, schema) as table:
        store = _behind(bouncer, pg_url, schema)
        try:
            outbox = Outbox(store, _counting_bus(table), load_entry_points=False)
            ids = _enqueue(store, outbox, EVENTS)
            outbox.poller(batch_size=10, transaction=transaction).run_until_idle()
            stats = outbox.stats()
        finally:
            store.close()
        assert _booked(pg_url, table) == sorted(ids)
        assert (stats.published, stats.pending, stats.dead) == (EVENTS, 0, 0)


def test_the_asyncio_poller_through_the_pooler(bouncer: PgBouncer, pg_url: str) -> None:
    with _migrated(pg_url) as schema:
        store = _behind(bouncer, pg_url, schema)
        seen: list[int] = []
        bus = EventBus()

        @bus.handler("order.placed", name="note")
        async def note(event: Any, ctx: Any) -> None:
            seen.append(event.id)

        outbox = Outbox(store, bus, load_entry_points=False)
        try:
            ids = _enqueue(store, outbox, EVENTS)

            async def drain() -> None:
                poller = outbox.async_poller(concurrency=4, batch_size=10)
                try:
                    await poller.run_until_idle()
                finally:
                    await store.async_store().close()

            asyncio.run(drain())
            stats = outbox.stats()
        finally:
            store.close()
        assert sorted(seen) == sorted(ids)
        assert stats.published == EVENTS


def test_sessions_through_the_pooler_are_in_utc_and_leave_others_alone(
    bouncer: PgBouncer, pg_url: str
) -> None:
    """The store's ``SET TimeZone`` is PgBouncer's to keep for this client: another client of
    the same server connections keeps its own zone, and the store's instants load in UTC."""
    with _migrated(pg_url) as schema:
        store = _behind(bouncer, pg_url, schema)
        other = psycopg.connect(bouncer.url(), autocommit=True, prepare_threshold=None)
        try:
            other.execute("SET TimeZone TO 'Asia/Tokyo'")
            outbox = Outbox(store, load_entry_points=False)
            _enqueue(store, outbox, 20)
            for _ in range(5):  # alternate: the two clients share two server connections
                with store.transaction() as conn:
                    assert conn.execute("SHOW TimeZone").fetchone() == ("UTC",)
                assert other.execute("SHOW TimeZone").fetchone() == ("Asia/Tokyo",)
            claims = store.claim(batch_size=5, lease=timedelta(seconds=30), now=None)
            assert claims and all(c.locked_until.tzinfo is UTC for c in claims)
        finally:
            other.close()
            store.close()


def test_listen_on_a_direct_connection_wakes_the_poller(bouncer: PgBouncer, pg_url: str) -> None:
    """``NOTIFY`` goes through the pooler with the enqueue's transaction; the waiter's
    ``LISTEN`` is on ``listen_conninfo`` (the server itself), and hears it."""
    with _migrated(pg_url) as schema:
        store = _behind(bouncer, pg_url, schema)
        outbox = Outbox(store, load_entry_points=False)
        waiter = store.make_waiter()
        assert waiter is not None
        try:
            waiter.wait(0)  # connects and LISTENs
            returned = threading.Event()

            def wait() -> None:
                waiter.wait(60)
                returned.set()

            thread = threading.Thread(target=wait, daemon=True)
            thread.start()
            with store.transaction() as conn:
                outbox.enqueue(conn, "order.placed", {})
            assert returned.wait(30), "the notification did not wake the waiter"
            thread.join(5)
        finally:
            waiter.close()
            store.close()


def test_without_listen_conninfo_notify_false_polls(bouncer: PgBouncer, pg_url: str) -> None:
    with _migrated(pg_url) as schema:
        store = PostgresStore(bouncer.url(), schema=schema, prepare_threshold=None, notify=False)
        try:
            assert store.make_waiter() is None and not store.capabilities.waiter
        finally:
            store.close()


# -- a fault ------------------------------------------------------------------------------------


def test_server_connections_terminated_mid_drain_lose_and_double_nothing(
    bouncer: PgBouncer, pg_url: str
) -> None:
    """Halfway through a drain every server connection PgBouncer holds for the test database
    is terminated (``pg_terminate_backend``): the poller meets the outage, the pooler opens new
    server connections, and the drain ends with each event's transactional write done once."""
    with _migrated(pg_url) as schema, _ledger(pg_url, schema) as table:
        store = _behind(bouncer, pg_url, schema)
        try:
            outbox = Outbox(store, _counting_bus(table), load_entry_points=False)
            ids = _enqueue(store, outbox, EVENTS)
            poller = outbox.poller(batch_size=10, lease=1.0)
            poller.run_once()
            # PgBouncer's own list of its server connections (the application_name a server
            # connection shows is whatever its last client left set: a delivery's RESET ALL
            # takes it back to the one it was opened with, maybe by an earlier test's client).
            with psycopg.connect(pg_url, autocommit=True) as admin:
                killed = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM unnest(%s::integer[]) AS pid",
                    [bouncer.server_pids()],
                ).fetchone()
            assert killed is not None and killed[0] >= 1
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                # Each step may meet the outage (a round, or the count on a pooled connection
                # whose server connection was cut): a StoreError, the outage said; go on.
                try:
                    if outbox.stats().published == EVENTS:
                        break
                    poller.run_until_idle()
                    if outbox.stats().published < EVENTS:
                        poller.run_once()  # leases of the killed round run out (1 s)
                except StoreError:
                    continue
            stats = outbox.stats()
        finally:
            store.close()
        assert _booked(pg_url, table) == sorted(ids)  # each once: none lost, none doubled
        assert (stats.published, stats.dead) == (EVENTS, 0)


def test_listen_conninfo_is_checked_kept_for_other_processes_and_scrubbed() -> None:
    from outboxkit import ConfigurationError

    with pytest.raises(ConfigurationError, match="listen_conninfo must be"):
        PostgresStore("postgresql://app@db.example:6432/shop", listen_conninfo=5)  # type: ignore[arg-type]
    direct = "postgresql://app:s3cret-word@db.example:5432/shop"
    store = PostgresStore("postgresql://app@db.example:6432/shop", listen_conninfo=direct)
    try:  # nothing connects
        assert store.options["listen_conninfo"] == direct  # a --processes child gets it too
        assert store.capabilities.waiter
        assert "s3cret-word" not in store.dialect.pool.scrub(f"failed: {direct}")
    finally:
        store.close()
