"""outboxkit on SQLAlchemy 2 (``pip install "outboxkit[sqlalchemy]"``).

- ``outbox.enqueue(session_or_connection, ...)``: a ``Session`` or ``Connection`` (and, with
  ``enqueue_async``, an ``AsyncSession`` or ``AsyncConnection``) carries the event in the ORM's
  own transaction, on any driver SQLAlchemy has for the store's database (psycopg 3, psycopg2,
  asyncpg; pysqlite, aiosqlite). ``ADAPTER`` does it; ``Outbox.enqueue`` finds it by itself.
- ``open_store(engine)``: a store on the engine's database; on PostgreSQL (``postgresql+psycopg``)
  it borrows the engine's pooled connections, so the app and the outbox share one pool.
- ``use_sessions(outbox, sessionmaker)``: handlers get ``ctx.session``, a session in the
  delivery transaction.
"""

from __future__ import annotations

from .adapter import ADAPTER, SQLAlchemyAdapter
from .engine import EnginePool, open_store
from .sessions import SessionFactory, use_sessions

__all__ = [
    "ADAPTER",
    "EnginePool",
    "SQLAlchemyAdapter",
    "SessionFactory",
    "open_store",
    "use_sessions",
]
