"""The test kit: drain an outbox under a virtual clock, and assert on what happened.

The pytest plugin (``outboxkit.testing.pytest_plugin``) hands these out as fixtures; they work
without pytest too::

    clock = FrozenClock()
    outbox = Outbox(MemoryStore(), bus, clock=clock)
    drain = Drain(outbox, clock)
    ...
    report = drain()                     # claim -> deliver -> settle until nothing is due
    report.assert_delivered("order.placed", handler="send-receipt")

``Drain`` runs the production path in rounds, through the poller's own drain loop
(``Poller.run_until_idle``, or ``AsyncPoller.run_until_idle`` for an app with ``async def``
handlers: ``drain()`` runs it on an event loop of its own, ``await drain.async_()`` on the
running one). When nothing is due but a retry or a lease is waiting, it moves the clock to the
next due time of any event, so a backoff schedule of hours finishes at once while every
recorded time, and the order of deliveries, keeps the real schedule.

One module per role: ``drain`` (``Drain``), ``report`` (``DrainReport``, ``HandlerErrors``),
``capture`` (``Capture`` and the enqueue assertions), ``clocks`` (``FreezegunClock``),
``stores`` (``open_test_store``), ``recorder`` (``Recorder``) and ``pytest_plugin`` (the
fixtures). This package only re-exports their public names.
"""

from __future__ import annotations

from .capture import Capture
from .clocks import FreezegunClock
from .drain import PAGE as PAGE  # not public; importable from here before the split
from .drain import Drain
from .recorder import Recorder
from .report import DrainReport, HandlerErrors
from .stores import open_test_store

__all__ = [
    "Capture",
    "Drain",
    "DrainReport",
    "FreezegunClock",
    "HandlerErrors",
    "Recorder",
    "open_test_store",
]
