"""The conformance suite against MariaDB/MySQL, every test in a database of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outboxkit_conformance import StoreConformance

from .server import make_store


class TestMySQLConformance(StoreConformance):
    def make_store(self, tmp_path: Path) -> Any:
        return make_store(tmp_path)
