"""The PostgreSQL store (psycopg 3): several pollers on several machines share one database.

Theory of operation:

- The SQL lives in ``queries.sql``, one named statement each; identifiers are filled in with
  ``psycopg.sql.Identifier`` after validation (``names``), values are always bound.
- The operations every SQL store shares (claim, extend, the round's ``settle_many``, release,
  requeue, listings, purges, stats) are ``outboxkit.storekit.sql.SQLStore``'s, on the
  PostgreSQL dialect (``dialect``: pooled connections (``pool``), errors mapped by SQLSTATE
  (``errors``), the schema check, the insert of events). This module adds what is the store's
  own: its options, enqueue through the app's connection, migrations, and the delivery and
  batch transactions (``delivery``, around ``flow``), which get the dialect.
- The asyncio side (``async_store()``, ``aio``) runs the very same statements, mappings and
  decisions on async connections of a pool of its own; only the waiting is its own.
- Time: every statement takes ``now`` as a parameter and falls back to the database clock
  (``coalesce(%(now)s, now())``): pollers on many machines share the server's clock; a test
  clock's instant is bound instead.
- A claim is one statement: a ``MATERIALIZED`` CTE picks due ids in ``(available_at, id)`` order
  ``FOR UPDATE SKIP LOCKED`` with the ``LIMIT``, and the ``UPDATE`` sets the lease, counts the
  attempt and draws a fresh token. It commits before it returns.
- Enqueue runs through the app's own connection, inside its transaction, and queues a
  ``NOTIFY`` in the same statement: PostgreSQL delivers it only if the app commits.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from outboxkit.core.model import Claim, Migration, NewEvent
from outboxkit.errors import ConfigurationError
from outboxkit.store import Capabilities
from outboxkit.storekit.names import (
    check_bool,
    check_count,
    check_options,
    check_seconds,
    table_names,
    validate_identifier,
)
from outboxkit.storekit.sql import SQLStore

from .delivery import Batch, Delivery, Round, delivering
from .dialect import PostgresDialect, PostgresStatements, batch_document, without_keys
from .flow import check_usable
from .listen import NotifyWaiter
from .names import Names, validate_schema
from .partitions import check_partition_size, convert, maintain
from .pool import Connection, Lender, Pool, is_url, scheme_of

if TYPE_CHECKING:
    from .aio import AsyncPostgresStore

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "PostgresStore"]

log = logging.getLogger("outboxkit")

SCHEMA_VERSION = 7
"""The schema version this code reads and writes."""

MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, "events, delivery records, due/published/dead partial indexes"),
    (2, "commit guard: a handler's COMMIT of its delivery transaction fails"),
    (3, "per-key order (key rows, key_seq), dedupe keys"),
    (4, "records without a foreign key (purges delete them), has_history for the claim"),
    (5, "message_id: a random uuid per new event, its identity on a broker"),
    (6, "errors: the error of each failed attempt"),
    (7, "close function: a delivery's R17 check, record and R18 reset in one statement"),
)
"""Each version and what it adds; version *n* runs the ``migration_n`` statement."""

_LOCK_SPACE = 0x6F62  # first key of the migration advisory lock: "ob"
_OPTIONS = frozenset(
    {
        "schema",
        "listen_conninfo",
        "table_prefix",
        "events_table",
        "deliveries_table",
        "schema_table",
        "channel",
        "notify",
        "prepare_threshold",
        "pool_min_size",
        "pool_max_size",
        "pool_timeout",
        "partition_size",
    }
)


class PostgresStore(SQLStore):
    """The PostgreSQL store (``postgresql://`` / ``postgres://``). Needs PostgreSQL 13 or later.

    Thread-safe: pollers in several threads (and processes, and machines) may share it. Its
    asyncio side (``async_store()``: ``Outbox.enqueue_async``, the asyncio poller) shares its
    SQL and error mapping, on a ``psycopg_pool.AsyncConnectionPool`` of its own.

    Args:
        conninfo: a ``postgresql://`` URL or a libpq ``key=value`` string, or a
            ``psycopg_pool.ConnectionPool`` of your own, or a ``Lender`` (a SQLAlchemy engine's
            pool: ``open_store(engine)``); the store borrows its connections and never closes it.
        schema: the PostgreSQL schema holding the tables (default ``public``; created by
            ``migrate()`` when missing).
        table_prefix: prefix of the three table names: ``{prefix}events``,
            ``{prefix}deliveries``, ``{prefix}schema`` (default ``outbox_``).
        events_table: the events table's name, instead of the prefix's.
        deliveries_table: the delivery records table's name, instead of the prefix's.
        schema_table: the schema version table's name, instead of the prefix's.
        channel: the ``LISTEN``/``NOTIFY`` channel (default: the events table's name).
        notify: ``NOTIFY`` at enqueue and let pollers ``LISTEN`` (default True). Behind
            PgBouncer in transaction pooling mode a ``LISTEN`` through the pooler hears nothing
            (notifications belong to a server session): give ``listen_conninfo``, or turn
            ``notify`` off (the pollers then poll every ``interval``).
        listen_conninfo: where the pollers' ``LISTEN`` connection goes, when not where
            ``conninfo`` does: the server's own address behind a transaction pooler (a URL or
            libpq string). Everything else goes through ``conninfo``.
        prepare_threshold: psycopg's server-side prepared statements (``None`` disables them).
        pool_min_size: connections the store's own pool keeps open (and its asyncio side's;
            when a pool is given, the asyncio side's only).
        pool_max_size: connections the pools open at most. An asyncio poller delivering
            ``concurrency`` events at once holds up to ``concurrency + 1`` connections.
        pool_timeout: seconds to wait for a pool's connection before the store reports the
            database unavailable.
        partition_size: the partitioned layout, with this many event ids per partition
            (10 to 10**12; e.g. 1,000,000): retention drops whole partitions instead of
            deleting rows, and the store has no dedupe keys (see ``outboxkit_pg.partitions``).
            ``migrate()`` makes a new schema partitioned, or converts today's tables in place.
            Default None: one table each, as before.
        make_dialect: the store's dialect class, or a factory called as it is (the ``Pool``,
            the ``Names``, ``notify=``, ``schema_version=``): a dialect of the caller's, for a
            store on connections someone else holds (the Django store's runs on Django's
            connection and never opens the pool). Default: ``PostgresDialect``.

    Raises:
        ConfigurationError: a bad name (schema, table, channel: ``^[A-Za-z_][A-Za-z0-9_]{0,62}$``),
            option or connection string. Nothing connects before the first use.
    """

    dialect: PostgresDialect
    statements: PostgresStatements

    sql_dialect = "postgresql"
    """The SQL dialect of the store's database, by SQLAlchemy's name for it."""

    def __init__(
        self,
        conninfo: str | ConnectionPool[Any] | Lender,
        *,
        schema: str = "public",
        table_prefix: str = "outbox_",
        events_table: str | None = None,
        deliveries_table: str | None = None,
        schema_table: str | None = None,
        channel: str | None = None,
        notify: bool = True,
        prepare_threshold: int | None = 5,
        pool_min_size: int = 1,
        pool_max_size: int = 4,
        pool_timeout: float = 10.0,
        listen_conninfo: str | None = None,
        partition_size: int | None = None,
        make_dialect: Callable[..., PostgresDialect] = PostgresDialect,
    ) -> None:
        # Names first: a hostile name is refused before anything else happens.
        validate_schema(schema)
        events, deliveries, versions = table_names(
            table_prefix, events_table, deliveries_table, schema_table
        )
        names = Names(
            schema=schema,
            events=events,
            deliveries=deliveries,
            versions=versions,
            channel=channel if channel is not None else validate_identifier(events, "channel"),
        )
        notifies = check_bool("notify", notify)
        if prepare_threshold is not None:
            check_count("prepare_threshold", prepare_threshold, minimum=0)
        check_count("pool_min_size", pool_min_size, minimum=1)
        check_count("pool_max_size", pool_max_size, minimum=1)
        if pool_max_size < pool_min_size:
            raise ConfigurationError(
                f"pool_max_size ({pool_max_size}) must be >= pool_min_size ({pool_min_size})"
            )
        timeout = check_seconds("pool_timeout", pool_timeout, allow_zero=False)
        if partition_size is not None:
            check_partition_size(partition_size)
        self.partition_size = partition_size
        """Event ids per partition in the partitioned layout; None: the other layout."""
        if listen_conninfo is not None and not isinstance(listen_conninfo, str):
            raise ConfigurationError(
                "listen_conninfo must be a postgresql:// URL or a libpq conninfo string, got "
                f"{type(listen_conninfo).__name__}"
            )
        if not isinstance(conninfo, str | ConnectionPool | Lender):
            raise ConfigurationError(
                "PostgresStore takes a postgresql:// URL, a libpq conninfo string, a "
                "psycopg_pool.ConnectionPool or a Lender (open_store(engine) on SQLAlchemy), "
                f"got {type(conninfo).__name__}"
            )
        pool = Pool(
            conninfo,
            kwargs={"prepare_threshold": prepare_threshold},
            min_size=pool_min_size,
            max_size=pool_max_size,
            timeout=timeout,
            name=f"outboxkit-{schema}",
            listen_conninfo=listen_conninfo,
        )
        dialect = make_dialect(pool, names, notify=notifies, schema_version=SCHEMA_VERSION)
        dialect.partitioned = partition_size is not None
        super().__init__(dialect, PostgresStatements(dialect))
        self.names = names
        self.where = pool.where
        self._capped = False  # a round's concurrency was held to the pool (logged once)
        self._waiters: weakref.WeakSet[NotifyWaiter] = weakref.WeakSet()
        self._async: AsyncPostgresStore | None = None
        self._async_lock = threading.Lock()
        url = pool.conninfo
        self.url: str | None = url if url is not None and is_url(url) else None
        """The connection URL (``open_store(store.url, **store.options)`` opens this store)."""
        self.options: dict[str, Any] = {
            "schema": self.names.schema,
            "events_table": self.names.events,
            "deliveries_table": self.names.deliveries,
            "schema_table": self.names.versions,
            "channel": self.names.channel,
            "notify": notify,
            "prepare_threshold": prepare_threshold,
            "pool_min_size": pool_min_size,
            "pool_max_size": pool_max_size,
            "pool_timeout": timeout,
        }
        if listen_conninfo is not None:
            self.options["listen_conninfo"] = listen_conninfo
        if partition_size is not None:
            self.options["partition_size"] = partition_size
        """The options that reproduce this store (with ``url``), for other processes."""
        self.capabilities = Capabilities(
            batches=True,
            waiter=notifies and pool.listening_to is not None,
            transactional_handlers=True,
            concurrent_claimers=True,
            multiprocess=self.url is not None,
            database_clock=True,
            concurrent_batches=True,
            asyncio=pool.conninfo is not None,
            ordering=True,
            dedupe=partition_size is None,
            error_history=True,
        )
        """What the store offers: all of it, but the waiter and the asyncio side on a pool of
        the app's without a conninfo string, ``multiprocess`` without a URL, and the dedupe
        keys in the partitioned layout."""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresStore:
        """The factory behind ``open_store("postgresql://...", **options)``.

        Raises:
            ConfigurationError: not a postgresql:// URL, or an unknown or invalid option.
        """
        if not is_url(url):
            raise ConfigurationError(
                "a PostgreSQL store URL starts with postgresql:// or postgres://, got "
                f"{scheme_of(url)!r}"
            )
        check_options(options, _OPTIONS, store="PostgreSQL")
        return cls(url, **options)

    def __repr__(self) -> str:
        return f"PostgresStore({self.where}, schema={self.names.schema!r})"

    # -- schema ---------------------------------------------------------------------------------

    def migrate(self) -> Migration:
        """Create or upgrade the schema (and the PostgreSQL schema itself when missing).

        Idempotent, and safe to run from several processes at once: the steps run in one
        transaction under an advisory lock. When the schema is current it only reads, so a role
        without DDL rights may call it.

        Returns:
            The version found (0: none) and the version left.

        Raises:
            SchemaError: the schema is newer than this code (naming both versions).
            StoreUnavailable: the database cannot be reached.
            StoreError: the migration failed (e.g. the role may not create tables).
        """
        doing = f"migrate schema {self.names.schema!r}"
        # One lock per PostgreSQL schema, not per table set: outboxes with other table names in
        # the same new schema would otherwise race on its CREATE SCHEMA (a unique violation on
        # pg_namespace). Migrations are rare; serializing them per schema costs nothing.
        lock_key = zlib.crc32(self.names.schema.encode()) - (1 << 31)  # a signed 32-bit key
        dialect = self.dialect
        rows = dialect.rows
        with (
            dialect.mapped(doing),
            dialect.connection(doing, check_schema=False) as conn,
            conn.transaction(),
        ):
            rows(conn, "lock_migrations", {"lock_space": _LOCK_SPACE, "lock_key": lock_key})
            if not rows(conn, "find_schema", {"schema": self.names.schema}):
                rows(conn, "create_schema", {})
            table = {"schema": self.names.schema, "table": self.names.versions}
            if not rows(conn, "find_table", table):
                rows(conn, "create_versions", {})
            (found, partitioned), *_ = rows(conn, "schema_version", {})
            found = int(found)
            if found > SCHEMA_VERSION:
                dialect.check_version(found)
            for version, description in MIGRATIONS:
                if version > found:
                    log.info("%r: applying schema version %d", self, version)
                    rows(conn, f"migration_{version}", {})
                    rows(conn, "record_version", {"version": version, "description": description})
            if self.partition_size is not None and not partitioned:
                log.info("%r: converting the tables to the partitioned layout", self)
                convert(conn, self.names, self.partition_size)
            else:
                dialect.check_layout(bool(partitioned))
        if self.partition_size is not None:
            self.maintain_partitions()  # partitions ahead, after a restart too
        dialect.schema_checked = True
        return Migration(before=found, after=max(found, SCHEMA_VERSION))

    def maintain_partitions(self, *, before: datetime | None = None) -> int:
        """The partitioned layout's upkeep: make the partitions ahead of the ids, and with
        ``before``, drop those whose every event was published before it (with their
        records). ``purge_published`` (the pollers' retention) runs it.

        Returns:
            How many events went with the dropped partitions.

        Raises:
            ConfigurationError: the store is not opened for the partitioned layout.
            StoreError: the database failed.
        """
        if self.partition_size is None:
            raise ConfigurationError(
                "maintain_partitions() is for the partitioned layout: open the store with "
                "partition_size"
            )
        with self.dialect.mapped("maintain the partitions"):
            return maintain(self, before=before)

    def purge_published(self, *, before: datetime, limit: int) -> int:
        """Delete at most ``limit`` events published before ``before``, with their records;
        how many. In the partitioned layout the partitions holding only such events are
        dropped first (their events counted too), then the rest are deleted."""
        dropped = 0 if self.partition_size is None else self.maintain_partitions(before=before)
        return dropped + super().purge_published(before=before, limit=limit)

    def drop_schema(self) -> None:
        """Drop the store's PostgreSQL schema with everything in it (for test schemas).

        Raises:
            ConfigurationError: the schema is ``public``, which is never dropped.
        """
        if self.names.schema == "public":
            raise ConfigurationError("drop_schema() never drops the public schema")
        with self.dialect.write("drop the schema") as conn:
            self.dialect.rows(conn, "drop_schema", {})

    def close(self) -> None:
        """Close the store's own pools (the asyncio side's too) and listeners (a pool passed in
        is left open). From async code, ``await store.async_store().close()`` first: this
        blocking call can only schedule the asyncio side's close on a loop running in its own
        thread (see ``AsyncPostgresStore.close_blocking``)."""
        for waiter in list(self._waiters):
            waiter.close()
        with self._async_lock:
            side = self._async
        if side is not None:
            side.close_blocking()
        self.dialect.pool.close()

    def now(self) -> datetime:
        """The database's clock (``now()`` on the server): the one every poller shares."""
        with self.dialect.read("read the database clock") as conn:
            now: datetime = self.dialect.rows(conn, "clock", {})[0][0]
        return now

    # -- transactions ---------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A pooled ``psycopg.Connection`` in an open transaction: committed when the block
        ends, rolled back if it raises. For apps without a connection of their own.

        Raises:
            StoreUnavailable / StoreError: the database failed to begin or commit.
        """
        with self.dialect.open_transaction("a transaction") as conn:
            yield conn

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        """Insert ``events`` through the app's ``psycopg.Connection``, in its transaction.

        Never begins (psycopg does, on a connection without autocommit, as for any statement),
        commits or rolls back. The ``NOTIFY`` is delivered when the app commits.

        Raises:
            ConfigurationError: not a psycopg connection, closed, or in autocommit mode outside
                a transaction block (the INSERT would commit on its own); nothing was written.
            StoreError: the INSERT failed.
        """
        if not events:
            return []
        dialect = self.dialect
        dialect.check_app_connection(conn, psycopg.Connection)
        with dialect.mapped(f"enqueue {len(events)} event(s)"):
            if not dialect.schema_checked:
                dialect.check_schema(conn)
            return dialect.insert(conn, events, now)

    def portable_enqueue(
        self, events: Sequence[NewEvent], now: datetime | None
    ) -> list[tuple[str, dict[str, Any]]]:
        """The statements that insert ``events`` through a connection another library drives
        (SQLAlchemy's, on any PostgreSQL driver), as ``(sql, params)`` with ``:name``
        parameters; each returns the new ids as its rows' first column (in batch order once
        sorted). The identifiers are the store's validated names; every value is a parameter.

        Raises:
            ConfigurationError: ``now`` is naive.
        """
        dialect = self.dialect
        params = dialect.params(
            {
                "now": now,
                "events": batch_document(events),
                "channel": self.names.channel,
                "notify": dialect.notify,
            }
        )
        name = "enqueue_portable_plain" if without_keys(events) else "enqueue_portable"
        return [(dialect.queries.text(name), dict(params))]

    # -- the hot path ---------------------------------------------------------------------------

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[Delivery]:
        """A delivery transaction on a pooled connection, opened (the event row locked, the
        token checked) when ``tx.connection`` is first taken; a block that never takes it ends
        with its record in one fenced statement (``delivery.delivering``).

        ``tx.connection`` is that ``psycopg.Connection`` in the open transaction: the handler
        reads and writes through it, but must not commit, roll back or close it.

        Raises:
            LeaseLostError: the token is stale (nothing is written).
            HandlerCrashed: the handler ended, broke or closed the transaction it was given.
            StoreUnavailable / StoreError: the database failed (never blamed on the handler).
        """
        with (
            self.dialect.connection(f"deliver event {claim.event.id}") as conn,
            delivering(self.dialect, conn, claim, now) as tx,
        ):
            yield tx

    @contextmanager
    def rounds(self, *, concurrency: int = 1) -> Iterator[Round]:
        """The deliveries of one per-event round (``Store.rounds``): each delivery a
        transaction of its own, on one pooled connection held for the round; a record that
        needs no transaction is sent without waiting for its commit (``pipeline``), on up to
        ``concurrency`` connections in turn, and read back before the connection is used
        otherwise, and before the round's settlement. The round holds at most
        ``pool_max_size - 2`` connections (two stay free for the claims, a prefetched one
        included): a higher ``concurrency`` is held to that, said once in the log."""
        round_ = Round(self, self.round_connections(concurrency))
        try:
            yield round_
        except BaseException:
            round_.close(failed=True)
            raise
        round_.close()

    def round_connections(self, concurrency: int) -> int:
        """How many connections a per-event round holds at most, on either side: up to
        ``concurrency``, and ``pool_max_size - 2`` at most (two stay free for the claims, a
        prefetched one included); a ``concurrency`` held to less is said once in the log."""
        max_size = self.dialect.pool.max_size
        lines = max(1, min(concurrency, max_size - 2))
        if lines < concurrency and not self._capped:
            self._capped = True
            log.info(
                "%r: concurrency %d held to %d connection(s) per round: pool_max_size is %d "
                "and two stay free for the claims; raise pool_max_size for more",
                self,
                concurrency,
                lines,
                max_size,
            )
        return lines

    def deliveries(self, *, concurrency: int = 1) -> AbstractContextManager[Round]:
        """Deprecated: ``rounds`` (the name every store has now)."""
        warnings.warn(
            "PostgresStore.deliveries() is deprecated: use PostgresStore.rounds()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.rounds(concurrency=concurrency)

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[Batch]:
        """One transaction for a claimed batch (``transaction="per_batch"``) on a pooled
        connection: each delivery in a savepoint of it, settlements and lease extensions in
        it, one commit at the end. The rows it delivers stay locked until then.

        On the store's own (autocommit) connections the transaction begins lazily
        (``BatchGuard.begun``): a batch whose handlers never took the connection settles in
        one statement, with its records, and that statement is its transaction."""
        dialect = self.dialect
        with dialect.connection("open the batch") as conn:
            if not conn.autocommit:  # an app's pool: psycopg begins the transaction
                with dialect.transaction_on(conn, "the batch"):
                    batch = Batch(self, conn)
                    yield batch
                    batch.write_kept()
                    check_usable(conn, self.where, "the batch")
                return
            batch = Batch(self, conn)
            batch.begun = False
            try:
                yield batch
                batch.write_kept()
                if batch.begun:
                    check_usable(conn, self.where, "the batch")
                    batch.commit()
            except BaseException:
                batch.abort()
                raise

    # -- wake-ups -------------------------------------------------------------------------------

    def async_store(self) -> AsyncPostgresStore:
        """The store's asyncio side (``AsyncPostgresStore``), made on first use and closed by
        ``close()``: the same tables, SQL and error mapping on psycopg's ``AsyncConnection``,
        from a ``psycopg_pool.AsyncConnectionPool`` of its own that opens on first use.

        Raises:
            ConfigurationError: the store has no asyncio side (a pool of the app's without a
                conninfo string to open async connections with).
            StoreError: the store is closed.
        """
        pool = self.dialect.pool
        if pool.conninfo is None:
            raise ConfigurationError(
                f"{self!r} has no asyncio side: its pool has no conninfo string to open async "
                "connections with"
            )
        with self._async_lock:
            pool.check_open()
            if self._async is None:
                from .aio import AsyncPostgresStore

                self._async = AsyncPostgresStore(self)
            return self._async

    def make_waiter(self) -> NotifyWaiter | None:
        """A poller waiter that also returns when an enqueue commits (``LISTEN``), or None
        when notifications are off. It connects on its first ``wait`` and is closed by the
        poller (or by ``close()``)."""
        if not self.capabilities.waiter:
            return None
        waiter = NotifyWaiter(**self.dialect.listening(asyncio=False))
        self._waiters.add(waiter)
        return waiter

    def explain_claim(self, *, batch_size: int, lease: timedelta, now: datetime | None) -> Any:
        """``EXPLAIN (ANALYZE, FORMAT JSON)`` of one claim, rolled back afterwards.

        For operators and tests checking that the claim walks the due index and that the
        ``LIMIT`` holds. Returns the JSON plan.
        """
        dialect = self.dialect
        query = b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + dialect.queries["claim"]
        params = dialect.params(
            {"now": now, "batch_size": batch_size, "lease": lease, "hold": False}
        )
        with (
            dialect.mapped("explain the claim"),
            dialect.connection("explain the claim") as conn,
            conn.transaction(force_rollback=True),
            conn.cursor(row_factory=tuple_row) as cur,
        ):
            cur.execute(query, params)
            row = cur.fetchone()
            assert row is not None
            return row[0]
