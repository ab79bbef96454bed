"""The README's Postgres example runs as written (against the test server, in a schema of its
own: the URL and the schema name are swapped for the test's, the app's tables land there too)."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.docs import page

from .conftest import fresh_schema

pytestmark = pytest.mark.pg


def test_readme_postgres_example_runs(pg_url: str) -> None:
    section = page("how-to/postgresql.md")
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert 'DATABASE_URL = "postgresql://app@localhost/app"' in example
    assert 'schema="outbox"' in example
    with fresh_schema(pg_url) as schema:
        # Unqualified app tables go to the test schema (created first, as search_path needs).
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        url = pg_url + ("&" if "?" in pg_url else "?") + f"options=-c%20search_path%3D{schema}"
        code = example.replace("postgresql://app@localhost/app", url).replace(
            'schema="outbox"', f'schema="{schema}"'
        )
        namespace: dict[str, Any] = {"__name__": "readme_postgres"}
        exec(compile(code, "docs/how-to/postgresql.md", "exec"), namespace)
        with psycopg.connect(pg_url) as conn:
            ledger = conn.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "ledger"))
            ).fetchone()
            published = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NOT NULL").format(
                    sql.Identifier(schema, "outbox_events")
                )
            ).fetchone()
        assert (ledger, published) == ((1,), (1,))
