"""Enqueue through SQLAlchemy: one driver-neutral path, ``Connection.execute(text(...))``, with
the statements the store gives (``portable_enqueue``: its validated names, every value bound).
The statements that return rows return the new ids; the others (MySQL's INSERTs, which have no
RETURNING) are run for their effect."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outboxkit.errors import ConfigurationError, SchemaError, StoreError, migrate_hint

if TYPE_CHECKING:
    from outboxkit.core.model import NewEvent
    from outboxkit.store import Store

__all__ = ["ADAPTER", "SQLAlchemyAdapter"]

_MISSING_TABLE = ("does not exist", "no such table", "undefinedtable")


class SQLAlchemyAdapter:
    """Writes events through a SQLAlchemy ``Session``/``Connection`` (``AsyncSession``/
    ``AsyncConnection`` from async code), inside the transaction the ORM has open: it never
    begins (beyond the ORM's own autobegin, as for any write), commits or rolls it back."""

    def enqueue(
        self, store: Store, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """Write ``events`` through ``conn`` (a ``Session`` or ``Connection``).

        Raises:
            ConfigurationError: an async object, an engine, a database of another kind than
                the store's, or an autocommit connection; nothing was sent.
            SchemaError: the database has no outboxkit tables (run migrate()).
            StoreError: the database failed.
        """
        if isinstance(conn, AsyncSession | AsyncConnection):
            raise ConfigurationError(
                f"outbox.enqueue got an {type(conn).__name__}: enqueue through it with "
                "`await outbox.enqueue_async(...)`"
            )
        if isinstance(conn, Session):
            _check(store, conn.get_bind(), what="Session")
            connection = conn.connection()
        elif isinstance(conn, Connection):
            _check(store, conn, what="Connection")
            connection = conn
        else:
            raise _not_a_connection(conn)
        statements = _statements(store, events, now)
        ids: list[int] = []
        for sql, params in statements:
            try:
                result = connection.execute(text(sql), params)
            except DBAPIError as exc:
                raise _error(exc, len(events)) from exc
            if result.returns_rows:  # an INSERT without RETURNING (MySQL) returns none
                ids.extend(sorted(row[0] for row in result.all()))
        return ids

    def on_commit(self, conn: Any, callback: Callable[[], None]) -> None:
        """Now: a listener per enqueue would cost more than the poll it saves. On PostgreSQL
        the store's ``LISTEN`` waiter wakes the pollers again at the commit."""
        callback()

    async def enqueue_async(
        self, store: Store, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """``enqueue`` through an ``AsyncSession`` or ``AsyncConnection``.

        Raises:
            ConfigurationError, SchemaError, StoreError: as for ``enqueue``.
        """
        if isinstance(conn, Session | Connection):
            raise ConfigurationError(
                f"outbox.enqueue_async got a blocking {type(conn).__name__}: enqueue through "
                "it with outbox.enqueue(...)"
            )
        if isinstance(conn, AsyncSession):
            _check(store, conn.sync_session.get_bind(), what="AsyncSession")
            connection = await conn.connection()
        elif isinstance(conn, AsyncConnection):
            _check(store, conn.sync_engine, what="AsyncConnection")
            if conn.sync_connection is not None:
                _check_autocommit(conn.sync_connection)
            connection = conn
        else:
            raise _not_a_connection(conn)
        statements = _statements(store, events, now)
        ids: list[int] = []
        for sql, params in statements:
            try:
                result = await connection.execute(text(sql), params)
            except DBAPIError as exc:
                raise _error(exc, len(events)) from exc
            if result.returns_rows:
                ids.extend(sorted(row[0] for row in result.all()))
        return ids


ADAPTER = SQLAlchemyAdapter()
"""The adapter ``Outbox.enqueue`` uses for SQLAlchemy objects (``outboxkit.contrib``)."""


def _not_a_connection(conn: object) -> ConfigurationError:
    if isinstance(conn, Engine | AsyncEngine):
        return ConfigurationError(
            "enqueue takes a SQLAlchemy Session or Connection in its open transaction, not an "
            "Engine: `with engine.begin() as conn: outbox.enqueue(conn, ...)`"
        )
    return ConfigurationError(
        "enqueue takes a SQLAlchemy Session or Connection (AsyncSession or AsyncConnection "
        f"with enqueue_async), got {type(conn).__name__}"
    )


def _check(store: Store, bind: Any, *, what: str) -> None:
    """Refuse a bind on another kind of database than the store's, or in autocommit mode.

    Raises:
        ConfigurationError: naming both databases, or the isolation level, and what to do.
    """
    wanted = getattr(store, "sql_dialect", None)
    if wanted is None:
        raise ConfigurationError(
            f"{store!r} keeps no events in a SQL database, so a SQLAlchemy {what} cannot carry "
            "them: open the store on the app's database (open_store(engine))"
        )
    dialect = bind.dialect
    if dialect.name != wanted:
        raise ConfigurationError(
            f"this SQLAlchemy {what} is on {dialect.name} ({dialect.name}+{dialect.driver}) but "
            f"the outbox's store is on {wanted}: enqueue through a {what} on the store's "
            "database, or open the store on the app's engine (open_store(engine))"
        )
    if isinstance(bind, Connection):
        _check_autocommit(bind)
    elif getattr(dialect, "isolation_level", None) == "AUTOCOMMIT":
        raise _autocommit()


def _check_autocommit(connection: Connection) -> None:
    level = connection.get_execution_options().get("isolation_level") or getattr(
        connection.dialect, "isolation_level", None
    )
    if level == "AUTOCOMMIT":
        raise _autocommit()


def _autocommit() -> ConfigurationError:
    return ConfigurationError(
        "enqueue needs the app's transaction, so that the event commits or rolls back with the "
        "app's writes; this SQLAlchemy connection runs with isolation_level='AUTOCOMMIT': use "
        "one without it. Nothing was written."
    )


def _statements(
    store: Store, events: Sequence[NewEvent], now: datetime | None
) -> list[tuple[str, dict[str, Any]]]:
    if any(e.dedupe_key is not None for e in events):
        raise ConfigurationError(
            "dedupe_key is not supported through a SQLAlchemy connection or session yet: "
            "enqueue through the driver's connection (session.connection().connection); "
            "nothing was written"
        )
    statements: list[tuple[str, dict[str, Any]]] = store.portable_enqueue(  # type: ignore[attr-defined]
        events, now
    )
    return statements


def _error(exc: DBAPIError, count: int) -> StoreError:
    reason = str(exc.orig).strip() if exc.orig is not None else str(exc)
    if any(marker in reason.lower() for marker in _MISSING_TABLE):
        return SchemaError(
            f"enqueue through SQLAlchemy found no outboxkit tables ({reason}): {migrate_hint()}"
        )
    return StoreError(f"enqueue {count} event(s) through SQLAlchemy failed: {reason}")
