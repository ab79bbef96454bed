"""The in-memory store (``memory://``): a real, transactional implementation of the store seam,
for unit tests of apps without a database of their own, and the reference the conformance suite
is written against (see ``store``)."""

from __future__ import annotations

from ..hookspecs import RegisterStore, hookimpl
from .store import MemoryStore
from .transaction import MemoryTransaction

__all__ = ["MemoryStore", "MemoryTransaction", "plugin"]


class _MemoryPlugin:
    """The memory store's registration; the ``outboxkit`` entry point names ``plugin``.

    A small object rather than this module, so registering it scans a handful of names.
    """

    @staticmethod
    @hookimpl
    def outboxkit_register_stores(register: RegisterStore) -> None:
        """Register ``memory://``."""
        register("memory", MemoryStore.from_url, schemes=("memory",))


plugin = _MemoryPlugin()
