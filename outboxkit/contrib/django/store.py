"""The Django store: outboxkit's SQLite or PostgreSQL store, run on Django's own connection.

``DjangoStore(using)`` picks the store for the alias's backend when first used (so an app may
build its ``Outbox`` at import time, before settings are ready) and feeds it the connection
Django holds for that alias in the calling thread: no second set of credentials, no
connection of outboxkit's own. Every step runs there, in a ``transaction.atomic(using=...)``
block of Django's:

- outside any atomic block (a poller's thread) that block is the transaction: the delivery
  transaction is Django's, so a handler's ORM writes and its ``transaction.atomic()`` blocks
  (savepoints) commit or roll back with the delivery record;
- inside one (a test under pytest-django's ``db`` fixture, a Django migration) it is a
  savepoint of it, so the test's own uncommitted rows and events are what the drain sees.

The Django store is made by composition: it holds a plain ``SQLiteStore`` or ``PostgresStore``
(``inner``) built on a dialect of its own (the stores' public ``dialect=`` / ``make_dialect=``
seam), which says where the connection comes from and how a transaction begins; the SQL, the
token checks, the commit guard (PostgreSQL) and the error mapping are the stores' own. What is
Django's (its atomic blocks around a delivery or a batch, the ``needs_rollback`` mark, closing a
stale connection between batches) is in ``sqlite.OnSQLite`` and ``postgres.OnPostgres``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from outboxkit.core.model import (
    AttemptError,
    Claim,
    DeadKey,
    DeadLetter,
    DeliveryRecord,
    Event,
    Migration,
    NewEvent,
    Stats,
)
from outboxkit.errors import ConfigurationError
from outboxkit.storekit import Capabilities, SettleItem, StoreBase
from outboxkit.waiter import ClosingWaiter

from .conf import config
from .connection import close_if_stale
from .sqlite import OnSQLite

if TYPE_CHECKING:
    from outboxkit.store import AsyncStore, BatchTransaction, DeliveryTransaction
    from outboxkit_pg.store import PostgresStore
    from outboxkit_sqlite.store import SQLiteStore

    from .postgres import OnPostgres

__all__ = ["DjangoStore", "store"]

CAPABILITIES = Capabilities(
    batches=True,
    transactional_handlers=True,
    concurrent_claimers=True,  # each thread on its own Django connection
    ordering=True,
    dedupe=True,
    error_history=True,
)


def store(using: str | None = None, **options: Any) -> DjangoStore:
    """The store for an app's ``Outbox``, on Django's connection for ``using`` (default:
    ``settings.OUTBOXKIT["DATABASE"]``, else ``"default"``). Nothing is read or connected until
    first use: build the ``Outbox`` at import time.

    Args:
        using: the database alias.
        **options: store options (``table_prefix``; on PostgreSQL ``schema``...); default:
            ``settings.OUTBOXKIT["STORE_OPTIONS"]``.
    """
    return DjangoStore(using, **options)


class DjangoStore(StoreBase):
    """A ``Store`` on Django's connection for one database alias (see the module docstring).

    Its per-event rounds are the store itself (``StoreBase.rounds``): every delivery runs in
    Django's atomic block on the calling thread's connection.

    Raises (on first use):
        ConfigurationError: the alias is unknown, its backend is neither SQLite nor PostgreSQL
            on psycopg 3, or a store option is wrong.
    """

    def __init__(self, using: str | None = None, **options: Any) -> None:
        if using is not None and not isinstance(using, str):
            raise ConfigurationError(f"using must be a database alias (str), got {using!r}")
        self._using = using
        self._options = options
        self.options: Mapping[str, Any] = dict(options)
        self._backend: OnSQLite | OnPostgres | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        if self._backend is not None:
            return repr(self._backend)
        return f"DjangoStore(using={self._using or 'settings.OUTBOXKIT'!r})"

    @property
    def alias(self) -> str:
        """The database alias (``using``, else ``settings.OUTBOXKIT["DATABASE"]``)."""
        return self._using if self._using is not None else config().database

    @property
    def django_alias(self) -> str:
        """The alias, under the name the enqueue adapter knows a Django store by."""
        return self.alias

    @property
    def backend(self) -> OnSQLite | OnPostgres:
        """What is Django's about the store for the alias's vendor, made on first use."""
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = _open(self.alias, self._options)
        return self._backend

    @property
    def inner(self) -> SQLiteStore | PostgresStore:
        """The SQLite or PostgreSQL store on Django's connection, made on first use."""
        return self.backend.sql

    # -- what describes the store (read without touching Django) --------------------------------

    capabilities = CAPABILITIES
    url: str | None = None  # other processes open it through their own Django settings

    # -- the Store protocol, on the inner store --------------------------------------------------

    def migrate(self) -> Migration | None:
        return self.backend.migrate()

    def close(self) -> None:
        if self._backend is not None:
            self._backend.sql.close()

    def now(self) -> datetime:
        return self.inner.now()

    def transaction(self) -> AbstractContextManager[Any]:
        """Django's raw connection inside ``transaction.atomic(using=alias)``."""
        return self.backend.transaction()

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        """Through Django's connection (``connection``, ``connections[alias]``) inside
        ``transaction.atomic()``, or the raw connection ``transaction()`` yields."""
        if type(conn).__module__.partition(".")[0] == "django":
            from .adapter import ADAPTER

            return ADAPTER.enqueue(self, conn, events, now=now)
        return self.inner.enqueue(conn, events, now=now)

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        close_if_stale(self.alias)
        return self.inner.claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractContextManager[DeliveryTransaction]:
        return self.backend.delivery(claim, now=now)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        return self.inner.extend(claims, lease=lease, now=now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        return self.inner.settle_many(items, now=now)

    def batch(self, *, now: datetime | None) -> AbstractContextManager[BatchTransaction]:
        return self.backend.batch(now=now)

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        return self.inner.release(claims, now=now)

    def make_waiter(self) -> ClosingWaiter | None:
        return None  # pollers poll every interval; an enqueue in the same process wakes them

    def async_store(self) -> AsyncStore:
        raise ConfigurationError(
            "the Django store has no asyncio side: Django's connections are blocking; enqueue "
            "with outbox.enqueue() inside transaction.atomic() (from async code, in a function "
            "run by asgiref's sync_to_async) and run the blocking poller"
        )

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        return self.inner.requeue(ids, now=now)

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        return self.inner.dead_letters(topic=topic, since=since, limit=limit)

    def get(self, event_id: int) -> Event | None:
        return self.inner.get(event_id)

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        return self.inner.events(after_id=after_id, topic=topic, limit=limit)

    def records(self, event_id: int) -> list[DeliveryRecord]:
        return self.inner.records(event_id)

    def attempt_errors(self, event_id: int) -> list[AttemptError]:
        return self.inner.attempt_errors(event_id)

    def purge_published(self, *, before: datetime, limit: int) -> int:
        return self.inner.purge_published(before=before, limit=limit)

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        return self.inner.purge_dead(ids=ids, before=before, limit=limit)

    def stats(self, *, now: datetime | None) -> Stats:
        return self.inner.stats(now=now)

    def clear(self) -> None:
        """Delete every event and delivery record (the test kit, after a ``transactional_db``
        test: the outbox tables are not Django models, so Django's flush leaves them)."""
        self.backend.clear()


def _open(alias: str, options: Mapping[str, Any]) -> OnSQLite | OnPostgres:
    from django.db import connections

    if alias not in connections.settings:
        raise ConfigurationError(
            f"the Django store's database alias {alias!r} is not in settings.DATABASES "
            f"({sorted(connections.settings)})"
        )
    given = dict(options) if options else dict(config().store_options)
    vendor = connections[alias].vendor
    if vendor == "sqlite":
        return OnSQLite(alias, **given)
    if vendor == "postgresql":
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            raise ConfigurationError(
                f"database {alias!r}: Django runs PostgreSQL on psycopg2 here; outboxkit needs "
                "psycopg 3 (pip install 'psycopg[binary]'; Django 4.2+ uses it when installed)"
            )
        from .postgres import OnPostgres

        return OnPostgres(alias, **given)
    raise ConfigurationError(
        f"database {alias!r} uses Django's {vendor!r} backend; outboxkit's Django store runs "
        "on SQLite and PostgreSQL"
    )
