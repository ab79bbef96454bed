"""The SQLite store: one file, no server, several poller processes on one machine.

Theory of operation:

- The schema is created and migrated with sqlite-utils (``schema``); the hot path runs on plain
  ``sqlite3``, on the store's own connections (``connections``): every transaction an explicit,
  short ``BEGIN IMMEDIATE`` ... ``COMMIT`` that takes SQLite's single write lock up front.
- The file runs in WAL mode (readers never block the writer) with ``synchronous=NORMAL``: a
  committed transaction survives any process crash; a power cut may lose the last few commits.
- The SQL is in ``queries.sql``; the operations every SQL store shares (claim, extend, the
  round's ``settle_many``, release, requeue, listings, purges, stats) are
  ``outboxkit._sql.base.SQLStore``'s. What is SQLite's own lives here (its transactions, each
  written once against a given connection, enqueue, the paths) and beside it: the delivery
  transaction and the batch's savepoints (``delivery``), what the app's connection must be
  (``caller``), and the asyncio side (``aio``), which runs these very transactions on aiosqlite.
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

import functools
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from outboxkit._sql.base import SQLStore
from outboxkit._sql.names import check_count, check_options, check_seconds
from outboxkit._sql.rows import encode_headers, inserted_ids, resolve_ids
from outboxkit.core.model import Claim, DeadKey, Migration, NewEvent
from outboxkit.errors import (
    ConfigurationError,
    LeaseLostError,
    SchemaError,
    StoreError,
    migrate_hint,
)
from outboxkit.store import Capabilities
from outboxkit.waiter import ClosingWaiter

from . import schema
from .caller import app_connection
from .connections import (
    BEGIN,
    BEGIN_READ,
    COMMIT,
    Connections,
    StoreConnection,
    WalWatch,
    connect,
    in_transaction,
    retry_busy,
)
from .delivery import Batch, Delivery, Lazily, Pooled, delivering
from .errors import map_error, open_error
from .tables import (
    INSERT_COLUMNS,
    INSERT_TAIL,
    NEW_MESSAGE_ID,
    TableNames,
    insert_events,
    render_queries,
)

if TYPE_CHECKING:
    from .aio import AsyncSQLiteStore

__all__ = ["SQLiteStore"]

MEMORY = ":memory:"
DEFAULT_BUSY_TIMEOUT = 30.0
MIB = 1024 * 1024
DEFAULT_WAL_WARN_BYTES = 64 * MIB
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
        "create",
    }
)


def _to_us(at: datetime) -> int:
    if at.tzinfo is None or at.utcoffset() is None:
        raise ConfigurationError(f"instants must be timezone-aware, got {at!r}")
    return (at - _EPOCH) // _MICROSECOND


@functools.lru_cache(maxsize=1024)
def _from_us(us: int) -> datetime:
    # Kept: a claim's rows share their lease end, and events enqueued together their instants.
    return _EPOCH + timedelta(0, 0, us)  # positional: cheaper than microseconds=


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
            raise map_error(exc, self._store._where, self._what) from exc


class SQLiteStore(SQLStore):
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
        create: create the file when it is missing (default). With False a missing file is
            refused (``ConfigurationError`` naming the path and ``outboxkit migrate``): what
            ``outboxkit``'s commands other than ``migrate`` use, so that a mistyped path is an
            error, not a new empty database.

    Raises:
        ConfigurationError: a bad option or table name; the directory is missing; the file or
            its directory is read-only or not a database (the message names the path).
        SchemaError: the database's schema is newer than this code (both versions named).
        StoreError: SQLite failed otherwise while opening.
    """

    sql_dialect = "sqlite"
    """The SQL dialect of the store's database, by SQLAlchemy's name for it."""

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
    ) -> None:
        self.tables = TableNames.from_options(
            table_prefix, events_table, deliveries_table, schema_table
        )
        self.busy_timeout = check_seconds("busy_timeout", busy_timeout, allow_zero=True)
        self.wal_warn_bytes = check_count("wal_warn_bytes", wal_warn_bytes, minimum=1)
        self._queries = render_queries(self.tables)
        self.memory = os.fspath(path) == MEMORY
        if self.memory:
            self.path: Path | None = None
            self.url: str | None = "sqlite://:memory:"
        else:
            self.path = Path(os.path.abspath(os.fspath(path)))
            self.url = f"sqlite:///{self.path.as_posix()}"
            _check_path(self.path)
            if not create and not self.path.exists():
                raise ConfigurationError(
                    f"there is no SQLite database {self.path} (to create one, run "
                    "`outboxkit migrate` on it)"
                )
        self.capabilities = Capabilities(
            batches=True,
            transactional_handlers=True,
            concurrent_claimers=True,
            multiprocess=not self.memory,
            asyncio=not self.memory,
            ordering=True,
            dedupe=True,
        )
        self.options: dict[str, Any] = {
            "events_table": self.tables.events,
            "deliveries_table": self.tables.deliveries,
            "schema_table": self.tables.schema,
            "busy_timeout": self.busy_timeout,
            "wal_warn_bytes": self.wal_warn_bytes,
        }
        self._async: AsyncSQLiteStore | None = None
        self._async_lock = threading.Lock()
        self._wal = WalWatch(None if self.memory else self._where, self.wal_warn_bytes)
        self._connections = self._open_connections()
        # An older schema found with migrate=False: pollers are refused until migrate().
        self._older: int | None = None
        try:
            if migrate:
                self.migrate()
            else:
                with self._read("check the schema version") as conn:
                    found = schema.current_version(conn, self.tables)
                schema.check_version(found, self._where)
                if 0 < found < schema.SCHEMA_VERSION:
                    self._older = found
        except BaseException:
            self._connections.close()
            raise
        self._shape_inserts()

    def _shape_inserts(self) -> None:
        """The statements that insert events into the schema found: with the message identity
        (``message_id``, version 6), or without it into a version 5 schema opened with
        ``migrate=False`` (its rows keep NULL, their identity their decimal id)."""
        self._with_message_id = self._older is None
        self._insert_head = self._queries[
            "insert_events_head" if self._with_message_id else "insert_events_head_v5"
        ]
        self._insert_one = insert_events(self._insert_head, 1, message_id=self._with_message_id)

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
        return f"SQLiteStore({self._where!r})"

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _where(self) -> str:
        return MEMORY if self.path is None else str(self.path)

    # -- the dialect seam (outboxkit._sql.base) ---------------------------------------------------

    def _mapped(self, doing: str, conn: Any = None) -> _Mapped:
        return _Mapped(self, doing)

    def _rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Sequence[Any]]:
        rows: list[Sequence[Any]] = conn.execute(self._queries[name], params).fetchall()
        return rows

    def _instant(self, at: datetime | None) -> int:
        # The store's clock is this host's: microseconds straight from it.
        return _to_us(at) if at is not None else time.time_ns() // 1000

    def _stored_instant(self, raw: Any) -> datetime:
        return _from_us(raw)

    def _duration(self, delta: timedelta) -> int:
        return delta // _MICROSECOND

    def _array(self, values: Sequence[Any]) -> str:
        return json.dumps(list(values))

    def _done(self, raw: Any) -> list[Sequence[str]]:
        pairs: list[Sequence[str]] = json.loads(raw) if raw and raw != "[]" else []
        return pairs

    def _records_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        return {"items": json.dumps(rows)}

    def _settle_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        return {"items": json.dumps(rows)}

    @contextmanager
    def _write(self, doing: str) -> Iterator[StoreConnection]:
        """A short write transaction on a store connection: BEGIN IMMEDIATE ... COMMIT."""
        with self._connections.acquire() as conn, self._write_on(conn, doing):
            yield conn

    @contextmanager
    def _read(self, doing: str) -> Iterator[StoreConnection]:
        """A read transaction (one consistent snapshot across several statements)."""
        with self._connections.acquire() as conn:
            if in_transaction(conn):  # :memory:, inside the same thread's transaction()
                with self._mapped(doing):
                    yield conn
                return
            try:
                with self._mapped(doing):
                    conn.control(BEGIN_READ)
                    yield conn
                    conn.control(COMMIT)
            except BaseException:
                conn.rollback_quietly()
                raise

    # -- connections and transactions ---------------------------------------------------------------

    def _open_connections(self) -> Connections:
        connections = Connections(self._connect, shared=self.memory)
        if not self.memory:
            # WAL is a property of the file: set once, kept by every later connection.
            try:
                with connections.acquire() as conn:
                    (mode,) = retry_busy(
                        lambda: conn.execute("PRAGMA journal_mode=WAL").fetchone(),
                        busy_timeout=self.busy_timeout,
                    )
            except sqlite3.Error as exc:
                connections.close()
                raise open_error(exc, self._where) from exc
            except BaseException:
                connections.close()
                raise
            if str(mode).lower() != "wal":
                connections.close()
                raise StoreError(f"SQLite database {self._where}: cannot use WAL mode ({mode})")
        return connections

    def _connect(self) -> StoreConnection:
        try:
            return connect(self._where, busy_timeout=self.busy_timeout)
        except sqlite3.Error as exc:
            raise open_error(exc, self._where) from exc

    def _begin(self, conn: StoreConnection) -> None:
        retry_busy(conn.control, BEGIN, busy_timeout=self.busy_timeout)

    def _commit(self, conn: StoreConnection) -> None:
        """Commit a write transaction (and look at the WAL's size, now and then)."""
        retry_busy(conn.control, COMMIT, busy_timeout=self.busy_timeout)
        self._wal.after_commit(conn)

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
                conn.rollback_quietly()
                raise
            if in_transaction(conn):
                try:
                    with self._mapped("commit the transaction"):
                        self._commit(conn)
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
        with self._write("migrate the schema") as conn:
            found = schema.migrate(
                conn, self.tables, applied_at=self._instant(None), where=self._where
            )
        self._older = None
        self._shape_inserts()
        return Migration(before=found, after=schema.SCHEMA_VERSION)

    def close(self) -> None:
        """Close every connection, the asyncio side's too. The store is unusable afterwards;
        closing twice is fine."""
        self._connections.close()
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
            if self._connections.closed:
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
        return self._insert(app_connection(conn), events, self._instant(now))

    def _insert(
        self, conn: sqlite3.Connection, events: Sequence[NewEvent], created: int
    ) -> list[int]:
        if not events:
            return []
        if self._older is not None and self._older < _DEDUPE_VERSION:
            return self._insert_older(conn, events, created)
        if len(events) == 1 and events[0].dedupe_key is None:
            # Outbox.enqueue, the hot path: one cached statement, no chunking
            try:
                (event_id, _) = conn.execute(self._insert_one, _row(events[0], created)).fetchone()
            except sqlite3.Error as exc:
                raise map_error(exc, self._where, "enqueue 1 event") from exc
            return [event_id]
        rows = [_row(e, created) for e in events]
        returned: list[Sequence[Any]] = []
        with self._mapped(f"enqueue {len(rows)} event(s)"):
            per_statement = max(
                1, conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // INSERT_COLUMNS
            )
            head, drawn = self._insert_head, self._with_message_id
            for start in range(0, len(rows), per_statement):
                chunk = rows[start : start + per_statement]
                values = [value for row in chunk for value in row]
                # RETURNING has no order; one INSERT hands out increasing ids in VALUES order.
                statement = insert_events(head, len(chunk), message_id=drawn)
                returned.extend(conn.execute(statement, values).fetchall())
            ids, missing = inserted_ids(events, returned)
            found = self._dedupe_holders(conn, missing) if missing else {}
            return resolve_ids(events, ids, found)

    def _dedupe_holders(self, conn: sqlite3.Connection, keys: list[str]) -> dict[str, int]:
        """R16: dedupe key -> the id of the stored event holding it."""
        rows = self._rows(conn, "dedupe_holders", {"keys": self._array(keys)})
        return {key: event_id for key, event_id in rows}

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
        created = self._instant(now)
        head = self._insert_head
        drawn = [NEW_MESSAGE_ID] if self._with_message_id else []
        statements: list[tuple[str, dict[str, Any]]] = []
        for start in range(0, len(events), _PORTABLE_ROWS):
            chunk = events[start : start + _PORTABLE_ROWS]
            params: dict[str, Any] = {}
            values = []
            for i, event in enumerate(chunk):
                names = [f"{column}{i}" for column in _PORTABLE_COLUMNS]
                params.update(zip(names, _row(event, created), strict=True))
                values.append("(" + ", ".join([*(f":{name}" for name in names), *drawn]) + ")")
            statements.append((f"{head} {', '.join(values)}{INSERT_TAIL}", params))
        return statements

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        self._check_schema()
        return super().claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    def _insert_older(
        self, conn: sqlite3.Connection, events: Sequence[NewEvent], created: int
    ) -> list[int]:
        """Enqueue into a schema older than version 5 (opened with ``migrate=False``, not
        migrated yet), so that an app can write events before its pollers' ``migrate()``: one
        statement per event, with the columns every version has; a dedupe key needs version 5.

        Raises:
            SchemaError: an event has a dedupe key.
        """
        if any(event.dedupe_key is not None for event in events):
            raise SchemaError(
                f"SQLite database {self._where} has outboxkit schema version {self._older}: "
                f"dedupe_key needs version {_DEDUPE_VERSION}: run migrate()"
            )
        statement = self._queries["insert_event_older"]
        with self._mapped(f"enqueue {len(events)} event(s)"):
            return [
                conn.execute(statement, _row(event, created)[:-1]).fetchone()[0] for event in events
            ]

    def _check_schema(self) -> None:
        """Refuse pollers while the schema is older (opened with ``migrate=False``)."""
        if self._older is not None:
            raise SchemaError(
                f"SQLite database {self._where} has outboxkit schema version {self._older}, "
                f"older than version {schema.SCHEMA_VERSION} this outboxkit needs: "
                f"{migrate_hint()}"
            )

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[Delivery]:
        """A delivery transaction (``BEGIN IMMEDIATE``, the claim's token checked), opened when
        ``tx.connection`` is first taken; a block that never takes it ends with its record in
        one fenced, autocommitted statement (``_lazily``).

        ``tx.connection`` is the store's ``sqlite3.Connection`` inside that transaction; the
        handler may read and write through it but not commit, roll back or close it.

        Raises:
            LeaseLostError: the token is stale (nothing is written).
            HandlerCrashed: the handler ended or closed the transaction it was given.
            StoreUnavailable: the database failed under the handler.
            StoreError: SQLite failed.
        """
        return Pooled(self, claim, now)

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[Batch]:
        """One ``BEGIN IMMEDIATE`` transaction for a claimed batch (``transaction="per_batch"``):
        each delivery a savepoint of it, everything committed once. It holds SQLite's write
        lock until the batch ends, so other writers wait (up to ``busy_timeout``)."""
        with self._connections.acquire() as conn, self._batch_on(conn) as batch:
            yield batch

    # -- the transactions, on a given connection ----------------------------------------------------
    # Each one whole, from BEGIN to COMMIT: the blocking store runs them on its connections, the
    # asyncio side (``aio``) on the threads of its own, with the block in between on the loop.

    @contextmanager
    def _write_on(self, conn: StoreConnection, doing: str) -> Iterator[StoreConnection]:
        """A short write transaction on ``conn``, its errors mapped naming ``doing``."""
        try:
            with self._mapped(doing):
                self._begin(conn)
                yield conn
                self._commit(conn)
        except BaseException:
            conn.rollback_quietly()
            raise

    @contextmanager
    def _delivery_on(
        self,
        conn: StoreConnection,
        claim: Claim,
        now: datetime | None,
        tx: Delivery | None = None,
    ) -> Iterator[Delivery]:
        """``delivery`` on ``conn``: BEGIN IMMEDIATE, the token check, the block, COMMIT (the
        block hands out ``tx``, when given: a delivery ``_lazily`` opens now)."""
        with self._mapped(f"open a delivery transaction for event {claim.event.id}"):
            self._begin(conn)
        try:
            with delivering(self, conn, claim, now, tx) as opened:
                yield opened
            with self._mapped(f"commit the delivery of event {claim.event.id}"):
                self._commit(conn)
        except BaseException:
            conn.rollback_quietly()
            raise

    def _lazily(
        self, conn: StoreConnection, claim: Claim, now: datetime | None
    ) -> AbstractContextManager[Delivery]:
        """``delivery`` on ``conn``, opened (``_delivery_on``) only when the handler first
        takes the connection or enqueues a follow-up (``delivery.Lazily``); one that never did
        and ends with one record is that record, fenced by the token, autocommitted."""

        def fenced(tx: Delivery) -> None:
            if not tx.write_fenced():
                raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
            self._wal.after_commit(conn)

        return Lazily(
            self, conn, claim, now, lambda tx: self._delivery_on(conn, claim, now, tx), fenced
        )

    @contextmanager
    def _batch_on(self, conn: StoreConnection) -> Iterator[Batch]:
        """``batch`` on ``conn``: BEGIN IMMEDIATE, the block, COMMIT."""
        with self._mapped("open a batch transaction"):
            self._begin(conn)
        try:
            batch = Batch(self, conn)
            yield batch
            batch.write_kept()
            with self._mapped("commit the batch"):
                if not in_transaction(conn):
                    raise StoreError("the batch transaction was ended by a handler")
                self._commit(conn)
        except BaseException:
            conn.rollback_quietly()
            raise


_DEDUPE_VERSION = 5
"""The schema version that added dedupe keys (and the multi-row insert with them)."""

_PORTABLE_COLUMNS = ("topic", "payload", "headers", "key", "created", "available", "dedupe")
_PORTABLE_ROWS = 999 // len(_PORTABLE_COLUMNS)  # within SQLite's oldest parameter limit


def _row(event: NewEvent, created: int) -> tuple[Any, ...]:
    """The ``insert_events`` values of one event, created at ``created`` (microseconds)."""
    if not event.headers and not event.delay and event.available_at is None:
        # the usual event: nothing to encode or add
        return (
            event.topic,
            event.payload_json,
            "{}",
            event.key,
            created,
            created,
            event.dedupe_key,
        )
    return (
        event.topic,
        event.payload_json,
        encode_headers(event.headers),
        event.key,
        created,
        (
            _to_us(event.available_at)
            if event.available_at is not None
            else created + event.delay // _MICROSECOND
        ),
        event.dedupe_key,
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
