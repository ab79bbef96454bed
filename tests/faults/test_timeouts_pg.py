"""Server-side timeouts in a transactional handler on PostgreSQL.

Three slow transactional handlers, each with a timeout set by ``SET LOCAL`` in its own delivery
transaction (so it dies with that transaction and never leaks to the pooled connection):

- ``statement_timeout``: the handler writes a row, then runs ``SELECT pg_sleep(5)``; the server
  cancels the statement after 100 ms. The handler raises ``QueryCanceled``: a handler failure,
  retried with backoff (1 s, 2 s on the injected ``FrozenClock``), dead-lettered after
  ``max_retries``; its row is rolled back every time.
- ``idle_in_transaction_session_timeout``, handler still working: the handler writes a row, idles
  client-side for 1 s (the fault: a slow call to the outside world inside a transactional
  handler), and the server ends its session after 200 ms idle; its next statement fails. The
  same story: a handler failure, retried, dead-lettered; the pool replaces the dead connection.
- ``idle_in_transaction_session_timeout``, handler done: the handler idles and returns, so it is
  outboxkit's delivery record that finds the session gone. That is a database failure, never
  blamed on the handler: ``run_once`` raises ``StoreUnavailable``; ``run_forever`` logs the
  outage and goes on; the event comes back when its lease passes, and once its attempts are used
  up it is dead-lettered without running the handler again.

Every run ends with normal events delivered on the same store (the pool recovered). The figures
line covers the normal events around the faults (harness handlers, ``ledger`` and ``mailer``):
the slow events, checked one by one, are purged before it is computed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import (
    DeadLettered,
    Event,
    EventBus,
    FrozenClock,
    HandlerFailed,
    Outbox,
    RetryScheduled,
)
from outboxkit.errors import StoreError, StoreUnavailable
from outboxkit.poller import Poller, PollReport
from outboxkit.testing import Recorder
from outboxkit_pg import PostgresStore
from tests.faults._harness import TOPICS, enqueue, figures
from tests.integration.pg._workers import _OutsideWorld, create_app_tables, make_bus, wait_until

pytestmark = [pytest.mark.pg, pytest.mark.faults]

MAX_RETRIES = 2  # three attempts
NORMAL = 20
LEASE = 5.0
IDLE = 1.0  # seconds the idle handlers wait client-side: well past the 200 ms timeout


class World:
    """A migrated store with the harness's tables and handlers, plus the slow ones, on a
    frozen clock; the app's own connections come from ``url``."""

    def __init__(self, url: str, schema: str, admin: psycopg.Connection[Any]) -> None:
        self.url = url
        self.schema = schema
        self.admin = admin
        self.store = PostgresStore(url, schema=schema)
        self.store.migrate()
        create_app_tables(admin, schema)
        self.outside = _OutsideWorld(url, schema)
        self.bus: EventBus = make_bus(schema, self.outside, TOPICS)
        self.clock = FrozenClock("2030-01-01T00:00:00Z")
        self.recorder = Recorder()
        self.outbox = Outbox(
            self.store,
            self.bus,
            clock=self.clock,
            max_retries=MAX_RETRIES,
            plugins=[self.recorder],
        )
        self.insert = sql.SQL("INSERT INTO {} (event_id, handler) VALUES (%s, %s)").format(
            sql.Identifier(schema, "ledger")
        )

    def enqueue_one(self, topic: str) -> int:
        with psycopg.connect(self.url) as app, app.transaction():
            return self.outbox.enqueue(app, topic, {"slow": True})

    def ledger_rows(self, event_id: int) -> int:
        row = self.admin.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE event_id = %s").format(
                sql.Identifier(self.schema, "ledger")
            ),
            (event_id,),
        ).fetchone()
        assert row is not None
        return int(row[0])

    def deliver_all(self, poller: Poller, rounds: int = 40) -> list[PollReport]:
        """``run_once`` until nothing is left, moving the clock past each retry's backoff."""
        reports: list[PollReport] = []
        for _ in range(rounds):
            report = poller.run_once()
            reports.append(report)
            if report.claimed:
                continue
            stats = self.store.stats(now=self.clock.now())
            if stats.pending + stats.claimed == 0:
                return reports
            self.clock.advance(timedelta(seconds=5))  # past any backoff used here (1 s, 2 s)
        raise AssertionError(f"not drained in {rounds} rounds: {self.store.stats(now=None)}")

    def figures_line(self, dead_ids: list[int], expected: int) -> tuple[Any, str]:
        assert self.outbox.purge(dead_ids=dead_ids) == len(dead_ids)
        result = figures(self.admin, self.schema, expected, [])
        return result, result.line()

    def close(self) -> None:
        self.outside.close()
        self.store.close()


@pytest.fixture
def world(pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]) -> Iterator[World]:
    w = World(pg_url, pg_schema, admin)
    try:
        yield w
    finally:
        w.close()


def _check_failed_then_dead(world: World, event_id: int, handler: str, needle: str) -> None:
    failed = [e for e in world.recorder.of(HandlerFailed) if e.event_id == event_id]
    retries = [e for e in world.recorder.of(RetryScheduled) if e.event_id == event_id]
    dead = [e for e in world.recorder.of(DeadLettered) if e.event_id == event_id]
    assert [(e.handler, e.attempt) for e in failed] == [(handler, n) for n in (1, 2, 3)]
    assert all(needle in e.error for e in failed), [e.error for e in failed]
    assert [r.delay for r in retries] == [timedelta(seconds=1), timedelta(seconds=2)]
    assert [d.attempt for d in dead] == [MAX_RETRIES + 1]
    letter = world.outbox.dead_letter(event_id)
    assert letter is not None and letter.last_error is not None
    assert needle in letter.last_error
    assert world.ledger_rows(event_id) == 0  # its write was rolled back on every attempt


def test_statement_timeout_in_a_handler_is_a_failure_retried_then_dead(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    def slow_statement(event: Event, ctx: Any) -> None:
        ctx.connection.execute(world.insert, (event.id, "slow-statement"))
        ctx.connection.execute("SET LOCAL statement_timeout = '100ms'")
        ctx.connection.execute("SELECT pg_sleep(5)")

    world.bus.subscribe("slow.statement", slow_statement, name="slow-statement")
    enqueue(world.url, world.outbox, NORMAL // 2)
    slow = world.enqueue_one("slow.statement")
    enqueue(world.url, world.outbox, NORMAL // 2, start=NORMAL // 2)
    poller = world.outbox.poller(batch_size=10, lease=LEASE)

    reports = world.deliver_all(poller)  # every run_once returns normally
    _check_failed_then_dead(world, slow, "slow-statement", "statement timeout")
    enqueue(world.url, world.outbox, 1, start=NORMAL)  # the pool still delivers
    assert poller.run_once().published != []
    result, line = world.figures_line([slow], NORMAL + 1)
    with capsys.disabled():
        print(
            f"\n[faults:timeouts-pg:statement_timeout] {NORMAL + 1} normal events and 1 slow, "
            f"{len(reports)} rounds, dead after {MAX_RETRIES + 1} attempts: {line}"
        )
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext == 0


def test_idle_in_transaction_timeout_then_a_statement_is_a_failure_retried_then_dead(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    def slow_then_write(event: Event, ctx: Any) -> None:
        ctx.connection.execute("SET LOCAL idle_in_transaction_session_timeout = '200ms'")
        ctx.connection.execute(world.insert, (event.id, "slow-idle"))
        threading.Event().wait(IDLE)  # the fault: idle in the transaction, client-side
        ctx.connection.execute(world.insert, (event.id, "slow-idle"))

    world.bus.subscribe("slow.idle", slow_then_write, name="slow-idle")
    enqueue(world.url, world.outbox, NORMAL // 2)
    slow = world.enqueue_one("slow.idle")
    enqueue(world.url, world.outbox, NORMAL // 2, start=NORMAL // 2)
    poller = world.outbox.poller(batch_size=10, lease=LEASE)

    reports = world.deliver_all(poller)  # every run_once returns normally
    _check_failed_then_dead(world, slow, "slow-idle", "idle-in-transaction timeout")
    enqueue(world.url, world.outbox, 1, start=NORMAL)  # the pool replaced the dead connection
    assert poller.run_once().published != []
    result, line = world.figures_line([slow], NORMAL + 1)
    with capsys.disabled():
        print(
            f"\n[faults:timeouts-pg:idle_in_transaction] {NORMAL + 1} normal events and 1 slow, "
            f"{len(reports)} rounds, dead after {MAX_RETRIES + 1} attempts: {line}"
        )
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext == 0


def _slow_then_return(world: World, topic: str) -> tuple[threading.Semaphore, list[int]]:
    """Subscribe ``slow-return``: writes a row, idles past the timeout, returns. Its runs go in
    the list, and the semaphore is released each time it returns."""
    returned = threading.Semaphore(0)
    calls: list[int] = []

    def slow_then_return(event: Event, ctx: Any) -> None:
        calls.append(event.id)
        ctx.connection.execute("SET LOCAL idle_in_transaction_session_timeout = '200ms'")
        ctx.connection.execute(world.insert, (event.id, "slow-return"))
        threading.Event().wait(IDLE)  # the fault: idle in the transaction, client-side
        returned.release()

    world.bus.subscribe(topic, slow_then_return, name="slow-return")
    return returned, calls


def test_idle_in_transaction_timeout_found_by_the_record_is_store_unavailable(
    world: World,
) -> None:
    returned, calls = _slow_then_return(world, "slow.return")
    slow = world.enqueue_one("slow.return")
    poller = world.outbox.poller(batch_size=10, lease=LEASE)
    with pytest.raises(StoreError) as raised:  # the record finds the session gone
        poller.run_once()
    assert calls == [slow]
    assert returned.acquire(timeout=0)
    assert not world.recorder.of(HandlerFailed)  # a database failure, not the handler's
    assert world.ledger_rows(slow) == 0
    # README, "Outages": "A lost or refused connection is a StoreUnavailable".
    assert isinstance(raised.value, StoreUnavailable), repr(raised.value)


def test_idle_in_transaction_timeout_found_by_the_record_is_an_outage_then_dead(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    returned, calls = _slow_then_return(world, "slow.return")
    slow = world.enqueue_one("slow.return")
    # run_forever on its own thread: each failed record is an outage, waited out; the test
    # only moves the frozen clock past the lease once the handler has returned, so that the
    # event comes back (attempts 1 to 3 run the handler).
    poller = world.outbox.poller(batch_size=10, lease=LEASE, interval=0.05)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            poller.run_forever()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="timeouts-poller", daemon=True)
    try:
        thread.start()
        for _ in range(MAX_RETRIES + 1):
            assert returned.acquire(timeout=30), "the handler did not run again"
            world.clock.advance(timedelta(seconds=LEASE + 1))
        # Attempt 4 is past max_retries + 1: dead-lettered without running the handler.
        assert wait_until(lambda: world.outbox.dead_letter(slow) is not None, 30), (
            f"not dead-lettered: {world.store.stats(now=world.clock.now())}"
        )
        enqueue(world.url, world.outbox, NORMAL)  # the same running poller delivers these
        assert wait_until(
            lambda: world.store.stats(now=world.clock.now()).published == NORMAL, 30
        ), f"normal events not delivered: {world.store.stats(now=world.clock.now())}"
        alive = thread.is_alive()
    finally:
        poller.stop()
        thread.join(30)
    assert alive and not thread.is_alive() and failure == []  # kept going; stopped when asked
    assert calls == [slow] * (MAX_RETRIES + 1)
    assert not world.recorder.of(HandlerFailed)  # never blamed on the handler
    (dead,) = world.recorder.of(DeadLettered)
    assert dead.event_id == slow and dead.attempt == MAX_RETRIES + 2
    assert dead.error is not None and "attempts used up" in dead.error
    assert world.ledger_rows(slow) == 0
    result, line = world.figures_line([slow], NORMAL)
    with capsys.disabled():
        print(
            f"\n[faults:timeouts-pg:idle_then_record] {NORMAL} normal events and 1 slow, "
            f"{len(calls)} handler runs, dead on attempt {dead.attempt}: {line}"
        )
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext == 0
