"""The consumer side: a message delivered twice is applied once (the inbox table, in the
consumer's own transaction), for each broker and on both consumer databases."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
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
        for event_id, _topic, body, _headers in [*messages, *messages]:  # each one twice
            with transaction(conn):
                if inbox.accept(conn, event_id):
                    insert_applied(conn, event_id, body)
                    applied += 1
        rows = conn.execute("SELECT event_id FROM applied ORDER BY event_id").fetchall()
        assert applied == 10
        assert [r[0] for r in rows] == sorted(ids)
        # Another consumer on the same inbox table sees every event once too.
        other = Inbox(consumer="shipping")
        with transaction(conn):
            assert [other.accept(conn, i) for i in ids[:2]] == [True, True]


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


def test_an_event_id_that_is_not_one_is_refused(tmp_path):
    inbox = Inbox(consumer="c")
    with consumer_db("sqlite", tmp_path) as conn:
        inbox.migrate(conn)
        for bad in (0, -1, "7", True):
            with pytest.raises(ConfigurationError, match="event_id"):
                inbox.accept(conn, bad)
        with pytest.raises(ConfigurationError, match="sqlite3 or psycopg"):
            inbox.accept(object(), 1)
