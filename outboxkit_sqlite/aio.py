"""The SQLite store's asyncio side (``SQLiteStore.async_store()``), on aiosqlite.

Theory of operation:

- Its connections are the store's own (``SQLiteDialect.connect``: the authorizer that refuses a
  handler's ``COMMIT``/``ROLLBACK``/``BEGIN``, the pragmas, the text factory), each opened by
  aiosqlite in the one thread that then runs everything on it:
  ``aiosqlite.Connection(dialect.connect, ...)``. A delivery's ``tx.connection`` is that
  aiosqlite connection, so an ``async def`` handler writes in the delivery transaction.
- Nothing of the store is written twice. Every transaction is the blocking store's own context
  manager (``SQLiteDialect.write_on``; ``delivery.delivery_on``, ``batch_on`` and the batch's
  savepoints, ``in_savepoint``), entered and left on the connection's thread, one hop each:
  ``BEGIN IMMEDIATE`` with its busy retry and the token check on the way in; the handler's
  failure judged, ``COMMIT`` (or the rollback) and the WAL watch on the way out. Only the block
  in between is awaited on the event loop. Statements run through the dialect's ``rows``; the
  errors met on the thread are mapped there, by the dialect's table.
- One write transaction at a time per event loop (an ``asyncio.Lock``): SQLite has one writer,
  and a task waiting its turn on the loop gets it as soon as the last one commits, where a
  connection waiting in SQLite's busy handler polls with sleeps. Writers in other processes and
  threads are still waited for in SQLite's busy handler; either wait ends at ``busy_timeout``
  (``StoreUnavailable``). ``concurrency`` above 1 thus overlaps the handlers that run outside the
  delivery transaction (``transactional=False``), never two transactions.
- ``:memory:`` has no asyncio side: its database lives on the blocking store's one connection,
  which a thread of aiosqlite's cannot share.
- aiosqlite's threads are daemons, so a store that is never closed does not keep the process
  from exiting; ``SQLiteStore.close()`` (or ``await side.close()``) closes them.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

import aiosqlite
from aiosqlite import core as aiosqlite_core

from outboxkit.core.model import Claim, DeadKey, NewEvent, Outcome
from outboxkit.errors import ConfigurationError, StoreError, StoreUnavailable
from outboxkit.storekit.aiosql import AsyncSQLBatch, AsyncSQLStore
from outboxkit.storekit.sql import Row
from outboxkit.waiter import AsyncClosingWaiter

from .caller import writable
from .connections import StoreConnection, in_transaction
from .delivery import Batch, Delivery, batch_on, delivery_on

if TYPE_CHECKING:
    from .dialect import SQLiteDialect
    from .store import SQLiteStore

__all__ = ["AsyncSQLiteStore", "check_aiosqlite"]

T = TypeVar("T")

ITER_CHUNK_SIZE = 64
"""Rows a handler's cursor fetches per hop to the connection's thread (aiosqlite's default)."""


# -- aiosqlite's internals, all in one place ------------------------------------------------------
# aiosqlite's public methods run one statement per hop to the connection's thread. The store runs
# its blocking steps whole on that thread, through the call every one of those methods is built
# on (``_execute``), and needs three more things aiosqlite keeps to itself: the sqlite3
# connection (the app's, to check it; the store's, to run its code on), the thread (to make it a
# daemon), and a way to stop the thread that no future waits on (the loop may be gone by the time
# the thread gets to it). These are aiosqlite 0.22's; ``check_aiosqlite`` refuses a version
# without them, at the first ``async_store()``. The side's own connections are of a subclass of
# aiosqlite's (``_Connection``), which uses them as its own; of a connection the app opened
# (``enqueue``) only ``_connection``, ``_running`` and ``_execute`` are read, in ``_sqlite3_of``
# and ``_run`` alone.

_STOP = getattr(aiosqlite_core, "_STOP_RUNNING_SENTINEL", None)
_INTERNALS = ("_execute", "_connection", "_thread", "_tx", "_running")


def check_aiosqlite() -> None:
    """Check that the installed aiosqlite has what the asyncio side uses of it.

    Raises:
        ConfigurationError: it does not (naming the version found).
    """
    probe = aiosqlite.Connection(lambda: sqlite3.connect(":memory:"), ITER_CHUNK_SIZE)  # not run
    missing = [name for name in _INTERNALS if not hasattr(probe, name)]
    if missing or _STOP is None:
        raise ConfigurationError(
            f"the SQLite store's asyncio side needs aiosqlite 0.22; aiosqlite "
            f"{getattr(aiosqlite, '__version__', '?')} is installed, which lacks "
            f"{', '.join(missing or ['_STOP_RUNNING_SENTINEL'])}"
        )


def _sqlite3_of(conn: aiosqlite.Connection) -> sqlite3.Connection | None:
    """The sqlite3 connection under the app's ``conn``; None once closed (or before it was
    awaited). aiosqlite has no public way to reach it."""
    raw: sqlite3.Connection | None = conn._connection if conn._running else None
    return raw


async def _run(conn: aiosqlite.Connection, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the thread of the app's ``conn``, after whatever is queued there
    (aiosqlite's own way to run a call there: it has no public one)."""
    execute: Callable[..., Awaitable[T]] = conn._execute
    return await execute(fn, *args)


def _insert_checked(
    dialect: SQLiteDialect, raw: sqlite3.Connection, events: Sequence[NewEvent], created: int
) -> list[int]:
    """The blocking enqueue's check and insert, on the app connection's thread (the sqlite3
    connection aiosqlite opened checks it is used there)."""
    return dialect.insert(writable(raw, wrapped=False), events, created)


class _Connection(aiosqlite.Connection):
    """An aiosqlite connection on one of the store's own ``StoreConnection``s."""

    store_connection: StoreConnection

    def __init__(self, connect: Callable[[], StoreConnection]) -> None:
        super().__init__(connect, ITER_CHUNK_SIZE)
        self._thread.daemon = True  # see the module docstring

    async def start(self) -> _Connection:
        """Open it: the store's ``connect`` runs in the connection's thread.

        Raises:
            ConfigurationError, StoreError: as the blocking store's connections.
        """
        await self
        self.store_connection = cast(StoreConnection, self._connection)
        return self

    @property
    def running(self) -> bool:
        return bool(self._running)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the connection's thread, after whatever is queued there. Once a
        handler closed the connection (its thread is gone), here: the store's code then meets
        the closed sqlite3 connection as the blocking store's does (``HandlerCrashed``; nothing
        to roll back)."""
        if not self._running:
            return fn(*args)
        execute: Callable[..., Awaitable[T]] = self._execute
        return await execute(fn, *args)

    def submit(self, fn: Callable[[], object]) -> None:
        """Queue ``fn`` on the connection's thread without waiting for it."""
        self._tx.put_nowait((None, fn))

    def retire(self) -> None:
        """Close the connection and stop its thread once what is queued there has run; nobody
        waits."""
        self._running = False

        def stop() -> object:
            raw, self._connection = self._connection, None
            if raw is not None:
                raw.close()
            return _STOP

        self.submit(stop)


@asynccontextmanager
async def _entered(conn: _Connection, cm: AbstractContextManager[T]) -> AsyncIterator[T]:
    """``with cm`` for async code: one of the store's blocking context managers entered and left
    on ``conn``'s thread (a hop each), the block in between awaited here."""
    try:
        value = await conn.run(cm.__enter__)
    except Exception:
        raise  # raised by the context manager itself, which is over
    except BaseException as interrupted:
        # The wait was interrupted (cancelled): the thread enters all the same, so it leaves too,
        # right after; the pool drops the connection.
        conn.submit(partial(cm.__exit__, type(interrupted), interrupted, None))
        raise
    try:
        yield value
    except BaseException as exc:
        if not await conn.run(cm.__exit__, type(exc), exc, exc.__traceback__):
            raise
    else:
        await conn.run(cm.__exit__, None, None, None)


class _Pool:
    """The asyncio side's connections, one per write transaction at a time (with the writer
    lock, one per event loop in use), kept for reuse; any thread's loop may take one."""

    def __init__(self, connect: Callable[[], StoreConnection]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self.closed = False

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[_Connection]:
        with self._lock:
            if self.closed:
                raise StoreError("the SQLite store's asyncio side is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = await _Connection(self._connect).start()
        finished = False
        try:
            yield conn
            finished = True
        except Exception:
            finished = True  # the store's steps on the thread ran to their end
            raise
        finally:
            self._give_back(conn, finished)

    def _give_back(self, conn: _Connection, finished: bool) -> None:
        if not conn.running:  # closed by a misbehaving handler
            return
        # The thread is idle here (its last step was awaited), so the flag is read safely.
        usable = finished and not in_transaction(conn.store_connection)
        if usable and conn.store_connection.dirty:  # R18: queued before its next use
            conn.submit(conn.store_connection.reset_quietly)
        with self._lock:
            if usable and not self.closed:
                self._idle.append(conn)
                return
        conn.retire()

    def close(self) -> None:
        """Close the idle connections (those in use are closed as they come back)."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.retire()

    async def aclose(self) -> None:
        """``close``, waiting for each idle connection to close."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


class _AsyncDelivery:
    """``Delivery`` for async code: its writes run on the connection's thread (the record
    with the commit)."""

    __slots__ = ("_conn", "_tx")

    def __init__(self, conn: _Connection, tx: Delivery) -> None:
        self._conn = conn
        self._tx = tx

    async def open(self) -> None:
        """Nothing to do: the delivery's transaction (or savepoint) opened with it."""

    @property
    def connection(self) -> aiosqlite.Connection:
        """The aiosqlite connection inside the delivery transaction."""
        return self._conn

    async def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Follow-up events in the delivery transaction (``Delivery.enqueue``)."""
        return await self._conn.run(self._tx.enqueue, events)

    async def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """The delivery record, written as the delivery's block ends, in the hop that commits
        it (``Delivery.defer_record``).

        Raises:
            ConfigurationError: ``outcome`` is not one that is recorded.
        """
        self._tx.defer_record(handler, outcome, reason=reason)


class AsyncSQLiteBatch(AsyncSQLBatch):
    """``Batch`` for async code: its savepoints are the blocking batch's, entered and left on
    the batch's connection's thread; extensions and settlements are ``AsyncSQLBatch``'s."""

    conn: _Connection

    def __init__(self, side: AsyncSQLiteStore, conn: _Connection, batch: Batch) -> None:
        super().__init__(side, conn)
        self._batch = batch

    async def claimed(self, claims: Sequence[Claim]) -> None:
        """``BatchTransaction.claimed``: told to the blocking batch, whose first savepoint
        checks them all (``SQLBatch.lock``, on the connection's thread)."""
        self._batch.claimed(claims)

    @asynccontextmanager
    async def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AsyncIterator[_AsyncDelivery]:
        """A delivery in a savepoint of the batch (see ``SQLiteStore.batch``)."""
        async with _entered(self.conn, self._batch.savepoint(claim, now=now, keeper=self)) as tx:
            yield _AsyncDelivery(self.conn, tx)


class AsyncSQLiteStore(AsyncSQLStore):
    """The SQLite store's asyncio side: ``SQLiteStore.async_store()`` (see the module docstring).

    Name for name the blocking store's hot path: ``enqueue`` through the app's aiosqlite
    connection, ``claim``, ``delivery``, ``extend``, ``settle_many``, ``release``, ``batch``.
    """

    store: SQLiteStore

    def __init__(self, store: SQLiteStore) -> None:
        check_aiosqlite()
        super().__init__(store)
        self.dialect: SQLiteDialect = store.dialect
        self._pool = _Pool(store.dialect.connect)
        self._turns: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._turns_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AsyncSQLiteStore({self.dialect.where!r})"

    @property
    def closed(self) -> bool:
        """Whether ``close`` (or the store's) closed this side."""
        return self._pool.closed

    # -- the async connections (``AsyncSQLStore``) ------------------------------------------------

    @asynccontextmanager
    async def write(self, doing: str) -> AsyncIterator[_Connection]:
        dialect = self.dialect
        async with self._transaction(doing, lambda raw: dialect.write_on(raw, doing)) as (conn, _):
            yield conn

    async def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        on = cast(_Connection, conn)  # what ``write`` and the batch hand out
        return await on.run(self.dialect.rows, on.store_connection, name, params)

    @asynccontextmanager
    async def _transaction(
        self, doing: str, opens: Callable[[StoreConnection], AbstractContextManager[T]]
    ) -> AsyncIterator[tuple[_Connection, T]]:
        """``opens(connection)``, one of the store's transactions, entered on a connection of
        the pool's in this loop's turn."""
        async with (
            self._turn(doing),
            self._pool.acquire() as conn,
            _entered(conn, opens(conn.store_connection)) as opened,
        ):
            yield conn, opened

    @asynccontextmanager
    async def _turn(self, doing: str) -> AsyncIterator[None]:
        """This loop's one write transaction at a time (see the module docstring).

        Raises:
            StoreUnavailable: another one of this loop's held it for ``busy_timeout``.
        """
        lock = self._turn_lock(asyncio.get_running_loop())
        if lock.locked():
            timeout = self.dialect.busy_timeout
            try:
                async with asyncio.timeout(timeout):
                    await lock.acquire()
            except TimeoutError as exc:
                raise StoreUnavailable(
                    f"SQLite store {self.dialect.where}: cannot {doing}: another write "
                    f"transaction of this event loop held the database for {timeout}s "
                    "(busy_timeout)"
                ) from exc
        else:
            await lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def _turn_lock(self, loop: asyncio.AbstractEventLoop) -> asyncio.Lock:
        with self._turns_lock:
            lock = self._turns.get(loop)
            if lock is None:
                # A new loop (each asyncio.run() makes one): forget those that are closed.
                for closed in [other for other in self._turns if other.is_closed()]:
                    del self._turns[closed]
                lock = self._turns[loop] = asyncio.Lock()
            return lock

    # -- AsyncStore ---------------------------------------------------------------------------------

    async def enqueue(
        self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """Insert ``events`` through the app's aiosqlite connection, in its open transaction (R1).

        The same refusals as the blocking ``enqueue``, applied to the sqlite3 connection under
        ``conn``. Never begins, commits or rolls back: with Python's default (legacy) transaction
        handling the driver opens the app's transaction before the INSERT; with
        ``isolation_level=None`` a ``BEGIN`` must be open.

        Returns:
            The new ids, in the order of ``events``.

        Raises:
            ConfigurationError: ``conn`` is not an aiosqlite connection, it is closed, or it is
                in autocommit mode with no open transaction (nothing is written).
            SchemaError: the connection's database has no outboxkit tables.
            StoreError: SQLite failed (the app's transaction is left to the app).
        """
        if not isinstance(conn, aiosqlite.Connection):
            raise ConfigurationError(
                "the SQLite store's asyncio side enqueues through an aiosqlite.Connection in "
                f"the app's open transaction, got {conn!r:.80}"
            )
        raw = _sqlite3_of(conn)
        if raw is None:
            raise ConfigurationError(
                "enqueue got a closed aiosqlite connection (or one not yet opened: await "
                "aiosqlite.connect(...) first)"
            )
        dialect = self.dialect
        return await _run(conn, _insert_checked, dialect, raw, events, dialect.instant(now))

    async def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        """R3: ``SQLiteStore.claim`` on the side's connection.

        Raises:
            SchemaError: the schema is older (opened with ``migrate=False``), as there.
            StoreUnavailable: the write lock stayed taken for ``busy_timeout``.
            StoreError: SQLite failed, or the side is closed.
        """
        self.dialect.check_schema()
        return await super().claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    @asynccontextmanager
    async def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AsyncIterator[_AsyncDelivery]:
        """``SQLiteStore.delivery`` for async code: ``tx.connection`` is the aiosqlite
        connection inside the delivery transaction; ``await tx.enqueue(...)``,
        ``await tx.record(...)``.

        Raises:
            LeaseLostError: the token is stale (nothing runs, nothing is written).
            HandlerCrashed: the handler ended or closed the transaction it was given.
            StoreUnavailable: the database failed under the handler.
            StoreError: SQLite failed.
        """
        dialect = self.dialect
        async with self._transaction(
            f"open a delivery transaction for event {claim.event.id}",
            lambda raw: delivery_on(dialect, raw, claim, now),
        ) as (conn, tx):
            yield _AsyncDelivery(conn, tx)

    @asynccontextmanager
    async def batch(self, *, now: datetime | None) -> AsyncIterator[AsyncSQLiteBatch]:
        """``SQLiteStore.batch`` for async code: one ``BEGIN IMMEDIATE`` transaction, a
        savepoint per delivery, committed once; this loop's other write transactions wait
        for it.

        Raises:
            StoreUnavailable: the write lock stayed taken for ``busy_timeout``.
            StoreError: SQLite failed, or a handler ended the batch's transaction.
        """
        store = self.store
        async with self._transaction(
            "open a batch transaction", lambda raw: batch_on(store, raw)
        ) as (conn, batch):
            yield AsyncSQLiteBatch(self, conn, batch)

    def make_waiter(self) -> AsyncClosingWaiter | None:
        """None: SQLite has no notifications; pollers poll (and an enqueue in the same process
        wakes them directly)."""
        return None

    async def close(self) -> None:
        """Close the side's connections (``SQLiteStore.close()`` does it too); the next
        ``store.async_store()`` makes a new side."""
        await self._pool.aclose()

    def close_now(self) -> None:
        """``close`` for blocking code: each connection closes in its own thread."""
        self._pool.close()
