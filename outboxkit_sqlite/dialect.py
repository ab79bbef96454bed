"""The SQLite dialect (``outboxkit.storekit.sql.Dialect``): what the SQLite store's SQL runs on.

It holds what the store's operations and its helpers (``delivery``, ``aio``) share, as public
members: the database (``path``, ``where``), the store's connections (``connections``) and the
WAL watch, the statements of ``queries.sql`` with the store's table names in place
(``queries``), the error mapping (``mapped``), the transactions (``read``, ``write``, and
``write_on`` a given connection: ``BEGIN IMMEDIATE`` with the busy retries, ``COMMIT`` and the
WAL watch), the values as SQLite binds and stores them (instants as INTEGER microseconds since
the epoch, UTC; durations in microseconds; arrays and settlements as JSON text), and the insert
of events (``insert``, in the shape of the schema found: ``use_schema``).
"""

from __future__ import annotations

import functools
import json
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from outboxkit.core.model import NewEvent
from outboxkit.errors import ConfigurationError, SchemaError, StoreError, migrate_hint
from outboxkit.storekit.rows import encode_headers, inserted_ids, resolve_ids
from outboxkit.storekit.sql import Dialect, JSONRows, Row

from . import schema
from .connections import (
    BEGIN,
    BEGIN_READ,
    COMMIT,
    Connections,
    StoreConnection,
    WalWatch,
    in_transaction,
    retry_busy,
)
from .connections import connect as new_connection
from .errors import map_error, open_error
from .tables import (
    INSERT_COLUMNS,
    INSERT_TAIL,
    NEW_MESSAGE_ID,
    TableNames,
    insert_events,
    render_queries,
)

__all__ = ["MEMORY", "SQLiteDialect", "to_us"]

MEMORY = ":memory:"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

DEDUPE_VERSION = 5
"""The schema version that added dedupe keys (and the multi-row insert with them)."""

_PORTABLE_COLUMNS = ("topic", "payload", "headers", "key", "created", "available", "dedupe")
_PORTABLE_ROWS = 999 // len(_PORTABLE_COLUMNS)  # within SQLite's oldest parameter limit


def to_us(at: datetime) -> int:
    """An aware instant as INTEGER microseconds since the epoch (UTC).

    Raises:
        ConfigurationError: ``at`` is naive.
    """
    if at.tzinfo is None or at.utcoffset() is None:
        raise ConfigurationError(f"instants must be timezone-aware, got {at!r}")
    return (at - _EPOCH) // _MICROSECOND


@functools.lru_cache(maxsize=1024)
def _from_us(us: int) -> datetime:
    # Kept: a claim's rows share their lease end, and events enqueued together their instants.
    return _EPOCH + timedelta(0, 0, us)  # positional: cheaper than microseconds=


class _Mapped:
    """``SQLiteDialect.mapped``: a plain class, not a generator context manager (the hot path
    enters several per event)."""

    __slots__ = ("_dialect", "_what")

    def __init__(self, dialect: SQLiteDialect, what: str) -> None:
        self._dialect = dialect
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, sqlite3.Error):
            raise map_error(exc, self._dialect.where, self._what) from exc


class SQLiteDialect(JSONRows, Dialect):
    """The SQLite store's dialect (see the module docstring).

    Args:
        path: the database file (checked by the store), or None for ``:memory:``: one
            in-memory database on one connection, shared under a re-entrant lock.
        tables: the store's table names.
        busy_timeout: seconds a connection waits for SQLite's write lock before giving up.
        wal_warn_bytes: the WAL size over which the WAL watch checkpoints (and may warn).

    Attributes:
        connections: the store's own connections (opened here: the file set to WAL mode).
        wal: the WAL watch, told of every commit of the store's.
        queries: every statement of ``queries.sql``, the table names in place.
        older: the schema's version when it is older than this code's (opened with
            ``migrate=False``, not migrated yet), else None.

    Raises:
        ConfigurationError: the file cannot be used (the message names the path).
        StoreError: SQLite failed otherwise while opening, or WAL mode was refused.
    """

    name = "sqlite"

    def __init__(
        self,
        path: Path | None,
        tables: TableNames,
        *,
        busy_timeout: float,
        wal_warn_bytes: int,
    ) -> None:
        self.path = path
        self.memory = path is None
        self.where = MEMORY if path is None else str(path)
        self.tables = tables
        self.busy_timeout = busy_timeout
        self.wal_warn_bytes = wal_warn_bytes
        self.queries = render_queries(tables)
        self.wal = WalWatch(None if self.memory else self.where, wal_warn_bytes)
        self.use_schema(None)
        self.connections = self.open_connections()

    # -- errors and statements ------------------------------------------------------------------

    def mapped(self, doing: str, conn: Any = None) -> _Mapped:
        return _Mapped(self, doing)

    def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        rows: list[Row] = conn.execute(self.queries[name], params).fetchall()
        return rows

    def empty_tables(self, conn: Any) -> None:
        """Delete every event and record on ``conn`` (in its transaction), ids from 1 again:
        the test stores' emptying between tests."""
        for statement in self.queries["empty_tables"].split(";"):
            conn.execute(statement, {"events_table": self.tables.events})

    # -- values ---------------------------------------------------------------------------------

    def instant(self, at: datetime | None) -> int:
        # The store's clock is this host's: microseconds straight from it.
        return to_us(at) if at is not None else time.time_ns() // 1000

    def stored_instant(self, raw: Any) -> datetime:
        return _from_us(raw)

    def array(self, values: Sequence[Any]) -> str:
        return json.dumps(list(values))

    # -- connections and transactions -----------------------------------------------------------

    def open_connections(self) -> Connections:
        """The store's connections; a file's set to WAL mode (a property of the file: set once,
        kept by every later connection)."""
        connections = Connections(self.connect, shared=self.memory)
        if not self.memory:
            try:
                with connections.acquire() as conn:
                    (mode,) = retry_busy(
                        lambda: conn.execute("PRAGMA journal_mode=WAL").fetchone(),
                        busy_timeout=self.busy_timeout,
                    )
            except sqlite3.Error as exc:
                connections.close()
                raise open_error(exc, self.where) from exc
            except BaseException:
                connections.close()
                raise
            if str(mode).lower() != "wal":
                connections.close()
                raise StoreError(f"SQLite database {self.where}: cannot use WAL mode ({mode})")
        return connections

    def connect(self) -> StoreConnection:
        """A new store connection (``connections.connect``): the asyncio side's are opened
        with it too.

        Raises:
            ConfigurationError, StoreError: the database cannot be opened.
        """
        try:
            return new_connection(self.where, busy_timeout=self.busy_timeout)
        except sqlite3.Error as exc:
            raise open_error(exc, self.where) from exc

    def begin(self, conn: StoreConnection) -> None:
        """``BEGIN IMMEDIATE`` on ``conn``, retried while SQLite answers busy at once."""
        retry_busy(conn.control, BEGIN, busy_timeout=self.busy_timeout)

    def commit(self, conn: StoreConnection) -> None:
        """Commit a write transaction (and look at the WAL's size, now and then)."""
        retry_busy(conn.control, COMMIT, busy_timeout=self.busy_timeout)
        self.wal.after_commit(conn)

    @contextmanager
    def write(self, doing: str) -> Iterator[sqlite3.Connection]:
        """A short write transaction on a store connection: BEGIN IMMEDIATE ... COMMIT."""
        with self.connections.acquire() as conn, self.write_on(conn, doing):
            yield conn

    @contextmanager
    def write_on(self, conn: StoreConnection, doing: str) -> Iterator[StoreConnection]:
        """A short write transaction on ``conn``, its errors mapped naming ``doing`` (the
        asyncio side runs it on the thread of its aiosqlite connection)."""
        try:
            with self.mapped(doing):
                self.begin(conn)
                yield conn
                self.commit(conn)
        except BaseException:
            conn.rollback_quietly()
            raise

    @contextmanager
    def read(self, doing: str) -> Iterator[sqlite3.Connection]:
        """A read transaction (one consistent snapshot across several statements)."""
        with self.connections.acquire() as conn:
            if in_transaction(conn):  # :memory:, inside the same thread's transaction()
                with self.mapped(doing):
                    yield conn
                return
            try:
                with self.mapped(doing):
                    conn.control(BEGIN_READ)
                    yield conn
                    conn.control(COMMIT)
            except BaseException:
                conn.rollback_quietly()
                raise

    def close(self) -> None:
        """Close the store's connections; closing twice is fine."""
        self.connections.close()

    # -- the schema found, and the insert of events ----------------------------------------------

    def use_schema(self, older: int | None) -> None:
        """Insert events into the schema found: ``older``, a version before this code's
        (opened with ``migrate=False``), or None, the current one. With the message identity
        (``message_id``, version 6), or without it into a version 5 schema (its rows keep NULL,
        their identity their decimal id)."""
        self.older = older
        self.with_message_id = older is None
        self.insert_head = self.queries[
            "insert_events_head" if self.with_message_id else "insert_events_head_v5"
        ]
        self.insert_one = insert_events(self.insert_head, 1, message_id=self.with_message_id)

    def check_schema(self) -> None:
        """Refuse pollers while the schema is older (opened with ``migrate=False``).

        Raises:
            SchemaError: it is, naming both versions.
        """
        if self.older is not None:
            raise SchemaError(
                f"SQLite database {self.where} has outboxkit schema version {self.older}, "
                f"older than version {schema.SCHEMA_VERSION} this outboxkit needs: "
                f"{migrate_hint()}"
            )

    def insert(
        self, conn: sqlite3.Connection, events: Sequence[NewEvent], created: int
    ) -> list[int]:
        """Insert ``events`` through ``conn``, in the transaction open on it (the app's, a
        delivery's), created at ``created`` (microseconds); their ids, in ``events``' order
        (R16: an event whose dedupe key is taken gets the holder's id).

        Raises:
            SchemaError: a dedupe key on a schema older than version 5, or no schema.
            StoreError: SQLite failed.
        """
        if not events:
            return []
        if self.older is not None and self.older < DEDUPE_VERSION:
            return self.insert_older(conn, events, created)
        if len(events) == 1 and events[0].dedupe_key is None:
            # Outbox.enqueue, the hot path: one cached statement, no chunking
            try:
                (event_id, _) = conn.execute(self.insert_one, _row(events[0], created)).fetchone()
            except sqlite3.Error as exc:
                raise map_error(exc, self.where, "enqueue 1 event") from exc
            return [event_id]
        rows = [_row(e, created) for e in events]
        returned: list[Row] = []
        with self.mapped(f"enqueue {len(rows)} event(s)"):
            per_statement = max(
                1, conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // INSERT_COLUMNS
            )
            head, drawn = self.insert_head, self.with_message_id
            for start in range(0, len(rows), per_statement):
                chunk = rows[start : start + per_statement]
                values = [value for row in chunk for value in row]
                # RETURNING has no order; one INSERT hands out increasing ids in VALUES order.
                statement = insert_events(head, len(chunk), message_id=drawn)
                returned.extend(conn.execute(statement, values).fetchall())
            ids, missing = inserted_ids(events, returned)
            found = self.dedupe_holders(conn, missing) if missing else {}
            return resolve_ids(events, ids, found)

    def dedupe_holders(self, conn: sqlite3.Connection, keys: list[str]) -> dict[str, int]:
        """R16: dedupe key -> the id of the stored event holding it."""
        rows = self.rows(conn, "dedupe_holders", {"keys": self.array(keys)})
        return {key: event_id for key, event_id in rows}

    def insert_older(
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
                f"SQLite database {self.where} has outboxkit schema version {self.older}: "
                f"dedupe_key needs version {DEDUPE_VERSION}: run migrate()"
            )
        statement = self.queries["insert_event_older"]
        with self.mapped(f"enqueue {len(events)} event(s)"):
            return [
                conn.execute(statement, _row(event, created)[:-1]).fetchone()[0] for event in events
            ]

    def portable_enqueue(
        self, events: Sequence[NewEvent], now: datetime | None
    ) -> list[tuple[str, dict[str, Any]]]:
        """``SQLiteStore.portable_enqueue``: the inserts as ``(sql, params)`` with ``:name``
        parameters, for a connection another library drives.

        Raises:
            ConfigurationError: ``now`` is naive.
        """
        created = self.instant(now)
        head = self.insert_head
        drawn = [NEW_MESSAGE_ID] if self.with_message_id else []
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
            to_us(event.available_at)
            if event.available_at is not None
            else created + event.delay // _MICROSECOND
        ),
        event.dedupe_key,
    )
