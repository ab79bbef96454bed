"""The SQLite store for outboxkit: the embedded default (``sqlite:///path/to/app.db``).

One file, no server; several poller processes on one machine may share it. See ``SQLiteStore``;
its asyncio side, on aiosqlite (``SQLiteStore.async_store()``), is ``outboxkit_sqlite.aio``.
"""

from __future__ import annotations

from .store import SQLiteStore

__all__ = ["SQLiteStore"]
