"""Waking pollers with ``LISTEN``/``NOTIFY``.

An enqueue queues a ``NOTIFY`` (no event data in it) that PostgreSQL delivers when the app
commits. A poller waiting between polls with a ``NotifyWaiter`` (the asyncio poller: an
``AsyncNotifyWaiter``) returns as soon as one arrives, instead of at the end of its interval.
Polling stays the source of truth: a notification lost while the listener reconnects only
means the next poll comes at the interval.

Both waiters are the same but for the waiting: ``_Listening`` holds what they share (the
connection options, the wake-up socket pair that ``wake`` writes to from any thread or signal
handler, and what a wait does before and after it waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import select
import socket
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import psycopg

from .loops import close_from_blocking, finish, running_loop

__all__ = ["AsyncNotifyWaiter", "NotifyWaiter"]

log = logging.getLogger("outboxkit")

_CONNECT_TIMEOUT = 5

C = TypeVar("C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])


@functools.lru_cache(maxsize=64)
def _sets_timeout(conninfo: str) -> bool:
    """Whether ``conninfo`` sets its own ``connect_timeout`` (parsed once per conninfo: a
    poller makes its waiter whenever it is made, a test kit's drain once per drain)."""
    return "connect_timeout" in psycopg.conninfo.conninfo_to_dict(conninfo)


class _Listening(Generic[C]):
    """What both waiters share (``C``: their kind of connection); see the module docstring.

    Args:
        conninfo, kwargs: how to open the listening connection (autocommit).
        listen: the ``LISTEN`` statement.
        where: the server, for log lines; ``scrub`` takes any secret out of a driver message.
    """

    def __init__(
        self,
        conninfo: str,
        kwargs: Mapping[str, Any],
        listen: bytes,
        *,
        where: str,
        scrub: Callable[[str], str] = str,
    ) -> None:
        self._conninfo = conninfo
        self._kwargs = {**kwargs, "autocommit": True}
        if not _sets_timeout(conninfo):
            self._kwargs.setdefault("connect_timeout", _CONNECT_TIMEOUT)
        self._listen = listen
        self._where = where
        self._scrub = scrub
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._woken = False
        self._conn: C | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the async connection's loop

    def __repr__(self) -> str:
        state = "listening" if self._conn is not None else "idle"
        return f"<{type(self).__name__} {self._where} {state}>"

    def wake(self) -> None:
        """End the current wait, or the next one at once: from any thread or a signal
        handler (it takes no lock and does not touch the event loop)."""
        # The flag first, then the byte: a wait() that has not made its sockets yet sees the
        # flag; one blocked waiting gets the byte. Safe from a signal handler (no lock).
        self._woken = True
        sockets = self._sockets
        if sockets is not None:
            # A full buffer means a wake is pending anyway; a closed socket, a closed waiter.
            with contextlib.suppress(OSError):
                sockets[1].send(b"\0")

    def _receiver(self) -> socket.socket | None:
        """The socket a wait watches for wake-ups, or None when already woken (no wait)."""
        if self._sockets is None:
            receive, send = socket.socketpair()
            receive.setblocking(False)
            send.setblocking(False)
            self._sockets = (receive, send)
        return None if self._woken else self._sockets[0]

    def _rewind(self) -> None:
        """After a wait: the wake-ups it consumed are gone."""
        self._woken = False
        if self._sockets is not None:
            try:
                while self._sockets[0].recv(512):
                    pass
            except OSError:  # nothing (more) to read
                pass

    def _close_sockets(self) -> None:
        sockets, self._sockets = self._sockets, None
        if sockets is not None:
            for sock in sockets:
                sock.close()

    def _cannot_connect(self, exc: psycopg.Error) -> C | None:
        """No listener yet (the server cannot be reached): the wait waits out its timeout."""
        log.debug("cannot LISTEN on %s yet: %s", self._where, self._scrub(str(exc)))
        return None

    def _listen_failed(self, exc: psycopg.Error) -> C | None:
        """No listener (its ``LISTEN`` failed): the wait waits out its timeout."""
        log.info("LISTEN on %s failed: %s", self._where, self._scrub(str(exc)))
        return None

    def _lost(self, exc: psycopg.Error) -> C | None:
        """The listening connection failed while read: log it; it is dropped (returned, for
        the caller to close)."""
        log.info("LISTEN connection to %s lost: %s", self._where, self._scrub(str(exc)))
        conn, self._conn = self._conn, None
        return conn

    def _current(self) -> C | None:
        """The listening connection if it is still open (else a new one is needed)."""
        if self._conn is not None and self._conn.closed:
            self._conn = None
        return self._conn


class NotifyWaiter(_Listening[psycopg.Connection[Any]]):
    """A poller ``Waiter`` that returns early on a notification or on ``wake()``.

    The listening connection is opened on the first ``wait`` and reopened after it is lost;
    while the database cannot be reached the waiter simply waits out its timeout. ``wake`` may
    be called from any thread. ``close`` releases the connection; the waiter can be used again.
    """

    def wait(self, timeout: float) -> None:
        """Return after ``timeout`` seconds, on a notification, or on ``wake()`` (at once if
        one came since the last wait). Never raises: without a listener it waits out the
        timeout."""
        receive = self._receiver()
        if receive is not None:
            conn = self._listener()
            if _select(receive, conn, timeout) and conn is not None:
                self._read(conn)
        self._rewind()

    def _read(self, conn: psycopg.Connection[Any]) -> None:
        try:
            for _ in conn.notifies(timeout=0):
                pass
        except psycopg.Error as exc:
            _close(self._lost(exc))

    def close(self) -> None:
        """Release the listening connection and the wake-up sockets."""
        conn, self._conn = self._conn, None
        _close(conn)
        self._close_sockets()

    def _listener(self) -> psycopg.Connection[Any] | None:
        if (conn := self._current()) is not None:
            return conn
        try:
            conn = psycopg.connect(self._conninfo, **self._kwargs)
        except psycopg.Error as exc:
            return self._cannot_connect(exc)
        try:
            conn.execute(self._listen)
        except psycopg.Error as exc:
            conn.close()
            return self._listen_failed(exc)
        self._conn = conn
        return conn


class AsyncNotifyWaiter(_Listening[psycopg.AsyncConnection[Any]]):
    """``NotifyWaiter`` for the asyncio poller (an ``AsyncClosingWaiter``): ``await wait()``
    returns early on a notification (psycopg's async notifications) or on ``wake()``, which may
    be called from any thread or a signal handler (it is not a coroutine).

    The listening connection belongs to the event loop of the wait that opened it; a wait on
    another loop (the first one ended) opens a new one. ``close`` releases it; the store's
    ``close()`` does too, from blocking code.
    """

    async def wait(self, timeout: float) -> None:
        """``NotifyWaiter.wait`` on the event loop."""
        receive = self._receiver()
        if receive is not None:
            conn = await self._listener()
            if await _readable(receive, conn, timeout) and conn is not None:
                await self._read(conn)
        self._rewind()

    async def _read(self, conn: psycopg.AsyncConnection[Any]) -> None:
        try:
            async for _ in conn.notifies(timeout=0):
                pass
        except psycopg.Error as exc:
            await self._close(self._lost(exc))

    async def close(self) -> None:
        """Release the listening connection and the wake-up sockets."""
        conn, self._conn = self._conn, None
        await self._close(conn)
        self._close_sockets()

    def close_blocking(self) -> None:
        """``close`` from blocking code (the store's ``close()``), wherever the loop is."""
        close_from_blocking(self._loop, self.close, self._hard_close)

    async def _listener(self) -> psycopg.AsyncConnection[Any] | None:
        loop = asyncio.get_running_loop()
        if self._conn is not None and self._loop is not loop:
            self._hard_close()  # opened on a loop that has ended: nothing there reads it
        if (conn := self._current()) is not None:
            return conn
        try:
            conn = await psycopg.AsyncConnection.connect(self._conninfo, **self._kwargs)
        except psycopg.Error as exc:
            return self._cannot_connect(exc)
        try:
            await conn.execute(self._listen)
        except psycopg.Error as exc:
            await conn.close()
            return self._listen_failed(exc)
        self._conn, self._loop = conn, loop
        return conn

    async def _close(self, conn: psycopg.AsyncConnection[Any] | None) -> None:
        """Close ``conn``: on its loop, or (that loop has ended) its socket at once."""
        if conn is None:
            return
        if self._loop is running_loop():
            await conn.close()
        else:
            finish(conn)

    def _hard_close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            finish(conn)
        self._close_sockets()


def _close(conn: psycopg.Connection[Any] | None) -> None:
    if conn is not None:
        conn.close()


def _select(receive: socket.socket, conn: psycopg.Connection[Any] | None, timeout: float) -> bool:
    """Wait until a wake-up or (``conn``) a notification comes, at most ``timeout`` seconds;
    whether ``conn`` has something to read."""
    waitables: list[Any] = [receive] if conn is None else [receive, conn]
    try:
        ready, _, _ = select.select(waitables, [], [], max(0.0, timeout))
    except (OSError, ValueError):
        return False
    return conn is not None and conn in ready


async def _readable(
    receive: socket.socket, conn: psycopg.AsyncConnection[Any] | None, timeout: float
) -> bool:
    """``_select`` on the event loop: a reader on each socket, until one is readable or
    ``timeout`` seconds pass; whether ``conn`` has something to read."""
    fds = [receive.fileno()] if conn is None else [receive.fileno(), conn.fileno()]
    try:  # what is readable already (a zero timeout gives the loop's readers no turn)
        ready = set(select.select(fds, [], [], 0)[0])
    except (OSError, ValueError):
        return False
    if ready or timeout <= 0:
        return conn is not None and conn.fileno() in ready
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def mark(fd: int) -> None:
        ready.add(fd)
        if not done.done():
            done.set_result(None)

    for fd in fds:
        loop.add_reader(fd, mark, fd)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done, timeout)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
    return conn is not None and conn.fileno() in ready
