"""Fixtures shared by the SQLite tests of the app's transactions (blocking and asyncio)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from outboxkit_sqlite import SQLiteStore


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "app.db"


@pytest.fixture
def store(path: Path) -> Iterator[SQLiteStore]:
    """A store on ``path``, the file also holding the app's ``orders`` and ``ledger`` tables."""
    with SQLiteStore(path) as store:
        with closing(sqlite3.connect(path)) as conn, conn:
            conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)")
            conn.execute("CREATE TABLE ledger (event_id INTEGER NOT NULL, handler TEXT NOT NULL)")
        yield store
