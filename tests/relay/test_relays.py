"""The relays against the real brokers: every event once, what a message carries, failures
that are never recorded as delivered, both pollers."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from outboxkit import EventBus, FrozenClock, Message, Outbox, open_store
from outboxkit.errors import RelayError, Unroutable
from outboxkit.relay import BrokerRelay, Relay
from outboxkit.testing import Drain
from tests.relay.brokers import nats_jetstream, rabbitmq

pytestmark = pytest.mark.asyncio

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest_asyncio.fixture
async def outboxes(tmp_path: Path) -> AsyncIterator[Callable[..., Outbox]]:
    """Outboxes on a SQLite file, each with one relay; closed (relay and store) afterwards."""
    made: list[Outbox] = []

    def make(relay: Relay, topics: list[str], name: str = "relay", **options: Any) -> Outbox:
        bus = EventBus()
        bus.relay(relay, topics=topics, name=name)
        store = open_store(f"sqlite:///{(tmp_path / f'outbox{len(made)}.db').as_posix()}")
        outbox = Outbox(store, bus, clock=FrozenClock("2030-01-01T00:00:00Z"), **options)
        made.append(outbox)
        return outbox

    yield make
    for outbox in made:
        for spec in outbox.bus.specs():
            if isinstance(spec.relay, BrokerRelay):
                await spec.relay.aclose()
                spec.relay.close()
        if outbox.store.capabilities.asyncio:
            await outbox.store.async_store().close()
        outbox.store.close()


def relay_of(outbox: Outbox) -> BrokerRelay[Any]:
    relay = outbox.bus.find("relay").relay
    assert isinstance(relay, BrokerRelay)
    return relay


def enqueue(outbox: Outbox, events: list[Message]) -> list[int]:
    ids: list[int] = []
    for start in range(0, len(events), 1000):
        with outbox.store.transaction() as tx:
            ids += outbox.enqueue_many(tx, events[start : start + 1000])
    return ids


async def test_ten_thousand_events_reach_the_broker_once_each(outboxes, broker):
    outbox = outboxes(broker.relay(), [broker.topic("#")])
    ids = enqueue(
        outbox,
        [Message(broker.topic("order.placed"), {"n": i}, key=f"k{i % 7}") for i in range(10_000)],
    )
    poller = outbox.async_poller(batch_size=500, transaction="per_batch")
    reports = await poller.run_until_idle()

    assert sum(len(r.published) for r in reports) == 10_000
    consumed = await broker.ids()
    assert len(consumed) == 10_000
    assert sorted(consumed) == sorted(ids)  # each id once, none other
    assert consumed == sorted(consumed)  # one key... and all: claim order kept
    assert outbox.stats().published == 10_000
    if broker.name == "nats":
        # Forced re-publishes inside the duplicate window: the stream drops every one.
        relay = relay_of(outbox)
        events = [outbox.store.get(i) for i in ids]
        answers = await relay.publish([e for e in events if e is not None])
        assert answers == [None] * 10_000  # acknowledged (as duplicates)
        info = await broker.extra["js"].stream_info(broker.extra["stream"])
        assert info.state.messages == 10_000


async def test_a_message_carries_the_message_id_event_id_topic_key_headers_and_created_at(
    outboxes, broker
):
    outbox = outboxes(broker.relay(), [broker.topic("order.*")])
    topic = broker.topic("order.placed")
    with outbox.store.transaction() as tx:
        event_id = outbox.enqueue(
            tx,
            topic,
            {"order_id": 42, "name": "Zoë"},
            key="customer-7",
            headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1", "x-app": "shop"},
        )
    await outbox.async_poller().run_until_idle()

    [(got_id, got_topic, body, headers, message_id, broker_id)] = await broker.read()
    assert (got_id, got_topic) == (event_id, topic)
    # The message's identity: the event's message_id (a UUID drawn by the store), in the
    # broker's own id (AMQP message_id, Nats-Msg-Id, the entry's field) and in a header.
    stored = outbox.store.get(event_id)
    assert stored is not None and str(uuid.UUID(stored.message_id)) == stored.message_id
    assert message_id == broker_id == headers["outbox-message-id"] == stored.message_id
    assert json.loads(body) == {"order_id": 42, "name": "Zoë"}
    assert headers["traceparent"] == TRACEPARENT
    assert headers["tracestate"] == "vendor=1"
    assert headers["x-app"] == "shop"
    assert headers["outbox-key"] == "customer-7"
    assert headers["outbox-event-id"] == str(event_id)
    assert headers["outbox-created-at"] == "2030-01-01T00:00:00+00:00"


async def test_the_blocking_poller_relays_through_the_relays_own_loop(outboxes, broker):
    outbox = outboxes(broker.relay(), [broker.topic("#")])
    ids = enqueue(outbox, [Message(broker.topic("a.b"), {"n": i}) for i in range(1_000)])
    reports = outbox.poller(batch_size=200, transaction="per_batch").run_until_idle()
    assert sum(len(r.published) for r in reports) == 1_000
    assert sorted(await broker.ids()) == ids


async def test_a_topic_the_relay_does_not_match_is_not_relayed(outboxes, broker):
    outbox = outboxes(broker.relay(), [broker.topic("order.*")])
    with outbox.store.transaction() as tx:
        kept = outbox.enqueue(tx, broker.topic("order.placed"), {})
        outbox.enqueue(tx, broker.topic("order.placed.eu"), {})  # '*' is one word
        outbox.enqueue(tx, broker.topic("invoice.sent"), {})
    report = await Drain(outbox, outbox.clock).async_()  # type: ignore[arg-type]
    assert await broker.ids() == [kept]
    assert len(report.published) == 3  # the other two: no subscriber, published (R9)


async def test_an_unroutable_rabbitmq_message_fails_and_is_dead_lettered(outboxes):
    async with rabbitmq() as broker:
        outbox = outboxes(broker.relay(), ["#"], max_retries=2)
        with outbox.store.transaction() as tx:
            routed = outbox.enqueue(tx, broker.topic("x"), {})
            lost = outbox.enqueue(tx, "nowhere.x", {})  # the queue is bound to <prefix>.#
        drain = Drain(outbox, outbox.clock)  # type: ignore[arg-type]
        with drain.expect_failures(Unroutable):
            report = await drain.async_()
        assert report.dead_lettered == [lost]
        assert await broker.ids() == [routed]
        assert outbox.store.records(lost) == []  # never recorded as delivered
        dead = outbox.store.get(lost)
        assert dead is not None and dead.attempts == 3
        assert "routes 'nowhere.x' to no queue" in (dead.last_error or "")


async def test_a_nats_subject_no_stream_covers_fails_and_is_dead_lettered(outboxes):
    async with nats_jetstream() as broker:
        outbox = outboxes(broker.relay(), ["#"], max_retries=2)
        with outbox.store.transaction() as tx:
            covered = outbox.enqueue(tx, broker.topic("x"), {})
            lost = outbox.enqueue(tx, f"{broker.prefix}nostream.x", {})
        drain = Drain(outbox, outbox.clock)  # type: ignore[arg-type]
        with drain.expect_failures(Unroutable):
            report = await drain.async_()
        assert report.dead_lettered == [lost]
        assert await broker.ids() == [covered]
        assert outbox.store.records(lost) == []
        dead = outbox.store.get(lost)
        assert dead is not None and dead.attempts == 3
        assert "no JetStream stream covers subject" in (dead.last_error or "")


async def test_an_unreachable_broker_fails_the_batch_without_the_password(outboxes):
    from outboxkit.relay.rabbitmq import RabbitMQRelay

    relay = RabbitMQRelay("amqp://guest:s3cr3t-pw@127.0.0.1:1/", exchange="x", confirm_timeout=5)
    outbox = outboxes(relay, ["#"], max_retries=0)
    store = outbox.store
    with store.transaction() as tx:
        ids = outbox.enqueue_many(tx, [Message("a", {}), Message("b", {})])
    drain = Drain(outbox, outbox.clock)  # type: ignore[arg-type]
    with drain.expect_failures(RelayError):
        report = await drain.async_()
    assert report.dead_lettered == ids
    for event_id in ids:
        event = store.get(event_id)
        assert event is not None and event.last_error
        assert "s3cr3t-pw" not in event.last_error
        assert "guest:***@127.0.0.1:1" in event.last_error
    assert "s3cr3t-pw" not in repr(relay)
