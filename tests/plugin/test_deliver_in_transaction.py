"""``deliver_one(..., conn=..., attempt=...)``: a handler run inside the test's own open
transaction, with the attempt it sees; its writes and follow-ups in that transaction, rolled
back to its savepoint on a failure or a ``Reject``; bad input named. On memory, SQLite and
PostgreSQL."""

from __future__ import annotations

import pytest

from tests.plugin.sample import run

LEDGER_APP = '''
import pytest
from outboxkit import EventBus, MemoryStore, Outbox, Reject

bus = EventBus()


def insert(conn, table, order_id):
    """One row through a handler's (or the test's) connection, whatever the store."""
    if hasattr(conn, "pending"):  # the memory store's transaction
        conn.insert(table, {"order_id": order_id})
    elif type(conn).__module__.startswith("psycopg"):
        conn.execute(f"INSERT INTO {table} (order_id) VALUES (%s)", (order_id,))
    else:
        conn.execute(f"INSERT INTO {table} (order_id) VALUES (?)", (order_id,))


def rows(conn, table):
    if hasattr(conn, "pending"):
        return sorted(row["order_id"] for row in conn.rows(table))
    return sorted(r[0] for r in conn.execute(f"SELECT order_id FROM {table}").fetchall())


@bus.handler("order.placed", name="book")
def book(event, ctx):
    insert(ctx.connection, "ledger", event.payload["order_id"])
    if event.payload.get("reject"):
        raise Reject("no stock")
    if ctx.attempt <= event.payload.get("fail_until", 0):
        raise ConnectionError(f"bank down on attempt {ctx.attempt}")
    ctx.enqueue("order.booked", {"order_id": event.payload["order_id"]})


@bus.handler("order.placed", name="rude")
def rude(event, ctx):
    ctx.connection.commit()


outbox = Outbox(MemoryStore(), bus, max_retries=3)


@pytest.fixture
def conn(outbox_store):
    """The test's own open transaction on the test store's database, with a ledger table."""
    class RollBack(Exception):
        pass

    try:
        with outbox_store.transaction() as tx:
            if not hasattr(tx, "pending"):
                tx.execute("CREATE TABLE ledger (order_id integer NOT NULL)")
            insert(tx, "ledger", 0)  # the test's own write, before the handler's
            yield tx
            raise RollBack  # the test's transaction is rolled back, as a db fixture does
    except RollBack:
        pass
'''

TESTS = """
import pytest
from outboxkit import ConfigurationError, HandlerCrashed
from outboxkit.testing import HandlerErrors
from ledgerapp import rows


def test_success_writes_in_the_tests_transaction(outbox_drain, conn):
    report = outbox_drain.deliver_one("book", {"order_id": 1}, conn=conn)
    report.assert_delivered("order.placed", handler="book", count=1)
    assert rows(conn, "ledger") == [0, 1]
    outbox_drain.assert_enqueued("order.booked", {"order_id": 1}, conn=conn)
    outbox_drain.assert_enqueued("order.placed", {"order_id": 1}, conn=conn)
    outbox_drain.refute_enqueued("order.booked")  # nothing committed


def test_a_failure_rolls_back_only_the_handlers_writes(outbox_drain, conn):
    report = outbox_drain.deliver_one(
        "book", {"order_id": 2, "fail_until": 2}, conn=conn, attempt=2, raise_errors=False
    )
    (delivery,) = report.deliveries
    assert (delivery.outcome.name, delivery.attempt) == ("FAILED", 2)
    assert delivery.error == "ConnectionError: bank down on attempt 2"
    assert rows(conn, "ledger") == [0]  # the test's own row stays
    outbox_drain.refute_enqueued("order.booked", conn=conn)
    third = outbox_drain.deliver_one("book", {"order_id": 2, "fail_until": 2}, conn=conn, attempt=3)
    third.assert_delivered("order.placed", handler="book")
    assert rows(conn, "ledger") == [0, 2]


def test_a_failure_raises_naming_the_handler_unless_expected(outbox_drain, conn):
    with pytest.raises(HandlerErrors, match="book.*ConnectionError: bank down on attempt 1"):
        outbox_drain.deliver_one("book", {"order_id": 3, "fail_until": 1}, conn=conn)
    with outbox_drain.expect_failures(ConnectionError):
        outbox_drain.deliver_one("book", {"order_id": 3, "fail_until": 1}, conn=conn)
    assert rows(conn, "ledger") == [0]


def test_a_reject_rolls_back_and_is_reported(outbox_drain, conn):
    report = outbox_drain.deliver_one("book", {"order_id": 4, "reject": True}, conn=conn)
    report.assert_rejected("order.placed", handler="book")
    assert report.deliveries[0].error == "no stock"
    assert rows(conn, "ledger") == [0]


def test_a_handler_ending_the_tests_transaction_is_named(outbox_drain, conn):
    # A store's own transaction may refuse the commit (SQLite's guard): the handler fails,
    # named; a commit that goes through ends the test's transaction: HandlerCrashed, named.
    with pytest.raises((HandlerCrashed, HandlerErrors), match="'rude'"):
        outbox_drain.deliver_one("rude", {"order_id": 5}, conn=conn)


@pytest.mark.parametrize("attempt", [0, -1, "2", True, 1.5])
def test_a_bad_attempt_is_named(outbox_drain, conn, attempt):
    with pytest.raises(ConfigurationError, match=f"attempt must be an integer >= 1, got {attempt!r}"):
        outbox_drain.deliver_one("book", {"order_id": 6}, conn=conn, attempt=attempt)
    assert rows(conn, "ledger") == [0]  # nothing written, the transaction usable


def test_attempt_without_conn_is_refused(outbox_drain):
    with pytest.raises(ConfigurationError, match="attempt=2.* needs conn="):
        outbox_drain.deliver_one("book", {"order_id": 7}, attempt=2)
"""


def test_deliver_one_in_the_tests_transaction(any_app: pytest.Pytester) -> None:
    any_app.makepyfile(ledgerapp=LEDGER_APP)
    any_app.makeconftest("from ledgerapp import conn  # noqa: F401\n")
    any_app.makeini(
        """
        [pytest]
        outboxkit_app = ledgerapp:outbox
        filterwarnings = error
        asyncio_default_fixture_loop_scope = function
        """
    )
    result = run(any_app, TESTS)
    result.assert_outcomes(passed=11)


def test_a_connection_in_no_transaction_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ledgerapp=LEDGER_APP)
    pytester.makeini(
        "[pytest]\noutboxkit_app = ledgerapp:outbox\nfilterwarnings = error\n"
        "asyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(
        test_autocommit="""
        import sqlite3
        import pytest
        from outboxkit import ConfigurationError

        def test_autocommit(outbox_drain, outbox_store):
            conn = sqlite3.connect(outbox_store.path, isolation_level=None)  # autocommit
            try:
                with pytest.raises(ConfigurationError, match="is in none .autocommit."):
                    outbox_drain.deliver_one("book", {"order_id": 1}, conn=conn)
            finally:
                conn.close()
            outbox_drain.refute_enqueued("order.placed")  # nothing written
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
