"""Registers the MariaDB/MySQL store's URL schemes (``mysql://``, ``mariadb://``) through the
``outboxkit`` entry point. It imports no driver: PyMySQL is imported when a store is opened,
and a missing one is reported as ``MissingDependency`` ("install outboxkit[mysql]")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outboxkit.storekit import MissingDependency, RegisterStore, hookimpl

if TYPE_CHECKING:
    from .store import MySQLStore

__all__ = ["open_mysql_store"]


def open_mysql_store(url: str, **options: Any) -> MySQLStore:
    """``open_store("mysql://user:pass@host:3306/db", **options)``: see ``MySQLStore.from_url``.

    Raises:
        MissingDependency: PyMySQL is not installed.
        ConfigurationError: a bad URL or option.
    """
    try:
        from .store import MySQLStore
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "pymysql":
            raise
        raise MissingDependency(
            "the MySQL store needs PyMySQL (pymysql is missing): install outboxkit[mysql]"
        ) from exc
    return MySQLStore.from_url(url, **options)


@hookimpl
def outboxkit_register_stores(register: RegisterStore) -> None:
    """Register ``mysql://`` and ``mariadb://``."""
    register("mysql", open_mysql_store, schemes=("mysql", "mariadb"))
