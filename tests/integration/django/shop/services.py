# shop/services.py - called from a view, a form's save(), a management command ...
from django.db import connection, transaction

from .events import outbox
from .models import Order


def place_order(item, quantity=1):
    with transaction.atomic():  # the order and its event commit, or roll back, together
        order = Order.objects.create(item=item, quantity=quantity)
        outbox.enqueue(connection, "order.placed", {"order_id": order.id})
    return order
