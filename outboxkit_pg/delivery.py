"""A PostgreSQL delivery transaction, and the batch transaction whose savepoints they are.

Round trips: the transaction (or savepoint) opens in the same pipeline sync as the row lock,
and the record and the COMMIT go in one more sync at the end (psycopg's pipeline mode,
prepared statements): a one-handler event costs the handler's own statements plus two.

The commit guard (``migration_2`` in ``queries.sql``): ``lock_for_delivery`` marks the
transaction as holding an open delivery and touches the event row, which queues a deferred
trigger; ``insert_record`` clears the mark; at COMMIT the trigger refuses to commit while a
delivery is open. So a handler's own ``COMMIT`` through ``ctx.connection`` fails and rolls back
everything, and the delivery counts as a handler failure. In a batch the trigger is queued
once, outside every savepoint (``lock_for_delivery`` without the mark), and each delivery locks
and marks its row in its own savepoint (``lock_in_batch``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from outboxkit._sql.base import SQLBatch
from outboxkit._sql.rows import record_params
from outboxkit.core.model import Claim, NewEvent, Outcome
from outboxkit.errors import (
    HandlerCrashed,
    LeaseLostError,
    Reject,
    StoreError,
    StoreUnavailable,
)

from .errors import session_ended_by_handler
from .pool import Connection

if TYPE_CHECKING:
    from .store import PostgresStore

__all__ = ["Batch", "Delivery", "delivering"]

log = logging.getLogger("outboxkit")


@dataclass(frozen=True, slots=True)
class _Frame:
    """How a delivery opens, ends and abandons its transaction (or its savepoint of a batch's):
    the statements sent in the pipeline syncs around the delivery."""

    begin: bytes  # empty: psycopg begins (a connection without autocommit)
    end: bytes
    abort: tuple[bytes, ...]


_TRANSACTION = _Frame(begin=b"BEGIN", end=b"COMMIT", abort=(b"ROLLBACK",))
# A connection without autocommit (a pool of the app's own): psycopg begins the transaction.
_IMPLICIT = _Frame(begin=b"", end=b"COMMIT", abort=(b"ROLLBACK",))
_SAVEPOINT = _Frame(
    begin=b"SAVEPOINT outboxkit_delivery",
    end=b"RELEASE SAVEPOINT outboxkit_delivery",
    abort=(b"ROLLBACK TO SAVEPOINT outboxkit_delivery", b"RELEASE SAVEPOINT outboxkit_delivery"),
)


class Delivery:
    """One open delivery transaction (see ``PostgresStore.delivery``)."""

    def __init__(
        self, store: PostgresStore, conn: Connection, claim: Claim, now: datetime | None
    ) -> None:
        self._store = store
        self._conn = conn
        self._claim = claim
        self._now = now
        self._records: list[Mapping[str, Any]] = []  # written with the commit (finish)

    @property
    def connection(self) -> Connection:
        return self._conn

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        if not events:
            return []
        self.check_usable()
        with self._store._mapped(f"enqueue {len(events)} follow-up(s)", self._conn):
            return self._store._insert(self._conn, events, self._now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """Queue the record; it is written with the commit (``finish``), in the same sync."""
        params = record_params(self._claim, handler, outcome, reason, self._now)
        self.check_usable()
        self._records.append(params)

    def finish(self, frame: _Frame) -> None:
        """Write the queued records and commit (or release), in one pipeline sync.

        Raises:
            StoreError / StoreUnavailable: the database refused or failed (rolled back).
        """
        conn = self._conn
        event_id = self._claim.event.id
        try:
            with conn.cursor() as cur, conn.pipeline():
                for params in self._records:
                    cur.execute(self._store._queries["insert_record"], params)
                cur.execute(frame.end)
        except pg_errors.UniqueViolation as exc:
            _abort(conn, frame)
            raise StoreError(f"event {event_id} already has a delivery record") from exc
        except psycopg.Error as exc:
            _abort(conn, frame)
            raise self._store._error(exc, f"commit the delivery of event {event_id}", conn) from exc

    def check_usable(self) -> None:
        """The transaction is still the one outboxkit opened (see ``check_usable``)."""
        check_usable(self._conn, self._store.where, f"event {self._claim.event.id}")


class Batch(SQLBatch):
    """One transaction for a claimed batch (see ``PostgresStore.batch``)."""

    _store: PostgresStore
    _conn: Connection

    def __init__(self, store: PostgresStore, conn: Connection) -> None:
        super().__init__(store, conn)
        self.guarded = False  # the commit guard's trigger is queued in this transaction

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[Delivery]:
        self._check_open()
        return delivering(self._store, self._conn, claim, now, self)

    def _check_open(self) -> None:
        """A batch whose transaction a handler ended would run every later step outside it
        (autocommitted): refuse them; the batch is abandoned and its events recover by their
        leases."""
        conn = self._conn
        if conn.closed or conn.info.transaction_status != TransactionStatus.INTRANS:
            raise StoreError(
                f"PostgreSQL at {self._store.where}: the batch transaction is no longer open "
                "(a handler ended it, or the connection was lost); the batch is abandoned"
            )


@contextmanager
def delivering(
    store: PostgresStore,
    conn: Connection,
    claim: Claim,
    now: datetime | None,
    batch: Batch | None = None,
) -> Iterator[Delivery]:
    """A delivery on ``conn``: its own transaction, or (``batch``) a savepoint of the batch's,
    the event row locked and the token checked; committed (released) on a normal exit, rolled
    back on an exception.

    Raises:
        LeaseLostError: the token is stale (nothing runs, nothing is written).
        HandlerCrashed: the handler ended, broke or closed the transaction it was given.
        StoreUnavailable: the server ended the session under the handler.
        StoreError: the database failed (never blamed on the handler).
    """
    queries = store._queries
    if batch is None:
        frame = _TRANSACTION if conn.autocommit else _IMPLICIT
        lock = queries["lock_for_delivery"]
    else:
        frame, lock = _SAVEPOINT, queries["lock_in_batch"]
    doing = f"deliver event {claim.event.id}"
    params = store._params({"id": claim.event.id, "token": claim.token, "mark": batch is None})
    store._params({"now": now})  # refused here if naive, before anything runs
    try:
        with conn.cursor(row_factory=tuple_row) as cur:
            guard: psycopg.Cursor[Any] | None = None
            with conn.pipeline():
                if batch is not None and not batch.guarded:
                    guard = conn.cursor()
                    guard.execute(queries["lock_for_delivery"], params)
                if frame.begin:
                    cur.execute(frame.begin)  # one cursor: it keeps the lock's result
                cur.execute(lock, params)
            owned = cur.fetchall()
            if guard is not None and batch is not None and guard.rowcount == 1:
                batch.guarded = True
    except BaseException as exc:
        _abort(conn, frame)
        if isinstance(exc, psycopg.Error):
            raise store._error(exc, doing, conn) from exc
        raise
    if not owned:
        _abort(conn, frame)
        raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
    delivery = Delivery(store, conn, claim, now)
    try:
        yield delivery
        delivery.check_usable()
    except BaseException as exc:
        if (
            conn.broken
            and isinstance(exc, Exception)
            and not isinstance(exc, StoreError)
            and not session_ended_by_handler(exc)
        ):
            # The server ended the session under the handler (a restart, a terminated
            # backend): the database failed, not the handler, whatever it raised then.
            raise StoreUnavailable(
                f"PostgreSQL at {store.where} is unavailable ({doing}): the connection was "
                "lost while a handler ran"
            ) from exc
        ended = _ended_by_handler(conn, exc)
        _abort(conn, frame)
        if ended:
            raise HandlerCrashed(
                f"event {claim.event.id}: a handler may not commit or roll back its "
                "delivery transaction (outboxkit commits it together with the delivery "
                f"record); its writes were rolled back: {exc}"
            ) from exc
        raise
    delivery.finish(frame)


def _abort(conn: Connection, frame: _Frame) -> None:
    """Roll a delivery back (to its savepoint), quietly: the error that brought us here is the
    one to report, and a connection that cannot roll back is discarded by the pool."""
    if conn.closed or conn.broken or conn.info.transaction_status == TransactionStatus.IDLE:
        return
    try:
        for statement in frame.abort:
            conn.execute(statement)
    except psycopg.Error as exc:
        log.debug("rollback of a delivery failed: %s", exc)


def check_usable(conn: Connection, where: str, what: str) -> None:
    """``conn``'s transaction (delivering ``what``) is still the one outboxkit opened.

    Raises:
        StoreUnavailable: the connection was lost (the database's doing).
        HandlerCrashed: a handler closed the connection, ended the transaction, or left it
            aborted by a failed statement it caught.
    """
    if conn.broken:
        raise StoreUnavailable(f"PostgreSQL at {where}: the connection delivering {what} was lost")
    if conn.closed:
        raise HandlerCrashed(
            f"{what}: a handler closed its delivery connection (outboxkit commits the delivery "
            "transaction together with the delivery record)"
        )
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise HandlerCrashed(
            f"{what}: a statement in the delivery transaction failed and the handler went on; "
            "the transaction is aborted and its writes were rolled back"
        )
    if status != TransactionStatus.INTRANS:
        raise HandlerCrashed(
            f"{what}: a handler may not commit or roll back its delivery transaction "
            "(outboxkit commits it together with the delivery record)"
        )


def _ended_by_handler(conn: Connection, exc: BaseException) -> bool:
    """Whether a handler's failure ``exc`` came with the delivery transaction ended under
    outboxkit (a raw COMMIT the commit guard refused, or a ROLLBACK): the connection is idle."""
    return (
        isinstance(exc, Exception)
        and not isinstance(exc, HandlerCrashed | LeaseLostError | Reject | StoreError)
        and not conn.closed
        and not conn.broken
        and conn.info.transaction_status == TransactionStatus.IDLE
    )
