"""The PostgreSQL store inserts a batch without keys or dedupe keys with a statement of its own
(``enqueue_plain``, ``enqueue_portable_plain`` through SQLAlchemy): the rows, ids and due
instants are the same as the keyed statement's, and a batch with a key still numbers it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from outboxkit import EventBus, FrozenClock, Message, Outbox
from outboxkit.core.payload import build_event
from outboxkit_pg import PostgresStore

pytestmark = pytest.mark.pg

NOW = datetime(2030, 1, 1, tzinfo=UTC)
AT = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)


def _plain_batch() -> list[Message]:
    return [
        Message("order.placed", {"n": 0}),
        Message("order.placed", {"n": 1}, headers={"trace": "t1"}, delay=5),
        Message("order.shipped", {"n": 2}, available_at=AT),
        Message("order.placed", {"n": 3}),
    ]


def _keyed_batch() -> list[Message]:
    return [
        Message("order.placed", {"n": 0}, key="a"),
        Message("order.placed", {"n": 1}),
        Message("order.placed", {"n": 2}, key="b"),
        Message("order.placed", {"n": 3}, key="a", delay=5),
    ]


def _rows(admin: psycopg.Connection[Any], store: PostgresStore, ids: list[int]) -> list[Any]:
    query = sql.SQL(
        "SELECT id, topic, payload, headers, key, key_seq, available_at - created_at,"
        " available_at FROM {} WHERE id = ANY(%s) ORDER BY id"
    ).format(sql.Identifier(store.names.schema, store.names.events))
    return admin.execute(query, (ids,)).fetchall()


def _enqueue(how: str, pg_url: str, store: PostgresStore, batch: list[Message]) -> list[int]:
    outbox = Outbox(store, EventBus(), clock=FrozenClock(NOW), load_entry_points=False)
    if how == "psycopg":
        with psycopg.connect(pg_url) as conn:
            return outbox.enqueue_many(conn, batch)
    url = f"postgresql+psycopg://{pg_url.split('://', 1)[1]}"
    engine = create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            return outbox.enqueue_many(session, batch)
    finally:
        engine.dispose()


@pytest.mark.parametrize("how", ["psycopg", "sqlalchemy"])
def test_a_batch_without_keys_is_stored_as_given(
    how: str, pg_url: str, pg_store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    ids = _enqueue(how, pg_url, pg_store, _plain_batch())
    assert len(ids) == 4 and ids == sorted(ids)
    rows = _rows(admin, pg_store, ids)
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("order.placed", {"n": 0}, {}),
        ("order.placed", {"n": 1}, {"trace": "t1"}),
        ("order.shipped", {"n": 2}, {}),
        ("order.placed", {"n": 3}, {}),
    ]
    assert [(r[4], r[5]) for r in rows] == [(None, None)] * 4
    assert [r[6] for r in rows[:2]] == [timedelta(0), timedelta(seconds=5)]
    assert rows[2][7] == AT


@pytest.mark.parametrize("how", ["psycopg", "sqlalchemy"])
def test_a_batch_with_a_key_numbers_it_in_batch_order(
    how: str, pg_url: str, pg_store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    first = _enqueue(how, pg_url, pg_store, _keyed_batch())
    second = _enqueue(how, pg_url, pg_store, _keyed_batch())
    rows = _rows(admin, pg_store, first + second)
    assert [r[0] for r in rows] == first + second
    assert [(r[4], r[5]) for r in rows] == [
        ("a", 1), (None, None), ("b", 1), ("a", 2),
        ("a", 3), (None, None), ("b", 2), ("a", 4),
    ]  # fmt: skip
    assert rows[3][6] == timedelta(seconds=5)


def test_the_statement_follows_the_batch(pg_store: PostgresStore) -> None:
    def built(*events: Message) -> list[Any]:
        return [
            build_event(m.topic, m.payload, key=m.key, dedupe_key=m.dedupe_key, delay=m.delay)
            for m in events
        ]

    plain = built(Message("t", {}), Message("t", {}, delay=1))
    keyed = built(Message("t", {}), Message("t", {}, key="k"))
    deduped = built(Message("t", {}), Message("t", {}, dedupe_key="d"))
    assert pg_store.dialect.insert_query(plain, None)[0] == "enqueue_plain"
    assert pg_store.dialect.insert_query(keyed, None)[0] == "enqueue"
    assert pg_store.dialect.insert_query(deduped, None)[0] == "enqueue"
    assert pg_store.dialect.insert_query(built(Message("t", {})), None)[0] == "enqueue_one"
    queries = pg_store.dialect.queries
    assert pg_store.portable_enqueue(plain, None)[0][0] == queries.text("enqueue_portable_plain")
    assert pg_store.portable_enqueue(keyed, None)[0][0] == queries.text("enqueue_portable")
