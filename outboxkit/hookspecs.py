"""The pluggy hook specifications. Every hook is prefixed ``outboxkit_``.

Plugins are found through the ``outboxkit`` entry-point group (the built-in stores register the
same way as third-party ones) or registered on an ``Outbox`` directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import pluggy

from .core.model import Event, ObserverEvent

__all__ = ["PROJECT", "RegisterStore", "StoreFactory", "hookimpl", "hookspec"]

PROJECT = "outboxkit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

StoreFactory = Callable[..., Any]
"""``factory(url: str, **options) -> Store``."""

RegisterStore = Callable[..., None]
"""``register(name: str, factory: StoreFactory, *, schemes: tuple[str, ...])``."""


@hookspec
def outboxkit_register_stores(register: RegisterStore) -> None:
    """Register store factories: call ``register(name, factory, schemes=(...))`` for each."""


@hookspec
def outboxkit_on_event(event: ObserverEvent) -> None:
    """Observe a lifecycle event (Claimed, Published, DeadLettered, ...); must not raise."""


@hookspec
def outboxkit_enqueue_headers(topic: str, headers: Mapping[str, str]) -> Mapping[str, str] | None:
    """Headers to add to an event being enqueued (``headers``: the caller's, which win)."""


@hookspec
def outboxkit_handler_scope(
    event: Event, handler: str, attempt: int, batched: bool
) -> AbstractContextManager[object] | None:
    """A context manager entered around one handler's run; it sees the handler's exception."""
