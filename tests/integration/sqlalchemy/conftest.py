"""Fixtures for the SQLAlchemy integration: the app's database on every driver SQLAlchemy has
for the store's (psycopg 3, psycopg2, asyncpg on the PostgreSQL test server, in a schema of its
own; pysqlite and aiosqlite on a SQLite file under ``tmp_path``), its ORM models, the store on
the same database and an outbox with a frozen clock."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import ForeignKey, String, create_engine, make_url
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import NullPool

from outboxkit import EventBus, FrozenClock, Outbox, Store
from outboxkit_pg import PostgresStore
from outboxkit_sqlite import SQLiteStore
from tests.integration.pg import conftest as pg


class Base(DeclarativeBase):
    pass


class Order(Base):
    """An app's row, written beside the event it enqueues."""

    __tablename__ = "sqla_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(50))


class Line(Base):
    """What a handler writes through ``ctx.session``."""

    __tablename__ = "sqla_lines"
    id: Mapped[int] = mapped_column(primary_key=True)
    event_id: Mapped[int]
    label: Mapped[str] = mapped_column(String(50))
    order_id: Mapped[int | None] = mapped_column(ForeignKey("sqla_orders.id"), default=None)


DRIVERS = [
    pytest.param(("pg", "psycopg"), id="pg-psycopg", marks=pytest.mark.pg),
    pytest.param(("pg", "psycopg2"), id="pg-psycopg2", marks=pytest.mark.pg),
    pytest.param(("pg", "asyncpg"), id="pg-asyncpg", marks=pytest.mark.pg),
    pytest.param(("sqlite", "pysqlite"), id="sqlite-pysqlite"),
    pytest.param(("sqlite", "aiosqlite"), id="sqlite-aiosqlite"),
]
DATABASES = [
    pytest.param("pg", id="pg", marks=pytest.mark.pg),
    pytest.param("sqlite", id="sqlite"),
]
ASYNC_DRIVERS = {"pg": "psycopg", "sqlite": "aiosqlite"}
SYNC_DRIVERS = {"pg": "psycopg", "sqlite": "pysqlite"}


@dataclass
class Database:
    """One test database: the store on it, and how the app reaches it through SQLAlchemy."""

    kind: str
    store: Store
    url: str  # the database, by SQLAlchemy URL without a driver
    schema: str | None  # PostgreSQL: the schema holding the store's and the app's tables
    driver: str = ""  # the driver the test's parameter names, if it names one

    @property
    def options(self) -> dict[str, Any]:
        """Execution options putting the app's tables in the test schema."""
        return {} if self.schema is None else {"schema_translate_map": {None: self.schema}}

    def sa_url(self, driver: str) -> Any:
        url = make_url(self.url).set(drivername=f"{make_url(self.url).drivername}+{driver}")
        if driver == "asyncpg":  # asyncpg takes server settings, not libpq's options
            url = url.difference_update_query(["options"])
        return url

    def engine(self, driver: str, **kwargs: Any) -> Engine:
        return create_engine(self.sa_url(driver), **kwargs).execution_options(**self.options)

    def async_engine(self, driver: str, **kwargs: Any) -> AsyncEngine:
        engine = create_async_engine(self.sa_url(driver), poolclass=NullPool, **kwargs)
        return engine.execution_options(**self.options)

    def count(self, table: str) -> int:
        """Rows in one of the app's tables (read outside SQLAlchemy)."""
        if self.schema is None:
            path = make_url(self.url).database
            assert path is not None
            with sqlite3.connect(path) as conn:
                (n,) = conn.execute(f"SELECT count(*) FROM {table}").fetchone()  # noqa: S608
            return int(n)
        with psycopg.connect(self.url, autocommit=True) as conn:
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(self.schema, table))
            row = conn.execute(query).fetchone()
            assert row is not None
            return int(row[0])

    def lines(self, event_id: int) -> int:
        """The ``sqla_lines`` rows a handler wrote for one event."""
        if self.schema is None:
            path = make_url(self.url).database
            assert path is not None
            with sqlite3.connect(path) as conn:
                query = "SELECT count(*) FROM sqla_lines WHERE event_id = ?"
                (n,) = conn.execute(query, (event_id,)).fetchone()
            return int(n)
        with psycopg.connect(self.url, autocommit=True) as conn:
            query = sql.SQL("SELECT count(*) FROM {} WHERE event_id = %s").format(
                sql.Identifier(self.schema, "sqla_lines")
            )
            row = conn.execute(query, (event_id,)).fetchone()
            assert row is not None
            return int(row[0])

    def events(self) -> int:
        return len(self.store.events())


@pytest.fixture
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The database named by the test's ``kind`` parameter, with the app's tables."""
    kind, driver = (request.param, "") if isinstance(request.param, str) else request.param
    if kind == "pg":
        url = pg.test_url(pg.pg_url_from_env())
        pg.require_server(url)
        with pg.fresh_schema(url, "oksqla") as schema:
            store = PostgresStore(url, schema=schema)
            try:
                store.migrate()
                db = Database("pg", store, url, schema, driver)
                engine = db.engine("psycopg")
                Base.metadata.create_all(engine)
                engine.dispose()
                yield db
            finally:
                store.close()
    else:
        path = tmp_path / "app.db"
        store = SQLiteStore(path)
        try:
            db = Database("sqlite", store, f"sqlite:///{path.as_posix()}", None, driver)
            engine = db.engine("pysqlite")
            Base.metadata.create_all(engine)
            engine.dispose()
            yield db
        finally:
            store.close()


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock("2030-01-01T00:00:00Z")


@pytest.fixture
def outbox(database: Database, clock: FrozenClock) -> Outbox:
    return Outbox(database.store, EventBus(), clock=clock, load_entry_points=False)
