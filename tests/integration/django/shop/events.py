"""The shop's outbox: a handler that writes through the ORM in the delivery transaction."""

from django.db import connection, transaction

from outboxkit import EventBus, Outbox, Reject
from outboxkit.contrib.django import store

from .models import LedgerLine

bus = EventBus()
outbox = Outbox(store(), bus)  # Django's connection for settings.OUTBOXKIT["DATABASE"]


@bus.handler("order.placed", name="ledger")
def ledger(event, ctx):
    order_id = event.payload["order_id"]
    with transaction.atomic():  # a savepoint of the delivery transaction
        LedgerLine.objects.create(order_id=order_id, line="debit")
        LedgerLine.objects.create(order_id=order_id, line="credit")
    if event.payload.get("reject"):
        raise Reject("refused after writing")  # the writes roll back, the rejection is kept
    if event.payload.get("fail_first") and ctx.attempt == 1:
        raise RuntimeError("failed after writing")  # the writes roll back; retried


@bus.handler("tick", name="tick-line")
def tick_line(event, ctx):
    LedgerLine.objects.create(order_id=event.payload["n"], line="tick")


connections_seen = []  # (ctx.connection, Django's raw connection) in the "probe" handler


@bus.handler("probe", name="probe")
def probe(event, ctx):
    connections_seen.append((ctx.connection, connection.connection))
