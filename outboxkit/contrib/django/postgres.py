"""The Django store on PostgreSQL (psycopg 3): outboxkit's ``PostgresStore`` on a dialect whose
connection is Django's (the store's pool is never opened), and Django's atomic blocks around
its deliveries and batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from outboxkit.core.model import Claim, Migration
from outboxkit.storekit import BatchBase, SettleItem
from outboxkit_pg.delivery import Batch as PGBatch
from outboxkit_pg.delivery import Delivery as PGDelivery
from outboxkit_pg.dialect import PostgresDialect
from outboxkit_pg.flow import check_usable
from outboxkit_pg.names import Names
from outboxkit_pg.pool import Pool
from outboxkit_pg.store import PostgresStore

from .connection import django_connection, marked, refuse_marked

__all__ = ["DjangoPGDialect", "OnPostgres", "PGBatchOnDjango"]


class DjangoPGDialect(PostgresDialect):
    """The PostgreSQL dialect whose connection is Django's (its pool is never opened). Made as
    the store makes its dialect (``PostgresStore(make_dialect=...)``), with the alias bound."""

    def __init__(self, alias: str, pool: Pool, names: Names, **options: Any) -> None:
        super().__init__(pool, names, **options)
        self.alias = alias

    @contextmanager
    def connection(self, doing: str, *, check_schema: bool = True) -> Iterator[Any]:
        """Django's connection: autocommit outside an atomic block (one statement, one
        transaction, as the store's own pool connections), the caller's transaction inside."""
        raw = django_connection(self.alias).connection
        if check_schema and not self.schema_checked:
            self.check_schema(raw)
        yield raw


class OnPostgres:
    """Django's PostgreSQL database (psycopg 3) under outboxkit's PostgreSQL store: ``sql`` is
    a plain ``PostgresStore`` on ``DjangoPGDialect`` (its pool is never opened); deliveries and
    batches run in Django's atomic blocks, through the PostgreSQL store's batch."""

    def __init__(self, alias: str, **options: Any) -> None:
        from psycopg.conninfo import make_conninfo

        self.alias = alias
        settings = django_connection(alias).settings_dict
        # For messages only (host, port, database, user; never the password): nothing connects.
        described = {
            "host": settings.get("HOST") or None,
            "port": str(settings["PORT"]) if settings.get("PORT") else None,
            "dbname": settings.get("NAME") or None,
            "user": settings.get("USER") or None,
        }
        conninfo = make_conninfo(**{k: v for k, v in described.items() if v is not None})
        options.setdefault("pool_min_size", 1)
        self.sql = PostgresStore(conninfo, make_dialect=partial(DjangoPGDialect, alias), **options)
        self.dialect = self.sql.dialect

    def __repr__(self) -> str:
        return (
            f"DjangoStore(using={self.alias!r}, postgresql={self.sql.where}, "
            f"schema={self.sql.names.schema!r})"
        )

    def raw(self) -> Any:
        return django_connection(self.alias).connection

    @contextmanager
    def atomic(self, doing: str) -> Iterator[Any]:
        import psycopg
        from django.db import Error as DjangoError
        from django.db import transaction

        try:
            with self.dialect.mapped(doing), transaction.atomic(using=self.alias):
                yield self.raw()
        except DjangoError as exc:  # Django's commit or rollback failed
            if isinstance(exc.__cause__, psycopg.Error):
                raise self.dialect.error(exc.__cause__, doing) from exc
            raise

    def migrate(self) -> Migration:
        from django.db import connections
        from psycopg.pq import TransactionStatus

        if connections[self.alias].in_atomic_block:
            # psycopg's transaction() must nest (a savepoint), not begin and commit on its own.
            with self.atomic("migrate the schema") as raw:
                if raw.info.transaction_status == TransactionStatus.IDLE:
                    raw.execute("SELECT 1")
                return self.sql.migrate()
        return self.sql.migrate()

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        with self.atomic("run a transaction") as raw:
            yield raw

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[PGDelivery]:
        # A savepoint frame inside Django's transaction: Django commits (or rolls back) it,
        # and a delivery inside a test's transaction never commits that.
        with (
            self.atomic(f"deliver event {claim.event.id}") as raw,
            self.opened(PGBatch(self.sql, raw), claim, now, fresh=True) as tx,
        ):
            yield tx

    @contextmanager
    def opened(
        self, batch: PGBatch, claim: Claim, now: datetime | None, *, fresh: bool = False
    ) -> Iterator[PGDelivery]:
        """A delivery of ``batch`` (a savepoint of Django's transaction) opened before the
        handler runs, whatever it touches: the ORM writes on Django's connection, never
        through ``ctx.connection``, and they must be inside the delivery's savepoint. A
        delivery whose handler left Django's block marked for rollback fails (R17). A
        ``fresh`` batch is a per-event delivery's frame: Django's block has not begun psycopg's
        transaction yet, and the delivery begins it."""
        was_marked = marked(self.alias)
        try:
            delivering = (
                PGDelivery(self.dialect, batch.conn, claim, now, batch)
                if fresh
                else batch.delivery(claim, now=now)
            )
            with delivering as tx:
                _ = tx.connection  # opened (row locked, token checked) before the handler runs
                yield tx
                refuse_marked(self.alias, claim, was_marked)
        except Exception:
            if not was_marked and marked(self.alias) and batch.begun:
                # The delivery's savepoint was rolled back, and with it what the mark was
                # for: the batch's block is sound again (Django would roll all of it back).
                from django.db import transaction

                transaction.set_rollback(False, using=self.alias)
            raise

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[PGBatchOnDjango]:
        from psycopg.pq import TransactionStatus

        with self.atomic("run a batch") as raw:
            if raw.info.transaction_status == TransactionStatus.IDLE:
                raw.execute("SELECT 1")  # psycopg begins Django's transaction
            yield PGBatchOnDjango(self, PGBatch(self.sql, raw))
            check_usable(raw, self.sql.where, "the batch")

    def clear(self) -> None:
        from psycopg import sql

        names = self.sql.names
        with self.atomic("clear the outbox tables") as raw:
            for table in (names.deliveries, names.events):
                raw.execute(
                    sql.SQL("DELETE FROM {}.{}").format(
                        sql.Identifier(names.schema), sql.Identifier(table)
                    )
                )


class PGBatchOnDjango(BatchBase):
    """The PostgreSQL store's batch in Django's transaction, its deliveries opened eagerly
    (``OnPostgres.opened``); the rest is the batch's own."""

    def __init__(self, on: OnPostgres, batch: PGBatch) -> None:
        self.on = on
        self.batch = batch

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[PGDelivery]:
        return self.on.opened(self.batch, claim, now)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        return self.batch.extend(claims, lease=lease, now=now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        return self.batch.settle_many(items, now=now)

    def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        return self.batch.record_many(handler, claims, now=now)

    def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        return self.batch.settle_last(items, now=now)
