"""The delivery transaction opens when the handler first takes ``ctx.connection``: on every
store, per event and per batch, a handler that never takes it is recorded like any other, and
one that takes it on a claim another poller has taken over gets nothing to write with, whatever
it does with the refusal (the delivery is the lease's loss, not the handler's failure)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, LeaseLostError, Outbox, Outcome, Reject, Store
from tests.backends import ALL_BACKENDS, migrated_store

START = datetime(2030, 6, 1, tzinfo=UTC)
LEASE = timedelta(seconds=30)
MODES = ["per_event", "per_batch"]


@pytest.fixture(params=ALL_BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    with migrated_store(request.param, tmp_path) as opened:
        yield opened


@pytest.mark.parametrize("mode", MODES)
def test_handlers_that_never_take_the_connection_are_recorded(store: Store, mode: str) -> None:
    clock = FrozenClock(START)
    bus = EventBus()
    seen: list[tuple[int, str]] = []

    @bus.handler("t", name="quiet")
    def quiet(event: Any, ctx: Any) -> None:
        seen.append((event.id, "quiet"))
        if event.payload["n"] % 3 == 1:
            raise Reject("not today")
        if event.payload["n"] % 3 == 2 and ctx.attempt == 1:
            raise RuntimeError("try again")

    @bus.handler("t", name="outside", transactional=False)
    def outside(event: Any, ctx: Any) -> None:
        seen.append((event.id, "outside"))

    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    with store.transaction() as tx:
        ids = outbox.enqueue_many(tx, [("t", {"n": n}) for n in range(9)])
    poller = outbox.poller(transaction=mode, lease=LEASE)
    first = poller.run_once()
    assert sorted(first.published) == sorted(i for n, i in enumerate(ids) if n % 3 != 2)
    clock.advance(timedelta(hours=1))
    second = poller.run_once()
    assert sorted(second.published) == [i for n, i in enumerate(ids) if n % 3 == 2]
    for n, event_id in enumerate(ids):
        records = {r.handler: r for r in store.records(event_id)}
        assert set(records) == {"quiet", "outside"}
        expected = Outcome.REJECTED if n % 3 == 1 else Outcome.SUCCEEDED
        assert records["quiet"].outcome is expected
        assert records["quiet"].attempt == (2 if n % 3 == 2 else 1)
        assert records["outside"].attempt == 1  # recorded on attempt 1: never run again
    assert seen.count((ids[2], "outside")) == 1


TAKEOVERS = [
    # SQLite's batch holds the write lock from the claim on: no poller can take an event over
    # under it. The memory store opens its delivery at once (no lazy opening to check).
    pytest.param("sqlite", "per_event", id="sqlite-per_event"),
    pytest.param("pg", "per_event", id="pg-per_event", marks=pytest.mark.pg),
    pytest.param("pg", "per_batch", id="pg-per_batch", marks=pytest.mark.pg),
]


@pytest.mark.parametrize(("backend", "mode"), TAKEOVERS)
def test_a_taken_over_claim_gives_no_connection_even_if_the_handler_swallows_it(
    backend: str, mode: str, tmp_path: Path
) -> None:
    with migrated_store(backend, tmp_path) as store:
        check_takeover(store, mode)


def check_takeover(store: Store, mode: str) -> None:
    clock = FrozenClock(START)
    bus = EventBus()
    refused: list[str] = []

    @bus.handler("t", name="late")
    def late(event: Any, ctx: Any) -> None:
        # Another poller takes the event over while this handler runs (its lease has run out
        # by the database's clock).
        clock.advance(LEASE * 2)
        (taken,) = store.claim(batch_size=1, lease=LEASE, now=clock.now())
        assert taken.event.id == event.id
        try:
            ctx.connection  # noqa: B018 - taking it opens the delivery transaction
        except LeaseLostError as exc:
            refused.append(str(exc))  # swallowed: the delivery is lost all the same

    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    with store.transaction() as tx:
        (event_id,) = outbox.enqueue_many(tx, [("t", {"n": 1})])
    report = outbox.poller(transaction=mode, lease=LEASE).run_once()
    assert refused and "stale" in refused[0]
    assert [d.outcome for d in report.deliveries] == [Outcome.LEASE_LOST]
    assert report.published == [] and report.failed == []
    assert report.lease_lost == [event_id]
    assert store.records(event_id) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_async_deliveries_never_opened_are_recorded(store: Store, mode: str) -> None:
    """The asyncio poller opens a delivery only for a transactional handler (``tx.open()``):
    a non-transactional handler's record, a rejection and a retry are recorded as ever."""
    if not store.capabilities.asyncio:
        pytest.skip(f"{store!r} declares no asyncio side (capabilities.asyncio is false)")
    clock = FrozenClock(START)
    bus = EventBus()
    seen: list[tuple[int, str]] = []

    @bus.handler("t", name="outside", transactional=False)
    async def outside(event: Any, ctx: Any) -> None:
        seen.append((event.id, "outside"))
        if event.payload["n"] % 3 == 1:
            raise Reject("not today")
        if event.payload["n"] % 3 == 2 and ctx.attempt == 1:
            raise RuntimeError("try again")

    @bus.handler("t", name="inside")
    async def inside(event: Any, ctx: Any) -> None:
        seen.append((event.id, "inside"))
        assert ctx.connection is not None  # opened for a transactional handler

    outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
    with store.transaction() as tx:
        ids = outbox.enqueue_many(tx, [("t", {"n": n}) for n in range(6)])
    poller = outbox.async_poller(transaction=mode, lease=LEASE)
    first = await poller.run_once()
    assert sorted(first.published) == sorted(i for n, i in enumerate(ids) if n % 3 != 2)
    clock.advance(timedelta(hours=1))
    second = await poller.run_once()
    assert sorted(second.published) == [i for n, i in enumerate(ids) if n % 3 == 2]
    for n, event_id in enumerate(ids):
        records = {r.handler: r for r in store.records(event_id)}
        assert set(records) == {"outside", "inside"}
        expected = Outcome.REJECTED if n % 3 == 1 else Outcome.SUCCEEDED
        assert records["outside"].outcome is expected
        assert records["outside"].attempt == (2 if n % 3 == 2 else 1)
        assert records["inside"].attempt == 1  # recorded on attempt 1: never run again
    assert seen.count((ids[2], "inside")) == 1
