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


class TestPostgresConformance(StoreConformance):
    pool: ClassVar[ConnectionPool[Any]]

    @contextmanager
    def make_store(self, tmp_path: Path) -> Iterator[PostgresStore]:  # type: ignore[override]
        store = PostgresStore(self.pool, schema=new_schema_name())
        try:
            store.migrate()
            yield store
        finally:
            try:
                store.drop_schema()
            finally:
                store.close()
