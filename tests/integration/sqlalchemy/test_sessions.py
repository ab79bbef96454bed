"""Acceptance 2: a handler writing ORM rows through ``ctx.session`` writes them in the delivery
transaction: a failed attempt leaves none, the successful one commits them with its one
delivery record, a ``Reject`` leaves none and a rejection; blocking and ``async def``
handlers, PostgreSQL and SQLite. And the session never ends the delivery transaction."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from sqlalchemy import func, select, text

from outboxkit import Event, Outbox, Reject
from outboxkit.contrib.sqlalchemy import use_sessions
from outboxkit.core.model import Outcome
from outboxkit.errors import ConfigurationError
from outboxkit.testing import Drain

from .conftest import DATABASES, Database, Line, Order


class Flaky(Exception):
    pass


def _lines(event: Event, session: Any) -> None:
    session.add_all([Line(event_id=event.id, label="a"), Line(event_id=event.id, label="b")])


def _record_outcomes(db: Database, event_id: int) -> list[Outcome]:
    return [r.outcome for r in db.store.records(event_id)]


def _subscribe(outbox: Outbox, *, asyncio: bool) -> list[tuple[int, int]]:
    """The handler; what it saw: (attempt, rows in the table when it started)."""
    seen: list[tuple[int, int]] = []
    count = select(func.count()).select_from(Line)
    if asyncio:

        @outbox.bus.handler("shipment", name="lines")
        async def lines(event: Event, ctx: Any) -> None:
            seen.append((ctx.attempt, await ctx.session.scalar(count)))
            _lines(event, ctx.session)
            await ctx.session.flush()  # the rows are in the database before the failure
            if event.payload["mode"] == "reject":
                raise Reject("no stock")
            if ctx.attempt == 1:
                raise Flaky("the first attempt fails after its writes")

    else:

        @outbox.bus.handler("shipment", name="lines")
        def lines(event: Event, ctx: Any) -> None:
            seen.append((ctx.attempt, ctx.session.scalar(count)))
            _lines(event, ctx.session)
            ctx.session.flush()
            if event.payload["mode"] == "reject":
                raise Reject("no stock")
            if ctx.attempt == 1:
                raise Flaky("the first attempt fails after its writes")

    return seen


@pytest.mark.parametrize("asyncio", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("database", DATABASES, indirect=True)
def test_a_failed_attempt_leaves_no_rows_the_next_commits_them_a_reject_none(
    database: Database, outbox: Outbox, clock: Any, asyncio: bool
) -> None:
    use_sessions(outbox, execution_options=database.options)
    seen = _subscribe(outbox, asyncio=asyncio)
    with database.store.transaction() as conn:
        retried, rejected = outbox.enqueue_many(
            conn, [("shipment", {"mode": "retry"}), ("shipment", {"mode": "reject"})]
        )
    drain = Drain(outbox, clock)
    with drain.expect_failures(Flaky):
        report = drain()
    # Each attempt found no rows of the earlier ones: the failure and the Reject wrote none.
    assert seen == [(1, 0), (1, 0), (2, 0)]
    assert [(d.event_id, d.attempt, d.outcome) for d in report.deliveries] == [
        (retried, 1, Outcome.FAILED),
        (rejected, 1, Outcome.REJECTED),
        (retried, 2, Outcome.SUCCEEDED),
    ]
    assert (database.lines(retried), database.lines(rejected)) == (2, 0)
    assert _record_outcomes(database, retried) == [Outcome.SUCCEEDED]
    assert _record_outcomes(database, rejected) == [Outcome.REJECTED]
    assert report.published == [rejected, retried]


@pytest.mark.parametrize("database", DATABASES, indirect=True)
def test_the_first_connect_does_not_roll_back_the_delivery_transaction(
    database: Database, outbox: Outbox, clock: Any
) -> None:
    """SQLAlchemy rolls back a new connection after its first-connect checks: on the delivery
    connection that would undo what the handler wrote through ``ctx.connection`` first."""
    use_sessions(outbox, execution_options=database.options)

    @outbox.bus.handler("shipment", name="raw_then_orm")
    def raw_then_orm(event: Event, ctx: Any) -> None:
        raw = ctx.connection
        insert = "INSERT INTO {} (id, item) VALUES (7, 'raw')"
        table = "sqla_orders" if database.schema is None else f'"{database.schema}".sqla_orders'
        cursor = raw.cursor()
        cursor.execute(insert.format(table))
        cursor.close()
        ctx.session.add(Line(event_id=event.id, label="orm", order_id=7))  # the first connect
        assert ctx.session.scalar(select(Order.item).where(Order.id == 7)) == "raw"

    with database.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "shipment", {})
    Drain(outbox, clock)()
    assert (database.count("sqla_orders"), database.count("sqla_lines")) == (1, 1)
    assert _record_outcomes(database, event_id) == [Outcome.SUCCEEDED]


@pytest.mark.parametrize("asyncio", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("database", DATABASES, indirect=True)
def test_a_commit_in_the_handler_fails_the_delivery_and_writes_nothing(
    database: Database, outbox: Outbox, clock: Any, asyncio: bool
) -> None:
    use_sessions(outbox, execution_options=database.options)
    if asyncio:

        @outbox.bus.handler("shipment", name="commits")
        async def commits(event: Event, ctx: Any) -> None:
            _lines(event, ctx.session)
            await ctx.session.commit()

    else:

        @outbox.bus.handler("shipment", name="commits")
        def commits(event: Event, ctx: Any) -> None:
            _lines(event, ctx.session)
            ctx.session.commit()

    with database.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "shipment", {})
    drain = Drain(outbox, clock)
    with drain.expect_failures():
        report = drain()
    assert {d.outcome for d in report.deliveries} == {Outcome.FAILED}  # retried, then dead
    assert "session.commit() in a handler" in (report.deliveries[0].error or "")
    assert database.count("sqla_lines") == 0
    assert _record_outcomes(database, event_id) == []


@pytest.mark.parametrize("database", DATABASES, indirect=True)
def test_a_rollback_in_the_handler_fails_the_delivery(
    database: Database, outbox: Outbox, clock: Any
) -> None:
    use_sessions(outbox, execution_options=database.options)

    @outbox.bus.handler("shipment", name="rolls_back")
    def rolls_back(event: Event, ctx: Any) -> None:
        _lines(event, ctx.session)
        ctx.session.flush()
        ctx.session.rollback()  # cannot undo part of a delivery: the delivery fails
        ctx.session.execute(text("SELECT 1"))

    with database.store.transaction() as conn:
        outbox.enqueue(conn, "shipment", {})
    drain = Drain(outbox, clock)
    with drain.expect_failures():
        report = drain()
    assert {d.outcome for d in report.deliveries} == {Outcome.FAILED}
    assert "ended the delivery transaction it was given (a rollback)" in (
        report.deliveries[0].error or ""
    )
    assert database.count("sqla_lines") == 0


@pytest.mark.parametrize("database", DATABASES, indirect=True)
def test_ctx_session_without_use_sessions_or_a_transaction_is_refused(
    database: Database, outbox: Outbox, clock: Any
) -> None:
    errors: list[str] = []

    @outbox.bus.handler("shipment", name="no_provider")
    def no_provider(event: Event, ctx: Any) -> None:
        try:
            ctx.session  # noqa: B018
        except ConfigurationError as exc:
            errors.append(str(exc))

    with database.store.transaction() as conn:
        outbox.enqueue(conn, "shipment", {})

    Drain(outbox, clock)()
    use_sessions(outbox, execution_options=database.options)

    @outbox.bus.handler("note", name="not_transactional", transactional=False)
    def not_transactional(event: Event, ctx: Any) -> None:
        try:
            ctx.session  # noqa: B018
        except ConfigurationError as exc:
            errors.append(str(exc))

    with database.store.transaction() as conn:
        outbox.enqueue(conn, "note", {})
    Drain(outbox, clock)()
    assert len(errors) == 2
    assert "no session provider; call outboxkit.contrib.sqlalchemy.use_sessions" in errors[0]
    assert "non-transactional handler" in errors[1]


@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
@pytest.mark.parametrize("database", DATABASES, indirect=True)
def test_a_handler_that_catches_a_failed_flush_fails_its_delivery(
    database: Database, outbox: Outbox, clock: Any, transaction: str
) -> None:
    """R17 for ``ctx.session``: a flush that fails (a duplicate primary key) leaves the session's
    transaction inactive, and SQLAlchemy rolls it back; a handler that catches the error and
    returns has failed its delivery (none of its rows, no record), and the retry writes once."""
    from sqlalchemy.exc import IntegrityError

    use_sessions(outbox, execution_options=database.options)

    @outbox.bus.handler("shipment", name="lines")
    def lines(event: Event, ctx: Any) -> None:
        ctx.session.add(Line(id=event.id * 10, event_id=event.id, label="kept?"))
        ctx.session.flush()
        if ctx.attempt == 1:
            ctx.session.add(Line(id=event.id * 10, event_id=event.id, label="duplicate"))
            with contextlib.suppress(IntegrityError):  # goes on as if nothing happened
                ctx.session.flush()

    with database.store.transaction() as conn:
        (event_id,) = outbox.enqueue_many(conn, [("shipment", {"mode": "swallow"})])
    report = outbox.poller(transaction=transaction).run_once()
    (delivery,) = report.deliveries
    assert delivery.outcome is Outcome.FAILED
    assert report.retried == [event_id]
    assert database.lines(event_id) == 0
    assert _record_outcomes(database, event_id) == []
    clock.advance(60)
    assert outbox.poller(transaction=transaction).run_once().published == [event_id]
    assert database.lines(event_id) == 1
    assert _record_outcomes(database, event_id) == [Outcome.SUCCEEDED]
