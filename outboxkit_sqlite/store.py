"""The SQLite store: one file, no server, several poller processes on one machine.

Theory of operation:

- The schema is created and migrated with sqlite-utils (``schema``); the hot path runs on plain
  ``sqlite3``, on the store's own connections (``connections``): every transaction an explicit,
  short ``BEGIN IMMEDIATE`` ... ``COMMIT`` that takes SQLite's single write lock up front.
- The file runs in WAL mode (readers never block the writer) with ``synchronous=NORMAL``: a
  committed transaction survives any process crash; a power cut may lose the last few commits.
- The SQL is in ``queries.sql``; the operations every SQL store shares (claim, extend, the
  round's ``settle_many``, release, requeue, listings, purges, stats) are
  ``outboxkit.storekit.sql.SQLStore``'s, run on the store's dialect (``dialect``,
  ``SQLiteDialect``: the connections, the transactions, the error mapping, the values, the
  insert of events). What is the store's own lives here (enqueue, ``transaction``, migrations,
  the paths) and beside it: the delivery transaction and the batch's savepoints
  (``delivery``), what the app's connection must be (``caller``), and the asyncio side
  (``aio``), which runs these very transactions on aiosqlite. Each helper gets the dialect, or
  the store's public members.
- A claim is one ``UPDATE ... WHERE id IN (SELECT ... LIMIT n) RETURNING ...`` under the write
  lock: two claimers, in threads or processes, never get the same event (R3).
- A delivery transaction holds the write lock while its handler runs, so handlers on SQLite
  should be short; the connection's authorizer refuses ``COMMIT``/``ROLLBACK``/``BEGIN`` from
  the handler.
- Instants are INTEGER microseconds since the epoch (UTC), bound from the caller's clock.
- ``sqlite://:memory:`` is one in-memory database on one connection, shared by the threads of one
  process under a re-entrant lock.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from outboxkit.core.model import Claim, DeadKey, Migration, NewEvent
from outboxkit.errors import ConfigurationError, StoreError
from outboxkit.store import Capabilities
from outboxkit.storekit.names import check_count, check_options, check_seconds
from outboxkit.storekit.sql import SQLStore
from outboxkit.waiter import ClosingWaiter

from . import schema
from .caller import app_connection
from .connections import in_transaction
from .delivery import Batch, Delivery, Pooled, batch_on
from .dialect import MEMORY, SQLiteDialect
from .tables import TableNames

if TYPE_CHECKING:
    from .aio import AsyncSQLiteStore

__all__ = ["SQLiteStore"]

DEFAULT_BUSY_TIMEOUT = 30.0
MIB = 1024 * 1024
DEFAULT_WAL_WARN_BYTES = 64 * MIB
_OPTIONS = frozenset(
    {
        "table_prefix",
        "events_table",
        "deliveries_table",
        "schema_table",
        "busy_timeout",
        "wal_warn_bytes",
        "migrate",
        "create",
    }
)


class SQLiteStore(SQLStore):
    """The SQLite store (``sqlite:///path/to/file.db``, ``sqlite://:memory:``).

    Thread-safe. With a file database, several processes on one machine may share it (each opens
    its own store on the same file); ``:memory:`` is for one process.

    Args:
        path: the database file (created if missing; its directory must exist), or ``":memory:"``.
        table_prefix: prefix of the three table names (``outbox_`` gives ``outbox_events``,
            ``outbox_deliveries``, ``outbox_schema``).
        events_table: the events table's name, instead of the prefix's.
        deliveries_table: the delivery records table's name, instead of the prefix's.
        schema_table: the schema version table's name, instead of the prefix's.
        busy_timeout: seconds a connection waits for SQLite's write lock before giving up.
        wal_warn_bytes: a write-ahead log larger than this (default 64 MiB) gets a passive
            checkpoint; if a read transaction held open elsewhere keeps it from getting through,
            a warning is logged on ``outboxkit.sqlite`` (at most once a minute).
        migrate: create or upgrade the schema on open (default). With False the schema is only
            checked, and :meth:`migrate` is yours to call: a newer schema is refused here, an
            older one at the first claim (a poller's first poll).
        create: create the file when it is missing (default). With False a missing file is
            refused (``ConfigurationError`` naming the path and ``outboxkit migrate``): what
            ``outboxkit``'s commands other than ``migrate`` use, so that a mistyped path is an
            error, not a new empty database.
        make_dialect: the store's dialect class, or a factory called as it is (``path`` or
            None for ``:memory:``, the ``TableNames``, ``busy_timeout=``, ``wal_warn_bytes=``):
            a dialect of the caller's, for a store on connections someone else holds (the
            Django store's runs on Django's connection). Default: ``SQLiteDialect``.

    Attributes:
        dialect: the store's ``SQLiteDialect``: its connections, transactions, statements and
            values, which the store's helpers (and its asyncio side) work with.

    Raises:
        ConfigurationError: a bad option or table name; the directory is missing; the file or
            its directory is read-only or not a database (the message names the path).
        SchemaError: the database's schema is newer than this code (both versions named).
        StoreError: SQLite failed otherwise while opening.
    """

    sql_dialect = "sqlite"
    """The SQL dialect of the store's database, by SQLAlchemy's name for it."""

    dialect: SQLiteDialect

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
        create: bool = True,
        make_dialect: Callable[..., SQLiteDialect] = SQLiteDialect,
    ) -> None:
        tables = TableNames.from_options(table_prefix, events_table, deliveries_table, schema_table)
        busy_timeout = check_seconds("busy_timeout", busy_timeout, allow_zero=True)
        wal_warn_bytes = check_count("wal_warn_bytes", wal_warn_bytes, minimum=1)
        file: Path | None = None
        if os.fspath(path) != MEMORY:
            file = Path(os.path.abspath(os.fspath(path)))
            _check_path(file)
            if not create and not file.exists():
                raise ConfigurationError(
                    f"there is no SQLite database {file} (to create one, run "
                    "`outboxkit migrate` on it)"
                )
        self.url: str | None = (
            "sqlite://:memory:" if file is None else f"sqlite:///{file.as_posix()}"
        )
        self.capabilities = Capabilities(
            batches=True,
            transactional_handlers=True,
            concurrent_claimers=True,
            multiprocess=file is not None,
            asyncio=file is not None,
            ordering=True,
            dedupe=True,
            error_history=True,
        )
        self.options: dict[str, Any] = {
            "events_table": tables.events,
            "deliveries_table": tables.deliveries,
            "schema_table": tables.schema,
            "busy_timeout": busy_timeout,
            "wal_warn_bytes": wal_warn_bytes,
        }
        self._async: AsyncSQLiteStore | None = None
        self._async_lock = threading.Lock()
        dialect = make_dialect(
            file, tables, busy_timeout=busy_timeout, wal_warn_bytes=wal_warn_bytes
        )
        super().__init__(dialect)
        try:
            if migrate:
                self.migrate()
            else:
                with dialect.read("check the schema version") as conn:
                    found = schema.current_version(conn, tables)
                schema.check_version(found, dialect.where)
                if 0 < found < schema.SCHEMA_VERSION:
                    # Pollers are refused until migrate(); enqueue writes the older shape.
                    dialect.use_schema(found)
        except BaseException:
            dialect.close()
            raise

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """The factory behind ``open_store("sqlite:///path")``.

        ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db`` (four slashes),
        ``sqlite://:memory:``. Options as for the constructor.

        Raises:
            ConfigurationError: the URL or an option is malformed (and as the constructor).
        """
        check_options(options, _OPTIONS, store="SQLite")
        return cls(_path_from_url(url), **options)

    def __repr__(self) -> str:
        return f"SQLiteStore({self.dialect.where!r})"

    # -- what the store was opened with (kept by its dialect) -----------------------------------

    @property
    def path(self) -> Path | None:
        """The database file (absolute), or None for ``:memory:``."""
        return self.dialect.path

    @property
    def memory(self) -> bool:
        """Whether the database is ``:memory:``."""
        return self.dialect.memory

    @property
    def tables(self) -> TableNames:
        """The store's table names."""
        return self.dialect.tables

    @property
    def busy_timeout(self) -> float:
        """Seconds a connection waits for SQLite's write lock before giving up."""
        return self.dialect.busy_timeout

    @property
    def wal_warn_bytes(self) -> int:
        """The WAL size over which a passive checkpoint runs (and may warn)."""
        return self.dialect.wal_warn_bytes

    # -- transactions -------------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A store connection inside ``BEGIN IMMEDIATE``: committed when the block ends, rolled
        back if it raises. ``enqueue`` accepts it; the app may run its own SQL on it too (and
        savepoints), but not commit, roll back or close it: the store does that.

        Raises:
            StoreError: the transaction could not begin or commit.
        """
        dialect = self.dialect
        with dialect.connections.acquire() as conn:
            with dialect.mapped("begin a transaction"):
                dialect.begin(conn)
            try:
                yield conn
            except BaseException:
                conn.rollback_quietly()
                raise
            if in_transaction(conn):
                try:
                    with dialect.mapped("commit the transaction"):
                        dialect.commit(conn)
                except BaseException:
                    conn.rollback_quietly()
                    raise

    # -- Store protocol -----------------------------------------------------------------------------

    def migrate(self) -> Migration:
        """Create or upgrade the schema. Idempotent; safe while other processes use the file.

        Returns:
            The version found (0: none) and the version left.

        Raises:
            SchemaError: the schema is newer than this code (both versions named), or its tables
                clash with existing ones.
            StoreError: SQLite failed.
        """
        dialect = self.dialect
        with dialect.write("migrate the schema") as conn:
            found = schema.migrate(
                conn, dialect.tables, applied_at=dialect.instant(None), where=dialect.where
            )
        dialect.use_schema(None)
        return Migration(before=found, after=schema.SCHEMA_VERSION)

    def close(self) -> None:
        """Close every connection, the asyncio side's too. The store is unusable afterwards;
        closing twice is fine."""
        self.dialect.close()
        with self._async_lock:
            side, self._async = self._async, None
        if side is not None:
            side.close_now()

    def now(self) -> datetime:
        """The store's clock: this host's (every process sharing the file is on it)."""
        return datetime.now(UTC)

    def async_store(self) -> AsyncSQLiteStore:
        """The store's asyncio side, on aiosqlite (``outboxkit_sqlite.aio``): made on first use,
        closed with the store. Its transactions are this store's, on connections of its own.

        Raises:
            ConfigurationError: the database is ``:memory:`` (``capabilities.asyncio`` is
                false): it lives on this store's one connection, which the asyncio side's
                threads cannot share; or the installed aiosqlite lacks what the side uses.
            StoreError: the store is closed.
        """
        if self.memory:
            raise ConfigurationError(
                "the SQLite store has no asyncio side for sqlite://:memory:: the in-memory "
                "database lives on the blocking store's one connection, which aiosqlite's "
                "threads cannot share; use a database file (a temporary one in tests)"
            )
        with self._async_lock:
            if self.dialect.connections.closed:
                raise StoreError("the SQLite store is closed")
            if self._async is None or self._async.closed:
                from .aio import AsyncSQLiteStore

                self._async = AsyncSQLiteStore(self)
            return self._async

    def make_waiter(self) -> ClosingWaiter | None:
        """None: SQLite has no notifications; pollers poll (and an enqueue in the same process
        wakes them directly)."""
        return None

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
        dialect = self.dialect
        return dialect.insert(app_connection(conn), events, dialect.instant(now))

    def portable_enqueue(
        self, events: Sequence[NewEvent], now: datetime | None
    ) -> list[tuple[str, dict[str, Any]]]:
        """The statements that insert ``events`` through a connection another library drives
        (SQLAlchemy's, on pysqlite or aiosqlite), as ``(sql, params)`` with ``:name``
        parameters; each returns the new ids as its rows' first column (in order once sorted).
        The identifiers are the store's validated table names; every value is a parameter.

        Raises:
            ConfigurationError: ``now`` is naive.
        """
        return self.dialect.portable_enqueue(events, now)

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        self.dialect.check_schema()
        return super().claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[Delivery]:
        """A delivery transaction (``BEGIN IMMEDIATE``, the claim's token checked), opened when
        ``tx.connection`` is first taken; a block that never takes it ends with its record in
        one fenced, autocommitted statement (``delivery.lazily``).

        ``tx.connection`` is the store's ``sqlite3.Connection`` inside that transaction; the
        handler may read and write through it but not commit, roll back or close it.

        Raises:
            LeaseLostError: the token is stale (nothing is written).
            HandlerCrashed: the handler ended or closed the transaction it was given.
            StoreUnavailable: the database failed under the handler.
            StoreError: SQLite failed.
        """
        return Pooled(self.dialect, claim, now)

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[Batch]:
        """One ``BEGIN IMMEDIATE`` transaction for a claimed batch (``transaction="per_batch"``):
        each delivery a savepoint of it, everything committed once. It holds SQLite's write
        lock until the batch ends, so other writers wait (up to ``busy_timeout``)."""
        with self.dialect.connections.acquire() as conn, batch_on(self, conn) as batch:
            yield batch


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
