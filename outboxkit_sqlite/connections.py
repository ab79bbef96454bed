"""The SQLite store's own connections and transactions.

- Every store connection is opened with ``isolation_level=None``: every transaction is an
  explicit ``BEGIN IMMEDIATE`` ... ``COMMIT``, short, and never left open between calls.
  ``BEGIN IMMEDIATE`` takes SQLite's single write lock up front, so a transaction never has to
  upgrade a read snapshot (the one case ``busy_timeout`` cannot wait out); a busy ``BEGIN`` is
  retried a few times with backoff on top of ``busy_timeout``.
- An authorizer refuses ``BEGIN``/``COMMIT``/``ROLLBACK`` prepared by anyone but the store: a
  handler given the connection in its delivery transaction, or an app inside
  ``store.transaction()``, cannot end the transaction the store commits (with the delivery
  record) or rolls back. Savepoints stay allowed.
- A file database gets one connection per concurrent user, kept for reuse; ``:memory:`` exactly
  one, shared under a re-entrant lock (every connection would see its own empty database).
- The WAL watch: a read transaction held open elsewhere stops every checkpoint at its snapshot,
  so the WAL grows with every commit; after a commit, at most every ``WAL_CHECK_INTERVAL``
  seconds, the size is looked at and, over ``wal_warn_bytes``, a passive checkpoint runs; if it
  cannot get through the log, a warning is logged (at most once a minute).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from outboxkit.errors import StoreError

from .errors import is_busy

__all__ = ["Connections", "StoreConnection", "WalWatch", "in_transaction", "retry_busy"]

T = TypeVar("T")

log = logging.getLogger("outboxkit.sqlite")

JOURNAL_SIZE_LIMIT = 32 * 1024 * 1024  # what the WAL file shrinks back to once reset
WAL_CHECK_INTERVAL = 5.0  # seconds between two looks at the WAL's size (one stat call)
WAL_WARN_INTERVAL = 60.0  # seconds between two warnings about it
BUSY_RETRIES = 8

# The store's own transaction statements, the only ones its connections may run (see
# StoreConnection). Spelled apart from a plain "COMMIT": sqlite3 caches prepared statements by
# their text, and anyone else's COMMIT must be freshly prepared, so the authorizer sees it.
BEGIN = "BEGIN IMMEDIATE -- outboxkit"
BEGIN_READ = "BEGIN DEFERRED -- outboxkit"
COMMIT = "COMMIT -- outboxkit"
ROLLBACK = "ROLLBACK -- outboxkit"
SAVEPOINT = "SAVEPOINT outboxkit_delivery"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO outboxkit_delivery"
RELEASE_SAVEPOINT = "RELEASE outboxkit_delivery"

# Text that is not UTF-8 (written behind outboxkit's back, or by an older version that let a
# lone surrogate through) reads back with its bad bytes escaped, instead of failing every query
# that touches the row.
read_text = functools.partial(str, encoding="utf-8", errors="backslashreplace")


def in_transaction(conn: sqlite3.Connection) -> bool:
    """Whether ``conn`` has an open transaction; False once it is closed."""
    try:
        return conn.in_transaction
    except sqlite3.ProgrammingError:  # closed
        return False


def retry_busy(action: Callable[..., T], *args: object, busy_timeout: float) -> T:
    """Run ``action(*args)``, retrying with backoff while SQLite reports busy, for at most
    ``busy_timeout`` in all.

    SQLite's own busy handler already waits up to ``busy_timeout``; this covers the cases where
    SQLite answers busy at once without calling it (e.g. while another connection recovers the
    WAL). An answer that came after the full wait is final.
    """
    deadline = time.monotonic() + busy_timeout
    delay = 0.005
    for attempt in range(BUSY_RETRIES + 1):
        try:
            return action(*args)
        except sqlite3.OperationalError as exc:
            if attempt == BUSY_RETRIES or not is_busy(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 3, 1.0)
    raise AssertionError("unreachable")  # pragma: no cover


class StoreConnection(sqlite3.Connection):
    """A store connection: only the store begins, commits and rolls back its transactions.

    ``delivery`` is the delivery (or batch) in progress on it, told when a handler tried to end
    its transaction. The authorizer is installed once: installing one expires every prepared
    statement.
    """

    delivery: Any = None
    _controlling = False
    # R18: a handler may have changed the connection's settings since they were last reset;
    # ``Connections`` resets them before anyone else gets it.
    dirty = False
    # Whether a handler ever set a PRAGMA on it (other than to the store's own value): the
    # authorizer sees each statement when it is prepared, and sqlite3 caches prepared
    # statements by their text, so a handler's PRAGMA may run again later, unseen. From the
    # first one on, every delivery on the connection counts as having changed its settings
    # (``dirty``); until then a delivery costs no reset and no ``query_only`` before its record.
    tainted = False
    session: tuple[str, ...] = ()  # the settings it is opened with (``connect``)
    # ``session`` as the authorizer sees each: (pragma name, value).
    own_settings: frozenset[tuple[str, str]] = frozenset()

    def reset_session(self) -> None:
        """R18: the settings a handler may have changed (``PRAGMA query_only``,
        ``foreign_keys``, ``busy_timeout`` ...) back to those the store opens its connections
        with, outside any transaction.

        Raises:
            sqlite3.Error: SQLite refused (the caller drops the connection).
        """
        for statement in self.session:
            self.execute(statement)
        self.dirty = False

    def reset_quietly(self) -> None:
        """``reset_session``; a connection SQLite refuses to reset is closed (and dropped by
        its pool), the failure logged."""
        try:
            self.reset_session()
        except sqlite3.Error as exc:
            log.warning("SQLite: a connection's settings could not be reset; closing it: %s", exc)
            self.close()

    def guard(self) -> None:
        self.set_authorizer(self._authorize)

    def control(self, statement: str) -> None:
        """Run one of the store's own transaction statements (``BEGIN``, ``COMMIT`` ...)."""
        self._controlling = True
        try:
            self.execute(statement)
        finally:
            self._controlling = False

    def rollback_quietly(self) -> None:
        """Roll back if a transaction is open; if even that fails, the pool drops the
        connection (it is left in a transaction)."""
        if in_transaction(self):
            with suppress(sqlite3.Error):
                self.control(ROLLBACK)

    def _authorize(self, action: int, name: object = None, value: object = None, *_: object) -> int:
        if action == sqlite3.SQLITE_TRANSACTION and not self._controlling:
            if self.delivery is not None:
                self.delivery.ended_by_handler = True
            return sqlite3.SQLITE_DENY
        if (
            action == sqlite3.SQLITE_PRAGMA
            and value is not None
            and self.delivery is not None
            and (str(name).lower(), str(value)) not in self.own_settings
        ):
            self.tainted = self.dirty = True  # R18: see ``tainted``
        return sqlite3.SQLITE_OK


def connect(path: str, *, busy_timeout: float) -> StoreConnection:
    """A new store connection on ``path`` (raises ``sqlite3.Error``; the caller maps it)."""
    conn = sqlite3.connect(
        path,
        isolation_level=None,
        check_same_thread=False,
        timeout=busy_timeout,
        factory=StoreConnection,
    )
    try:
        conn.guard()
        conn.text_factory = read_text
        conn.session = (
            "PRAGMA synchronous=NORMAL",
            f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}",
            f"PRAGMA busy_timeout={round(busy_timeout * 1000)}",
            "PRAGMA query_only=0",
            "PRAGMA foreign_keys=0",
            "PRAGMA recursive_triggers=0",
        )
        conn.own_settings = frozenset(
            (name.lower(), value)
            for name, value in (
                statement.removeprefix("PRAGMA ").split("=", 1) for statement in conn.session
            )
        )
        conn.reset_session()
    except BaseException:
        conn.close()
        raise
    return conn


class Connections:
    """The store's own connections: one per concurrent user, handed between threads one user at
    a time; or, for ``:memory:`` (``shared``), one connection under a re-entrant lock."""

    def __init__(self, connect: Callable[[], StoreConnection], *, shared: bool) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._idle: list[StoreConnection] = []
        self._closed = False
        self._shared_lock = threading.RLock()
        self._shared = connect() if shared else None

    @property
    def closed(self) -> bool:
        return self._closed

    def take(self) -> StoreConnection:
        """A connection for one user, handed back with ``give`` (``acquire`` as two calls, for
        a context manager written as a class: the delivery's, made once per event).

        Raises:
            StoreError: the store is closed.
            sqlite3.Error: a new connection could not be opened.
        """
        if self._shared is not None:
            self._shared_lock.acquire()
            if self._closed:
                self._shared_lock.release()
                raise StoreError("the SQLite store is closed")
            return self._shared
        with self._lock:
            if self._closed:
                raise StoreError("the SQLite store is closed")
            conn = self._idle.pop() if self._idle else None
        return self._connect() if conn is None else conn

    def give(self, conn: StoreConnection) -> None:
        """Hand back a connection ``take`` gave (its session reset if a handler had it)."""
        if conn.dirty and not in_transaction(conn):
            conn.reset_quietly()
        if self._shared is not None:
            self._shared_lock.release()
        else:
            self._give_back(conn)

    @contextmanager
    def acquire(self) -> Iterator[StoreConnection]:
        conn = self.take()
        try:
            yield conn
        finally:
            self.give(conn)

    def _give_back(self, conn: StoreConnection) -> None:
        try:
            usable = not conn.in_transaction
        except sqlite3.ProgrammingError:  # closed by a misbehaving handler
            return
        with self._lock:
            if usable and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        if self._shared is not None:
            with self._shared_lock:
                self._shared.close()


class WalWatch:
    """Looks at the WAL's size after commits (see the module docstring). Never raises."""

    def __init__(self, path: str | None, warn_bytes: int) -> None:
        self._wal = None if path is None else f"{path}-wal"
        self._warn_bytes = warn_bytes
        self._lock = threading.Lock()
        self.check_at = math.inf if path is None else 0.0
        self._warn_at = 0.0

    def after_commit(self, conn: StoreConnection) -> None:
        if time.monotonic() < self.check_at:  # the hot path's only cost
            return
        if not self._lock.acquire(blocking=False):
            return  # another thread is looking
        try:
            self._check(conn)
        finally:
            self._lock.release()

    def _check(self, conn: StoreConnection) -> None:
        now = time.monotonic()
        if now < self.check_at or self._wal is None:
            return
        self.check_at = now + WAL_CHECK_INTERVAL
        try:
            size = os.path.getsize(self._wal)
        except OSError:
            return
        if size <= self._warn_bytes:
            return
        try:
            row = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            log.debug("SQLite WAL %s: passive checkpoint failed: %s", self._wal, exc)
            return
        busy, frames, checkpointed = row if row is not None else (1, -1, -1)
        if busy or checkpointed < 0 or checkpointed >= frames or now < self._warn_at:
            return
        self._warn_at = now + WAL_WARN_INTERVAL
        log.warning(
            "SQLite database %s: the WAL file %s is %.1f MB (over wal_warn_bytes=%d) and a "
            "checkpoint got through only %d of its %d frames: a connection holds a read "
            "transaction open, so the WAL cannot be reset and grows with every commit; end "
            "long-lived read transactions (a BEGIN without COMMIT, an unfinished cursor)",
            self._wal.removesuffix("-wal"),
            self._wal,
            size / 1_000_000,
            self._warn_bytes,
            checkpointed,
            frames,
        )
