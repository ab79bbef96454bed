"""The conformance suite against SQLite files, and ``:memory:``."""

from __future__ import annotations

from pathlib import Path

from outboxkit_conformance import StoreConformance
from outboxkit_sqlite import SQLiteStore


class TestSQLiteFileConformance(StoreConformance):
    def make_store(self, tmp_path: Path) -> SQLiteStore:
        return SQLiteStore(tmp_path / "outbox.db")


class TestSQLiteMemoryConformance(StoreConformance):
    def make_store(self, tmp_path: Path) -> SQLiteStore:
        return SQLiteStore(":memory:")
