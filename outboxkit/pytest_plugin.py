"""The outboxkit pytest plugin (entry point ``pytest11``, active once outboxkit is installed).

Kept small and lazy: nothing from outboxkit is imported until a fixture or hook needs it.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("outboxkit")
    group.addoption(
        "--outbox-store-factory",
        dest="outbox_store_factory",
        default=None,
        metavar="MODULE:FACTORY",
        help="the store factory the outboxkit conformance suite checks",
    )
