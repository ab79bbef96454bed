"""Fixtures of the test kit's tests: ``app``, the sample app in a pytester folder."""

from __future__ import annotations

import pytest

from tests.plugin.sample import HELPERS, SAMPLE_APP, STORE_ARGS, STORE_CLASS, store_args


@pytest.fixture(
    params=[pytest.param("sqlite", id="sqlite"), pytest.param("pg", id="pg", marks=pytest.mark.pg)]
)
def app(request: pytest.FixtureRequest, pytester: pytest.Pytester) -> pytest.Pytester:
    """The sample app, its ini, and the store: the default SQLite file per test, or PostgreSQL
    through ``--outbox-store`` (a schema per test, dropped afterwards)."""
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
    STORE_ARGS[id(pytester)] = store_args(request.param)
    STORE_CLASS[id(pytester)] = {"sqlite": "SQLiteStore", "pg": "PostgresStore"}[request.param]
    return pytester
