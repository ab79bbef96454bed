"""Integrations with the frameworks apps reach their database through: ``sqlalchemy`` and
``django`` (each needs its own extra or framework installed; nothing here imports either).

``Outbox.enqueue`` hands a framework's connection or session (a SQLAlchemy ``Session``, a
Django connection) to the integration that knows it: ``adapter_for`` finds it by the package
the object's class comes from, importing the integration only then, so an app that never passes
one pays a dictionary lookup and imports nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..core.model import NewEvent
    from ..store import Store

__all__ = ["ADAPTERS", "ConnectionAdapter", "adapter_for", "integration_for"]


class ConnectionAdapter(Protocol):
    """How events are written through a framework's connection or session, in its open
    transaction: never beginning, committing or rolling it back (R1)."""

    def enqueue(
        self, store: Store, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """Write ``events`` through ``conn``; their ids, in order.

        Raises:
            ConfigurationError: ``conn`` cannot carry events to ``store`` (another database, no
                open transaction, a driver it cannot use), naming what to do; nothing written.
            StoreError: the database failed.
        """
        ...

    async def enqueue_async(
        self, store: Store, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """``enqueue`` through an async connection or session."""
        ...

    def on_commit(self, conn: Any, callback: Callable[[], None]) -> None:
        """Call ``callback`` when ``conn``'s transaction commits (never if it rolls back),
        or now when the framework cannot tell: how an enqueue wakes this process's pollers."""
        ...


ADAPTERS = {
    "sqlalchemy": "outboxkit.contrib.sqlalchemy",
    "django": "outboxkit.contrib.django.adapter",
}
"""The top-level package of a connection's class -> the module whose ``ADAPTER`` writes
through it."""


def adapter_for(conn: object) -> ConnectionAdapter | None:
    """The adapter for a framework's connection or session, or None for anything else (a
    driver's own connection, a ``MemoryTransaction``: the store takes those itself)."""
    module = ADAPTERS.get(type(conn).__module__.partition(".")[0])
    if module is None:
        return None
    adapter: ConnectionAdapter = importlib.import_module(module).ADAPTER
    return adapter


def integration_for(obj: object) -> Any:
    """The integration module for a framework's object (a SQLAlchemy ``Engine``...), imported
    now, or None when its class comes from no framework outboxkit integrates with."""
    module = ADAPTERS.get(type(obj).__module__.partition(".")[0])
    return None if module is None else importlib.import_module(module)
