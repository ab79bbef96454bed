"""``open_store(engine)``: the outbox's store on a SQLAlchemy engine's database.

PostgreSQL: the store is psycopg 3 based, so an engine on ``postgresql+psycopg://`` lends it
its pooled connections (``EnginePool``): the app and the outbox share one pool. What cannot come
from a pool is opened from the engine's connection arguments: a poller's ``LISTEN`` connection
(one per running poller, held while it runs; ``notify=False`` polls without it) and the asyncio
side's own pool. SQLite has no server pool: the store opens its own connections to the
engine's database file.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimedOut
from sqlalchemy.ext.asyncio import AsyncEngine

from outboxkit.errors import ConfigurationError, MissingDependency

if TYPE_CHECKING:
    from outboxkit_pg import PostgresStore
    from outboxkit_sqlite import SQLiteStore

__all__ = ["EnginePool", "open_store"]


class EnginePool:
    """A SQLAlchemy engine's pool as the PostgreSQL store's pool: ``getconn`` borrows one of
    the engine's pooled connections (``engine.raw_connection()``, its psycopg connection),
    ``putconn`` gives it back to the engine's pool.

    Args:
        engine: an engine on ``postgresql+psycopg://``.

    Raises:
        ConfigurationError: an engine on another driver or database.
    """

    def __init__(self, engine: Engine) -> None:
        dialect = engine.dialect
        if dialect.name != "postgresql" or dialect.driver != "psycopg":
            raise ConfigurationError(
                "the PostgreSQL store borrows psycopg 3 connections: open_store(engine) needs "
                f"an engine on postgresql+psycopg://, got {dialect.name}+{dialect.driver} "
                "(enqueue through this engine's sessions still works; or give open_store a "
                "postgresql:// URL and the store opens its own connections)"
            )
        from psycopg.conninfo import make_conninfo

        self.engine = engine
        _, params = dialect.create_connect_args(engine.url)
        self.conninfo: str | None = make_conninfo(
            "", **{k: v for k, v in params.items() if isinstance(v, str | int)}
        )
        """The engine's connection arguments, for what a pool cannot lend (``LISTEN``, the
        asyncio side)."""
        self.kwargs: dict[str, Any] = {}
        self._lent: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EnginePool({self.engine!r})"

    def getconn(self) -> Any:
        """One of the engine's pooled psycopg connections.

        Raises:
            psycopg_pool.PoolTimeout: the engine's pool had none to give in time.
            psycopg.Error: the engine could not connect.
        """
        from psycopg_pool import PoolTimeout

        try:
            fairy = self.engine.raw_connection()
        except PoolTimedOut as exc:
            raise PoolTimeout(str(exc)) from exc
        except DBAPIError as exc:
            if exc.orig is not None:
                raise exc.orig from exc
            raise
        conn = fairy.driver_connection
        with self._lock:
            self._lent[id(conn)] = fairy
        return conn

    def putconn(self, conn: Any) -> None:
        """Give ``conn`` back to the engine's pool."""
        with self._lock:
            fairy = self._lent.pop(id(conn), None)
        if fairy is not None:
            fairy.close()

    def close(self) -> None:
        """Nothing: the engine's pool is the app's (``engine.dispose()`` closes it)."""


def open_store(engine: Any, **options: Any) -> PostgresStore | SQLiteStore:
    """The store on ``engine``'s database (``outboxkit.open_store(engine)`` calls this).

    PostgreSQL: a ``PostgresStore`` borrowing the engine's pooled connections (the engine must
    be on ``postgresql+psycopg://``). SQLite: a ``SQLiteStore`` on the engine's database file,
    with connections of its own. ``options`` are the store's (``schema``, ``table_prefix``...).

    Raises:
        ConfigurationError: not an engine; another database or PostgreSQL driver; an
            in-memory SQLite database (each connection would have its own).
        MissingDependency: PostgreSQL without ``outboxkit[pg]``.
    """
    if isinstance(engine, AsyncEngine):
        if engine.dialect.name == "sqlite":
            engine = engine.sync_engine
        else:
            raise ConfigurationError(
                "open_store(engine) on PostgreSQL borrows blocking psycopg connections: give it "
                "a blocking engine (create_engine('postgresql+psycopg://...')) beside your "
                "AsyncEngine, or a postgresql:// URL"
            )
    if not isinstance(engine, Engine):
        raise ConfigurationError(
            f"open_store takes a store URL or a SQLAlchemy Engine, got {type(engine).__name__}"
        )
    name = engine.dialect.name
    if name == "sqlite":
        database = engine.url.database
        if not database or database == ":memory:" or database.startswith("file:"):
            raise ConfigurationError(
                "open_store(engine) on SQLite opens the engine's database file; this engine's "
                f"database is {database or 'in memory'!r}: use a file (sqlite:///path.db)"
            )
        from outboxkit_sqlite import SQLiteStore

        return SQLiteStore(database, **options)
    if name == "postgresql":
        try:
            from outboxkit_pg import PostgresStore
        except ImportError as exc:
            raise MissingDependency(
                'the PostgreSQL store needs psycopg 3: pip install "outboxkit[pg]"'
            ) from exc
        return PostgresStore(EnginePool(engine), **options)
    raise ConfigurationError(
        f"outboxkit has no store for {name} databases (PostgreSQL and SQLite): open the "
        "store with its own URL"
    )
