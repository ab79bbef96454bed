"""A SQLite delivery transaction, and the batch transaction whose savepoints they are.

Blocking code that both sides of the store run as it is: the blocking store in the caller's
thread, the asyncio side (``aio``) on the thread of its aiosqlite connection, with the handler's
block in between run on the event loop. So the transactions (``delivery_on``, ``batch_on``,
``in_savepoint``), the token check and the decision about a handler's failure exist once. They
work with the store's dialect (``SQLiteDialect``): its connections, statements and error
mapping; a batch with the store itself (``SQLBatch``: its ``dialect`` and ``statements``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from outboxkit.core.model import Claim, NewEvent, Outcome
from outboxkit.errors import HandlerCrashed, LeaseLostError, Reject, StoreError
from outboxkit.storekit.rows import record_params
from outboxkit.storekit.sql import KeptRecords, SQLBatch

from .connections import (
    RELEASE_SAVEPOINT,
    ROLLBACK_TO_SAVEPOINT,
    SAVEPOINT,
    StoreConnection,
    in_transaction,
)
from .errors import database_failure, map_error

if TYPE_CHECKING:
    from .dialect import SQLiteDialect
    from .store import SQLiteStore

WRITABLE = "PRAGMA query_only=0"

__all__ = [
    "Batch",
    "Delivery",
    "Lazily",
    "Pooled",
    "batch_on",
    "check_owned",
    "delivering",
    "delivery_on",
    "handler_failure",
    "in_savepoint",
    "lazily",
]


class Delivery:
    """One delivery transaction: the store's connection inside ``BEGIN IMMEDIATE`` (or a
    savepoint of a batch's), the claim's token checked."""

    __slots__ = (
        "_claim",
        "_deferred",
        "_dialect",
        "_now",
        "conn",
        "ended_by_handler",
        "keeping",
        "opener",
    )

    def __init__(
        self,
        dialect: SQLiteDialect,
        conn: sqlite3.Connection,
        claim: Claim,
        now: int,
        opener: Callable[[], None] | None = None,
    ) -> None:
        self._dialect = dialect
        self._claim = claim
        self._now = now
        self.conn = conn
        self.ended_by_handler = False
        self._deferred: list[tuple[str, dict[str, Any]]] | None = None
        # Set while the transaction is still to be opened (``Lazily``): opens it when the
        # connection is first taken, then clears itself.
        self.opener = opener
        # In a batch's savepoint: the records are kept, for the batch to write with its
        # settlement once the savepoint is released (``in_savepoint``), not written one by one.
        self.keeping = False

    @property
    def connection(self) -> sqlite3.Connection:
        """The store's connection inside the delivery transaction (``ctx.connection``),
        opened now if it is not yet.

        Raises:
            LeaseLostError: the token is stale (nothing is opened).
            StoreError: SQLite failed opening it.
        """
        if self.opener is not None:
            self.opener()
        return self.conn

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Follow-up events, inserted in the delivery transaction.

        Returns:
            Their ids.

        Raises:
            HandlerCrashed: a handler ended the transaction.
            StoreError: SQLite failed.
        """
        if self.opener is not None:
            self.opener()
        self.check_open()
        return self._dialect.insert(self.conn, events, self._now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """Write the delivery record for ``handler`` now; it commits with the transaction.

        Raises:
            ConfigurationError: ``outcome`` is not one that is recorded.
            HandlerCrashed: a handler ended the transaction.
            StoreError: SQLite failed.
        """
        params = record_params(self._claim, handler, outcome, reason, self._now)
        if self.opener is not None or self.keeping:  # written when the block ends
            self._deferred = [*(self._deferred or ()), (handler, params)]
            return
        self._write_record(handler, params)

    def defer_record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """``record``, checked now and written when the block ends, just before the commit:
        the asyncio side's way, which saves a hop to the connection's thread per delivery."""
        params = record_params(self._claim, handler, outcome, reason, self._now)
        if self._deferred is None:
            self._deferred = []
        self._deferred.append((handler, params))

    def write_deferred(self) -> None:
        """Write the records ``defer_record`` kept (``delivering`` calls it as the block ends);
        in a batch's savepoint they stay, for the batch (``take_records``)."""
        if self.keeping:
            return
        deferred, self._deferred = self._deferred, None
        for handler, params in deferred or ():
            self._write_record(handler, params)

    def _write_record(self, handler: str, params: Mapping[str, Any]) -> None:
        self.check_open()
        dialect = self._dialect
        with dialect.mapped(f"record {handler!r} for event {self._claim.event.id}"):
            # The record is outboxkit's write, not the handler's: a handler that made its
            # connection read-only does not make the store fail (R18). Of the store's own
            # connections, only one a handler set a PRAGMA on can be (``tainted``).
            conn = self.conn
            if not isinstance(conn, StoreConnection) or conn.tainted:
                conn.execute(WRITABLE)
            conn.execute(dialect.queries["insert_record"], params)

    def write_fenced(self) -> bool:
        """A delivery never opened, ending with one record: that record, inserted only if the
        token still holds, in one autocommitted statement. Whether it held.

        Raises:
            StoreError: SQLite failed.
        """
        handler, params = self._take()
        dialect = self._dialect
        with dialect.mapped(f"record {handler!r} for event {self._claim.event.id}"):
            cursor = self.conn.execute(
                dialect.queries["insert_record_fenced"], {**params, "token": self._claim.token}
            )
        return cursor.rowcount == 1

    def take_records(self) -> list[tuple[str, dict[str, Any]]]:
        """The records kept, as (handler, ``record_params``), taken."""
        deferred, self._deferred = self._deferred or [], None
        return deferred

    def take_single(self) -> Mapping[str, Any]:
        """The one record kept, taken (for the batch to write: ``Batch.keep``)."""
        return self._take()[1]

    def _take(self) -> tuple[str, Mapping[str, Any]]:
        deferred, self._deferred = self._deferred or [], None
        ((handler, params),) = deferred
        return handler, params

    @property
    def single_record(self) -> bool:
        """Whether the block ended with exactly one record kept (``write_fenced`` can end it)."""
        return self._deferred is not None and len(self._deferred) == 1

    def check_kept(self) -> None:
        """R17: the handler did not try to end its delivery transaction (the authorizer
        refused it, whatever the handler made of the refusal).

        Raises:
            HandlerCrashed: it tried to.
        """
        if self.ended_by_handler:
            raise HandlerCrashed(
                f"event {self._claim.event.id}: a handler tried to commit or roll back its "
                "delivery transaction (refused: outboxkit commits it with the delivery record); "
                "nothing of this delivery was committed and it runs again"
            )

    def check_open(self) -> None:
        """Raises HandlerCrashed if the transaction is no longer open (a handler closed it)."""
        if not in_transaction(self.conn):
            raise HandlerCrashed(
                f"event {self._claim.event.id}: the delivery transaction was ended by a handler "
                "(committed, rolled back or closed); outboxkit commits it with the delivery record"
            )


class Batch(SQLBatch):
    """One transaction for a claimed batch: deliveries in savepoints; settlements and lease
    extensions on the same connection (``SQLBatch``)."""

    store: SQLiteStore
    conn: StoreConnection

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[Delivery]:
        """A delivery in a savepoint of the batch (``in_savepoint``), opened only when the
        handler first takes the connection; one that never did keeps its record for
        ``write_kept`` (``Lazily``)."""
        dialect, conn = self.store.dialect, self.conn

        def keep(tx: Delivery) -> None:
            self.keep(claim, tx.take_single())

        def opening(tx: Delivery) -> AbstractContextManager[Delivery]:
            return in_savepoint(dialect, conn, claim, now, self, tx)

        return Lazily(dialect, conn, claim, now, opening, keep)

    def savepoint(
        self, claim: Claim, *, now: datetime | None, keeper: KeptRecords
    ) -> AbstractContextManager[Delivery]:
        """A delivery in a savepoint of the batch, opened at once (``in_savepoint``): the
        asyncio side's, whose handler takes the aiosqlite connection without asking here, and
        whose batch (``keeper``) keeps the records for its settlement."""
        return in_savepoint(self.store.dialect, self.conn, claim, now, self, keeper=keeper)


class Pooled(AbstractContextManager[Delivery]):
    """``SQLiteStore.delivery``: one of the store's connections, taken for the block
    (``Connections.take``), and on it a delivery opened lazily (``lazily``); the connection
    handed back when the block ends, whatever happened. A class, as ``Lazily`` is: one is made
    per delivery, and two generator-based context managers cost it ~3.5 µs more."""

    __slots__ = ("_claim", "_conn", "_delivery", "_dialect", "_now")

    def __init__(self, dialect: SQLiteDialect, claim: Claim, now: datetime | None) -> None:
        self._dialect = dialect
        self._claim = claim
        self._now = now

    def __enter__(self) -> Delivery:
        connections = self._dialect.connections
        self._conn = conn = connections.take()
        try:
            self._delivery = delivery = lazily(self._dialect, conn, self._claim, self._now)
            return delivery.__enter__()
        except BaseException:
            connections.give(conn)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            return self._delivery.__exit__(exc_type, exc, tb)
        finally:
            self._dialect.connections.give(self._conn)


class Lazily(AbstractContextManager[Delivery]):
    """A delivery opened (``opening(tx)``: a transaction, or a savepoint of the batch's) only
    when its handler first takes the connection or enqueues a follow-up; a block that never
    did and ends with exactly one record is ended by ``single(tx)`` instead (the record fenced
    by the token in one statement, or kept by the batch). A failure of the opening is the
    delivery's error, whatever the handler made of it.

    A class rather than a generator: one is made per delivery, and nearly none opens, so it
    makes the opened block's stack only when it opens."""

    __slots__ = ("_failed", "_opened", "_opening", "_single", "tx")

    def __init__(
        self,
        dialect: SQLiteDialect,
        conn: StoreConnection,
        claim: Claim,
        now: datetime | None,
        opening: Callable[[Delivery], AbstractContextManager[Delivery]],
        single: Callable[[Delivery], None],
    ) -> None:
        self._opening = opening
        self._single = single
        self._opened: AbstractContextManager[Delivery] | None = None  # once it is
        self._failed: BaseException | None = None  # the opening's failure
        self.tx = Delivery(dialect, conn, claim, dialect.instant(now), self._open_now)

    def _open_now(self) -> None:
        self.tx.opener = None
        opened = self._opening(self.tx)
        try:
            opened.__enter__()
        except BaseException as exc:
            self._failed = exc
            # Taken again, refused again; records are kept, never written (R6, if the handler
            # swallowed the refusal: ``__exit__`` raises it).
            self.tx.opener = self._refuse
            raise
        self._opened = opened

    def _refuse(self) -> None:
        assert self._failed is not None
        raise self._failed

    def __enter__(self) -> Delivery:
        return self.tx

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        failed, opened = self._failed, self._opened
        if exc is not None:
            if failed is not None and failed is not exc:
                raise failed from exc
            # into the opened transaction, which rolls back
            return opened is not None and bool(opened.__exit__(exc_type, exc, tb))
        if failed is not None:
            raise failed  # the handler swallowed it: the delivery fails all the same
        if opened is None:
            if self.tx.single_record:
                self.tx.opener = None
                self._single(self.tx)
                return False
            self._open_now()
            opened = self._opened
            assert opened is not None
        opened.__exit__(None, None, None)
        return False


# -- the transactions, on a given connection ---------------------------------------------------
# Each one whole, from BEGIN to COMMIT: the blocking store runs them on its connections, the
# asyncio side (``aio``) on the threads of its own, with the block in between on the loop.


class _Block(AbstractContextManager[Delivery]):
    """What each of a delivery's context managers below holds: the store's dialect, the
    connection, the claim, the instant given, and the delivery handed out (or to hand out)."""

    __slots__ = ("_claim", "_conn", "_dialect", "_now", "_tx")

    def __init__(
        self,
        dialect: SQLiteDialect,
        conn: StoreConnection,
        claim: Claim,
        now: datetime | None,
        tx: Delivery | None,
    ) -> None:
        self._dialect = dialect
        self._conn = conn
        self._claim = claim
        self._now = now
        self._tx = tx


def delivery_on(
    dialect: SQLiteDialect,
    conn: StoreConnection,
    claim: Claim,
    now: datetime | None,
    tx: Delivery | None = None,
) -> AbstractContextManager[Delivery]:
    """``SQLiteStore.delivery`` on ``conn``: BEGIN IMMEDIATE, the token check, the block, COMMIT
    (the block hands out ``tx``, when given: a delivery ``lazily`` opens now)."""
    return _DeliveryOn(dialect, conn, claim, now, tx)


class _DeliveryOn(_Block):
    """``delivery_on``: a class, as ``delivering`` is (one per delivery that opens)."""

    __slots__ = ("_inner",)

    def __enter__(self) -> Delivery:
        dialect, conn, claim = self._dialect, self._conn, self._claim
        with dialect.mapped(f"open a delivery transaction for event {claim.event.id}"):
            dialect.begin(conn)
        self._inner = inner = _Delivering(dialect, conn, claim, self._now, self._tx, False, False)
        try:
            return inner.__enter__()
        except BaseException:
            conn.rollback_quietly()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        conn = self._conn
        try:
            self._inner.__exit__(exc_type, exc, tb)  # raises instead, or never suppresses
            if exc is None:
                with self._dialect.mapped(f"commit the delivery of event {self._claim.event.id}"):
                    self._dialect.commit(conn)
                return False
        except BaseException:
            conn.rollback_quietly()
            raise
        conn.rollback_quietly()
        return False


def lazily(
    dialect: SQLiteDialect, conn: StoreConnection, claim: Claim, now: datetime | None
) -> AbstractContextManager[Delivery]:
    """``SQLiteStore.delivery`` on ``conn``, opened (``delivery_on``) only when the handler
    first takes the connection or enqueues a follow-up (``Lazily``); one that never did and
    ends with one record is that record, fenced by the token, autocommitted."""

    def fenced(tx: Delivery) -> None:
        if not tx.write_fenced():
            raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
        dialect.wal.after_commit(conn)

    return Lazily(
        dialect, conn, claim, now, lambda tx: delivery_on(dialect, conn, claim, now, tx), fenced
    )


@contextmanager
def batch_on(store: SQLiteStore, conn: StoreConnection) -> Iterator[Batch]:
    """``SQLiteStore.batch`` on ``conn``: BEGIN IMMEDIATE, the block, COMMIT."""
    dialect = store.dialect
    with dialect.mapped("open a batch transaction"):
        dialect.begin(conn)
    try:
        batch = Batch(store, conn)
        yield batch
        batch.write_kept()
        with dialect.mapped("commit the batch"):
            if not in_transaction(conn):
                raise StoreError("the batch transaction was ended by a handler")
            dialect.commit(conn)
    except BaseException:
        conn.rollback_quietly()
        raise


def in_savepoint(
    dialect: SQLiteDialect,
    conn: StoreConnection,
    claim: Claim,
    now: datetime | None,
    batch: Batch,
    tx: Delivery | None = None,
    keeper: KeptRecords | None = None,
) -> AbstractContextManager[Delivery]:
    """A delivery in a savepoint of ``batch``'s transaction, open on ``conn``: released on a
    normal exit, rolled back to (and released) on an exception. The token is the batch's answer
    (``SQLBatch.lock``: the batch's tokens checked at once by its first delivery that opens;
    its transaction holds the database's one write lock, so none changes under it), refused
    before the savepoint when stale; a claim the batch was not told of is checked here. The
    records are kept by ``keeper`` (by default the batch) once the savepoint is released, and
    written with the settlement.

    Raises:
        LeaseLostError: the token is stale (nothing is opened).
    """
    return _InSavepoint(dialect, conn, claim, now, batch, tx, keeper)


class _InSavepoint(_Block):
    """``in_savepoint``: a class, as ``delivering`` is (one per delivery in a batch)."""

    __slots__ = ("_batch", "_inner", "_keeper")

    def __init__(
        self,
        dialect: SQLiteDialect,
        conn: StoreConnection,
        claim: Claim,
        now: datetime | None,
        batch: Batch,
        tx: Delivery | None,
        keeper: KeptRecords | None,
    ) -> None:
        super().__init__(dialect, conn, claim, now, tx)
        self._batch = batch
        self._keeper = keeper

    def __enter__(self) -> Delivery:
        dialect, conn, claim = self._dialect, self._conn, self._claim
        held = self._batch.lock(claim)
        if held is False:
            raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
        with dialect.mapped(f"open a savepoint for event {claim.event.id}"):
            conn.execute(SAVEPOINT)
        self._inner = inner = _Delivering(
            dialect, conn, claim, self._now, self._tx, held is True, True
        )
        try:
            self._tx = inner.__enter__()
        except BaseException:
            self._roll_back()
            raise
        return self._tx

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            self._inner.__exit__(exc_type, exc, tb)  # raises instead, or never suppresses
        except BaseException:
            self._roll_back()
            raise
        if exc is not None:
            self._roll_back()
            return False
        dialect, conn, claim, opened = self._dialect, self._conn, self._claim, self._tx
        assert opened is not None
        with dialect.mapped(f"release the savepoint of event {claim.event.id}"):
            conn.execute(RELEASE_SAVEPOINT)
            records = opened.take_records()
            if records and conn.tainted:  # a handler's PRAGMA query_only: not for the batch's
                conn.execute(WRITABLE)  # own writes (R18), as before each record
            kept_by = self._batch if self._keeper is None else self._keeper
            for _, params in records:
                kept_by.keep(claim, params)
        return False

    def _roll_back(self) -> None:
        """Undo the savepoint's writes, if the transaction is still there to undo them in."""
        conn = self._conn
        if in_transaction(conn):
            with suppress(sqlite3.Error):
                conn.execute(ROLLBACK_TO_SAVEPOINT)
                conn.execute(RELEASE_SAVEPOINT)


def check_owned(dialect: SQLiteDialect, conn: sqlite3.Connection, claim: Claim) -> None:
    """R6's token check, inside the delivery's open transaction (it holds the write lock).

    Raises:
        LeaseLostError: the token is stale.
        StoreError: SQLite failed.
    """
    with dialect.mapped(f"check the claim on event {claim.event.id}"):
        owned = conn.execute(
            dialect.queries["owned"], {"id": claim.event.id, "token": claim.token}
        ).fetchone()
    if owned is None:
        raise LeaseLostError(f"event {claim.event.id}: claim token is stale")


def delivering(
    dialect: SQLiteDialect,
    conn: StoreConnection,
    claim: Claim,
    now: datetime | None,
    tx: Delivery | None = None,
    checked: bool = False,
    keeping: bool = False,
) -> AbstractContextManager[Delivery]:
    """Inside ``conn``'s open transaction: check the token (unless ``checked``: the batch's
    check holds for it), hand out the delivery, check the handler left the transaction open.
    Commits nothing; with ``keeping`` (a batch's savepoint) writes no record either: they stay
    on the delivery (``Delivery.take_records``).

    Raises:
        LeaseLostError: the token is stale (nothing is handed out).
        HandlerCrashed, StoreUnavailable, StoreError: instead of the block's exception, as
            ``handler_failure`` decides.
    """
    return _Delivering(dialect, conn, claim, now, tx, checked, keeping)


class _Delivering(_Block):
    """``delivering``: a class, not a generator, as ``Lazily`` is (one per delivery that
    opens; a generator-based context manager costs each about 1.5 µs more)."""

    __slots__ = ("_checked", "_keeping")

    def __init__(
        self,
        dialect: SQLiteDialect,
        conn: StoreConnection,
        claim: Claim,
        now: datetime | None,
        tx: Delivery | None,
        checked: bool,
        keeping: bool,
    ) -> None:
        super().__init__(dialect, conn, claim, now, tx)
        self._checked = checked
        self._keeping = keeping

    def __enter__(self) -> Delivery:
        dialect, conn, claim = self._dialect, self._conn, self._claim
        if not self._checked:
            check_owned(dialect, conn, claim)
        tx = self._tx
        if tx is None:  # (one given, as ``Lazily``'s, has its instant already)
            self._tx = tx = Delivery(dialect, conn, claim, dialect.instant(self._now))
        tx.keeping = self._keeping
        conn.delivery = tx
        if conn.tainted:  # a handler set a PRAGMA on it once: reset its settings after each (R18)
            conn.dirty = True
        return tx

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        tx = self._tx
        assert tx is not None
        try:
            own = exc is None  # the block ended well: the checks' own failure is raised here
            if exc is None:
                try:
                    tx.check_kept()
                    tx.write_deferred()
                    tx.check_open()
                except Exception as failure:
                    exc = failure
                else:
                    return False
            elif not isinstance(exc, Exception):
                return False
            instead = handler_failure(self._dialect, tx, self._claim, exc)
            if instead is not None:
                raise instead from exc
            if own:
                raise exc
            return False
        finally:
            self._conn.delivery = None


def handler_failure(
    dialect: SQLiteDialect, tx: Delivery, claim: Claim, exc: Exception
) -> StoreError | HandlerCrashed | None:
    """What a delivery raises instead of ``exc``, the exception its block ended with.

    The file failing under the handler (disk full, I/O error) is the database's failure, not the
    handler's, whatever the handler made of it; a handler that tried to end the transaction is
    a ``HandlerCrashed`` failure, whatever it raised afterwards.

    Returns:
        The error to raise from ``exc``, or None: ``exc`` itself.
    """
    failure = database_failure(exc)
    if failure is not None:
        return map_error(
            failure,
            dialect.where,
            f"deliver event {claim.event.id} (the database failed while a handler ran)",
        )
    if tx.ended_by_handler and not isinstance(exc, HandlerCrashed | Reject | LeaseLostError):
        return HandlerCrashed(
            f"event {claim.event.id}: a handler may not commit or roll back its delivery "
            "transaction (outboxkit commits it with the delivery record); its writes were "
            f"rolled back: {exc}"
        )
    return None
