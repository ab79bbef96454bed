"""The conformance suite against the in-memory reference store."""

from __future__ import annotations

from pathlib import Path

from outboxkit import MemoryStore
from outboxkit_conformance import StoreConformance


class TestMemoryConformance(StoreConformance):
    def make_store(self, tmp_path: Path) -> MemoryStore:
        return MemoryStore()
