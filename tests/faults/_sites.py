"""One scenario, four stores: a store plus a *caller* connection of the application's own.

A ``Site`` opens the store (memory, SQLite on a real file, PostgreSQL in a fresh schema,
MariaDB/MySQL in a fresh database) and an application table ``orders``; ``caller()`` gives a
connection with an open transaction that has already written one ``orders`` row, so a test can
check that a refused ``enqueue`` left that transaction open, unbroken and still holding its own
write.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from outboxkit import MemoryStore, Store
from tests.backends import ALL_BACKENDS, SQL_BACKENDS

BACKENDS = ALL_BACKENDS
__all__ = ["BACKENDS", "SQL_BACKENDS", "Site", "open_site", "site"]


@dataclass
class Site:
    backend: str
    store: Store
    url: str
    options: dict[str, Any]
    _caller: Callable[[], Any]
    _orders_in: Callable[[Any], int]  # rows of orders seen through a caller connection
    _committed_orders: Callable[[], int]
    _write_order: Callable[[Any], None]  # one orders row through a connection (a handler's too)

    @contextmanager
    def caller(self) -> Iterator[Any]:
        """A caller connection inside an open transaction that has written one orders row."""
        conn = self._caller()
        try:
            yield conn
        finally:
            if self.backend == "memory":
                if conn.open:
                    conn.rollback()
            else:
                conn.close()

    def assert_usable(self, conn: Any, before: int) -> None:
        """The caller's transaction is still open, not aborted, and holds its own write."""
        if self.backend == "memory":
            assert conn.open
        elif self.backend == "sqlite":
            assert conn.in_transaction
        elif self.backend == "mysql":
            from pymysql.constants import SERVER_STATUS

            assert conn.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS
        else:
            from psycopg.pq import TransactionStatus

            assert conn.info.transaction_status is TransactionStatus.INTRANS
        assert self._orders_in(conn) == before + 1

    def commit(self, conn: Any) -> None:
        conn.commit()

    def committed_orders(self) -> int:
        return self._committed_orders()

    def write_order(self, conn: Any) -> None:
        self._write_order(conn)

    def execute(self, conn: Any, statement: str) -> None:
        """Run ``statement`` on a store or caller connection (PyMySQL's has no ``execute``)."""
        if self.backend == "mysql":
            with conn.cursor() as cur:
                cur.execute(statement)
        else:
            conn.execute(statement)


@contextmanager
def open_site(backend: str, tmp_path: Path) -> Iterator[Site]:
    if backend == "memory":
        with closing(MemoryStore()) as memory:

            def begin() -> Any:
                tx = memory.begin()
                tx.insert("orders", {"id": 1})
                return tx

            yield Site(
                "memory",
                memory,
                "memory://",
                {},
                begin,
                lambda tx: len(tx.rows("orders")),
                lambda: len(memory.rows("orders")),
                lambda tx: tx.insert("orders", {"id": 0}),
            )
    elif backend == "sqlite":
        from outboxkit_sqlite import SQLiteStore

        path = tmp_path / "app.db"
        with closing(sqlite3.connect(path)) as setup, setup:
            setup.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT)")

        def count(conn: sqlite3.Connection) -> int:
            return int(conn.execute("SELECT count(*) FROM orders").fetchone()[0])

        def sqlite_begin() -> Any:
            conn = sqlite3.connect(path)
            conn.execute("INSERT INTO orders DEFAULT VALUES")
            return conn

        def sqlite_committed() -> int:
            with closing(sqlite3.connect(path)) as conn:
                return count(conn)

        with SQLiteStore(path) as lite:
            yield Site(
                "sqlite",
                lite,
                f"sqlite:///{path.as_posix()}",
                {},
                sqlite_begin,
                count,
                sqlite_committed,
                lambda conn: conn.execute("INSERT INTO orders DEFAULT VALUES"),
            )
    elif backend == "pg":
        import psycopg
        from psycopg import sql

        from outboxkit_pg import PostgresStore
        from tests.integration.pg import conftest as pg

        url = pg.test_url(pg.pg_url_from_env())
        pg.require_server(url)
        with pg.fresh_schema(url, "okfault") as schema:
            store = PostgresStore(url, schema=schema)
            try:
                store.migrate()
                orders = sql.Identifier(schema, "orders")
                with psycopg.connect(url, autocommit=True) as pg_setup:
                    pg_setup.execute(
                        sql.SQL("CREATE TABLE {} (id serial PRIMARY KEY)").format(orders)
                    )

                def pg_count(conn: Any) -> int:
                    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(orders)).fetchone()
                    return int(row[0])

                def pg_begin() -> Any:
                    conn = psycopg.connect(url)
                    conn.execute(sql.SQL("INSERT INTO {} DEFAULT VALUES").format(orders))
                    return conn

                def pg_write(conn: Any) -> None:
                    conn.execute(sql.SQL("INSERT INTO {} DEFAULT VALUES").format(orders))

                def pg_committed() -> int:
                    with psycopg.connect(url, autocommit=True) as conn:
                        return pg_count(conn)

                yield Site(
                    "pg", store, url, {"schema": schema}, pg_begin, pg_count, pg_committed, pg_write
                )
            finally:
                store.close()
    elif backend == "mysql":
        import pymysql

        from outboxkit_mysql import MySQLStore
        from tests.integration.mysql import server as mysql

        with mysql.fresh_database(prefix="okfault") as url:
            args = {**mysql.connect_args(url), "database": url.rsplit("/", 1)[1]}
            with closing(pymysql.connect(**args, autocommit=True)) as setup, setup.cursor() as cur:
                cur.execute("CREATE TABLE orders (id INT AUTO_INCREMENT PRIMARY KEY)")

            def my_count(conn: Any) -> int:
                with conn.cursor() as cur:
                    cur.execute("SELECT count(*) FROM orders")
                    return int(cur.fetchone()[0])

            def my_write(conn: Any) -> None:
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO orders () VALUES ()")

            def my_begin() -> Any:
                conn = pymysql.connect(**args)
                my_write(conn)
                return conn

            def my_committed() -> int:
                with closing(pymysql.connect(**args)) as conn:
                    return my_count(conn)

            with MySQLStore(url) as store:
                store.migrate()
                yield Site("mysql", store, url, {}, my_begin, my_count, my_committed, my_write)
    else:  # pragma: no cover
        raise ValueError(backend)


@pytest.fixture(params=BACKENDS)
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    with open_site(request.param, tmp_path) as opened:
        yield opened
