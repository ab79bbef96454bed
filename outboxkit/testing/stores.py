"""Stores for tests: ``open_test_store`` gives each test a fresh, migrated store.

SQLite tests copy one migrated template file per process instead of running the DDL for each
test; PostgreSQL tests get a schema of their own, dropped afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..core.text import redact_url
from ..errors import ConfigurationError
from ..plugins import open_store
from ..store import Store

__all__ = ["POSTGRES_SCHEMES", "open_test_store"]

POSTGRES_SCHEMES = frozenset({"postgresql", "postgres"})
"""The URL schemes that get a schema of their own per test."""


@contextlib.contextmanager
def open_test_store(url: str | None, tmp_path: Path, name: str = "test") -> Iterator[Store]:
    """A fresh, migrated store for one test; removed afterwards.

    ``None`` gives a SQLite file under ``tmp_path``; ``memory://`` an in-memory store; a
    ``postgresql://`` URL a schema of its own (named after ``name`` and the xdist worker),
    dropped at the end.

    Args:
        url: the store URL, or None for a SQLite file.
        tmp_path: the test's own folder (the SQLite file goes there).
        name: what the store is for (the test's node id); a PostgreSQL schema name derives
            from it.

    Yields:
        The migrated store; closed (its schema dropped, on PostgreSQL) when the block ends.

    Raises:
        UnknownStore: no store handles the URL's scheme.
        MissingDependency: the store's driver is not installed.
        ConfigurationError: a PostgreSQL URL opened something other than a ``PostgresStore``
            (its schema could not be dropped).
    """
    if url is None:
        path = tmp_path / "outbox.db"
        shutil.copyfile(_sqlite_template(), path)  # a migrated empty file: no DDL per test
        url = f"sqlite:///{path}"
    if url.split("://", 1)[0].lower() in POSTGRES_SCHEMES:
        with _postgres_test_store(url, name) as store:
            yield store
        return
    opened: Store = open_store(url)
    try:
        opened.migrate()
        yield opened
    finally:
        opened.close()


@contextlib.contextmanager
def _postgres_test_store(url: str, name: str) -> Iterator[Store]:
    """A PostgreSQL store on a schema of its own, dropped at the end."""
    store: Store = open_store(url, schema=_schema_name(name))
    # Imported here, not at the top: only a PostgreSQL URL needs the driver, and a missing one
    # was just reported by open_store as MissingDependency.
    from outboxkit_pg import PostgresStore

    if not isinstance(store, PostgresStore):
        store.close()
        raise ConfigurationError(
            f"{redact_url(url)!r} opened a {type(store).__name__}, not a PostgresStore: "
            "its test schema could not be dropped"
        )
    try:
        store.migrate()
        yield store
    finally:
        try:
            store.drop_schema()
        finally:
            store.close()


@functools.cache
def _sqlite_template() -> Path:
    """An empty, migrated SQLite outbox file, made once per process and copied for each test."""
    folder = Path(tempfile.mkdtemp(prefix="outboxkit-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "template.db"
    store: Store = open_store(f"sqlite:///{path}")
    try:
        store.migrate()
    finally:
        store.close()
    return path


def _schema_name(name: str) -> str:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    digest = hashlib.sha1(f"{name}\0{os.getpid()}\0{uuid.uuid4()}".encode()).hexdigest()[:12]
    return f"outboxkit_test_{worker}_{digest}"[:63]
