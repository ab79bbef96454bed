"""The PostgreSQL store (psycopg 3): several pollers on several machines share one database.

Theory of operation:

- The SQL lives in ``queries.sql``, one named statement each; identifiers are filled in with
  ``psycopg.sql.Identifier`` after validation (``names``), values are always bound.
- The operations every SQL store shares (claim, extend, the round's ``settle_many``, release,
  requeue, listings, purges, stats) are ``outboxkit._sql.base.SQLStore``'s; this module is the
  PostgreSQL dialect: transactions on pooled connections (``pool``), errors mapped by SQLSTATE
  (``errors``), enqueue through the app's connection, migrations, and the delivery and batch
  transactions (``delivery``, around ``flow``).
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

import json
import logging
import threading
import warnings
import weakref
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from outboxkit._sql.base import SQLStore
from outboxkit._sql.names import (
    check_bool,
    check_count,
    check_options,
    check_seconds,
    table_names,
    validate_identifier,
)
from outboxkit._sql.rows import encode_headers, event_from_row, inserted_ids, resolve_ids
from outboxkit.core.machine import Publish
from outboxkit.core.model import Claim, Event, Migration, NewEvent, Outcome
from outboxkit.errors import ConfigurationError, SchemaError, StoreError, migrate_hint
from outboxkit.store import Capabilities, SettleItem

from .delivery import Batch, Delivery, Round, delivering
from .errors import map_error
from .flow import check_usable, has_rows
from .listen import NotifyWaiter
from .names import Names, Queries, prepared, validate_schema
from .pool import AnyConnection, Connection, Lender, Pool, is_url, scheme_of

if TYPE_CHECKING:
    from .aio import AsyncPostgresStore

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "PostgresStore"]

log = logging.getLogger("outboxkit")

SCHEMA_VERSION = 5
"""The schema version this code reads and writes."""

MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, "events, delivery records, due/published/dead partial indexes"),
    (2, "commit guard: a handler's COMMIT of its delivery transaction fails"),
    (3, "per-key order (key rows, key_seq), dedupe keys"),
    (4, "records without a foreign key (purges delete them), has_history for the claim"),
    (5, "message_id: a random uuid per new event, its identity on a broker"),
)
"""Each version and what it adds; version *n* runs the ``migration_n`` statement."""

_LOCK_SPACE = 0x6F62  # first key of the migration advisory lock: "ob"
_OPTIONS = frozenset(
    {
        "schema",
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
    }
)

Row = Sequence[Any]
_SUCCEEDED = Outcome.SUCCEEDED.value


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
        events_table, deliveries_table, schema_table: override one table name each.
        channel: the ``LISTEN``/``NOTIFY`` channel (default: the events table's name).
        notify: ``NOTIFY`` at enqueue and let pollers ``LISTEN`` (default True). Turn it off
            behind PgBouncer in transaction pooling mode, together with ``prepare_threshold=None``.
        prepare_threshold: psycopg's server-side prepared statements (``None`` disables them).
        pool_min_size, pool_max_size, pool_timeout: the store's own connection pool and its
            asyncio side's (when a pool is given, the asyncio side's only): connections kept
            open, at most, and how long (seconds) to wait for one before the store reports the
            database unavailable. An asyncio poller delivering ``concurrency`` events at once
            holds up to ``concurrency + 1`` connections.

    Raises:
        ConfigurationError: a bad name (schema, table, channel: ``^[A-Za-z_][A-Za-z0-9_]{0,62}$``),
            option or connection string. Nothing connects before the first use.
    """

    settles_recording = True  # a batch's settlement and kept records: one statement
    payload_is_json = True  # jsonb: a claimed payload is decoded on first read

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
    ) -> None:
        # Names first: a hostile name is refused before anything else happens.
        validate_schema(schema)
        events, deliveries, versions = table_names(
            table_prefix, events_table, deliveries_table, schema_table
        )
        self.names = Names(
            schema=schema,
            events=events,
            deliveries=deliveries,
            versions=versions,
            channel=channel if channel is not None else validate_identifier(events, "channel"),
        )
        self._notify = check_bool("notify", notify)
        if prepare_threshold is not None:
            check_count("prepare_threshold", prepare_threshold, minimum=0)
        check_count("pool_min_size", pool_min_size, minimum=1)
        check_count("pool_max_size", pool_max_size, minimum=1)
        if pool_max_size < pool_min_size:
            raise ConfigurationError(
                f"pool_max_size ({pool_max_size}) must be >= pool_min_size ({pool_min_size})"
            )
        timeout = check_seconds("pool_timeout", pool_timeout, allow_zero=False)
        if not isinstance(conninfo, str | ConnectionPool | Lender):
            raise ConfigurationError(
                "PostgresStore takes a postgresql:// URL, a libpq conninfo string, a "
                "psycopg_pool.ConnectionPool or a Lender (open_store(engine) on SQLAlchemy), "
                f"got {type(conninfo).__name__}"
            )
        self._pool = Pool(
            conninfo,
            kwargs={"prepare_threshold": prepare_threshold},
            min_size=pool_min_size,
            max_size=pool_max_size,
            timeout=timeout,
            name=f"outboxkit-{schema}",
        )
        self.where = self._pool.where
        self._queries = Queries(self.names)
        self._schema_checked = False
        self._capped = False  # a round's concurrency was held to the pool (logged once)
        self._waiters: weakref.WeakSet[NotifyWaiter] = weakref.WeakSet()
        self._async: AsyncPostgresStore | None = None
        self._async_lock = threading.Lock()
        url = self._pool.conninfo
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
        """The options that reproduce this store (with ``url``), for other processes."""
        self.capabilities = Capabilities(
            batches=True,
            waiter=self._notify and self._pool.conninfo is not None,
            transactional_handlers=True,
            concurrent_claimers=True,
            multiprocess=self.url is not None,
            database_clock=True,
            concurrent_batches=True,
            asyncio=self._pool.conninfo is not None,
            ordering=True,
            dedupe=True,
        )
        """What the store offers: all of it, but the waiter and the asyncio side on a pool of
        the app's without a conninfo string, and ``multiprocess`` without a URL."""

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

    # -- the dialect seam (outboxkit._sql.base) ---------------------------------------------------

    @contextmanager
    def _mapped(self, doing: str, conn: Any = None) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as exc:
            raise self._error(exc, doing, conn) from exc

    @contextmanager
    def _read(self, doing: str) -> Iterator[Connection]:
        # One statement is one transaction (autocommit); several reads need no one snapshot here.
        with self._mapped(doing), self._connection(doing) as conn:
            yield conn

    _write = _read  # every write is one statement: atomic by itself

    def _rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        with conn.cursor(row_factory=tuple_row) as cur:
            # No parameters: none at all, so a % in the statement (a function body) is kept.
            cur.execute(
                self._queries[name], self._params(params) or None, prepare=prepared(conn, name)
            )
            return cur.fetchall() if has_rows(cur) else []

    def _instant(self, at: datetime | None) -> datetime | None:
        return at  # None: the database's clock (coalesce(%(now)s, now()))

    def _stored_instant(self, raw: Any) -> datetime:
        instant: datetime = raw
        return instant

    def _event(self, row: Row) -> Event:
        # psycopg loads the timestamptz columns as aware datetimes already
        return event_from_row(row, None, json_column=self.payload_is_json)

    def _duration(self, delta: timedelta) -> timedelta:
        return delta

    def _array(self, values: Sequence[Any]) -> list[Any]:
        return list(values)

    def _done(self, raw: Any) -> list[Sequence[str]]:
        pairs: list[Sequence[str]] = raw or []  # NULL: no earlier claim left a record
        return pairs

    def _records_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        names = ("ids", "tokens", "handlers", "outcomes", "attempts", "ats", "reasons")
        return _arrays(names, rows)

    def _settle_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        names = ("ids", "tokens", "publish", "dead", "retry_after", "keeps_error", "errors")
        return _arrays(names, rows)

    def _settle_kept_query(
        self, items: Sequence[SettleItem], kept: Sequence[tuple[Any, ...]], now: datetime | None
    ) -> tuple[str, dict[str, Any]] | None:
        """``publish_recording`` when every item publishes and every kept record is a success
        stamped with ``now`` (rows of ``RECORD_COLUMNS``), else the base's choice."""
        if (
            kept
            and all(type(settlement) is Publish for _, settlement, _ in items)
            and all(r[3] == _SUCCEEDED and r[5] == now and r[6] is None for r in kept)
        ):
            settling = {(claim.event.id, claim.token) for claim, _, _ in items}
            if all((r[0], r[1]) in settling for r in kept):
                return "publish_recording", {
                    "now": now,
                    "ids": [claim.event.id for claim, _, _ in items],
                    "tokens": [claim.token for claim, _, _ in items],
                    "record_ids": [r[0] for r in kept],
                    "handlers": [r[2] for r in kept],
                }
        return super()._settle_kept_query(items, kept, now)

    @staticmethod
    def _params(params: Mapping[str, Any]) -> Mapping[str, Any]:
        """``params``, refusing a naive datetime (PostgreSQL would read it in the session's
        time zone).

        Raises:
            ConfigurationError: naming the parameter.
        """
        for name, value in params.items():
            if isinstance(value, datetime) and value.utcoffset() is None:
                raise ConfigurationError(
                    f"{name} must be a timezone-aware datetime (naive ones are refused), got "
                    f"{value!r}"
                )
        return params

    def _error(
        self, exc: psycopg.Error, doing: str, conn: AnyConnection | None = None
    ) -> StoreError:
        """The outboxkit error for a driver error (the password scrubbed from the message)."""
        return map_error(
            exc,
            where=self.where,
            schema=self.names.schema,
            doing=doing,
            scrub=self._pool.scrub,
            conn=conn,
        )

    # -- connections ----------------------------------------------------------------------------

    @contextmanager
    def _connection(self, doing: str, *, check_schema: bool = True) -> Iterator[Connection]:
        """A pooled connection; on first use, the schema's version is checked.

        Raises:
            StoreUnavailable: no connection could be had (the message says why).
            SchemaError: the first use finds no schema, or one of another version.
        """
        with self._pool.connection(doing) as conn:
            if check_schema and not self._schema_checked:
                self._check_schema(conn)
            yield conn

    def _check_schema(self, conn: Connection) -> None:
        try:
            rows = self._rows(conn, "schema_version", {})
        except psycopg.Error as exc:
            raise self._schema_error(exc) from exc
        self._schema_found(rows)

    def _schema_error(self, exc: psycopg.Error) -> StoreError:
        """What a failed read of the schema version means (both sides' first use)."""
        if isinstance(exc, pg_errors.UndefinedTable):
            return SchemaError(
                f"PostgreSQL at {self.where} has no outboxkit schema in schema "
                f"{self.names.schema!r} (table {self.names.versions!r} is missing): "
                f"{migrate_hint()}"
            )
        return self._error(exc, "read the schema version")

    def _schema_found(self, rows: Sequence[Row]) -> None:
        """The schema version read (``schema_version``): checked once per store.

        Raises:
            SchemaError: another version than this code's.
        """
        self._check_version(int(rows[0][0]))
        self._schema_checked = True

    def _check_version(self, found: int) -> None:
        if found > SCHEMA_VERSION:
            raise SchemaError(
                f"PostgreSQL at {self.where}, schema {self.names.schema!r}: the outboxkit schema "
                f"is at version {found}, newer than version {SCHEMA_VERSION} this outboxkit "
                "supports: upgrade outboxkit"
            )
        if found < SCHEMA_VERSION:
            raise SchemaError(
                f"PostgreSQL at {self.where}, schema {self.names.schema!r}: the outboxkit schema "
                f"is at version {found}, older than version {SCHEMA_VERSION} this outboxkit "
                f"needs: {migrate_hint()}"
            )

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
        with (
            self._mapped(doing),
            self._connection(doing, check_schema=False) as conn,
            conn.transaction(),
        ):
            self._rows(conn, "lock_migrations", {"lock_space": _LOCK_SPACE, "lock_key": lock_key})
            if not self._rows(conn, "find_schema", {"schema": self.names.schema}):
                self._rows(conn, "create_schema", {})
            table = {"schema": self.names.schema, "table": self.names.versions}
            if not self._rows(conn, "find_table", table):
                self._rows(conn, "create_versions", {})
            found = int(self._rows(conn, "schema_version", {})[0][0])
            if found > SCHEMA_VERSION:
                self._check_version(found)
            for version, description in MIGRATIONS:
                if version > found:
                    log.info("%r: applying schema version %d", self, version)
                    self._rows(conn, f"migration_{version}", {})
                    self._rows(
                        conn, "record_version", {"version": version, "description": description}
                    )
        self._schema_checked = True
        return Migration(before=found, after=max(found, SCHEMA_VERSION))

    def drop_schema(self) -> None:
        """Drop the store's PostgreSQL schema with everything in it (for test schemas).

        Raises:
            ConfigurationError: the schema is ``public``, which is never dropped.
        """
        if self.names.schema == "public":
            raise ConfigurationError("drop_schema() never drops the public schema")
        with self._write("drop the schema") as conn:
            self._rows(conn, "drop_schema", {})

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
        self._pool.close()

    def now(self) -> datetime:
        """The database's clock (``now()`` on the server): the one every poller shares."""
        with self._read("read the database clock") as conn:
            now: datetime = self._rows(conn, "clock", {})[0][0]
        return now

    # -- transactions ---------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A pooled ``psycopg.Connection`` in an open transaction: committed when the block
        ends, rolled back if it raises. For apps without a connection of their own.

        Raises:
            StoreUnavailable / StoreError: the database failed to begin or commit.
        """
        with self._open_transaction("a transaction") as conn:
            yield conn

    @contextmanager
    def _open_transaction(self, what: str) -> Iterator[Connection]:
        """A pooled connection in a psycopg transaction: committed when the block ends, rolled
        back if it raises; driver errors mapped, naming ``what`` (``transaction``, ``batch``)."""
        with self._connection(f"open {what}") as conn, self._transaction_on(conn, what):
            yield conn

    @contextmanager
    def _transaction_on(self, conn: Connection, what: str) -> Iterator[None]:
        """A psycopg transaction on ``conn`` (``_open_transaction``)."""
        tx = psycopg.Transaction(conn)
        with self._mapped(f"begin {what}", conn):
            tx.__enter__()
        try:
            yield
        except BaseException as exc:
            # A failed rollback (the connection is gone) is logged by psycopg, never
            # raised: it must not mask ``exc``.
            if not tx.__exit__(type(exc), exc, exc.__traceback__):
                raise
            return
        with self._mapped(f"commit {what}", conn):
            tx.__exit__(None, None, None)

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
        self._check_app_connection(conn, psycopg.Connection)
        with self._mapped(f"enqueue {len(events)} event(s)"):
            if not self._schema_checked:
                self._check_schema(conn)
            return self._insert(conn, events, now)

    @staticmethod
    def _check_app_connection(
        conn: object, kind: type[psycopg.Connection[Any]] | type[psycopg.AsyncConnection[Any]]
    ) -> None:
        """Refuse a connection ``enqueue`` cannot write through in the app's transaction,
        before anything is sent (the app's transaction stays usable).

        Raises:
            ConfigurationError: not a ``kind``, closed, or in autocommit mode outside a
                transaction block (the INSERT would commit on its own).
        """
        name = f"psycopg.{kind.__name__}"
        if not isinstance(conn, kind):
            raise ConfigurationError(
                f"the PostgreSQL store enqueues through the app's {name} (psycopg 3) inside its "
                f"open transaction, got {conn!r:.80}"
            )
        if conn.closed:
            raise ConfigurationError(f"enqueue got a closed {name}; nothing was written")
        if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
            block = "async with" if kind is psycopg.AsyncConnection else "with"
            raise ConfigurationError(
                "enqueue needs the app's open transaction, so that the event commits or rolls "
                "back with the app's writes; this connection is in autocommit mode outside a "
                f"transaction block: use `{block} conn.transaction():`. Nothing was written."
            )

    def _insert_query(
        self, events: Sequence[NewEvent], now: datetime | None
    ) -> tuple[str, dict[str, Any]]:
        """The statement that inserts ``events`` (and queues the notification), by name, and
        its parameters: ``enqueue_one`` for one event, else ``enqueue_plain`` for a batch
        without keys or dedupe keys, else ``enqueue``."""
        channel = {"channel": self.names.channel, "notify": self._notify}
        plain = _without_keys(events)
        if plain and len(events) == 1:
            (event,) = events
            return "enqueue_one", {
                "now": now,
                "topic": event.topic,
                "payload": event.payload_json,
                "headers": encode_headers(event.headers),
                "delay": event.delay,
                "available_at": event.available_at,
                **channel,
            }
        name = "enqueue_plain" if plain else "enqueue"
        return name, {"now": now, "events": _batch_document(events), **channel}

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
        params = self._params(
            {
                "now": now,
                "events": _batch_document(events),
                "channel": self.names.channel,
                "notify": self._notify,
            }
        )
        name = "enqueue_portable_plain" if _without_keys(events) else "enqueue_portable"
        return [(self._queries.text(name), dict(params))]

    @staticmethod
    def _inserted(name: str, rows: Sequence[Row]) -> list[int]:
        """The new ids from ``enqueue_one``'s rows."""
        return [rows[0][0]]

    def _insert(
        self, conn: Connection, events: Sequence[NewEvent], now: datetime | None
    ) -> list[int]:
        name, params = self._insert_query(events, now)
        rows = self._rows(conn, name, params)
        if name == "enqueue_one":
            return self._inserted(name, rows)
        ids, missing = inserted_ids(events, rows)
        # A statement of its own: its fresh snapshot sees a holder that a concurrent
        # transaction committed while the insert waited for it (READ COMMITTED).
        found: dict[str, int] = {}
        if missing:
            found = {k: i for k, i in self._rows(conn, "dedupe_holders", {"keys": missing})}
        return resolve_ids(events, ids, found)

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
            self._connection(f"deliver event {claim.event.id}") as conn,
            delivering(self, conn, claim, now) as tx,
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
        lines = max(1, min(concurrency, self._pool.max_size - 2))
        if lines < concurrency and not self._capped:
            self._capped = True
            log.info(
                "%r: concurrency %d held to %d connection(s) per round: pool_max_size is %d "
                "and two stay free for the claims; raise pool_max_size for more",
                self,
                concurrency,
                lines,
                self._pool.max_size,
            )
        round_ = Round(self, lines)
        try:
            yield round_
        except BaseException:
            round_.close(failed=True)
            raise
        round_.close()

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
        with self._connection("open the batch") as conn:
            if not conn.autocommit:  # an app's pool: psycopg begins the transaction
                with self._transaction_on(conn, "the batch"):
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
        if self._pool.conninfo is None:
            raise ConfigurationError(
                f"{self!r} has no asyncio side: its pool has no conninfo string to open async "
                "connections with"
            )
        with self._async_lock:
            self._pool.check_open()
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
        waiter = NotifyWaiter(**self._listening(asyncio=False))
        self._waiters.add(waiter)
        return waiter

    def _listening(self, *, asyncio: bool) -> dict[str, Any]:
        """A ``LISTEN`` waiter's arguments (either side's)."""
        pool = self._pool
        assert pool.conninfo is not None
        return {
            "conninfo": pool.conninfo,
            "kwargs": pool.connect_kwargs(asyncio=asyncio),
            "listen": self._queries["listen"],
            "where": self.where,
            "scrub": pool.scrub,
        }

    def explain_claim(self, *, batch_size: int, lease: timedelta, now: datetime | None) -> Any:
        """``EXPLAIN (ANALYZE, FORMAT JSON)`` of one claim, rolled back afterwards.

        For operators and tests checking that the claim walks the due index and that the
        ``LIMIT`` holds. Returns the JSON plan.
        """
        query = b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + self._queries["claim"]
        params = self._params({"now": now, "batch_size": batch_size, "lease": lease, "hold": False})
        with (
            self._mapped("explain the claim"),
            self._connection("explain the claim") as conn,
            conn.transaction(force_rollback=True),
            conn.cursor(row_factory=tuple_row) as cur,
        ):
            cur.execute(query, params)
            row = cur.fetchone()
            assert row is not None
            return row[0]


_json_text = json.JSONEncoder(ensure_ascii=False).encode
_MICROSECOND = timedelta(microseconds=1)


def _without_keys(events: Sequence[NewEvent]) -> bool:
    """Whether no event of ``events`` has a key or a dedupe key (``enqueue_plain`` inserts
    them)."""
    return all(e.key is None and e.dedupe_key is None for e in events)


def _batch_document(events: Sequence[NewEvent]) -> str:
    """The ``enqueue`` statement's parameter: a JSON array of ``[topic, payload, headers, key,
    delay_us, dedupe_key, available_at]``, one per event, built from the already-encoded
    payloads (no re-encoding; each
    distinct topic is encoded once)."""
    topics = {topic: _json_text(topic) for topic in {e.topic for e in events}}
    return "[{}]".format(
        ",".join(
            f"[{topics[e.topic]},{e.payload_json},{encode_headers(e.headers)},"
            f"{'null' if e.key is None else _json_text(e.key)},"
            f"{e.delay // _MICROSECOND if e.delay else 0},"
            f"{'null' if e.dedupe_key is None else _json_text(e.dedupe_key)},"
            f"{'null' if e.available_at is None else _json_text(e.available_at.isoformat())}]"
            for e in events
        )
    )


def _arrays(names: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> dict[str, list[Any]]:
    """One array parameter per column of ``rows``, named by ``names`` (bound as binary arrays
    where the statement says ``%(name)b``: psycopg's text format would escape every element
    through a regular expression, milliseconds per hundred)."""
    return {name: list(column) for name, column in zip(names, zip(*rows, strict=True), strict=True)}
