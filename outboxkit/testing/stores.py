"""Stores for tests: ``open_test_store`` gives each test a fresh, migrated store.

SQLite tests copy one migrated template file per process instead of running the DDL for each
test. In memory-backed storage (``/dev/shm``), when the system has it, the file (the same
SQLite file, WAL and all, without the disk's flushes) and the store open on it are kept for the
process's next test, emptied (ids from 1 again); else each test copies its own under
``tmp_path``. PostgreSQL tests get a migrated schema of their own:
one a process made earlier and emptied after its last test (its rows deleted, its ids from 1
again: the statement sent as that test ends, its answer read as the next one starts), with the
store open on it kept for the next test, or a new one. The
production path is the same (the same store class and statements on a real schema); what a
test no longer pays is the schema's DDL and the store's connections. The schemas are dropped
when the test session ends (or the process exits).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import select
import shutil
import sqlite3
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from ..core.text import redact_url
from ..errors import ConfigurationError
from ..plugins import make_plugin_manager, open_store, registered_stores
from ..store import Store

if TYPE_CHECKING:
    from outboxkit_pg import PostgresStore
    from outboxkit_sqlite import SQLiteStore

__all__ = ["POSTGRES_SCHEMES", "close_test_stores", "open_test_store"]

POSTGRES_SCHEMES = frozenset({"postgresql", "postgres"})
"""The URL schemes that get a schema of their own per test."""


@contextlib.contextmanager
def open_test_store(
    url: str | None, tmp_path: Path | Callable[[], Path], name: str = "test"
) -> Iterator[Store]:
    """A fresh, migrated store for one test; removed afterwards.

    ``None`` gives a SQLite file (in ``/dev/shm`` when there is one, else under ``tmp_path``);
    ``memory://`` an in-memory store; a ``postgresql://`` URL a migrated schema of its own
    (named after ``name`` and the xdist worker the first time; emptied after the test and
    kept for the process's next one, dropped at the session's end).

    Args:
        url: the store URL, or None for a SQLite file.
        tmp_path: the test's own folder, or what makes it (the SQLite file goes there when
            the system has no memory-backed storage).
        name: what the store is for (the test's node id); a PostgreSQL schema name derives
            from it.

    Yields:
        The migrated store; closed when the block ends (on PostgreSQL, its schema emptied and
        kept for the next test with the store open on it).

    Raises:
        UnknownStore: no store handles the URL's scheme.
        MissingDependency: the store's driver is not installed.
        ConfigurationError: a PostgreSQL URL opened something other than a ``PostgresStore``
            (its schema could not be dropped).
    """
    if url is None:
        folder = _ram_folder()
        if folder is not None:
            with _kept_sqlite_store(folder) as kept:
                yield kept
            return
        path = (tmp_path() if callable(tmp_path) else tmp_path) / "outbox.db"
        shutil.copyfile(_sqlite_template(), path)  # a migrated empty file: no DDL per test
        with _opened(f"sqlite:///{path}") as store:
            yield store
        return
    if url.split("://", 1)[0].lower() in POSTGRES_SCHEMES:
        with _postgres_test_store(url, name) as store:
            yield store
        return
    with _opened(url) as store:
        yield store


@contextlib.contextmanager
def _opened(url: str) -> Iterator[Store]:
    opened: Store = _open(url)
    try:
        opened.migrate()
        yield opened
    finally:
        opened.close()


_IDLE_SQLITE: list[SQLiteStore] = []
"""The stores on emptied SQLite files in memory-backed storage, waiting for their next test."""


@contextlib.contextmanager
def _kept_sqlite_store(folder: Path) -> Iterator[Store]:
    """A store on a migrated SQLite file in ``folder``: an emptied one kept from an earlier
    test, or a copy of the template; emptied and kept for the next test afterwards."""
    from outboxkit_sqlite import SQLiteStore

    if _IDLE_SQLITE:
        store = _IDLE_SQLITE.pop()
    else:
        path = folder / f"{uuid.uuid4().hex}.db"
        shutil.copyfile(_sqlite_template(), path)  # a migrated empty file: no DDL per test
        made = _open(f"sqlite:///{path}")
        assert isinstance(made, SQLiteStore)
        store = made
    kept = False
    try:
        yield store
        kept = _emptied_sqlite(store)
    finally:
        if kept:
            _IDLE_SQLITE.append(store)
        else:
            store.close()
            file = store.path
            if file is not None:
                for leftover in file.parent.glob(f"{file.name}*"):
                    leftover.unlink(missing_ok=True)


def _emptied_sqlite(store: SQLiteStore) -> bool:
    """Empty the store's tables for the next test (ids from 1 again); False when it cannot be
    kept: the test closed it, SQLite refused, or the test made tables of its own in it (the
    app's tables: the next test gets a fresh file, as it would without keeping)."""
    if store.dialect.connections.closed:
        return False
    try:
        with store.transaction() as conn:
            made = {row[0] for row in conn.execute(_SQLITE_OBJECTS)}
            if made != _template_objects():
                return False
            store.dialect.empty_tables(conn)
    except Exception:
        return False
    return True


_IDLE: dict[str, list[_Emptying]] = {}
"""Per URL, the stores on test schemas being emptied (the statement sent, its answer not yet
read), waiting for their next test."""


@contextlib.contextmanager
def _postgres_test_store(url: str, name: str) -> Iterator[Store]:
    """A PostgreSQL store on a migrated schema of its own: an emptied one kept from an earlier
    test, or a new one; its emptying sent afterwards, and the store kept for the next test."""
    idle = _IDLE.setdefault(url, [])
    store: PostgresStore | None = None
    while idle and store is None:
        emptying = idle.pop()
        if emptying.emptied():
            store = emptying.store
        else:
            _drop(emptying.store, url)
    if store is None:
        store = _new_postgres_store(url, name)
    sent: _Emptying | None = None
    try:
        yield store
        sent = _Emptying.send(store)
    finally:
        if sent is not None:
            idle.append(sent)
        else:
            _drop(store, url)


def _new_postgres_store(url: str, name: str) -> PostgresStore:
    # Imported here, not at the top: only a PostgreSQL URL needs the driver, and a missing one
    # is reported by open_store as MissingDependency.
    store: Store = open_store(_without_commit_flush(url), schema=_schema_name(name))
    from outboxkit_pg import PostgresStore

    if not isinstance(store, PostgresStore):
        store.close()
        raise ConfigurationError(
            f"{redact_url(url)!r} opened a {type(store).__name__}, not a PostgresStore: "
            "its test schema could not be dropped"
        )
    try:
        store.migrate()
    except BaseException:
        _drop(store, url)
        raise
    return store


class _Emptying:
    """A kept PostgreSQL test store's emptying for the next test (ids from 1 again), sent when
    a test ends and its answer read when the next test takes the store: the server empties the
    tables while pytest goes from one test to the next, and the test waits for it only if it
    is not done by then.

    One autocommitted statement (``_emptying_statement``), sent in a pipeline sync on a
    connection of the store's pool held out of it in between (``outboxkit_pg.pipeline.Flight``,
    as a delivery sends its statements). It empties nothing when the test made relations of
    its own in the schema (the app's tables: the next test gets a new schema, as it would
    without keeping).
    """

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self._lease = store.dialect.connection("empty the test store", check_schema=False)
        self._conn = self._lease.__enter__()
        self._statement = _emptying_statement(store, self._conn)
        try:
            self._send()
        except BaseException as exc:
            self._end(exc)
            raise

    def _send(self) -> None:
        """Send the emptying, prepared (the server plans it once per connection, not per
        test); wait only until libpq has written it."""
        from outboxkit_pg.flow import Statement
        from outboxkit_pg.pipeline import Flight

        self._flight = Flight(self._conn)
        writing = self._flight.send([Statement(self._statement, {}, prepare=True)])
        while writing:
            select.select([], [self._conn.pgconn.socket], [])
            writing = self._flight.flush()

    @classmethod
    def send(cls, store: PostgresStore) -> _Emptying | None:
        """The emptying of ``store``, sent; None when the store cannot be kept (the test
        closed it, or the database refused)."""
        if store.dialect.pool.closed:
            return None
        try:
            return cls(store)
        except Exception:
            return None

    def emptied(self) -> bool:
        """Wait for the answer: whether the tables were emptied (the store can be kept)."""
        from psycopg import errors as pg_errors

        try:
            try:
                result = self._answer()
            except pg_errors.InvalidSqlStatementName:
                # psycopg deallocated every prepared statement of the connection (it does
                # after a test's ROLLBACK on it): the flight forgot it; prepared again
                self._send()
                result = self._answer()
            kept = bool(result.ntuples == 1 and result.get_value(0, 0) == b"0")
        except BaseException as exc:
            self._end(exc)
            return False
        self._end(None)
        return kept

    def _answer(self) -> Any:
        while (results := self._flight.read()) is None:
            select.select([self._conn.pgconn.socket], [], [])
        (result,) = results
        return result

    def _end(self, exc: BaseException | None) -> None:
        """Hand the connection back to the pool (closed first when it is left in the middle
        of the pipeline: it can be neither read back nor reused)."""
        from psycopg import pq

        conn = self._conn
        if exc is not None and conn.pgconn.pipeline_status != pq.PipelineStatus.OFF:
            conn.close()
        with contextlib.suppress(Exception):
            self._lease.__exit__(None, None, None)


def _emptying_statement(store: PostgresStore, conn: Any) -> bytes:
    """The statement that empties ``store``'s tables when no other relation is in its schema,
    and returns how many other relations there are (``_Emptying``).

    The schema's own relations are found through ``pg_depend``'s index on the object depended
    on (the schema), not by a scan of ``pg_class``, which grows with every schema a test run
    makes and drops. DELETE, not TRUNCATE: a few rows go at once, where TRUNCATE makes new
    files (tens of ms).
    """
    names = store.names
    statement = _EMPTYING.get(names.schema)
    if statement is not None:
        return statement
    from psycopg import sql

    ours = [names.events, names.deliveries, names.keys, names.versions]
    events, deliveries, keys = (
        sql.Identifier(names.schema, table)
        for table in (names.events, names.deliveries, names.keys)
    )
    statement = (
        sql.SQL(
            "WITH other AS ("
            " SELECT count(*) AS n FROM pg_depend d JOIN pg_class c ON c.oid = d.objid"
            " WHERE d.refclassid = 'pg_namespace'::regclass"
            " AND d.classid = 'pg_class'::regclass"
            " AND d.refobjid = (SELECT oid FROM pg_namespace WHERE nspname = {schema})"
            " AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND c.relname <> ALL({ours})),"
            " gone_records AS (DELETE FROM {deliveries} WHERE (SELECT n FROM other) = 0),"
            " gone_keys AS (DELETE FROM {keys} WHERE (SELECT n FROM other) = 0),"
            " gone_events AS (DELETE FROM {events} WHERE (SELECT n FROM other) = 0)"
            " SELECT n, CASE WHEN n = 0 THEN"
            " setval(pg_get_serial_sequence({events_name}, 'id'), 1, false)"
            " + setval(pg_get_serial_sequence({deliveries_name}, 'seq'), 1, false) END"
            " FROM other"
        )
        .format(
            schema=sql.Literal(names.schema),
            ours=sql.Literal(ours),
            deliveries=deliveries,
            keys=keys,
            events=events,
            events_name=sql.Literal(events.as_string()),
            deliveries_name=sql.Literal(deliveries.as_string()),
        )
        .as_bytes(conn)
    )
    _EMPTYING[names.schema] = statement
    return statement


_EMPTYING: dict[str, bytes] = {}
"""Per test schema, its emptying statement (composed once)."""


def _drop(store: PostgresStore, url: str) -> None:
    """Drop the store's schema (on a new store when the test closed this one) and close it."""
    _EMPTYING.pop(store.names.schema, None)
    try:
        if store.dialect.pool.closed:
            store = _reopened(store, url)
        store.drop_schema()
    finally:
        store.close()


def _without_commit_flush(url: str) -> str:
    """``url`` whose sessions commit without waiting for the WAL flush (``synchronous_commit
    = off``, unless the URL sets ``options`` itself): a commit is then the same transaction,
    seen by every other session at once, only not yet on disk should the server crash - which
    a test store never needs, and which costs each commit a disk flush (milliseconds)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "options" for key, _ in query):
        return url
    query.append(("options", "-c synchronous_commit=off"))
    return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))


def _reopened(store: PostgresStore, url: str) -> PostgresStore:
    from outboxkit_pg import PostgresStore

    fresh = open_store(_without_commit_flush(url), schema=store.names.schema)
    assert isinstance(fresh, PostgresStore)
    return fresh


def close_test_stores() -> None:
    """Close every kept test store, dropping the PostgreSQL schemas (at the session's end)."""
    while _IDLE_SQLITE:
        with contextlib.suppress(Exception):
            _IDLE_SQLITE.pop().close()
    for url, idle in list(_IDLE.items()):
        while idle:
            emptying = idle.pop()
            with contextlib.suppress(Exception):
                emptying.emptied()  # its connection back in the pool first
                _drop(emptying.store, url)


atexit.register(close_test_stores)


def _open(url: str, **options: Any) -> Store:
    """``open_store(url, **options)``, the stores' registry read once per process (building
    it per test was most of a memory store's test)."""
    entry = _registry().get(url.split("://", 1)[0].lower())
    if entry is None:
        opened: Store = open_store(url, **options)  # its own errors, and SQLAlchemy URLs
        return opened
    made: Store = entry.factory(url, **options)
    return made


@functools.cache
def _registry() -> dict[str, Any]:
    return dict(registered_stores(make_plugin_manager()))


@functools.cache
def _ram_folder() -> Path | None:
    """A folder of this process's in memory-backed storage (``/dev/shm``), or None."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        return None
    folder = Path(tempfile.mkdtemp(prefix="outboxkit-tests-", dir=shm))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


_SQLITE_OBJECTS = "SELECT type || ' ' || name FROM sqlite_master"


@functools.cache
def _template_objects() -> frozenset[str]:
    """The schema objects of a migrated, empty outbox file (the template's)."""
    with contextlib.closing(sqlite3.connect(_sqlite_template())) as conn:
        return frozenset(row[0] for row in conn.execute(_SQLITE_OBJECTS))


@functools.cache
def _sqlite_template() -> Path:
    """An empty, migrated SQLite outbox file, made once per process and copied for each test."""
    folder = Path(tempfile.mkdtemp(prefix="outboxkit-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "template.db"
    store: Store = open_store(f"sqlite:///{path}")
    try:
        store.migrate()
    finally:
        store.close()
    return path


def _schema_name(name: str) -> str:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    digest = hashlib.sha1(f"{name}\0{os.getpid()}\0{uuid.uuid4()}".encode()).hexdigest()[:12]
    return f"outboxkit_test_{worker}_{digest}"[:63]
