"""What enqueue through SQLAlchemy refuses, before any SQL, leaving the caller's transaction
usable: a bad payload, a database of another kind than the store's, a store without a SQL
database, an autocommit connection, an engine, the wrong side (sync/async)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outboxkit import InvalidEvent, MemoryStore, Outbox
from outboxkit.errors import ConfigurationError, SchemaError
from outboxkit_sqlite import SQLiteStore

from .conftest import DATABASES, Database, Order


@pytest.mark.parametrize("database", DATABASES, indirect=True)
def test_a_bad_payload_is_refused_and_the_session_goes_on(
    database: Database, outbox: Outbox
) -> None:
    engine = database.engine("psycopg" if database.kind == "pg" else "pysqlite")
    try:
        with Session(engine) as session:
            session.add(Order(item="kept"))
            with pytest.raises(InvalidEvent):
                outbox.enqueue(session, "order.placed", {"not json": {1, 2}})
            outbox.enqueue(session, "order.placed", {"ok": True})
            session.commit()
            assert session.scalar(select(func.count()).select_from(Order)) == 1
    finally:
        engine.dispose()
    assert database.events() == 1


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_another_kind_of_database_is_refused_naming_both(
    database: Database, tmp_path: Path
) -> None:
    pg_engine = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    outbox = Outbox(database.store, load_entry_points=False)
    with Session(pg_engine) as session, pytest.raises(ConfigurationError) as caught:
        outbox.enqueue(session, "a", {})
    message = str(caught.value)
    assert "postgresql (postgresql+psycopg)" in message and "store is on sqlite" in message
    pg_engine.dispose()  # never connected: the refusal came before any SQL


def test_a_store_without_a_database_and_an_engine_are_refused(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite+pysqlite:///{(tmp_path / 'a.db').as_posix()}")
    try:
        with Session(engine) as session, pytest.raises(ConfigurationError, match="no events in"):
            Outbox(MemoryStore(), load_entry_points=False).enqueue(session, "a", {})
        store = SQLiteStore(tmp_path / "a.db")
        outbox = Outbox(store, load_entry_points=False)
        with pytest.raises(ConfigurationError, match="not an Engine"):
            outbox.enqueue(engine, "a", {})
        autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        with autocommit.connect() as conn, pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
            outbox.enqueue(conn, "a", {})
        assert store.events() == []
        store.close()
    finally:
        engine.dispose()


def test_the_wrong_side_is_refused_naming_the_right_call(tmp_path: Path) -> None:
    path = (tmp_path / "a.db").as_posix()
    store = SQLiteStore(tmp_path / "a.db")
    outbox = Outbox(store, load_entry_points=False)
    engine = create_engine(f"sqlite+pysqlite:///{path}")

    async def both() -> None:
        aengine = create_async_engine(f"sqlite+aiosqlite:///{path}")
        try:
            async with AsyncSession(aengine) as asession:
                with pytest.raises(ConfigurationError, match=r"await outbox\.enqueue_async"):
                    outbox.enqueue(asession, "a", {})
            with (
                Session(engine) as session,
                pytest.raises(ConfigurationError, match=r"outbox\.enqueue\("),
            ):
                await outbox.enqueue_async(session, "a", {})
        finally:
            await aengine.dispose()

    try:
        asyncio.run(both())
    finally:
        engine.dispose()
        store.close()


def test_a_database_without_the_outbox_tables_is_a_schema_error(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "outbox.db")
    engine = create_engine(f"sqlite+pysqlite:///{(tmp_path / 'other.db').as_posix()}")
    try:
        with (
            Session(engine) as session,
            pytest.raises(SchemaError, match="run `outboxkit migrate`"),
        ):
            Outbox(store, load_entry_points=False).enqueue(session, "a", {})
    finally:
        engine.dispose()
        store.close()
