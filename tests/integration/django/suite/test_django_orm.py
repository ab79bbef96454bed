"""Acceptance 3: enqueue through the ORM's transaction, and handlers writing through the ORM in
the delivery transaction, on the backend project.settings names (SQLite file or PostgreSQL)."""

import pytest
from django.db import connection, connections, transaction
from shop.extra import audit_order
from shop.models import LedgerLine, Order
from shop.services import place_order

from outboxkit import ConfigurationError, InvalidEvent
from outboxkit.core.model import Outcome

pytestmark = pytest.mark.django_db(transaction=True)


def test_commit_writes_one_event(outbox, outbox_drain):
    order = place_order("book")
    assert [e.payload for e in outbox_drain.enqueued("order.placed")] == [{"order_id": order.id}]


def test_rollback_writes_no_event(outbox, outbox_drain):
    with transaction.atomic():
        order = Order.objects.create(item="book")
        outbox.enqueue(connection, "order.placed", {"order_id": order.id})
        transaction.set_rollback(True)
    assert Order.objects.count() == 0
    assert outbox_drain.enqueued() == []


def test_exception_in_atomic_writes_no_event(outbox, outbox_drain):
    with pytest.raises(RuntimeError, match="boom"), transaction.atomic():
        order = Order.objects.create(item="book")
        outbox.enqueue(connections["default"], "order.placed", {"order_id": order.id})
        raise RuntimeError("boom")
    assert Order.objects.count() == 0
    assert outbox_drain.enqueued() == []


def test_autocommit_is_refused_naming_atomic(outbox, outbox_drain):
    with pytest.raises(ConfigurationError, match=r"transaction\.atomic\(using='default'\)"):
        outbox.enqueue(connection, "order.placed", {"order_id": 1})
    assert outbox_drain.enqueued() == []


def test_the_transaction_stays_usable_after_a_refusal(outbox, outbox_drain):
    with transaction.atomic():
        order = Order.objects.create(item="book")
        with pytest.raises(InvalidEvent):
            outbox.enqueue(connection, "order.placed", {"bad": float("nan")})
        outbox.enqueue(connection, "order.placed", {"order_id": order.id})
    assert Order.objects.count() == 1
    assert len(outbox_drain.enqueued("order.placed")) == 1


def test_async_enqueue_is_refused_naming_sync_to_async(outbox):
    import asyncio

    with pytest.raises(ConfigurationError, match="sync_to_async"):
        asyncio.run(outbox.enqueue_async(connection, "order.placed", {"order_id": 1}))


def test_a_failed_attempt_rolls_back_the_orm_writes_then_the_retry_commits_them(
    outbox, outbox_drain
):
    order = audit_order(outbox, fail_first=True)
    first = outbox.poller().run_once()
    assert [d.outcome for d in first.deliveries] == [Outcome.FAILED]
    assert LedgerLine.objects.count() == 0  # written, then rolled back with the attempt
    with outbox_drain.expect_failures("audit"):
        outbox_drain().assert_delivered("order.audit", handler="audit")
    lines = sorted(LedgerLine.objects.values_list("line", flat=True))
    assert lines == ["audit-credit", "audit-debit"]
    assert all(line.order_id == order.id for line in LedgerLine.objects.all())
    (event,) = outbox_drain.enqueued("order.audit")
    records = outbox.store.records(event.id)
    assert [(r.handler, r.outcome) for r in records] == [("audit", Outcome.SUCCEEDED)]
    (failed,) = outbox.attempt_errors(event.id)  # the first attempt's error, kept
    assert failed.attempt == 1 and failed.error.startswith("audit: ")
    assert outbox.store.capabilities.error_history


def test_a_rejection_rolls_back_the_orm_writes_and_is_recorded(outbox, outbox_drain):
    audit_order(outbox, reject=True)
    report = outbox_drain()
    report.assert_rejected("order.audit", handler="audit")
    assert LedgerLine.objects.count() == 0
    (event,) = outbox_drain.enqueued("order.audit")
    (record,) = outbox.store.records(event.id)
    assert (record.outcome, record.reason) == (Outcome.REJECTED, "refused after writing")


def test_per_batch_deliveries_are_savepoints_of_one_django_transaction(outbox, outbox_drain):
    audit_order(outbox, fail_first=True)
    place_order("pen")
    report = outbox.poller(transaction="per_batch").run_once()
    assert sorted(d.outcome.value for d in report.deliveries) == ["failed", "succeeded"]
    assert LedgerLine.objects.count() == 2  # the failed delivery's writes rolled back alone


def test_ctx_connection_is_the_raw_db_api_connection(outbox, outbox_drain):
    from shop.extra import connections_seen

    connections_seen.clear()
    with transaction.atomic():
        outbox.enqueue(connection, "probe", {})
    outbox_drain().assert_delivered("probe", handler="probe")
    ((given, djangos),) = connections_seen
    assert given is djangos  # the delivery transaction is on Django's connection
    assert type(given).__module__.split(".")[0] in ("sqlite3", "psycopg")


def test_the_readme_handler_rejects_an_empty_order_before_writing(outbox, outbox_drain):
    place_order("nothing", quantity=0)
    outbox_drain().assert_rejected("order.placed", handler="ledger")
    assert LedgerLine.objects.count() == 0


def test_an_event_written_through_the_orm_carries_a_message_id(outbox, outbox_store):
    """The Django store runs the SQLite and PostgreSQL stores' statements: an event written in
    the ORM's transaction gets its message identity (a UUID) there too, which every read and
    the claim carry."""
    import uuid
    from datetime import timedelta

    place_order("book")
    place_order("pen")
    events = outbox_store.events()
    assert len(events) == 2
    ids = [e.message_id for e in events]
    assert [str(uuid.UUID(m)) for m in ids] == ids and len(set(ids)) == 2
    assert outbox_store.get(events[0].id).message_id == ids[0]
    claims = outbox_store.claim(batch_size=10, lease=timedelta(seconds=30), now=None)
    assert [c.event.message_id for c in claims] == ids


def test_an_enqueue_wakes_this_process_pollers_when_the_atomic_block_commits(outbox):
    # Woken at the enqueue, a poller would poll before the commit, find nothing, and leave the
    # event for its interval: Django's on_commit wakes it after the commit, never on a rollback.
    wakes: list[int] = []

    class Counting:
        def wake(self) -> None:
            wakes.append(1)

    waiter = Counting()
    outbox.add_waiter(waiter)
    try:
        with transaction.atomic():
            outbox.enqueue(connection, "order.placed", {"order_id": 1})
            assert wakes == []
        assert wakes == [1]
        with transaction.atomic():
            outbox.enqueue(connection, "order.placed", {"order_id": 2})
            transaction.set_rollback(True)
        assert wakes == [1]
    finally:
        outbox.remove_waiter(waiter)
