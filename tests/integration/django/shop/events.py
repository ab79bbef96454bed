# shop/events.py
from django.db import transaction

from outboxkit import EventBus, Outbox, Reject
from outboxkit.contrib.django import store

from .models import LedgerLine, Order

bus = EventBus()
outbox = Outbox(store(), bus)  # on Django's connection for settings.OUTBOXKIT["DATABASE"]


@bus.handler("order.placed", name="ledger")
def ledger(event, ctx):
    # Runs inside the delivery transaction, on Django's connection: these rows commit together
    # with the delivery record, exactly once, or roll back with a failed attempt.
    order = Order.objects.get(id=event.payload["order_id"])
    if order.quantity <= 0:
        raise Reject("nothing to book")  # recorded, never retried
    with transaction.atomic():  # a savepoint of the delivery transaction
        LedgerLine.objects.create(order_id=order.id, line="debit")
        LedgerLine.objects.create(order_id=order.id, line="credit")
