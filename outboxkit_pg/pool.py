"""The PostgreSQL store's connections: a psycopg pool of its own (opened on first use), or the
app's pool, borrowed; and the asyncio side's ``AsyncPool``, a ``psycopg_pool.AsyncConnectionPool``
of its own, built from the same conninfo and connection options (the app's pool's too).

- A connection the server dropped while it sat in the pool (a restart, ``pg_terminate_backend``)
  is found without a round trip and swapped for a new one: an idle socket stays silent unless
  the server speaks first, which in practice means it is hanging up.
- Before the store's own pool is made (the asyncio side's too), one direct connection is
  tried: a server that refuses (nothing listening, bad credentials, no such database) fails
  the first use at once with ``CannotConnect`` naming the cause, instead of a pool retrying in
  the background, logging each failure, until ``pool_timeout`` (what a one-shot ``outboxkit``
  command relies on). The pool is made only once that attempt succeeds.
- When the pool has no connection to give, one direct attempt tells why (refused, bad
  credentials, no such database), so the message names the cause, not a timeout.
- Messages name host, port and database; the password is taken out of every one (``where``,
  ``scrub``).

``Pool`` knows all of that (the conninfo, the sizes, the liveness rule, the probe, every
message); ``AsyncPool`` only waits differently, as psycopg's async pool does beside its blocking one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import select
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Protocol, runtime_checkable

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from outboxkit.core.text import scrub, secrets_of
from outboxkit.errors import CannotConnect, ConfigurationError, StoreError, StoreUnavailable

from .loops import close_from_blocking, finish

__all__ = [
    "AnyConnection",
    "hold_transaction",
    "release_transaction",
    "Lender",
    "AsyncConnection",
    "AsyncPool",
    "Connection",
    "Pool",
    "describe",
    "is_url",
]

log = logging.getLogger("outboxkit")

Connection = psycopg.Connection[Any]
AsyncConnection = psycopg.AsyncConnection[Any]
AnyConnection = Connection | AsyncConnection

SCHEMES = ("postgresql", "postgres")
_PROBE_TIMEOUT = 5  # seconds libpq may spend finding out why the pool cannot connect
_SETS_TIMEZONE = re.compile(r"timezone\s*=", re.IGNORECASE)


SET_UTC = b"SET TimeZone TO 'UTC'"
_UTC = b"UTC"


def zone_given(options: str | None, environ: Mapping[str, str]) -> bool:
    """Whether the connection settings name a session time zone: ``TimeZone`` in the
    ``options`` given (or, without them, in ``PGOPTIONS``), or ``PGTZ``. The store's own
    connections are put in UTC only when they do not."""
    if "PGTZ" in environ:
        return True
    given = options if options else environ.get("PGOPTIONS")
    return bool(given and _SETS_TIMEZONE.search(given))


def needs_utc(conn: AnyConnection) -> bool:
    """The session's zone, as the server last reported it, is not UTC (no round trip)."""
    return conn.pgconn.parameter_status(b"TimeZone") != _UTC


def is_url(conninfo: object) -> bool:
    return isinstance(conninfo, str) and scheme_of(conninfo) in SCHEMES


def scheme_of(url: object) -> str:
    if not isinstance(url, str) or "://" not in url:
        return ""
    return url.split("://", 1)[0].lower()


def describe(conninfo: str) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    """``host:port/dbname`` for messages, the secrets to keep out of them, and the params.

    Raises:
        ConfigurationError: the string does not parse (the message never quotes it).
    """
    secrets = set(secrets_of(conninfo))
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise ConfigurationError(
            "cannot parse the PostgreSQL connection string (not shown: it may hold a password): "
            f"{scrub(str(exc), sorted(secrets, key=len, reverse=True))}"
        ) from None
    given = params.get("password")
    if given:
        secrets |= set(secrets_of(f"password={given}")) | {str(given)}
    ordered = tuple(sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True))
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = params.get("dbname")
    where = f"{host}:{port}" + (f"/{dbname}" if dbname else "")
    return scrub(where, ordered), ordered, params


@runtime_checkable
class Lender(Protocol):
    """A pool of the app's that lends psycopg connections, as ``psycopg_pool.ConnectionPool``
    does (``outboxkit.contrib.sqlalchemy.EnginePool``: a SQLAlchemy engine's pool)."""

    @property
    def conninfo(self) -> str | None:
        """The connection string for what a pool cannot lend (``LISTEN``, the asyncio side),
        or None (then the store has neither)."""
        ...

    @property
    def kwargs(self) -> Mapping[str, Any]:
        """Connection keyword arguments for those connections."""
        ...

    def getconn(self) -> Connection:
        """A connection (raising ``PoolTimeout`` or a ``psycopg.Error`` when there is none)."""
        ...

    def putconn(self, conn: Connection) -> None:
        """Give ``conn`` back."""
        ...


class Pool:
    """Where the store's connections come from.

    Args:
        conninfo: a URL or libpq string (the store opens a pool of its own on first use), or a
            ``psycopg_pool.ConnectionPool`` or ``Lender`` of the app's (borrowed, never closed).
        kwargs: connection keyword arguments (``prepare_threshold``...).
        min_size, max_size, timeout: the store's own pool (and the asyncio side's).
        name: the pool's name (in psycopg_pool's logs).
        listen_conninfo: where the ``LISTEN`` connection goes, if not where ``conninfo`` does
            (the server itself, behind a transaction pooler).
    """

    def __init__(
        self,
        conninfo: str | ConnectionPool[Any] | Lender,
        *,
        kwargs: Mapping[str, Any],
        min_size: int,
        max_size: int,
        timeout: float,
        name: str,
        listen_conninfo: str | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self.min_size, self.max_size, self.timeout, self.name = min_size, max_size, timeout, name
        self.secrets: tuple[str, ...] = ()
        self.where = "the pool's server"
        self._connect_errors_seen = 0
        self.utc = False
        """Put the store's own sessions in UTC: ``SET TimeZone`` when a connection is made,
        and again when one comes back to the pool in another zone (a delivery's ``RESET
        ALL``). psycopg then loads ``timestamptz`` values as datetimes in ``datetime.UTC``,
        its cheapest conversion (a named zone, the server's ``Etc/UTC`` default too, costs
        three times as much: 0.93 against 0.30 µs for a row of three, on every row a claim
        returns). A ``SET`` and not libpq's ``options`` startup parameter: a transaction
        pooler refuses that one ("unsupported startup parameter: options"), while PgBouncer
        keeps a ``TimeZone`` a client ``SET`` for that client, on whichever server connection
        runs its transactions."""
        if isinstance(conninfo, ConnectionPool | Lender):
            self._pool: ConnectionPool[Any] | Lender | None = conninfo
            self.owned = False
            given = conninfo.conninfo
            self.conninfo: str | None = given if isinstance(given, str) else None
            pool_kwargs = conninfo.kwargs if isinstance(conninfo.kwargs, Mapping) else {}
            self.kwargs = {k: v for k, v in pool_kwargs.items() if k != "autocommit"}
        else:
            self._pool = None
            self.owned = True
            self.conninfo = conninfo
            self.kwargs = dict(kwargs)
        if self.conninfo is not None:
            self.where, self.secrets, params = describe(self.conninfo)
            if "application_name" not in params and "application_name" not in self.kwargs:
                self.kwargs["application_name"] = "outboxkit"
            # The store's own connections in UTC, unless the settings name a zone (see
            # ``utc``); given options are passed on as they are, none added.
            given = self.kwargs.get("options", params.get("options"))
            self.utc = self.owned and not zone_given(given, os.environ)
        self.listening_to: str | None = listen_conninfo or self.conninfo
        """The conninfo of the ``LISTEN`` connection (None: there can be none)."""
        self.listening_where = self.where
        if listen_conninfo is not None:
            self.listening_where, secrets, _ = describe(listen_conninfo)
            self.secrets = tuple(sorted({*self.secrets, *secrets}, key=len, reverse=True))

    @property
    def closed(self) -> bool:
        """The store was closed: no connection is given any more (the async pool's too)."""
        return self._closed

    def scrub(self, text: str) -> str:
        return scrub(text, self.secrets)

    def options(self, *, asyncio: bool = False) -> dict[str, Any]:
        """The arguments of a pool of the store's own, besides the conninfo: autocommit
        connections (every write is one statement; a delivery begins its own transaction)."""
        kwargs = {**self.connect_kwargs(asyncio=asyncio), "autocommit": True}
        in_utc: dict[str, Any] = {}
        if self.utc and not asyncio:  # the asyncio side passes its own (``AsyncPool``)
            in_utc = {"configure": _put_in_utc, "reset": _put_in_utc}
        return {
            **in_utc,
            "kwargs": kwargs,
            "min_size": self.min_size,
            "max_size": self.max_size,
            "timeout": self.timeout,
            "name": f"{self.name}-async" if asyncio else self.name,
            "open": False,
        }

    def connect_kwargs(self, *, asyncio: bool = False) -> dict[str, Any]:
        """The connection keyword arguments; for an async connection without a cursor factory
        (an app pool's is a blocking cursor class, which cannot serve an async connection)."""
        if not asyncio:
            return dict(self.kwargs)
        return {k: v for k, v in self.kwargs.items() if k != "cursor_factory"}

    def _get(self, doing: str) -> ConnectionPool[Any] | Lender:
        pool = self._pool
        if pool is not None and not self._closed:
            return pool
        with self._lock:
            self.check_open()
            if self._pool is None:
                assert self.conninfo is not None
                self.probe(doing)
                self._pool = ConnectionPool(self.conninfo, **self.options())
                self._pool.open(wait=False)
            return self._pool

    def probe(self, doing: str) -> None:
        """One direct connection, closed at once: the server is there and takes the credentials.

        Raises:
            CannotConnect: it refused (the message names host, port and database, and why).
        """
        assert self.conninfo is not None
        try:
            with psycopg.connect(self.conninfo, **self.probe_kwargs()):
                pass
        except psycopg.Error as exc:
            raise self.cannot_connect(exc, doing) from None

    def check_open(self) -> None:
        """Raises:
        StoreError: the store is closed."""
        if self._closed:
            raise StoreError("this PostgresStore is closed")

    @contextmanager
    def connection(self, doing: str) -> Iterator[Connection]:
        """A pooled connection, live as far as can be told without a round trip; committed
        at the end when it is not in autocommit (a pool of the app's own), rolled back if the
        block raises.

        Raises:
            StoreUnavailable: no connection could be had (the message says why).
        """
        pool = self._get(doing)
        conn = self._getconn(pool, doing)
        try:
            yield conn
            if not self.owned and must_commit(conn):
                conn.commit()
        except BaseException:
            if must_roll_back(conn):
                rollback_quietly(conn)
            raise
        finally:
            # The store's own connections go back in autocommit, or not at all (a transaction
            # held by a delivery that could not end it: ``hold_transaction``).
            if self.owned and not conn.autocommit and not release_transaction(conn):
                conn.close()
            pool.putconn(conn)

    def _getconn(self, pool: ConnectionPool[Any] | Lender, doing: str) -> Connection:
        for _ in self.attempts():
            try:
                conn: Connection = pool.getconn()
            except PoolTimeout as exc:
                raise self.unreachable(doing) from exc
            except psycopg.Error as exc:
                raise self.unavailable(exc, doing) from exc
            if _alive(conn):
                return conn
            log.info(DISCARDING)
            pool.putconn(conn)
        raise self.all_closed(doing)

    def attempts(self) -> range:
        """How many pooled connections to try before giving up: every one the pool may hold
        found closed, and two fresh ones."""
        return range(self.max_size + 2)

    def unavailable(self, exc: psycopg.Error, doing: str) -> StoreUnavailable:
        """The pool failed to give a connection (``exc``, not a timeout)."""
        return StoreUnavailable(
            f"PostgreSQL at {self.where} is unavailable ({doing}): {self.scrub(str(exc).strip())}"
        )

    def all_closed(self, doing: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"PostgreSQL at {self.where} ({doing}): every pooled connection was found closed"
        )

    def unreachable(self, doing: str) -> StoreUnavailable:
        """Why the pool has no connection to give: one direct attempt tells."""
        if self.conninfo is None:
            return StoreUnavailable(
                f"no PostgreSQL connection from the pool within {self.timeout:g} s ({doing})"
            )
        try:
            self.probe(doing)
        except CannotConnect as exc:
            return exc
        return self.exhausted(doing)

    def probe_kwargs(self, *, asyncio: bool = False) -> dict[str, Any]:
        """The direct attempt's connection arguments: libpq may not spend long on it."""
        kwargs = {**self.connect_kwargs(asyncio=asyncio), "autocommit": True}
        if "connect_timeout" not in conninfo_to_dict(self.conninfo or ""):
            kwargs["connect_timeout"] = _PROBE_TIMEOUT
        return kwargs

    def cannot_connect(self, exc: psycopg.Error, doing: str) -> CannotConnect:
        """The direct attempt failed: ``exc`` says why (refused, bad credentials...), on one
        line (libpq's messages span several: one per address it tried)."""
        reason = " ".join(self.scrub(str(exc)).split())
        return CannotConnect(f"cannot connect to PostgreSQL at {self.where} ({doing}): {reason}")

    def exhausted(self, doing: str) -> StoreUnavailable:
        """The direct attempt connected: the pool is full, or (the true cause after an outage)
        its own connection attempts failed and it is waiting to try again."""
        failed = self._connect_failures()
        if failed:
            return StoreUnavailable(
                f"PostgreSQL at {self.where} ({doing}): the pool had no connection within "
                f"{self.timeout:g} s: {failed} of its connection attempts failed (the server "
                "was unreachable or refused them; a direct connection now succeeds, so the "
                "pool is reconnecting)"
            )
        return StoreUnavailable(
            f"PostgreSQL at {self.where} ({doing}): no free connection in the pool within "
            f"{self.timeout:g} s (pool_max_size={self.max_size})"
        )

    def _connect_failures(self) -> int:
        """The store's own pool's failed connection attempts since the last call."""
        pool = self._pool
        if not isinstance(pool, ConnectionPool) or not self.owned:
            return 0
        errors = pool.get_stats().get("connections_errors", 0)
        failed, self._connect_errors_seen = errors - self._connect_errors_seen, errors
        return max(failed, 0)

    def close(self) -> None:
        """Close the store's own pool (a pool passed in is left open)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if isinstance(pool, ConnectionPool) and self.owned:
            pool.close()


class AsyncPool:
    """The asyncio side's connections: a ``psycopg_pool.AsyncConnectionPool`` of its own,
    built from ``pool``'s conninfo, connection options and sizes, opened on first use on the
    running event loop, which it then belongs to.

    The pool closes itself when its loop ends (``asyncio.run`` returns); the next use, on
    another loop, opens a new one. Two live loops at once cannot share it.
    """

    def __init__(self, pool: Pool) -> None:
        self.sync = pool
        self._lock = threading.Lock()  # the loop binding is checked and changed at once
        self._pool: AsyncConnectionPool[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Lock | None = None
        self._closer: asyncio.Task[None] | None = None  # closes the pool when its loop ends
        # Every connection the pool made, for closing their sockets after their loop ended.
        self._made: weakref.WeakSet[AsyncConnection] = weakref.WeakSet()

    async def _get(self, doing: str) -> AsyncConnectionPool[Any]:
        loop = asyncio.get_running_loop()
        pool = self._pool
        if pool is not None and self._loop is loop and not pool.closed and not self.sync.closed:
            return pool
        with self._lock:
            self.sync.check_open()
            if self._loop is not loop:
                self._bind(loop)
            opening = self._opening
        assert opening is not None
        async with opening:  # one pool, however many tasks ask for the first connection
            if self._pool is not None and self._pool.closed:
                # Its loop lives on, but the pool was closed with its tasks (cancelled all at
                # once, as a framework's shutdown may): the next use opens another.
                self._pool = None
            if self._pool is None:
                assert self.sync.conninfo is not None
                await self.probe(doing)
                pool = AsyncConnectionPool(
                    self.sync.conninfo,
                    configure=self._made_one,
                    reset=_put_in_utc_async if self.sync.utc else None,
                    **self.sync.options(asyncio=True),
                )
                closer = asyncio.create_task(_close_at_loop_end(pool), name=pool.name)
                # Wait for the first connections (``pool_min_size``): none is left half made
                # in the background when a short-lived loop ends (``asyncio.run`` of a
                # request), which cancels it midway.
                try:
                    await pool.open(wait=True, timeout=self.sync.timeout)
                except BaseException as exc:  # a timeout, or this task cancelled
                    await pool.close()
                    closer.cancel()
                    if isinstance(exc, PoolTimeout):
                        raise await self.unreachable(doing) from exc
                    raise
                self._pool, self._closer = pool, closer
            return self._pool

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        old = self._loop
        if old is not None and not old.is_closed():
            raise ConfigurationError(
                "the asyncio side of this PostgresStore is open on another event loop; one "
                "loop at a time can use it: await store.async_store().close() on that loop first"
            )
        self._hard_close()  # the old loop's pool: its tasks ended with it
        self._loop, self._opening = loop, asyncio.Lock()

    async def _made_one(self, conn: AsyncConnection) -> None:
        self._made.add(conn)
        if self.sync.utc:
            await _put_in_utc_async(conn)

    @asynccontextmanager
    async def connection(self, doing: str) -> AsyncIterator[AsyncConnection]:
        """``Pool.connection`` on the asyncio side: a live pooled async connection.

        Raises:
            StoreUnavailable: no connection could be had (the message says why).
            ConfigurationError: the pool is open on another event loop.
        """
        pool = await self._get(doing)
        conn = await self._getconn(pool, doing)
        try:
            yield conn
        except BaseException:
            if must_roll_back(conn):
                await _rollback_quietly_async(conn)
            raise
        finally:
            # Its own autocommit connections go back in autocommit, or not at all (see
            # ``Pool.connection``).
            if not conn.autocommit and not release_transaction(conn):
                await conn.close()
            await pool.putconn(conn)

    async def _getconn(self, pool: AsyncConnectionPool[Any], doing: str) -> AsyncConnection:
        sync = self.sync
        for _ in sync.attempts():
            try:
                conn: AsyncConnection = await pool.getconn()
            except PoolTimeout as exc:
                raise await self.unreachable(doing) from exc
            except psycopg.Error as exc:
                raise sync.unavailable(exc, doing) from exc
            if await _alive_async(conn):
                return conn
            log.info(DISCARDING)
            await pool.putconn(conn)
        raise sync.all_closed(doing)

    async def probe(self, doing: str) -> None:
        """``Pool.probe`` on an async connection (before the pool is made, and to say why it
        has none to give).

        Raises:
            CannotConnect: the server refused.
        """
        sync = self.sync
        try:
            conn = await psycopg.AsyncConnection.connect(
                sync.conninfo or "", **sync.probe_kwargs(asyncio=True)
            )
        except psycopg.Error as exc:
            raise sync.cannot_connect(exc, doing) from None
        await conn.close()

    async def unreachable(self, doing: str) -> StoreUnavailable:
        """``Pool.unreachable``, the direct attempt made on an async connection."""
        try:
            await self.probe(doing)
        except CannotConnect as exc:
            return exc
        return self.sync.exhausted(doing)

    async def close(self) -> None:
        """Close the pool (on its own loop); the next use opens another one, unless the store
        is closed."""
        loop, shut = self._take()
        if shut is None:
            return
        if loop is asyncio.get_running_loop():
            await shut()
        else:  # its loop is gone (or elsewhere): nothing here can await its close
            close_from_blocking(loop, shut, self._hard_close)

    def close_blocking(self) -> None:
        """Close the pool from blocking code (``PostgresStore.close()``), wherever its loop is
        (see ``loops.close_from_blocking``)."""
        loop, shut = self._take()
        if shut is not None:
            close_from_blocking(loop, shut, self._hard_close)

    def _take(
        self,
    ) -> tuple[asyncio.AbstractEventLoop | None, Callable[[], Coroutine[Any, Any, None]] | None]:
        """Forget the pool; its loop, and what closes it there (None: there is no pool)."""
        with self._lock:
            pool, loop, closer = self._pool, self._loop, self._closer
            self._pool = self._loop = self._opening = self._closer = None
        if pool is None:
            return loop, None

        async def shut() -> None:
            await pool.close()
            if closer is not None:
                closer.cancel()

        return loop, shut

    def _hard_close(self) -> None:
        self._pool = None
        for conn in list(self._made):
            finish(conn)
        self._made = weakref.WeakSet()


DISCARDING = "discarding a PostgreSQL connection the server closed"


async def _close_at_loop_end(pool: AsyncConnectionPool[Any]) -> None:
    """Wait until cancelled, then close ``pool``: a task of the pool's own that closes it when
    its event loop ends. ``asyncio.run`` cancels every task once its main coroutine returns,
    and psycopg_pool's workers survive a cancellation (they catch it, to keep the pool
    consistent) and would wait for work forever, so that ``asyncio.run`` never returned; the
    pool's close stops them."""
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        await pool.close()
        raise


def _put_in_utc(conn: Connection) -> None:
    """``Pool.utc``: a connection made, or back in the pool (autocommit, idle)."""
    if needs_utc(conn):
        conn.execute(SET_UTC, prepare=False)


async def _put_in_utc_async(conn: AsyncConnection) -> None:
    if needs_utc(conn):
        await conn.execute(SET_UTC, prepare=False)


def hold_transaction(conn: AnyConnection) -> None:
    """Hold the transaction outboxkit just began on an autocommit connection (its ``BEGIN``
    answered, in the delivery's first pipeline sync): until ``release_transaction``, psycopg
    takes the connection as one without autocommit, so that a statement a handler runs after
    ending that transaction (``ctx.connection.rollback()``, a raw ``ROLLBACK``) begins a
    transaction of psycopg's, which outboxkit rolls back, instead of committing at once, on
    every attempt (R17).

    psycopg's setter refuses to turn autocommit off inside a transaction, and turning it off
    before the ``BEGIN`` would make psycopg send a ``BEGIN`` of its own in a round trip of its
    own, on every delivery: the flag is set here, on the driver's attribute (``_autocommit``,
    what the public property reads; outboxkit's one write of psycopg's private state, checked
    by ``tests/integration/pg/test_delivery_integrity.py``).
    """
    conn._autocommit = False


def release_transaction(conn: AnyConnection) -> bool:
    """End ``hold_transaction`` once the connection is idle again: autocommit back on. False
    (nothing changed) when it is still in a transaction: its caller discards it, since the
    pool must never get a connection without autocommit back."""
    if conn.closed or conn.pgconn.transaction_status != TransactionStatus.IDLE:
        return False
    conn._autocommit = True
    return True


def must_commit(conn: AnyConnection) -> bool:
    """A connection without autocommit (a pool of the app's own) left in a transaction by a
    block that ended normally: the block's work is committed before the connection goes back."""
    return not conn.autocommit and conn.info.transaction_status != TransactionStatus.IDLE


def must_roll_back(conn: AnyConnection) -> bool:
    """A connection going back to the pool in a transaction (a block that raised)."""
    return not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE


def rollback_quietly(conn: Connection) -> None:
    try:
        conn.rollback()
    except psycopg.Error as exc:
        log.debug(_ROLLBACK_FAILED, exc)


async def _rollback_quietly_async(conn: AsyncConnection) -> None:
    try:
        await conn.rollback()
    except psycopg.Error as exc:
        log.debug(_ROLLBACK_FAILED, exc)


_ROLLBACK_FAILED = "rollback failed on a connection going back to the pool: %s"


def _heard_from(conn: AnyConnection) -> bool | None:
    """What ``conn``'s socket tells without a round trip, after it sat idle in the pool: True
    if it is silent (alive), False if it is closed, None if the server spoke: ask it.

    An idle connection's socket stays silent unless the server speaks first, which in practice
    means it is hanging up (a FATAL such as "terminating connection due to administrator
    command", then the end of the stream). So a silent socket costs no round trip; only one
    that spoke is checked with an empty query.
    """
    if conn.closed:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return None if readable else True


def _alive(conn: Connection) -> bool:
    """False if the server has dropped ``conn`` while it sat idle in the pool."""
    if (silent := _heard_from(conn)) is not None:
        return silent
    try:
        ConnectionPool.check_connection(conn)
    except psycopg.Error:
        return False
    return conn.pgconn.status == ConnStatus.OK


async def _alive_async(conn: AsyncConnection) -> bool:
    """``_alive`` for an async connection."""
    if (silent := _heard_from(conn)) is not None:
        return silent
    try:
        await AsyncConnectionPool.check_connection(conn)
    except psycopg.Error:
        return False
    return conn.pgconn.status == ConnStatus.OK
