"""The pytest plugin's earlier module name, kept as an alias: it lives in
``outboxkit.testing.pytest_plugin`` (the ``pytest11`` entry point names that one)."""

from __future__ import annotations

from .testing.pytest_plugin import (
    outbox,
    outbox_clock,
    outbox_drain,
    outbox_store,
    pytest_addoption,
    pytest_assertrepr_compare,
    pytest_configure,
    pytest_unconfigure,
)

__all__ = [
    "outbox",
    "outbox_clock",
    "outbox_drain",
    "outbox_store",
    "pytest_addoption",
    "pytest_assertrepr_compare",
    "pytest_configure",
    "pytest_unconfigure",
]
