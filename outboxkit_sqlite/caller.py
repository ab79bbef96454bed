"""The app's connections: what ``enqueue`` writes through, and when it refuses to.

``enqueue`` never begins, commits or rolls back the app's transaction, so it writes only where
the event will commit or roll back with the app's own writes. The blocking store takes a
``sqlite3.Connection`` (or a ``sqlite_utils.Database``), the asyncio side an aiosqlite
connection; both are checked here, on the ``sqlite3.Connection`` underneath.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from outboxkit.errors import ConfigurationError

__all__ = ["app_connection", "writable"]

_HAS_AUTOCOMMIT = hasattr(sqlite3.Connection, "autocommit")  # Python 3.12+


def app_connection(conn: Any) -> sqlite3.Connection:
    """The ``sqlite3.Connection`` behind what the app passed to the blocking ``enqueue``, if it
    may write.

    Raises:
        ConfigurationError: not a SQLite connection, closed, or no transaction is (or will be)
            open.
    """
    if isinstance(conn, sqlite3.Connection):
        return writable(conn, wrapped=False)
    inner = getattr(conn, "conn", None)
    if not isinstance(inner, sqlite3.Connection):
        raise ConfigurationError(
            "the SQLite store enqueues through a sqlite3.Connection (or a "
            f"sqlite_utils.Database) in the app's open transaction, got {conn!r:.80}"
        )
    return writable(inner, wrapped=True)


def writable(raw: sqlite3.Connection, *, wrapped: bool) -> sqlite3.Connection:
    """``raw`` if an INSERT through it joins a transaction of the app's (``wrapped``: it belongs
    to a ``sqlite_utils.Database``).

    Raises:
        ConfigurationError: ``raw`` is closed, or no transaction is (or will be) open.
    """
    try:
        if raw.in_transaction:
            return raw
    except sqlite3.ProgrammingError as exc:
        raise ConfigurationError(f"enqueue got a closed SQLite connection: {exc}") from exc
    # No transaction is open. Python's legacy (default) handling opens one before our INSERT,
    # exactly as it would before the app's own INSERT, and leaves it to the app to commit; in
    # autocommit mode the INSERT would commit on its own, outside any transaction of the app's.
    # sqlite-utils commits every write made outside db.atomic(), so it needs an open one too.
    autocommit = getattr(raw, "autocommit", None) if _HAS_AUTOCOMMIT else None
    legacy = autocommit is None or autocommit == getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", -1)
    if legacy and raw.isolation_level is not None and not wrapped:
        return raw
    how = (
        "enqueue inside `with db.atomic():` (or after db.begin())"
        if wrapped
        else "run BEGIN first (isolation_level=None / autocommit=True), or use Python's "
        "default transaction handling or autocommit=False"
    )
    raise ConfigurationError(
        "enqueue needs an open transaction on the app's SQLite connection, so that the event "
        f"commits or rolls back with the app's writes; this one is in autocommit mode: {how}. "
        "Nothing was written."
    )
