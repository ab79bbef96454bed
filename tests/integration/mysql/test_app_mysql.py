"""An app on MariaDB/MySQL: it enqueues through its own PyMySQL connection (or SQLAlchemy's
``mysql+pymysql://`` session) in its own transaction, and its transactional handlers write
through ``ctx.connection`` exactly once with their record (R1, R6, R17, R18), per event and per
batch. Every test runs in a database of its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    HandlerCrashed,
    Message,
    Outbox,
    Outcome,
    StoreUnavailable,
    open_store,
)
from outboxkit_mysql import MySQLStore

from .server import connect_args

MODES = ["per_event", "per_batch"]


def app_connection(url: str, **options: Any) -> pymysql.connections.Connection:
    """The app's own PyMySQL connection to the test's database (autocommit off: PyMySQL's
    default, a transaction opened by the first statement)."""
    database = url.rsplit("/", 1)[1]
    return pymysql.connect(**connect_args(url), database=database, **options)


@pytest.fixture
def store(mysql_url: str) -> Iterator[MySQLStore]:
    made = open_store(mysql_url)
    assert isinstance(made, MySQLStore)
    try:
        made.migrate()
        yield made
    finally:
        made.close()


@pytest.fixture
def ledger(mysql_url: str) -> Iterator[Any]:
    """An app table the handlers write to (no unique key: a doubled write shows)."""
    with app_connection(mysql_url, autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE ledger (event_id BIGINT, label VARCHAR(32)) ENGINE=InnoDB")
        yield conn


def ledger_rows(conn: Any) -> list[tuple[int, str]]:
    with conn.cursor() as cur:
        cur.execute("SELECT event_id, label FROM ledger ORDER BY event_id, label")
        return [(int(a), str(b)) for a, b in cur.fetchall()]


def drain(outbox: Outbox, clock: FrozenClock, mode: str, rounds: int = 12) -> list[Any]:
    """Rounds until nothing is claimed, the clock moved past every backoff."""
    reports = []
    for _ in range(rounds):
        report = outbox.poller(transaction=mode).run_once()
        if not report.claimed:
            break
        reports.append(report)
        clock.advance(60)
    return reports


def test_a_pymysql_app_enqueues_in_its_transaction(store: MySQLStore, mysql_url: str) -> None:
    outbox = Outbox(store, EventBus())
    with app_connection(mysql_url) as conn:
        committed = outbox.enqueue(conn, "order.placed", {"order": 1})
        conn.commit()
        outbox.enqueue(conn, "order.placed", {"order": 2})
        conn.rollback()
    (event,) = store.events()
    assert (event.id, event.payload) == (committed, {"order": 1})


def test_an_autocommit_connection_outside_a_transaction_is_refused(
    store: MySQLStore, mysql_url: str
) -> None:
    outbox = Outbox(store, EventBus())
    with app_connection(mysql_url, autocommit=True) as conn:
        with pytest.raises(ConfigurationError, match="autocommit"):
            outbox.enqueue(conn, "t", {})
        conn.begin()
        outbox.enqueue(conn, "t", {})
        conn.rollback()
    assert store.events() == []


@pytest.mark.parametrize("mode", MODES)
def test_a_transactional_handler_writes_once_with_its_record(
    store: MySQLStore, ledger: Any, mode: str
) -> None:
    """The first attempt writes and fails: nothing of it commits. The retry writes one row and
    one record, together."""
    bus = EventBus()
    attempts: list[int] = []

    @bus.handler("t", name="ledger")
    def write(event: Event, ctx: Any) -> None:
        with ctx.connection.cursor() as cur:
            cur.execute("INSERT INTO ledger VALUES (%s, 'done')", (event.id,))
        attempts.append(event.id)
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails after its write")

    clock = FrozenClock()
    outbox = Outbox(store, bus, clock=clock)
    with store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {"n": 1})
    first = outbox.poller(transaction=mode).run_once()
    assert [d.outcome for d in first.deliveries] == [Outcome.FAILED]
    assert ledger_rows(ledger) == []
    assert store.records(event_id) == []
    clock.advance(60)
    drain(outbox, clock, mode)
    assert ledger_rows(ledger) == [(event_id, "done")]
    assert [(r.handler, r.outcome) for r in store.records(event_id)] == [
        ("ledger", Outcome.SUCCEEDED)
    ]
    assert store.stats(now=clock.now()).published == 1


ENDINGS = {
    "commit()": lambda conn: conn.commit(),
    "rollback()": lambda conn: conn.rollback(),
    "raw COMMIT": lambda conn: conn.cursor().execute("COMMIT"),
    "raw ROLLBACK": lambda conn: conn.cursor().execute("ROLLBACK"),
    "DDL": lambda conn: conn.cursor().execute("CREATE TABLE implicit_commit (a INT)"),
}


@pytest.mark.parametrize("how", sorted(ENDINGS))
@pytest.mark.parametrize("mode", MODES)
def test_a_handler_that_ends_its_transaction_fails_and_commits_nothing(
    store: MySQLStore, ledger: Any, mode: str, how: str
) -> None:
    """R17: the server refuses the attempt (an XA transaction); the handler swallows the
    refusal and writes again; the delivery fails all the same, nothing commits, and after
    ``max_retries`` the event is dead with no row of it."""
    bus = EventBus()

    @bus.handler("t", name="ledger")
    def write(event: Event, ctx: Any) -> None:
        conn = ctx.connection
        conn.cursor().execute("INSERT INTO ledger VALUES (%s, 'before')", (event.id,))
        with contextlib.suppress(pymysql.err.MySQLError):  # a handler that swallows it
            ENDINGS[how](conn)
        conn.cursor().execute("INSERT INTO ledger VALUES (%s, 'after')", (event.id,))

    clock = FrozenClock()
    outbox = Outbox(store, bus, clock=clock, max_retries=1)
    with store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {"n": 1})
    reports = drain(outbox, clock, mode)
    deliveries = [d for r in reports for d in r.deliveries]
    assert [d.outcome for d in deliveries] == [Outcome.FAILED] * 2
    assert all(isinstance(d.exception, HandlerCrashed) for d in deliveries)
    assert reports[-1].dead_lettered == [event_id]
    assert ledger_rows(ledger) == []
    assert store.records(event_id) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_goes_on_after_one_delivery_tried_to_commit(
    store: MySQLStore, ledger: Any, mode: str
) -> None:
    """R17 in a batch costs the one delivery only: the others write once, with their records."""
    bus = EventBus()

    @bus.handler("t", name="ledger")
    def write(event: Event, ctx: Any) -> None:
        ctx.connection.cursor().execute("INSERT INTO ledger VALUES (%s, 'row')", (event.id,))
        if event.payload["n"] == 2:
            ctx.connection.commit()

    clock = FrozenClock()
    outbox = Outbox(store, bus, clock=clock, max_retries=0)
    with store.transaction() as conn:
        ids = [outbox.enqueue(conn, "t", {"n": n}) for n in (1, 2, 3)]
    (report,) = drain(outbox, clock, mode)
    assert [d.outcome for d in report.deliveries] == [
        Outcome.SUCCEEDED,
        Outcome.FAILED,
        Outcome.SUCCEEDED,
    ]
    assert ledger_rows(ledger) == [(ids[0], "row"), (ids[2], "row")]
    assert report.dead_lettered == [ids[1]]


@pytest.mark.parametrize("mode", MODES)
def test_no_session_setting_of_a_handler_reaches_the_next_delivery(
    store: MySQLStore, mode: str
) -> None:
    """R18: what a handler sets on its session is gone before the next delivery."""
    bus = EventBus()
    seen: list[tuple[Any, ...]] = []

    @bus.handler("t", name="session")
    def session(event: Event, ctx: Any) -> None:
        with ctx.connection.cursor() as cur:
            cur.execute("SELECT @@session.time_zone, @@session.sql_mode, @@session.autocommit")
            seen.append(cur.fetchone())
            cur.execute("SET time_zone = '+05:00', sql_mode = '', autocommit = 0")

    clock = FrozenClock()
    outbox = Outbox(store, bus, clock=clock)
    for _ in range(3):
        with store.transaction() as conn:
            outbox.enqueue(conn, "t", {})
        drain(outbox, clock, mode)
    assert len(seen) == 3
    assert len(set(seen)) == 1, seen
    assert seen[0][0] == "+00:00"


def test_a_lock_wait_timeout_under_a_handler_is_the_stores_failure(
    store: MySQLStore, ledger: Any
) -> None:
    """InnoDB's 1205 under a running handler is the database's failure: ``run_once`` raises
    ``StoreUnavailable`` (``run_forever`` waits it out), nothing is recorded against the
    handler, and the event is delivered once its lease has passed."""
    bus = EventBus()

    @bus.handler("t", name="ledger")
    def write(event: Event, ctx: Any) -> None:
        with ctx.connection.cursor() as cur:
            cur.execute("SET SESSION innodb_lock_wait_timeout = 1")
            cur.execute("UPDATE ledger SET label = 'mine' WHERE event_id = 0")

    ledger.cursor().execute("INSERT INTO ledger VALUES (0, 'locked')")
    clock = FrozenClock()
    outbox = Outbox(store, bus, clock=clock)
    with store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    ledger.begin()
    ledger.cursor().execute("SELECT * FROM ledger WHERE event_id = 0 FOR UPDATE")
    with pytest.raises(StoreUnavailable, match="1205"):
        outbox.poller().run_once()
    ledger.rollback()
    assert store.records(event_id) == []
    clock.advance(60)  # past the lease: the event is due again, its attempt used up
    drain(outbox, clock, "per_event")
    assert ledger_rows(ledger) == [(0, "mine")]
    assert [r.outcome for r in store.records(event_id)] == [Outcome.SUCCEEDED]


def test_sqlalchemy_sessions_enqueue_in_their_transaction(
    store: MySQLStore, mysql_url: str
) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    engine = create_engine("mysql+pymysql://" + mysql_url.split("://", 1)[1])
    try:
        outbox = Outbox(store, EventBus())
        with Session(engine) as session, session.begin():
            session.execute(text("SELECT 1"))
            kept = outbox.enqueue(session, "t", {"n": 1}, key="k")
        with Session(engine) as session:
            session.begin()
            outbox.enqueue(session, "t", {"n": 2})
            session.rollback()
        with engine.begin() as conn:
            third = outbox.enqueue(conn, "t", {"n": 3})
        with Session(engine) as session, session.begin():  # a batch: each id in its place
            batch = outbox.enqueue_many(
                session,
                [Message("t", {"n": 4}, key="k"), Message("t", {"n": 5}), Message("t", {"n": 6})],
            )
    finally:
        engine.dispose()
    events = store.events()
    assert [e.payload["n"] for e in events] == [1, 3, 4, 5, 6]
    assert events[0].id == kept and events[0].key == "k"
    assert [third, *batch] == [e.id for e in events[1:]]
