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
    """One open delivery transaction (see ``PostgresStore.delivery``)."""

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Enqueue follow-up events inside this transaction."""
        if not events:
            return []
        flow = self._flow
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

    Raises:
        LeaseLostError: the token is stale (nothing runs, nothing is written).
        HandlerCrashed: the handler ended, broke or closed the transaction it was given.
        StoreUnavailable: the server ended the session under the handler.
        StoreError: the database failed (never blamed on the handler).
    """
    flow = Flow(store, conn, claim, now, batch)
    try:
        flow.opened(_sync(conn, flow.opening()))
        yield Delivery(flow)
        _sync(conn, flow.closing())
    except BaseException as exc:
        error = flow.error_for(exc)
        _abort(conn, flow.aborting())
        if error is exc:
            raise
        raise error from exc


def _sync(conn: Connection, statements: Sequence[Statement]) -> list[Result]:
    """Send ``statements`` in one pipeline sync; what each returned."""
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
