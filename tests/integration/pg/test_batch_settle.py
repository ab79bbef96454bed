"""A PostgreSQL batch's settlement: the records its deliveries kept (handlers that never took
the connection) are written with the settlement in one statement when every kept record is one
of the events being settled, by ``insert_records_fenced`` before the settlement otherwise; a
stale token settles nothing and records nothing either way. The asyncio side's batch keeps them
the same way.

A batch begins its transaction lazily: with the first delivery that takes the connection, or
the first step of more than one statement. Settled as its last write (``settle_last``), a batch
whose handlers never took the connection is one statement, a transaction of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.pq import TransactionStatus

from outboxkit import EventBus, Outbox, Outcome
from outboxkit.core.machine import Publish, Retry
from outboxkit.core.model import Claim
from outboxkit_pg import PostgresStore

pytestmark = pytest.mark.pg

LEASE = timedelta(seconds=30)


@pytest.fixture
def store(pg_url: str, pg_schema: str) -> Iterator[PostgresStore]:
    opened = PostgresStore(pg_url, schema=pg_schema, notify=False)
    try:
        opened.migrate()
        yield opened
    finally:
        opened.close()


@pytest.fixture
def statements(store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the statements the store runs, in order."""
    names: list[str] = []
    run = store.dialect.rows

    def spy(conn: Any, name: str, params: Any) -> Any:
        names.append(name)
        return run(conn, name, params)

    monkeypatch.setattr(store.dialect, "rows", spy)
    return names


def claimed(store: PostgresStore, events: int) -> list[Claim]:
    outbox = Outbox(store, EventBus(), load_entry_points=False)
    with store.transaction() as tx:
        outbox.enqueue_many(tx, [("t", {"n": n}) for n in range(events)])
    claims = store.claim(batch_size=events, lease=LEASE, now=None)
    assert len(claims) == events
    return claims


def kept_batch(store: PostgresStore, claims: list[Claim], settle: list[Claim]) -> list[bool]:
    """Deliver ``claims`` in one batch, none taking the connection, and settle ``settle``."""
    with store.batch(now=None) as batch:
        for claim in claims:
            with batch.delivery(claim, now=None) as tx:
                tx.record("h", Outcome.SUCCEEDED)
        return batch.settle_many([(c, Publish(), None) for c in settle], now=None)


def recorded(store: PostgresStore, claims: list[Claim]) -> list[int]:
    """The ids of ``claims``' events that have a record, in record order."""
    return [c.event.id for c in claims for _ in store.records(c.event.id)]


def published(store: PostgresStore, claims: list[Claim]) -> list[bool]:
    events = [store.get(c.event.id) for c in claims]
    return [event is not None and event.published_at is not None for event in events]


def test_kept_records_of_the_settled_events_go_with_the_settlement(
    store: PostgresStore, statements: list[str]
) -> None:
    claims = claimed(store, 3)
    statements.clear()
    assert kept_batch(store, claims, claims) == [True, True, True]
    assert statements == ["publish_recording"]  # every event published: the short statement
    assert recorded(store, claims) == [c.event.id for c in claims]
    assert published(store, claims) == [True, True, True]
    assert [r.attempt for c in claims for r in store.records(c.event.id)] == [1, 1, 1]


def test_a_round_with_a_retry_or_a_rejection_settles_through_the_general_statement(
    store: PostgresStore, statements: list[str]
) -> None:
    claims = claimed(store, 3)
    statements.clear()
    with store.batch(now=None) as batch:
        for claim in claims:
            with batch.delivery(claim, now=None) as tx:
                if claim is claims[1]:
                    tx.record("h", Outcome.REJECTED, reason="not ours")
                else:
                    tx.record("h", Outcome.SUCCEEDED)
        settled = batch.settle_many(
            [
                (claims[0], Publish(), None),
                (claims[1], Publish(), None),
                (claims[2], Retry(delay=timedelta(seconds=5), retry=1), "g: boom"),
            ],
            now=None,
        )
    assert settled == [True, True, True]
    assert statements == ["settle_many_recording"]
    assert [r.reason for c in claims for r in store.records(c.event.id)] == [
        None,
        "not ours",
        None,
    ]
    assert published(store, claims) == [True, True, False]


def test_a_kept_record_of_an_event_not_settled_is_written_on_its_own(
    store: PostgresStore, statements: list[str]
) -> None:
    claims = claimed(store, 3)
    statements.clear()
    assert kept_batch(store, claims, claims[:2]) == [True, True]
    assert statements == ["insert_records_fenced", "publish_many"]
    assert recorded(store, claims) == [c.event.id for c in claims]
    assert published(store, claims) == [True, True, False]


def test_a_stale_token_settles_and_records_nothing(
    store: PostgresStore, statements: list[str], pg_url: str
) -> None:
    claims = claimed(store, 3)
    stale = claims[1]
    with psycopg.connect(pg_url, autocommit=True) as admin:  # another poller took it over
        admin.execute(
            sql.SQL("UPDATE {} SET claim_token = gen_random_uuid() WHERE id = %s").format(
                sql.Identifier(store.names.schema, "outbox_events")
            ),
            (stale.event.id,),
        )
    statements.clear()
    assert kept_batch(store, claims, claims) == [True, False, True]
    assert statements == ["publish_recording"]
    assert recorded(store, claims) == [claims[0].event.id, claims[2].event.id]
    assert published(store, claims) == [True, False, True]


@pytest.mark.asyncio
async def test_the_asyncio_batch_keeps_records_the_same_way(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = claimed(store, 3)
    side = store.async_store()
    names: list[str] = []
    run = side.rows

    async def spy(conn: Any, name: str, params: Any) -> Any:
        names.append(name)
        return await run(conn, name, params)

    monkeypatch.setattr(side, "rows", spy)
    try:
        async with side.batch(now=None) as batch:
            for claim in claims:
                async with batch.delivery(claim, now=None) as tx:
                    await tx.record("h", Outcome.SUCCEEDED)
            settled = await batch.settle_many([(c, Publish(), None) for c in claims], now=None)
    finally:
        await side.close()
    assert settled == [True, True, True]
    assert names == ["publish_recording"]
    assert recorded(store, claims) == [c.event.id for c in claims]
    assert published(store, claims) == [True, True, True]


# -- the batch's transaction, begun lazily -------------------------------------------------------


def seen_published(pg_url: str, store: PostgresStore, claims: list[Claim]) -> list[bool]:
    """Whether another session sees ``claims``' events published (committed)."""
    query = sql.SQL("SELECT published_at IS NOT NULL FROM {} WHERE id = ANY(%s) ORDER BY id")
    with psycopg.connect(pg_url, autocommit=True) as other:
        table = sql.Identifier(store.names.schema, "outbox_events")
        rows = other.execute(query.format(table), ([c.event.id for c in claims],)).fetchall()
    return [row[0] for row in rows]


def test_a_batch_whose_handlers_never_took_the_connection_settles_last_in_one_statement(
    store: PostgresStore, statements: list[str], pg_url: str
) -> None:
    claims = claimed(store, 3)
    statements.clear()
    with store.batch(now=None) as batch:
        conn = batch.conn
        for claim in claims:
            with batch.delivery(claim, now=None) as tx:
                tx.record("h", Outcome.SUCCEEDED)
        assert conn.info.transaction_status == TransactionStatus.IDLE  # nothing begun
        settled = batch.settle_last([(c, Publish(), None) for c in claims], now=None)
        # committed before the block ends: the statement was its own transaction
        assert conn.info.transaction_status == TransactionStatus.IDLE
        assert seen_published(pg_url, store, claims) == [True, True, True]
    assert settled == [True, True, True]
    assert statements == ["publish_recording"]
    assert recorded(store, claims) == [c.event.id for c in claims]


def test_a_batch_whose_handler_took_the_connection_commits_once_at_its_end(
    store: PostgresStore, pg_url: str
) -> None:
    claims = claimed(store, 2)
    with store.batch(now=None) as batch:
        conn = batch.conn
        with batch.delivery(claims[0], now=None) as tx:
            tx.record("h", Outcome.SUCCEEDED)
        assert conn.info.transaction_status == TransactionStatus.IDLE
        assert not batch.guarded
        with batch.delivery(claims[1], now=None) as tx:
            tx.connection.execute("SELECT 1")  # begins the batch's transaction
            tx.record("h", Outcome.SUCCEEDED)
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        assert batch.guarded  # the commit guard queued with the BEGIN, once for the batch
        settled = batch.settle_last([(c, Publish(), None) for c in claims], now=None)
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        assert seen_published(pg_url, store, claims) == [False, False]  # not yet committed
    assert settled == [True, True]
    assert seen_published(pg_url, store, claims) == [True, True]
    assert recorded(store, claims) == [c.event.id for c in claims]


def test_a_step_of_the_batch_before_its_settlement_begins_it(
    store: PostgresStore, pg_url: str
) -> None:
    """``settle_many``, and a lease extension, are written in the batch's transaction (begun
    for them): the batch that raises afterwards undoes them."""
    claims = claimed(store, 2)
    with pytest.raises(RuntimeError, match="poller died"), store.batch(now=None) as batch:
        extended = batch.extend(claims, lease=LEASE * 10, now=None)
        assert [c.token for c in extended] == [c.token for c in claims]
        assert batch.settle_many([(claims[0], Publish(), None)], now=None) == [True]
        assert batch.conn.info.transaction_status == TransactionStatus.INTRANS
        raise RuntimeError("poller died")
    assert seen_published(pg_url, store, claims) == [False, False]
    event = store.get(claims[1].event.id)
    assert event is not None and event.locked_until == claims[1].locked_until  # not extended


@pytest.mark.asyncio
async def test_the_asyncio_batch_begins_lazily_the_same_way(
    store: PostgresStore, pg_url: str
) -> None:
    claims = claimed(store, 4)
    side = store.async_store()
    try:
        async with side.batch(now=None) as batch:
            for claim in claims[:2]:
                async with batch.delivery(claim, now=None) as tx:
                    await tx.record("h", Outcome.SUCCEEDED)
            assert batch.conn.info.transaction_status == TransactionStatus.IDLE
            items = [(c, Publish(), None) for c in claims[:2]]
            assert await batch.settle_last(items, now=None) == [True, True]
            assert seen_published(pg_url, store, claims[:2]) == [True, True]
        async with side.batch(now=None) as batch:
            for claim in claims[2:]:
                async with batch.delivery(claim, now=None) as tx:
                    await tx.open()
                    await tx.connection.execute("SELECT 1")
                    await tx.record("h", Outcome.SUCCEEDED)
            items = [(c, Publish(), None) for c in claims[2:]]
            assert await batch.settle_last(items, now=None) == [True, True]
            assert batch.conn.info.transaction_status == TransactionStatus.INTRANS
            assert seen_published(pg_url, store, claims[2:]) == [False, False]
    finally:
        await side.close()
    assert seen_published(pg_url, store, claims) == [True, True, True, True]
    assert recorded(store, claims) == [c.event.id for c in claims]
