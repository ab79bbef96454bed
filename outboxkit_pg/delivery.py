"""A PostgreSQL delivery transaction, the batch transaction whose savepoints they are, and the
per-event round whose connection they share: the blocking shell around ``flow.Flow`` (what a
delivery sends, reads and raises is there, shared with the asyncio side in ``aio``; only the
waiting is here) and ``pipeline.RecordPipeline``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.rows import tuple_row

from outboxkit.core.model import Claim, NewEvent, Outcome
from outboxkit.errors import StoreError, StoreUnavailable
from outboxkit.storekit import DeliveriesBase, SettleItem
from outboxkit.storekit.rows import record_params
from outboxkit.storekit.sql import SQLBatch

from .flow import BatchGuard, Flow, Result, Statement, has_rows
from .pipeline import PREPARED_STALE, RecordPipeline, drain, fly, implicit_begin
from .pool import Connection

if TYPE_CHECKING:
    from .dialect import PostgresDialect
    from .store import PostgresStore

__all__ = ["Batch", "Delivery", "Round", "delivering", "restart"]

log = logging.getLogger("outboxkit")


class Delivery:
    """One delivery transaction (``DeliveryTransaction``; see ``PostgresStore.delivery``),
    its own context manager: ``with delivering(...) as tx``. It opens when its connection is
    first taken (or a follow-up enqueued): its ``flow.Flow`` is made then. A delivery never
    opened ends as its one record, fenced by the token in a single statement
    (``insert_record_fenced``), kept by the batch and written with the others' before it
    settles (``insert_records_fenced``), or, in a per-event round, sent without waiting for
    it (``Round.send``): a handler that does not use the connection costs no round trip, and
    no more than its record.

    On a normal exit the transaction commits (a batch's savepoint is released); on an
    exception it rolls back and the exception is re-raised, as the error it is for the
    delivery (``Flow.error_for``).

    Raises:
        ConfigurationError: ``now`` is a naive datetime (before anything is sent).
        LeaseLostError: the token is stale (nothing the handler wrote through the connection
            commits; in a batch, a kept record's stale token shows when the batch settles).
        HandlerCrashed: the handler ended, broke or closed the transaction it was given.
        StoreUnavailable: the server ended the session under the handler.
        StoreError: the database failed (never blamed on the handler).
    """

    __slots__ = ("_batch", "_claim", "_conn", "_dialect", "_flow", "_now", "_record", "_round")

    def __init__(
        self,
        dialect: PostgresDialect,
        conn: Connection,
        claim: Claim,
        now: datetime | None,
        batch: Batch | None = None,
        round_: Round | None = None,
    ) -> None:
        if now is not None and now.utcoffset() is None:
            dialect.params({"now": now})  # refused, naming it, before anything runs
        self._dialect = dialect
        self._conn = conn
        self._claim = claim
        self._now = now
        self._batch = batch
        self._round = round_
        self._flow: Flow[Connection] | None = None
        self._record: dict[str, Any] | None = None  # the one record of a delivery not opened

    def _made_flow(self) -> Flow[Connection]:
        flow = self._flow
        if flow is None:
            flow = self._flow = Flow(self._dialect, self._conn, self._claim, self._now, self._batch)
            if self._record is not None:
                flow.records.append(self._record)
                self._record = None
        return flow

    def _opened(self) -> Flow[Connection]:
        flow = self._made_flow()
        if not flow.is_open:
            open_flow(flow, self._round)
        return flow

    @property
    def connection(self) -> Connection:
        """The connection in the open delivery transaction, opened now if it is not yet.

        Raises:
            LeaseLostError: the token is stale (the transaction is not opened).
            StoreError: the database failed opening it.
        """
        return self._opened().conn

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Enqueue follow-up events inside this transaction."""
        if not events:
            return []
        flow = self._opened()
        with flow.dialect.mapped(f"enqueue {len(events)} follow-up(s)", flow.conn):
            flow.check_usable()
            return flow.dialect.insert(flow.conn, events, flow.now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """Queue the record; it is written with the commit, in the same sync (or, for a
        delivery never opened, alone: see the class docstring).

        Raises:
            ConfigurationError: ``outcome`` is not one that is recorded.
        """
        if self._flow is None and self._record is None:
            self._record = record_params(self._claim, handler, outcome, reason, self._now)
        else:
            self._made_flow().record(handler, outcome, reason)

    def __enter__(self) -> Delivery:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._flow is None:
            if exc is not None:
                return  # never opened: it wrote nothing, there is nothing to undo
            record = self._record
            if record is not None:
                if self._batch is not None:
                    self._batch.keep(self._claim, record)  # written with the settlement
                    return
                if self._round is not None and self._round.send(self._claim, record, self._conn):
                    return
        flow = self._made_flow()
        if exc is not None:
            self._fail(flow, exc)
            return  # the block's own exception goes on as it is
        try:
            self._commit(flow)
        except BaseException as failure:
            self._fail(flow, failure)
            raise

    def _commit(self, flow: Flow[Connection]) -> None:
        """End ``flow``'s delivery normally: its record and commit (or what is kept)."""
        round_ = self._round
        if flow.open_error is not None:
            raise flow.open_error  # the handler swallowed it: the delivery fails all the same
        if flow.must_open():
            open_flow(flow, round_)
        if self._batch is not None and not flow.is_open:
            self._batch.keep(self._claim, flow.records[0])
        elif (
            round_ is None
            or flow.is_open
            or not round_.send(self._claim, flow.records[0], self._conn)
        ):
            flow.closed(close(flow, self._conn))

    def _fail(self, flow: Flow[Connection], failure: BaseException) -> None:
        """Roll the delivery back after ``failure``; raise the error it is for the delivery
        (``Flow.error_for``) when that is another (returns when it is ``failure`` itself). A
        handler that ended the batch's transaction fails with ``BatchRolledBack``, the batch
        begun afresh (``restart``)."""
        error = flow.error_for(failure)
        conn = self._conn
        if flow.is_open or self._round is None:  # a round's unopened delivery: nothing to undo
            aborted = abort_quietly(conn, flow.aborting())
            if self._batch is not None:
                if flow.lost_batch(aborted):
                    error = restart(self._batch, conn, error)
            else:
                resets = flow.resetting()
                if resets is None or not abort_quietly(conn, resets):
                    conn.close()  # left in a transaction, or as the handler set it: discarded
        if error is not failure:
            raise error from failure


def restart(batch: Batch, conn: Connection, failure: BaseException) -> BaseException:
    """Begin ``batch`` afresh after a handler ended its transaction (``BatchGuard.restarted``);
    the error the handler's delivery fails with.

    Raises:
        StoreError: the connection could not be set right (the batch is abandoned).
    """
    if not abort_quietly(conn, batch.restarting()):
        raise batch.unusable() from failure
    resets, error = batch.restarted(failure)
    if not abort_quietly(conn, resets):
        raise batch.unusable() from failure
    return error


class Batch(BatchGuard, SQLBatch):
    """One transaction for a claimed batch (see ``PostgresStore.batch``)."""

    store: PostgresStore
    conn: Connection

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[Delivery]:
        self._check_for_delivery()
        return Delivery(self.store.dialect, self.conn, claim, now, self)

    def begin(self) -> None:
        """``SQLBatch.begin``: the batch's ``BEGIN``, if no delivery sent it yet."""
        if not self.begun:
            with self.store.dialect.mapped("begin the batch", self.conn):
                _sync(self.conn, self.beginning())
            self.began()

    def commit(self) -> None:
        """Commit the batch's transaction.

        Raises:
            StoreError: the database failed (the caller rolls back).
        """
        with self.store.dialect.mapped("commit the batch", self.conn):
            self.conn.execute(b"COMMIT")
        self.ended()

    def abort(self) -> None:
        """Roll the batch's transaction back after a failure that ends the batch (quietly: the
        failure is the error to see); a connection that cannot is discarded."""
        if self.begun and not (abort_quietly(self.conn, (b"ROLLBACK",)) and self.ended()):
            self.conn.close()

    def _where(self) -> str:
        return self.store.where


delivering = Delivery
"""``delivering(dialect, conn, claim, now, batch=None, round_=None)``: a delivery on ``conn``, its
own transaction, a savepoint of ``batch``'s, or one of a per-event round's (``Delivery``)."""


def open_flow(flow: Flow[Connection], round_: Round | None = None) -> None:
    """Open ``flow``'s transaction now: its first pipeline sync (after the round's pipelined
    records, read back first). What it raises is kept as the delivery's error
    (``Flow.open_error``), whatever the handler that asked makes of it.

    Raises:
        LeaseLostError: the token is stale.
        StoreError: the database failed (mapped).
    """
    try:
        if round_ is not None:
            round_.before_use()
        try:
            results = _sync(flow.conn, flow.opening())
        except PREPARED_STALE:  # see ``Flow.reopening``
            if not abort_quietly(flow.conn, flow.reopening()):
                raise
            results = _sync(flow.conn, flow.opening())
        flow.opened(results)
    except BaseException as exc:
        error = flow.open_failed(exc)
        if error is exc:
            raise
        raise error from exc


def close(flow: Flow[Connection], conn: Connection) -> list[Result]:
    """Send ``flow``'s last sync (its records and commit); once more from the savepoint
    before the records when a record's prepared statement was gone (see ``Flow.reclosing``)."""
    statements = flow.closing()
    try:
        return _sync(conn, statements)
    except PREPARED_STALE:
        if not flow.is_open:
            raise
        return _sync(conn, flow.reclosing())


def _sync(conn: Connection, statements: Sequence[Statement]) -> list[Result]:
    """Send ``statements`` in one pipeline sync (``pipeline.fly``; through psycopg one alone,
    without a pipeline, whose entry and exit cost more than the statement, and all of them on
    a connection psycopg is to begin a transaction on: ``implicit_begin``); what each
    returned."""
    if len(statements) > 1 and not implicit_begin(conn):
        return fly(conn, statements)
    if len(statements) == 1:
        (statement,) = statements
        cursor = conn.cursor(row_factory=tuple_row).execute(statement.query, statement.params)
        rows = cursor.fetchall() if has_rows(cursor) else []
        return [Result(cursor.rowcount, rows)]
    with conn.pipeline():
        cursors = [
            conn.cursor(row_factory=tuple_row).execute(s.query, s.params) for s in statements
        ]
    return [Result(c.rowcount, c.fetchall() if has_rows(c) else []) for c in cursors]


def abort_quietly(conn: Connection, statements: Sequence[bytes]) -> bool:
    """Roll a delivery back, quietly: the error that brought us here is the one to report, and
    a connection that cannot roll back is discarded by the pool. Whether every statement ran."""
    try:
        for statement in statements:
            conn.execute(statement)
    except psycopg.Error as exc:
        log.debug("rollback of a delivery failed: %s", exc)
        return False
    return True


class _Line:
    """One of a round's connections, with the records pipelined on it."""

    def __init__(self, lease: AbstractContextManager[Connection], conn: Connection) -> None:
        self.lease = lease
        self.conn = conn
        self.pipeline: RecordPipeline | None = None

    @property
    def pending(self) -> bool:
        return self.pipeline is not None and self.pipeline.pending


class Round(DeliveriesBase):
    """The deliveries of one per-event round (``PostgresStore.rounds``): each delivery a
    transaction of its own, as on the store, on one pooled connection held for the round (a
    fresh one after a delivery that left it unusable). A delivery that never opened its
    transaction sends its fenced record without waiting for it (``pipeline``), on up to
    ``concurrency`` connections in turn, so that PostgreSQL commits several at once (one WAL
    flush serves the commits that wait for it together). Every result is read before a
    delivery opens its transaction, before a lease extension and the settlement (on the first
    connection), and when the round ends.

    A connection lost with records unanswered ends the round: their fate is unknown, so no
    later step of the round may settle anything (each raises the loss); the events recover by
    their leases, and a record that did commit keeps its handler from running again.
    """

    def __init__(self, store: PostgresStore, concurrency: int = 1) -> None:
        self._store = store
        self._dialect = store.dialect
        self._lines: list[_Line | None] = [None] * concurrency
        self._next = 0  # the line the next pipelined record goes to
        self._lost: StoreError | None = None

    def _line(self, index: int, doing: str) -> _Line:
        if self._lost is not None:
            raise self._lost
        line = self._lines[index]
        if line is None:
            lease = self._dialect.connection(doing)
            line = self._lines[index] = _Line(lease, lease.__enter__())
        return line

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[Delivery]:
        """``PostgresStore.delivery`` on the round's first connection."""
        line = self._line(0, f"deliver event {claim.event.id}")
        conn = line.conn
        try:
            with delivering(self._dialect, conn, claim, now, round_=self) as tx:
                yield tx
        finally:
            if conn.closed or conn.broken or not (line.pending or _idle(conn)):
                self._release(0, broken=True)  # left unusable: the pool discards it

    def send(self, claim: Claim, record: Mapping[str, Any], conn: Connection) -> bool:
        """Send ``claim``'s fenced record (``record_params``) pipelined, on the next of the
        round's connections (``conn``, the deliveries', first); False when that connection
        cannot (the caller then writes it as usual, on ``conn``).

        Raises:
            StoreError: the connection failed taking it (the round ends: ``_release``).
        """
        index = self._next
        line = self._line(index, f"record the delivery of event {claim.event.id}")
        if line.pipeline is None:
            if not RecordPipeline.usable(line.conn):
                return False
            line.pipeline = RecordPipeline(self._dialect, line.conn)
        self._next = (index + 1) % len(self._lines)
        try:
            line.pipeline.send(claim, record)
        except StoreError as exc:
            self._lost = exc
            self._release(index, broken=True)
            raise
        return True

    def before_use(self) -> None:
        """Read every pipelined record back before psycopg uses a connection of the round
        again (it cannot while the connection is in pipeline mode).

        Raises:
            StoreError: a record failed, or a connection did (the round ends).
        """
        if self._lost is not None:
            raise self._lost
        for index, line in enumerate(self._lines):
            if line is None or line.pipeline is None:
                continue
            try:
                drain(line.pipeline)
            except StoreError as exc:
                self._lost = exc
                self._release(index, broken=True)
                raise

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        doing = f"extend {len(claims)} lease(s)"
        conn = self._line(0, doing).conn
        self.before_use()
        with self._dialect.mapped(doing, conn):
            return self._store.extend_on(conn, claims, lease, now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``PostgresStore.settle_many`` after every pipelined record is read back: a refused
        record's event is refused here too (the same token), which reports the lost lease."""
        if not items:
            self.before_use()
            return []
        doing = f"settle {len(items)} event(s)"
        conn = self._line(0, doing).conn
        self.before_use()
        with self._dialect.mapped(doing, conn):
            return self._store.settle_many_on(conn, items, now)

    def close(self, failed: bool = False) -> None:
        """End the round: read what is pending and hand the connections back. After a
        failure they go back as they are (the pool rolls them back, or discards them closed).

        Raises:
            StoreError: a record failed, or a connection was lost with records unanswered.
        """
        try:
            if not failed:
                self.before_use()
        finally:
            for index in range(len(self._lines)):
                self._release(index, broken=failed)

    def _release(self, index: int, broken: bool = False) -> None:
        line, self._lines[index] = self._lines[index], None
        if line is None:
            return
        if line.pending and self._lost is None:
            self._lost = StoreUnavailable(
                f"PostgreSQL at {self._dialect.where}: the connection was lost with delivery "
                "records unanswered; their events recover by their leases"
            )
        if not broken:
            line.lease.__exit__(None, None, None)
            return
        conn = line.conn
        if not conn.closed and conn.pgconn.pipeline_status != _PIPELINE_OFF:
            conn.close()  # records unread: it can neither be read back nor reused
        line.lease.__exit__(_Abandoned, _Abandoned(), None)  # the pool rolls back, or discards


class _Abandoned(Exception):
    """Handed to the pool's exit for a connection the round leaves unusable: the pool rolls
    it back (or discards it, closed) instead of committing."""


def _idle(conn: Connection) -> bool:
    return conn.pgconn.transaction_status == _IDLE


_IDLE = int(TransactionStatus.IDLE)
_PIPELINE_OFF = int(PipelineStatus.OFF)
