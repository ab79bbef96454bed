"""The PostgreSQL store for outboxkit (psycopg 3). Install with ``pip install outboxkit[pg]``.

``import outboxkit_pg`` works without psycopg; ``PostgresStore`` imports it on first access::

    from outboxkit_pg import PostgresStore

    store = PostgresStore("postgresql://app@db.example/app", schema="outbox")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import PostgresStore

__all__ = ["PostgresStore"]


def __getattr__(name: str) -> Any:
    if name == "PostgresStore":
        from .plugin import load_store_class

        return load_store_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
