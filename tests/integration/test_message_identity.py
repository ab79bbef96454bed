"""The message identity (``Event.message_id``) across a schema upgrade, and on every way into
the SQL stores.

The upgrade that adds it (PostgreSQL schema version 5, SQLite 6) leaves the rows already there
without one: their identity stays their decimal id, the one their messages carried before, so a
re-publish of an event sent before the upgrade is still a duplicate to the NATS stream and the
consumer's inbox. Every event written after it gets a random UUID drawn by the database.
"""

from __future__ import annotations

import sqlite3
import uuid
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from outboxkit import FrozenClock, Message, Outbox, SchemaError, Store
from outboxkit.core.payload import build_event
from outboxkit.relay import message_of, topic_destination
from outboxkit_sqlite import SQLiteStore
from outboxkit_sqlite import schema as sqlite_schema
from outboxkit_sqlite.tables import TableNames
from tests.integration.pg.conftest import pg_schema, pg_url  # noqa: F401 - the fixtures

LEASE = timedelta(seconds=30)


def is_uuid(text: str) -> bool:
    return str(uuid.UUID(text)) == text


def check_upgraded(store: Store, old: list[int]) -> None:
    """``old`` were written before the upgrade: their identity is their decimal id, on every
    read and in the message a relay makes; a new event gets a UUID."""
    for event_id in old:
        event = store.get(event_id)
        assert event is not None and event.message_id == str(event_id)
        message = message_of(event, topic_destination)
        assert message.message_id == message.headers["outbox-message-id"] == str(event_id)
    with store.transaction() as tx:
        (new,) = store.enqueue(tx, [build_event("t", {"new": True})], now=None)
    fresh = store.get(new)
    assert fresh is not None and is_uuid(fresh.message_id)
    assert [e.message_id for e in store.events()] == [*map(str, old), fresh.message_id]
    claims = store.claim(batch_size=10, lease=LEASE, now=None)
    assert [c.event.message_id for c in claims] == [*map(str, old), fresh.message_id]


@pytest.mark.pg
def test_pg_upgrade_to_version_5_keeps_the_identity_of_the_events_already_there(
    pg_url: str,  # noqa: F811
    pg_schema: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import outboxkit_pg.store as pg_store_module
    from outboxkit_pg import PostgresStore

    with monkeypatch.context() as patch:  # the schema as version 4 left it
        patch.setattr(pg_store_module, "SCHEMA_VERSION", 4)
        patch.setattr(pg_store_module, "MIGRATIONS", pg_store_module.MIGRATIONS[:4])
        old = PostgresStore(pg_url, schema=pg_schema, notify=False)
        try:
            assert old.migrate().after == 4
            with old.transaction() as tx:
                events = [build_event("t", {"n": 1}), build_event("t", {"n": 2}, key="k")]
                ids = old.enqueue(tx, events, now=None)
        finally:
            old.close()
    store = PostgresStore(pg_url, schema=pg_schema, notify=False)
    try:
        migration = store.migrate()
        assert (migration.before, migration.after) == (4, pg_store_module.SCHEMA_VERSION)
        check_upgraded(store, ids)
    finally:
        store.close()


def test_sqlite_upgrade_to_version_6_keeps_the_identity_of_the_events_already_there(
    tmp_path: Path,
) -> None:
    path = tmp_path / "app.db"
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        sqlite_schema.migrate(conn, TableNames(), applied_at=0, where=str(path), target=5)
        conn.execute("COMMIT")
    with SQLiteStore(path, migrate=False) as store:
        # An app writing before its pollers migrate: the version 5 statements, keys and
        # dedupe keys included; the rows have no message id yet.
        outbox = Outbox(store)  # the system clock, as check_upgraded's claim (now=None)
        with store.transaction() as tx:
            ids = [outbox.enqueue(tx, "t", {"n": 0})]
            ids += outbox.enqueue_many(
                tx, [Message("t", {"n": 1}, key="k"), Message("t", {"n": 2}, dedupe_key="once")]
            )
            assert outbox.enqueue(tx, "t", {"n": 3}, dedupe_key="once") == ids[2]
        with pytest.raises(SchemaError, match=f"older than version {sqlite_schema.SCHEMA_VERSION}"):
            store.claim(batch_size=10, lease=LEASE, now=None)
        migration = store.migrate()
        assert (migration.before, migration.after) == (5, sqlite_schema.SCHEMA_VERSION)
        check_upgraded(store, ids)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_an_event_enqueued_through_sqlalchemy_gets_a_message_id(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The statements another library's connection runs (``portable_enqueue``) draw it too."""
    if kind == "sqlite":
        path = tmp_path / "app.db"
        store: Store = SQLiteStore(path)
        engine = create_engine(f"sqlite:///{path.as_posix()}")
    else:
        from outboxkit_pg import PostgresStore

        url = request.getfixturevalue("pg_url")
        store = PostgresStore(url, schema=request.getfixturevalue("pg_schema"), notify=False)
        store.migrate()
        engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        outbox = Outbox(store, clock=FrozenClock("2030-01-01T00:00:00Z"))
        with Session(engine) as session:
            ids = [outbox.enqueue(session, "t", {"one": 1})]
            ids += outbox.enqueue_many(session, [Message("t", {"n": n}) for n in range(3)])
            session.commit()
        got = [store.get(i) for i in ids]
        assert all(e is not None and is_uuid(e.message_id) for e in got)
        assert len({e.message_id for e in got if e is not None}) == 4
    finally:
        engine.dispose()
        store.close()
