"""The consumer side: a message delivered twice is applied once (the inbox table, in the
consumer's own transaction), for each broker and on both consumer databases."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql

from outboxkit import EventBus, FrozenClock, Message, Outbox, open_store
from outboxkit.errors import ConfigurationError
from outboxkit.relay import BrokerRelay
from outboxkit.relay.inbox import Inbox
from tests.integration.pg import conftest as pg
from tests.relay.brokers import Broker


@contextmanager
def consumer_db(kind: str, tmp_path: Path) -> Iterator[Any]:
    """The consumer's own database: an ``applied`` table its effects go to."""
    if kind == "sqlite":
        conn = sqlite3.connect(tmp_path / "consumer.db", isolation_level=None)
        conn.execute("CREATE TABLE applied (event_id INTEGER, body TEXT)")
        try:
            yield conn
        finally:
            conn.close()
        return
    url = pg.test_url(pg.pg_url_from_env())
    pg.require_server(url)
    with pg.fresh_schema(url, "okinbox") as schema:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        with psycopg.connect(url, options=f"-c search_path={schema}") as conn:
            conn.execute("CREATE TABLE applied (event_id bigint, body text)")
            conn.commit()
            yield conn


@contextmanager
def transaction(conn: Any) -> Iterator[None]:
    if isinstance(conn, sqlite3.Connection):
        conn.execute("BEGIN")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    else:
        with conn.transaction():
            yield


def insert_applied(conn: Any, event_id: int, body: bytes) -> None:
    if isinstance(conn, sqlite3.Connection):
        conn.execute("INSERT INTO applied VALUES (?, ?)", (event_id, body.decode()))
    else:
        conn.execute("INSERT INTO applied VALUES (%s, %s)", (event_id, body.decode()))


@pytest_asyncio.fixture
async def relayed(tmp_path: Path, broker: Broker) -> AsyncIterator[tuple[Broker, list[int]]]:
    """Ten events relayed to the broker."""
    relay = broker.relay()
    bus = EventBus()
    bus.relay(relay, topics=[broker.topic("#")], name="relay")
    store = open_store(f"sqlite:///{(tmp_path / 'outbox.db').as_posix()}")
    outbox = Outbox(store, bus, clock=FrozenClock("2030-01-01T00:00:00Z"))
    with store.transaction() as tx:
        ids = outbox.enqueue_many(tx, [Message(broker.topic("x"), {"i": i}) for i in range(10)])
    await outbox.async_poller().run_until_idle()
    assert isinstance(relay, BrokerRelay)
    await relay.aclose()
    await store.async_store().close()
    store.close()
    yield broker, ids


@pytest.mark.asyncio
@pytest.mark.parametrize("db", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
async def test_a_message_delivered_twice_is_applied_once(relayed, db, tmp_path):
    broker, ids = relayed
    messages = await broker.read()
    assert len(messages) == 10
    inbox = Inbox(consumer="billing")
    with consumer_db(db, tmp_path) as conn:
        with transaction(conn):
            inbox.migrate(conn)
        applied = 0
        for message in [*messages, *messages]:  # each one twice
            with transaction(conn):
                if inbox.accept(conn, message.message_id):
                    insert_applied(conn, message.event_id, message.body)
                    applied += 1
        rows = conn.execute("SELECT event_id FROM applied ORDER BY event_id").fetchall()
        assert applied == 10
        assert [r[0] for r in rows] == sorted(ids)
        # Another consumer on the same inbox table sees every event once too.
        other = Inbox(consumer="shipping")
        with transaction(conn):
            assert [other.accept(conn, m.message_id) for m in messages[:2]] == [True, True]


@pytest.mark.parametrize("db", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_a_rolled_back_application_leaves_the_message_to_be_applied_again(db, tmp_path):
    inbox = Inbox(consumer="billing")
    with consumer_db(db, tmp_path) as conn:
        with transaction(conn):
            inbox.migrate(conn)
        with pytest.raises(RuntimeError), transaction(conn):
            assert inbox.accept(conn, 7)
            raise RuntimeError("the consumer's effect failed")
        with transaction(conn):
            assert inbox.accept(conn, 7)  # the redelivery is applied
        with transaction(conn):
            assert not inbox.accept(conn, 7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"consumer": ""}, "consumer"),
        ({"consumer": "c", "table": "bad name"}, "table"),
        ({"consumer": "c", "table": 'x"; drop'}, "table"),
    ],
)
def test_a_bad_inbox_is_refused_naming_the_option(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        Inbox(**kwargs)


def test_a_message_id_that_is_not_one_is_refused(tmp_path):
    inbox = Inbox(consumer="c")
    with consumer_db("sqlite", tmp_path) as conn:
        inbox.migrate(conn)
        for bad in (0, -1, "", "x" * 201, "a\x00b", True, 1.5, None, b"7"):
            with pytest.raises(ConfigurationError, match="message_id"):
                inbox.accept(conn, bad)
        with pytest.raises(ConfigurationError, match="sqlite3 or psycopg"):
            inbox.accept(object(), "7")
        # An int, as older code passed the event id, is its decimal text.
        assert inbox.accept(conn, 7)
        assert not inbox.accept(conn, "7")


OLD_FORMAT = {
    "sqlite": """CREATE TABLE outboxkit_inbox (
        consumer TEXT NOT NULL,
        event_id INTEGER NOT NULL,
        received_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        PRIMARY KEY (consumer, event_id))""",
    "pg": """CREATE TABLE outboxkit_inbox (
        consumer text NOT NULL,
        event_id bigint NOT NULL,
        received_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (consumer, event_id))""",
}
"""The inbox table as outboxkit created it before message ids (keyed on the event id)."""


def inbox_columns(conn: Any) -> dict[str, str]:
    if isinstance(conn, sqlite3.Connection):
        rows = conn.execute("SELECT name, type FROM pragma_table_info('outboxkit_inbox')")
    else:
        rows = conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns"
            " WHERE table_name = 'outboxkit_inbox' AND table_schema = current_schema()"
        )
    return {name: kind.lower() for name, kind in rows.fetchall()}


@pytest.mark.parametrize("db", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_inbox_migrate_upgrades_an_old_format_table_and_its_ids_stay_duplicates(db, tmp_path):
    """Messages sent before the upgrade carry the decimal event id as their identity: one the
    old inbox applied is still a duplicate after ``migrate``; new (UUID) ids go in beside."""
    with consumer_db(db, tmp_path) as conn:
        with transaction(conn):
            conn.execute(OLD_FORMAT[db])
            conn.execute(
                "INSERT INTO outboxkit_inbox (consumer, event_id)"
                " VALUES ('billing', 7), ('shipping', 8)"
            )
        inbox = Inbox(consumer="billing")
        with transaction(conn):
            inbox.migrate(conn)
        with transaction(conn):
            inbox.migrate(conn)  # idempotent: already upgraded
        columns = inbox_columns(conn)
        assert "event_id" not in columns and columns["message_id"] == "text"
        fresh = str(uuid.uuid4())
        with transaction(conn):
            assert not inbox.accept(conn, "7")  # applied before the upgrade: a duplicate
            assert not inbox.accept(conn, 7)  # as older code passes it, too
            assert inbox.accept(conn, "8")  # shipping's, not billing's
            assert inbox.accept(conn, fresh)
            assert not inbox.accept(conn, fresh)
        rows = conn.execute(
            "SELECT consumer, message_id FROM outboxkit_inbox ORDER BY consumer, message_id"
        ).fetchall()
        assert [tuple(r) for r in rows] == sorted(
            [("billing", "7"), ("billing", "8"), ("billing", fresh), ("shipping", "8")]
        )


@pytest.mark.pg
@pytest.mark.asyncio
async def test_inbox_migrate_refuses_an_async_connection_naming_migrate_async():
    """``Inbox.migrate(AsyncConnection)`` used to return at once, an unawaited coroutine, having
    created nothing; each blocking method now refuses an async connection naming the async
    one, and each async method a blocking connection naming the blocking one."""
    url = pg.test_url(pg.pg_url_from_env())
    pg.require_server(url)
    inbox = Inbox(consumer="billing")
    with pg.fresh_schema(url, "okinbox") as schema:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        options = f"-c search_path={schema}"
        async with await psycopg.AsyncConnection.connect(url, options=options) as aconn:
            with pytest.raises(ConfigurationError, match=r"await Inbox\.migrate_async\(aconn"):
                inbox.migrate(aconn)
            with pytest.raises(ConfigurationError, match=r"await Inbox\.accept_async\(aconn"):
                inbox.accept(aconn, "7")
            found = await aconn.execute("SELECT to_regclass('outboxkit_inbox')")
            assert await found.fetchone() == (None,)  # nothing was created
            # The async side creates, and upgrades an old-format table, as the blocking one.
            await aconn.execute(OLD_FORMAT["pg"])
            await aconn.execute(
                "INSERT INTO outboxkit_inbox (consumer, event_id) VALUES ('billing', 7)"
            )
            await inbox.migrate_async(aconn)
            await aconn.commit()
            assert not await inbox.accept_async(aconn, "7")
            assert await inbox.accept_async(aconn, "8")
            await aconn.commit()
        with psycopg.connect(url, options=options) as conn:
            with pytest.raises(ConfigurationError, match=r"call Inbox\.migrate\(conn"):
                await inbox.migrate_async(conn)
            with pytest.raises(ConfigurationError, match=r"call Inbox\.accept\(conn"):
                await inbox.accept_async(conn, "9")
            assert inbox_columns(conn)["message_id"] == "text"
        with (
            closing(sqlite3.connect(":memory:")) as other,
            pytest.raises(ConfigurationError, match="needs a psycopg AsyncConnection"),
        ):
            await inbox.accept_async(other, "9")
