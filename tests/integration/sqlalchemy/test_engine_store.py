"""Acceptance 5: ``open_store(engine)`` and SQLAlchemy URLs. On PostgreSQL the store borrows
the engine's pooled connections (the app and the outbox share one pool); the connection count
of a running poller plus the app is measured against separate pools (pg_stat_activity of a
database of the test's own). SQLite: the store opens the engine's file itself."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine, event, make_url
from sqlalchemy.orm import Session

from outboxkit import Event, EventBus, Outbox, open_store
from outboxkit.errors import ConfigurationError
from outboxkit_pg import PostgresStore
from outboxkit_sqlite import SQLiteStore
from tests.integration.pg import conftest as pg
from tests.integration.pg._workers import wait_until

from .conftest import Base, Order


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A database of the test's own (its connections counted alone); dropped afterwards."""
    url = pg.test_url(pg.pg_url_from_env())
    pg.require_server(url)
    name = f"oksqla_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        path, mark, query = url.partition("?")
        yield f"{path.rsplit('/', 1)[0]}/{name}{mark}{query}"
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _connections(url: str) -> int:
    """Backends connected to the test database, besides this query's own."""
    name = make_url(url).database
    with psycopg.connect(pg.test_url(pg.pg_url_from_env())) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _opened(engine: Any) -> int:
    """Connections the engine's pool holds open, idle or checked out."""
    return int(engine.pool.checkedin() + engine.pool.checkedout())


def _beyond_the_app(engine: Any, url: str) -> int:
    """Backends of the test database that are not the app engine's own. The engine's pool may
    grow while the poller runs (the app and the poller each hold one at once), so the count is
    taken between two equal readings of the pool."""
    for _ in range(100):
        before = _opened(engine)
        total = _connections(url)
        if _opened(engine) == before:
            return total - before
    raise AssertionError("the engine's pool kept changing size")


def _sa(url: str, driver: str) -> str:
    """``url`` as a SQLAlchemy URL on ``driver`` (asyncpg takes no libpq ``options``)."""
    _, rest = url.split("://", 1)
    if driver == "asyncpg":
        rest = rest.partition("?")[0]
    return f"postgresql+{driver}://{rest}"


@pytest.mark.pg
def test_the_store_borrows_the_engines_pooled_connections(pg_database: str) -> None:
    engine = create_engine(_sa(pg_database, "psycopg"), pool_size=2, max_overflow=0)
    checkouts: list[Any] = []
    event.listen(engine.pool, "checkout", lambda dbapi, record, proxy: checkouts.append(dbapi))
    store = open_store(engine)
    try:
        assert isinstance(store, PostgresStore)
        store.migrate()
        outbox = Outbox(store, load_entry_points=False)
        with Session(engine) as session:
            outbox.enqueue(session, "a", {})
            session.commit()
        before = len(checkouts)
        claims = store.claim(batch_size=10, lease=timedelta(seconds=30), now=None)
        assert [c.event.topic for c in claims] == ["a"]
        assert len(checkouts) == before + 1  # the claim ran on one of the engine's connections
        assert engine.pool.checkedout() == 0  # and gave it back
        assert store.url is None and store.capabilities.asyncio  # LISTEN, asyncio: own ones
    finally:
        store.close()
        engine.dispose()


@pytest.mark.pg
def test_one_pool_for_the_app_and_a_running_poller_counts_fewer_connections(
    pg_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The figures for the docs: connections of the test database, beyond the app engine's own,
    while a poller runs (its LISTEN connection included) and the app has enqueued through its
    engine. Counted beyond the app's pool, since how many of those it opens depends on whether
    the app and the poller happened to want one at the same moment."""

    def measure(shared: bool) -> int:
        engine = create_engine(_sa(pg_database, "psycopg"), pool_size=5)
        store = open_store(engine) if shared else PostgresStore(pg_database)
        try:
            store.migrate()
            Base.metadata.create_all(engine)
            bus = EventBus()
            done = threading.Event()
            delivered: list[int] = []

            @bus.handler("order.placed", name="count")
            def count(event: Event, ctx: Any) -> None:
                delivered.append(event.id)
                if len(delivered) == 20:
                    done.set()

            outbox = Outbox(store, bus, interval=0.05, load_entry_points=False)
            poller = outbox.poller()
            thread = threading.Thread(target=poller.run_forever)
            thread.start()
            try:
                for n in range(20):
                    with Session(engine) as session, session.begin():
                        session.add(Order(item=f"o{n}"))
                        outbox.enqueue(session, "order.placed", {"n": n})
                assert done.wait(timeout=60)
                # The LISTEN connection opens at the poller's first idle wait, which may come
                # after the last delivery: counted once it is there.
                wait_until(lambda: _beyond_the_app(engine, pg_database) >= 1, 10, step=0.01)
                return _beyond_the_app(engine, pg_database)
            finally:
                poller.stop()
                thread.join(timeout=60)
        finally:
            store.close()
            engine.dispose()

    shared, separate = measure(shared=True), measure(shared=False)
    with capsys.disabled():
        print(f"\nconnections beyond the app's pool: one pool {shared}, separate pools {separate}")
    assert shared == 1  # the LISTEN connection alone: claims and settles ride the app's pool
    assert separate >= 2  # the store's own pool besides


@pytest.mark.pg
@pytest.mark.parametrize("driver", ["psycopg2", "asyncpg"])
def test_other_postgresql_drivers_are_refused_naming_the_one_to_use(
    pg_database: str, driver: str
) -> None:
    engine = create_engine(_sa(pg_database, driver)) if driver != "asyncpg" else None
    if engine is None:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(_sa(pg_database, driver))
    with pytest.raises(ConfigurationError, match=r"postgresql\+psycopg://"):
        open_store(engine)


@pytest.mark.pg
def test_a_sqlalchemy_url_opens_the_store_and_its_password_is_never_shown() -> None:
    url = pg.test_url(pg.pg_url_from_env())
    pg.require_server(url)
    store = open_store(_sa(url, "psycopg"), schema="okt_unused")
    try:
        assert isinstance(store, PostgresStore)
    finally:
        store.close()
    secret = "pa55-s3cr3t-word"
    bad = f"postgresql+psycopg://postgres:{secret}@127.0.0.1:1/postgres"
    store = open_store(bad, pool_timeout=1)
    try:
        with pytest.raises(Exception) as caught:
            store.now()
        assert secret not in str(caught.value)
    finally:
        store.close()


def test_sqlite_engines_and_urls_open_the_file(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    engine = create_engine(f"sqlite+pysqlite:///{path.as_posix()}")
    try:
        store = open_store(engine)
        assert isinstance(store, SQLiteStore) and store.path == path
        store.close()
    finally:
        engine.dispose()
    store = open_store(f"sqlite+pysqlite:///{path.as_posix()}")
    assert isinstance(store, SQLiteStore) and store.path == path
    store.close()
    memory = create_engine("sqlite+pysqlite://")
    with pytest.raises(ConfigurationError, match="use a file"):
        open_store(memory)
    memory.dispose()
