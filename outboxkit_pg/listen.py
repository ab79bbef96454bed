"""Waking pollers with ``LISTEN``/``NOTIFY``.

An enqueue queues a ``NOTIFY`` (no event data in it) that PostgreSQL delivers when the app
commits. A poller waiting between polls with a ``NotifyWaiter`` returns as soon as one arrives,
instead of at the end of its interval. Polling stays the source of truth: a notification lost
while the listener reconnects only means the next poll comes at the interval.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
from collections.abc import Mapping
from typing import Any

import psycopg

__all__ = ["NotifyWaiter"]

log = logging.getLogger("outboxkit")

_CONNECT_TIMEOUT = 5


class NotifyWaiter:
    """A poller ``Waiter`` that returns early on a notification or on ``wake()``.

    The listening connection is opened on the first ``wait`` and reopened after it is lost;
    while the database cannot be reached the waiter simply waits out its timeout. ``wake`` may
    be called from any thread. ``close`` releases the connection; the waiter can be used again.
    """

    def __init__(
        self, conninfo: str, kwargs: Mapping[str, Any], listen: bytes, *, where: str
    ) -> None:
        self._conninfo = conninfo
        self._kwargs = {"autocommit": True, **kwargs}
        if "connect_timeout" not in psycopg.conninfo.conninfo_to_dict(conninfo):
            self._kwargs.setdefault("connect_timeout", _CONNECT_TIMEOUT)
        self._listen = listen
        self._where = where
        self._conn: psycopg.Connection[Any] | None = None
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._woken = False

    def __repr__(self) -> str:
        state = "listening" if self._conn is not None else "idle"
        return f"<NotifyWaiter {self._where} {state}>"

    def wake(self) -> None:
        # The flag first, then the byte: a wait() that has not made its sockets yet sees the
        # flag; one blocked in select() gets the byte. Safe from a signal handler (no lock).
        self._woken = True
        sockets = self._sockets
        if sockets is not None:
            # A full buffer means a wake is pending anyway; a closed socket, a closed waiter.
            with contextlib.suppress(OSError):
                sockets[1].send(b"\0")

    def wait(self, timeout: float) -> None:
        if self._sockets is None:
            receive, send = socket.socketpair()
            receive.setblocking(False)
            send.setblocking(False)
            self._sockets = (receive, send)
        receive = self._sockets[0]
        if not self._woken:
            conn = self._listener()
            waitables: list[Any] = [receive] if conn is None else [receive, conn]
            try:
                ready, _, _ = select.select(waitables, [], [], max(0.0, timeout))
            except (OSError, ValueError):
                ready = []
            if conn is not None and conn in ready:
                try:
                    for _ in conn.notifies(timeout=0):
                        pass
                except psycopg.Error as exc:
                    log.info("LISTEN connection to %s lost: %s", self._where, exc)
                    self._drop_listener()
        self._woken = False
        try:
            while receive.recv(512):
                pass
        except OSError:  # nothing (more) to read
            pass

    def close(self) -> None:
        self._drop_listener()
        sockets, self._sockets = self._sockets, None
        if sockets is not None:
            for sock in sockets:
                sock.close()

    def _listener(self) -> psycopg.Connection[Any] | None:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        self._conn = None
        try:
            conn = psycopg.connect(self._conninfo, **self._kwargs)
        except psycopg.Error as exc:
            log.debug("cannot LISTEN on %s yet: %s", self._where, exc)
            return None
        try:
            conn.execute(self._listen)
        except psycopg.Error as exc:
            log.info("LISTEN on %s failed: %s", self._where, exc)
            conn.close()
            return None
        self._conn = conn
        return conn

    def _drop_listener(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
