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

One module per role: ``drain`` (``Drain``), ``solo`` (its ``deliver_one``), ``aim`` (aiming
a drain, ``CrashAt`` crash points), ``report`` (``DrainReport``, ``HandlerErrors``), ``left``
(what a drain left and why), ``capture`` (``Capture`` and the enqueue assertions),
``matching`` (payload patterns: ``ANY``, ``Matcher``), ``through`` (reading through the app's
connection; naming another database), ``relay`` (``TestRelay``), ``statements``
(``StatementCount``), ``clocks`` (``FreezegunClock``, ``TimeMachineClock``), ``stores``
(``open_test_store``), ``recorder`` (``Recorder``), ``loops`` (event loops of a drain's own)
and ``pytest_plugin`` (the fixtures). This package only re-exports their public names.
"""

from __future__ import annotations

from .aim import CrashAt, InjectedCrash
from .capture import Capture
from .clocks import FreezegunClock, TimeMachineClock
from .drain import PAGE as PAGE  # not public; importable from here before the split
from .drain import Drain
from .left import Left
from .matching import ANY, Matcher
from .recorder import Recorder
from .relay import TestRelay
from .report import DrainReport, HandlerErrors
from .statements import StatementCount
from .stores import open_test_store

__all__ = [
    "ANY",
    "Capture",
    "CrashAt",
    "Drain",
    "DrainReport",
    "FreezegunClock",
    "HandlerErrors",
    "InjectedCrash",
    "Left",
    "Matcher",
    "Recorder",
    "StatementCount",
    "TestRelay",
    "TimeMachineClock",
    "open_test_store",
]
