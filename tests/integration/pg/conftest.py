"""Fixtures for the PostgreSQL tests.

The server comes from ``OUTBOXKIT_TEST_PG`` (default ``postgresql://postgres@127.0.0.1:5432/
postgres``). Every test gets a schema of its own, dropped afterwards. When the server cannot be
reached the tests that need it are skipped, naming the server and why; with
``OUTBOXKIT_REQUIRE_PG=1`` (as in CI) they fail instead.

The tests' sessions run with ``synchronous_commit=off``: they check what pollers do, not what
survives a crash of the server, and a commit then does not wait for its WAL flush (on a virtual
disk that is several milliseconds per commit). ``OUTBOXKIT_TEST_PG_SYNC=1`` keeps the server's
setting, to measure with it.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit_pg import PostgresStore

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def pg_url_from_env() -> str:
    return os.environ.get("OUTBOXKIT_TEST_PG") or DEFAULT_URL


def test_url(url: str) -> str:
    """``url`` with the tests' session settings (see the module docstring)."""
    if os.environ.get("OUTBOXKIT_TEST_PG_SYNC") == "1":
        return url
    if "://" in url:
        return url + ("&" if "?" in url else "?") + "options=-c%20synchronous_commit%3Doff"
    return url + " options='-c synchronous_commit=off'"


@functools.cache
def server_problem(url: str) -> str | None:
    """Why the test server cannot be used, or None."""
    try:
        with psycopg.connect(url, connect_timeout=3, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        where = PostgresStore(url).where
        return f"no PostgreSQL test server at {where} ({type(exc).__name__}: {exc})".strip()
    return None


def require_server(url: str) -> None:
    """Skip (or, with OUTBOXKIT_REQUIRE_PG=1, fail) when the server cannot be reached."""
    problem = server_problem(url)
    if problem is None:
        return
    if os.environ.get("OUTBOXKIT_REQUIRE_PG") == "1":
        pytest.fail(f"OUTBOXKIT_REQUIRE_PG=1 but {problem}", pytrace=False)
    pytest.skip(f"{problem}; set OUTBOXKIT_TEST_PG to a server (OUTBOXKIT_REQUIRE_PG=1 fails)")


def new_schema_name(prefix: str = "okt") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@contextmanager
def fresh_schema(url: str, prefix: str = "okt") -> Iterator[str]:
    """A schema name no one uses yet; the schema (if created) is dropped at the end."""
    schema = new_schema_name(prefix)
    try:
        yield schema
    finally:
        drop_schema(url, schema)


@contextmanager
def migrated_store(url: str, **options: Any) -> Iterator[PostgresStore]:
    """A store in a fresh schema, migrated; closed and dropped at the end."""
    with fresh_schema(url) as schema:
        store = PostgresStore(url, schema=schema, **options)
        try:
            store.migrate()
            yield store
        finally:
            store.close()


@pytest.fixture(scope="session")
def pg_url() -> str:
    url = test_url(pg_url_from_env())
    require_server(url)
    return url


@pytest.fixture
def pg_schema(pg_url: str) -> Iterator[str]:
    with fresh_schema(pg_url) as schema:
        yield schema


@pytest.fixture
def pg_store(pg_url: str, pg_schema: str) -> Iterator[PostgresStore]:
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        store.migrate()
        yield store
    finally:
        store.close()


@pytest.fixture
def admin(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for setting up and inspecting (as the test server's user)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        yield conn
