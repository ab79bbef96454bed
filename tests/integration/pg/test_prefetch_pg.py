"""``prefetch`` on PostgreSQL: the next batch claimed (on another pooled connection) while one
is delivered, by the blocking and the asyncio poller, per event and per batch, two pollers at
once: every event's handler runs once and commits once, every event is recorded once and
published, nothing is left claimed."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import Event, EventBus, Outbox
from outboxkit_pg import PostgresStore

pytestmark = pytest.mark.pg

EVENTS = 1_000


def ledger_outbox(store: PostgresStore, ledger: sql.Identifier, *, asyncio_side: bool) -> Outbox:
    """One transactional handler writing a ledger row per event through ``ctx.connection``."""
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(ledger)
    if asyncio_side:

        async def write_async(event: Event, ctx: Any) -> None:
            await ctx.connection.execute(insert, (event.id,))

        bus.subscribe("order", write_async, name="ledger")
    else:

        def write(event: Event, ctx: Any) -> None:
            ctx.connection.execute(insert, (event.id,))

        bus.subscribe("order", write, name="ledger")
    return Outbox(store, bus, load_entry_points=False)


@pytest.mark.parametrize("side", ["blocking", "asyncio"])
@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_two_prefetching_pollers_deliver_every_event_once(
    pg_store: PostgresStore, admin: psycopg.Connection[Any], side: str, transaction: str
) -> None:
    ledger = sql.Identifier(pg_store.names.schema, "ledger")
    admin.execute(sql.SQL("CREATE TABLE {} (event_id bigint NOT NULL)").format(ledger))
    outbox = ledger_outbox(pg_store, ledger, asyncio_side=side == "asyncio")
    with pg_store.transaction() as tx:
        ids = outbox.enqueue_many(tx, [("order", {"n": i}) for i in range(EVENTS)])
    pollers = [
        (outbox.poller if side == "blocking" else outbox.async_poller)(
            batch_size=50, transaction=transaction, prefetch=True
        )
        for _ in range(2)
    ]

    if side == "blocking":
        threads = [threading.Thread(target=p.run_until_idle) for p in pollers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    else:  # one event loop for the store's asyncio side: both pollers on it

        async def both() -> None:
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(p.run_until_idle() for p in pollers)), timeout=120
                )
            finally:
                await pg_store.async_store().close()

        asyncio.run(both())
    rows = admin.execute(sql.SQL("SELECT event_id FROM {}").format(ledger)).fetchall()
    assert sorted(r[0] for r in rows) == sorted(ids)  # each handler's write committed once
    records = admin.execute(
        sql.SQL("SELECT count(*), count(DISTINCT event_id) FROM {}").format(
            sql.Identifier(pg_store.names.schema, pg_store.names.deliveries)
        )
    ).fetchone()
    assert records == (EVENTS, EVENTS)
    stats = pg_store.stats(now=None)
    assert (stats.published, stats.pending, stats.claimed, stats.dead) == (EVENTS, 0, 0, 0)


def test_a_stopped_prefetching_poller_leaves_nothing_claimed(
    pg_store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    ledger = sql.Identifier(pg_store.names.schema, "ledger")
    admin.execute(sql.SQL("CREATE TABLE {} (event_id bigint NOT NULL)").format(ledger))
    outbox = ledger_outbox(pg_store, ledger, asyncio_side=False)
    with pg_store.transaction() as tx:
        outbox.enqueue_many(tx, [("order", {"n": i}) for i in range(200)])
    poller = outbox.poller(batch_size=50, transaction="per_batch", prefetch=True)
    seen = 0

    def stop_after_two(report: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == 2:
            poller.stop()

    poller.run_until_idle(on_round=stop_after_two)
    stats = pg_store.stats(now=None)
    assert (stats.published, stats.claimed) == (100, 0)  # the prefetched third batch released
    refunded = admin.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NULL AND attempts = 0").format(
            sql.Identifier(pg_store.names.schema, pg_store.names.events)
        )
    ).fetchone()
    assert refunded == (100,)
