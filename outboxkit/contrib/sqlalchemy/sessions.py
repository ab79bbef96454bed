"""``ctx.session``: an ORM session in a handler's delivery transaction.

The session's engine is one of the provider's, made once per kind of delivery connection; its
pool lends the delivery transaction's own connection (``_Lent``), which SQLAlchemy must never end:

- ``pool_reset_on_return=None`` and ``NullPool``: nothing is rolled back when the session lets
  go of it, and "closing" it (``_Lent.close``) leaves it to the store;
- the rollback SQLAlchemy sends while it connects (after reading the server's version on the
  first connect) is absorbed: the delivery transaction, with what the handler wrote through
  ``ctx.connection`` before it first used ``ctx.session``, goes on;
- a ``commit`` (``session.commit()`` is refused before it starts, by a ``before_commit``
  listener) or a ``rollback`` by the handler would end the delivery transaction: the delivery
  fails instead (``HandlerCrashed``), and everything it wrote rolls back with it;
- what the dialect installs on each new connection (a notice handler, SQL functions) is
  installed once per delivery connection, not on every delivery.

The shell calls ``finish`` (a flush) after the handler returned and before the delivery
record, and ``close`` in any case; a ``Reject`` or a failure rolls the session's writes back
with the delivery transaction.
"""

from __future__ import annotations

import contextvars
import sqlite3
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from outboxkit.errors import ConfigurationError, HandlerCrashed

if TYPE_CHECKING:
    from outboxkit.outbox import Outbox

__all__ = ["SessionFactory", "use_sessions"]

_LENDING: contextvars.ContextVar[_Lent | _AsyncLent | None] = contextvars.ContextVar(
    "outboxkit_sqlalchemy_lending", default=None
)
_SET_UP: weakref.WeakSet[Any] = weakref.WeakSet()
"""Delivery connections the dialects' per-connection setup already ran on."""

_ENDED = (
    "ended the delivery transaction it was given ({how}); its writes roll back with the "
    "delivery. Let the outbox commit: return from the handler (raise, or Reject, to undo)"
)


class _Lent:
    """The delivery connection as SQLAlchemy's pool sees it: every attribute is the real
    connection's but ``commit``, ``rollback``, ``close`` and the per-connection setup."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.connecting = True  # SQLAlchemy's own setup; its rollback is absorbed
        self.live = True  # the handler is running; False once the shell lets go
        self.ended: str | None = None  # how the handler tried to end the transaction
        self._first = raw not in _SET_UP

    def connected(self) -> None:
        """SQLAlchemy's setup is over (pool ``checkout``): from now on the handler drives, and
        the dialects' per-connection setup is done for this delivery connection."""
        self.connecting = False
        self._first = False
        _SET_UP.add(self._raw)

    def check(self) -> None:
        """Raises ``HandlerCrashed`` if the handler's session ended the transaction."""
        if self.ended is not None:
            raise HandlerCrashed("the handler's session " + _ENDED.format(how=self.ended))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def commit(self) -> None:
        if self.live and not self.connecting:
            self.ended = "a commit"
            raise HandlerCrashed("the handler's session " + _ENDED.format(how="a commit"))

    def rollback(self) -> None:
        if self.live and not self.connecting:
            self.ended = "a rollback"

    def close(self) -> None:
        return None

    # The dialects' per-connection setup: once per delivery connection.
    def add_notice_handler(self, *args: Any, **kwargs: Any) -> None:
        if self._first:
            self._raw.add_notice_handler(*args, **kwargs)

    def create_function(self, *args: Any, **kwargs: Any) -> None:
        if self._first:
            self._raw.create_function(*args, **kwargs)


class _AsyncLent(_Lent):
    """``_Lent`` for an async driver connection (psycopg's ``AsyncConnection``, aiosqlite's)."""

    async def commit(self) -> None:  # type: ignore[override]
        _Lent.commit(self)

    async def rollback(self) -> None:  # type: ignore[override]
        _Lent.rollback(self)

    async def close(self) -> None:  # type: ignore[override]
        return None

    async def create_function(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if self._first:
            await self._raw.create_function(*args, **kwargs)


def _lend() -> _Lent:
    lent = _LENDING.get()
    if not isinstance(lent, _Lent):
        raise ConfigurationError(
            "this engine only lends a delivery transaction's connection to ctx.session; "
            "use it only through ctx.session inside a handler"
        )
    return lent


async def _lend_async() -> _Lent:
    return _lend()


def _connected(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """Pool ``checkout``: SQLAlchemy's setup is over; from now on the handler drives."""
    lent = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    if isinstance(lent, _Lent):
        lent.connected()


def _kind(connection: Any) -> tuple[str, bool]:
    """The SQLAlchemy URL of a delivery connection's driver, and whether it is async.

    Raises:
        ConfigurationError: a connection no SQLAlchemy dialect here drives.
    """
    if isinstance(connection, sqlite3.Connection):
        return "sqlite+pysqlite://", False
    import aiosqlite

    if isinstance(connection, aiosqlite.Connection):
        return "sqlite+aiosqlite://", True
    package = type(connection).__module__.partition(".")[0]
    if package == "psycopg":
        import psycopg

        if isinstance(connection, psycopg.AsyncConnection):
            return "postgresql+psycopg://", True
        if isinstance(connection, psycopg.Connection):
            return "postgresql+psycopg://", False
    raise ConfigurationError(
        "ctx.session binds to the delivery transaction's connection of the PostgreSQL or "
        f"SQLite store (psycopg, sqlite3, aiosqlite), got {type(connection).__name__}"
    )


class SessionFactory:
    """The ``SessionProvider`` behind ``use_sessions``: makes each delivery's ``ctx.session``
    with the app's session factories, bound to the delivery transaction's connection.

    Args:
        sessions: a ``sessionmaker`` for blocking handlers (its own bind is replaced by the
            delivery connection); default: plain ``Session``.
        async_sessions: an ``async_sessionmaker`` for ``async def`` handlers; default: plain
            ``AsyncSession``.
        execution_options: the app engine's execution options the sessions need too (e.g.
            ``schema_translate_map``), as ``engine.get_execution_options()`` gives them.
    """

    def __init__(
        self,
        sessions: sessionmaker[Any] | None = None,
        async_sessions: async_sessionmaker[Any] | None = None,
        *,
        execution_options: Mapping[str, Any] | None = None,
    ) -> None:
        if sessions is not None and not isinstance(sessions, sessionmaker):
            raise ConfigurationError(
                f"sessions must be a sqlalchemy.orm.sessionmaker, got {type(sessions).__name__}"
            )
        if async_sessions is not None and not isinstance(async_sessions, async_sessionmaker):
            raise ConfigurationError(
                "async_sessions must be a sqlalchemy.ext.asyncio.async_sessionmaker, got "
                f"{type(async_sessions).__name__}"
            )
        self.sessions = sessions if sessions is not None else sessionmaker()
        self.async_sessions = async_sessions if async_sessions is not None else async_sessionmaker()
        self.execution_options = dict(execution_options or {})
        self._engines: dict[tuple[str, bool], Engine | AsyncEngine] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SessionFactory({self.sessions!r}, {self.async_sessions!r})"

    def _engine(self, url: str, asyncio: bool) -> Engine | AsyncEngine:
        with self._lock:
            engine = self._engines.get((url, asyncio))
            if engine is None:
                options: dict[str, Any] = {"poolclass": NullPool, "pool_reset_on_return": None}
                if url.startswith("postgresql"):
                    # psycopg's hstore lookup wants the connection itself, not a stand-in; an
                    # HSTORE column still works, through SQLAlchemy's own conversion.
                    options["use_native_hstore"] = False
                if asyncio:
                    engine = create_async_engine(url, async_creator=_lend_async, **options)
                    pool = engine.sync_engine.pool
                else:
                    engine = create_engine(url, creator=_lend, **options)
                    pool = engine.pool
                event.listen(pool, "checkout", _connected)
                if self.execution_options:
                    engine = engine.execution_options(**self.execution_options)
                self._engines[(url, asyncio)] = engine
            return engine

    def open(self, connection: Any) -> _Scope | _AsyncScope:
        """The ``ctx.session`` of one delivery, on ``connection`` (its transaction's).

        Raises:
            ConfigurationError: a connection no SQLAlchemy dialect here drives.
        """
        url, asyncio = _kind(connection)
        engine = self._engine(url, asyncio)
        if asyncio:
            assert isinstance(engine, AsyncEngine)
            return _AsyncScope(self.async_sessions(bind=engine), _AsyncLent(connection))
        assert isinstance(engine, Engine)
        return _Scope(self.sessions(bind=engine), _Lent(connection))


def _refuse_commit(session: Session) -> None:
    raise HandlerCrashed(
        "session.commit() in a handler: ctx.session is in the delivery transaction, which the "
        "outbox commits with the delivery record; return from the handler instead (nothing was "
        "committed)"
    )


class _Scope:
    """A blocking handler's ``ctx.session`` (see the module docstring)."""

    def __init__(self, session: Session, lent: _Lent) -> None:
        self.session = session
        self._lent = lent
        self._token = _LENDING.set(lent)
        event.listen(session, "before_commit", _refuse_commit)

    def finish(self) -> None:
        """Flush the session's pending state into the delivery transaction.

        Raises:
            HandlerCrashed: the handler's session committed or rolled back the transaction.
        """
        self._lent.check()
        self.session.flush()
        self._lent.check()

    def close(self) -> None:
        """Let go of the session; the delivery transaction stays the store's."""
        self._lent.live = False
        try:
            self.session.close()
        finally:
            _LENDING.reset(self._token)


class _AsyncScope:
    """An ``async def`` handler's ``ctx.session``, an ``AsyncSession``."""

    def __init__(self, session: AsyncSession, lent: _AsyncLent) -> None:
        self.session = session
        self._lent = lent
        self._token = _LENDING.set(lent)
        event.listen(session.sync_session, "before_commit", _refuse_commit)

    async def finish(self) -> None:
        """Flush the session's pending state into the delivery transaction.

        Raises:
            HandlerCrashed: the handler's session committed or rolled back the transaction.
        """
        self._lent.check()
        await self.session.flush()
        self._lent.check()

    async def close(self) -> None:
        """Let go of the session; the delivery transaction stays the store's."""
        self._lent.live = False
        try:
            await self.session.close()
        finally:
            _LENDING.reset(self._token)


def use_sessions(
    outbox: Outbox,
    sessions: sessionmaker[Any] | None = None,
    *,
    async_sessions: async_sessionmaker[Any] | None = None,
    execution_options: Mapping[str, Any] | None = None,
) -> SessionFactory:
    """Give the handlers of ``outbox`` a ``ctx.session``: a ``Session`` made by ``sessions``
    (an ``AsyncSession`` by ``async_sessions`` for ``async def`` handlers) in the delivery
    transaction. Its writes commit with the delivery record and roll back on a failure or a
    ``Reject``; ``session.commit()`` in a handler fails the delivery. Copies of the outbox
    (``rebind``, the test kit's) keep it.

    Args:
        outbox: the outbox whose handlers get sessions.
        sessions: a ``sessionmaker`` (its options; its bind is replaced by the delivery
            connection).
        async_sessions: an ``async_sessionmaker``, for ``async def`` handlers.
        execution_options: engine execution options the sessions need (``schema_translate_map``).

    Returns:
        The ``SessionFactory`` now set as ``outbox.sessions``.

    Raises:
        ConfigurationError: ``sessions`` or ``async_sessions`` is not a session maker.
    """
    factory = SessionFactory(sessions, async_sessions, execution_options=execution_options)
    outbox.sessions = factory
    return factory
