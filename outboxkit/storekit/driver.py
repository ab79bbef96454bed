"""Helpers for a store on a DB-API driver: its own connections, and its errors mapped.

``ConnectionPool(connect, size, reset=..., close=...)`` makes a connection when none is idle,
keeps at most ``size`` idle ones, and closes a connection handed back ``broken`` (or one whose
``reset`` fails) instead of keeping it: a connection that failed, or whose transaction is in
doubt, never serves anyone else. ``reset(conn)`` runs before a connection is kept (R18: a
handler's session settings end with its delivery); it returns whether it could. A pool not
closed by the time the interpreter exits closes its idle connections then (``atexit``): a
driver that does not say goodbye when a connection is collected (PyMySQL) would otherwise
leave the server logging every one as aborted, at each poller's restart.

``MappedErrors(errors, mapper, doing)`` is a block whose driver errors become outboxkit's
(what a ``Dialect.mapped`` returns): a plain class, as a hot path enters several per event.

``PooledDialect`` is a ``Dialect`` whose connections are such a pool's: its ``connection``,
``read``, ``write``, ``mapped`` and ``close``, from the driver's error class and the store's
``map_error``; its ``rows``, ``execute`` and ``script`` run the store's statements on a cursor
(``run_script``: several in one round trip). ``GuardedConnection`` is the mixin of the store's
connection class that keeps a handler from ending its delivery transaction through the
driver's API (R17), and notes that a handler had the connection (R18).
``parse_server_url`` reads a database server's URL.

``LazyDelivery`` is the delivery transaction (``DeliveryTransaction``) of such a store, opened
when its handler first takes the connection (or, ``defer``, with the handler's first
statement, by a connection class that sends the opening ahead of it); the store writes how it
opens, commits and rolls back. A refusal of the opening stays, whatever the handler makes of
it (R6). ``PooledDelivery`` is the context manager ``Store.delivery`` returns for it (a
connection from the pool for the block), ``InBatch`` the one a batch's ``delivery`` returns:
a delivery never opened ends with its one record in a single fenced statement
(``LazyDelivery.fenced``), or kept for the batch's ``write_kept``. ``pooled_batch`` is what
``Store.batch`` returns.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import unquote, urlsplit

from ..core.model import Claim, Outcome
from ..errors import ConfigurationError, HandlerCrashed, LeaseLostError, Reject, StoreError
from .names import validate_identifier
from .queries import run_steps
from .rows import record_params
from .sql import Dialect, Row, SQLBatch

if TYPE_CHECKING:
    from .sql import KeptRecords

__all__ = [
    "ConnectionPool",
    "GuardedConnection",
    "InBatch",
    "LazyDelivery",
    "MappedErrors",
    "PooledDelivery",
    "PooledDialect",
    "Script",
    "ServerURL",
    "parse_server_url",
    "pooled_batch",
    "run_script",
    "script_text",
]

C = TypeVar("C")


class ConnectionPool(Generic[C]):
    """Connections made by ``connect()``, up to ``size`` kept idle (see the module docstring).

    Args:
        connect: makes a connection (its errors propagate: map them there).
        size: how many idle connections are kept.
        reset: makes a connection fit for its next user; False: close it instead.
        close: closes a connection, quietly.
        what: the store, for the error of a closed pool.
    """

    def __init__(
        self,
        connect: Callable[[], C],
        size: int,
        *,
        reset: Callable[[C], bool],
        close: Callable[[C], None],
        what: str,
    ) -> None:
        self.connect = connect
        self.size = size
        self.reset = reset
        self.close_one = close
        self.what = what
        self.idle: list[C] = []
        self.lock = threading.Lock()
        self.closed = False
        self._at_exit = _closing_at_exit(weakref.ref(self))
        atexit.register(self._at_exit)

    def take(self) -> C:
        """An idle connection, or a new one.

        Raises:
            StoreError: the pool is closed.
        """
        with self.lock:
            if self.closed:
                raise StoreError(f"{self.what} is closed")
            if self.idle:
                return self.idle.pop()
        return self.connect()

    def give(self, conn: C, *, broken: bool = False) -> None:
        """Hand ``conn`` back: reset and kept, or (``broken``, reset failed, pool full or
        closed) closed."""
        keep = not broken and self.reset(conn)
        with self.lock:
            if keep and not self.closed and len(self.idle) < self.size:
                self.idle.append(conn)
                return
        self.close_one(conn)

    def close(self) -> None:
        """Close the idle connections; the pool makes no more. Closing twice is fine."""
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        atexit.unregister(self._at_exit)
        for conn in idle:
            self.close_one(conn)


def _closing_at_exit(pool: weakref.ref[ConnectionPool[Any]]) -> Callable[[], None]:
    """What closes ``pool`` at the interpreter's exit, if it is still there (a weak reference:
    the hook does not keep a forgotten pool alive)."""

    def close() -> None:
        found = pool()
        if found is not None:
            found.close()

    return close


class MappedErrors:
    """A block whose driver errors (``errors``) are raised as ``mapper(exc, doing)`` (a
    ``StoreError``), from them.

    Args:
        errors: the driver's error class(es).
        mapper: makes outboxkit's error of a driver's, naming ``doing``.
        doing: what the block does, for the message.
    """

    __slots__ = ("doing", "errors", "mapper")

    def __init__(
        self,
        errors: type[BaseException] | tuple[type[BaseException], ...],
        mapper: Callable[[BaseException, str], BaseException],
        doing: str,
    ) -> None:
        self.errors = errors
        self.mapper = mapper
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, self.errors):
            raise self.mapper(exc, self.doing) from exc


Script = Sequence[tuple[str, "Mapping[str, Any] | None"]]
"""Statements, one each, as ``(sql, params)``."""

Refusal = TypeVar("Refusal", LeaseLostError, StoreError)


def script_text(conn: Any, statements: Script) -> str:
    """``statements`` as one text, each interpolated by the driver's own escaping (its
    cursors' ``mogrify``: PyMySQL's, psycopg's)."""
    mogrify = conn.cursor().mogrify
    return ";".join(mogrify(sql, params) if params else sql for sql, params in statements)


def run_script(conn: Any, statements: Script) -> int:
    """``statements`` in one round trip (``script_text``: a driver and connection that take
    several statements at once), every answer read (``nextset``); the last one's row count
    (rows changed, or selected ``INTO`` variables)."""
    cur = conn.cursor()
    try:
        cur.execute(script_text(conn, statements))
        while cur.nextset():
            pass
        count: int = cur.rowcount
    finally:
        cur.close()
    return count


class PooledDialect(Dialect):
    """A dialect whose connections are a ``ConnectionPool``'s (``pool``), DB-API connections in
    autocommit mode whose driver errors derive from ``driver_error``: the blocks of the seam,
    its errors mapped by ``map_error``. ``checkout`` makes a connection taken from the pool fit
    for the block (by default it is already)."""

    pool: ConnectionPool[Any]
    driver_error: type[BaseException] | tuple[type[BaseException], ...] = Exception

    @abstractmethod
    def map_error(self, exc: BaseException, doing: str) -> StoreError:
        """The driver's error ``exc`` as outboxkit's, naming the database and ``doing``."""

    def outage(self, exc: BaseException) -> bool:
        """Whether the driver's error ``exc`` is an outage that may pass (a deadlock, a lost
        connection: ``map_error`` makes it ``StoreUnavailable``). By default none is."""
        return False

    def mapped(self, doing: str, conn: Any = None) -> MappedErrors:
        return MappedErrors(self.driver_error, self.map_error, doing)

    def checkout(self, conn: Any) -> Any:
        """``conn``, taken from the pool, made fit for a block of the store's own."""
        return conn

    queries: dict[str, list[str]]
    """The statements of the store's ``queries.sql``, names in place, each split into its steps
    (``queries.split_steps``): what the default ``rows`` and ``execute`` run."""

    def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        """The named statement's rows, its steps run by ``queries.run_steps`` on a cursor of
        ``conn`` (a driver with ``pyformat`` parameters, expanding tuples for ``IN``: an empty
        one matches nothing, so no step runs)."""
        if any(type(value) is tuple and not value for value in params.values()):
            return []
        cur = conn.cursor()
        try:

            def execute(sql: str, bound: Mapping[str, Any]) -> list[Row] | None:
                cur.execute(sql, bound)
                return list(cur.fetchall()) if cur.description else None

            return run_steps(execute, self.queries[name], params)
        finally:
            cur.close()

    def execute(self, conn: Any, name: str, params: Mapping[str, Any]) -> tuple[int, Any]:
        """Run a one-step statement; its cursor's ``rowcount`` and ``lastrowid``."""
        (sql,) = self.queries[name]
        cur = conn.cursor()
        try:
            cur.execute(sql, params)
            return cur.rowcount, cur.lastrowid
        finally:
            cur.close()

    def script(self, conn: Any, statements: Script) -> int:
        """Run ``statements`` (``(sql, params)`` each) on ``conn``, in one round trip if the
        driver can; the last one's row count (``LazyDelivery.flush`` reads it). Default:
        ``run_script``."""
        return run_script(conn, statements)

    @contextmanager
    def connection(self, doing: str) -> Iterator[Any]:
        """One of the pool's connections for the block, its errors mapped; one that failed is
        closed rather than kept."""
        conn = None
        try:
            with self.mapped(doing):
                conn = self.checkout(self.pool.take())
                yield conn
        except BaseException:
            if conn is not None:
                self.pool.give(conn, broken=True)
            raise
        self.pool.give(conn)

    @contextmanager
    def write(self, doing: str) -> Iterator[Any]:
        """A connection in a transaction (``BEGIN``) for the block: committed when it ends,
        rolled back if it raises."""
        with self.connection(doing) as conn:
            cursor = conn.cursor()
            try:
                cursor.execute("BEGIN")
            finally:
                cursor.close()
            try:
                yield conn
            except BaseException:
                conn.rollback()
                raise
            conn.commit()

    def read(self, doing: str) -> Any:
        """A connection in autocommit mode (each statement its own snapshot)."""
        return self.connection(doing)

    def close(self) -> None:
        """Close the pool's connections."""
        self.pool.close()


if TYPE_CHECKING:

    class _DriverConnection:
        """What ``GuardedConnection`` overrides of a driver's connection class."""

        def commit(self) -> None: ...
        def rollback(self) -> None: ...
        def begin(self) -> None: ...
        def close(self) -> None: ...

else:
    _DriverConnection = object


class GuardedConnection(_DriverConnection):
    """The mixin of a store's connection class, before the driver's
    (``class StoreConnection(GuardedConnection, driver.Connection)``): while it serves a
    delivery (``delivering``), ``commit``, ``rollback``, ``begin`` and ``close`` raise
    ``refusal(what)`` (R17: outboxkit commits the delivery, with its record), and
    ``ended_by_handler`` notes the attempt, whatever the handler makes of the refusal.
    ``dirty``: a handler had the connection, so its session is set again before its next use
    (R18)."""

    delivering = False
    ended_by_handler = False
    dirty = False
    ahead: LazyDelivery | None = None
    """A delivery whose opening goes with the connection's next statement, in its round trip
    (``LazyDelivery.defer``): the store's connection class sends and reads it."""

    def refusal(self, what: str) -> BaseException:
        """The error a refused ``what`` raises (by default a ``StoreError``; a store raises its
        driver's, which a handler's own error handling expects)."""
        return StoreError(f"outboxkit: a handler may not {what} its delivery transaction")

    def _guard(self, what: str) -> None:
        if self.delivering:
            self.ended_by_handler = True
            raise self.refusal(what)

    def kept(self) -> bool:
        """A ``ConnectionPool``'s ``reset``: the connection made fit for its next user, kept
        unless a handler tried to end its delivery (one a handler had stays ``dirty``)."""
        self.delivering = False
        self.ahead = None
        return not self.ended_by_handler

    def close_quietly(self) -> None:
        """A ``ConnectionPool``'s ``close``: closed, whatever state it is in."""
        self.delivering = False
        with suppress(Exception):  # already gone
            super().close()

    def commit(self) -> None:
        self._guard("commit")
        super().commit()

    def rollback(self) -> None:
        self._guard("roll back")
        super().rollback()

    def begin(self) -> None:
        self._guard("begin another transaction instead of")
        super().begin()

    def close(self) -> None:
        self._guard("close the connection of")
        super().close()


@dataclass(frozen=True, slots=True)
class ServerURL:
    """A database server's URL, parsed (``parse_server_url``)."""

    scheme: str
    host: str
    port: int
    user: str
    password: str = field(repr=False)
    database: str

    @property
    def shown(self) -> str:
        """The URL without its password, for messages."""
        return f"{self.scheme}://{self.user}@{self.host}:{self.port}/{self.database}"

    def connect_args(self) -> dict[str, Any]:
        """``host``, ``port``, ``user``, ``password``, ``database``: a DB-API driver's
        ``connect`` arguments."""
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "password": self.password,
            "database": self.database,
        }


def parse_server_url(
    url: str, *, schemes: Sequence[str], port: int, user: str, store: str
) -> ServerURL:
    """``scheme://user:password@host:port/database``, percent-decoded, with the defaults
    ``127.0.0.1``, ``port`` and ``user`` (and no password) for what it leaves out.

    Raises:
        ConfigurationError: another scheme, no database, or a database name that is not a
            plain identifier (the message shows the URL without its password).
    """
    parts = urlsplit(url) if isinstance(url, str) else None
    scheme = parts.scheme.lower() if parts is not None else ""
    if parts is None or scheme not in schemes:
        shown = _without_password(url) if isinstance(url, str) else type(url).__name__
        raise ConfigurationError(
            f"a {store} store URL starts with '{schemes[0]}://', got {shown!r:.80}"
        )
    found = ServerURL(
        scheme=scheme,
        host=parts.hostname or "127.0.0.1",
        port=parts.port or port,
        user=unquote(parts.username) if parts.username else user,
        password=unquote(parts.password) if parts.password else "",
        database=unquote(parts.path.lstrip("/")),
    )
    if not found.database or "/" in found.database:
        raise ConfigurationError(
            f"a {store} store URL names its database: {schemes[0]}://user:pass@host:{port}/db, "
            f"got {found.shown}"
        )
    validate_identifier(found.database, "the URL's database")
    return found


def _without_password(url: str) -> str:
    """``url`` with the password of its authority, if any, replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    credentials, at, host = authority.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}{slash}{path}"


class LazyDelivery(ABC):
    """A delivery transaction on one connection (``conn``) of ``dialect``'s, opened (``open``)
    when its handler first takes ``connection`` or enqueues a follow-up; ``record`` keeps the
    records for ``finish``. The store writes ``open``, ``finish`` (the records and the commit),
    ``undo`` (the rollback) and ``fenced`` (the one record of a delivery never opened, inserted
    only if the token still holds). ``failure`` tells what the block raises instead of a
    handler's exception. ``broken``: ``undo`` failed, so the connection is in doubt."""

    def __init__(
        self, dialect: PooledDialect, conn: Any, claim: Claim, now: datetime | None
    ) -> None:
        self.dialect = dialect
        self.conn = conn
        self.claim = claim
        self.now = now  # as the dialect binds it
        self.opened = False
        self.broken = False
        self.refused: LeaseLostError | StoreError | None = None
        self.opening: Script = ()
        self.checks = True
        self.kept: list[dict[str, Any]] = []

    @property
    def connection(self) -> Any:
        """The connection inside the delivery transaction (``ctx.connection``), opened now if
        it is not yet (a deferred opening, ``defer``: with the handler's first statement).

        Raises:
            LeaseLostError: the token is stale (nothing is opened; a deferred opening raises
                it from the handler's first statement instead).
        """
        if not self.opened:
            try:
                self.open()
            except (LeaseLostError, StoreError) as refusal:
                self.refused = refusal  # R6: stays refused, if the handler swallows it
                raise
        return self.conn

    def refuse(self, refusal: Refusal) -> Refusal:
        """Note that opening the delivery failed (``refusal``), and return it to raise: the
        delivery ends with it even if the handler swallows it (R6: nothing is written)."""
        self.refused = refusal
        return refusal

    def defer(self, opening: Script, *, checks: bool = True) -> None:
        """``open`` for a store whose connection (a ``GuardedConnection``) sends a delivery's
        ``opening`` (the transaction or savepoint begun, then the token check and row lock,
        whose row count 1 says the token holds; ``checks`` False: no check, the row already
        locked by the batch) ahead of the handler's first statement, in its round trip: kept
        on the connection (``ahead``) for that; ``flush`` sends it alone."""
        self.opened = True
        self.opening = opening
        self.checks = checks
        conn = self.conn
        conn.ahead = self
        conn.dirty = conn.delivering = True
        conn.ended_by_handler = False  # this delivery's own (a batch's connection serves many)

    def flush(self) -> None:
        """Send the deferred opening now if it has not gone (the handler took the connection
        and never used it), in a round trip of its own.

        Raises:
            LeaseLostError: the token is stale.
        """
        if getattr(self.conn, "ahead", None) is not self:
            return
        self.conn.ahead = None
        with self.dialect.mapped(self.opening_what):
            owned = self.dialect.script(self.conn, self.opening)
        if self.checks and owned != 1:
            raise self.stale_token()

    def stale_token(self) -> LeaseLostError:
        """The refusal of a stale token, kept (``refuse``)."""
        return self.refuse(LeaseLostError(f"event {self.claim.event.id}: claim token is stale"))

    def opening_failed(self, exc: BaseException) -> StoreError:
        """The driver's error ``exc`` from a deferred opening, as the store's, kept."""
        return self.refuse(self.dialect.map_error(exc, self.opening_what))

    @property
    def opening_what(self) -> str:
        return f"open the delivery of event {self.claim.event.id}"

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """The delivery record of ``handler``: written as the delivery commits."""
        self.kept.append(record_params(self.claim, handler, outcome, reason, self.now))

    @property
    def single(self) -> dict[str, Any] | None:
        """The one record of a delivery never opened (None: it opened, or has several)."""
        return self.kept[0] if not self.opened and len(self.kept) == 1 else None

    @abstractmethod
    def open(self) -> None:
        """Open the transaction and check the token, locking the event's row (``opened``
        set first: a failed opening is undone).

        Raises:
            LeaseLostError: the token is stale.
        """

    @abstractmethod
    def finish(self) -> None:
        """The normal end of an opened delivery: its records and the commit."""

    @abstractmethod
    def undo(self) -> None:
        """Roll the opened delivery back."""

    @abstractmethod
    def fenced(self, params: dict[str, Any]) -> None:
        """Write the one record of a delivery never opened, if the token still holds.

        Raises:
            LeaseLostError: it does not (nothing was written).
        """

    def check_kept(self) -> None:
        """R17: the handler did not try to end its delivery transaction (a
        ``GuardedConnection`` noted no attempt).

        Raises:
            HandlerCrashed: it tried to.
        """
        if getattr(self.conn, "ended_by_handler", False):
            raise HandlerCrashed(
                f"event {self.claim.event.id}: a handler tried to commit, roll back or close "
                "its delivery transaction (refused: outboxkit commits it with the delivery "
                "record); nothing of this delivery was committed and it runs again"
            )

    def failure(self, exc: BaseException) -> BaseException | None:
        """What the block raises instead of ``exc`` (None: ``exc`` itself): an outage of the
        database under the handler (``PooledDialect.outage``, anywhere in ``exc``'s causes) is
        the store's failure, never the handler's; an attempt to end the transaction (see
        ``check_kept``) is ``HandlerCrashed``."""
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, StoreError):
                return None
            if self.dialect.outage(seen):
                return self.dialect.map_error(
                    seen,
                    f"deliver event {self.claim.event.id} (the database failed under a handler)",
                )
            seen = seen.__cause__ or seen.__context__
        if getattr(self.conn, "ended_by_handler", False) and not isinstance(
            exc, HandlerCrashed | Reject
        ):
            return HandlerCrashed(
                f"event {self.claim.event.id}: a handler may not commit or roll back its "
                f"delivery transaction; its writes were rolled back: {exc}"
            )
        return None

    def close(self, exc: BaseException | None, batch: KeptRecords | None = None) -> None:
        """End the block that had the delivery (``exc``: its exception): the one record of a
        delivery never opened is written fenced, or kept by ``batch``; any other delivery
        ends (``end``)."""
        single = self.single if exc is None else None
        if single is None:
            self.end(exc)
        elif batch is None:
            self.fenced(single)
        else:
            batch.keep(self.claim, single)

    def end(self, exc: BaseException | None) -> None:
        """End the delivery: on a normal exit open it if it is not yet, and finish it; else
        (or if finishing fails) undo what opened, and raise what ``failure`` says."""
        if exc is None and self.refused is not None:  # a handler swallowed the refusal
            if self.opened:
                self._undo_quietly()
            raise self.refused
        if exc is None:
            if not self.opened:
                self.open()
            try:
                self.flush()
                self.finish()
                return
            except BaseException:
                self._undo_quietly()
                raise
        if self.opened:
            self._undo_quietly()
        instead = self.failure(exc) if isinstance(exc, Exception) else None
        if instead is not None:
            raise instead from exc

    def _undo_quietly(self) -> None:
        if getattr(self.conn, "ahead", None) is self:  # a deferred opening never sent
            self.conn.ahead = None
            return
        try:
            self.undo()
        except Exception:  # the error the block raises is the one that made it undo
            self.broken = True  # the connection is in doubt: closed, not kept


D = TypeVar("D", bound=LazyDelivery)


class PooledDelivery(Generic[D]):
    """What ``Store.delivery`` returns: a connection from ``dialect``'s pool for the block, and
    on it the delivery ``make(conn)`` makes; the connection back to the pool afterwards
    (closed if ending the delivery failed). A class: one is made per delivery."""

    __slots__ = ("dialect", "doing", "make", "tx")

    def __init__(self, dialect: PooledDialect, make: Callable[[Any], D], doing: str) -> None:
        self.dialect = dialect
        self.make = make
        self.doing = doing

    def __enter__(self) -> D:
        with self.dialect.mapped(self.doing):
            conn = self.dialect.pool.take()
        self.tx: D = self.make(conn)
        return self.tx

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tx = self.tx
        broken = True
        try:
            tx.close(exc)
            broken = tx.broken
        finally:
            self.dialect.pool.give(tx.conn, broken=broken)


class InBatch(Generic[D]):
    """What a batch's ``delivery`` returns: ``tx``, a delivery on the batch's connection; a
    delivery never opened keeps its one record for the batch's ``write_kept``."""

    __slots__ = ("batch", "tx")

    def __init__(self, batch: KeptRecords, tx: D) -> None:
        self.batch = batch
        self.tx = tx

    def __enter__(self) -> D:
        return self.tx

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.tx.close(exc, self.batch)


B = TypeVar("B", bound=SQLBatch)


@contextmanager
def pooled_batch(
    dialect: PooledDialect,
    make: Callable[[Any], B],
    begin: Callable[[Any], None],
    end: Callable[[Any, bool], None],
) -> Iterator[B]:
    """What ``Store.batch`` returns for a store on a ``PooledDialect``: one of the pool's
    connections, ``begin(conn)`` its transaction, the block with the batch ``make(conn)``,
    then the batch's kept records (``write_kept``) and ``end(conn, True)``, the commit. If the
    block raises, ``end(conn, False)`` rolls back; a connection whose rollback fails too is
    closed rather than kept."""
    with dialect.mapped("open a batch transaction"):
        conn = dialect.pool.take()
    broken = True
    try:
        with dialect.mapped("open a batch transaction"):
            begin(conn)
        try:
            batch = make(conn)
            yield batch
            batch.write_kept()
            with dialect.mapped("commit the batch"):
                end(conn, True)
        except BaseException:
            try:
                end(conn, False)
                broken = False
            except dialect.driver_error:
                pass  # the error the block raises is the one that made it roll back
            raise
        broken = False
    finally:
        dialect.pool.give(conn, broken=broken)
