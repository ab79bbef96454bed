"""Acceptance 1: an event enqueued through a SQLAlchemy session is in the ORM's own transaction,
on every driver SQLAlchemy has for the store's database: commit -> 1 event, rollback -> 0, an
exception inside ``with session.begin():`` -> 0 (with the app's row each time)."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outboxkit import Outbox

from .conftest import DRIVERS, Database, Order

ASYNC = {"asyncpg", "aiosqlite"}


class Boom(Exception):
    pass


def _sync_cases(db: Database, outbox: Outbox) -> list[tuple[int, int]]:
    engine = db.engine(db.driver)
    seen = []
    try:
        with Session(engine) as session:  # commit
            session.add(Order(item="commit"))
            event_id = outbox.enqueue(session, "order.placed", {"item": "commit"})
            session.commit()
        assert db.store.get(event_id) is not None
        seen.append((db.events(), db.count("sqla_orders")))
        with Session(engine) as session:  # rollback
            session.add(Order(item="rollback"))
            outbox.enqueue(session, "order.placed", {"item": "rollback"})
            session.rollback()
        seen.append((db.events(), db.count("sqla_orders")))
        with Session(engine) as session, pytest.raises(Boom), session.begin():  # a raise
            session.add(Order(item="raise"))
            outbox.enqueue_many(session, [("order.placed", {"n": 1}), ("order.placed", {})])
            raise Boom
        seen.append((db.events(), db.count("sqla_orders")))
        with engine.connect() as conn:  # a Connection, commit as you go
            outbox.enqueue(conn, "order.placed", {"via": "connection"})
            conn.commit()
        seen.append((db.events(), db.count("sqla_orders")))
    finally:
        engine.dispose()
    return seen


async def _async_cases(db: Database, outbox: Outbox) -> list[tuple[int, int]]:
    engine = db.async_engine(db.driver)
    seen = []
    try:
        async with AsyncSession(engine) as session:
            session.add(Order(item="commit"))
            await outbox.enqueue_async(session, "order.placed", {"item": "commit"})
            await session.commit()
        seen.append((db.events(), db.count("sqla_orders")))
        async with AsyncSession(engine) as session:
            session.add(Order(item="rollback"))
            await outbox.enqueue_async(session, "order.placed", {"item": "rollback"})
            await session.rollback()
        seen.append((db.events(), db.count("sqla_orders")))
        async with AsyncSession(engine) as session:
            with pytest.raises(Boom):
                async with session.begin():
                    session.add(Order(item="raise"))
                    await outbox.enqueue_many_async(
                        session, [("order.placed", {"n": 1}), ("order.placed", {})]
                    )
                    raise Boom
        seen.append((db.events(), db.count("sqla_orders")))
        async with engine.connect() as conn:
            await outbox.enqueue_async(conn, "order.placed", {"via": "connection"})
            await conn.commit()
        seen.append((db.events(), db.count("sqla_orders")))
    finally:
        await engine.dispose()
    return seen


@pytest.mark.parametrize("database", DRIVERS, indirect=True)
def test_commit_keeps_the_event_rollback_and_a_raise_remove_it(
    database: Database, outbox: Outbox
) -> None:
    if database.driver in ASYNC:
        import asyncio

        seen = asyncio.run(_async_cases(database, outbox))
    else:
        seen = _sync_cases(database, outbox)
    # (events, app rows) after: commit, rollback, a raise in begin(), a Connection's commit
    assert seen == [(1, 1), (1, 1), (1, 1), (2, 1)]
    (first, second) = database.store.events()
    assert (first.topic, first.payload) == ("order.placed", {"item": "commit"})
    assert second.payload == {"via": "connection"}
