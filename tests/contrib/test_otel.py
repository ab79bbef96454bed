"""``outboxkit.contrib.otel``: the trace from the request that enqueued an event to the handlers
that ran it and its follow-ups, read from the OpenTelemetry SDK's in-memory exporter.

Both pollers, per event (the delivery span is the enqueue's child) and in a batch (a link), on
the memory store and on a real SQLite file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outboxkit import EventBus, FrozenClock, MemoryStore, Outbox, Reject, open_store
from outboxkit.contrib.otel import Tracing

SQL = "sqlite"


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


@pytest.fixture(params=["memory", SQL])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    store = MemoryStore() if request.param == "memory" else open_store(f"sqlite:///{tmp_path}/t.db")
    store.migrate()
    yield store
    store.close()


def _bus(asyncio_handlers: bool) -> EventBus:
    """``order.placed`` -> ``reserve`` (enqueues ``stock.reserved``) -> ``ship``."""
    bus = EventBus()
    if asyncio_handlers:

        @bus.handler("order.placed", name="reserve")
        async def areserve(event: Any, ctx: Any) -> None:
            ctx.enqueue("stock.reserved", {"order": event.payload["order"]})

        @bus.handler("stock.reserved", name="ship")
        async def aship(event: Any, ctx: Any) -> None:
            pass

    else:

        @bus.handler("order.placed", name="reserve")
        def reserve(event: Any, ctx: Any) -> None:
            ctx.enqueue("stock.reserved", {"order": event.payload["order"]})

        @bus.handler("stock.reserved", name="ship")
        def ship(event: Any, ctx: Any) -> None:
            pass

    return bus


def _drain(outbox: Outbox, *, asyncio_poller: bool, transaction: str) -> None:
    if not asyncio_poller:
        outbox.poller(transaction=transaction).run_until_idle()
        return
    poller = outbox.async_poller(transaction=transaction)

    async def drain() -> None:
        try:
            await poller.run_until_idle()
        finally:
            await poller.store.close()

    asyncio.run(drain())


def _by_name(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


@pytest.mark.parametrize("asyncio_poller", [False, True], ids=["blocking", "asyncio"])
@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_the_delivery_span_is_the_requests_child_and_the_follow_up_its_grandchild(
    provider: tuple[TracerProvider, InMemorySpanExporter],
    store: Any,
    asyncio_poller: bool,
    transaction: str,
) -> None:
    tracer_provider, exporter = provider
    outbox = Outbox(
        store,
        _bus(asyncio_poller),
        clock=FrozenClock(),
        plugins=[Tracing(tracer_provider)],
        load_entry_points=False,
    )
    tracer = tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("POST /orders") as request, store.transaction() as tx:
        event_id = outbox.enqueue(tx, "order.placed", {"order": 7})
    request_context = request.get_span_context()
    headers = store.get(event_id).headers
    assert headers["traceparent"].startswith(
        f"00-{request_context.trace_id:032x}-{request_context.span_id:016x}-"
    )

    _drain(outbox, asyncio_poller=asyncio_poller, transaction=transaction)

    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == [
        "POST /orders",
        "process order.placed",
        "process stock.reserved",
    ]
    delivery = _by_name(spans, "process order.placed")
    follow_up = _by_name(spans, "process stock.reserved")
    assert delivery.kind is SpanKind.CONSUMER
    assert delivery.status.status_code is StatusCode.UNSET
    assert dict(delivery.attributes or {}) == {
        "messaging.system": "outboxkit",
        "messaging.destination.name": "order.placed",
        "messaging.message.id": str(event_id),
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.consumer.group.name": "reserve",
        "outboxkit.attempt": 1,
    }
    assert delivery.context is not None and follow_up.context is not None
    if transaction == "per_event":
        # request -> delivery -> the follow-up's delivery, one trace.
        assert delivery.parent is not None and delivery.parent.span_id == request_context.span_id
        assert delivery.context.trace_id == request_context.trace_id
        assert follow_up.parent is not None
        assert follow_up.parent.span_id == delivery.context.span_id
        assert follow_up.context.trace_id == request_context.trace_id
        assert delivery.links == () and follow_up.links == ()
    else:
        # One batch transaction serves many traces: each delivery links to its enqueue.
        assert delivery.parent is None and follow_up.parent is None
        assert [link.context.span_id for link in delivery.links] == [request_context.span_id]
        assert [link.context.span_id for link in follow_up.links] == [delivery.context.span_id]
        assert delivery.context.trace_id != request_context.trace_id


@pytest.mark.parametrize("asyncio_poller", [False, True], ids=["blocking", "asyncio"])
def test_a_failure_sets_the_status_and_records_the_exception_a_reject_does_not(
    provider: tuple[TracerProvider, InMemorySpanExporter], asyncio_poller: bool
) -> None:
    tracer_provider, exporter = provider
    bus = EventBus()
    if asyncio_poller:

        @bus.handler("t", name="fails")
        async def afails(event: Any, ctx: Any) -> None:
            raise RuntimeError("card declined")

        @bus.handler("t", name="says-no")
        async def asays_no(event: Any, ctx: Any) -> None:
            raise Reject("out of stock")

    else:

        @bus.handler("t", name="fails")
        def fails(event: Any, ctx: Any) -> None:
            raise RuntimeError("card declined")

        @bus.handler("t", name="says-no")
        def says_no(event: Any, ctx: Any) -> None:
            raise Reject("out of stock")

    store = MemoryStore()
    outbox = Outbox(
        store, bus, clock=FrozenClock(), plugins=[Tracing(tracer_provider)], max_retries=0
    )
    with store.transaction() as tx:
        outbox.enqueue(tx, "t", {})  # no span is active: no trace context is stored
    _drain(outbox, asyncio_poller=asyncio_poller, transaction="per_event")

    failed = [
        s
        for s in exporter.get_finished_spans()
        if s.attributes and s.attributes.get("messaging.consumer.group.name") == "fails"
    ]
    rejected = [
        s
        for s in exporter.get_finished_spans()
        if s.attributes and s.attributes.get("messaging.consumer.group.name") == "says-no"
    ]
    assert len(failed) == 1 and len(rejected) == 1
    assert failed[0].parent is None  # a root: the event carried no context
    assert failed[0].status.status_code is StatusCode.ERROR
    assert failed[0].status.description == "RuntimeError: card declined"
    assert [e.name for e in failed[0].events] == ["exception"]
    assert (failed[0].events[0].attributes or {})["exception.message"] == "card declined"
    assert rejected[0].status.status_code is StatusCode.UNSET
    assert [(e.name, dict(e.attributes or {})) for e in rejected[0].events] == [
        ("rejected", {"reason": "out of stock"})
    ]


def test_a_traceparent_the_caller_gives_wins_and_no_span_adds_nothing(
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    tracer_provider, _ = provider
    store = MemoryStore()
    outbox = Outbox(store, EventBus(), clock=FrozenClock(), plugins=[Tracing(tracer_provider)])
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with store.transaction() as tx:
        bare = outbox.enqueue(tx, "t", {}, headers={"x": "1"})
        with tracer_provider.get_tracer("app").start_as_current_span("request"):
            explicit = outbox.enqueue(tx, "t", {}, headers={"traceparent": given})
            (many,) = outbox.enqueue_many(tx, [("t", {})])
    assert store.get(bare).headers == {"x": "1"}
    assert store.get(explicit).headers == {"traceparent": given}  # no tracestate mixed in
    assert set(store.get(many).headers) == {"traceparent"}
