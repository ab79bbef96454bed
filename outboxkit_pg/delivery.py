"""A PostgreSQL delivery transaction, and the batch transaction whose savepoints they are: the
blocking shell around ``flow.Flow`` (what a delivery sends, reads and raises is there, shared
with the asyncio side in ``aio``; only the waiting is here).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import TYPE_CHECKING

import psycopg
from psycopg.rows import tuple_row

from outboxkit._sql.base import SQLBatch
from outboxkit.core.model import Claim, NewEvent, Outcome

from .flow import BatchGuard, Flow, Result, Statement, Transaction
from .pool import Connection

if TYPE_CHECKING:
    from .store import PostgresStore

__all__ = ["Batch", "Delivery", "delivering"]

log = logging.getLogger("outboxkit")


class Delivery(Transaction[Connection]):
    """One delivery transaction (see ``PostgresStore.delivery``); a delivery of its own opens
    when its connection is first taken (or a follow-up enqueued)."""

    @property
    def connection(self) -> Connection:
        """The connection in the open delivery transaction, opened now if it is not yet.

        Raises:
            LeaseLostError: the token is stale (the transaction is not opened).
            StoreError: the database failed opening it.
        """
        flow = self._flow
        if not flow.is_open:
            open_flow(flow)
        return flow.conn

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Enqueue follow-up events inside this transaction."""
        if not events:
            return []
        flow = self._flow
        if not flow.is_open:
            open_flow(flow)
        with flow.store._mapped(self._following(events), flow.conn):
            return flow.store._insert(flow.conn, events, flow.now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """Queue the record; it is written with the commit, in the same sync."""
        self._flow.record(handler, outcome, reason)


class Batch(BatchGuard, SQLBatch):
    """One transaction for a claimed batch (see ``PostgresStore.batch``)."""

    _store: PostgresStore
    _conn: Connection

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[Delivery]:
        self._check_open()
        return delivering(self._store, self._conn, claim, now, self)

    def _where(self) -> str:
        return self._store.where


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

    Opened lazily: only when the handler first takes ``tx.connection`` or enqueues a
    follow-up. A delivery that never did ends with its one record fenced by the token in a
    single statement (``insert_record_fenced``) or, in a batch, kept by the batch and written
    with the others' before it settles (``insert_records_fenced``): a handler that does not
    use the connection costs no round trip of its own.

    Raises:
        LeaseLostError: the token is stale (nothing the handler wrote through the connection
            commits; in a batch, a kept record's stale token shows when the batch settles).
        HandlerCrashed: the handler ended, broke or closed the transaction it was given.
        StoreUnavailable: the server ended the session under the handler.
        StoreError: the database failed (never blamed on the handler).
    """
    flow = Flow(store, conn, claim, now, batch)
    try:
        yield Delivery(flow)
        if flow.open_error is not None:
            raise flow.open_error  # the handler swallowed it: the delivery fails all the same
        if flow.must_open():
            open_flow(flow)
        if batch is not None and not flow.is_open:
            batch.keep(claim, flow.records[0])  # written, fenced, before the batch settles
        else:
            flow.closed(_sync(conn, flow.closing()))
    except BaseException as exc:
        error = flow.error_for(exc)
        _abort(conn, flow.aborting())
        if error is exc:
            raise
        raise error from exc


def open_flow(flow: Flow[Connection]) -> None:
    """Open ``flow``'s transaction now: its first pipeline sync. What it raises is kept as the
    delivery's error (``Flow.open_error``), whatever the handler that asked makes of it.

    Raises:
        LeaseLostError: the token is stale.
        StoreError: the database failed (mapped).
    """
    try:
        flow.opened(_sync(flow.conn, flow.opening()))
    except BaseException as exc:
        error = flow.open_failed(exc)
        if error is exc:
            raise
        raise error from exc


def _sync(conn: Connection, statements: Sequence[Statement]) -> list[Result]:
    """Send ``statements`` in one pipeline sync (one alone: without the pipeline, whose
    entry and exit cost more than the statement); what each returned."""
    if len(statements) == 1:
        (statement,) = statements
        cursor = conn.cursor(row_factory=tuple_row).execute(statement.query, statement.params)
        rows = cursor.fetchall() if cursor.description is not None else []
        return [Result(cursor.rowcount, rows)]
    with conn.pipeline():
        cursors = [
            conn.cursor(row_factory=tuple_row).execute(s.query, s.params) for s in statements
        ]
    return [Result(c.rowcount, c.fetchall() if c.description is not None else []) for c in cursors]


def _abort(conn: Connection, statements: Sequence[bytes]) -> None:
    """Roll a delivery back, quietly: the error that brought us here is the one to report, and
    a connection that cannot roll back is discarded by the pool."""
    try:
        for statement in statements:
            conn.execute(statement)
    except psycopg.Error as exc:
        log.debug("rollback of a delivery failed: %s", exc)
