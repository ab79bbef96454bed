"""The suite as a test module: ``pytest --pyargs outboxkit_conformance --outbox-store-factory=M:F``."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from outboxkit import Store
from outboxkit_conformance import StoreConformance, call_factory, load_factory


class TestConformance(StoreConformance):
    _factory: Any = None

    @pytest.fixture(autouse=True)
    def _load_factory(self, request: pytest.FixtureRequest) -> None:
        spec = request.config.getoption("outbox_store_factory", None)
        if not spec:
            pytest.fail(
                "no store to check: pass --outbox-store-factory=module:factory", pytrace=False
            )
        try:
            self._factory = load_factory(spec)
        except ValueError as exc:
            pytest.fail(str(exc), pytrace=False)

    def _known_failures(self) -> Mapping[str, str]:
        return getattr(self._factory, "known_failures", None) or self.known_failures

    def make_store(self, tmp_path: Path) -> Store | AbstractContextManager[Store]:
        return call_factory(self._factory, tmp_path)
