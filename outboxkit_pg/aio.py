"""The PostgreSQL store's asyncio side (``PostgresStore.async_store()``): what the asyncio
poller and ``Outbox.enqueue_async`` need, name for name with the blocking store.

It runs the blocking store's statements (``queries.sql``, rendered once by its dialect), built
and read by the store's own ``Statements`` (``SQLStore``'s hot path through ``AsyncSQLStore``;
enqueue through ``PostgresDialect.insert_query``), with the dialect's error mapping
(``errors``). A delivery is the same ``flow.Flow`` as the blocking one (its two pipeline syncs,
the commit guard, which error a failure is), driven by an async shell. Only the waiting is its
own:

- connections come from ``pool.AsyncPool``, a ``psycopg_pool.AsyncConnectionPool`` of its own
  (the store's sizes), opened on first use on the running event loop and closed by
  ``close()`` or by the store's ``close()``; a per-event round (``rounds``, ``AsyncRound``)
  holds its deliveries' connections from one delivery to the next;
- a transactional handler's ``ctx.connection`` is the delivery's ``psycopg.AsyncConnection``;
- ``make_waiter()`` listens with psycopg's async notifications (``listen.AsyncNotifyWaiter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.pq import PipelineStatus
from psycopg.rows import tuple_row

from outboxkit.core.model import Claim, NewEvent, Outcome
from outboxkit.errors import LeaseLostError, StoreError, StoreUnavailable
from outboxkit.storekit import AsyncDeliveriesBase, SettleItem
from outboxkit.storekit.aiosql import AsyncSQLBatch, AsyncSQLStore
from outboxkit.storekit.rows import inserted_ids, resolve_ids
from outboxkit.storekit.sql import Row

from .flow import BatchGuard, Flow, Result, Statement, Transaction, check_usable, has_rows
from .listen import AsyncNotifyWaiter
from .names import prepared
from .pipeline import PREPARED_STALE, Flight, RecordPipeline, flight_result, implicit_begin
from .pool import AsyncConnection, AsyncPool

if TYPE_CHECKING:
    from .store import PostgresStore

__all__ = ["AsyncBatch", "AsyncDelivery", "AsyncPostgresStore", "AsyncRound"]

log = logging.getLogger("outboxkit")

_T = TypeVar("_T")


class AsyncPostgresStore(AsyncSQLStore):
    """The asyncio side of ``store`` (an ``AsyncStore``); get it with ``store.async_store()``.

    Every method is the async twin of the store's own: the same statements, the same
    refusals, the same errors (``outboxkit.errors``, never a driver's). One event loop at a
    time uses it; ``close()`` (on that loop) releases its connections, and the next use opens
    them again, on whichever loop it runs.
    """

    store: PostgresStore

    def __init__(self, store: PostgresStore) -> None:
        super().__init__(store)
        self.dialect = store.dialect
        """The blocking store's dialect: its statements, checks and error mapping."""
        self._pool = AsyncPool(store.dialect.pool)
        self._waiters: weakref.WeakSet[AsyncNotifyWaiter] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"AsyncPostgresStore({self.dialect.where}, schema={self.dialect.names.schema!r})"

    # -- the async seam (outboxkit.storekit.aiosql.AsyncSQLStore) ------------------------------------

    @asynccontextmanager
    async def write(self, doing: str) -> AsyncIterator[AsyncConnection]:
        # As the blocking store's: every write is one statement, atomic by itself.
        with self.dialect.mapped(doing):
            async with self._connection(doing) as conn:
                yield conn

    async def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        dialect = self.dialect
        async with conn.cursor(row_factory=tuple_row) as cur:
            # No parameters: none at all, so a % in the statement (a function body) is kept.
            await cur.execute(
                dialect.queries[name], dialect.params(params) or None, prepare=prepared(conn, name)
            )
            rows: list[Row] = await cur.fetchall() if has_rows(cur) else []
            return rows

    # -- connections ------------------------------------------------------------------------------

    @asynccontextmanager
    async def _connection(self, doing: str) -> AsyncIterator[AsyncConnection]:
        """A pooled async connection; on the store's first use, the schema's version is
        checked (once for both sides).

        Raises:
            StoreUnavailable: no connection could be had (the message says why).
            SchemaError: no schema, or one of another version.
        """
        async with self._pool.connection(doing) as conn:
            if not self.dialect.schema_checked:
                await self._check_schema(conn)
            yield conn

    async def _check_schema(self, conn: AsyncConnection) -> None:
        try:
            rows = await self.rows(conn, "schema_version", {})
        except psycopg.Error as exc:
            raise self.dialect.schema_error(exc) from exc
        self.dialect.schema_found(rows)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """``PostgresStore.transaction`` on the asyncio side: a pooled ``AsyncConnection`` in an
        open transaction, committed when the block ends, rolled back if it raises. For apps
        without an async connection of their own.

        Raises:
            StoreUnavailable / StoreError: the database failed to begin or commit.
        """
        async with self._open_transaction("a transaction") as conn:
            yield conn

    @asynccontextmanager
    async def _open_transaction(self, what: str) -> AsyncIterator[AsyncConnection]:
        """As the blocking store's: begin and commit mapped, naming ``what``; an error of the
        block is re-raised as it is, after the rollback (which never masks it)."""
        mapped = self.dialect.mapped
        async with self._connection(f"open {what}") as conn:
            tx = psycopg.AsyncTransaction(conn)
            with mapped(f"begin {what}", conn):
                await tx.__aenter__()
            try:
                yield conn
            except BaseException as exc:
                if not await tx.__aexit__(type(exc), exc, exc.__traceback__):
                    raise
                return
            with mapped(f"commit {what}", conn):
                await tx.__aexit__(None, None, None)

    # -- enqueue ----------------------------------------------------------------------------------

    async def enqueue(
        self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """Insert ``events`` through the app's ``psycopg.AsyncConnection``, in its transaction
        (``PostgresStore.enqueue`` for async code). Never begins (psycopg does, on a
        connection without autocommit), commits or rolls back. The ``NOTIFY`` is delivered
        when the app commits.

        Args:
            conn: the app's ``psycopg.AsyncConnection``, in its open transaction.
            events: the checked events (``Outbox.enqueue_async`` builds them).
            now: the instant to bind, or None for the database's clock.

        Returns:
            The new ids, in ``events`` order.

        Raises:
            ConfigurationError: not a ``psycopg.AsyncConnection``, closed, or in autocommit
                mode outside a transaction block; nothing was written, the transaction is
                usable.
            StoreError: the INSERT failed.
        """
        if not events:
            return []
        dialect = self.dialect
        dialect.check_app_connection(conn, psycopg.AsyncConnection)
        with dialect.mapped(f"enqueue {len(events)} event(s)"):
            if not dialect.schema_checked:
                await self._check_schema(conn)
            return await self.insert(conn, events, now)

    async def insert(
        self, conn: AsyncConnection, events: Sequence[NewEvent], now: datetime | None
    ) -> list[int]:
        """``PostgresDialect.insert`` on an async connection: insert ``events`` in the
        transaction open on ``conn``; the new ids, in ``events`` order."""
        name, params = self.dialect.insert_query(events, now)
        rows = await self.rows(conn, name, params)
        if name == "enqueue_one":
            return self.dialect.inserted(name, rows)
        ids, missing = inserted_ids(events, rows)
        found: dict[str, int] = {}
        if missing:
            rows = await self.rows(conn, "dedupe_holders", {"keys": missing})
            found = {key: event_id for key, event_id in rows}
        return resolve_ids(events, ids, found)

    # -- the hot path -----------------------------------------------------------------------------

    @asynccontextmanager
    async def delivery(self, claim: Claim, *, now: datetime | None) -> AsyncIterator[AsyncDelivery]:
        """``PostgresStore.delivery`` for async code: a delivery transaction on a pooled async
        connection, made ready by ``tx.open()`` and opened (the event row locked, the token
        checked) when ``tx.connection`` is first taken (``AsyncDelivery``); a block that never
        opens it ends with its record in one fenced statement.
        ``tx.connection`` is then that ``AsyncConnection`` in the open transaction: the handler
        reads and writes through it, but must not commit, roll back or close it.

        Raises:
            LeaseLostError: the token is stale (nothing is written).
            HandlerCrashed: the handler ended, broke or closed the transaction it was given.
            StoreUnavailable / StoreError: the database failed (never blamed on the handler).
        """
        async with (
            self._connection(f"deliver event {claim.event.id}") as conn,
            delivering(self, conn, claim, now) as tx,
        ):
            yield tx

    @asynccontextmanager
    async def rounds(self, *, concurrency: int = 1) -> AsyncIterator[AsyncRound]:
        """The deliveries of one per-event round (``PostgresStore.rounds`` for async code):
        each delivery a transaction of its own, as ``delivery``'s, on a connection the round
        holds from one delivery to the next (``AsyncRound``): as many as the blocking round
        (``PostgresStore.round_connections``)."""
        round_ = AsyncRound(self, self.store.round_connections(concurrency), self._connection)
        try:
            yield round_
        except BaseException:
            await round_.close(failed=True)
            raise
        await round_.close()

    @asynccontextmanager
    async def batch(self, *, now: datetime | None) -> AsyncIterator[AsyncBatch]:
        """``PostgresStore.batch`` for async code: one transaction for a claimed batch on a
        pooled async connection, a savepoint per delivery, one commit at the end; begun lazily
        (``BatchGuard.begun``), as the blocking store's."""
        async with self._connection("open the batch") as conn:
            batch = AsyncBatch(self, conn)
            batch.begun = False
            try:
                yield batch
                await batch.write_kept()
                if batch.begun:
                    check_usable(conn, self.dialect.where, "the batch")
                    await batch.commit()
            except BaseException:
                await batch.abort()
                raise

    # -- wake-ups and the end ---------------------------------------------------------------------

    def make_waiter(self) -> AsyncNotifyWaiter | None:
        """An async waiter that also returns when an enqueue commits anywhere (``LISTEN``), or
        None when notifications are off. It connects on its first ``wait``; the poller that
        asked closes it (so do ``close()`` and the store's ``close()``)."""
        if not self.store.capabilities.waiter:
            return None
        waiter = AsyncNotifyWaiter(**self.dialect.listening(asyncio=True))
        self._waiters.add(waiter)
        return waiter

    async def close(self) -> None:
        """Release the async connections and listeners (on the loop they belong to); the
        next use opens them again, unless the store is closed."""
        for waiter in list(self._waiters):
            await waiter.close()
        await self._pool.close()

    def close_blocking(self) -> None:
        """``close`` from blocking code (the store's ``close()``), wherever the event loop is:
        awaited there when it runs in another thread, scheduled on it when this is blocking
        code inside it, the sockets closed at once when it has ended."""
        for waiter in list(self._waiters):
            waiter.close_blocking()
        self._pool.close_blocking()


class AsyncDelivery(Transaction[AsyncConnection]):
    """One async delivery transaction (see ``AsyncPostgresStore.delivery``), or a savepoint of
    a batch's. It opens lazily, as the blocking one does when the handler takes the connection:
    ``open`` only makes it ready for the handler (it takes the connection's psycopg lock), and
    the first time the handler takes ``connection`` a task sends the opening sync (the
    transaction or savepoint, the row lock, the token check) and then lets the lock go, so that
    every statement the handler sends on the connection waits for it, and runs in the open
    transaction. A handler that never takes the connection costs no transaction: the delivery
    ends as its fenced record alone (or, in a batch, kept for the batch's settlement).

    If that opening fails, the handler's statements are made to fail before the lock is let
    go, so that none runs outside the delivery: a stale token leaves the transaction (or the
    batch's savepoint) it opened failed on purpose, rolled back at the delivery's end (a batch
    goes on); any other failure that leaves no failed transaction closes the connection. The
    delivery then fails with what the opening raised (``Flow.open_error``: lease-lost for a
    stale token), whatever the handler made of its own statement's error. On a connection
    psycopg would begin a transaction on itself (``implicit_begin``; not the asyncio side's
    own, which are in autocommit), ``open`` opens at once instead.
    """

    def __init__(
        self, side: AsyncPostgresStore, flow: Flow[AsyncConnection], held: _Held | None = None
    ) -> None:
        super().__init__(flow)
        self._side = side
        self._held = held  # a round's connection, with the records pipelined on it
        self._armed = False  # the connection's lock taken by ``open``, the opening not sent
        self._opening: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Make the delivery ready for the handler (idempotent): the transaction opens when
        the handler first takes ``connection`` (see the class), or at once on a connection
        psycopg begins transactions on.

        Raises:
            LeaseLostError: (opening at once) the token is stale (the transaction is not opened).
            StoreError: (opening at once) the database failed opening it.
        """
        flow = self._flow
        if flow.is_open or self._armed or self._opening is not None:
            return
        if implicit_begin(flow.conn):
            await self.open_now()
            return
        await flow.conn.lock.acquire()
        self._armed = True

    async def open_now(self) -> None:
        """Open the delivery transaction now, if it is not yet (the lazy opening awaited, or
        begun if the handler has not taken the connection).

        Raises:
            LeaseLostError: the token is stale (the transaction is not opened).
            StoreError: the database failed opening it.
        """
        flow = self._flow
        if self._armed and self._opening is None:
            self._start_opening()
        if self._opening is not None:
            await self._opening
            if flow.open_error is not None:
                raise flow.open_error
            return
        if flow.is_open:
            return
        try:
            await self._opened(locked=False)
        except BaseException as exc:
            error = flow.open_failed(exc)
            if error is exc:
                raise
            raise error from exc

    async def settled(self) -> None:
        """The delivery's block has ended: the lazy opening, if the handler began it, is
        awaited (what it raised is kept in ``Flow.open_error``), and the connection's lock, if
        the handler never took the connection, let go."""
        if self._opening is not None:
            await self._opening
        elif self._armed:
            self._armed = False
            self._flow.conn.lock.release()

    async def _opened(self, *, locked: bool) -> None:
        """Send the opening sync and read it back (``Flow.opened``); ``locked``: the
        connection's lock is held already (the lazy opening)."""
        flow = self._flow
        if self._held is not None:
            await self._held.drain()  # the round's records on it, read back first
        try:
            results = await _sync(flow.conn, flow.opening(), locked=locked)
        except PREPARED_STALE:  # see ``Flow.reopening``
            if not await abort_quietly(flow.conn, flow.reopening(), locked=locked):
                raise
            results = await _sync(flow.conn, flow.opening(), locked=locked)
        flow.opened(results)

    def _start_opening(self) -> None:
        """The lazy opening's task (the handler takes the connection in the loop's thread: a
        transactional handler is an ``async def`` one)."""
        self._opening = asyncio.get_running_loop().create_task(self._open_lazily())

    async def _open_lazily(self) -> None:
        """The lazy opening, under the lock ``open`` took; let go at its end. A failure is
        kept (``Flow.open_error``), and before the lock is let go the handler's statements
        are made to fail, so that none runs outside the delivery: a stale token leaves the
        transaction (or savepoint) it opened failed on purpose (``_STALE``), rolled back when
        the delivery ends; any other failure closes the connection."""
        flow = self._flow
        conn = flow.conn
        try:
            await self._opened(locked=True)
        except BaseException as exc:
            error = flow.open_failed(exc)
            if isinstance(error, LeaseLostError) and not (conn.closed or conn.broken):
                with contextlib.suppress(psycopg.Error):  # what it is sent for
                    await _fly(conn, [Statement(_STALE)], locked=True)
            if conn.closed or conn.info.transaction_status != _INERROR:
                await conn.close()
            else:
                flow.failed_open = True
            if not isinstance(exc, Exception):
                raise
        finally:
            self._armed = False
            conn.lock.release()

    @property
    def connection(self) -> AsyncConnection:
        """The connection of the delivery transaction: taking it begins the lazy opening.

        Raises:
            StoreError: ``open`` was not awaited first.
        """
        flow = self._flow
        if self._armed:
            if self._opening is None:
                self._start_opening()
        elif not flow.is_open and self._opening is None:
            raise StoreError(
                f"{flow.what}: the delivery transaction is not open yet; await open() first"
            )
        return flow.conn

    async def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Enqueue follow-up events inside this transaction (opened first if need be)."""
        if not events:
            return []
        await self.open_now()
        flow = self._flow
        with flow.dialect.mapped(self._following(events), flow.conn):
            return await self._side.insert(flow.conn, events, flow.now)

    async def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """Queue the record; it is written with the commit, in the same sync (or, for a
        delivery never opened, alone in one fenced statement)."""
        self._flow.record(handler, outcome, reason)


class _Held:
    """A pooled connection an ``AsyncRound`` holds, with the pool's lease of it and the fenced
    records sent on it without waiting (``pipeline.RecordPipeline``), not read back yet."""

    __slots__ = ("conn", "failed", "lease", "pipeline", "where")

    def __init__(
        self,
        lease: AbstractAsyncContextManager[AsyncConnection],
        conn: AsyncConnection,
        where: str,
    ) -> None:
        self.lease = lease
        self.conn = conn
        self.where = where
        self.pipeline: RecordPipeline | None = None
        self.failed: StoreError | None = None  # a record or the connection failed: the round ends

    @property
    def pipelined(self) -> bool:
        """Whether the connection is in pipeline mode (records in flight, or read and not
        finished): psycopg may not use it until ``drain``."""
        return self.pipeline is not None and self.conn.pgconn.pipeline_status != _PIPELINE_OFF

    def send(self, side: AsyncPostgresStore, claim: Claim, record: Mapping[str, Any]) -> bool:
        """Send ``claim``'s fenced record without waiting for it; False when the connection
        cannot pipeline (no prepared statements: PgBouncer in transaction mode).

        Raises:
            StoreError: the connection failed taking it (the round ends).
        """
        if self.pipeline is None:
            if not RecordPipeline.usable(self.conn):
                return False
            self.pipeline = RecordPipeline(side.dialect, self.conn)
        try:
            self.pipeline.send(claim, record)
        except StoreError as exc:
            self.failed = exc
            raise
        return True

    async def drain(self) -> None:
        """Read every record pending on the connection back, and leave pipeline mode.

        Raises:
            StoreError: a record failed, or the connection did (the round ends).
        """
        if self.failed is not None:
            raise self.failed
        pipeline = self.pipeline
        if pipeline is None:
            return
        try:
            while pipeline.pending:
                if pipeline.wants_write():
                    await _ready(pipeline.socket(), write=True)
                elif pipeline.pgconn.is_busy():
                    await _ready(pipeline.socket())
                    pipeline.readable()
                else:
                    pipeline.take_results()
            pipeline.finish()
        except StoreError as exc:
            self.failed = exc
            raise
        except BaseException:  # cancelled while reading: what was answered is unknown
            self.failed = StoreUnavailable(
                f"PostgreSQL at {self.where}: the round stopped with delivery records unread; "
                "their events recover by their leases"
            )
            raise


class _RoundDelivery(AbstractAsyncContextManager[AsyncDelivery]):
    """``AsyncRound.delivery``: a connection of the round's taken for the block (``take``),
    given back whatever happens (``give``), and on it a delivery (``delivering``). A class, as
    ``delivering`` is."""

    __slots__ = ("_claim", "_give", "_held", "_inner", "_now", "_side", "_take")

    def __init__(
        self,
        side: AsyncPostgresStore,
        take: Callable[[str], Awaitable[_Held]],
        give: Callable[[_Held], Awaitable[None]],
        claim: Claim,
        now: datetime | None,
    ) -> None:
        self._side = side
        self._take = take
        self._give = give
        self._claim = claim
        self._now = now

    async def __aenter__(self) -> AsyncDelivery:
        claim = self._claim
        self._held = held = await self._take(f"deliver event {claim.event.id}")
        try:
            self._inner = inner = delivering(self._side, held.conn, claim, self._now, held=held)
            return await inner.__aenter__()
        except BaseException:
            await self._give(held)
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            return await self._inner.__aexit__(exc_type, exc, tb)
        finally:
            await self._give(self._held)


class AsyncRound(AsyncDeliveriesBase):
    """The deliveries of one per-event round on the asyncio side (``AsyncPostgresStore.rounds``):
    the blocking ``delivery.Round``'s rules, on connections several deliveries use at once.

    Each delivery is a transaction of its own, exactly as ``AsyncPostgresStore.delivery``'s (the
    same ``delivering``), on a pooled connection the round holds from one delivery to the next
    instead of taking one from the pool and handing it back each time (the pool's hand-over
    and return cost more than a delivery whose handler never takes the connection). Such a
    delivery sends its fenced record without waiting for it (``pipeline.RecordPipeline``, on
    the connection it had); the records are read back before the connection serves anything
    else (a delivery that opens its transaction, a lease extension), before the round settles
    (every connection's) and when it ends. A record the token refused wrote nothing, and its
    event's settlement, fenced by the same token, is refused too (the lost lease is reported
    then); a record or a connection that failed ends the round: every later step raises it,
    and nothing more is settled (the events recover by their leases).

    It holds at most ``size`` connections: a delivery (an extension, a settlement) takes the one
    idle longest, unless that one has records in flight and the round holds fewer (then a new
    one from the pool: the records commit on several connections at once, and one WAL flush
    serves the commits that wait for it together); with none idle, it waits for one to come
    back. Nothing that waits holds a connection, so the waits always end. A connection left
    unusable (closed, still in a transaction, or failed) goes back to the pool at once, which
    discards it or rolls it back, and frees its place; the others go back when the round ends.
    """

    def __init__(
        self,
        side: AsyncPostgresStore,
        size: int,
        connect: Callable[[str], AbstractAsyncContextManager[AsyncConnection]],
    ) -> None:
        self._side = side
        self._size = size
        self._connect = connect  # the side's pooled connections (``doing`` names the use)
        self._held = 0  # connections taken from the pool: idle, or in use
        self._idle: deque[_Held] = deque()  # the one idle longest first
        self._waiting: deque[asyncio.Future[_Held | None]] = deque()
        self._lost: StoreError | None = None

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractAsyncContextManager[AsyncDelivery]:
        """``AsyncPostgresStore.delivery`` on a connection of the round's; a delivery never
        opened sends its record pipelined."""
        return _RoundDelivery(self._side, self._take, self._done_with, claim, now)

    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        side = self._side
        return await self._on_one(
            f"extend {len(claims)} lease(s)", lambda conn: side.extend_on(conn, claims, lease, now)
        )

    async def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``AsyncPostgresStore.settle_many`` after every record the round pipelined is read
        back: a refused record's event is refused here too (the same token)."""
        await self._drain_idle()
        if not items:
            return []
        side = self._side
        return await self._on_one(
            f"settle {len(items)} event(s)", lambda conn: side.settle_many_on(conn, items, now)
        )

    async def _on_one(self, doing: str, work: Callable[[AsyncConnection], Awaitable[_T]]) -> _T:
        """``work`` on one of the round's connections, its records read back first."""
        held = await self._take(doing)
        try:
            await held.drain()
            with self._side.dialect.mapped(doing, held.conn):
                return await work(held.conn)
        finally:
            await self._done_with(held)

    @property
    def waiting(self) -> int:
        """How many deliveries (extensions, settlements) wait for one of the round's
        connections now."""
        return sum(not waiter.done() for waiter in self._waiting)

    async def close(self, *, failed: bool = False) -> None:
        """End the round: read back what is pending (unless the round failed), and hand the
        idle connections back to the pool (at the round's end, none is in use).

        Raises:
            StoreError: a record failed, or a connection was lost with records unread.
        """
        try:
            if not failed:
                await self._drain_idle()
        finally:
            while self._idle:
                held = self._idle.popleft()
                if held.pipelined or held.failed is not None:
                    await self._discard(held)
                else:
                    await self._give_back(held, usable=True)

    async def _drain_idle(self) -> None:
        """Read back the records pending on every idle connection.

        Raises:
            StoreError: one failed (the round ends: raised by every later step).
        """
        if self._lost is not None:
            raise self._lost
        for held in list(self._idle):
            try:
                await held.drain()
            except StoreError as exc:
                self._lost = exc
                self._idle.remove(held)
                await self._discard(held)
                raise

    async def _take(self, doing: str) -> _Held:
        """The connection of the round's idle longest, unless it has records in flight and the
        round holds fewer than ``size`` (then a new one from the pool); else the next one
        given back.

        Raises:
            StoreError: the round failed earlier (a record, or a connection with records).
            StoreUnavailable: the pool had none to give (the message says why).
        """
        if self._lost is not None:
            raise self._lost
        idle = self._idle
        # The one idle longest, unless it has records in flight and the round may take a new
        # connection: then the records commit on several at once (one WAL flush serves the
        # commits that wait for it together).
        if idle and (self._held >= self._size or not idle[0].pipelined):
            return idle.popleft()
        if self._held >= self._size:
            waiter: asyncio.Future[_Held | None] = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                given = await waiter
            except BaseException:  # cancelled: what it was given goes to the next one
                if waiter.done() and not waiter.cancelled():
                    self._hand_on(waiter.result())
                raise
            if given is not None:
                return given
            # None: a place freed (a connection went back to the pool): take a new one.
            if self._lost is not None:
                self._hand_on(None)
                raise self._lost
        lease = self._connect(doing)
        self._held += 1
        try:
            conn = await lease.__aenter__()
        except BaseException:
            self._held -= 1
            self._hand_on(None)
            raise
        return _Held(lease, conn, self._side.dialect.where)

    def _hand_on(self, given: _Held | None) -> None:
        """Give a waiter a connection (or, None, a place to take a new one in); with none
        waiting, the connection is idle (the place stays free)."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(given)
                return
        if given is not None:
            self._idle.append(given)

    async def _done_with(self, held: _Held) -> None:
        """``held`` back from a delivery (an extension, a settlement): to the next user, or,
        left unusable, to the pool."""
        conn = held.conn
        if held.failed is not None:
            if self._lost is None:
                self._lost = held.failed
            await self._discard(held)
        elif conn.closed or conn.broken:
            await self._discard(held)
        elif held.pipelined:
            self._hand_on(held)  # its records are read back by its next user
        elif conn.pgconn.transaction_status != _IDLE:
            await self._discard(held)
        else:
            self._hand_on(held)

    async def _discard(self, held: _Held) -> None:
        """Hand an unusable connection back to the pool, and free its place. One with records
        unread is closed first (it can neither be read back nor reused), and ends the round."""
        conn = held.conn
        if held.pipeline is not None and held.pipeline.pending and self._lost is None:
            self._lost = StoreUnavailable(
                f"PostgreSQL at {held.where}: the connection was lost with delivery records "
                "unanswered; their events recover by their leases"
            )
        if held.pipelined and not conn.closed:
            await conn.close()
        await self._give_back(held, usable=False)
        self._hand_on(None)

    async def _give_back(self, held: _Held, *, usable: bool) -> None:
        self._held -= 1
        if usable:
            await held.lease.__aexit__(None, None, None)
        else:  # the pool rolls it back, or discards it closed
            await held.lease.__aexit__(_Unusable, _Unusable(), None)


class _Unusable(Exception):
    """Handed to the pool's lease for a connection a delivery left unusable: the pool rolls it
    back, or discards it closed, instead of keeping it as it is."""


_IDLE = psycopg.pq.TransactionStatus.IDLE
_INERROR = psycopg.pq.TransactionStatus.INERROR

_STALE = (
    b"DO $$ BEGIN RAISE EXCEPTION 'outboxkit: this delivery''s claim token is stale' "
    b"USING HINT = 'Another poller holds the event now; nothing of this delivery commits.'; "
    b"END $$"
)
"""Sent by a lazy opening that found the token stale, after the handler took the connection:
the transaction (or savepoint) fails, so that every statement the handler sends in it fails
too, until the delivery's end rolls it back (``Flow.failed_open``)."""


class AsyncBatch(BatchGuard, AsyncSQLBatch):
    """One transaction for a claimed batch (see ``AsyncPostgresStore.batch``)."""

    side: AsyncPostgresStore
    conn: AsyncConnection

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractAsyncContextManager[AsyncDelivery]:
        self._check_for_delivery()
        return delivering(self.side, self.conn, claim, now, self)

    async def begin(self) -> None:
        """``Batch.begin`` on the async connection."""
        if not self.begun:
            with self.side.dialect.mapped("begin the batch", self.conn):
                await _sync(self.conn, self.beginning())
            self.began()

    async def commit(self) -> None:
        """``Batch.commit`` on the async connection."""
        with self.side.dialect.mapped("commit the batch", self.conn):
            await self.conn.execute(b"COMMIT")
        self.ended()

    async def abort(self) -> None:
        """``Batch.abort`` on the async connection."""
        if self.begun and not (await abort_quietly(self.conn, (b"ROLLBACK",)) and self.ended()):
            await self.conn.close()

    def _where(self) -> str:
        return self.side.dialect.where


def delivering(
    side: AsyncPostgresStore,
    conn: AsyncConnection,
    claim: Claim,
    now: datetime | None,
    batch: AsyncBatch | None = None,
    held: _Held | None = None,
) -> AbstractAsyncContextManager[AsyncDelivery]:
    """``delivery.delivering`` on an async connection (the same ``Flow``): it opens when
    ``tx.connection`` is taken after ``tx.open()``, or at its end when what it queued needs the
    transaction; one that never opens is its fenced record alone or, in a batch, kept for the
    batch's settlement.

    Raises:
        LeaseLostError: the token is stale (nothing is written).
        HandlerCrashed: the handler ended, broke or closed the transaction it was given.
        StoreUnavailable: the server ended the session under the handler.
        StoreError: the database failed (never blamed on the handler).
    """
    return _Delivering(side, conn, claim, now, batch, held)


class _Delivering(AbstractAsyncContextManager[AsyncDelivery]):
    """``delivering``: a class, not an async generator (one per delivery: an
    ``asynccontextmanager`` costs each a generator, its first-iteration hook and its
    finalizer's registration)."""

    __slots__ = ("_batch", "_claim", "_conn", "_flow", "_held", "_side", "_tx")

    def __init__(
        self,
        side: AsyncPostgresStore,
        conn: AsyncConnection,
        claim: Claim,
        now: datetime | None,
        batch: AsyncBatch | None,
        held: _Held | None,
    ) -> None:
        self._side = side
        self._conn = conn
        self._claim = claim
        self._batch = batch
        self._held = held
        self._flow = flow = Flow(side.dialect, conn, claim, now, batch)
        self._tx = AsyncDelivery(side, flow, held)

    async def __aenter__(self) -> AsyncDelivery:
        return self._tx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        await self._tx.settled()
        if exc is None:
            try:
                await self._end()
            except BaseException as failure:
                error = await self._failed(failure)
                if error is None:
                    raise
                raise error from failure
            return False
        error = await self._failed(exc)
        if error is None:
            return False  # the block's own exception goes on
        raise error from exc

    async def _end(self) -> None:
        """The block ended well: open if what it queued needs it, then the record (kept by
        the batch, pipelined on the round's connection, or with the commit)."""
        flow, claim, batch, held = self._flow, self._claim, self._batch, self._held
        if flow.open_error is not None:
            raise flow.open_error  # the handler swallowed it: the delivery fails all the same
        if flow.must_open():
            await self._tx.open_now()
        if batch is not None and not flow.is_open:
            batch.keep(claim, flow.records[0])  # written, fenced, with the batch's settlement
        elif held is None or flow.is_open or not held.send(self._side, claim, flow.records[0]):
            # (On a round's connection: an open delivery read the records back as it opened;
            # one that cannot pipeline has none.)
            flow.closed(await close(flow, self._conn))

    async def _failed(self, exc: BaseException) -> BaseException | None:
        """What to raise instead of ``exc`` (None: ``exc`` itself), once the delivery is rolled
        back (the batch restarted, or the session reset: a connection that cannot be is
        closed)."""
        flow, conn, batch = self._flow, self._conn, self._batch
        error = flow.error_for(exc)
        if self._held is not None and not flow.is_open and not flow.failed_open:
            # A round's delivery never opened: it wrote nothing, there is nothing to undo (and
            # the connection may have records in flight).
            return None if error is exc else error
        aborted = await abort_quietly(conn, flow.aborting())
        if batch is not None:
            if flow.lost_batch(aborted):
                error = await restart(batch, conn, error)
        else:
            resets = flow.resetting()
            if resets is None or not await abort_quietly(conn, resets):
                await conn.close()  # left in a transaction, or as the handler set it: discarded
        return None if error is exc else error


async def restart(
    batch: AsyncBatch, conn: AsyncConnection, failure: BaseException
) -> BaseException:
    """``delivery.restart`` on the async connection.

    Raises:
        StoreError: the connection could not be set right (the batch is abandoned).
    """
    if not await abort_quietly(conn, batch.restarting()):
        raise batch.unusable() from failure
    resets, error = batch.restarted(failure)
    if not await abort_quietly(conn, resets):
        raise batch.unusable() from failure
    return error


async def close(flow: Flow[AsyncConnection], conn: AsyncConnection) -> list[Result]:
    """``delivery.close`` on the asyncio side."""
    statements = flow.closing()
    try:
        return await _sync(conn, statements)
    except PREPARED_STALE:
        if not flow.is_open:
            raise
        return await _sync(conn, flow.reclosing())


async def _sync(
    conn: AsyncConnection, statements: Sequence[Statement], *, locked: bool = False
) -> list[Result]:
    """Send ``statements`` in one pipeline sync (``pipeline.Flight``; through psycopg one
    alone, without a pipeline, whose entry and exit cost more than the statement, and all of
    them on a connection psycopg is to begin a transaction on: ``implicit_begin``); what each
    returned. ``locked``: the caller holds the connection's lock (a lazy opening: always a
    flight, never psycopg, which would wait for that lock)."""
    if locked or (len(statements) > 1 and not implicit_begin(conn)):
        return await _fly(conn, statements, locked=locked)
    if len(statements) == 1:
        (statement,) = statements
        cursor = await conn.cursor(row_factory=tuple_row).execute(statement.query, statement.params)
        rows = await cursor.fetchall() if has_rows(cursor) else []
        return [Result(cursor.rowcount, rows)]
    async with conn.pipeline():
        cursors = [
            await conn.cursor(row_factory=tuple_row).execute(s.query, s.params) for s in statements
        ]
    return [Result(c.rowcount, await c.fetchall() if has_rows(c) else []) for c in cursors]


async def _fly(
    conn: AsyncConnection, statements: Sequence[Statement], *, locked: bool = False
) -> list[Result]:
    """``pipeline.fly`` on an async connection: the flight's waiting on the event loop, under
    the connection's lock (``locked``: the caller holds it).

    Raises:
        psycopg.Error: a statement failed, or the connection did.
    """
    try:
        if locked:
            return await _flown(conn, statements)
        async with conn.lock:
            return await _flown(conn, statements)
    except psycopg.Error:
        if conn.pgconn.pipeline_status != _PIPELINE_OFF:
            await conn.close()
        raise
    except BaseException:
        await conn.close()  # results pending: it can be neither read back nor reused
        raise


async def _ready(fd: int, *, write: bool = False) -> None:
    """Wait until ``fd`` is readable (or writable)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def _flown(conn: AsyncConnection, statements: Sequence[Statement]) -> list[Result]:
    """A flight's sending and reading, its waits on the event loop (the caller holds the
    connection's lock)."""
    flight = Flight(conn)
    writing = flight.send(statements)
    fd = conn.pgconn.socket
    while writing:
        await _ready(fd, write=True)
        writing = flight.flush()
    while (got := flight.read()) is None:
        await _ready(fd)
    return [flight_result(r) for r in got]


async def abort_quietly(
    conn: AsyncConnection, statements: Sequence[bytes], *, locked: bool = False
) -> bool:
    """Roll a delivery back, quietly (see ``delivery.abort_quietly``); whether every
    statement ran. ``locked``: the caller holds the connection's lock (one flight)."""
    try:
        if locked:
            await _fly(conn, [Statement(s) for s in statements], locked=True)
            return True
        for statement in statements:
            await conn.execute(statement)
    except psycopg.Error as exc:
        log.debug("rollback of a delivery failed: %s", exc)
        return False
    return True


_PIPELINE_OFF = int(PipelineStatus.OFF)
