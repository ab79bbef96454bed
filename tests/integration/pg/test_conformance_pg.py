"""The conformance suite against PostgreSQL.

One connection pool for the class (the store borrows it), a fresh schema per test, dropped after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
from psycopg_pool import ConnectionPool

from outboxkit_conformance import StoreConformance
from outboxkit_pg import PostgresStore

from .conftest import new_schema_name

pytestmark = pytest.mark.pg


@pytest.fixture(scope="module", autouse=True)
def _shared_pool(pg_url: str) -> Iterator[None]:
    with ConnectionPool(
        pg_url, kwargs={"autocommit": True}, min_size=2, max_size=6, open=True
    ) as pool:
        TestPostgresConformance.pool = pool
        yield


@contextmanager
def _schema_store(**options: Any) -> Iterator[PostgresStore]:
    """A store in a new schema on the shared pool, migrated; the schema dropped after."""
    store = PostgresStore(TestPostgresConformance.pool, schema=new_schema_name(), **options)
    try:
        store.migrate()
        yield store
    finally:
        try:
            store.drop_schema()
        finally:
            store.close()


class TestPostgresConformance(StoreConformance):
    pool: ClassVar[ConnectionPool[Any]]

    @contextmanager
    def make_store(self, tmp_path: Path) -> Iterator[PostgresStore]:  # type: ignore[override]
        with _schema_store() as store:
            yield store


class TestPartitionedConformance(StoreConformance):
    """Every conformance check on the partitioned layout (``partition_size``): the suite's
    events span several partitions of 1,000 ids, and a new schema is converted by migrate()."""

    @contextmanager
    def make_store(self, tmp_path: Path) -> Iterator[PostgresStore]:  # type: ignore[override]
        with _schema_store(partition_size=1000) as store:
            yield store
