"""R17 on Django's connection (item 2): a handler that catches an ORM ``IntegrityError`` leaves
Django's atomic block marked for rollback (``needs_rollback``), which Django then rolls back
without raising. Its delivery fails (nothing of it committed, no record, retried) instead of
the event being published with none of its rows and no record (SQLite), and in ``per_batch`` it
costs that delivery only, instead of the whole batch rolled back in silence (PostgreSQL)."""

import pytest
from django.db import connection, transaction
from shop.models import LedgerLine, Order

from outboxkit import HandlerCrashed
from outboxkit.core.model import Outcome

pytestmark = pytest.mark.django_db(transaction=True)


def _enqueue(outbox, topic, **payload):
    with transaction.atomic():
        order = Order.objects.create(item=topic)
        outbox.enqueue(connection, topic, {"order_id": order.id, **payload})
    return order


def test_a_caught_integrity_error_fails_the_delivery_and_the_retry_commits_once(
    outbox, outbox_drain
):
    order = _enqueue(outbox, "order.swallow")
    first = outbox.poller().run_once()
    (delivery,) = first.deliveries
    assert delivery.outcome is Outcome.FAILED
    assert isinstance(delivery.exception, HandlerCrashed)
    # SQLite: the mark found; PostgreSQL: the aborted transaction found first.
    assert "marked for rollback" in delivery.error or "failed and the handler went on" in (
        delivery.error
    )
    assert first.published == []
    assert LedgerLine.objects.count() == 0
    (event,) = outbox_drain.enqueued("order.swallow")
    assert outbox.store.records(event.id) == []
    with outbox_drain.expect_failures("swallow"):
        outbox_drain()
    assert list(LedgerLine.objects.values_list("order_id", "line")) == [(order.id, "swallow")]
    (record,) = outbox.store.records(event.id)
    assert (record.outcome, record.attempt) == (Outcome.SUCCEEDED, 2)


def test_in_a_batch_the_marked_delivery_costs_only_itself(outbox, outbox_drain):
    with transaction.atomic():
        outbox.enqueue(connection, "tick", {"n": 1})
    bad = _enqueue(outbox, "order.swallow", always=True)
    with transaction.atomic():
        outbox.enqueue(connection, "tick", {"n": 3})
    report = outbox.poller(transaction="per_batch").run_once()
    outcomes = {(d.handler, d.outcome) for d in report.deliveries}
    assert outcomes == {("tick-line", Outcome.SUCCEEDED), ("swallow", Outcome.FAILED)}
    assert len(report.published) == 2 and len(report.retried) == 1
    lines = sorted(LedgerLine.objects.values_list("order_id", "line"))
    assert lines == [(1, "tick"), (3, "tick")]  # the healthy deliveries committed
    assert not LedgerLine.objects.filter(order_id=bad.id).exists()
