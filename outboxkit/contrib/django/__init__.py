"""outboxkit for Django: the app (``INSTALLED_APPS = [..., "outboxkit.contrib.django"]``), the
store on Django's own connection, ``manage.py outboxkit``, and the outbox tables' migration.

.. code-block:: python

    # settings.py
    OUTBOXKIT = {"DATABASE": "default", "OUTBOX": "myapp.events:outbox"}

    # myapp/events.py
    from outboxkit import EventBus, Outbox
    from outboxkit.contrib.django import store

    bus = EventBus()
    outbox = Outbox(store(), bus)  # nothing is read or connected until first use

    # a view or service
    with transaction.atomic():
        order = Order.objects.create(item="book")
        outbox.enqueue(connection, "order.placed", {"order_id": order.id})

See the README's "Django" section.
"""

from __future__ import annotations

from .store import DjangoStore, store

__all__ = ["DjangoStore", "store"]
