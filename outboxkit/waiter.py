"""How a poller waits between polls: a ``Waiter`` returns early when woken.

The default, ``ThreadWaiter``, is woken by enqueues in this process; a store may offer one that
also wakes on commits elsewhere (``Store.make_waiter``: PostgreSQL's ``LISTEN``). Tests inject
one that moves a ``FrozenClock`` instead of sleeping. Polling stays the source of truth: a
waiter only makes the next poll come sooner.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

__all__ = ["ClosingWaiter", "ThreadWaiter", "Waiter"]


@runtime_checkable
class Waiter(Protocol):
    """``wait`` returns after ``timeout`` seconds, or earlier when ``wake`` is called (from any
    thread, or a signal handler)."""

    def wait(self, timeout: float) -> None: ...

    def wake(self) -> None: ...


@runtime_checkable
class ClosingWaiter(Waiter, Protocol):
    """A waiter holding something to release (a ``LISTEN`` connection): what a store's
    ``make_waiter`` returns; the poller that asked for it calls ``close`` when it is done."""

    def close(self) -> None: ...


class ThreadWaiter:
    """The default waiter: a ``threading.Event`` that in-process enqueues set."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def wait(self, timeout: float) -> None:
        # Clear only a wake we consumed: one that lands after a timeout stays set for next time.
        if self._event.wait(timeout):
            self._event.clear()

    def wake(self) -> None:
        self._event.set()

    def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return "ThreadWaiter()"
