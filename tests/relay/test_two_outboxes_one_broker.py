"""Two outboxes on one broker lose each other's events (fixed).

Event ids are unique in one database only: two services (or an app's dev and test databases)
both have an event 1. When the event id was the message's identity, a JetStream stream took the
second outbox's events for duplicates of the first's and acknowledged them unstored, and a
consumer's ``Inbox`` skipped them as already applied. The identity is now the event's
``message_id``, a random UUID its store drew when the event was written: two outboxes relaying
into one NATS stream, one Redis stream and one RabbitMQ queue lose nothing, while a real
duplicate (the same event published again) is still dropped by the stream (NATS) and by the
inbox. Both SQL stores: two PostgreSQL schemas, two SQLite files.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, Message, Outbox, Store, open_store
from outboxkit.relay import BrokerRelay
from outboxkit.relay import nats as relay_nats
from outboxkit.relay import rabbitmq as relay_rabbitmq
from outboxkit.relay import redis as relay_redis
from outboxkit.relay.inbox import Inbox
from tests.integration.pg import conftest as pg
from tests.relay.brokers import Broker, Got
from tests.relay.test_inbox import consumer_db, insert_applied, transaction

EACH = 50  # events per outbox


@contextmanager
def two_stores(kind: str, tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    """Two stores of one kind, each with its own events table: two SQLite files, or two
    schemas of one PostgreSQL database. Their event ids start at 1 alike."""
    with ExitStack() as stack:
        stores: list[Store] = []
        for name in ("service_a", "service_b"):
            if kind == "sqlite":
                store = open_store(f"sqlite:///{(tmp_path / f'{name}.db').as_posix()}")
            else:
                url = pg.test_url(pg.pg_url_from_env())
                pg.require_server(url)
                schema = stack.enter_context(pg.fresh_schema(url, name))
                store = open_store(url, schema=schema)
                store.migrate()
            stack.callback(store.close)
            stores.append(store)
        yield stores[0], stores[1]


async def relay_events(store: Store, broker: Broker, label: str) -> tuple[Outbox, list[int]]:
    """``EACH`` events of ``label`` enqueued in ``store`` and relayed to ``broker`` by an
    asyncio poller (a claimed batch of 20 per publish)."""
    bus = EventBus()
    bus.relay(broker.relay(), topics=[broker.topic("#")], name="relay")
    outbox = Outbox(store, bus, clock=FrozenClock("2030-01-01T00:00:00Z"))
    with store.transaction() as tx:
        ids = outbox.enqueue_many(
            tx,
            [Message(broker.topic("order.placed"), {"from": label, "n": n}) for n in range(EACH)],
        )
    try:
        reports = await outbox.async_poller(batch_size=20, transaction="per_batch").run_until_idle()
    finally:
        await store.async_store().close()
    assert sum(len(r.published) for r in reports) == EACH
    return outbox, ids


def relay_of(outbox: Outbox) -> BrokerRelay[Any]:
    relay = outbox.bus.find("relay").relay
    assert isinstance(relay, BrokerRelay)
    return relay


def apply(inbox: Inbox, conn: Any, messages: list[Got]) -> int:
    """Each message through the inbox in a transaction of its own; how many were applied."""
    applied = 0
    for message in messages:
        with transaction(conn):
            if inbox.accept(conn, message.message_id):
                insert_applied(conn, message.event_id, message.body)
                applied += 1
    return applied


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
async def test_two_outboxes_on_one_broker_lose_none_of_each_others_events(
    kind: str, broker: Broker, tmp_path: Path
) -> None:
    with two_stores(kind, tmp_path) as (store_a, store_b):
        outbox_a, ids_a = await relay_events(store_a, broker, "a")
        outbox_b, ids_b = await relay_events(store_b, broker, "b")
        # The case that lost events: both outboxes' local ids are 1..50.
        assert ids_a == ids_b == list(range(1, EACH + 1))
        assert outbox_a.stats().published == outbox_b.stats().published == EACH

        # Every event arrived once, under its own identity: the store's message_id.
        assert await broker.count() == 2 * EACH
        messages = await broker.read()
        assert len(messages) == 2 * EACH
        stored = {e.message_id: e for s in (store_a, store_b) for e in s.events(limit=10 * EACH)}
        assert len(stored) == 2 * EACH  # 100 distinct message ids across the two stores
        assert {m.message_id for m in messages} == set(stored)
        for m in messages:
            assert m.broker_id == m.message_id == str(uuid.UUID(m.message_id))
            assert stored[m.message_id].id == m.event_id
        sent = {(m.headers["outbox-event-id"], m.body) for m in messages}
        assert len(sent) == 2 * EACH  # both outboxes' payloads, each once

        with consumer_db(kind, tmp_path) as conn:
            inbox = Inbox(consumer="billing")
            with transaction(conn):
                inbox.migrate(conn)
            assert apply(inbox, conn, messages) == 2 * EACH  # lost: 0
            assert apply(inbox, conn, messages) == 0  # each one delivered again: dropped

            # A real duplicate: outbox A publishes its first event again (a lost confirm).
            first = store_a.get(ids_a[0])
            assert first is not None
            relay = relay_of(outbox_a)
            assert await relay.publish([first]) == [None]
            await relay.aclose()
            await relay_of(outbox_b).aclose()
            if broker.name == "nats":
                # The stream dropped it (acknowledged as a duplicate): still 100 stored.
                assert await broker.count() == 2 * EACH
            else:
                # RabbitMQ and Redis keep the copy, under the same identity; the inbox drops it.
                again = await broker.read()
                copies = again if broker.name == "rabbitmq" else again[2 * EACH :]
                assert [(c.message_id, c.event_id) for c in copies] == [
                    (first.message_id, first.id)
                ]
                assert apply(inbox, conn, copies) == 0
            rows = conn.execute("SELECT count(*) FROM applied").fetchone()
            assert rows[0] == 2 * EACH


# -- messages sent before the upgrade -------------------------------------------------------------


def test_a_message_sent_before_the_upgrade_is_identified_by_its_decimal_event_id() -> None:
    """An old relay's messages carried the decimal event id only (``outbox-event-id``, and as
    the broker's own id): ``event_id`` reads that back, so an old message applied before the
    upgrade is still a duplicate (the inbox's old rows become that same text)."""
    old_rabbit = SimpleNamespace(message_id="42", headers={"outbox-event-id": "42"})
    old_nats = SimpleNamespace(headers={"outbox-event-id": "42", "Nats-Msg-Id": "42"})
    old_redis = {b"outbox-event-id": b"42", b"payload": b"{}"}
    assert relay_rabbitmq.event_id(old_rabbit) == "42"  # type: ignore[arg-type]
    assert relay_nats.event_id(old_nats) == "42"  # type: ignore[arg-type]
    assert relay_redis.event_id(old_redis) == "42"

    new_id = str(uuid.uuid4())
    new_rabbit = SimpleNamespace(
        message_id=new_id, headers={"outbox-message-id": new_id, "outbox-event-id": "42"}
    )
    new_nats = SimpleNamespace(
        headers={"outbox-message-id": new_id, "outbox-event-id": "42", "Nats-Msg-Id": new_id}
    )
    new_redis = {"outbox-message-id": new_id, "outbox-event-id": "42"}
    assert relay_rabbitmq.event_id(new_rabbit) == new_id  # type: ignore[arg-type]
    assert relay_nats.event_id(new_nats) == new_id  # type: ignore[arg-type]
    assert relay_redis.event_id(new_redis) == new_id
    # Upper case (a broker tool re-typing it) reads as the relay wrote it.
    assert relay_redis.event_id({"outbox-message-id": new_id.upper()}) == new_id

    for foreign in (
        SimpleNamespace(headers={}),
        SimpleNamespace(headers={"outbox-message-id": "not-a-uuid"}),
        SimpleNamespace(headers={"outbox-event-id": "-3"}),
    ):
        with pytest.raises(ValueError, match="not an outbox message"):
            relay_nats.event_id(foreign)  # type: ignore[arg-type]
