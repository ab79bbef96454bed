"""The MariaDB/MySQL delivery transaction, and the batch whose savepoints they are.

A delivery runs in an XA transaction (``XA START`` ... ``XA END``, ``XA COMMIT ... ONE PHASE``:
one commit, as a plain transaction's). Inside one the server itself refuses ``COMMIT``,
``ROLLBACK``, ``BEGIN`` and every statement that would commit implicitly (DDL), so a handler
cannot end the transaction it was given (R17): it keeps the row lock the token check took, and
``StoreConnection`` notes the attempt, which fails the delivery whatever the handler made of
the refusal. Savepoints work inside it, for a handler's own recovery and for a batch.

A delivery opens lazily, when its handler first takes ``ctx.connection`` or enqueues a
follow-up: the opening, the token check and the row lock are one round trip; the records, the
``XA END`` and the commit another. A delivery that never opened ends with its one record in a
single autocommitted statement fenced by the token (in a batch: kept for ``write_kept``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pymysql

from outboxkit.storekit import (
    Claim,
    HandlerCrashed,
    LeaseLostError,
    NewEvent,
    Outcome,
    Reject,
    StoreError,
)
from outboxkit.storekit.rows import record_params
from outboxkit.storekit.sql import SQLBatch

from .dialect import SESSION, UNAVAILABLE, StoreConnection, code_of, map_error, restored, run_script

if TYPE_CHECKING:
    from .store import MySQLStore

__all__ = ["Batch", "Delivery", "batch_on", "xa_end"]

_SAVEPOINT = "SAVEPOINT outboxkit_delivery"
_ROLLBACK_TO = "ROLLBACK TO SAVEPOINT outboxkit_delivery"


def xa_end(conn: StoreConnection, xid: str, *, commit: bool, before: Sequence[Any] = ()) -> None:
    """End the XA transaction ``xid``: the ``before`` statements (``(sql, params)``), then
    ``XA END`` and a one-phase commit, in one round trip; or (``commit=False``) roll it back
    whatever state it is in, the connection then closed by the pool if that fails too."""
    params = {"xid": xid}
    if commit:
        run_script(
            conn,
            [*before, ("XA END %(xid)s", params), ("XA COMMIT %(xid)s ONE PHASE", params)],
        )
        return
    for sql in ("XA END %(xid)s", "XA ROLLBACK %(xid)s"):
        try:
            run_script(conn, [(sql, params)])
        except pymysql.err.MySQLError:
            if sql.startswith("XA ROLLBACK"):
                raise


class Delivery:
    """One delivery (``DeliveryTransaction``): an XA transaction of its own on a store
    connection, or (``xid`` None) a savepoint of the batch open on it; opened lazily."""

    def __init__(
        self,
        store: MySQLStore,
        conn: StoreConnection,
        claim: Claim,
        now: datetime | None,
        xid: str | None,
        batch: Batch | None = None,
    ) -> None:
        self.store = store
        self.batch = batch
        self.conn = conn
        self.claim = claim
        self.now = store.dialect.instant(now)
        self.xid = xid
        self.opened = False
        self.kept: list[dict[str, Any]] = []

    @property
    def connection(self) -> StoreConnection:
        """The store's PyMySQL connection inside the delivery transaction (``ctx.connection``),
        opened now if it is not yet.

        Raises:
            LeaseLostError: the token is stale (nothing is opened).
        """
        if not self.opened:
            self.open()
        return self.conn

    def open(self) -> None:
        """Open the transaction (or the savepoint) and check the token, locking the row."""
        self.opened = True
        dialect, claim, conn = self.store.dialect, self.claim, self.conn
        steps: list[Any] = []
        if self.xid is not None:
            if conn.dirty:
                steps.append((SESSION, None))  # R18
            steps.append(("XA START %(xid)s", {"xid": self.xid}))
        else:
            steps.append((_SAVEPOINT, None))
        (check,) = dialect.queries["owned"]
        steps.append((check, {"id": claim.event.id, "token": claim.token}))
        with dialect.mapped(f"open the delivery of event {claim.event.id}"):
            owned = run_script(conn, steps)
        conn.dirty = conn.delivering = True
        conn.ended_by_handler = False  # this delivery's own (a batch's connection serves many)
        if owned != 1:
            raise LeaseLostError(f"event {claim.event.id}: claim token is stale")

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Follow-up events, inserted in the delivery transaction."""
        self.check_kept()
        return self.store.insert(self.connection, events, self.now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """The delivery record of ``handler``: written as the delivery commits."""
        self.kept.append(record_params(self.claim, handler, outcome, reason, self.now))

    def check_kept(self) -> None:
        """R17: the handler did not try to end its delivery transaction.

        Raises:
            HandlerCrashed: it tried to (the server refused it).
        """
        if self.conn.ended_by_handler:
            raise HandlerCrashed(
                f"event {self.claim.event.id}: a handler tried to commit, roll back or close "
                "its delivery transaction (refused: outboxkit commits it with the delivery "
                "record); nothing of this delivery was committed and it runs again"
            )

    def finish(self) -> None:
        """The normal end: the records and the commit (or the savepoint's release)."""
        self.conn.delivering = False
        self.check_kept()
        (insert,) = self.store.dialect.queries["insert_record"]
        records = [(insert, params) for params in self.kept]
        if self.batch is not None:
            # The savepoint stays (the next delivery's of the same name replaces it; the
            # batch's commit ends it); the records go with the batch's settlement, fenced by
            # the row lock this delivery took: no round trip here.
            for params in self.kept:
                self.batch.keep(self.claim, params)
            return
        with self.store.dialect.mapped(f"commit the delivery of event {self.claim.event.id}"):
            xa_end(self.conn, self.xid or "", commit=True, before=records)

    def undo(self) -> None:
        """Roll the delivery back (the transaction, or to the savepoint)."""
        self.conn.delivering = False
        if self.xid is not None:
            xa_end(self.conn, self.xid, commit=False)
        else:
            run_script(self.conn, [(_ROLLBACK_TO, None)])

    def failure(self, exc: BaseException) -> BaseException | None:
        """What the delivery raises instead of ``exc``, its block's exception: the database's
        failure under the handler (a deadlock, a lost connection) is the store's, never the
        handler's; an attempt to end the transaction is ``HandlerCrashed``. None: ``exc``."""
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, StoreError):
                return None
            if code_of(seen) in UNAVAILABLE:
                return map_error(
                    seen,
                    self.store.dialect.where,
                    f"deliver event {self.claim.event.id} (the database failed under a handler)",
                )
            seen = seen.__cause__ or seen.__context__
        if self.conn.ended_by_handler and not isinstance(exc, HandlerCrashed | Reject):
            return HandlerCrashed(
                f"event {self.claim.event.id}: a handler may not commit or roll back its "
                f"delivery transaction; its writes were rolled back: {exc}"
            )
        return None


class EventDelivery:
    """``MySQLStore.delivery``: a store connection for the block, and on it a ``Delivery`` in
    an XA transaction of its own. A class (one is made per delivery)."""

    def __init__(self, store: MySQLStore, claim: Claim, now: datetime | None) -> None:
        self.store = store
        self.claim = claim
        self.now = now

    def __enter__(self) -> Delivery:
        dialect = self.store.dialect
        with dialect.mapped(f"deliver event {self.claim.event.id}"):
            conn = dialect.pool.take()
        self.tx = Delivery(self.store, conn, self.claim, self.now, f"okx{uuid.uuid4().hex}")
        return self.tx

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tx, pool = self.tx, self.store.dialect.pool
        broken = True
        try:
            if exc is None and not tx.opened and len(tx.kept) == 1:
                self.fenced(tx.kept[0])
            else:
                _end(tx, exc)
            broken = False
        finally:
            pool.give(tx.conn, broken=broken)

    def fenced(self, params: dict[str, Any]) -> None:
        """The one record of a delivery never opened, fenced by the token, autocommitted."""
        dialect, claim = self.store.dialect, self.claim
        with dialect.mapped(f"record a delivery of event {claim.event.id}"):
            written, _ = dialect.execute(
                restored(self.tx.conn), "insert_record_fenced", {**params, "token": claim.token}
            )
        if written != 1:
            raise LeaseLostError(f"event {claim.event.id}: claim token is stale")


def _end(tx: Delivery, exc: BaseException | None) -> None:
    """End an opened (or to-be-opened) delivery: commit on a normal exit, else roll back and
    raise what ``Delivery.failure`` says."""
    if exc is None:
        if not tx.opened:
            tx.open()
        try:
            tx.finish()
            return
        except BaseException as failed:
            exc = failed
            _undo_quietly(tx)
            raise
    if tx.opened:
        _undo_quietly(tx)
    instead = tx.failure(exc) if isinstance(exc, Exception) else None
    if instead is not None:
        raise instead from exc


def _undo_quietly(tx: Delivery) -> None:
    try:
        tx.undo()
    except pymysql.err.MySQLError:
        tx.conn.ended_by_handler = True  # the pool closes it rather than keep it


class BatchDelivery:
    """``Batch.delivery``: a savepoint of the batch, opened lazily; a delivery never opened
    keeps its one record for the batch's ``write_kept``."""

    def __init__(self, batch: Batch, claim: Claim, now: datetime | None) -> None:
        self.batch = batch
        self.tx = Delivery(batch.store, batch.conn, claim, now, None, batch)

    def __enter__(self) -> Delivery:
        return self.tx

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tx = self.tx
        if exc is None and not tx.opened and len(tx.kept) == 1:
            self.batch.keep(tx.claim, tx.kept[0])
            return
        _end(tx, exc)


class Batch(SQLBatch):
    """One XA transaction for a claimed batch: deliveries in savepoints; settlements and lease
    extensions on the same connection (``SQLBatch``)."""

    store: MySQLStore
    conn: StoreConnection

    def delivery(self, claim: Claim, *, now: datetime | None) -> BatchDelivery:
        return BatchDelivery(self, claim, now)


@contextmanager
def batch_on(store: MySQLStore) -> Iterator[Batch]:
    """``MySQLStore.batch``: a store connection in an XA transaction for the block."""
    dialect = store.dialect
    xid = f"okb{uuid.uuid4().hex}"
    with dialect.mapped("open a batch transaction"):
        conn = dialect.pool.take()
    broken = True
    try:
        with dialect.mapped("open a batch transaction"):
            run_script(
                conn,
                [*([(SESSION, None)] if conn.dirty else []), ("XA START %(xid)s", {"xid": xid})],
            )
        conn.dirty = False
        try:
            batch = Batch(store, conn)
            yield batch
            batch.write_kept()
            with dialect.mapped("commit the batch"):
                xa_end(conn, xid, commit=True)
        except BaseException:
            with suppress(pymysql.err.MySQLError):
                xa_end(conn, xid, commit=False)
                broken = False
            raise
        broken = False
    finally:
        dialect.pool.give(conn, broken=broken)
