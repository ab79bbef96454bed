"""Helpers for a store on a DB-API driver: its own connections, and its errors mapped.

``ConnectionPool(connect, size, reset=..., close=...)`` makes a connection when none is idle,
keeps at most ``size`` idle ones, and closes a connection handed back ``broken`` (or one whose
``reset`` fails) instead of keeping it: a connection that failed, or whose transaction is in
doubt, never serves anyone else. ``reset(conn)`` runs before a connection is kept (R18: a
handler's session settings end with its delivery); it returns whether it could. A pool not
closed by the time the interpreter exits closes its idle connections then (``atexit``): a
driver that does not say goodbye when a connection is collected (PyMySQL) would otherwise
leave the server logging every one as aborted, at each poller's restart.

``MappedErrors(errors, mapper, doing)`` is a block whose driver errors become outboxkit's
(what a ``Dialect.mapped`` returns): a plain class, as a hot path enters several per event.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import StoreError

__all__ = ["ConnectionPool", "MappedErrors"]

C = TypeVar("C")


class ConnectionPool(Generic[C]):
    """Connections made by ``connect()``, up to ``size`` kept idle (see the module docstring).

    Args:
        connect: makes a connection (its errors propagate: map them there).
        size: how many idle connections are kept.
        reset: makes a connection fit for its next user; False: close it instead.
        close: closes a connection, quietly.
        what: the store, for the error of a closed pool.
    """

    def __init__(
        self,
        connect: Callable[[], C],
        size: int,
        *,
        reset: Callable[[C], bool],
        close: Callable[[C], None],
        what: str,
    ) -> None:
        self.connect = connect
        self.size = size
        self.reset = reset
        self.close_one = close
        self.what = what
        self.idle: list[C] = []
        self.lock = threading.Lock()
        self.closed = False
        self._at_exit = _closing_at_exit(weakref.ref(self))
        atexit.register(self._at_exit)

    def take(self) -> C:
        """An idle connection, or a new one.

        Raises:
            StoreError: the pool is closed.
        """
        with self.lock:
            if self.closed:
                raise StoreError(f"{self.what} is closed")
            if self.idle:
                return self.idle.pop()
        return self.connect()

    def give(self, conn: C, *, broken: bool = False) -> None:
        """Hand ``conn`` back: reset and kept, or (``broken``, reset failed, pool full or
        closed) closed."""
        keep = not broken and self.reset(conn)
        with self.lock:
            if keep and not self.closed and len(self.idle) < self.size:
                self.idle.append(conn)
                return
        self.close_one(conn)

    def close(self) -> None:
        """Close the idle connections; the pool makes no more. Closing twice is fine."""
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        atexit.unregister(self._at_exit)
        for conn in idle:
            self.close_one(conn)


def _closing_at_exit(pool: weakref.ref[ConnectionPool[Any]]) -> Callable[[], None]:
    """What closes ``pool`` at the interpreter's exit, if it is still there (a weak reference:
    the hook does not keep a forgotten pool alive)."""

    def close() -> None:
        found = pool()
        if found is not None:
            found.close()

    return close


class MappedErrors:
    """A block whose driver errors (``errors``) are raised as ``mapper(exc, doing)`` (a
    ``StoreError``), from them.

    Args:
        errors: the driver's error class(es).
        mapper: makes outboxkit's error of a driver's, naming ``doing``.
        doing: what the block does, for the message.
    """

    __slots__ = ("doing", "errors", "mapper")

    def __init__(
        self,
        errors: type[BaseException] | tuple[type[BaseException], ...],
        mapper: Callable[[BaseException, str], BaseException],
        doing: str,
    ) -> None:
        self.errors = errors
        self.mapper = mapper
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, self.errors):
            raise self.mapper(exc, self.doing) from exc
