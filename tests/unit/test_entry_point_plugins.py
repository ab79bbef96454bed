"""Entry-point plugins: an ``Outbox`` gets the ones with hooks of its own (an observer, enqueue
headers); the ones that only register stores stay with ``open_store``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, MemoryStore, ObserverEvent, Outbox, hookimpl
from outboxkit import plugins as plugin_module


class StoresOnly:
    @hookimpl
    def outboxkit_register_stores(self, register: Any) -> None:
        register("nothing", lambda url, **options: MemoryStore(), schemes=["nothing"])


class Watching:
    def __init__(self) -> None:
        self.seen: list[ObserverEvent] = []

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        self.seen.append(event)


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StoresOnly, Watching]]:
    stores, watching = StoresOnly(), Watching()
    found = (("stores-only", stores), ("watching", watching))
    monkeypatch.setattr(plugin_module, "_entry_point_plugins", lambda: found)
    plugin_module._entry_points_beyond_stores.cache_clear()
    yield stores, watching
    plugin_module._entry_points_beyond_stores.cache_clear()


def test_an_outbox_gets_the_entry_points_with_hooks_of_its_own(
    installed: tuple[StoresOnly, Watching],
) -> None:
    stores, watching = installed
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: None, name="noop")
    store = MemoryStore()
    outbox = Outbox(store, bus, clock=FrozenClock())
    for manager in (outbox.plugins, outbox.rebind(clock=FrozenClock()).plugins):
        assert manager.is_registered(watching)
        assert not manager.is_registered(stores)
    with store.transaction() as tx:
        outbox.enqueue(tx, "t", {})
    outbox.poller().run_once()
    assert [type(event).__name__ for event in watching.seen][-1] == "Published"


def test_open_store_still_gets_the_store_plugins(installed: tuple[StoresOnly, Watching]) -> None:
    stores, watching = installed
    manager = plugin_module.make_plugin_manager()
    assert manager.is_registered(stores) and manager.is_registered(watching)
    assert "nothing" in plugin_module.registered_stores(manager)
