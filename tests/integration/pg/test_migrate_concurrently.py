"""Concurrent migrations into one new PostgreSQL schema.

Outboxes with different table prefixes migrating one schema that does not exist yet, all at
once: the migration lock was per table set, so they raced on the shared ``CREATE SCHEMA`` and
most failed with a unique violation on ``pg_namespace`` (18 of 24). The lock is now per
schema; every one of them succeeds, each with its own tables.
"""

from __future__ import annotations

import threading

import pytest

from outboxkit_pg import PostgresStore
from tests.integration.pg.conftest import fresh_schema

pytestmark = pytest.mark.pg

MIGRATORS = 24


def test_concurrent_migrations_with_other_prefixes_into_one_new_schema_all_succeed(
    pg_url: str,
) -> None:
    with fresh_schema(pg_url, "okmig") as schema:
        stores = [
            PostgresStore(pg_url, schema=schema, table_prefix=f"p{i}_", pool_min_size=1)
            for i in range(MIGRATORS)
        ]
        start = threading.Barrier(MIGRATORS)
        failures: list[BaseException] = []

        def migrate(store: PostgresStore) -> None:
            start.wait()
            try:
                store.migrate()
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=migrate, args=(s,)) for s in stores]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert failures == []
            for store in stores:
                assert store.stats(now=None).total == 0  # its own tables, at the current version
        finally:
            for store in stores:
                store.close()
