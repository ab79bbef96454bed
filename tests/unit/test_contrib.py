"""``Outbox.enqueue`` hands a framework's connection to its adapter, found by the package of
its class; anything else goes to the store as before."""

from __future__ import annotations

import sqlite3
import sys
import types
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import pytest

from outboxkit import MemoryStore, Outbox, Store, contrib
from outboxkit.core.model import NewEvent


class _Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def enqueue(
        self, store: Store, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        self.calls.append(("sync", [e.topic for e in events]))
        return list(range(1, len(events) + 1))

    async def enqueue_async(
        self, store: Store, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        self.calls.append(("async", [e.topic for e in events]))
        return list(range(1, len(events) + 1))


@pytest.fixture
def framework(monkeypatch: pytest.MonkeyPatch) -> tuple[type, _Recording]:
    """A framework package ``okframework`` whose connections an adapter module takes."""
    adapter = _Recording()
    module = types.ModuleType("okframework_adapter")
    module.ADAPTER = adapter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "okframework_adapter", module)
    monkeypatch.setitem(contrib.ADAPTERS, "okframework", "okframework_adapter")
    connection = type("Connection", (), {"__module__": "okframework.engine"})
    return connection, adapter


def test_a_frameworks_connection_goes_to_its_adapter(framework: tuple[type, _Recording]) -> None:
    connection, adapter = framework
    outbox = Outbox(MemoryStore())
    assert outbox.enqueue(connection(), "a", {}) == 1
    assert outbox.enqueue_many(connection(), [("b", 1), ("c", 2)]) == [1, 2]
    assert adapter.calls == [("sync", ["a"]), ("sync", ["b", "c"])]
    assert outbox.store.stats(now=None).total == 0  # nothing went to the store itself


@pytest.mark.asyncio
async def test_async_enqueues_go_to_its_adapter_too(framework: tuple[type, _Recording]) -> None:
    connection, adapter = framework
    outbox = Outbox(MemoryStore())
    assert await outbox.enqueue_async(connection(), "a", {}) == 1
    assert await outbox.enqueue_many_async(connection(), [("b", 1)]) == [1]
    assert adapter.calls == [("async", ["a"]), ("async", ["b"])]


def test_drivers_and_the_memory_transaction_have_no_adapter() -> None:
    store = MemoryStore()
    with store.transaction() as tx:
        assert contrib.adapter_for(tx) is None
    raw = sqlite3.connect(":memory:")
    try:
        assert contrib.adapter_for(raw) is None
    finally:
        raw.close()
    assert contrib.adapter_for(object()) is None
