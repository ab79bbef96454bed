"""Handlers the tests use besides the README's ``ledger``, on the shop's bus."""

import contextlib

from django.db import IntegrityError, connection, transaction

from outboxkit import Reject

from .events import bus
from .models import LedgerLine, Order

connections_seen = []  # (ctx.connection, Django's raw connection) in the "probe" handler


@bus.handler("order.audit", name="audit")
def audit(event, ctx):
    """Writes two ORM rows, then rejects or (on the first attempt) fails, as the payload says."""
    order_id = event.payload["order_id"]
    LedgerLine.objects.create(order_id=order_id, line="audit-debit")
    LedgerLine.objects.create(order_id=order_id, line="audit-credit")
    if event.payload.get("reject"):
        raise Reject("refused after writing")
    if event.payload.get("fail_first") and ctx.attempt == 1:
        raise RuntimeError("failed after writing")


@bus.handler("order.swallow", name="swallow")
def swallow(event, ctx):
    """Writes a ledger line, then an order whose id is taken, and catches the IntegrityError:
    Django's atomic block is then marked for rollback (on its first attempt, or always)."""
    order_id = event.payload["order_id"]
    LedgerLine.objects.create(order_id=order_id, line="swallow")
    if ctx.attempt == 1 or event.payload.get("always"):
        with contextlib.suppress(IntegrityError):
            Order.objects.create(id=order_id, item="duplicate")


@bus.handler("tick", name="tick-line")
def tick_line(event, ctx):
    LedgerLine.objects.create(order_id=event.payload["n"], line="tick")


@bus.handler("probe", name="probe")
def probe(event, ctx):
    connections_seen.append((ctx.connection, connection.connection))


def audit_order(outbox, **flags):
    """An order and its "order.audit" event, committed together."""
    with transaction.atomic():
        order = Order.objects.create(item="audited")
        outbox.enqueue(connection, "order.audit", {"order_id": order.id, **flags})
    return order
