"""SQLite's errors as outboxkit's: a table keyed by SQLite's result-code names.

``sqlite3`` errors carry ``sqlite_errorname`` (``SQLITE_BUSY``, ``SQLITE_IOERR_SHORT_READ``...);
the longest prefix in ``CODES`` decides the class. A missing table is a generic ``SQLITE_ERROR``,
told apart by its message. Messages name the database file and what was being done.
"""

from __future__ import annotations

import sqlite3

from outboxkit.errors import (
    ConfigurationError,
    SchemaError,
    StoreError,
    StoreUnavailable,
    chain,
    migrate_hint,
)

__all__ = [
    "CODES",
    "DATABASE_FAILED",
    "UNUSABLE_AT_OPEN",
    "database_failure",
    "error_name",
    "is_busy",
    "map_error",
    "open_error",
]

CODES: dict[str, type[StoreError]] = {
    "SQLITE_BUSY": StoreUnavailable,  # another connection holds the write lock past busy_timeout
    "SQLITE_LOCKED": StoreUnavailable,  # a table lock within this process
    "SQLITE_IOERR": StoreUnavailable,  # the disk (or the file system) failed
    "SQLITE_FULL": StoreUnavailable,  # the disk is full, or max_page_count reached
    "SQLITE_CANTOPEN": StoreUnavailable,  # the file (or its -wal/-shm) cannot be opened
    "SQLITE_CORRUPT": StoreError,  # a damaged file: no retry helps
    "SQLITE_NOTADB": StoreError,
}
"""Result-code name (prefix) -> the outboxkit error it is."""

DATABASE_FAILED = (
    "SQLITE_FULL",
    "SQLITE_IOERR",
    "SQLITE_CORRUPT",
    "SQLITE_NOTADB",
    "SQLITE_CANTOPEN",
)
"""Result codes that say the database file itself failed: never a handler's own doing."""

UNUSABLE_AT_OPEN = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_NOTADB", "SQLITE_PERM")
"""At open, these mean the path is wrong for a store: a ``ConfigurationError``, not an outage."""


def error_name(exc: sqlite3.Error) -> str:
    return str(getattr(exc, "sqlite_errorname", "") or "")


def is_busy(exc: sqlite3.Error) -> bool:
    name = error_name(exc)
    if name:
        return name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED"))
    return "locked" in str(exc) or "busy" in str(exc)


def map_error(exc: sqlite3.Error, where: str, doing: str) -> StoreError:
    """The outboxkit error for ``exc``, raised while doing ``doing`` on the file ``where``."""
    message = f"SQLite store {where}: cannot {doing}: {exc}"
    if isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
        return StoreError(f"SQLite store {where}: the connection is closed: {exc}")
    if isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc):
        return SchemaError(f"{message} (no outboxkit schema: {migrate_hint()})")
    name = error_name(exc)
    for prefix in sorted(CODES, key=len, reverse=True):
        if name.startswith(prefix):
            return CODES[prefix](message)
    if is_busy(exc):
        return StoreUnavailable(message)
    return StoreError(message)


def open_error(exc: sqlite3.Error, where: str) -> ConfigurationError | StoreError:
    """The error for a database that cannot be opened at all."""
    if error_name(exc).startswith(UNUSABLE_AT_OPEN) or "unable to open" in str(exc):
        return ConfigurationError(
            f"cannot use the SQLite database {where}: {exc} (outboxkit needs to read and write "
            "the file and to create its -wal and -shm files beside it)"
        )
    return map_error(exc, where, "open the database")


def database_failure(exc: BaseException) -> sqlite3.Error | None:
    """The ``sqlite3`` error in ``exc``'s chain that says the database file failed, if any."""
    for cause in chain(exc):
        if isinstance(cause, sqlite3.Error) and error_name(cause).startswith(DATABASE_FAILED):
            return cause
    return None
