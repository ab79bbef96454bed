"""Store targets for tests that run the same scenario on several stores (CLI, operations).

A target is a store URL plus options, so it can be opened here and handed to the ``outboxkit``
command or to a subprocess. PostgreSQL comes from the Postgres tests' own helpers
(``tests/integration/pg/conftest.py``): the server named by ``OUTBOXKIT_TEST_PG``, a fresh schema
per test (dropped afterwards), skipped when the server cannot be reached unless
``OUTBOXKIT_REQUIRE_PG=1`` (then the test fails). MariaDB/MySQL likewise from
``tests/integration/mysql/server.py`` (``OUTBOXKIT_TEST_MYSQL``, a database per test,
``OUTBOXKIT_REQUIRE_MYSQL=1``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from outboxkit import Store, open_store

SQL_BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("pg", id="pg", marks=pytest.mark.pg),
    pytest.param("mysql", id="mysql", marks=pytest.mark.mysql),
]
ALL_BACKENDS = [pytest.param("memory", id="memory"), *SQL_BACKENDS]


@dataclass(frozen=True)
class Target:
    """Where a test's events live: ``open_store(url, **options)``."""

    backend: str
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def open(self) -> Store:
        store: Store = open_store(self.url, **self.options)
        return store

    def cli_args(self) -> list[str]:
        """``--store URL`` and one ``--store-option`` per option."""
        args = ["--store", self.url]
        for key, value in self.options.items():
            args += ["--store-option", f"{key}={value}"]
        return args

    def option_args(self) -> list[str]:
        """Only the ``--store-option`` arguments (with the URL coming from the environment)."""
        return self.cli_args()[2:]

    def app_env(self) -> dict[str, str]:
        """The environment the test apps (``tests/cli/apps.py``) read their own store from."""
        return {
            "CLI_TEST_STORE": self.url,
            "CLI_TEST_STORE_OPTIONS": json.dumps(dict(self.options)),
        }


@contextmanager
def open_target(backend: str, tmp_path: Path) -> Iterator[Target]:
    """A target with no schema yet (SQLite creates it on open; Postgres needs ``migrate``)."""
    if backend == "memory":
        yield Target("memory", "memory://")
    elif backend == "sqlite":
        # An option too, so that --store-option is exercised on both stores.
        url = f"sqlite:///{(tmp_path / 'outbox.db').as_posix()}"
        yield Target("sqlite", url, {"busy_timeout": 10})
    elif backend == "pg":
        from tests.integration.pg import conftest as pg

        url = pg.test_url(pg.pg_url_from_env())
        pg.require_server(url)
        with pg.fresh_schema(url, "okcli") as schema:
            yield Target("pg", url, {"schema": schema})
    elif backend == "mysql":
        from tests.integration.mysql import server as mysql

        with mysql.fresh_database(prefix="okcli") as url:
            yield Target("mysql", url, {"pool_size": 4})
    else:  # pragma: no cover
        raise ValueError(backend)


@contextmanager
def migrated_store(backend: str, tmp_path: Path) -> Iterator[Store]:
    """An opened, migrated store of ``backend`` (``open_target``), closed afterwards."""
    with open_target(backend, tmp_path) as target:
        store = target.open()
        try:
            store.migrate()
            yield store
        finally:
            store.close()
