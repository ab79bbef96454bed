"""Registers the Postgres store's URL schemes (``postgresql://``, ``postgres://``).

Loaded through the ``outboxkit`` entry point in every process that opens a store, so it imports
no driver: psycopg is imported when a Postgres store is opened, and a missing one is reported
as ``MissingDependency`` ("install outboxkit[pg]").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outboxkit.hookspecs import RegisterStore, hookimpl
from outboxkit.storekit.plugin import StoreClass

if TYPE_CHECKING:
    from .store import PostgresStore

__all__ = ["POSTGRES_STORE", "load_store_class", "open_postgres_store"]

POSTGRES_STORE = StoreClass(
    "outboxkit_pg.store",
    "PostgresStore",
    drivers=("psycopg", "psycopg_pool"),
    needs="psycopg 3 and psycopg-pool",
    extra="pg",
    what="the PostgreSQL store",
)


def load_store_class() -> type[PostgresStore]:
    """``PostgresStore``, importing psycopg.

    Raises:
        MissingDependency: psycopg 3 or psycopg-pool is not installed.
    """
    store: type[PostgresStore] = POSTGRES_STORE.load()
    return store


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
