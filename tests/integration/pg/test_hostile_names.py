"""Acceptance 7: hostile schema, table and channel names are refused at construction.

Names come from hypothesis (quotes, semicolons, SQL comments, spaces, non-ASCII, leading digits,
64+ characters...). Every one raises ``ConfigurationError`` before any connection is made (the
store is built against an unreachable server, and against the real one); a canary table in the
real database is intact afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from outboxkit import ConfigurationError, open_store
from outboxkit.storekit.names import IDENTIFIER
from outboxkit_pg import PostgresStore

from .conftest import drop_schema

UNREACHABLE = "postgresql://nobody:secret-password@127.0.0.1:1/nowhere"
NAME_OPTIONS = ("schema", "events_table", "deliveries_table", "schema_table", "channel")

HOSTILE = [
    'x"; DROP TABLE canary; --',
    "canary; DROP SCHEMA public CASCADE",
    "a'b",
    'a"b',
    "a b",
    "a-b",
    "a.b",
    "public.canary",
    "1abc",
    "",
    " ",
    "x" * 64,
    "é",
    "a\x00b",
    "\uff46\uff55\uff4c\uff4c",  # fullwidth letters
    "a\nb",
    "$1",
    "a/*b*/",
]

hostile_names = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(min_size=0, max_size=80),
    st.text(alphabet="\"';-/*\\ .$()", min_size=1, max_size=10).map(lambda s: "a" + s),
    st.integers(min_value=64, max_value=200).map(lambda n: "a" * n),
).filter(lambda name: not IDENTIFIER.match(name))


@pytest.fixture(scope="module")
def canary(pg_url: str) -> Iterator[tuple[str, str]]:
    """A table that must survive: (url, schema)."""
    schema = f"okt_canary_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(sql.Identifier(schema, "canary"))
        )
        conn.execute(
            sql.SQL("INSERT INTO {} VALUES (1), (2), (3)").format(sql.Identifier(schema, "canary"))
        )
    try:
        yield pg_url, schema
    finally:
        drop_schema(pg_url, schema)


def canary_rows(url: str, schema: str) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            sql.SQL("SELECT array_agg(id ORDER BY id) FROM {}").format(
                sql.Identifier(schema, "canary")
            )
        ).fetchone()


@pytest.mark.pg
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(name=hostile_names, option=st.sampled_from(NAME_OPTIONS))
def test_hostile_names_are_refused_at_construction(
    canary: tuple[str, str], name: str, option: str
) -> None:
    url, schema = canary
    for target in (UNREACHABLE, url):
        with pytest.raises(ConfigurationError, match=option):
            PostgresStore(target, **{option: name})
        with pytest.raises(ConfigurationError, match=option):
            open_store(target, **{option: name})
    if option != "schema":  # next to the canary's own schema, too
        with pytest.raises(ConfigurationError, match=option):
            PostgresStore(url, schema=schema, **{option: name})


@pytest.mark.pg
@settings(max_examples=50, deadline=None)
@given(prefix=st.text(max_size=70).filter(lambda p: not IDENTIFIER.match(p + "deliveries")))
def test_hostile_table_prefixes_are_refused(canary: tuple[str, str], prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="table_prefix"):
        PostgresStore(canary[0], table_prefix=prefix)


@pytest.mark.pg
def test_the_canary_is_intact(canary: tuple[str, str]) -> None:
    # Runs after the property tests in this module (file order).
    url, schema = canary
    assert canary_rows(url, schema) == ([1, 2, 3],)
    with psycopg.connect(url, autocommit=True) as conn:
        public = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'public'"
        ).fetchone()
    assert public == (1,)


def test_refused_before_any_connection() -> None:
    # No server needed: an unreachable one would fail differently had anything connected.
    for option in NAME_OPTIONS:
        with pytest.raises(ConfigurationError):
            PostgresStore(UNREACHABLE, **{option: 'x"; DROP TABLE canary; --'})
