from django.db import connection, transaction

from .events import outbox
from .models import Order


def place_order(item, **flags):
    with transaction.atomic():
        order = Order.objects.create(item=item)
        outbox.enqueue(connection, "order.placed", {"order_id": order.id, **flags})
    return order
