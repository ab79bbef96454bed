"""The PostgreSQL store's connections: a psycopg pool of its own (opened on first use), or the
app's pool, borrowed.

- A connection the server dropped while it sat in the pool (a restart, ``pg_terminate_backend``)
  is found without a round trip and swapped for a new one: an idle socket stays silent unless
  the server speaks first, which in practice means it is hanging up.
- When the pool has no connection to give, one direct attempt tells why (refused, bad
  credentials, no such database), so the message names the cause, not a timeout.
- Messages name host, port and database; the password is taken out of every one (``where``,
  ``scrub``).
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from outboxkit.core.text import scrub, secrets_of
from outboxkit.errors import ConfigurationError, StoreError, StoreUnavailable

__all__ = ["Connection", "Pool", "describe", "is_url"]

log = logging.getLogger("outboxkit")

Connection = psycopg.Connection[Any]

SCHEMES = ("postgresql", "postgres")
_PROBE_TIMEOUT = 5  # seconds libpq may spend finding out why the pool cannot connect


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


class Pool:
    """Where the store's connections come from.

    Args:
        conninfo: a URL or libpq string (the store opens a pool of its own on first use), or a
            ``psycopg_pool.ConnectionPool`` of the app's (borrowed, never closed).
        kwargs: connection keyword arguments (``prepare_threshold``...).
        min_size, max_size, timeout: the store's own pool.
        name: the pool's name (in psycopg_pool's logs).
    """

    def __init__(
        self,
        conninfo: str | ConnectionPool[Any],
        *,
        kwargs: Mapping[str, Any],
        min_size: int,
        max_size: int,
        timeout: float,
        name: str,
    ) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self.min_size, self.max_size, self.timeout, self._name = min_size, max_size, timeout, name
        self.secrets: tuple[str, ...] = ()
        self.where = "the pool's server"
        if isinstance(conninfo, ConnectionPool):
            self._pool: ConnectionPool[Any] | None = conninfo
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

    def scrub(self, text: str) -> str:
        return scrub(text, self.secrets)

    def _get(self) -> ConnectionPool[Any]:
        pool = self._pool
        if pool is not None and not self._closed:
            return pool
        with self._lock:
            if self._closed:
                raise StoreError("this PostgresStore is closed")
            if self._pool is None:
                assert self.conninfo is not None
                self._pool = ConnectionPool(
                    self.conninfo,
                    kwargs={"autocommit": True, **self.kwargs},
                    min_size=self.min_size,
                    max_size=self.max_size,
                    timeout=self.timeout,
                    name=self._name,
                    open=False,
                )
                self._pool.open(wait=False)
            return self._pool

    @contextmanager
    def connection(self, doing: str) -> Iterator[Connection]:
        """A pooled connection, live as far as can be told without a round trip; committed
        at the end when it is not in autocommit (a pool of the app's own), rolled back if the
        block raises.

        Raises:
            StoreUnavailable: no connection could be had (the message says why).
        """
        pool = self._get()
        conn = self._getconn(pool, doing)
        try:
            yield conn
            if not conn.autocommit and conn.info.transaction_status != TransactionStatus.IDLE:
                conn.commit()
        except BaseException:
            rollback_quietly(conn)
            raise
        finally:
            pool.putconn(conn)

    def _getconn(self, pool: ConnectionPool[Any], doing: str) -> Connection:
        for _ in range(self.max_size + 2):
            try:
                conn: Connection = pool.getconn()
            except PoolTimeout as exc:
                raise self.unreachable(doing) from exc
            except psycopg.Error as exc:
                raise StoreUnavailable(
                    f"PostgreSQL at {self.where} is unavailable ({doing}): "
                    f"{self.scrub(str(exc).strip())}"
                ) from exc
            if _alive(conn):
                return conn
            log.info("discarding a PostgreSQL connection the server closed")
            pool.putconn(conn)
        raise StoreUnavailable(
            f"PostgreSQL at {self.where} ({doing}): every pooled connection was found closed"
        )

    def unreachable(self, doing: str) -> StoreUnavailable:
        """Why the pool has no connection to give: one direct attempt tells."""
        if self.conninfo is None:
            return StoreUnavailable(
                f"no PostgreSQL connection from the pool within {self.timeout:g} s ({doing})"
            )
        kwargs = {**self.kwargs, "autocommit": True}
        if "connect_timeout" not in conninfo_to_dict(self.conninfo):
            kwargs["connect_timeout"] = _PROBE_TIMEOUT
        try:
            with psycopg.connect(self.conninfo, **kwargs):
                pass
        except psycopg.Error as exc:
            reason = self.scrub(str(exc).strip())
            return StoreUnavailable(
                f"cannot connect to PostgreSQL at {self.where} ({doing}): {reason}"
            )
        return StoreUnavailable(
            f"PostgreSQL at {self.where} ({doing}): no free connection in the pool within "
            f"{self.timeout:g} s (pool_max_size={self.max_size})"
        )

    def close(self) -> None:
        """Close the store's own pool (a pool passed in is left open)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None and self.owned:
            pool.close()


def rollback_quietly(conn: Connection) -> None:
    if conn.closed or conn.info.transaction_status == TransactionStatus.IDLE:
        return
    try:
        conn.rollback()
    except psycopg.Error as exc:
        log.debug("rollback failed on a connection going back to the pool: %s", exc)


def _alive(conn: Connection) -> bool:
    """False if the server has dropped ``conn`` while it sat idle in the pool.

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
    if not readable:
        return True
    try:
        ConnectionPool.check_connection(conn)
    except psycopg.Error:
        return False
    return conn.pgconn.status == ConnStatus.OK
