# tests/test_orders.py
from shop.models import LedgerLine
from shop.services import place_order


def test_an_order_is_booked(db, outbox_drain):
    order = place_order("book")
    outbox_drain.assert_enqueued("order.placed", {"order_id": order.id})
    outbox_drain().assert_delivered("order.placed", handler="ledger")
    assert LedgerLine.objects.filter(order_id=order.id).count() == 2


def test_an_empty_order_is_rejected(db, outbox_drain):
    place_order("nothing", quantity=0)
    outbox_drain().assert_rejected("order.placed", handler="ledger")
    assert not LedgerLine.objects.exists()
