"""The MariaDB/MySQL dialect (``outboxkit.storekit.sql.Dialect``): the store's connections, its
error table, its values, and the statements of ``queries.sql`` with the store's names in place.

- Connections are PyMySQL's, the store's own (``ConnectionPool``), in autocommit mode with the session
  settings below (``SESSION``), set again before a connection a handler used serves anyone else
  (R18). ``StoreConnection`` notes a handler's attempt to end its delivery transaction (R17).
- Instants are DATETIME(6) in UTC, bound as naive UTC datetimes (None: the database's clock,
  ``UTC_TIMESTAMP(6)``); durations integer microseconds; lists tuples, or JSON text.
- Driver errors are mapped by their code (``UNAVAILABLE``, ``SCHEMA``): a deadlock (1213), a
  lock wait timeout (1205) or a lost connection is ``StoreUnavailable``, retried by the pollers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import pymysql
from pymysql.constants import CLIENT, COMMAND

from outboxkit.storekit import (
    SchemaError,
    StoreError,
    StoreUnavailable,
    migrate_hint,
)
from outboxkit.storekit.driver import (
    ConnectionPool,
    GuardedConnection,
    PooledDialect,
    parse_server_url,
    run_script,
    script_text,
)
from outboxkit.storekit.queries import load_queries, split_steps
from outboxkit.storekit.rows import EVENT_COLUMNS
from outboxkit.storekit.sql import JSONRows, NaiveUTC, Row

__all__ = ["SESSION", "SESSION_STEPS", "MySQLDialect", "StoreConnection", "map_error", "restored"]

SESSION = (
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED;"
    "SET time_zone = '+00:00', autocommit = 1, foreign_key_checks = 1, unique_checks = 1,"
    " sql_mode = 'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION'"
)
"""The store's session: READ COMMITTED (no gap locks on searches, a fresh snapshot per
statement), UTC, autocommit (transactions are explicit), strict."""
SESSION_STEPS = [(sql, None) for sql in SESSION.split(";")]  # a script's, one answer each

UNAVAILABLE = frozenset(
    {1040, 1053, 1205, 1213, 1317, 1927, 2002, 2003, 2006, 2013, 2014, 2055, 4031}
)
"""Codes of failures that may pass: too many connections, shutdown, lock wait timeout,
deadlock, interrupted, killed, cannot connect, gone away, lost, out of sync."""

SCHEMA = frozenset({1146})
"""No such table: the schema is missing (``migrate``)."""

XA_REFUSED = 1399
"""XAER_RMFAIL: the server refused to end (or begin) a transaction inside an XA one."""

_NOW = "COALESCE(CAST(%(now)s AS DATETIME(6)), UTC_TIMESTAMP(6))"
_MICROSECOND = timedelta(microseconds=1)


def code_of(exc: BaseException) -> int | None:
    """The server's (or the client's) error code of a PyMySQL error, if it has one."""
    if isinstance(exc, pymysql.err.InterfaceError):
        return 2013  # the connection is closed or broken
    if isinstance(exc, pymysql.err.MySQLError) and exc.args and isinstance(exc.args[0], int):
        return exc.args[0]
    return None


def map_error(exc: BaseException, where: str, doing: str) -> StoreError:
    """A PyMySQL error as outboxkit's, naming the database and what was being done (never a
    password: ``where`` has none)."""
    code = code_of(exc)
    reason = " ".join(str(part) for part in exc.args[1:]) if code is not None else str(exc)
    message = f"{where}: {doing} failed: ({code}) {reason}".strip()
    if code in UNAVAILABLE:
        return StoreUnavailable(message)
    if code in SCHEMA:
        return SchemaError(f"{message}: {migrate_hint()}")
    return StoreError(message)


class StoreConnection(GuardedConnection, pymysql.connections.Connection):
    """A PyMySQL connection of the store's (``GuardedConnection``): the server's own refusal of
    a statement that would end the delivery's XA transaction (``COMMIT``, ``ROLLBACK``,
    ``BEGIN``, DDL: error 1399) is noted as an attempt to end it too (R17)."""

    def refusal(self, what: str) -> BaseException:
        message = f"outboxkit: a handler may not {what} its delivery transaction"
        refused: BaseException = pymysql.err.OperationalError(XA_REFUSED, message)
        return refused

    def query(self, sql: Any, unbuffered: bool = False) -> int:
        try:
            if self.ahead is None:
                result: int = super().query(sql, unbuffered)
            else:
                result = self._query_ahead(sql, unbuffered)
        except pymysql.err.MySQLError as exc:
            if self.delivering and code_of(exc) == XA_REFUSED:
                self.ended_by_handler = True
            raise
        return result

    def _query_ahead(self, sql: str | bytes, unbuffered: bool) -> int:
        """``query(sql)`` with the ``ahead`` delivery's opening before it, in one round trip;
        the opening's answers read first. A stale token (the check's count 0): the answer to
        ``sql`` is read and dropped, ``LeaseLostError`` raised instead (what ``sql`` did is
        undone with the delivery, R6)."""
        ahead, self.ahead = self.ahead, None
        assert ahead is not None
        opening = script_text(self, ahead.opening).encode(self.encoding)
        if isinstance(sql, str):
            sql = sql.encode(self.encoding, "surrogateescape")
        owned = 0
        try:
            self._execute_command(COMMAND.COM_QUERY, opening + b";" + sql)
            for _ in ahead.opening:
                owned = self._read_query_result()
        except pymysql.err.MySQLError as exc:
            raise ahead.opening_failed(exc) from exc
        owned = owned if ahead.checks else 1
        try:
            answer: int = self._read_query_result(unbuffered=unbuffered)
        except pymysql.err.MySQLError:
            if owned == 1:
                raise
        else:
            self._affected_rows = answer
            if owned == 1:
                return answer
            if unbuffered and self._result is not None:  # its rows unread: the connection
                self._result.unbuffered_active = False  # closes (the server rolls back)
                self._force_close()
            while not unbuffered and self._result is not None and self._result.has_next:
                self.next_result()
        raise ahead.stale_token()


class MySQLDialect(NaiveUTC, JSONRows, PooledDialect):
    """The MariaDB/MySQL store's dialect (see the module docstring).

    Args:
        url: ``mysql://user:pass@host:port/database``.
        tables: the store's four table names (events, deliveries, keys, schema).
        pool_size: how many idle connections the store keeps.

    Attributes:
        queries: the statements of ``queries.sql``, names in place, each split into its steps.
        pool: the store's connections.
    """

    name = "mysql"
    driver_error = pymysql.err.Error
    pool: ConnectionPool[StoreConnection]

    def __init__(self, url: str, tables: Sequence[str], *, pool_size: int) -> None:
        server = parse_server_url(
            url, schemes=("mysql", "mariadb"), port=3306, user="root", store="MySQL"
        )
        self.connect = server.connect_args()
        db = server.database
        self.where = f"MySQL {server.host}:{server.port}/{db}"
        self.url = f"mysql://{server.user}@{server.host}:{server.port}/{db}"
        self.tables = tuple(tables)
        names = dict(zip(("events", "deliveries", "keys", "schema"), self.tables, strict=True))
        slots = {k: f"`{db}`.`{v}`" for k, v in names.items()}
        slots["event_columns"] = ", ".join(f"`{c}`" for c in EVENT_COLUMNS)
        self.queries = {
            name: split_steps(text.replace("{now}", _NOW).format(**slots))
            for name, text in load_queries("outboxkit_mysql").items()
        }
        self.pool = ConnectionPool(
            self.new_connection,
            pool_size,
            reset=StoreConnection.kept,
            close=StoreConnection.close_quietly,
            what="the MySQL store",
        )

    # -- statements ---------------------------------------------------------------------------

    def map_error(self, exc: BaseException, doing: str) -> StoreError:
        return map_error(exc, self.where, doing)

    def outage(self, exc: BaseException) -> bool:
        return code_of(exc) in UNAVAILABLE

    def checkout(self, conn: StoreConnection) -> StoreConnection:
        return restored(conn)

    def new_connection(self) -> StoreConnection:
        """A new connection of the store's (the pool's ``connect``)."""
        with self.mapped("connect"):
            return StoreConnection(
                **self.connect,
                charset="utf8mb4",
                autocommit=True,
                client_flag=CLIENT.MULTI_STATEMENTS,
                init_command=SESSION,
                connect_timeout=10,
            )

    def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        if name == "purge_dead":
            params = {**params, "any": params["ids"] is None, "ids": params["ids"] or (0,)}
        return super().rows(conn, name, params)


def restored(conn: StoreConnection) -> StoreConnection:
    """``conn`` with the store's session set again if a handler had it (R18)."""
    if conn.dirty:
        run_script(conn, SESSION_STEPS)
        conn.dirty = False
    return conn
