"""Delivery records sent without waiting for them: libpq's pipeline mode on one connection.

A per-event round (``PostgresStore.round``) delivers its events one after another on one
connection. A delivery whose handler never took the connection ends as one statement, the
record fenced by the claim token (``insert_record_fenced``), committed on its own. Waiting for
each one's commit before the next handler runs puts the poller's own work and the server's
commit (its WAL flush) end to end; sent in pipeline mode, each followed by a sync of its own,
the record still commits alone, in order, while the poller goes on with the next event. The
results are read when they arrive, and all of them before anything else uses the connection
(a delivery that opens its transaction, a lease extension, the round's settlement) and when
the round ends.

A record the token refused (the event's lease was taken over) wrote nothing, and the event's
settlement, fenced by the same token, is refused too: the shell reports the lost lease then,
as it does for a batch's kept records. A record that failed (the database's error) fails the
round when it is read: the event recovers by its lease, as after any database failure.

The statement is prepared under a name of outboxkit's own, once per connection: the
connection's prepared names are known (``_PREPARED``, the delivery flights' too), so a later
round sends no prepare the server would refuse (a duplicate prepare is an error in the server's
log, and its parse is wasted). One that is gone (psycopg sends ``DEALLOCATE ALL`` after it saw
a ``ROLLBACK``; a handler may run it itself) fails its record in the record's own sync, which
wrote nothing: the record is sent again behind a new prepare. Without prepared statements
(``prepare_threshold=None``, for PgBouncer in transaction mode) a round waits for each record
as before.

``RecordPipeline`` is the protocol, written once: what is sent, and how the results read so far
are taken in. The waiting is its callers': ``drain`` here for a blocking connection, and
``outboxkit_pg.aio`` for an async one.
"""

from __future__ import annotations

import hashlib
import select
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.postgres import types as pg_types

from outboxkit.core.model import Claim
from outboxkit.errors import StoreError

from .flow import Result, Statement
from .names import numbered
from .pool import AnyConnection

if TYPE_CHECKING:
    from .dialect import PostgresDialect

__all__ = [
    "PREPARED_STALE",
    "Flight",
    "RecordPipeline",
    "drain",
    "flight_result",
    "fly",
    "implicit_begin",
]

_STATEMENT = "outboxkit_record_{}"
"""The prepared statement's name, with a digest of its text: stores of other schemas or tables
may take turns on one connection (a pool of the app's). psycopg names its own ``_pg3_<n>``."""

_TYPES = {
    "event_id": pg_types["int8"].oid,
    "token": pg_types["uuid"].oid,
    "handler": pg_types["text"].oid,
    "outcome": pg_types["text"].oid,
    "attempt": pg_types["int4"].oid,
    "now": pg_types["timestamptz"].oid,
    "reason": pg_types["text"].oid,
}
_DUPLICATE_PREPARED = pg_errors.DuplicatePreparedStatement.sqlstate
_DUPLICATE = str(_DUPLICATE_PREPARED).encode()  # as a result's error field carries it
_SQLSTATE = pq.DiagnosticField.SQLSTATE
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
_PIPELINE_OFF = pq.PipelineStatus.OFF
_IDLE = pq.TransactionStatus.IDLE
_BAD = pq.ConnStatus.BAD
_PREPARE = None  # what ``sent`` holds for the prepare's sync
_GONE = pg_errors.InvalidSqlStatementName.sqlstate

_PREPARED: weakref.WeakKeyDictionary[AnyConnection, set[bytes]] = weakref.WeakKeyDictionary()
"""The statements prepared on each connection by its flights (``Statement.prepare``) and its
rounds' records (``RecordPipeline``). One the server says is gone (psycopg sends ``DEALLOCATE
ALL`` after it saw a ``ROLLBACK``, ``DROP`` or ``ALTER``; a handler may run it) is forgotten,
and only that one: preparing a statement that still exists would fail (an error in the
server's log), and abort the transaction it is sent in."""


class _Record:
    """A record sent and not read back yet: what it would be sent again with."""

    __slots__ = ("claim", "resent", "values")

    def __init__(self, claim: Claim, values: list[bytes | None], resent: bool) -> None:
        self.claim = claim
        self.values = values
        self.resent = resent


class RecordPipeline:
    """The fenced records a round sent on ``conn`` and has not read back yet.

    Args:
        dialect: the store's dialect, whose statement and error mapping are used.
        conn: the round's connection (blocking or async: only its ``pgconn`` is used, while
            records are pending).
    """

    def __init__(self, dialect: PostgresDialect, conn: AnyConnection) -> None:
        self._dialect = dialect
        self.conn = conn
        self.pgconn = conn.pgconn
        self._query, self._order = dialect.queries.positional("insert_record_fenced")
        digest = hashlib.blake2b(self._query, digest_size=12).hexdigest()
        self._name = _STATEMENT.format(digest).encode()
        self._types = [_TYPES[name] for name in self._order]
        self._encoding = conn.info.encoding
        self._sent: deque[_Record | None] = deque()  # one per sync sent, in order
        self._result: pq.abc.PGresult | None = None  # the head sync's result, until its sync
        self.refused: set[int] = set()  # events whose record the token refused
        self._error: StoreError | None = None

    @staticmethod
    def usable(conn: AnyConnection) -> bool:
        """Whether records may be pipelined on ``conn``: it prepares statements (not behind
        PgBouncer in transaction mode) and is idle, outside any transaction."""
        return (
            conn.prepare_threshold is not None
            and not conn.closed
            and conn.pgconn.transaction_status == _IDLE
            and psycopg.Pipeline.is_supported()
        )

    @property
    def pending(self) -> bool:
        """Whether records were sent whose results are not read yet."""
        return bool(self._sent)

    def send(self, claim: Claim, params: Mapping[str, Any]) -> None:
        """Send ``claim``'s fenced record (``record_params`` and the token) and its sync,
        without waiting; read whatever results have arrived.

        Raises:
            StoreUnavailable / StoreError: the connection failed to take it (mapped).
        """
        pg = self.pgconn
        values = {**params, "token": claim.token}
        texts = [self._text(values[name]) for name in self._order]
        try:
            if pg.pipeline_status == _PIPELINE_OFF:
                pg.enter_pipeline_mode()
            self._send(_Record(claim, texts, resent=False))
            pg.consume_input()
        except psycopg.Error as exc:
            raise self._dialect.error(
                exc, f"record the delivery of event {claim.event.id}"
            ) from exc
        self.take_results()

    def _send(self, record: _Record) -> None:
        """Send ``record`` in a sync of its own, behind the statement's prepare (in a sync of
        its own too) unless the connection has it."""
        pg = self.pgconn
        prepared = _PREPARED.setdefault(self.conn, set())
        if self._name not in prepared:
            pg.send_prepare(self._name, self._query, self._types)
            pg.pipeline_sync()
            self._sent.append(_PREPARE)
            prepared.add(self._name)  # the records sent behind it find it
        pg.send_query_prepared(self._name, record.values)
        pg.pipeline_sync()
        self._sent.append(record)
        pg.flush()  # what the socket does not take now goes with the next flush

    def _text(self, value: Any) -> bytes | None:
        """A parameter in PostgreSQL's text format.

        Raises:
            StoreError: text the connection's encoding cannot hold (as psycopg refuses it).
        """
        if value is None:
            return None
        if isinstance(value, datetime):
            return value.isoformat().encode()
        try:
            return str(value).encode(self._encoding)
        except UnicodeEncodeError as exc:
            raise StoreError(
                f"PostgreSQL at {self._dialect.where}: a delivery record's text cannot be "
                f"written in the connection's encoding ({self._encoding}): {exc.reason}"
            ) from None

    def take_results(self) -> None:
        """Take in the results libpq has read, without waiting for more.

        Raises:
            StoreUnavailable: the connection was lost (the results still pending never come).
        """
        pg = self.pgconn
        while self._sent and not pg.is_busy():
            result = pg.get_result()
            if result is None:
                if pg.status == _BAD:
                    raise self._lost()
                continue  # the end of one statement's results
            if result.status != _PIPELINE_SYNC:
                self._result = result
                continue
            sent, got, self._result = self._sent.popleft(), self._result, None
            self._read(sent, got)
        if self._sent and pg.status == _BAD:
            raise self._lost()

    def _lost(self) -> StoreError:
        """The error for a connection lost with results pending (the first failure read, if
        any: the server's reason)."""
        error, self._error = self._error, None
        if error is not None:
            return error
        message = self.pgconn.get_error_message(self._encoding) or "the connection was lost"
        return self._dialect.error(
            psycopg.OperationalError(message),
            f"read {len(self._sent)} delivery record(s) back",
            self.conn,
        )

    def _read(self, sent: _Record | None, result: pq.abc.PGresult | None) -> None:
        """What one sync's statement came back with: a refused or failed record is kept; one
        whose prepared statement was gone is sent again (it wrote nothing)."""
        if result is None:
            return
        if result.status == _TUPLES_OK:
            if sent is not None and result.ntuples == 0:
                self.refused.add(sent.claim.event.id)
            return
        if result.status == _COMMAND_OK:
            return
        error = pg_errors.error_from_result(result, encoding=self._encoding)
        if sent is _PREPARE:
            if error.sqlstate == _DUPLICATE_PREPARED:
                return  # prepared in this session already
            _PREPARED.get(self.conn, set()).discard(self._name)
        elif error.sqlstate == _GONE and not sent.resent and self._error is None:
            if _PREPARE not in self._sent:  # else prepared again since, by a record before it
                _PREPARED.get(self.conn, set()).discard(self._name)
            try:
                self._send(_Record(sent.claim, sent.values, resent=True))
            except psycopg.Error as exc:
                error = exc
            else:
                return
        if self._error is None:
            what = "prepare the delivery record" if sent is None else f"event {sent.claim.event.id}"
            if isinstance(error, pg_errors.UniqueViolation):
                self._error = StoreError(f"{what} already has a delivery record")
            else:
                self._error = self._dialect.error(
                    error, f"record the delivery of {what}", self.conn
                )

    def wants_write(self) -> bool:
        """Flush what is left to send; whether some is still left (then wait to write)."""
        try:
            return bool(self.pgconn.flush())
        except psycopg.Error as exc:
            raise self._dialect.error(exc, "send the delivery records", self.conn) from exc

    def socket(self) -> int:
        """The connection's socket, to wait on.

        Raises:
            StoreUnavailable: the connection is gone.
        """
        try:
            return self.pgconn.socket
        except psycopg.Error:
            raise self._lost() from None

    def readable(self) -> None:
        """The socket has data: read it and take in the results."""
        try:
            self.pgconn.consume_input()
        except psycopg.Error as exc:
            raise self._dialect.error(exc, "read the delivery records", self.conn) from exc
        self.take_results()

    def finish(self) -> None:
        """Every result was read: leave pipeline mode (the connection is psycopg's again) and
        raise the first failure.

        Raises:
            StoreError: a record failed (the first failure, mapped).
        """
        pg = self.pgconn
        if pg.pipeline_status != _PIPELINE_OFF:
            try:
                pg.exit_pipeline_mode()
            except psycopg.Error as exc:
                raise self._dialect.error(exc, "end the delivery records", self.conn) from exc
        error, self._error = self._error, None
        if error is not None:
            raise error


def drain(pipeline: RecordPipeline | None) -> None:
    """Wait for every result ``pipeline`` has pending, on its blocking connection, and leave
    pipeline mode.

    Raises:
        StoreError: a record failed, or the connection did (mapped).
    """
    if pipeline is None:
        return
    while pipeline.pending:
        writing = pipeline.wants_write()
        if pipeline.pgconn.is_busy() or writing:
            fd = pipeline.socket()
            readable, _, _ = select.select([fd], [fd] if writing else [], [])
            if readable:
                pipeline.readable()
        else:
            pipeline.take_results()
    pipeline.finish()


# -- a delivery's pipeline syncs, on libpq directly ------------------------------------------------

_FLIGHT_TYPES = {
    **_TYPES,
    "id": pg_types["int8"].oid,
    "mark": pg_types["bool"].oid,
    "last": pg_types["bool"].oid,
}
_FATAL = pq.ExecStatus.FATAL_ERROR
_ABORTED = pq.ExecStatus.PIPELINE_ABORTED


class _Form:
    """A statement as libpq takes it: numbered parameters, their names in that order and
    their types, and the name it is prepared under."""

    __slots__ = ("name", "order", "query", "types")

    def __init__(self, query: bytes) -> None:
        self.query, self.order = numbered(query)
        self.types = [_FLIGHT_TYPES.get(name, 0) for name in self.order]
        digest = hashlib.blake2b(self.query, digest_size=12).hexdigest()
        self.name = f"outboxkit_{digest}".encode()


_FORMS: dict[bytes, _Form] = {}
"""Each statement's ``_Form``, made at its first flight (a handful: the deliveries')."""

PREPARED_STALE = (pg_errors.InvalidSqlStatementName, pg_errors.DuplicatePreparedStatement)
"""What a flight raises when what it knew of the connection's prepared statements was stale:
one it ran was gone, or one it prepared was there already. It knows better now: sent again,
the flight prepares (or runs) the statement as the server has it."""


class Flight:
    """One pipeline sync of a delivery's statements (``flow.Statement``: its opening, or its
    records and commit), sent on libpq directly: psycopg's pipeline costs more Python per
    statement (~20 µs) than a round trip on one host, which the sync exists to save. A
    statement with ``prepare`` runs under a name of outboxkit's own, prepared in the same
    sync the first time a connection sends it; the others run unnamed (statements without
    parameters, and those sent once a batch). Values go in PostgreSQL's text format.

    The waiting is the callers' (``fly`` here; ``outboxkit_pg.aio`` for an async connection):
    ``send``, then ``read`` each time the socket is readable until it returns the results.
    """

    __slots__ = ("_conn", "_got", "_kinds", "_new", "_pg", "_used")

    def __init__(self, conn: AnyConnection) -> None:
        self._conn = conn
        self._pg = conn.pgconn
        self._kinds: list[
            bool
        ] = []  # per result expected: True for a statement's, False a prepare's
        self._got: list[pq.abc.PGresult] = []
        self._new: list[bytes] = []  # prepared in this flight (known once it succeeded)
        self._used: list[bytes] = []  # run under a name prepared by an earlier flight

    def send(self, statements: Sequence[Statement]) -> bool:
        """Send ``statements`` and their sync; whether some is still to be flushed.

        Raises:
            psycopg.Error: libpq refused (the connection is gone).
        """
        pg, conn = self._pg, self._conn
        kinds = self._kinds
        prepares = conn.prepare_threshold is not None
        prepared = _PREPARED.get(conn) if prepares else None
        encoding = ""
        pg.enter_pipeline_mode()
        for statement in statements:
            params = statement.params
            if params is None:
                pg.send_query_params(statement.query, None)
                kinds.append(True)
                continue
            form = _FORMS.get(statement.query)
            if form is None:
                form = _FORMS[statement.query] = _Form(statement.query)
            if not encoding:
                encoding = conn.info.encoding
            values = [_flight_text(params[name], encoding) for name in form.order]
            if statement.prepare and prepares:
                if (prepared is None or form.name not in prepared) and form.name not in self._new:
                    pg.send_prepare(form.name, form.query, form.types)
                    kinds.append(False)
                    self._new.append(form.name)
                elif form.name not in self._new:
                    self._used.append(form.name)
                pg.send_query_prepared(form.name, values)
            else:
                pg.send_query_params(form.query, values, form.types)
            kinds.append(True)
        pg.pipeline_sync()
        return bool(pg.flush())

    def flush(self) -> bool:
        """Send what is left; whether some still is."""
        return bool(self._pg.flush())

    def read(self) -> list[pq.abc.PGresult] | None:
        """Take in what arrived; every statement's result once the sync's end came (None:
        wait until the socket is readable, and read again).

        Raises:
            psycopg.Error: a statement failed (the first failure: the rest did not run), or
                the connection was lost.
        """
        pg = self._pg
        pg.consume_input()
        while not pg.is_busy():
            result = pg.get_result()
            if result is None:
                if pg.status == _BAD:
                    raise psycopg.OperationalError(
                        pg.get_error_message(self._conn.info.encoding) or "connection lost"
                    )
                continue
            if result.status != _PIPELINE_SYNC:
                self._got.append(result)
                continue
            pg.exit_pipeline_mode()
            return self._done()
        if pg.status == _BAD:
            raise psycopg.OperationalError(
                pg.get_error_message(self._conn.info.encoding) or "connection lost"
            )
        return None

    def _done(self) -> list[pq.abc.PGresult]:
        results: list[pq.abc.PGresult] = []
        failed: pq.abc.PGresult | None = None
        prepared: list[bytes] = []  # the prepares the server took (kept: not transactional)
        new = iter(self._new)
        for kind, result in zip(self._kinds, self._got, strict=True):
            if result.status in (_FATAL, _ABORTED) and failed is None:
                failed = result
            if kind:
                results.append(result)
                continue
            name = next(new)
            if result.status not in (_FATAL, _ABORTED) or (
                result.error_field(_SQLSTATE) == _DUPLICATE
            ):
                prepared.append(name)  # prepared now, or there already
        if prepared:
            _PREPARED.setdefault(self._conn, set()).update(prepared)
        if failed is not None:
            if failed.status == _ABORTED:  # a prepare failed before it: its error came first
                raise psycopg.OperationalError("a delivery's pipeline was aborted")
            error = pg_errors.error_from_result(failed, encoding=self._conn.info.encoding)
            if isinstance(error, pg_errors.InvalidSqlStatementName):
                _PREPARED.get(self._conn, set()).difference_update(self._used)
            raise error
        return results


def implicit_begin(conn: AnyConnection) -> bool:
    """Whether psycopg would begin a transaction before the next statement on ``conn`` (a
    connection without autocommit, idle: an app's own, Django's), with the isolation level
    and access mode the app set on it: a flight, which psycopg does not see, must not be sent
    there (the delivery's syncs go through psycopg's own pipeline instead)."""
    return not conn.autocommit and conn.pgconn.transaction_status == _IDLE


def _flight_text(value: Any, encoding: str) -> bytes | None:
    """A parameter in PostgreSQL's text format."""
    if value is None:
        return None
    if value is True:
        return b"t"
    if value is False:
        return b"f"
    if isinstance(value, datetime):
        return value.isoformat().encode()
    return str(value).encode(encoding)


def fly(conn: psycopg.Connection[Any], statements: Sequence[Statement]) -> list[Result]:
    """Send ``statements`` in one pipeline sync (``Flight``) on a blocking connection and wait
    for what each returned. A failure or an interruption while results are pending leaves
    the connection unusable: it is closed (its pool discards it).

    Raises:
        psycopg.Error: a statement failed, or the connection did.
    """
    flight = Flight(conn)
    try:
        with conn.lock:
            writing = flight.send(statements)
            fd = conn.pgconn.socket
            while True:
                readable, _, _ = select.select([fd], [fd] if writing else [], [])
                if writing:
                    writing = flight.flush()
                if readable:
                    got = flight.read()
                    if got is not None:
                        return [flight_result(r) for r in got]
    except psycopg.Error:
        if conn.pgconn.pipeline_status != _PIPELINE_OFF:
            conn.close()
        raise
    except BaseException:
        conn.close()  # results pending: it can be neither read back nor reused
        raise


def flight_result(result: pq.abc.PGresult) -> Result:
    """A flight's statement result as a delivery reads it: its row count (rows returned, or
    the rows its command changed) and as many placeholder rows as it returned (a delivery
    only asks whether there were any)."""
    if result.status == _TUPLES_OK:
        count = result.ntuples
        return Result(count, [()] * count)
    status = result.command_status
    tail = status.rsplit(b" ", 1)[-1] if status else b""
    return Result(int(tail) if tail.isdigit() else -1, [])
