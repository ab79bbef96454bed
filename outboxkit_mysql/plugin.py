"""Registers the MariaDB/MySQL store's URL schemes (``mysql://``, ``mariadb://``) through the
``outboxkit`` entry point. It imports no driver: PyMySQL is imported when a store is opened,
and a missing one is reported as ``MissingDependency`` ("install outboxkit[mysql]")."""

from __future__ import annotations

from outboxkit.storekit import RegisterStore, hookimpl
from outboxkit.storekit.plugin import StoreClass

__all__ = ["MYSQL_STORE"]

MYSQL_STORE = StoreClass(
    "outboxkit_mysql.store",
    "MySQLStore",
    drivers=("pymysql",),
    needs="PyMySQL",
    extra="mysql",
    what="the MySQL store",
)
"""``MySQLStore``, imported on first use: ``open_store("mysql://user:pass@host:3306/db")``
opens it (see ``MySQLStore.from_url``)."""


@hookimpl
def outboxkit_register_stores(register: RegisterStore) -> None:
    """Register ``mysql://`` and ``mariadb://``."""
    register("mysql", MYSQL_STORE.open, schemes=("mysql", "mariadb"))
