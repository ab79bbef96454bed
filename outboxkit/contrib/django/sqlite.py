"""The Django store on SQLite: outboxkit's ``SQLiteStore`` on a dialect whose connection is
Django's, and Django's atomic blocks around its deliveries and batches. On SQLite a
transaction's first statement takes the write lock (a no-op ``UPDATE``), so it waits for the
lock (the connection's ``timeout``) instead of failing with "database is locked" when a read
snapshot would have to be upgraded."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

from outboxkit.core.model import Claim, Migration
from outboxkit.storekit import BatchBase, SettleItem
from outboxkit_sqlite.connections import retry_busy
from outboxkit_sqlite.delivery import Delivery as SQLiteDelivery
from outboxkit_sqlite.delivery import check_owned, handler_failure
from outboxkit_sqlite.dialect import SQLiteDialect
from outboxkit_sqlite.errors import map_error as map_sqlite_error
from outboxkit_sqlite.store import SQLiteStore
from outboxkit_sqlite.tables import TableNames

from .connection import django_connection, marked, refuse_marked

__all__ = ["DjangoSQLiteDialect", "OnSQLite", "SQLiteBatchOnDjango"]


class DjangoSQLiteDialect(SQLiteDialect):
    """The SQLite store's dialect on Django's connection for ``alias`` (its own connections are
    never used): reads and writes in Django's atomic blocks. Made as the store makes its
    dialect (``SQLiteStore(make_dialect=...)``), with the alias bound."""

    def __init__(
        self,
        alias: str,
        database: str,
        path: Path | None,
        tables: TableNames,
        **options: Any,
    ) -> None:
        super().__init__(None, tables, **options)
        self.connections.close()  # the placeholder's one in-memory connection
        self.memory = False
        self.alias = alias
        self.where = f"{database} (Django database {alias!r})"
        # A write that changes nothing: the transaction's first statement takes the lock.
        self.take_lock = self.queries["take_lock"]

    def raw(self) -> sqlite3.Connection:
        raw: sqlite3.Connection = django_connection(self.alias).connection
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

    @contextmanager
    def write(self, doing: str) -> Iterator[sqlite3.Connection]:
        with self.atomic(doing, lock=True) as raw:
            yield raw

    @contextmanager
    def read(self, doing: str) -> Iterator[sqlite3.Connection]:
        with self.atomic(doing, lock=False) as raw:
            yield raw


class OnSQLite:
    """Django's SQLite database under outboxkit's SQLite store: ``sql`` is a plain
    ``SQLiteStore`` on ``DjangoSQLiteDialect``; deliveries and batches run in Django's atomic
    blocks, through the SQLite store's public delivery pieces."""

    def __init__(self, alias: str, **options: Any) -> None:
        self.alias = alias
        wrapper = django_connection(alias)
        self.name = str(wrapper.settings_dict["NAME"])
        if not wrapper.is_in_memory_db() and not wrapper.in_atomic_block:
            # As the SQLite store does to its file: readers never block the writer.
            wrapper.connection.execute("PRAGMA journal_mode=WAL")
        options.setdefault("migrate", False)  # the Django migration (or `outboxkit migrate`)
        self.sql = SQLiteStore(
            ":memory:", make_dialect=partial(DjangoSQLiteDialect, alias, self.name), **options
        )
        self.dialect: SQLiteDialect = self.sql.dialect

    def __repr__(self) -> str:
        return f"DjangoStore(using={self.alias!r}, sqlite={self.name!r})"

    def migrate(self) -> Migration:
        return self.sql.migrate()

    def atomic(self, doing: str, *, lock: bool) -> AbstractContextManager[sqlite3.Connection]:
        return self.dialect.write(doing) if lock else self.dialect.read(doing)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.atomic("run a transaction", lock=True) as raw:
            yield raw

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[SQLiteDelivery]:
        with (
            self.atomic(f"deliver event {claim.event.id}", lock=True) as raw,
            self.delivering(raw, claim, now) as tx,
        ):
            yield tx

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[SQLiteBatchOnDjango]:
        with self.atomic("run a batch", lock=True) as raw:
            yield SQLiteBatchOnDjango(self, raw)

    @contextmanager
    def delivering(
        self, conn: sqlite3.Connection, claim: Claim, now: datetime | None
    ) -> Iterator[SQLiteDelivery]:
        """The SQLite store's delivery inside Django's open transaction: the token check, the
        delivery, the check that the handler left the transaction open. Commits nothing."""
        dialect = self.dialect
        at = dialect.instant(now)
        check_owned(dialect, conn, claim)
        tx = SQLiteDelivery(dialect, conn, claim, at)
        was_marked = marked(self.alias)
        try:
            yield tx
            refuse_marked(self.alias, claim, was_marked)
            tx.check_open()
        except Exception as exc:
            instead = handler_failure(dialect, tx, claim, exc)
            if instead is None:
                raise
            raise instead from exc

    def clear(self) -> None:
        with self.dialect.write("clear the outbox tables") as raw:
            self.dialect.empty_tables(raw)


class SQLiteBatchOnDjango(BatchBase):
    """A batch on Django's connection: each delivery in a savepoint (a nested atomic); a
    relay's confirms recorded one delivery each, the settlement with ``settle_many``
    (``BatchBase``'s defaults)."""

    def __init__(self, on: OnSQLite, conn: sqlite3.Connection) -> None:
        self.on = on
        self.conn = conn

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[SQLiteDelivery]:
        with (
            self.on.atomic(f"deliver event {claim.event.id}", lock=False) as raw,
            self.on.delivering(raw, claim, now) as tx,
        ):
            yield tx

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        with self.on.dialect.mapped(f"extend {len(claims)} lease(s)"):
            return self.on.sql.extend_on(self.conn, claims, lease, now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        if not items:
            return []
        with self.on.dialect.mapped(f"settle {len(items)} event(s)"):
            return self.on.sql.settle_many_on(self.conn, items, now)
