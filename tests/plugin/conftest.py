"""Fixtures of the test kit's tests: ``app``, the sample app in a pytester folder."""

from __future__ import annotations

import pytest

from tests.plugin.sample import HELPERS, SAMPLE_APP, STORE_ARGS, STORE_CLASS, store_args

SQLITE_AND_PG = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("pg", id="pg", marks=pytest.mark.pg),
]


@pytest.fixture(params=SQLITE_AND_PG)
def app(request: pytest.FixtureRequest, pytester: pytest.Pytester) -> pytest.Pytester:
    """The sample app, its ini, and the store: the default SQLite file per test, or PostgreSQL
    through ``--outbox-store`` (a schema per test, dropped afterwards)."""
    return make_app(request.param, pytester)


@pytest.fixture(params=[pytest.param("memory", id="memory"), *SQLITE_AND_PG])
def any_app(request: pytest.FixtureRequest, pytester: pytest.Pytester) -> pytest.Pytester:
    """``app`` on each of the three stores: ``memory://``, a SQLite file, PostgreSQL."""
    return make_app(request.param, pytester)


@pytest.fixture
def app_pg(pytester: pytest.Pytester) -> pytest.Pytester:
    """``app`` on PostgreSQL only."""
    return make_app("pg", pytester)


@pytest.fixture
def app_memory(pytester: pytest.Pytester) -> pytest.Pytester:
    """``app`` on ``memory://`` only."""
    return make_app("memory", pytester)


def make_app(backend: str, pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(myapp=SAMPLE_APP, apphelpers=HELPERS)
    pytester.makeini(
        """
        [pytest]
        outboxkit_app = myapp:outbox
        filterwarnings = error
        asyncio_default_fixture_loop_scope = function
        """
    )
    pytester.syspathinsert()
    STORE_ARGS[id(pytester)] = store_args(backend)
    STORE_CLASS[id(pytester)] = {
        "memory": "MemoryStore",
        "sqlite": "SQLiteStore",
        "pg": "PostgresStore",
    }[backend]
    return pytester
