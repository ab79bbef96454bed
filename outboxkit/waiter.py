"""How a poller waits between polls: a ``Waiter`` returns early when woken; an ``AsyncWaiter``
is the same for the asyncio poller.

The default, ``ThreadWaiter``, is woken by enqueues in this process; a store may offer one that
also wakes on commits elsewhere (``Store.make_waiter``: PostgreSQL's ``LISTEN``). Tests inject
one that moves a ``FrozenClock`` instead of sleeping. Polling stays the source of truth: a
waiter only makes the next poll come sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Protocol, runtime_checkable

__all__ = [
    "AsyncClosingWaiter",
    "AsyncWaiter",
    "ClosingWaiter",
    "LoopWaiter",
    "ThreadWaiter",
    "Waiter",
    "Wakeable",
]


class Wakeable(Protocol):
    """What ``Outbox.wake`` nudges: any waiter, blocking or async (``wake`` is thread-safe)."""

    def wake(self) -> None: ...


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


@runtime_checkable
class AsyncWaiter(Protocol):
    """``await wait(timeout)`` returns after ``timeout`` seconds, or earlier when ``wake`` is
    called - from any thread, or a signal handler: ``wake`` is not a coroutine."""

    async def wait(self, timeout: float) -> None: ...

    def wake(self) -> None: ...


@runtime_checkable
class AsyncClosingWaiter(AsyncWaiter, Protocol):
    """An async waiter holding something to release (a ``LISTEN`` connection)."""

    async def close(self) -> None: ...


class LoopWaiter:
    """The asyncio poller's default waiter: an ``asyncio.Event`` of the loop it waits on, which
    ``wake`` sets safely from any thread (in-process enqueues, ``stop()`` from a signal)."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken = False  # a wake before the first wait, or between two

    async def wait(self, timeout: float) -> None:
        if self._event is None or self._loop is not asyncio.get_running_loop():
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        if self._woken:
            self._woken = False
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        self._event.clear()
        self._woken = False

    def wake(self) -> None:
        self._woken = True
        loop, event = self._loop, self._event
        if loop is None or event is None or loop.is_closed():
            return
        # Through the loop's self-pipe even from its own thread: a plain ``signal.signal``
        # handler runs there while the loop sleeps in its selector, which ``event.set()``
        # alone would not wake before the wait's timeout.
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(event.set)

    async def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return "LoopWaiter()"
