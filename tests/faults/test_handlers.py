"""Handlers misbehaving, on SQLite (a real file) and PostgreSQL.

The memory store's versions of these are the R6 rules in ``tests/unit/test_rules.py``; here the
same faults go through each SQL store's real delivery transaction. Fast, in one process, under a
frozen clock: not marked ``faults``, the default run includes them.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import Event, EventBus, FrozenClock, HandlerCrashed, Outbox, Outcome
from tests.faults._sites import SQL_BACKENDS, open_site

LEASE = timedelta(seconds=30)
US = timedelta(microseconds=1)


@pytest.mark.parametrize("backend", SQL_BACKENDS)
@pytest.mark.parametrize("fault", [KeyboardInterrupt, SystemExit], ids=lambda f: f.__name__)
def test_base_exception_records_nothing_uses_the_attempt_and_is_recovered_after_the_lease(
    backend: str, fault: type[BaseException], tmp_path: Path
) -> None:
    with open_site(backend, tmp_path) as site:
        clock = FrozenClock()
        bus = EventBus()
        calls: list[tuple[int, int]] = []

        @bus.handler("t", name="ledger")
        def ledger(event: Event, ctx: Any) -> None:
            calls.append((event.id, ctx.attempt))
            site.write_order(ctx.connection)
            if ctx.attempt == 1 and event.id == first:
                raise fault

        outbox = Outbox(site.store, bus, clock=clock, lease=LEASE)
        with site.store.transaction() as conn:
            first, second = outbox.enqueue_many(conn, [("t", 1), ("t", 2)])

        poller = outbox.poller()
        with pytest.raises(fault):
            poller.run_once()
        # Re-raised; rolled back (no order, no record); the attempt is used up.
        assert calls == [(first, 1)]
        assert site.committed_orders() == 0
        assert site.store.records(first) == []
        held = site.store.get(first)
        assert held is not None
        assert held.attempts == 1
        assert held.published_at is None and held.failed_at is None
        # The unstarted event was released, and the store's connection still works.
        assert poller.run_once().published == [second]
        # The interrupted one is leased until its lease runs out, then delivered again.
        clock.advance(LEASE - US)
        assert not poller.run_once()
        clock.advance(US)
        assert poller.run_once().published == [first]
        assert calls == [(first, 1), (second, 1), (first, 2)]
        (record,) = site.store.records(first)
        assert (record.handler, record.outcome, record.attempt) == ("ledger", Outcome.SUCCEEDED, 2)
        assert site.committed_orders() == 2


@pytest.mark.parametrize("backend", SQL_BACKENDS)
@pytest.mark.parametrize("how", ["commit", "sql-commit", "sql-commit-then-write", "close"])
def test_a_handler_ending_its_connection_is_a_system_failure(
    backend: str, how: str, tmp_path: Path
) -> None:
    with open_site(backend, tmp_path) as site:
        clock = FrozenClock()
        bus = EventBus()
        broken = [True]

        @bus.handler("t", name="ledger")
        def ledger(event: Event, ctx: Any) -> None:
            site.write_order(ctx.connection)
            if broken[0]:
                if how.startswith("sql-commit"):
                    site.execute(ctx.connection, "COMMIT")
                    if how == "sql-commit-then-write":
                        site.write_order(ctx.connection)
                else:
                    getattr(ctx.connection, how)()

        outbox = Outbox(site.store, bus, clock=clock, backoff=1.0)
        with site.store.transaction() as conn:
            event_id = outbox.enqueue(conn, "t", {})
        report = outbox.poller().run_once()
        (delivery,) = report.deliveries
        assert delivery.outcome is Outcome.FAILED
        if backend == "pg" and how == "commit":
            # psycopg itself refuses commit() inside the store's transaction block: the handler
            # fails before anything commits (a handler failure, retried like any other).
            assert "commit" in (delivery.error or "")
        else:
            assert isinstance(delivery.exception, HandlerCrashed)
            event = site.store.get(event_id)
            assert event is not None
            assert "HandlerCrashed" in (event.last_error or "")
        assert report.retried == [event_id]
        # Detected: its write did not commit (not even by the handler's own commit), no record.
        assert site.committed_orders() == 0
        assert site.store.records(event_id) == []
        # The store recovers its connection; the retry delivers exactly once.
        broken[0] = False
        clock.advance(1)
        assert outbox.poller().run_once().published == [event_id]
        assert site.committed_orders() == 1


@pytest.mark.parametrize("backend", SQL_BACKENDS)
def test_a_handler_committing_inside_a_batch_leaks_nothing(backend: str, tmp_path: Path) -> None:
    """``transaction="per_batch"``: the first event's handler fails (its savepoint is rolled
    back), the second's runs a raw ``COMMIT`` and writes again. Nothing a handler wrote commits
    without its record (on PostgreSQL the commit guard refuses that COMMIT, which rolls the
    batch's transaction back: that delivery fails with ``BatchRolledBack`` and the batch goes
    on afresh; SQLite's authorizer refuses the statement); the round does not raise, and every
    event is delivered exactly once."""
    with open_site(backend, tmp_path) as site:
        clock = FrozenClock()
        bus = EventBus()

        @bus.handler("t", name="ledger")
        def ledger(event: Event, ctx: Any) -> None:
            site.write_order(ctx.connection)
            if ctx.attempt == 1 and event.id == first:
                raise RuntimeError("first fails")
            if ctx.attempt == 1 and event.id == second:
                ctx.connection.execute("COMMIT")
                site.write_order(ctx.connection)

        outbox = Outbox(site.store, bus, clock=clock, lease=LEASE, backoff=1.0)
        with site.store.transaction() as conn:
            first, second, third = outbox.enqueue_many(conn, [("t", 1), ("t", 2), ("t", 3)])
        poller = outbox.poller(transaction="per_batch")
        report = poller.run_once()  # the batch goes on: no StoreError
        (committer,) = [d for d in report.deliveries if d.event_id == second]
        assert committer.outcome is Outcome.FAILED
        assert report.published == [third]
        records = sum(len(site.store.records(i)) for i in (first, second, third))
        assert site.committed_orders() == records  # every committed write has its record
        clock.advance(LEASE)
        for _ in range(5):
            if not poller.run_once():
                break
            clock.advance(LEASE)
        for event_id in (first, second, third):
            (record,) = site.store.records(event_id)
            assert record.outcome is Outcome.SUCCEEDED
            event = site.store.get(event_id)
            assert event is not None and event.published_at is not None
        assert site.committed_orders() == 3


@pytest.mark.parametrize("mode", ["per_event", "per_batch"])
@pytest.mark.parametrize("backend", ["memory", *SQL_BACKENDS])
def test_a_handler_that_rolls_back_and_goes_on_fails_whatever_the_store_made_of_it(
    backend: str, mode: str, tmp_path: Path
) -> None:
    """R17 on every store: a handler writes, rolls its delivery transaction back
    (``ctx.connection.rollback()``; the memory store and SQLite's authorizer refuse it,
    PostgreSQL does it), catches whatever that raised, writes again and returns. The delivery
    fails: none of its writes commit, no record; the retry writes once."""
    with open_site(backend, tmp_path) as site:
        clock = FrozenClock()
        bus = EventBus()

        @bus.handler("t", name="ledger")
        def ledger(event: Event, ctx: Any) -> None:
            site.write_order(ctx.connection)
            if ctx.attempt == 1:
                with contextlib.suppress(Exception):  # refused: the handler goes on
                    ctx.connection.rollback()
                site.write_order(ctx.connection)

        outbox = Outbox(site.store, bus, clock=clock, lease=LEASE)
        with site.store.transaction() as conn:
            (event_id,) = outbox.enqueue_many(conn, [("t", 1)])
        poller = outbox.poller(transaction=mode)
        report = poller.run_once()
        (delivery,) = report.deliveries
        assert delivery.outcome is Outcome.FAILED
        assert isinstance(delivery.exception, HandlerCrashed)
        assert report.retried == [event_id]
        assert site.committed_orders() == 0
        assert site.store.records(event_id) == []
        clock.advance(LEASE)
        assert poller.run_once().published == [event_id]
        assert site.committed_orders() == 1
        (record,) = site.store.records(event_id)
        assert record.attempt == 2
