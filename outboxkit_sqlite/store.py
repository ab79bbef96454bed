"""The SQLite store: one file, no server, several poller processes on one machine.

Theory of operation:

- The schema is created and migrated with sqlite-utils (``_schema``); the hot path runs on plain
  ``sqlite3``. The store's own connections are opened with ``isolation_level=None``: every
  transaction is an explicit ``BEGIN IMMEDIATE`` ... ``COMMIT``, short, and never left open
  between calls. ``BEGIN IMMEDIATE`` takes SQLite's single write lock up front, so a transaction
  never has to upgrade a read snapshot (the one case ``busy_timeout`` cannot wait out); a busy
  ``BEGIN`` is retried a few times with backoff on top of ``busy_timeout``.
- The file runs in WAL mode (readers never block the writer) with ``synchronous=NORMAL``: a
  committed transaction survives any process crash; a power cut may lose the last few commits.
  ``journal_size_limit`` shrinks the WAL file back once a checkpoint has reset it. A read
  transaction held open elsewhere stops every checkpoint at its snapshot, so the WAL grows with
  every commit: after a commit, at most every ``_WAL_CHECK_INTERVAL`` seconds, the store looks at
  the WAL's size and, over ``wal_warn_bytes``, runs a passive checkpoint; if that cannot get
  through the log, it logs a warning on ``outboxkit.sqlite`` (at most once a minute).
- A claim is one ``UPDATE ... WHERE id IN (SELECT ... LIMIT n) RETURNING ...`` under the write
  lock: two claimers, in threads or processes, never get the same event (R3).
- A delivery transaction holds the write lock while its handler runs, so handlers on SQLite
  should be short. While the handler runs, an authorizer refuses ``COMMIT``/``ROLLBACK``/``BEGIN``
  on the connection it was given: a handler cannot end the transaction its record commits in.
- Instants are INTEGER microseconds since the epoch (UTC), bound from the caller's clock.
- ``sqlite://:memory:`` is one in-memory database on one connection, shared by the threads of one
  process under a re-entrant lock (the app's transactions, the pollers and the store's reads all
  see the same data).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Self, TypeVar

from outboxkit._storekit import (
    done_from_pairs,
    encode_headers,
    event_from_row,
    record_from_row,
    settle_params,
    sort_claims,
    still_owned,
)
from outboxkit.core.machine import Settlement
from outboxkit.core.model import Claim, DeadLetter, DeliveryRecord, Event, NewEvent, Outcome, Stats
from outboxkit.errors import (
    ConfigurationError,
    HandlerCrashed,
    LeaseLostError,
    Reject,
    SchemaError,
    StoreError,
    StoreUnavailable,
)
from outboxkit.store import Capabilities
from outboxkit.waiter import ClosingWaiter

from . import _schema
from ._sql import INSERT_COLUMNS, Queries, TableNames

__all__ = ["SQLiteStore"]

T = TypeVar("T")

log = logging.getLogger("outboxkit.sqlite")

MEMORY = ":memory:"
DEFAULT_BUSY_TIMEOUT = 30.0
MIB = 1024 * 1024
DEFAULT_WAL_WARN_BYTES = 64 * MIB
_JOURNAL_SIZE_LIMIT = 32 * MIB  # what the WAL file shrinks back to once a checkpoint reset it
_WAL_CHECK_INTERVAL = 5.0  # seconds between two looks at the WAL's size (one stat call)
_WAL_WARN_INTERVAL = 60.0  # seconds between two warnings about it
_BUSY_RETRIES = 8
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_OPTIONS = frozenset(
    {
        "table_prefix",
        "events_table",
        "deliveries_table",
        "schema_table",
        "busy_timeout",
        "wal_warn_bytes",
        "migrate",
    }
)
_UNAVAILABLE = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_FULL")
_UNUSABLE_AT_OPEN = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_NOTADB", "SQLITE_PERM")


def _to_us(at: datetime) -> int:
    if at.tzinfo is None or at.utcoffset() is None:
        raise ConfigurationError(f"instants must be timezone-aware, got {at!r}")
    return (at - _EPOCH) // _MICROSECOND


def _from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _from_us_or_none(us: int | None) -> datetime | None:
    return None if us is None else _from_us(us)


def _now(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(UTC)


def _error_name(exc: sqlite3.Error) -> str:
    return str(getattr(exc, "sqlite_errorname", "") or "")


def _is_busy(exc: sqlite3.Error) -> bool:
    name = _error_name(exc)
    if name:
        return name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED"))
    return "locked" in str(exc) or "busy" in str(exc)


def _in_transaction(conn: sqlite3.Connection) -> bool:
    """Whether ``conn`` has an open transaction; False once it is closed."""
    try:
        return conn.in_transaction
    except sqlite3.ProgrammingError:  # closed
        return False


def _retry_busy(action: Callable[..., T], *args: object, busy_timeout: float) -> T:
    """Run ``action(*args)``, retrying with backoff while SQLite reports busy, for at most
    ``busy_timeout`` in all.

    SQLite's own busy handler already waits up to ``busy_timeout``; this covers the cases where
    SQLite answers busy at once without calling it (e.g. while another connection recovers the
    WAL). An answer that came after the full wait is final.
    """
    deadline = time.monotonic() + busy_timeout
    delay = 0.005
    for attempt in range(_BUSY_RETRIES + 1):
        try:
            return action(*args)
        except sqlite3.OperationalError as exc:
            if attempt == _BUSY_RETRIES or not _is_busy(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 3, 1.0)
    raise AssertionError("unreachable")  # pragma: no cover


# The store's own transaction statements, the only ones its connections run (see
# _StoreConnection). Spelled apart from a plain "COMMIT": sqlite3 caches prepared statements by
# their text, and anyone else's COMMIT must be freshly prepared, so the authorizer sees it.
_BEGIN = "BEGIN IMMEDIATE -- outboxkit"
_COMMIT = "COMMIT -- outboxkit"
_ROLLBACK = "ROLLBACK -- outboxkit"
_BEGIN_READ = "BEGIN DEFERRED -- outboxkit"
# The order of each event's values in settle_many's :items array (see _sql.Queries).
_SETTLE_MANY_COLUMNS = ("id", "token", "publish", "dead", "retry_after", "keeps_error", "error")
_SAVEPOINT = "SAVEPOINT outboxkit_delivery"
_ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO outboxkit_delivery"
_RELEASE_SAVEPOINT = "RELEASE outboxkit_delivery"


class _Mapped:
    """``SQLiteStore._mapped``: a plain class, not a generator context manager (the hot path
    enters several per event)."""

    __slots__ = ("_store", "_what")

    def __init__(self, store: SQLiteStore, what: str) -> None:
        self._store = store
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, sqlite3.Error):
            raise self._store._store_error(exc, self._what) from exc


class _StoreConnection(sqlite3.Connection):
    """A store connection: only the store begins, commits and rolls back its transactions.

    An authorizer refuses BEGIN/COMMIT/ROLLBACK prepared by anyone else: a handler given the
    connection in its delivery transaction, or an app inside ``store.transaction()``, cannot end
    the transaction the store commits (with the delivery record) or rolls back. Savepoints stay
    allowed. The authorizer is installed once: installing one expires every prepared statement.
    """

    delivery: _Delivery | None = None
    _controlling = False

    def guard(self) -> None:
        self.set_authorizer(self._authorize)

    def control(self, statement: str) -> None:
        """Run one of the store's own transaction statements (``_BEGIN``, ``_COMMIT`` ...)."""
        self._controlling = True
        try:
            self.execute(statement)
        finally:
            self._controlling = False

    def _authorize(self, action: int, *_: object) -> int:
        if action == sqlite3.SQLITE_TRANSACTION and not self._controlling:
            if self.delivery is not None:
                self.delivery.ended_by_handler = True
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK


class _Connections:
    """The store's own connections.

    A file database gets one connection per concurrent user, kept for reuse (connections are
    handed between threads, one user at a time). ``:memory:`` gets exactly one connection, shared
    under a re-entrant lock, since every connection would otherwise see its own empty database.
    """

    def __init__(self, connect: Callable[[], _StoreConnection], *, shared: bool) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._idle: list[_StoreConnection] = []
        self._closed = False
        self._shared_lock = threading.RLock()
        self._shared = connect() if shared else None

    @contextmanager
    def acquire(self) -> Iterator[_StoreConnection]:
        if self._shared is not None:
            with self._shared_lock:
                if self._closed:
                    raise StoreError("the SQLite store is closed")
                yield self._shared
            return
        with self._lock:
            if self._closed:
                raise StoreError("the SQLite store is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        finally:
            self._give_back(conn)

    def _give_back(self, conn: _StoreConnection) -> None:
        try:
            usable = not conn.in_transaction
        except sqlite3.ProgrammingError:  # closed by a misbehaving handler
            return
        with self._lock:
            if usable and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        if self._shared is not None:
            with self._shared_lock:
                self._shared.close()


class _Delivery:
    """One delivery transaction: the store's connection inside ``BEGIN IMMEDIATE``, token checked."""

    __slots__ = ("_claim", "_now", "_store", "conn", "ended_by_handler")

    def __init__(
        self, store: SQLiteStore, conn: sqlite3.Connection, claim: Claim, now: datetime
    ) -> None:
        self._store = store
        self._claim = claim
        self._now = now
        self.conn = conn
        self.ended_by_handler = False

    @property
    def connection(self) -> sqlite3.Connection:
        return self.conn

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        self.check_open()
        return self._store._insert(self.conn, events, self._now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        if not outcome.recorded:
            raise ConfigurationError(
                f"only succeeded/rejected outcomes are recorded, got {outcome}"
            )
        self.check_open()
        with self._store._mapped(f"record {handler!r} for event {self._claim.event.id}"):
            self.conn.execute(
                self._store._queries.insert_record,
                {
                    "event_id": self._claim.event.id,
                    "handler": handler,
                    "outcome": outcome.value,
                    "attempt": self._claim.attempt,
                    "recorded_at": _to_us(self._now),
                    "reason": reason,
                },
            )

    def check_open(self) -> None:
        """Raises HandlerCrashed if the transaction is no longer open (a handler closed it)."""
        if not _in_transaction(self.conn):
            raise HandlerCrashed(
                f"event {self._claim.event.id}: the delivery transaction was ended by a handler "
                "(committed, rolled back or closed); outboxkit commits it with the delivery record"
            )


class _Batch:
    """One transaction for a claimed batch: deliveries in savepoints, settlements and lease
    extensions on the same connection (another one would wait for this one's write lock)."""

    __slots__ = ("_conn", "_store")

    def __init__(self, store: SQLiteStore, conn: _StoreConnection) -> None:
        self._store = store
        self._conn = conn

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[_Delivery]:
        conn = self._conn
        with self._store._mapped(f"open a savepoint for event {claim.event.id}"):
            conn.execute(_SAVEPOINT)
        try:
            with self._store._delivering(conn, claim, _now(now)) as tx:
                yield tx
        except BaseException:
            if _in_transaction(conn):
                with suppress(sqlite3.Error):
                    conn.execute(_ROLLBACK_TO_SAVEPOINT)
                    conn.execute(_RELEASE_SAVEPOINT)
            raise
        with self._store._mapped(f"release the savepoint of event {claim.event.id}"):
            conn.execute(_RELEASE_SAVEPOINT)

    def settle_many(
        self, items: Sequence[tuple[Claim, Settlement, str | None]], *, now: datetime | None
    ) -> list[bool]:
        """``SQLiteStore.settle_many`` inside the batch's transaction."""
        if not items:
            return []
        with self._store._mapped(f"settle {len(items)} event(s)"):
            return self._store._settle_many_on(self._conn, items, _now(now))

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        with self._store._mapped(f"extend {len(claims)} lease(s)"):
            return self._store._extend_on(self._conn, claims, lease, _now(now))


class SQLiteStore:
    """The SQLite store (``sqlite:///path/to/file.db``, ``sqlite://:memory:``).

    Thread-safe. With a file database, several processes on one machine may share it (each opens
    its own store on the same file); ``:memory:`` is for one process.

    Args:
        path: the database file (created if missing; its directory must exist), or ``":memory:"``.
        table_prefix: prefix of the three table names (``outbox_`` gives ``outbox_events``,
            ``outbox_deliveries``, ``outbox_schema``).
        events_table, deliveries_table, schema_table: override one table name each.
        busy_timeout: seconds a connection waits for SQLite's write lock before giving up.
        wal_warn_bytes: a write-ahead log larger than this (default 64 MiB) gets a passive
            checkpoint; if a read transaction held open elsewhere keeps it from getting through,
            a warning is logged on ``outboxkit.sqlite`` (at most once a minute).
        migrate: create or upgrade the schema on open (default). With False the schema is only
            checked, and :meth:`migrate` is yours to call: a newer schema is refused here, an
            older one at the first claim (a poller's first poll).

    Raises:
        ConfigurationError: a bad option or table name; the directory is missing; the file or
            its directory is read-only or not a database (the message names the path).
        SchemaError: the database's schema is newer than this code (both versions named).
        StoreError: SQLite failed otherwise while opening.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table_prefix: str = "outbox_",
        events_table: str | None = None,
        deliveries_table: str | None = None,
        schema_table: str | None = None,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        wal_warn_bytes: int = DEFAULT_WAL_WARN_BYTES,
        migrate: bool = True,
    ) -> None:
        defaults = TableNames.with_prefix(table_prefix)
        self.tables = TableNames(
            events=events_table if events_table is not None else defaults.events,
            deliveries=deliveries_table if deliveries_table is not None else defaults.deliveries,
            schema=schema_table if schema_table is not None else defaults.schema,
        )
        if (
            not isinstance(busy_timeout, int | float)
            or isinstance(busy_timeout, bool)
            or not math.isfinite(busy_timeout)
            or busy_timeout < 0
        ):
            raise ConfigurationError(
                f"busy_timeout must be a finite number of seconds >= 0, got {busy_timeout!r}"
            )
        self.busy_timeout = float(busy_timeout)
        if (
            not isinstance(wal_warn_bytes, int)
            or isinstance(wal_warn_bytes, bool)
            or (wal_warn_bytes <= 0)
        ):
            raise ConfigurationError(
                f"wal_warn_bytes must be an integer number of bytes > 0, got {wal_warn_bytes!r}"
            )
        self.wal_warn_bytes = wal_warn_bytes
        self._queries = Queries.build(self.tables)
        self._insert_one = self._queries.insert_events(1)
        self.memory = os.fspath(path) == MEMORY
        if self.memory:
            self.path: Path | None = None
            self.url = "sqlite://:memory:"
        else:
            self.path = Path(os.path.abspath(os.fspath(path)))
            self.url = f"sqlite:///{self.path.as_posix()}"
            _check_path(self.path)
        self.capabilities = Capabilities(
            batches=True,
            transactional_handlers=True,
            concurrent_claimers=True,
            multiprocess=not self.memory,
        )
        self.options: dict[str, Any] = {
            "events_table": self.tables.events,
            "deliveries_table": self.tables.deliveries,
            "schema_table": self.tables.schema,
            "busy_timeout": self.busy_timeout,
            "wal_warn_bytes": self.wal_warn_bytes,
        }
        # The WAL watch (file databases only): the next look at its size, the next warning.
        self._wal_lock = threading.Lock()
        self._wal_check_at = math.inf if self.memory else 0.0
        self._wal_warn_at = 0.0
        self._connections = self._open_connections()
        # An older schema found with migrate=False: pollers are refused until migrate().
        self._older: int | None = None
        try:
            if migrate:
                self.migrate()
            else:
                with self._read("check the schema version") as conn:
                    found = _schema.current_version(conn, self.tables)
                _schema.check_version(found, self._where)
                if 0 < found < _schema.SCHEMA_VERSION:
                    self._older = found
        except BaseException:
            self._connections.close()
            raise

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """The factory behind ``open_store("sqlite:///path")``.

        ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db`` (four slashes),
        ``sqlite://:memory:``. Options as for the constructor.

        Raises:
            ConfigurationError: the URL or an option is malformed (and as the constructor).
        """
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise ConfigurationError(
                f"unknown SQLite store option(s) {unknown}; known: {sorted(_OPTIONS)}"
            )
        return cls(_path_from_url(url), **options)

    def __repr__(self) -> str:
        return f"SQLiteStore({self._where!r})"

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _where(self) -> str:
        return MEMORY if self.path is None else str(self.path)

    # -- connections and transactions -----------------------------------------------------------

    def _open_connections(self) -> _Connections:
        connections = _Connections(self._connect, shared=self.memory)
        if not self.memory:
            # WAL is a property of the file: set once, kept by every later connection.
            try:
                with connections.acquire() as conn:
                    (mode,) = _retry_busy(
                        lambda: conn.execute("PRAGMA journal_mode=WAL").fetchone(),
                        busy_timeout=self.busy_timeout,
                    )
            except sqlite3.Error as exc:
                connections.close()
                raise self._open_error(exc) from exc
            except BaseException:
                connections.close()
                raise
            if str(mode).lower() != "wal":
                connections.close()
                raise StoreError(f"SQLite database {self._where}: cannot use WAL mode ({mode})")
        return connections

    def _connect(self) -> _StoreConnection:
        try:
            conn = sqlite3.connect(
                self._where,
                isolation_level=None,
                check_same_thread=False,
                timeout=self.busy_timeout,
                factory=_StoreConnection,
            )
            conn.guard()
        except sqlite3.Error as exc:
            raise self._open_error(exc) from exc
        # Text that is not UTF-8 (written behind outboxkit's back, or by an older version that
        # let a lone surrogate through) reads back with its bad bytes escaped, instead of
        # failing every query that touches the row.
        conn.text_factory = _read_text
        try:
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA journal_size_limit={_JOURNAL_SIZE_LIMIT}")
        except sqlite3.Error as exc:
            conn.close()
            raise self._open_error(exc) from exc
        return conn

    def _open_error(self, exc: sqlite3.Error) -> ConfigurationError | StoreError:
        if _error_name(exc).startswith(_UNUSABLE_AT_OPEN) or "unable to open" in str(exc):
            return ConfigurationError(
                f"cannot use the SQLite database {self._where}: {exc} (outboxkit needs to read "
                "and write the file and to create its -wal and -shm files beside it)"
            )
        return self._store_error(exc, "open the database")

    def _store_error(self, exc: sqlite3.Error, what: str) -> StoreError:
        message = f"SQLite store {self._where}: cannot {what}: {exc}"
        if isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
            return StoreError(f"SQLite store {self._where}: the connection is closed: {exc}")
        if isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc):
            return SchemaError(f"{message} (is the schema migrated? call migrate())")
        if _error_name(exc).startswith(_UNAVAILABLE) or _is_busy(exc):
            return StoreUnavailable(message)
        return StoreError(message)

    def _mapped(self, what: str) -> _Mapped:
        """A block whose sqlite3 errors become outboxkit's errors, naming ``what``."""
        return _Mapped(self, what)

    def _begin(self, conn: _StoreConnection) -> None:
        _retry_busy(conn.control, _BEGIN, busy_timeout=self.busy_timeout)

    def _commit(self, conn: _StoreConnection) -> None:
        """Commit a write transaction (and look at the WAL's size, now and then)."""
        _retry_busy(conn.control, _COMMIT, busy_timeout=self.busy_timeout)
        if time.monotonic() >= self._wal_check_at:  # the hot path's only cost
            self._check_wal(conn)

    def _check_wal(self, conn: _StoreConnection) -> None:
        """Over ``wal_warn_bytes``, checkpoint (passively); if a reader's snapshot stops the
        checkpoint, warn (at most every ``_WAL_WARN_INTERVAL`` seconds). Never raises."""
        if not self._wal_lock.acquire(blocking=False):
            return  # another thread is looking
        try:
            now = time.monotonic()
            if now < self._wal_check_at:
                return
            self._wal_check_at = now + _WAL_CHECK_INTERVAL
            wal = f"{self._where}-wal"
            try:
                size = os.path.getsize(wal)
            except OSError:
                return
            if size <= self.wal_warn_bytes:
                return
            try:
                row = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as exc:
                log.debug("SQLite database %s: passive checkpoint failed: %s", self._where, exc)
                return
            busy, frames, checkpointed = row if row is not None else (1, -1, -1)
            if busy or checkpointed < 0 or checkpointed >= frames or now < self._wal_warn_at:
                return
            self._wal_warn_at = now + _WAL_WARN_INTERVAL
            log.warning(
                "SQLite database %s: the WAL file %s is %.1f MB (over wal_warn_bytes=%d) and a "
                "checkpoint got through only %d of its %d frames: a connection holds a read "
                "transaction open, so the WAL cannot be reset and grows with every commit; end "
                "long-lived read transactions (a BEGIN without COMMIT, an unfinished cursor)",
                self._where,
                wal,
                size / 1_000_000,
                self.wal_warn_bytes,
                checkpointed,
                frames,
            )
        finally:
            self._wal_lock.release()

    @staticmethod
    def _rollback_quietly(conn: _StoreConnection) -> None:
        if _in_transaction(conn):
            # If even ROLLBACK fails, the pool closes the connection (it is left in a transaction).
            with suppress(sqlite3.Error):
                conn.control(_ROLLBACK)

    @contextmanager
    def _write(self, what: str) -> Iterator[_StoreConnection]:
        """A short write transaction on a store connection: BEGIN IMMEDIATE ... COMMIT."""
        with self._connections.acquire() as conn:
            try:
                with self._mapped(what):
                    self._begin(conn)
                    yield conn
                    self._commit(conn)
            except BaseException:
                self._rollback_quietly(conn)
                raise

    @contextmanager
    def _read(self, what: str) -> Iterator[_StoreConnection]:
        """A read transaction (one consistent snapshot across several statements)."""
        with self._connections.acquire() as conn:
            if _in_transaction(conn):  # :memory:, inside the same thread's transaction()
                with self._mapped(what):
                    yield conn
                return
            try:
                with self._mapped(what):
                    conn.control(_BEGIN_READ)
                    yield conn
                    conn.control(_COMMIT)
            except BaseException:
                self._rollback_quietly(conn)
                raise

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A store connection inside ``BEGIN IMMEDIATE``: committed when the block ends, rolled
        back if it raises. ``enqueue`` accepts it; the app may run its own SQL on it too (and
        savepoints), but not commit, roll back or close it: the store does that.

        Raises:
            StoreError: the transaction could not begin or commit.
        """
        with self._connections.acquire() as conn:
            with self._mapped("begin a transaction"):
                self._begin(conn)
            try:
                yield conn
            except BaseException:
                self._rollback_quietly(conn)
                raise
            if _in_transaction(conn):
                try:
                    with self._mapped("commit the transaction"):
                        self._commit(conn)
                except BaseException:
                    self._rollback_quietly(conn)
                    raise

    # -- Store protocol -------------------------------------------------------------------------

    def migrate(self) -> None:
        """Create or upgrade the schema. Idempotent; safe while other processes use the file.

        Raises:
            SchemaError: the schema is newer than this code (both versions named), or its tables
                clash with existing ones.
            StoreError: SQLite failed.
        """
        with self._write("migrate the schema") as conn:
            _schema.migrate(
                conn, self.tables, applied_at=_to_us(datetime.now(UTC)), where=self._where
            )
        self._older = None

    def close(self) -> None:
        """Close every connection. The store is unusable afterwards; closing twice is fine."""
        self._connections.close()

    def now(self) -> datetime:
        """The store's clock: this host's (every process sharing the file is on it)."""
        return _now(None)

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        """Insert ``events`` through the app's connection, in the app's open transaction (R1).

        ``conn`` is a ``sqlite3.Connection`` on the store's database file (or a
        ``sqlite_utils.Database``, whose ``.conn`` is used) or what ``transaction()`` yields.
        Never begins, commits or rolls back: with Python's default (legacy) transaction handling
        the driver opens the app's transaction before the INSERT, as it does for the app's own
        writes; with ``isolation_level=None`` (or ``autocommit=True``) a ``BEGIN`` must be open.

        Returns:
            The new ids, in the order of ``events`` (one INSERT per ~5,000 events).

        Raises:
            ConfigurationError: ``conn`` is not a SQLite connection, or it is in autocommit mode
                with no open transaction (nothing is written).
            SchemaError: the connection's database has no outboxkit tables.
            StoreError: SQLite failed (the app's transaction is left to the app).
        """
        return self._insert(_app_connection(conn), events, now)

    def _insert(
        self, conn: sqlite3.Connection, events: Sequence[NewEvent], now: datetime | None
    ) -> list[int]:
        if not events:
            return []
        # The store's clock is the system clock: microseconds straight from it.
        created = _to_us(now) if now is not None else time.time_ns() // 1000
        if len(events) == 1:  # Outbox.enqueue, the hot path: one cached statement, no chunking
            try:
                (event_id,) = conn.execute(self._insert_one, _row(events[0], created)).fetchone()
            except sqlite3.Error as exc:
                raise self._store_error(exc, "enqueue 1 event") from exc
            return [event_id]
        rows = [_row(e, created) for e in events]
        ids: list[int] = []
        with self._mapped(f"enqueue {len(rows)} event(s)"):
            per_statement = max(
                1, conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // INSERT_COLUMNS
            )
            for start in range(0, len(rows), per_statement):
                chunk = rows[start : start + per_statement]
                values = [value for row in chunk for value in row]
                returned = conn.execute(self._queries.insert_events(len(chunk)), values)
                # RETURNING has no order; one INSERT hands out increasing ids in VALUES order.
                ids.extend(sorted(row[0] for row in returned.fetchall()))
        return ids

    def claim(self, *, batch_size: int, lease: timedelta, now: datetime | None) -> list[Claim]:
        if self._older is not None:
            raise SchemaError(
                f"SQLite database {self._where} has outboxkit schema version {self._older}, "
                f"older than version {_schema.SCHEMA_VERSION} this outboxkit needs: run migrate()"
            )
        at = _now(now)
        with self._write("claim events") as conn:
            rows = conn.execute(
                self._queries.claim,
                {
                    "now": _to_us(at),
                    "lease_end": _to_us(at + lease),
                    "batch_size": batch_size,
                },
            ).fetchall()
            done: dict[int, list[tuple[str, str]]] = {}
            if rows:
                ids = json.dumps([row[0] for row in rows])
                for event_id, handler, outcome in conn.execute(
                    self._queries.done_for_events, {"ids": ids}
                ):
                    done.setdefault(event_id, []).append((handler, outcome))
        return sort_claims(
            Claim(
                event=_event(row),
                token=row[12],
                locked_until=_from_us(row[10]),
                done=done_from_pairs(done.get(row[0], ())),
            )
            for row in rows
        )

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[_Delivery]:
        """Open a delivery transaction (``BEGIN IMMEDIATE``) after checking the claim's token.

        ``tx.connection`` is the store's ``sqlite3.Connection`` inside that transaction; the
        handler may read and write through it but not commit, roll back or close it.

        Raises:
            LeaseLostError: the token is stale (nothing runs, nothing is written).
            HandlerCrashed: the handler ended or closed the transaction it was given.
            StoreError: SQLite failed.
        """
        at = _now(now)
        with self._connections.acquire() as conn:
            with self._mapped(f"open a delivery transaction for event {claim.event.id}"):
                self._begin(conn)
            try:
                with self._delivering(conn, claim, at) as tx:
                    yield tx
                with self._mapped(f"commit the delivery of event {claim.event.id}"):
                    self._commit(conn)
            except BaseException:
                self._rollback_quietly(conn)
                raise

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[_Batch]:
        """One ``BEGIN IMMEDIATE`` transaction for a claimed batch (``transaction="per_batch"``):
        each delivery a savepoint of it, everything committed once. It holds SQLite's write
        lock until the batch ends, so other writers wait (up to ``busy_timeout``)."""
        with self._connections.acquire() as conn:
            with self._mapped("open a batch transaction"):
                self._begin(conn)
            try:
                yield _Batch(self, conn)
                with self._mapped("commit the batch"):
                    if not _in_transaction(conn):
                        raise StoreError("the batch transaction was ended by a handler")
                    self._commit(conn)
            except BaseException:
                self._rollback_quietly(conn)
                raise

    @contextmanager
    def _delivering(
        self, conn: _StoreConnection, claim: Claim, at: datetime
    ) -> Iterator[_Delivery]:
        """Inside ``conn``'s open transaction: check the token, hand out the delivery, check
        the handler left the transaction open. Commits nothing."""
        with self._mapped(f"check the claim on event {claim.event.id}"):
            owned = conn.execute(
                self._queries.owned, {"id": claim.event.id, "token": claim.token}
            ).fetchone()
        if owned is None:
            raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
        tx = _Delivery(self, conn, claim, at)
        conn.delivery = tx
        try:
            yield tx
            tx.check_open()
        except Exception as exc:
            failure = _database_failure(exc)
            if failure is not None:
                # The file failed under the handler (disk full, I/O error): the database's
                # failure, not the handler's, whatever the handler made of it.
                raise self._store_error(
                    failure,
                    f"deliver event {claim.event.id} (the database failed while a handler ran)",
                ) from exc
            if tx.ended_by_handler and not isinstance(
                exc, HandlerCrashed | Reject | LeaseLostError
            ):
                raise HandlerCrashed(
                    f"event {claim.event.id}: a handler may not commit or roll back its "
                    "delivery transaction (outboxkit commits it with the delivery record); "
                    f"its writes were rolled back: {exc}"
                ) from exc
            raise
        finally:
            conn.delivery = None

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        with self._write(f"extend {len(claims)} lease(s)") as conn:
            return self._extend_on(conn, claims, lease, _now(now))

    def _extend_on(
        self, conn: sqlite3.Connection, claims: Sequence[Claim], lease: timedelta, at: datetime
    ) -> list[Claim]:
        kept = {
            token: locked_until
            for token, locked_until in conn.execute(
                self._queries.extend,
                {"lease_end": _to_us(at + lease), **_claim_keys(claims)},
            ).fetchall()
        }
        return still_owned(claims, {token: _from_us(end) for token, end in kept.items()})

    def make_waiter(self) -> ClosingWaiter | None:
        """None: SQLite has no notifications; pollers poll (and an enqueue in the same process
        wakes them directly)."""
        return None

    def settle_many(
        self, items: Sequence[tuple[Claim, Settlement, str | None]], *, now: datetime | None
    ) -> list[bool]:
        """``settle`` for several events in one transaction (the ``batched_settle``
        capability); which of them were settled, in order."""
        if not items:
            return []
        with self._write(f"settle {len(items)} event(s)") as conn:
            return self._settle_many_on(conn, items, _now(now))

    def _settle_many_on(
        self,
        conn: sqlite3.Connection,
        items: Sequence[tuple[Claim, Settlement, str | None]],
        at: datetime,
    ) -> list[bool]:
        rows = [
            [params[key] for key in _SETTLE_MANY_COLUMNS]
            for params in (self._settle_params(c, s, e, at) for c, s, e in items)
        ]
        settled = {
            row[0]
            for row in conn.execute(
                self._queries.settle_many, {"now": _to_us(at), "items": json.dumps(rows)}
            )
        }
        return [claim.event.id in settled for claim, _, _ in items]

    def _settle_on(
        self,
        conn: sqlite3.Connection,
        claim: Claim,
        settlement: Settlement,
        error: str | None,
        at: datetime,
    ) -> bool:
        params = self._settle_params(claim, settlement, error, at)
        return conn.execute(self._queries.settle, params).rowcount == 1

    @staticmethod
    def _settle_params(
        claim: Claim, settlement: Settlement, error: str | None, at: datetime
    ) -> dict[str, Any]:
        return settle_params(
            claim,
            settlement,
            error=error,
            now=_to_us(at),
            retry_after=lambda delay: delay // _MICROSECOND,
        )

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        if not claims:
            return 0
        with self._write(f"release {len(claims)} claim(s)") as conn:
            cursor = conn.execute(self._queries.release, _claim_keys(claims))
            return cursor.rowcount

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        wanted = sorted(set(ids))
        if not wanted:
            return 0
        at = _now(now)
        with self._write(f"requeue {len(wanted)} event(s)") as conn:
            cursor = conn.execute(
                self._queries.requeue, {"ids": json.dumps(wanted), "now": _to_us(at)}
            )
            return cursor.rowcount

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        with self._read("list dead letters") as conn:
            rows = conn.execute(
                self._queries.dead_letters,
                {
                    "topic": topic,
                    "since": None if since is None else _to_us(since),
                    "limit": limit,
                },
            ).fetchall()
            records = self._records_of(conn, [row[0] for row in rows])
        return [
            DeadLetter(
                event=_event(row),
                failed_at=_from_us(row[9]),
                last_error=row[11],
                records=tuple(records.get(row[0], ())),
            )
            for row in rows
        ]

    def _records_of(
        self, conn: sqlite3.Connection, ids: list[int]
    ) -> dict[int, list[DeliveryRecord]]:
        found: dict[int, list[DeliveryRecord]] = {}
        if not ids:
            return found
        for event_id, handler, outcome, attempt, recorded_at, reason in conn.execute(
            self._queries.records, {"ids": json.dumps(ids)}
        ):
            found.setdefault(event_id, []).append(
                record_from_row(
                    event_id=event_id,
                    handler=handler,
                    outcome=outcome,
                    attempt=attempt,
                    recorded_at=_from_us(recorded_at),
                    reason=reason,
                )
            )
        return found

    def get(self, event_id: int) -> Event | None:
        with self._read(f"read event {event_id}") as conn:
            row = conn.execute(self._queries.get, {"id": event_id}).fetchone()
        return None if row is None else _event(row)

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        with self._read("list events") as conn:
            rows = conn.execute(
                self._queries.events, {"after_id": after_id, "topic": topic, "limit": limit}
            ).fetchall()
        return [_event(row) for row in rows]

    def records(self, event_id: int) -> list[DeliveryRecord]:
        with self._read(f"read the records of event {event_id}") as conn:
            return self._records_of(conn, [event_id]).get(event_id, [])

    def purge_published(self, *, before: datetime, limit: int) -> int:
        with self._write("purge published events") as conn:
            ids = [
                row[0]
                for row in conn.execute(
                    self._queries.purge_published, {"before": _to_us(before), "limit": limit}
                ).fetchall()
            ]
            return self._purge_records(conn, ids)

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        wanted = None if ids is None else json.dumps(sorted(set(ids)))
        with self._write("purge dead events") as conn:
            doomed = [
                row[0]
                for row in conn.execute(
                    self._queries.purge_dead,
                    {
                        "ids": wanted,
                        "before": None if before is None else _to_us(before),
                        "limit": limit,
                    },
                ).fetchall()
            ]
            return self._purge_records(conn, doomed)

    def _purge_records(self, conn: sqlite3.Connection, ids: list[int]) -> int:
        if ids:
            conn.execute(self._queries.purge_records, {"ids": json.dumps(ids)})
        return len(ids)

    def stats(self, *, now: datetime | None) -> Stats:
        at = _now(now)
        counts = {"pending": 0, "claimed": 0, "published": 0, "dead": 0}
        by_topic: dict[str, dict[str, int]] = {}
        oldest: int | None = None
        with self._read("count events") as conn:
            rows = conn.execute(self._queries.stats, {"now": _to_us(at)}).fetchall()
        for topic, state, count, oldest_due in rows:
            counts[state] += count
            by_topic.setdefault(topic, {})[state] = count
            if oldest_due is not None and (oldest is None or oldest_due < oldest):
                oldest = oldest_due
        return Stats(**counts, by_topic=by_topic, oldest_due_at=_from_us_or_none(oldest))


def _event(row: Sequence[Any]) -> Event:
    """An Event from the first twelve columns of a row (``_sql.EVENT_COLUMNS``)."""
    return event_from_row(
        id=row[0],
        topic=row[1],
        payload=row[2],
        headers=row[3],
        key=row[4],
        created_at=_from_us(row[5]),
        available_at=_from_us(row[6]),
        attempts=row[7],
        published_at=_from_us_or_none(row[8]),
        failed_at=_from_us_or_none(row[9]),
        locked_until=_from_us_or_none(row[10]),
        last_error=row[11],
    )


# SQLite result codes that mean the database file itself failed (never a handler's own doing).
_DATABASE_FAILED = (
    "SQLITE_FULL",
    "SQLITE_IOERR",
    "SQLITE_CORRUPT",
    "SQLITE_NOTADB",
    "SQLITE_CANTOPEN",
)


def _database_failure(exc: BaseException) -> sqlite3.Error | None:
    """The ``sqlite3`` error in ``exc``'s chain that says the database file failed, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sqlite3.Error) and _error_name(current).startswith(_DATABASE_FAILED):
            return current
        current = current.__cause__ or current.__context__
    return None


def _claim_keys(claims: Sequence[Claim]) -> dict[str, str]:
    """The ``:ids`` and ``:tokens`` JSON arrays that ``extend`` and ``release`` match rows by."""
    return {
        "ids": json.dumps([c.event.id for c in claims]),
        "tokens": json.dumps([c.token for c in claims]),
    }


def _row(event: NewEvent, created: int) -> tuple[Any, ...]:
    """The ``insert_events`` values of one event, created at ``created`` (microseconds)."""
    if not event.headers and not event.delay:  # the usual event: nothing to encode or add
        return (event.topic, event.payload_json, "{}", event.key, created, created)
    return (
        event.topic,
        event.payload_json,
        encode_headers(event.headers),
        event.key,
        created,
        created + event.delay // _MICROSECOND,
    )


_HAS_AUTOCOMMIT = hasattr(sqlite3.Connection, "autocommit")  # Python 3.12+
_read_text = functools.partial(str, encoding="utf-8", errors="backslashreplace")


def _app_connection(conn: Any) -> sqlite3.Connection:
    """The ``sqlite3.Connection`` behind what the app passed to ``enqueue``, if it may write.

    Raises:
        ConfigurationError: not a SQLite connection, or no transaction is (or will be) open.
    """
    if isinstance(conn, sqlite3.Connection):
        raw, wrapped = conn, False
    else:
        inner = getattr(conn, "conn", None)
        if not isinstance(inner, sqlite3.Connection):
            raise ConfigurationError(
                "the SQLite store enqueues through a sqlite3.Connection (or a "
                f"sqlite_utils.Database) in the app's open transaction, got {conn!r:.80}"
            )
        raw, wrapped = inner, True
    try:
        if raw.in_transaction:
            return raw
    except sqlite3.ProgrammingError as exc:
        raise ConfigurationError(f"enqueue got a closed SQLite connection: {exc}") from exc
    # No transaction is open. Python's legacy (default) handling opens one before our INSERT,
    # exactly as it would before the app's own INSERT, and leaves it to the app to commit; in
    # autocommit mode the INSERT would commit on its own, outside any transaction of the app's.
    # sqlite-utils commits every write made outside db.atomic(), so it needs an open one too.
    autocommit = getattr(raw, "autocommit", None) if _HAS_AUTOCOMMIT else None
    legacy = autocommit is None or autocommit == getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", -1)
    if legacy and raw.isolation_level is not None and not wrapped:
        return raw
    how = (
        "enqueue inside `with db.atomic():` (or after db.begin())"
        if wrapped
        else "run BEGIN first (isolation_level=None / autocommit=True), or use Python's "
        "default transaction handling or autocommit=False"
    )
    raise ConfigurationError(
        "enqueue needs an open transaction on the app's SQLite connection, so that the event "
        f"commits or rolls back with the app's writes; this one is in autocommit mode: {how}. "
        "Nothing was written."
    )


def _check_path(path: Path) -> None:
    """Clear errors for the usual reasons a database file cannot be used, before SQLite's own.

    Raises:
        ConfigurationError: naming the path.
    """
    directory = path.parent
    if not directory.is_dir():
        raise ConfigurationError(
            f"cannot open the SQLite database {path}: its directory {directory} does not exist"
        )
    if path.is_dir():
        raise ConfigurationError(f"cannot open the SQLite database {path}: it is a directory")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise ConfigurationError(
            f"cannot open the SQLite database {path}: the file is read-only (or unreadable) "
            "for this process; outboxkit needs to read and write it"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"cannot open the SQLite database {path}: its directory {directory} is not "
            "writable; SQLite needs to create the database's -wal and -shm files there"
        )


def _path_from_url(url: str) -> str:
    """The path (or ``:memory:``) a ``sqlite://`` URL names.

    Raises:
        ConfigurationError: not a sqlite URL, or neither ``sqlite:///path`` nor ``:memory:``.
    """
    scheme, sep, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    if not sep or scheme.lower() != "sqlite":
        raise ConfigurationError(f"a SQLite store URL starts with 'sqlite://', got {url!r}")
    if rest in (MEMORY, "/" + MEMORY):
        return MEMORY
    if not rest.startswith("/") or len(rest) < 2 or "?" in rest or "#" in rest:
        raise ConfigurationError(
            "a SQLite store URL is sqlite:///relative/path.db, sqlite:////absolute/path.db "
            f"or sqlite://:memory:, got {url!r}"
        )
    return rest[1:]
