"""The MariaDB/MySQL test server, and databases of the tests' own.

The server comes from ``OUTBOXKIT_TEST_MYSQL`` (default ``mysql://root@127.0.0.1:3306/test``;
the database named there is only used to connect). Each test makes a database of its own and
drops it afterwards. When the server cannot be reached the tests that need it skip, naming the
server and why; with ``OUTBOXKIT_REQUIRE_MYSQL=1`` (as in CI) they fail instead.

``make_store`` is a store factory for ``outboxkit conformance``::

    outboxkit conformance tests.integration.mysql.server:make_store
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pymysql
import pytest

from outboxkit_mysql import MySQLStore

DEFAULT_URL = "mysql://root@127.0.0.1:3306/test"


def server_url() -> str:
    return os.environ.get("OUTBOXKIT_TEST_MYSQL") or DEFAULT_URL


def connect_args(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    return {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 3306,
        "user": parts.username or "root",
        "password": parts.password or "",
    }


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, ""))


@functools.cache
def server_problem(url: str) -> str | None:
    """Why the test server cannot be used, or None."""
    try:
        pymysql.connect(**connect_args(url), connect_timeout=3).close()
    except pymysql.err.Error as exc:
        where = f"{urlsplit(url).hostname}:{urlsplit(url).port or 3306}"
        return f"no MariaDB/MySQL test server at {where} ({type(exc).__name__}: {exc})"
    return None


def require_server(url: str | None = None) -> str:
    """The server's URL; skip (with OUTBOXKIT_REQUIRE_MYSQL=1: fail) when it cannot be reached."""
    url = url or server_url()
    problem = server_problem(url)
    if problem is None:
        return url
    if os.environ.get("OUTBOXKIT_REQUIRE_MYSQL") == "1":
        pytest.fail(f"OUTBOXKIT_REQUIRE_MYSQL=1 but {problem}", pytrace=False)
    pytest.skip(
        f"{problem}; set OUTBOXKIT_TEST_MYSQL to a server (OUTBOXKIT_REQUIRE_MYSQL=1 fails)"
    )


def admin(url: str) -> pymysql.connections.Connection:
    return pymysql.connect(**connect_args(url), autocommit=True)


@contextmanager
def fresh_database(url: str | None = None, prefix: str = "okt") -> Iterator[str]:
    """A new database; its URL. Dropped at the end."""
    url = require_server(url)
    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    with admin(url) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    try:
        yield with_database(url, name)
    finally:
        with admin(url) as conn, conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")


@contextmanager
def migrated_store(url: str | None = None, **options: Any) -> Iterator[MySQLStore]:
    """A store in a fresh database, migrated; closed and dropped at the end."""
    with fresh_database(url) as db_url:
        store = MySQLStore(db_url, **options)
        try:
            store.migrate()
            yield store
        finally:
            store.close()


def make_store(tmp_path: Path) -> Any:
    """The conformance suite's factory: a fresh, migrated store in a database of its own."""
    return migrated_store()
