"""The MariaDB/MySQL store for outboxkit (``mysql://user:pass@host:3306/db``), on PyMySQL.

Built only on the public store seam, ``outboxkit.storekit``. ``MySQLStore`` is imported on
first use: the entry point (``plugin``) loads this package in every process, with or without
PyMySQL installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import MySQLStore

__all__ = ["MySQLStore"]


def __getattr__(name: str) -> Any:
    if name == "MySQLStore":
        from .plugin import MYSQL_STORE

        return MYSQL_STORE.load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
