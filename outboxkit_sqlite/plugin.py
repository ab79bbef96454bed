"""Registers the SQLite store's URL scheme (``sqlite://``) through the ``outboxkit`` entry point."""

from __future__ import annotations

from typing import Any

from outboxkit.hookspecs import RegisterStore, hookimpl


def open_sqlite_store(url: str, **options: Any) -> Any:
    """``open_store("sqlite:///path.db", **options)``: see ``SQLiteStore.from_url``."""
    from .store import SQLiteStore

    return SQLiteStore.from_url(url, **options)


@hookimpl
def outboxkit_register_stores(register: RegisterStore) -> None:
    """Register ``sqlite://``."""
    register("sqlite", open_sqlite_store, schemes=("sqlite",))
