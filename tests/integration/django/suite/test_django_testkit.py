"""Acceptance 4: the test kit under pytest-django, with the ``db`` and ``transactional_db``
fixtures."""

from django.db import connection, transaction
from shop.extra import audit_order
from shop.models import LedgerLine, Order
from shop.services import place_order


def test_db_fixture_drains_inside_the_tests_transaction(db, outbox, outbox_drain):
    assert connection.in_atomic_block  # pytest-django's transaction, rolled back afterwards
    order = place_order("book")
    outbox_drain.assert_enqueued("order.placed", {"order_id": order.id}, count=1)
    report = outbox_drain()
    report.assert_delivered("order.placed", handler="ledger")
    assert LedgerLine.objects.filter(order_id=order.id).count() == 2
    assert connection.in_atomic_block  # the drain committed nothing of the test's


def test_db_fixture_retries_roll_back_to_their_savepoint(db, outbox, outbox_drain):
    audit_order(outbox, fail_first=True)
    with outbox_drain.expect_failures("audit"):
        report = outbox_drain()
    assert [d.outcome.value for d in report.deliveries_to(handler="audit")] == [
        "failed",
        "succeeded",
    ]
    assert LedgerLine.objects.count() == 2


def test_transactional_db_fixture_drains_committed_events(transactional_db, outbox, outbox_drain):
    assert not connection.in_atomic_block
    order = place_order("book")
    outbox_drain.assert_enqueued("order.placed", {"order_id": order.id}, count=1)
    outbox_drain().assert_delivered("order.placed", handler="ledger")
    assert LedgerLine.objects.filter(order_id=order.id).count() == 2
    assert Order.objects.count() == 1


def test_transactional_db_leaves_no_events_behind(transactional_db, outbox, outbox_drain):
    # Runs after the test above: its events were cleared with Django's flush of the tables.
    assert outbox.store.events() == []
    with transaction.atomic():
        outbox.enqueue(connection, "probe", {})
    assert len(outbox.store.events()) == 1
