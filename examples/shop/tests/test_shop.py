"""The shop's tests, with outboxkit's pytest plugin: ``outbox_drain`` delivers synchronously on a
virtual clock, so the receipt's retries (1 s, 2 s, ... of backoff) take no time at all.

The shop writes its orders and events through its own ``sqlite3`` connection, so the test store
is the SQLite store on the shop's own database file: ``outbox_store`` is overridden for that.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxkit import FrozenClock, Outbox, Store, open_store
from outboxkit.cli.demo import shop
from outboxkit.cli.demo.runner import main as demo_main
from outboxkit.testing import Drain


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "shop.db"


@pytest.fixture
def outbox_store(db: Path) -> Iterator[Store]:
    """The outbox's tables in the shop's own database file."""
    store: Store = open_store(f"sqlite:///{db.as_posix()}")
    yield store
    store.close()


@pytest.fixture
def conn(db: Path, outbox_store: Store) -> Iterator[sqlite3.Connection]:
    """The shop's own connection (Python's default transaction handling), tables created."""
    connection = sqlite3.connect(db, timeout=30)
    shop.create_tables(connection)
    yield connection
    connection.close()


@pytest.fixture
def outbox(outbox_store: Store, outbox_clock: FrozenClock) -> Outbox:
    return shop.make_outbox(outbox_store, clock=outbox_clock)


@pytest.fixture
def mailer(monkeypatch: pytest.MonkeyPatch) -> shop.FlakyMailer:
    """A mail server that works, unless a test says otherwise."""
    fresh = shop.FlakyMailer(failure_rate=0.0)
    monkeypatch.setattr(shop, "mailer", fresh)
    return fresh


def stock(conn: sqlite3.Connection, product: str) -> int:
    (available,) = conn.execute(
        "SELECT available FROM stock WHERE product = ?", (product,)
    ).fetchone()
    return int(available)


def test_an_order_is_checked_reserved_and_receipted(
    outbox: Outbox, outbox_drain: Drain, conn: sqlite3.Connection, mailer: shop.FlakyMailer
) -> None:
    placed = shop.place_order(outbox, conn, email="ada@example.com", product="widget", quantity=2)
    outbox_drain.assert_enqueued("order.placed", {"order_id": placed.order_id, "total": 40})
    report = outbox_drain()
    for handler in ("fraud-check", "reserve-stock", "send-receipt"):
        report.assert_delivered("order.placed", handler=handler, count=1)
    assert report.published == [placed.event_id]
    assert mailer.sent == [placed.order_id]
    assert stock(conn, "widget") == shop.PRODUCTS["widget"] - 2


def test_the_receipt_is_retried_until_the_mail_server_takes_it(
    outbox: Outbox, outbox_drain: Drain, conn: sqlite3.Connection, mailer: shop.FlakyMailer
) -> None:
    mailer.fail_first = 2  # busy twice, then fine
    placed = shop.place_order(outbox, conn, email="bob@example.com", product="gadget", quantity=1)
    with outbox_drain.expect_failures("send-receipt"):
        report = outbox_drain()
    attempts = report.deliveries_to(handler="send-receipt")
    assert [d.outcome.value for d in attempts] == ["failed", "failed", "succeeded"]
    # Backoff 1 s then 2 s, on the virtual clock: the test took no time.
    assert [(d.at - attempts[0].at).total_seconds() for d in attempts] == [0, 1, 3]
    assert report.retried == [placed.event_id, placed.event_id]
    assert report.published == [placed.event_id]
    assert mailer.sent == [placed.order_id]
    assert mailer.calls == 3


def test_stock_is_reserved_exactly_once_however_often_the_receipt_is_retried(
    outbox: Outbox, outbox_drain: Drain, conn: sqlite3.Connection, mailer: shop.FlakyMailer
) -> None:
    mailer.fail_first = 4
    shop.place_order(
        outbox, conn, email="cy@example.com", product="doohickey", quantity=3, total=900
    )
    with outbox_drain.expect_failures("send-receipt"):
        report = outbox_drain()
    assert len(report.deliveries_to(handler="send-receipt")) == 5  # 4 failures, then success
    # reserve-stock succeeded on the first attempt; its record keeps it from running again,
    # and its write committed with that record: taken off the stock once.
    report.assert_delivered("order.placed", handler="reserve-stock", count=1)
    assert len(report.deliveries_to(handler="reserve-stock")) == 1
    assert stock(conn, "doohickey") == shop.PRODUCTS["doohickey"] - 3


def test_fraud_check_rejects_big_orders_once_and_for_all(
    outbox: Outbox, outbox_drain: Drain, conn: sqlite3.Connection, mailer: shop.FlakyMailer
) -> None:
    big = shop.place_order(outbox, conn, email="eve@example.com", product="doohickey", quantity=3)
    assert shop.PRICES["doohickey"] * 3 > shop.FRAUD_LIMIT
    report = outbox_drain()
    report.assert_rejected("order.placed", handler="fraud-check", count=1)
    (rejection,) = report.rejected
    assert rejection.error is not None and "fraud limit" in rejection.error
    # A rejection is a decision, not a failure: nothing is retried, the event is published.
    assert report.retried == [] and report.published == [big.event_id]
    # Each handler decides on its own: the others still ran.
    report.assert_delivered("order.placed", handler="send-receipt", count=1)


def test_out_of_stock_is_rejected_and_the_stock_untouched(
    outbox: Outbox, outbox_drain: Drain, conn: sqlite3.Connection, mailer: shop.FlakyMailer
) -> None:
    too_many = shop.PRODUCTS["doohickey"] + 1
    shop.place_order(
        outbox, conn, email="fay@example.com", product="doohickey", quantity=too_many, total=1
    )
    outbox_drain().assert_rejected("order.placed", handler="reserve-stock", count=1)
    assert stock(conn, "doohickey") == shop.PRODUCTS["doohickey"]


def test_a_receipt_that_never_goes_out_is_dead_lettered_then_requeued(
    outbox: Outbox, outbox_drain: Drain, conn: sqlite3.Connection, mailer: shop.FlakyMailer
) -> None:
    mailer.failure_rate = 1.0  # the mail server is down
    placed = shop.place_order(outbox, conn, email="gil@example.com", product="widget", quantity=1)
    with outbox_drain.expect_failures("send-receipt"):
        report = outbox_drain()
    report.assert_dead_lettered("order.placed", count=1)
    assert len(report.deliveries_to(handler="send-receipt")) == 11  # max_retries=10, then dead
    letter = outbox.dead_letter(placed.event_id)
    assert letter is not None and "mail server busy" in (letter.last_error or "")
    assert {r.handler for r in letter.records} == {"fraud-check", "reserve-stock"}

    mailer.failure_rate = 0.0  # back up: requeue, and only the receipt runs again
    assert outbox.requeue([placed.event_id]) == 1
    again = outbox_drain()
    assert [d.handler for d in again.deliveries] == ["send-receipt"]
    assert again.published == [placed.event_id]
    assert stock(conn, "widget") == shop.PRODUCTS["widget"] - 1


def test_the_demo_helper_counts_what_happened(tmp_path: Path) -> None:
    run = demo_main(tmp_path / "demo.db", orders=40)
    assert run.orders == 40 and run.pending == 0
    assert run.published + run.dead_lettered == 40
    for name, tally in run.handlers.items():
        assert tally.published + tally.rejected + tally.dead_lettered == 40, name
