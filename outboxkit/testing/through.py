"""Reading the test store through the app's own connection, inside its open transaction, and
telling which database a connection is on.

``events_through(store, conn)`` is what ``assert_enqueued(..., conn=conn)`` reads: every event
the store holds as ``conn`` sees it, so one the app enqueued in a transaction it has not
committed yet is there (River's ``RequireInsertedTx``):

- the memory store: a ``MemoryTransaction`` of the store (its buffered events after the
  committed ones);
- a SQL store (``outboxkit.storekit.SQLStore``: SQLite, PostgreSQL): its ``events`` statement
  run on the app's driver connection (a ``sqlite3.Connection`` or ``sqlite_utils.Database``, a
  ``psycopg.Connection``), or on the one under a SQLAlchemy ``Session``/``Connection`` or
  Django's connection.

``database_of(conn)`` names the database a driver connection is on, and ``same_database``
compares it with the store's: the test kit uses them to name an enqueue that went to another
database than the test store's (a real ``shop.db``), which the drain never sees.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from typing import Any

from ..core.model import Event
from ..errors import ConfigurationError
from ..store import Store
from ..storekit.sql import SQLStore

__all__ = [
    "StrayWatch",
    "stray_message",
    "database_of",
    "driver_connection",
    "events_through",
    "store_database",
]

PAGE = 1000


def driver_connection(conn: Any) -> Any:
    """The DB-API connection behind what an app passes to ``enqueue``: itself, or the one under
    a ``sqlite_utils.Database`` (``.conn``), a SQLAlchemy ``Session``/``Connection``, or a
    Django connection wrapper (``.connection``)."""
    if isinstance(conn, sqlite3.Connection) or type(conn).__module__.startswith("psycopg"):
        return conn
    inner = getattr(conn, "conn", None)  # sqlite_utils.Database
    if isinstance(inner, sqlite3.Connection):
        return inner
    if hasattr(conn, "get_bind") and hasattr(conn, "connection"):  # a SQLAlchemy Session
        conn = conn.connection()
    dbapi = getattr(conn, "connection", None)  # SQLAlchemy Connection, Django's wrapper
    driver = getattr(dbapi, "driver_connection", dbapi)  # SQLAlchemy's pool proxy
    return driver if driver is not None else conn


def events_through(store: Store, conn: Any) -> list[Event]:
    """Every event of ``store`` as ``conn`` sees it, inside its open transaction.

    Raises:
        ConfigurationError: ``conn`` cannot be read through for this store (naming both).
    """
    from ..memory import MemoryStore, MemoryTransaction

    if isinstance(store, MemoryStore):
        if not isinstance(conn, MemoryTransaction) or conn.tables is not store.tables:
            raise ConfigurationError(
                f"conn= must be a transaction of the test store {store!r} "
                f"(store.transaction() or store.begin()), got {conn!r:.80}"
            )
        committed = _paged(store.events)
        return committed + [row.to_event() for row in conn.pending.events]
    if isinstance(store, SQLStore):
        raw = driver_connection(conn)
        dialect, statements = store.dialect, store.statements
        events: list[Event] = []
        after_id = 0
        with dialect.mapped("read events through the app's connection", raw):
            while True:
                params = {"after_id": after_id, "topic": None, "limit": PAGE}
                page = [statements.event(row) for row in dialect.rows(raw, "events", params)]
                events.extend(page)
                if len(page) < PAGE:
                    return events
                after_id = page[-1].id
    raise ConfigurationError(
        f"conn= reads through the app's transaction on the memory store and the SQL stores; "
        f"{store!r} is neither"
    )


def _paged(read: Any) -> list[Event]:
    events: list[Event] = []
    after_id = 0
    while page := read(after_id=after_id, limit=PAGE):
        events.extend(page)
        after_id = page[-1].id
        if len(page) < PAGE:
            break
    return events


def database_of(conn: Any) -> str | None:
    """The database a driver connection is on, as a comparable name (``sqlite:<real path>``,
    ``postgresql:<host>:<port>/<dbname>``), or None when it cannot be told (a SQLite database
    in memory, another driver)."""
    raw = driver_connection(conn)
    if isinstance(raw, sqlite3.Connection):
        try:
            rows = raw.execute("PRAGMA database_list").fetchall()
        except sqlite3.Error:
            return None
        main = next((row[2] for row in rows if row[1] == "main"), "")
        return f"sqlite:{os.path.realpath(main)}" if main else None
    info = getattr(raw, "info", None)
    if type(raw).__module__.startswith("psycopg") and info is not None:
        return f"postgresql:{info.host}:{info.port}/{info.dbname}"
    return None


def store_database(store: Store) -> str | None:
    """The database ``store`` keeps its events in, named as ``database_of`` names a
    connection's; None for a store that is not a SQL database on a file or a server."""
    if not isinstance(store, SQLStore):
        return None
    path = getattr(store, "path", None)
    if path is not None:
        return f"sqlite:{os.path.realpath(path)}"
    if store.dialect.name == "postgresql":
        with store.transaction() as conn:
            return database_of(conn)
    return None


class StrayWatch:
    """Notes every enqueue into ``store`` made through a connection to another database than
    the store's (``strays``: that database's name, once per enqueue).

    The SQL stores insert through whatever connection the app hands them; in a test, a
    connection the app opened on its real database (a ``shop.db``) puts the events there,
    where no drain of the test store looks. ``install`` wraps the test store's ``enqueue``
    (the test's own store object, made for the test) to name them.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.strays: list[str] = []
        self.own: list[str | None] = []  # the store's database, once known

    def install(self) -> None:
        """Watch the store's enqueues from now on (a store kept from an earlier test is
        watched by this watch instead of that test's)."""
        if not isinstance(self.store, SQLStore):
            return  # the memory store refuses another store's transaction itself
        current = vars(self.store).get("enqueue")
        if isinstance(current, _Watched):  # a store kept from an earlier test
            self.own = current.watch.own
            current.watch = self
            return
        self.store.enqueue = _Watched(self.store.enqueue, self)  # type: ignore[method-assign]

    def check(self, conn: Any) -> None:
        theirs = database_of(conn)
        if theirs is None:
            return
        if not self.own:
            self.own.append(store_database(self.store))
        own = self.own[0]
        if own is not None and theirs != own:
            self.strays.append(theirs.split(":", 1)[1])

    def __call__(self) -> list[str]:
        return list(self.strays)


class _Watched:
    """A store's ``enqueue``, each connection checked by a ``StrayWatch`` first."""

    def __init__(self, enqueue: Any, watch: StrayWatch) -> None:
        self.enqueue = enqueue
        self.watch = watch

    def __call__(self, conn: Any, events: Any, *, now: Any) -> list[int]:
        self.watch.check(conn)
        ids: list[int] = self.enqueue(conn, events, now=now)
        return ids


def stray_message(strays: Sequence[str]) -> str:
    """What an enqueue into another database than the test store's is told."""
    where = ", ".join(dict.fromkeys(strays))
    return (
        f"{len(strays)} enqueue(s) of this test went through a connection to another database "
        f"({where}) than the test store's: the drain and the assertions never see them. "
        "Override the outbox_store fixture to open the store on the database your app's "
        "connection uses (see the README's testing chapter)"
    )
