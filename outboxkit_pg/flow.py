"""What a PostgreSQL delivery does, whichever way it waits: the statements of its two pipeline
syncs, how their results are read, and which error it raises when something fails.

The blocking delivery (``delivery``) and the asyncio one (``aio``) are thin shells around a
``Flow``, as psycopg's own blocking and async connections are around its generators: each shell
sends ``flow.opening()`` in one pipeline sync and hands the results to ``flow.opened``, yields
the delivery transaction, and sends ``flow.closing()`` in one more sync. On any exception it
asks ``flow.error_for(exc)`` which error to raise - before rolling back, since the rollback
changes the state that decision reads - then rolls back with ``flow.aborting()``. Only the
waiting is the shell's own.

Round trips: the transaction (or savepoint) opens in the same pipeline sync as the row lock,
and the record and the COMMIT go in one more sync at the end: a one-handler event costs the
handler's own statements plus two (``tests/integration/pg/test_delivery_budget.py`` pins the
counts per path). A sync of several statements is sent on libpq directly (``pipeline.Flight``,
the row lock prepared under a name of outboxkit's own): psycopg's own pipeline costs more
Python per statement than a round trip on one host.

The commit guard (``migration_2`` in ``queries.sql``): ``lock_for_delivery`` marks the
transaction as holding an open delivery and touches the event row, which queues a deferred
trigger; ``close_delivery`` (``migration_7``) checks the mark, writes the record and clears the
mark with the session's reset; at COMMIT the trigger refuses to commit while a delivery is
open. So a handler's own ``COMMIT`` through ``ctx.connection`` fails and rolls back
everything, and the delivery counts as a handler failure. In a batch the trigger is queued
once, outside every savepoint (``lock_for_delivery`` without the mark), and each delivery locks
and marks its row in its own savepoint (``lock_in_batch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import ExecStatus, TransactionStatus

from outboxkit.core.model import Claim, Outcome
from outboxkit.errors import (
    BatchRolledBack,
    HandlerCrashed,
    LeaseLostError,
    Reject,
    StoreError,
    StoreUnavailable,
)
from outboxkit.storekit.rows import record_params

from .errors import session_ended_by_handler
from .pool import AnyConnection, hold_transaction, release_transaction

if TYPE_CHECKING:
    from .dialect import PostgresDialect

__all__ = [
    "BatchGuard",
    "Flow",
    "Frame",
    "Result",
    "Statement",
    "Transaction",
    "check_batch_open",
    "check_usable",
]


RESET_ROLE = b"RESET ROLE"
"""R18: a role the handler took (``SET ROLE``) ends with its run: sent before the delivery's
records, which are outboxkit's writes, not the handler's (``RESET ALL`` keeps the role)."""

RESET_SESSION = b"RESET ALL"
"""R18: a delivery's session settings (``SET statement_timeout``, ``SET search_path`` ...)
end with it. A delivery that commits has ``close_delivery`` run it after its last record (the
reset ends their open-delivery mark too), before its COMMIT (or the release of its savepoint);
one that failed is rolled back and sends it (``SESSION_RESETS``)."""

ENDED_UNDER_HANDLER = "OBX17"
"""The SQLSTATE ``close_delivery`` raises when the transaction is not the one outboxkit opened
for the delivery (R17, ``migration_7``)."""

_RECORDS_SAVEPOINT = b"SAVEPOINT outboxkit_records"
_RECORDS_ROLLBACK = b"ROLLBACK TO SAVEPOINT outboxkit_records"
"""The savepoint before a delivery's records (``Flow.closing``, ``Flow.reclosing``)."""

SESSION_RESETS = (RESET_SESSION, RESET_ROLE)
"""R18 for a delivery that failed: whatever the handler left on its session, taken back."""


@dataclass(frozen=True, slots=True)
class Frame:
    """How a delivery opens, ends and abandons its transaction (or its savepoint of a batch's):
    the statements sent in the pipeline syncs around the delivery.

    ``reset``: what the session needs once an abandoned delivery is rolled back (R18): the
    settings a handler may have left outside the transaction (after ending it).
    """

    begin: bytes  # empty: psycopg begins (a connection without autocommit)
    end: bytes
    abort: tuple[bytes, ...]
    reset: tuple[bytes, ...] = ()


# An autocommit connection (the store's own pool): outboxkit begins the transaction and holds
# it (``pool.hold_transaction``) until it ends.
TRANSACTION = Frame(begin=b"BEGIN", end=b"COMMIT", abort=(b"ROLLBACK",), reset=SESSION_RESETS)
# A connection without autocommit (a pool of the app's own): psycopg begins the transaction;
# the reset is then a transaction of its own.
IMPLICIT = Frame(begin=b"", end=b"COMMIT", abort=(b"ROLLBACK",), reset=(*SESSION_RESETS, b"COMMIT"))
SAVEPOINT = Frame(
    begin=b"SAVEPOINT outboxkit_delivery",
    end=b"RELEASE SAVEPOINT outboxkit_delivery",
    abort=(b"ROLLBACK TO SAVEPOINT outboxkit_delivery", b"RELEASE SAVEPOINT outboxkit_delivery"),
)


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of a pipeline sync, with its bound values (None: no parameters).
    ``prepare``: one a delivery sends every time, run prepared (``pipeline.Flight``)."""

    query: bytes
    params: Mapping[str, Any] | None = None
    prepare: bool = False


@dataclass(frozen=True, slots=True)
class Result:
    """What one statement of a pipeline sync returned: its row count and rows (none for a
    statement without a result, such as ``BEGIN``)."""

    rowcount: int
    rows: Sequence[tuple[Any, ...]]


class BatchGuard:
    """What both sides' batch transactions share beyond ``SQLBatch``: whether the commit
    guard's trigger is already queued in the batch's transaction (its deliveries' flows read
    and set it), and the refusal of a step once that transaction has ended."""

    guarded: bool = False
    # Whether a delivery opened its savepoint (its handler was given the connection) since the
    # transaction was last checked for a delivery: only such a handler can end it (a lost
    # connection fails the next statement, and the batch's own writes check it anyway).
    taken: bool = True
    # Whether the batch's transaction has begun. On an autocommit connection (the store's own
    # pool) it begins lazily: with the first delivery that opens its savepoint (``BEGIN`` in
    # the same pipeline sync) or a step that must be in it (``begin``: a lease extension, a
    # ``settle_many``, a settlement of more than one statement). A batch whose handlers never
    # took the connection settles (``settle_last``) in one statement, a transaction of its own:
    # no BEGIN and no COMMIT, two round trips fewer.
    begun: bool = True
    # Whether outboxkit began the batch's transaction itself, on an autocommit connection, and
    # holds it (``pool.hold_transaction``) until it ends.
    held: bool = False
    conn: AnyConnection

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The delivery records written inside the batch's transaction so far, as (claim
        # token, handler): what a handler that ends that transaction takes with it.
        self.written: list[tuple[str, str]] = []

    def beginning(self) -> list[Statement]:
        """The statement that begins the batch's transaction on an autocommit connection
        (lazily: sent by the first delivery that opens its savepoint, or by ``begin``);
        ``began`` once it was answered."""
        self.begun = True
        return [Statement(b"BEGIN")]

    def began(self) -> None:
        """The batch's ``BEGIN`` was answered: outboxkit holds the transaction until it ends, so
        that a statement after a handler's rollback cannot commit on its own (R17)."""
        hold_transaction(self.conn)
        self.held = True

    def ended(self) -> bool:
        """The batch's transaction ended (committed, or rolled back): the connection is back to
        autocommit. False if it is not idle: the caller discards it."""
        if not self.held:
            return True
        self.held = False
        return release_transaction(self.conn)

    def restarting(self) -> list[bytes]:
        """A handler ended the batch's transaction (R17): what rolls back whatever it began
        instead, before ``restarted``."""
        conn = self.conn
        return [] if conn.info.transaction_status == TransactionStatus.IDLE else [b"ROLLBACK"]

    def restarted(self, failure: BaseException) -> tuple[list[bytes], BatchRolledBack]:
        """After ``restarting``: what resets the session (R18), and the error the handler's
        delivery fails with, naming the records the lost transaction held. The batch goes on:
        its transaction begins again (lazily, on an autocommit connection; at once, by psycopg,
        on one without), the commit guard is queued again.

        Raises:
            StoreError: the connection is not idle after the rollback.
        """
        if not self.ended():
            raise self.unusable()
        self.begun = not self.conn.autocommit
        self.guarded = self.taken = False
        undone, self.written = tuple(self.written), []
        error = BatchRolledBack(
            "a handler ended the batch's transaction (a commit or a rollback through "
            "ctx.connection); its delivery failed, and the batch's earlier work in that "
            f"transaction ({len(undone)} delivery record(s)) was rolled back and is redone: "
            f"{failure}",
            undone=undone,
            extensions_lost=True,
        )
        return list(SESSION_RESETS), error

    def unusable(self) -> StoreError:
        """The batch's connection could not be set right after a handler ended its
        transaction: the batch is abandoned (its events recover by their leases)."""
        return StoreError(
            f"PostgreSQL at {self._where()}: the batch's connection could not begin afresh "
            "after a handler ended its transaction; the batch is abandoned"
        )

    def _where(self) -> str:
        raise NotImplementedError

    def check_open(self) -> None:
        """``SQLBatch.check_open``: the batch's transaction, once begun, is still open.

        Raises:
            StoreError: a handler ended it, or the connection was lost (``check_batch_open``).
        """
        if self.begun:
            check_batch_open(self.conn, self._where())

    def _check_for_delivery(self) -> None:
        """``check_open`` before a delivery, if a handler had the connection since the last."""
        if self.taken:
            self.check_open()
            self.taken = False


C = TypeVar("C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])
"""The connection a flow runs on: a blocking one, or an async one."""

# The phases of a delivery: which error a failure is depends on when it happened.
_OPENING, _HANDLER, _CLOSING = "opening", "handler", "closing"


class Flow(Generic[C]):
    """One delivery of ``claim`` on ``conn``: its own transaction, or (``batch``) a savepoint
    of the batch's. See the module docstring for how a shell drives it.

    Raises:
        ConfigurationError: ``now`` is a naive datetime (before anything is sent).
    """

    def __init__(
        self,
        dialect: PostgresDialect,
        conn: C,
        claim: Claim,
        now: datetime | None,
        batch: BatchGuard | None = None,
    ) -> None:
        self.dialect: PostgresDialect = dialect
        self.conn: C = conn
        self.claim: Claim = claim
        self.now: datetime | None = now
        self._batch: BatchGuard | None = batch
        queries = dialect.queries
        if batch is None:
            self.frame = TRANSACTION if conn.autocommit else IMPLICIT
            self._lock = queries["lock_for_delivery"]
        else:
            self.frame, self._lock = SAVEPOINT, queries["lock_in_batch"]
        self._params = dialect.params(
            {"id": claim.event.id, "token": claim.token, "mark": batch is None}
        )
        dialect.params({"now": now})  # refused here if naive, before anything runs
        # The batch's first delivery (until one matches its row) also queues the guard's
        # trigger, outside its savepoint: a statement of its own, before the savepoint opens.
        self._guarding = batch is not None and not batch.guarded
        self._phase = _OPENING
        self.records: list[Mapping[str, Any]] = []  # written with the commit (closing)
        self._tail: list[Statement] = []  # the last sync from its records on (``reclosing``)
        # A delivery of its own opens lazily: only when the handler first takes the connection
        # (``open_error``: what that opening raised, whatever the handler made of it). One never
        # opened is, at its end, one fenced statement (``closing``).
        self.is_open = False
        self.open_error: BaseException | None = None
        # A lazy opening (the asyncio side's) failed after the handler took the connection and
        # left its transaction or savepoint open and failed (on purpose, for a stale token), so
        # that the handler's statements fail: rolled back at the end (``aborting``).
        self.failed_open = False
        self._batch_ended = False  # found by ``aborting``: see ``lost_batch``
        self._begins_batch = False  # its opening begins the batch's transaction
        # Whether the delivery's own transaction is held (``pool.hold_transaction``).
        self.holding = False

    @property
    def what(self) -> str:
        return f"event {self.claim.event.id}"

    # -- the first sync: open, lock the row, check the token ---------------------------------------

    def opening(self) -> list[Statement]:
        """The first pipeline sync: (the batch's BEGIN, its guard,) the transaction or
        savepoint, the row lock with the token check."""
        statements = []
        batch = self._batch
        if batch is not None:
            batch.taken = True  # the handler may use the batch's connection from now on
            if not batch.begun:  # the batch's transaction begins here (``BatchGuard.begun``)
                statements += batch.beginning()
                self._begins_batch = True
        if self._guarding:
            statements.append(Statement(self.dialect.queries["lock_for_delivery"], self._params))
        if self.frame.begin:
            statements.append(Statement(self.frame.begin))
        statements.append(Statement(self._lock, self._params, prepare=True))
        return statements

    def reopening(self) -> list[bytes]:
        """The opening failed because the row lock's prepared statement was gone (psycopg
        sends ``DEALLOCATE ALL`` after it saw a handler's ``ROLLBACK``, ``DROP`` or
        ``ALTER``; a handler may ``DISCARD ALL``), or there already (``PREPARED_STALE``):
        what undoes that opening, before ``opening`` is sent again (it prepares the
        statement anew, or runs it). Nothing else ran in it."""
        batch = self._batch
        if batch is None:
            return [self.frame.abort[0]]
        if self._begins_batch:  # its own BEGIN: nothing of the batch's is in there yet
            batch.begun = self._begins_batch = False
            return [b"ROLLBACK"]
        return list(SAVEPOINT.abort)

    def opened(self, results: Sequence[Result]) -> None:
        """Read the first sync's results; from now on the handler runs.

        Raises:
            LeaseLostError: the token is stale (the caller rolls back; nothing ran).
        """
        batch = self._batch
        if batch is None:
            if self.frame is TRANSACTION:  # begun: held until it ends (R17)
                hold_transaction(self.conn)
                self.holding = True
        elif self._begins_batch:
            batch.began()
        # The guard's statement comes before the savepoint and the row lock (and after the
        # batch's BEGIN, when this delivery begins it).
        if self._guarding and batch is not None and results[-3].rowcount == 1:
            batch.guarded = True
        if not results[-1].rows:
            raise LeaseLostError(f"{self.what}: claim token is stale")
        self.is_open = True
        self._phase = _HANDLER

    def open_failed(self, exc: BaseException) -> BaseException:
        """The error the failed opening ``exc`` is (``error_for``), kept as the delivery's
        error (``open_error``) whatever the handler that asked for the connection makes of it."""
        self.open_error = self.error_for(exc)
        return self.open_error

    def must_open(self) -> bool:
        """Whether the transaction must be opened before it can end: it is not open yet, and
        its end is not the single record that ``closing`` fences in one statement (or, in a
        batch, that the batch keeps: ``SQLBatch.keep``)."""
        return not self.is_open and len(self.records) != 1

    # -- while the handler runs ---------------------------------------------------------------------

    def check_usable(self) -> None:
        """The transaction is still the one outboxkit opened (see ``check_usable``)."""
        check_usable(self.conn, self.dialect.where, self.what)

    def record(self, handler: str, outcome: Outcome, reason: str | None) -> None:
        """Queue the record; it is written with the commit (``closing``), in the same sync.

        Raises:
            ConfigurationError: ``outcome`` is not one that is recorded.
            HandlerCrashed / StoreUnavailable: the transaction is no longer usable.
        """
        params = record_params(self.claim, handler, outcome, reason, self.now)
        if self.is_open:
            self.check_usable()
        self.records.append(params)

    # -- the last sync: the records and the commit ------------------------------------------------

    def closing(self) -> list[Statement]:
        """The last pipeline sync: the handler's role taken back (R18), then the queued
        records through ``close_delivery`` (each checking that the transaction is still the
        one outboxkit opened, R17; the last one resetting the session's settings, R18, which
        closes the delivery for the commit guard), and the COMMIT (or the release of the
        savepoint).

        A delivery never opened (``must_open`` is false) ends in one statement instead: the
        record inserted only if the token still holds, the row locked meanwhile
        (``insert_record_fenced``), autocommitted (or committed with it, on a connection
        without autocommit); ``closed`` reads whether it held.

        Raises:
            HandlerCrashed / StoreUnavailable: the handler left the transaction unusable.
        """
        if not self.is_open:
            self._phase = _CLOSING
            fenced = Statement(
                self.dialect.queries["insert_record_fenced"],
                {**self.records[0], "token": self.claim.token},
            )
            return [fenced] if self.frame is TRANSACTION else [fenced, Statement(b"COMMIT")]
        self.check_usable()
        self._phase = _CLOSING
        close: bytes = self.dialect.queries["close_delivery"]
        last, utc = len(self.records) - 1, self.dialect.pool.utc
        # The records run prepared (planned once per connection, not per delivery), behind a
        # savepoint: a statement psycopg deallocated under the handler fails only back to it
        # (``reclosing``), the handler's writes kept. ``utc``: RESET ALL took the session's
        # zone back to the server's default; the store's own sessions are in UTC
        # (``Pool.utc``), set again in the same statement, not by the pool's reset in a round
        # trip of its own when the connection comes back.
        tail: list[Statement] = [
            Statement(close, {**params, "last": i == last, "utc": utc}, prepare=True)
            for i, params in enumerate(self.records)
        ]
        tail.append(Statement(self.frame.end))
        self._tail = tail
        return [Statement(RESET_ROLE), Statement(_RECORDS_SAVEPOINT), *tail]

    def reclosing(self) -> list[Statement]:
        """The last sync again, after it failed on a record's prepared statement: gone
        (psycopg sends ``DEALLOCATE ALL`` after it saw a handler roll back to a savepoint of
        its own, ``DROP`` or ``ALTER``; a handler may deallocate it itself), or there already
        (prepared by a sync that failed after it). ``pipeline.Flight`` has taken the failure
        in, so the statement is prepared again, or run as it is; the transaction goes back
        to the savepoint before the records, which kept the handler's writes."""
        return [Statement(_RECORDS_ROLLBACK), *self._tail]

    def closed(self, results: Sequence[Result]) -> None:
        """Read the last sync's results.

        Raises:
            LeaseLostError: the fenced record of a delivery never opened found the token stale
                (nothing was written).
        """
        if not self.is_open:
            if not results[0].rows:
                raise LeaseLostError(f"{self.what}: claim token is stale")
        elif self._batch is not None:  # held by the batch's transaction until it commits
            token = self.claim.token
            self._batch.written += [(token, params["handler"]) for params in self.records]
        elif self.holding:  # committed: the connection is back to autocommit
            self.holding = False
            release_transaction(self.conn)

    # -- failures ---------------------------------------------------------------------------------

    def error_for(self, exc: BaseException) -> BaseException:
        """The error to raise for ``exc`` (``exc`` itself: re-raise it), by when it happened.
        Call it before rolling back: the decision reads the connection's state.

        - opening: a driver error is the database's (mapped);
        - the handler: the server ended the session under the handler (``conn.broken``) is
          ``StoreUnavailable`` whatever the handler raised, except the handler's own idling
          past ``idle_in_transaction_session_timeout``; a handler that ended the transaction
          itself (its COMMIT refused by the guard, a ROLLBACK) is ``HandlerCrashed``;
        - closing: a second record for the event is a ``StoreError``, any other driver error
          the database's (mapped).
        """
        conn, dialect = self.conn, self.dialect
        if self.open_error is not None:
            return self.open_error  # the lazy opening failed under the handler
        if self._phase == _OPENING:
            if isinstance(exc, psycopg.Error):
                return dialect.error(exc, f"deliver {self.what}", conn)
            return exc
        if self._phase == _CLOSING:
            if isinstance(exc, pg_errors.UniqueViolation):
                return StoreError(f"{self.what} already has a delivery record")
            if isinstance(exc, psycopg.Error) and exc.sqlstate == ENDED_UNDER_HANDLER:
                # close_delivery found the delivery's mark gone (R17): the transaction the
                # handler returned in is not the one outboxkit opened.
                return HandlerCrashed(
                    f"{self.what}: a handler rolled back its delivery transaction (or ended "
                    "it and began another) and went on; outboxkit commits the delivery "
                    "transaction together with the delivery record, so nothing of this "
                    "delivery was committed and it runs again"
                )
            if isinstance(exc, psycopg.Error):
                return dialect.error(exc, f"commit the delivery of {self.what}", conn)
            return exc
        if (
            conn.broken
            and isinstance(exc, Exception)
            and not isinstance(exc, StoreError)
            and not session_ended_by_handler(exc)
        ):
            # The server ended the session under the handler (a restart, a terminated
            # backend): the database failed, not the handler, whatever it raised then.
            return StoreUnavailable(
                f"PostgreSQL at {dialect.where} is unavailable (deliver {self.what}): the "
                "connection was lost while a handler ran"
            )
        if _ended_by_handler(conn, exc):
            return HandlerCrashed(
                f"{self.what}: a handler may not commit or roll back its delivery transaction "
                "(outboxkit commits it together with the delivery record); its writes were "
                f"rolled back: {exc}"
            )
        return exc

    def aborting(self) -> tuple[bytes, ...]:
        """The statements that roll the delivery back (to its savepoint); none when the
        connection is gone (the pool discards it) or idle. A batch's transaction found ended
        (idle) has nothing to roll back to: the handler ended it (``lost_batch``)."""
        conn = self.conn
        if conn.closed or conn.broken:
            return ()  # gone
        if not self.is_open and self._batch is not None and not self.failed_open:
            return ()  # a delivery in a batch that never opened its savepoint
        idle = conn.info.transaction_status == TransactionStatus.IDLE
        if self._batch is not None:
            self._batch_ended = idle
        return () if idle else self.frame.abort

    def resetting(self) -> tuple[bytes, ...] | None:
        """After ``aborting``'s statements ran, for a delivery of its own: the transaction
        outboxkit held is let go (autocommit back), and what resets the session of a
        delivery whose handler had the connection (R18). None: the connection is still in a
        transaction (the rollback failed), the caller discards it."""
        if self.holding:
            self.holding = False
            if not release_transaction(self.conn):
                return None
        return self.frame.reset if self.is_open else ()

    def lost_batch(self, aborted: bool) -> bool:
        """Whether this delivery's handler ended the transaction of the batch it ran in: it
        had the connection, which is still usable, and the transaction was found ended, or
        rolling back to the delivery's savepoint failed (``aborted`` is false: the savepoint
        is not in the transaction any more). See ``BatchGuard.restarting``."""
        conn = self.conn
        return (
            self._batch is not None
            and self.is_open
            and not conn.closed
            and not conn.broken
            and (self._batch_ended or not aborted)
        )


class Transaction(Generic[C]):
    """What both sides' delivery transactions (``DeliveryTransaction``) share: the flow they
    belong to, and its connection, the handler's ``ctx.connection``."""

    def __init__(self, flow: Flow[C]) -> None:
        self._flow: Flow[C] = flow

    @property
    def connection(self) -> C:
        return self._flow.conn

    def _following(self, events: Sequence[object]) -> str:
        """Before follow-ups are inserted: the transaction is still usable; what is done."""
        self._flow.check_usable()
        return f"enqueue {len(events)} follow-up(s)"


def has_rows(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    """Whether ``cursor``'s statement returned rows (a SELECT, a RETURNING): read from its
    result's status, where ``cursor.description`` would make a column object per column on
    every statement."""
    result = cursor.pgresult
    return result is not None and result.status == ExecStatus.TUPLES_OK


def check_usable(conn: AnyConnection, where: str, what: str) -> None:
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


_INTRANS = int(TransactionStatus.INTRANS)


def check_batch_open(conn: AnyConnection, where: str) -> None:
    """A batch whose transaction a handler ended would run every later step outside it
    (autocommitted): refuse them; the batch is abandoned and its events recover by their
    leases.

    Raises:
        StoreError: the batch's transaction is no longer open.
    """
    # pgconn's status, not conn.info's: that builds an object and an enum on every delivery.
    if conn.closed or conn.pgconn.transaction_status != _INTRANS:
        raise StoreError(
            f"PostgreSQL at {where}: the batch transaction is no longer open (a handler ended "
            "it, or the connection was lost); the batch is abandoned"
        )


def _ended_by_handler(conn: AnyConnection, exc: BaseException) -> bool:
    """Whether a handler's failure ``exc`` came with the delivery transaction ended under
    outboxkit (a raw COMMIT the commit guard refused, or a ROLLBACK): the connection is idle."""
    return (
        isinstance(exc, Exception)
        and not isinstance(exc, HandlerCrashed | LeaseLostError | Reject | StoreError)
        and not conn.closed
        and not conn.broken
        and conn.info.transaction_status == TransactionStatus.IDLE
    )
