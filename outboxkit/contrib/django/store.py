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

The SQL, the token checks, the commit guard (PostgreSQL) and the error mapping are the stores'
own: ``_DjangoSQLite`` and ``_DjangoPostgres`` only say where their connection comes from and
how a transaction begins. On SQLite a transaction's first statement takes the write lock (a
no-op ``UPDATE``), so it waits for the lock (the connection's ``timeout``) instead of failing
with "database is locked" when a read snapshot would have to be upgraded.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outboxkit.core.model import (
    Claim,
    DeadKey,
    DeadLetter,
    DeliveryRecord,
    Event,
    Migration,
    NewEvent,
    Stats,
)
from outboxkit.errors import ConfigurationError, HandlerCrashed
from outboxkit.storekit import BatchBase, Capabilities, SettleItem, StoreBase
from outboxkit.waiter import ClosingWaiter
from outboxkit_sqlite.connections import retry_busy
from outboxkit_sqlite.delivery import Delivery as SQLiteDelivery
from outboxkit_sqlite.delivery import check_owned, handler_failure
from outboxkit_sqlite.dialect import SQLiteDialect
from outboxkit_sqlite.errors import map_error as map_sqlite_error
from outboxkit_sqlite.store import SQLiteStore
from outboxkit_sqlite.tables import TableNames

from .conf import config

if TYPE_CHECKING:
    from outboxkit.store import AsyncStore, BatchTransaction, DeliveryTransaction

__all__ = ["DjangoStore", "store"]

CAPABILITIES = Capabilities(
    batches=True,
    transactional_handlers=True,
    concurrent_claimers=True,  # each thread on its own Django connection
    ordering=True,
    dedupe=True,
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


def _django_connection(alias: str) -> Any:
    """This thread's ``DatabaseWrapper`` for ``alias``, connected."""
    from django.db import connections

    wrapper = connections[alias]
    wrapper.ensure_connection()
    return wrapper


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
        self._inner: _DjangoSQLite | _DjangoPostgres | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        if self._inner is not None:
            return repr(self._inner)
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
    def inner(self) -> _DjangoSQLite | _DjangoPostgres:
        """The SQLite or PostgreSQL store on Django's connection, made on first use."""
        if self._inner is None:
            with self._lock:
                if self._inner is None:
                    self._inner = _open(self.alias, self._options)
        return self._inner

    # -- what describes the store (read without touching Django) --------------------------------

    capabilities = CAPABILITIES
    url: str | None = None  # other processes open it through their own Django settings

    # -- the Store protocol, on the inner store --------------------------------------------------

    def migrate(self) -> Migration | None:
        return self.inner.migrate()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()

    def now(self) -> datetime:
        return self.inner.now()

    def transaction(self) -> AbstractContextManager[Any]:
        """Django's raw connection inside ``transaction.atomic(using=alias)``."""
        return self.inner.transaction()

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
        return self.inner.claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractContextManager[DeliveryTransaction]:
        return self.inner.delivery(claim, now=now)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        return self.inner.extend(claims, lease=lease, now=now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        return self.inner.settle_many(items, now=now)

    def batch(self, *, now: datetime | None) -> AbstractContextManager[BatchTransaction]:
        return self.inner.batch(now=now)

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
        self.inner.clear()


def _open(alias: str, options: Mapping[str, Any]) -> _DjangoSQLite | _DjangoPostgres:
    from django.db import connections

    if alias not in connections.settings:
        raise ConfigurationError(
            f"the Django store's database alias {alias!r} is not in settings.DATABASES "
            f"({sorted(connections.settings)})"
        )
    given = dict(options) if options else dict(config().store_options)
    vendor = connections[alias].vendor
    if vendor == "sqlite":
        return _DjangoSQLite(alias, **given)
    if vendor == "postgresql":
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            raise ConfigurationError(
                f"database {alias!r}: Django runs PostgreSQL on psycopg2 here; outboxkit needs "
                "psycopg 3 (pip install 'psycopg[binary]'; Django 4.2+ uses it when installed)"
            )
        return _DjangoPostgres(alias, **given)
    raise ConfigurationError(
        f"database {alias!r} uses Django's {vendor!r} backend; outboxkit's Django store runs "
        "on SQLite and PostgreSQL"
    )


# -- SQLite -------------------------------------------------------------------------------------


class _DjangoSQLiteDialect(SQLiteDialect):
    """The SQLite store's dialect on Django's connection (its own connections are never used):
    reads and writes in Django's atomic blocks."""

    def __init__(self, alias: str, database: str, tables: TableNames, **options: Any) -> None:
        super().__init__(None, tables, **options)
        self.connections.close()  # the placeholder's one in-memory connection
        self.memory = False
        self.alias = alias
        self.where = f"{database} (Django database {alias!r})"
        events = tables.events.replace('"', '""')
        # A write that changes nothing: the transaction's first statement takes the lock.
        self.take_lock = f'UPDATE "{events}" SET id = id WHERE 0'  # noqa: S608

    def raw(self) -> sqlite3.Connection:
        raw: sqlite3.Connection = _django_connection(self.alias).connection
        return raw

    def lock(self, raw: sqlite3.Connection) -> None:
        try:
            retry_busy(raw.execute, self.take_lock, busy_timeout=self.busy_timeout)
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):  # before the first migration: nothing to lock
                raise

    @contextmanager
    def atomic(self, doing: str, *, lock: bool) -> Iterator[sqlite3.Connection]:
        """Django's atomic block on the alias (a savepoint inside one), errors mapped."""
        from django.db import Error as DjangoError
        from django.db import transaction

        try:
            with self.mapped(doing), transaction.atomic(using=self.alias):
                raw = self.raw()
                if lock:
                    self.lock(raw)
                yield raw
        except DjangoError as exc:  # Django's commit or rollback failed
            if isinstance(exc.__cause__, sqlite3.Error):
                raise map_sqlite_error(exc.__cause__, self.where, doing) from exc
            raise

    def write(self, doing: str) -> AbstractContextManager[sqlite3.Connection]:  # type: ignore[override]
        return self.atomic(doing, lock=True)

    def read(self, doing: str) -> AbstractContextManager[sqlite3.Connection]:  # type: ignore[override]
        return self.atomic(doing, lock=False)


class _DjangoSQLite(SQLiteStore):
    """The SQLite store on Django's connection (``_DjangoSQLiteDialect``)."""

    dialect: _DjangoSQLiteDialect

    def __init__(self, alias: str, **options: Any) -> None:
        self.alias = alias
        wrapper = _django_connection(alias)
        self._name = str(wrapper.settings_dict["NAME"])
        if not wrapper.is_in_memory_db() and not wrapper.in_atomic_block:
            # As the SQLite store does to its file: readers never block the writer.
            wrapper.connection.execute("PRAGMA journal_mode=WAL")
        options.setdefault("migrate", False)  # the Django migration (or `outboxkit migrate`)
        super().__init__(":memory:", **options)
        self.url = None
        self.capabilities = CAPABILITIES

    def _open_dialect(
        self, path: Path | None, tables: TableNames, *, busy_timeout: float, wal_warn_bytes: int
    ) -> _DjangoSQLiteDialect:
        return _DjangoSQLiteDialect(
            self.alias,
            self._name,
            tables,
            busy_timeout=busy_timeout,
            wal_warn_bytes=wal_warn_bytes,
        )

    def __repr__(self) -> str:
        return f"DjangoStore(using={self.alias!r}, sqlite={self._name!r})"

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.dialect.atomic("run a transaction", lock=True) as raw:
            yield raw

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        _close_if_stale(self.alias)
        return super().claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[SQLiteDelivery]:
        with (
            self.dialect.atomic(f"deliver event {claim.event.id}", lock=True) as raw,
            _delivering(self, raw, claim, now) as tx,
        ):
            yield tx

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[_SQLiteBatch]:  # type: ignore[override]
        with self.dialect.atomic("run a batch", lock=True) as raw:
            yield _SQLiteBatch(self, raw)

    def clear(self) -> None:
        with self.dialect.write("clear the outbox tables") as raw:
            for table in (self.tables.deliveries, self.tables.events):
                raw.execute('DELETE FROM "{}"'.format(table.replace('"', '""')))  # noqa: S608


class _SQLiteBatch(BatchBase):
    """A batch on Django's connection: each delivery in a savepoint (a nested atomic); a
    relay's confirms recorded one delivery each, the settlement with ``settle_many``
    (``BatchBase``'s defaults)."""

    def __init__(self, store: _DjangoSQLite, conn: sqlite3.Connection) -> None:
        self._store = store
        self._conn = conn

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[SQLiteDelivery]:
        with (
            self._store.dialect.atomic(f"deliver event {claim.event.id}", lock=False) as raw,
            _delivering(self._store, raw, claim, now) as tx,
        ):
            yield tx

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        with self._store.dialect.mapped(f"extend {len(claims)} lease(s)"):
            return self._store.extend_on(self._conn, claims, lease, now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        if not items:
            return []
        with self._store.dialect.mapped(f"settle {len(items)} event(s)"):
            return self._store.settle_many_on(self._conn, items, now)


@contextmanager
def _delivering(
    store: _DjangoSQLite, conn: sqlite3.Connection, claim: Claim, now: datetime | None
) -> Iterator[SQLiteDelivery]:
    """The SQLite store's delivery inside Django's open transaction: the token check, the
    delivery, the check that the handler left the transaction open. Commits nothing."""
    dialect = store.dialect
    at = dialect.instant(now)
    check_owned(dialect, conn, claim)
    tx = SQLiteDelivery(dialect, conn, claim, at)
    marked = _marked(store.alias)
    try:
        yield tx
        _refuse_marked(store.alias, claim, marked)
        tx.check_open()
    except Exception as exc:
        instead = handler_failure(dialect, tx, claim, exc)
        if instead is None:
            raise
        raise instead from exc


def _marked(alias: str) -> bool:
    """Whether Django's atomic block on ``alias`` is marked for rollback (``needs_rollback``):
    a database error inside it that the code caught (an ORM ``IntegrityError``) leaves it so,
    and Django then rolls the block back when it ends, without raising."""
    from django.db import connections

    return bool(connections[alias].needs_rollback)


def _refuse_marked(alias: str, claim: Claim, before: bool) -> None:
    """R17: a delivery whose handler left Django's atomic block marked for rollback fails: its
    writes, and the record, would otherwise be rolled back silently when the block ends, and
    the event published as delivered.

    Raises:
        HandlerCrashed: the block is marked now and was not when the handler started.
    """
    if not before and _marked(alias):
        raise HandlerCrashed(
            f"event {claim.event.id}: the handler left Django's transaction marked for "
            "rollback (a database error it caught, such as an IntegrityError, inside the "
            "delivery's atomic block, or transaction.set_rollback(True)); nothing of this "
            "delivery was committed and it runs again. Wrap a write that may fail in its own "
            "transaction.atomic() block to recover from it inside the handler"
        )


def _close_if_stale(alias: str) -> None:
    """Between batches, what Django does between requests (``close_old_connections``): drop
    this thread's connection if it is broken or past ``CONN_MAX_AGE``."""
    from django.db import connections

    wrapper = connections[alias]
    if not wrapper.in_atomic_block:
        wrapper.close_if_unusable_or_obsolete()


# -- PostgreSQL ---------------------------------------------------------------------------------

try:
    from outboxkit_pg.delivery import Batch as _PGBatch
    from outboxkit_pg.delivery import Delivery as _PGDelivery
    from outboxkit_pg.delivery import delivering as _pg_delivering
    from outboxkit_pg.dialect import PostgresDialect as _PostgresDialect
    from outboxkit_pg.flow import check_usable as _pg_check_usable
    from outboxkit_pg.names import Names as _PGNames
    from outboxkit_pg.pool import Pool as _PGPool
    from outboxkit_pg.store import SCHEMA_VERSION as _PG_SCHEMA_VERSION
    from outboxkit_pg.store import PostgresStore as _PostgresStore
except ImportError:  # pragma: no cover - psycopg is not installed: SQLite only
    _PostgresStore = object  # type: ignore[assignment,misc]
    _PostgresDialect = object  # type: ignore[assignment,misc]
    _PGBatch = object  # type: ignore[assignment,misc]


class _DjangoPGDialect(_PostgresDialect):
    """The PostgreSQL dialect whose connection is Django's (its pool is never opened)."""

    def __init__(self, alias: str, pool: _PGPool, names: _PGNames, *, notify: bool) -> None:
        super().__init__(pool, names, notify=notify, schema_version=_PG_SCHEMA_VERSION)
        self.alias = alias

    @contextmanager
    def connection(self, doing: str, *, check_schema: bool = True) -> Iterator[Any]:
        """Django's connection: autocommit outside an atomic block (one statement, one
        transaction, as the store's own pool connections), the caller's transaction inside."""
        raw = _django_connection(self.alias).connection
        if check_schema and not self.schema_checked:
            self.check_schema(raw)
        yield raw


class _DjangoPostgres(_PostgresStore):
    """The PostgreSQL store on Django's psycopg 3 connection (its pool is never opened)."""

    dialect: _DjangoPGDialect

    def __init__(self, alias: str, **options: Any) -> None:
        from psycopg.conninfo import make_conninfo

        self.alias = alias
        settings = _django_connection(alias).settings_dict
        # For messages only (host, port, database, user; never the password): nothing connects.
        described = {
            "host": settings.get("HOST") or None,
            "port": str(settings["PORT"]) if settings.get("PORT") else None,
            "dbname": settings.get("NAME") or None,
            "user": settings.get("USER") or None,
        }
        conninfo = make_conninfo(**{k: v for k, v in described.items() if v is not None})
        options.setdefault("pool_min_size", 1)
        super().__init__(conninfo, **options)
        self.url = None
        self.capabilities = CAPABILITIES

    def __repr__(self) -> str:
        return f"DjangoStore(using={self.alias!r}, postgresql={self.where}, schema={self.names.schema!r})"

    def _make_dialect(self, pool: _PGPool, names: _PGNames, *, notify: bool) -> _DjangoPGDialect:
        return _DjangoPGDialect(self.alias, pool, names, notify=notify)

    def _raw(self) -> Any:
        return _django_connection(self.alias).connection

    @contextmanager
    def _atomic(self, doing: str) -> Iterator[Any]:
        import psycopg
        from django.db import Error as DjangoError
        from django.db import transaction

        try:
            with self.dialect.mapped(doing), transaction.atomic(using=self.alias):
                yield self._raw()
        except DjangoError as exc:  # Django's commit or rollback failed
            if isinstance(exc.__cause__, psycopg.Error):
                raise self.dialect.error(exc.__cause__, doing) from exc
            raise

    def migrate(self) -> Migration:
        from django.db import connections
        from psycopg.pq import TransactionStatus

        if connections[self.alias].in_atomic_block:
            # psycopg's transaction() must nest (a savepoint), not begin and commit on its own.
            with self._atomic("migrate the schema") as raw:
                if raw.info.transaction_status == TransactionStatus.IDLE:
                    raw.execute("SELECT 1")
                return super().migrate()
        return super().migrate()

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        with self._atomic("run a transaction") as raw:
            yield raw

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        _close_if_stale(self.alias)
        claims: list[Claim] = super().claim(
            batch_size=batch_size, lease=lease, now=now, dead_key=dead_key
        )
        return claims

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[_PGDelivery]:
        # A savepoint frame inside Django's transaction: Django commits (or rolls back) it,
        # and a delivery inside a test's transaction never commits that.
        with (
            self._atomic(f"deliver event {claim.event.id}") as raw,
            _pg_delivering(self.dialect, raw, claim, now, _DjangoPGBatch(self, raw)) as tx,
        ):
            _ = tx.connection  # opened (row locked, token checked) before the handler runs
            marked = _marked(self.alias)
            yield tx
            _refuse_marked(self.alias, claim, marked)

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[_DjangoPGBatch]:
        from psycopg.pq import TransactionStatus

        with self._atomic("run a batch") as raw:
            if raw.info.transaction_status == TransactionStatus.IDLE:
                raw.execute("SELECT 1")  # psycopg begins Django's transaction
            yield _DjangoPGBatch(self, raw)
            _pg_check_usable(raw, self.where, "the batch")

    def clear(self) -> None:
        from psycopg import sql

        with self._atomic("clear the outbox tables") as raw:
            for table in (self.names.deliveries, self.names.events):
                raw.execute(
                    sql.SQL("DELETE FROM {}.{}").format(
                        sql.Identifier(self.names.schema), sql.Identifier(table)
                    )
                )


class _DjangoPGBatch(_PGBatch):
    """The PostgreSQL batch whose deliveries open their savepoint before the handler runs,
    whatever it touches: the ORM writes on Django's connection, never through
    ``ctx.connection``, and they must be inside the delivery's savepoint."""

    store: _DjangoPostgres

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[_PGDelivery]:
        alias = self.store.alias
        marked = _marked(alias)
        try:
            with super().delivery(claim, now=now) as tx:
                _ = tx.connection
                yield tx
                _refuse_marked(alias, claim, marked)
        except Exception:
            if not marked and _marked(alias) and self.begun:
                # The delivery's savepoint was rolled back, and with it what the mark was
                # for: the batch's block is sound again (Django would roll all of it back).
                from django.db import transaction

                transaction.set_rollback(False, using=alias)
            raise
