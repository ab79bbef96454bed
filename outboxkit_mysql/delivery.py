"""The MariaDB/MySQL delivery transaction, and the batch whose savepoints they are.

A delivery runs in an XA transaction (``XA START`` ... ``XA END``, ``XA COMMIT ... ONE PHASE``:
one commit, as a plain transaction's). Inside one the server itself refuses ``COMMIT``,
``ROLLBACK``, ``BEGIN`` and every statement that would commit implicitly (DDL), so a handler
cannot end the transaction it was given (R17): it keeps the row lock the token check took, and
``StoreConnection`` notes the attempt, which fails the delivery whatever the handler made of
the refusal. Savepoints work inside it, for a handler's own recovery and for a batch.

A delivery opens lazily (``LazyDelivery.defer``): its opening, the token check and the row
lock go to the server with the handler's first statement, in its round trip
(``StoreConnection.query``); the records, the ``XA END`` and the commit in another. A delivery
that never opened ends with its one record in a single autocommitted statement fenced by the
token (in a batch: kept for ``write_kept``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any

import pymysql

from outboxkit.storekit import (
    Claim,
    LeaseLostError,
    NewEvent,
)
from outboxkit.storekit.driver import (
    InBatch,
    LazyDelivery,
    PooledDelivery,
    pooled_batch,
    run_script,
)
from outboxkit.storekit.sql import SQLBatch

from .dialect import SESSION_STEPS, StoreConnection, restored

if TYPE_CHECKING:
    from .store import MySQLStore

__all__ = ["Batch", "Delivery", "batch_on", "delivery_of", "xa_end"]

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


class Delivery(LazyDelivery):
    """One delivery (``DeliveryTransaction``): an XA transaction of its own on a store
    connection, or (``xid`` None) a savepoint of the batch open on it; opened lazily
    (``LazyDelivery``). ``connection`` is the store's PyMySQL connection."""

    conn: StoreConnection

    def __init__(
        self,
        store: MySQLStore,
        conn: StoreConnection,
        claim: Claim,
        now: datetime | None,
        xid: str | None,
        batch: Batch | None = None,
    ) -> None:
        super().__init__(store.dialect, conn, claim, store.dialect.instant(now))
        self.store = store
        self.batch = batch
        self.xid = xid

    def open(self) -> None:
        """Open the transaction (or the savepoint), check the token and lock the row: sent
        with the handler's first statement (``StoreConnection.query``), else alone."""
        steps: list[Any] = []
        if self.xid is not None:
            if self.conn.dirty:
                steps += SESSION_STEPS  # R18
            steps.append(("XA START %(xid)s", {"xid": self.xid}))
        else:
            steps.append((_SAVEPOINT, None))
            owned = None if self.batch is None else self.batch.lock(self.claim)
            if owned is not None:  # the batch checked and locked its rows (``Batch.lock``)
                if not owned:
                    raise self.stale_token()
                self.defer(steps, checks=False)
                return
        (check,) = self.store.dialect.queries["owned"]
        self.defer([*steps, (check, {"id": self.claim.event.id, "token": self.claim.token})])

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Follow-up events, inserted in the delivery transaction."""
        self.check_kept()
        return self.store.insert(self.connection, events, self.now)

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

    def fenced(self, params: dict[str, Any]) -> None:
        """The one record of a delivery never opened, fenced by the token, autocommitted."""
        dialect, claim = self.store.dialect, self.claim
        with dialect.mapped(f"record a delivery of event {claim.event.id}"):
            written, _ = dialect.execute(
                restored(self.conn), "insert_record_fenced", {**params, "token": claim.token}
            )
        if written != 1:
            raise LeaseLostError(f"event {claim.event.id}: claim token is stale")


def delivery_of(store: MySQLStore, claim: Claim, now: datetime | None) -> PooledDelivery[Delivery]:
    """``MySQLStore.delivery``: a store connection for the block, and on it a ``Delivery`` in
    an XA transaction of its own."""
    return PooledDelivery(
        store.dialect,
        lambda conn: Delivery(store, conn, claim, now, f"okx{uuid.uuid4().hex}"),
        f"deliver event {claim.event.id}",
    )


class Batch(SQLBatch):
    """One XA transaction for a claimed batch: deliveries in savepoints, their tokens checked
    once (``SQLBatch.lock``); settlements and lease extensions on the same connection."""

    store: MySQLStore
    conn: StoreConnection

    def delivery(self, claim: Claim, *, now: datetime | None) -> InBatch[Delivery]:
        return InBatch(self, Delivery(self.store, self.conn, claim, now, None, self))


def batch_on(store: MySQLStore) -> AbstractContextManager[Batch]:
    """``MySQLStore.batch``: a store connection in an XA transaction for the block."""
    xid = f"okb{uuid.uuid4().hex}"

    def begin(conn: StoreConnection) -> None:
        session = SESSION_STEPS if conn.dirty else []
        run_script(conn, [*session, ("XA START %(xid)s", {"xid": xid})])
        conn.dirty = False

    def end(conn: StoreConnection, commit: bool) -> None:
        xa_end(conn, xid, commit=commit)

    return pooled_batch(store.dialect, lambda conn: Batch(store, conn), begin, end)
