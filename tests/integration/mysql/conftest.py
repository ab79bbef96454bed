"""Fixtures for the MariaDB/MySQL tests (see ``server``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outboxkit_mysql import MySQLStore

from .server import fresh_database, migrated_store, require_server


@pytest.fixture(scope="session")
def mysql_server() -> str:
    return require_server()


@pytest.fixture
def mysql_url(mysql_server: str) -> Iterator[str]:
    """The URL of a database of the test's own (dropped afterwards)."""
    with fresh_database(mysql_server) as url:
        yield url


@pytest.fixture
def mysql_store(mysql_server: str) -> Iterator[MySQLStore]:
    with migrated_store(mysql_server) as store:
        yield store
