"""Registers the Postgres store's URL schemes (``postgresql://``, ``postgres://``).

Loaded through the ``outboxkit`` entry point in every process that opens a store, so it imports
no driver: psycopg is imported when a Postgres store is opened, and a missing one is reported
as ``MissingDependency`` ("install outboxkit[pg]").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outboxkit.errors import MissingDependency
from outboxkit.hookspecs import RegisterStore, hookimpl

if TYPE_CHECKING:
    from .store import PostgresStore

__all__ = ["load_store_class", "open_postgres_store"]

_DRIVERS = frozenset({"psycopg", "psycopg_pool"})


def load_store_class() -> type[PostgresStore]:
    """``PostgresStore``, importing psycopg.

    Raises:
        MissingDependency: psycopg 3 or psycopg-pool is not installed.
    """
    try:
        from .store import PostgresStore
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in _DRIVERS:
            raise
        raise MissingDependency(
            f"the PostgreSQL store needs psycopg 3 and psycopg-pool ({exc.name} is missing): "
            "install outboxkit[pg]"
        ) from exc
    return PostgresStore


def open_postgres_store(url: str, **options: Any) -> PostgresStore:
    """``open_store("postgresql://...", **options)``: see ``PostgresStore.from_url``.

    Raises:
        MissingDependency: psycopg 3 or psycopg-pool is not installed.
        ConfigurationError: a bad URL or option.
    """
    return load_store_class().from_url(url, **options)


@hookimpl
def outboxkit_register_stores(register: RegisterStore) -> None:
    """Register ``postgresql://`` and ``postgres://``."""
    register("postgres", open_postgres_store, schemes=("postgresql", "postgres"))
