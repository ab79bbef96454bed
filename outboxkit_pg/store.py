"""The PostgreSQL store (psycopg 3): several pollers on several machines share one database.

Theory of operation:

- The SQL lives in ``sql/queries.sql``, one named statement each; identifiers are filled in with
  ``psycopg.sql.Identifier`` after ``validate_identifier``, values are always bound.
- Time: every statement takes ``now`` as a parameter and falls back to the database clock
  (``coalesce(%(now)s, now())``): pollers on many machines share the server's clock; a test
  clock's instant is bound instead.
- A claim is one statement: a ``MATERIALIZED`` CTE picks due ids in ``(available_at, id)`` order
  ``FOR UPDATE SKIP LOCKED`` with the ``LIMIT``, and the ``UPDATE`` sets the lease, counts the
  attempt and draws a fresh token. It commits before it returns.
- A delivery transaction is a pooled connection in ``BEGIN``; its first statement locks the event
  row (``SELECT ... FOR UPDATE``) and checks the claim token, so a poller whose lease was taken
  over runs nothing, and claims skip the row while the handler runs. The handler gets that
  ``psycopg.Connection`` as ``ctx.connection``; its record commits with its writes.
- Settle, extend and release are single statements fenced by the token.
- Enqueue runs through the app's own connection, inside its transaction, and queues a
  ``NOTIFY`` in the same statement: PostgreSQL delivers it only if the app commits.
- Driver errors are mapped at this boundary: lost or refused connections to
  ``StoreUnavailable`` (the poller waits them out), missing tables to ``SchemaError``, the rest to
  ``StoreError``. Messages name host, port and database, never the password.
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import weakref
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote, urlsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool, PoolTimeout

from outboxkit._storekit import (
    done_from_pairs,
    encode_headers,
    event_from_row,
    prefixed_table_names,
    record_from_row,
    settle_params,
    settle_values,
    sort_claims,
    still_owned,
    validate_identifier,
)
from outboxkit.core.machine import Settlement
from outboxkit.core.model import Claim, DeadLetter, DeliveryRecord, Event, NewEvent, Outcome, Stats
from outboxkit.errors import (
    ConfigurationError,
    HandlerCrashed,
    LeaseLostError,
    Reject,
    SchemaError,
    StoreError,
    StoreUnavailable,
)
from outboxkit.store import Capabilities

from ._queries import Names, Queries, validate_schema
from .listen import NotifyWaiter

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "PostgresStore"]

log = logging.getLogger("outboxkit")

SCHEMA_VERSION = 2
"""The schema version this code reads and writes."""

MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, "events, delivery records, due/published/dead partial indexes"),
    (2, "commit guard: a handler's COMMIT of its delivery transaction fails"),
)
"""Each version and what it adds; version *n* runs the ``migration_n`` statement."""

_LOCK_SPACE = 0x6F62  # first key of the migration advisory lock: "ob"
_SCHEMES = ("postgresql", "postgres")
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
_PROBE_TIMEOUT = 5  # seconds libpq may spend finding out why the pool cannot connect

Row = tuple[Any, ...]
Connection = psycopg.Connection[Any]


class PostgresStore:
    """The PostgreSQL store (``postgresql://`` / ``postgres://``). Needs PostgreSQL 13 or later.

    Thread-safe: pollers in several threads (and processes, and machines) may share it.

    Args:
        conninfo: a ``postgresql://`` URL or a libpq ``key=value`` string, or a
            ``psycopg_pool.ConnectionPool`` of your own (the store borrows its connections and
            never closes it).
        schema: the PostgreSQL schema holding the tables (default ``public``; created by
            ``migrate()`` when missing).
        table_prefix: prefix of the three table names: ``{prefix}events``,
            ``{prefix}deliveries``, ``{prefix}schema`` (default ``outbox_``).
        events_table, deliveries_table, schema_table: override one table name each.
        channel: the ``LISTEN``/``NOTIFY`` channel (default: the events table's name).
        notify: ``NOTIFY`` at enqueue and let pollers ``LISTEN`` (default True). Turn it off
            behind PgBouncer in transaction pooling mode, together with ``prepare_threshold=None``.
        prepare_threshold: psycopg's server-side prepared statements (``None`` disables them).
        pool_min_size, pool_max_size, pool_timeout: the store's own connection pool (ignored
            when a pool is given): connections kept open, at most, and how long (seconds) to
            wait for one before the store reports the database unavailable.

    Raises:
        ConfigurationError: a bad name (schema, table, channel: ``^[A-Za-z_][A-Za-z0-9_]{0,62}$``),
            option or connection string. Nothing connects before the first use.
    """

    def __init__(
        self,
        conninfo: str | ConnectionPool[Any],
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
        default_events, default_deliveries, default_versions = prefixed_table_names(table_prefix)
        events = events_table if events_table is not None else default_events
        self.names = Names(
            schema=schema,
            events=events,
            deliveries=deliveries_table if deliveries_table is not None else default_deliveries,
            versions=schema_table if schema_table is not None else default_versions,
            channel=channel if channel is not None else validate_identifier(events, "events_table"),
        )
        if not isinstance(notify, bool):
            raise ConfigurationError(f"notify must be True or False, got {notify!r}")
        if prepare_threshold is not None and (
            not isinstance(prepare_threshold, int)
            or isinstance(prepare_threshold, bool)
            or prepare_threshold < 0
        ):
            raise ConfigurationError(
                f"prepare_threshold must be None or an integer >= 0, got {prepare_threshold!r}"
            )
        for option, value in (("pool_min_size", pool_min_size), ("pool_max_size", pool_max_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{option} must be an integer >= 1, got {value!r}")
        if pool_max_size < pool_min_size:
            raise ConfigurationError(
                f"pool_max_size ({pool_max_size}) must be >= pool_min_size ({pool_min_size})"
            )
        if (
            not isinstance(pool_timeout, int | float)
            or isinstance(pool_timeout, bool)
            or not 0 < pool_timeout < float("inf")
        ):
            raise ConfigurationError(f"pool_timeout must be seconds > 0, got {pool_timeout!r}")

        if isinstance(conninfo, ConnectionPool):
            self._pool: ConnectionPool[Any] | None = conninfo
            self._owns_pool = False
            given = conninfo.conninfo
            self._conninfo: str | None = given if isinstance(given, str) else None
            pool_kwargs = conninfo.kwargs if isinstance(conninfo.kwargs, Mapping) else {}
            self._kwargs: dict[str, Any] = {
                k: v for k, v in pool_kwargs.items() if k != "autocommit"
            }
        elif isinstance(conninfo, str):
            self._pool = None
            self._owns_pool = True
            self._conninfo = conninfo
            self._kwargs = {"prepare_threshold": prepare_threshold}
        else:
            raise ConfigurationError(
                "PostgresStore takes a postgresql:// URL, a libpq conninfo string or a "
                f"psycopg_pool.ConnectionPool, got {type(conninfo).__name__}"
            )
        self._secrets: tuple[str, ...] = ()
        self.where = "the pool's server"
        if self._conninfo is not None:
            self.where, self._secrets, params = _describe(self._conninfo)
            if "application_name" not in params and "application_name" not in self._kwargs:
                self._kwargs["application_name"] = "outboxkit"

        self._queries = Queries(self.names)
        self._notify = notify
        self._pool_min_size = pool_min_size
        self._pool_max_size = pool_max_size
        self._pool_timeout = float(pool_timeout)
        self._lock = threading.Lock()
        self._closed = False
        self._schema_checked = False
        self._waiters: weakref.WeakSet[NotifyWaiter] = weakref.WeakSet()

        url = self._conninfo
        self.url: str | None = url if url is not None and _is_url(url) else None
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
            "pool_timeout": self._pool_timeout,
        }
        """The options that reproduce this store (with ``url``), for other processes."""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresStore:
        """The factory behind ``open_store("postgresql://...", **options)``.

        Raises:
            ConfigurationError: not a postgresql:// URL, or an unknown or invalid option.
        """
        if not _is_url(url):
            raise ConfigurationError(
                "a PostgreSQL store URL starts with postgresql:// or postgres://, got "
                f"{_scheme_of(url)!r}"
            )
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise ConfigurationError(
                f"unknown PostgreSQL store option(s) {unknown}; known: {sorted(_OPTIONS)}"
            )
        return cls(url, **options)

    def __repr__(self) -> str:
        return f"PostgresStore({self.where}, schema={self.names.schema!r})"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            batches=True,
            waiter=self._notify and self._conninfo is not None,
            transactional_handlers=True,
            concurrent_claimers=True,
            multiprocess=self.url is not None,
            database_clock=True,
            concurrent_batches=True,
        )

    # -- connections ----------------------------------------------------------------------------

    def _get_pool(self) -> ConnectionPool[Any]:
        pool = self._pool
        if pool is not None and not self._closed:
            return pool
        with self._lock:
            if self._closed:
                raise StoreError("this PostgresStore is closed")
            if self._pool is None:
                assert self._conninfo is not None
                self._pool = ConnectionPool(
                    self._conninfo,
                    kwargs={"autocommit": True, **self._kwargs},
                    min_size=self._pool_min_size,
                    max_size=self._pool_max_size,
                    timeout=self._pool_timeout,
                    name=f"outboxkit-{self.names.schema}",
                    open=False,
                )
                self._pool.open(wait=False)
            return self._pool

    @contextmanager
    def _connection(self, doing: str, *, check_schema: bool = True) -> Iterator[Connection]:
        """A pooled connection, live as far as can be told without a round trip.

        Raises:
            StoreUnavailable: no connection could be had (the message says why).
            SchemaError: the first use finds no schema, or one of another version.
        """
        pool = self._get_pool()
        conn = self._getconn(pool, doing)
        try:
            if check_schema and not self._schema_checked:
                self._check_schema(conn)
            yield conn
            if not conn.autocommit and conn.info.transaction_status != TransactionStatus.IDLE:
                conn.commit()  # a pool of the app's own, without autocommit
        except BaseException:
            _rollback_quietly(conn)
            raise
        finally:
            pool.putconn(conn)

    def _getconn(self, pool: ConnectionPool[Any], doing: str) -> Connection:
        # A connection the server dropped while it sat in the pool (restart, pg_terminate_backend)
        # is found here without a round trip and swapped for a new one.
        for _ in range(self._pool_max_size + 2):
            try:
                conn = pool.getconn()
            except PoolTimeout as exc:
                raise self._unreachable(doing) from exc
            except psycopg.Error as exc:
                raise self._error(exc, doing) from exc
            if _alive(conn):
                return conn  # type: ignore[no-any-return]
            log.info("discarding a PostgreSQL connection the server closed")
            pool.putconn(conn)
        raise StoreUnavailable(
            f"PostgreSQL at {self.where} ({doing}): every pooled connection was found closed"
        )

    def _check_schema(self, conn: Connection) -> None:
        try:
            rows = _fetch(conn, self._queries["schema_version"], None)
        except pg_errors.UndefinedTable as exc:
            raise SchemaError(
                f"PostgreSQL at {self.where} has no outboxkit schema in schema "
                f"{self.names.schema!r} (table {self.names.versions!r} is missing): "
                "run migrate() first"
            ) from exc
        except psycopg.Error as exc:
            raise self._error(exc, "read the schema version") from exc
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
                "needs: run migrate()"
            )

    def _run(
        self, name: str, params: Mapping[str, Any] | None, doing: str
    ) -> tuple[list[Row], int]:
        """Run one statement on a pooled connection and commit it; rows and row count."""
        _refuse_naive(params)
        try:
            with self._connection(doing) as conn, conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(self._queries[name], params)
                rows = cur.fetchall() if cur.description is not None else []
                return rows, cur.rowcount
        except psycopg.Error as exc:
            raise self._error(exc, doing) from exc

    def _error(self, exc: psycopg.Error, doing: str, conn: Connection | None = None) -> StoreError:
        """The outboxkit error for a driver error (the password scrubbed from the message).

        A connection the server ended (``exc.sqlstate`` in class 08, or one of
        ``_CONNECTION_ENDED``), or ``conn`` found broken, is a ``StoreUnavailable`` whatever the
        error's class: ``idle_in_transaction_session_timeout`` raises an ``InternalError``.
        """
        message = self._scrub(str(exc).strip()) or type(exc).__name__
        if _connection_ended(exc, conn):
            return StoreUnavailable(
                f"PostgreSQL at {self.where} is unavailable ({doing}): the connection was "
                f"lost: {message}"
            )
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            return StoreUnavailable(
                f"PostgreSQL at {self.where} is unavailable ({doing}): {message}"
            )
        if isinstance(
            exc, pg_errors.UndefinedTable | pg_errors.UndefinedColumn | pg_errors.InvalidSchemaName
        ):
            return SchemaError(
                f"PostgreSQL at {self.where}, schema {self.names.schema!r}: the outboxkit tables "
                f"are missing or out of date ({doing}): {message}; run migrate()"
            )
        return StoreError(
            f"PostgreSQL at {self.where}: {doing} failed: {type(exc).__name__}: {message}"
        )

    def _unreachable(self, doing: str) -> StoreUnavailable:
        """Why the pool has no connection to give: one direct attempt tells."""
        if self._conninfo is None:
            return StoreUnavailable(
                f"no PostgreSQL connection from the pool within {self._pool_timeout:g} s ({doing})"
            )
        kwargs = {**self._kwargs, "autocommit": True}
        if "connect_timeout" not in conninfo_to_dict(self._conninfo):
            kwargs["connect_timeout"] = _PROBE_TIMEOUT
        try:
            with psycopg.connect(self._conninfo, **kwargs):
                pass
        except psycopg.Error as exc:
            reason = self._scrub(str(exc).strip())
            return StoreUnavailable(
                f"cannot connect to PostgreSQL at {self.where} ({doing}): {reason}"
            )
        return StoreUnavailable(
            f"PostgreSQL at {self.where} ({doing}): no free connection in the pool within "
            f"{self._pool_timeout:g} s (pool_max_size={self._pool_max_size})"
        )

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # -- schema ---------------------------------------------------------------------------------

    def migrate(self) -> None:
        """Create or upgrade the schema (and the PostgreSQL schema itself when missing).

        Idempotent, and safe to run from several processes at once: the steps run in one
        transaction under an advisory lock. When the schema is current it only reads, so a role
        without DDL rights may call it.

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
        q = self._queries
        try:
            with (
                self._connection(doing, check_schema=False) as conn,
                conn.transaction(),
            ):
                _fetch(
                    conn, q["lock_migrations"], {"lock_space": _LOCK_SPACE, "lock_key": lock_key}
                )
                if not _fetch(conn, q["find_schema"], {"schema": self.names.schema}):
                    _fetch(conn, q["create_schema"], None)
                table = {"schema": self.names.schema, "table": self.names.versions}
                if not _fetch(conn, q["find_table"], table):
                    _fetch(conn, q["create_versions"], None)
                found = int(_fetch(conn, q["schema_version"], None)[0][0])
                if found > SCHEMA_VERSION:
                    self._check_version(found)
                for version, description in MIGRATIONS:
                    if version > found:
                        log.info("%r: applying schema version %d", self, version)
                        _fetch(conn, q[f"migration_{version}"], None)
                        _fetch(
                            conn,
                            q["record_version"],
                            {"version": version, "description": description},
                        )
        except psycopg.Error as exc:
            raise self._error(exc, doing) from exc
        self._schema_checked = True

    def drop_schema(self) -> None:
        """Drop the store's PostgreSQL schema with everything in it (for test schemas).

        Raises:
            ConfigurationError: the schema is ``public``, which is never dropped.
        """
        if self.names.schema == "public":
            raise ConfigurationError("drop_schema() never drops the public schema")
        try:
            with self._connection("drop the schema", check_schema=False) as conn:
                _fetch(conn, self._queries["drop_schema"], None)
        except psycopg.Error as exc:
            raise self._error(exc, "drop the schema") from exc

    def close(self) -> None:
        """Close the store's own pool and listeners (a pool passed in is left open)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        for waiter in list(self._waiters):
            waiter.close()
        if pool is not None and self._owns_pool:
            pool.close()

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
        with self._connection(f"open {what}") as conn:
            tx = psycopg.Transaction(conn)
            try:
                tx.__enter__()
            except psycopg.Error as exc:
                raise self._error(exc, f"begin {what}", conn) from exc
            try:
                yield conn
            except BaseException as exc:
                if not _abandon(tx, exc):
                    raise
                return
            try:
                tx.__exit__(None, None, None)
            except psycopg.Error as exc:
                raise self._error(exc, f"commit {what}", conn) from exc

    def now(self) -> datetime:
        """The database's clock (``now()`` on the server): the one every poller shares."""
        rows, _ = self._run("clock", None, "read the database clock")
        now: datetime = rows[0][0]
        return now

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
        if not isinstance(conn, psycopg.Connection):
            raise ConfigurationError(
                "the PostgreSQL store enqueues through the app's psycopg.Connection (psycopg 3) "
                f"inside its open transaction, got {conn!r:.80}"
            )
        if conn.closed:
            raise ConfigurationError("enqueue got a closed psycopg connection; nothing was written")
        if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
            raise ConfigurationError(
                "enqueue needs the app's open transaction, so that the event commits or rolls "
                "back with the app's writes; this connection is in autocommit mode outside a "
                "transaction block: use `with conn.transaction():`. Nothing was written."
            )
        doing = f"enqueue {len(events)} event(s)"
        try:
            if not self._schema_checked:
                self._check_schema(conn)
            return self._insert(conn, events, now)
        except psycopg.Error as exc:
            raise self._error(exc, doing) from exc

    def _insert(
        self, conn: Connection, events: Sequence[NewEvent], now: datetime | None
    ) -> list[int]:
        _refuse_naive({"now": now})
        if len(events) == 1:
            (event,) = events
            with conn.cursor(row_factory=tuple_row) as cur:
                cur.execute(
                    self._queries["enqueue_one"],
                    {
                        "now": now,
                        "topic": event.topic,
                        "payload": event.payload_json,
                        "headers": encode_headers(event.headers),
                        "key": event.key,
                        "delay": event.delay,
                        "channel": self.names.channel,
                        "notify": self._notify,
                    },
                )
                row = cur.fetchone()
            assert row is not None  # an INSERT ... VALUES ... RETURNING returns its row
            return [row[0]]
        rows = _fetch(
            conn,
            self._queries["enqueue"],
            {
                "now": now,
                "events": _batch_document(events),
                "channel": self.names.channel,
                "notify": self._notify,
            },
        )
        return sorted(row[0] for row in rows)  # ids grow in batch order

    # -- the hot path ---------------------------------------------------------------------------

    def claim(self, *, batch_size: int, lease: timedelta, now: datetime | None) -> list[Claim]:
        rows, _ = self._run(
            "claim", {"now": now, "batch_size": batch_size, "lease": lease}, "claim events"
        )
        return sort_claims(
            Claim(
                event=_event(row),
                token=row[12],
                locked_until=row[10],
                done=done_from_pairs(row[13]),
            )
            for row in rows
        )

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[_Delivery]:
        """A delivery transaction on a pooled connection, the event row locked.

        ``tx.connection`` is that ``psycopg.Connection`` in the open transaction: the handler
        reads and writes through it, but must not commit, roll back or close it.

        Raises:
            LeaseLostError: the token is stale (nothing runs, nothing is written).
            HandlerCrashed: the handler ended, broke or closed the transaction it was given.
            StoreUnavailable / StoreError: the database failed (never blamed on the handler).
        """
        with (
            self._connection(f"deliver event {claim.event.id}") as conn,
            self._delivering(conn, claim, now) as delivery,
        ):
            yield delivery

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[_Batch]:
        """One transaction for a claimed batch (``transaction="per_batch"``) on a pooled
        connection: each delivery in a savepoint of it, settlements and lease extensions in
        it, one commit at the end. The rows it delivers stay locked until then."""
        with self._open_transaction("the batch") as conn:
            yield _Batch(self, conn)
            _check_usable(conn, self.where, "the batch")

    @contextmanager
    def _delivering(
        self, conn: Connection, claim: Claim, now: datetime | None, batch: _Batch | None = None
    ) -> Iterator[_Delivery]:
        """A delivery on ``conn``: its own transaction (``frame`` None) or a savepoint of the
        batch's, the event row locked and the token checked; committed (released) on a normal
        exit, rolled back on an exception.

        Round trips: the transaction (or savepoint) opens in the same pipeline sync as the row
        lock, and the record, the settlement and the COMMIT go in one more sync at the end
        (psycopg's pipeline mode, prepared statements): a one-handler event costs the handler's
        own statements plus two. In a ``batch`` the delivery is a savepoint of the batch's
        transaction, and the commit guard is queued once per batch (see ``lock_for_delivery``
        in ``queries.sql``), not per delivery.
        """
        if batch is None:
            frame = _TRANSACTION if conn.autocommit else _IMPLICIT
            lock = self._queries["lock_for_delivery"]
        else:
            frame, lock = _SAVEPOINT, self._queries["lock_in_batch"]
        doing = f"deliver event {claim.event.id}"
        _refuse_naive({"now": now})
        params = {"id": claim.event.id, "token": claim.token, "mark": batch is None}
        try:
            with conn.cursor(row_factory=tuple_row) as cur:
                guard: psycopg.Cursor[Any] | None = None
                with conn.pipeline():
                    if batch is not None and not batch.guarded:
                        guard = conn.cursor()
                        guard.execute(self._queries["lock_for_delivery"], params)
                    if frame.begin:
                        cur.execute(frame.begin)  # one cursor: it keeps the lock's result
                    cur.execute(lock, params)
                owned = cur.fetchall()
                if guard is not None and batch is not None and guard.rowcount == 1:
                    batch.guarded = True
        except BaseException as exc:
            _abort(conn, frame)
            if isinstance(exc, psycopg.Error):
                raise self._error(exc, doing, conn) from exc
            raise
        if not owned:
            _abort(conn, frame)
            raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
        delivery = _Delivery(self, conn, claim, now)
        try:
            yield delivery
            delivery.check_usable()
        except BaseException as exc:
            if (
                conn.broken
                and isinstance(exc, Exception)
                and not isinstance(exc, StoreError)
                and not _session_ended_by_handler(exc)
            ):
                # The server ended the session under the handler (a restart, a terminated
                # backend): the database failed, not the handler, whatever it raised then.
                raise StoreUnavailable(
                    f"PostgreSQL at {self.where} is unavailable ({doing}): the connection was "
                    "lost while a handler ran"
                ) from exc
            ended = _ended_by_handler(conn, exc)
            _abort(conn, frame)
            if ended:
                raise HandlerCrashed(
                    f"event {claim.event.id}: a handler may not commit or roll back its "
                    "delivery transaction (outboxkit commits it together with the delivery "
                    f"record); its writes were rolled back: {exc}"
                ) from exc
            raise
        delivery.finish(frame)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        doing = f"extend {len(claims)} lease(s)"
        try:
            with self._connection(doing) as conn:
                return self._extend_on(conn, claims, lease, now)
        except psycopg.Error as exc:
            raise self._error(exc, doing) from exc

    def _extend_on(
        self, conn: Connection, claims: Sequence[Claim], lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        ordered = sorted(claims, key=lambda c: c.event.id)  # one lock order for every poller
        rows = _fetch(
            conn,
            self._queries["extend"],
            {
                "now": now,
                "lease": lease,
                "ids": [c.event.id for c in ordered],
                "tokens": [c.token for c in ordered],
            },
        )
        return still_owned(claims, {str(token): locked_until for token, locked_until in rows})

    def settle_many(
        self, items: Sequence[tuple[Claim, Settlement, str | None]], *, now: datetime | None
    ) -> list[bool]:
        """``settle`` for several events in one statement (the ``batched_settle`` capability);
        which of them were settled, in order."""
        if not items:
            return []
        doing = f"settle {len(items)} event(s)"
        try:
            with self._connection(doing) as conn:
                return self._settle_many_on(conn, items, now)
        except psycopg.Error as exc:
            raise self._error(exc, doing) from exc

    def _settle_many_on(
        self,
        conn: Connection,
        items: Sequence[tuple[Claim, Settlement, str | None]],
        now: datetime | None,
    ) -> list[bool]:
        values = [settle_values(settlement) for _, settlement, _ in items]
        rows = _fetch(
            conn,
            self._queries["settle_many"],
            {
                "now": now,
                "ids": [claim.event.id for claim, _, _ in items],
                "tokens": [claim.token for claim, _, _ in items],
                "publish": [v.publish for v in values],
                "dead": [v.dead for v in values],
                "retry_after": [v.retry_after for v in values],
                "keeps_error": [v.keeps_error for v in values],
                "errors": [error for _, _, error in items],
            },
        )
        settled = {row[0] for row in rows}
        return [claim.event.id in settled for claim, _, _ in items]

    def _settle_on(
        self,
        conn: Connection,
        claim: Claim,
        settlement: Settlement,
        error: str | None,
        now: datetime | None,
    ) -> bool:
        _refuse_naive({"now": now})
        with conn.cursor() as cur:
            cur.execute(
                self._queries["settle"], settle_params(claim, settlement, error=error, now=now)
            )
            return cur.rowcount == 1

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        if not claims:
            return 0
        ordered = sorted(claims, key=lambda c: c.event.id)
        rows, _ = self._run(
            "release",
            {"ids": [c.event.id for c in ordered], "tokens": [c.token for c in ordered]},
            f"release {len(claims)} claim(s)",
        )
        return len(rows)

    # -- operations -----------------------------------------------------------------------------

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        wanted = sorted(set(ids))
        if not wanted:
            return 0
        rows, _ = self._run(
            "requeue", {"ids": wanted, "now": now}, f"requeue {len(wanted)} event(s)"
        )
        return len(rows)

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        rows, _ = self._run(
            "dead_letters", {"topic": topic, "since": since, "limit": limit}, "list dead letters"
        )
        records = self._records_of([row[0] for row in rows])
        return [
            DeadLetter(
                event=_event(row),
                failed_at=row[9],
                last_error=row[11],
                records=tuple(records.get(row[0], ())),
            )
            for row in rows
        ]

    def get(self, event_id: int) -> Event | None:
        rows, _ = self._run("get", {"id": event_id}, f"read event {event_id}")
        return _event(rows[0]) if rows else None

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        rows, _ = self._run(
            "events", {"after_id": after_id, "topic": topic, "limit": limit}, "list events"
        )
        return [_event(row) for row in rows]

    def records(self, event_id: int) -> list[DeliveryRecord]:
        return self._records_of([event_id]).get(event_id, [])

    def _records_of(self, ids: list[int]) -> dict[int, list[DeliveryRecord]]:
        found: dict[int, list[DeliveryRecord]] = {}
        if not ids:
            return found
        rows, _ = self._run("records", {"ids": ids}, "read delivery records")
        for event_id, handler, outcome, attempt, recorded_at, reason in rows:
            found.setdefault(event_id, []).append(
                record_from_row(
                    event_id=event_id,
                    handler=handler,
                    outcome=outcome,
                    attempt=attempt,
                    recorded_at=recorded_at,
                    reason=reason,
                )
            )
        return found

    def purge_published(self, *, before: datetime, limit: int) -> int:
        _, count = self._run(
            "purge_published", {"before": before, "limit": limit}, "purge published events"
        )
        return count

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        wanted = None if ids is None else sorted(set(ids))
        _, count = self._run(
            "purge_dead", {"ids": wanted, "before": before, "limit": limit}, "purge dead events"
        )
        return count

    def stats(self, *, now: datetime | None) -> Stats:
        rows, _ = self._run("stats", {"now": now}, "count events")
        counts = {"pending": 0, "claimed": 0, "published": 0, "dead": 0}
        by_topic: dict[str, dict[str, int]] = {}
        oldest: datetime | None = None
        for topic, state, count, oldest_due in rows:
            counts[state] += count
            by_topic.setdefault(topic, {})[state] = count
            if oldest_due is not None and (oldest is None or oldest_due < oldest):
                oldest = oldest_due
        return Stats(**counts, by_topic=by_topic, oldest_due_at=oldest)

    # -- wake-ups -------------------------------------------------------------------------------

    def make_waiter(self) -> NotifyWaiter | None:
        """A poller waiter that also returns when an enqueue commits (``LISTEN``), or None
        when notifications are off. It connects on its first ``wait`` and is closed by the
        poller (or by ``close()``)."""
        if not self._notify or self._conninfo is None:
            return None
        waiter = NotifyWaiter(
            self._conninfo, self._kwargs, self._queries["listen"], where=self.where
        )
        self._waiters.add(waiter)
        return waiter

    def explain_claim(self, *, batch_size: int, lease: timedelta, now: datetime | None) -> Any:
        """``EXPLAIN (ANALYZE, FORMAT JSON)`` of one claim, rolled back afterwards.

        For operators and tests checking that the claim walks the due index and that the
        ``LIMIT`` holds. Returns the JSON plan.
        """
        query = b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + self._queries["claim"]
        params = {"now": now, "batch_size": batch_size, "lease": lease}
        try:
            with (
                self._connection("explain the claim") as conn,
                conn.transaction(force_rollback=True),
            ):
                return _fetch(conn, query, params)[0][0]
        except psycopg.Error as exc:
            raise self._error(exc, "explain the claim") from exc


@dataclass(frozen=True, slots=True)
class _Frame:
    """How a delivery opens, ends and abandons its transaction (or its savepoint of a batch's):
    the statements ``_delivering`` sends in the pipeline syncs around the delivery."""

    begin: bytes  # empty: psycopg begins (a connection without autocommit)
    end: bytes
    abort: tuple[bytes, ...]


_TRANSACTION = _Frame(begin=b"BEGIN", end=b"COMMIT", abort=(b"ROLLBACK",))
# A connection without autocommit (a pool of the app's own): psycopg begins the transaction.
_IMPLICIT = _Frame(begin=b"", end=b"COMMIT", abort=(b"ROLLBACK",))
_SAVEPOINT = _Frame(
    begin=b"SAVEPOINT outboxkit_delivery",
    end=b"RELEASE SAVEPOINT outboxkit_delivery",
    abort=(b"ROLLBACK TO SAVEPOINT outboxkit_delivery", b"RELEASE SAVEPOINT outboxkit_delivery"),
)


def _abort(conn: Connection, frame: _Frame) -> None:
    """Roll a delivery back (to its savepoint), quietly: the error that brought us here is the
    one to report, and a connection that cannot roll back is discarded by the pool."""
    if conn.closed or conn.broken or conn.info.transaction_status == TransactionStatus.IDLE:
        return
    try:
        for statement in frame.abort:
            conn.execute(statement)
    except psycopg.Error as exc:
        log.debug("rollback of a delivery failed: %s", exc)


class _Batch:
    """One transaction for a claimed batch (see ``PostgresStore.batch``)."""

    __slots__ = ("_conn", "_store", "guarded")

    def __init__(self, store: PostgresStore, conn: Connection) -> None:
        self._store = store
        self._conn = conn
        self.guarded = False  # the commit guard's trigger is queued in this transaction

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[_Delivery]:
        self._check_open()
        return self._store._delivering(self._conn, claim, now, self)

    def _check_open(self) -> None:
        """A batch whose transaction a handler ended would run every later step outside it
        (autocommitted): refuse them; the batch is abandoned and its events recover by their
        leases."""
        conn = self._conn
        if conn.closed or conn.info.transaction_status != TransactionStatus.INTRANS:
            raise StoreError(
                f"PostgreSQL at {self._store.where}: the batch transaction is no longer open "
                "(a handler ended it, or the connection was lost); the batch is abandoned"
            )

    def settle_many(
        self, items: Sequence[tuple[Claim, Settlement, str | None]], *, now: datetime | None
    ) -> list[bool]:
        """``PostgresStore.settle_many`` inside the batch's transaction."""
        if not items:
            return []
        self._check_open()
        try:
            return self._store._settle_many_on(self._conn, items, now)
        except psycopg.Error as exc:
            raise self._store._error(exc, f"settle {len(items)} event(s)", self._conn) from exc

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        self._check_open()
        try:
            return self._store._extend_on(self._conn, claims, lease, now)
        except psycopg.Error as exc:
            raise self._store._error(exc, f"extend {len(claims)} lease(s)", self._conn) from exc


class _Delivery:
    """One open delivery transaction (see ``PostgresStore.delivery``)."""

    def __init__(
        self, store: PostgresStore, conn: Connection, claim: Claim, now: datetime | None
    ) -> None:
        self._store = store
        self._conn = conn
        self._claim = claim
        self._now = now
        # What finish() writes with the commit: (kind, statement, parameters).
        self._tail: list[tuple[str, bytes, Mapping[str, Any]]] = []

    @property
    def connection(self) -> Connection:
        return self._conn

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        if not events:
            return []
        self.check_usable()
        try:
            return self._store._insert(self._conn, events, self._now)
        except psycopg.Error as exc:
            raise self._store._error(
                exc, f"enqueue {len(events)} follow-up(s)", self._conn
            ) from exc

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """Queue the record; it is written with the commit (``finish``), in the same query."""
        if not outcome.recorded:
            raise ConfigurationError(
                f"only succeeded/rejected outcomes are recorded, got {outcome}"
            )
        self.check_usable()
        params = {
            "event_id": self._claim.event.id,
            "handler": handler,
            "outcome": outcome.value,
            "attempt": self._claim.attempt,
            "now": self._now,
            "reason": reason,
        }
        self._tail.append(("record", self._store._queries["insert_record"], params))

    def finish(self, frame: _Frame) -> None:
        """Write the queued record and settlement and commit (or release), in one pipeline sync.

        Raises:
            StoreError / StoreUnavailable: the database refused or failed (rolled back).
            LeaseLostError: the settlement found the token stale (cannot happen: the row is
                locked and its token was checked in this transaction).
        """
        conn = self._conn
        event_id = self._claim.event.id
        settled: psycopg.Cursor[Any] | None = None  # the settle's own cursor: its row count
        try:
            with conn.cursor() as cur, conn.pipeline():
                for kind, statement, params in self._tail:
                    if kind == "settle":
                        settled = conn.cursor()
                        settled.execute(statement, params)
                    else:
                        cur.execute(statement, params)
                cur.execute(frame.end)
        except pg_errors.UniqueViolation as exc:
            _abort(conn, frame)
            raise StoreError(f"event {event_id} already has a delivery record") from exc
        except psycopg.Error as exc:
            _abort(conn, frame)
            raise self._store._error(exc, f"commit the delivery of event {event_id}", conn) from exc
        if settled is not None and settled.rowcount != 1:
            raise LeaseLostError(f"event {event_id}: claim token is stale")

    def check_usable(self) -> None:
        """The transaction is still the one outboxkit opened (see ``_check_usable``)."""
        _check_usable(self._conn, self._store.where, f"event {self._claim.event.id}")


_CONNECTION_ENDED = frozenset(
    {
        "25P03",  # idle_in_transaction_session_timeout
        "57P01",  # admin_shutdown (also pg_terminate_backend)
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now
        "57P05",  # idle_session_timeout
    }
)
"""SQLSTATEs with which the server ends the session (besides class 08, connection exceptions)."""


def _connection_ended(exc: psycopg.Error, conn: Connection | None = None) -> bool:
    """Whether ``exc`` means the connection is gone: the server ended the session, the
    connection failed (class 08), or ``conn`` is broken."""
    state = exc.sqlstate or ""
    if state.startswith("08") or state in _CONNECTION_ENDED:
        return True
    return conn is not None and conn.broken


_ENDED_BY_HANDLER = frozenset({"25P03"})
"""SQLSTATEs with which the server ends a session because of what the handler did: it left
its delivery transaction idle past ``idle_in_transaction_session_timeout``. A handler failure
(retried, then dead-lettered), not an outage."""


def _session_ended_by_handler(exc: BaseException) -> bool:
    """Whether ``exc``'s chain holds the server's error for a session the handler's own
    idling ended (``_ENDED_BY_HANDLER``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, psycopg.Error) and current.sqlstate in _ENDED_BY_HANDLER:
            return True
        current = current.__cause__ or current.__context__
    return False


def _check_usable(conn: Connection, where: str, what: str) -> None:
    """``conn``'s transaction (delivering ``what``) is still the one outboxkit opened.

    Raises:
        StoreUnavailable: the connection was lost (the database's doing).
        HandlerCrashed: a handler closed the connection, ended the transaction, or left it
            aborted by a failed statement it caught.
    """
    if conn.broken:
        raise StoreUnavailable(f"PostgreSQL at {where}: the connection delivering {what} was lost")
    if conn.closed:
        raise HandlerCrashed(
            f"{what}: a handler closed its delivery connection (outboxkit commits the delivery "
            "transaction together with the delivery record)"
        )
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise HandlerCrashed(
            f"{what}: a statement in the delivery transaction failed and the handler went on; "
            "the transaction is aborted and its writes were rolled back"
        )
    if status != TransactionStatus.INTRANS:
        raise HandlerCrashed(
            f"{what}: a handler may not commit or roll back its delivery transaction "
            "(outboxkit commits it together with the delivery record)"
        )


def _ended_by_handler(conn: Connection, exc: BaseException) -> bool:
    """Whether a handler's failure ``exc`` came with the delivery transaction ended under
    outboxkit (a raw COMMIT the commit guard refused, or a ROLLBACK): the connection is idle."""
    return (
        isinstance(exc, Exception)
        and not isinstance(exc, HandlerCrashed | LeaseLostError | Reject | StoreError)
        and not conn.closed
        and not conn.broken
        and conn.info.transaction_status == TransactionStatus.IDLE
    )


def _refuse_naive(params: Mapping[str, Any] | None) -> None:
    """PostgreSQL would read a naive datetime in the session's time zone: refuse it.

    Raises:
        ConfigurationError: naming the parameter.
    """
    if not params:
        return
    for name, value in params.items():
        if isinstance(value, datetime) and value.utcoffset() is None:
            raise ConfigurationError(
                f"{name} must be a timezone-aware datetime (naive ones are refused), got {value!r}"
            )


def _fetch(conn: Connection, query: bytes, params: Mapping[str, Any] | None) -> list[Row]:
    _refuse_naive(params)
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(query, params)
        return cur.fetchall() if cur.description is not None else []


_json_text = json.JSONEncoder(ensure_ascii=False).encode
_MICROSECOND = timedelta(microseconds=1)


def _batch_document(events: Sequence[NewEvent]) -> str:
    """The ``enqueue`` statement's parameter: a JSON array of ``[topic, payload, headers, key,
    delay_us]``, one per event, built from the already-encoded payloads (no re-encoding; each
    distinct topic is encoded once)."""
    topics = {topic: _json_text(topic) for topic in {e.topic for e in events}}
    return "[{}]".format(
        ",".join(
            f"[{topics[e.topic]},{e.payload_json},{encode_headers(e.headers)},"
            f"{'null' if e.key is None else _json_text(e.key)},"
            f"{e.delay // _MICROSECOND if e.delay else 0}]"
            for e in events
        )
    )


def _event(row: Row) -> Event:
    """An Event from the twelve leading columns of ``get``/``events``/``dead_letters``/``claim``."""
    return event_from_row(
        id=row[0],
        topic=row[1],
        payload=row[2],
        headers=row[3],
        key=row[4],
        created_at=row[5],
        available_at=row[6],
        attempts=row[7],
        published_at=row[8],
        failed_at=row[9],
        locked_until=row[10],
        last_error=row[11],
    )


def _abandon(tx: psycopg.Transaction, exc: BaseException) -> bool:
    """Roll ``tx`` back because of ``exc``; True if psycopg swallows it (``psycopg.Rollback``).

    A failed rollback (the connection is gone) is logged by psycopg, never raised: it must not
    mask ``exc``.
    """
    return bool(tx.__exit__(type(exc), exc, exc.__traceback__))


def _rollback_quietly(conn: Connection) -> None:
    if conn.closed or conn.info.transaction_status == TransactionStatus.IDLE:
        return
    try:
        conn.rollback()
    except psycopg.Error as exc:
        log.debug("rollback failed on a connection going back to the pool: %s", exc)


def _alive(conn: Connection) -> bool:
    """False if the server has dropped ``conn`` while it sat idle in the pool.

    An idle connection's socket stays silent unless the server speaks first, which in practice
    means it is hanging up (a FATAL such as "terminating connection due to administrator
    command", then the end of the stream). So a silent socket costs no round trip; only one
    that spoke is checked with an empty query.
    """
    if conn.closed:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    if not readable:
        return True
    try:
        ConnectionPool.check_connection(conn)
    except psycopg.Error:
        return False
    return conn.pgconn.status == ConnStatus.OK


def _is_url(conninfo: object) -> bool:
    return isinstance(conninfo, str) and _scheme_of(conninfo) in _SCHEMES


def _scheme_of(url: object) -> str:
    if not isinstance(url, str) or "://" not in url:
        return ""
    return url.split("://", 1)[0].lower()


def _describe(conninfo: str) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    """``host:port/dbname`` for messages, the secrets to keep out of them, and the params.

    Raises:
        ConfigurationError: the string does not parse (the message never quotes it).
    """
    secrets: set[str] = set()
    if _is_url(conninfo):
        try:
            password = urlsplit(conninfo).password
        except ValueError:
            password = None
        if password:
            secrets.add(password)
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise ConfigurationError(
            "cannot parse the PostgreSQL connection string (not shown: it may hold a password): "
            f"{_scrub_all(str(exc), secrets)}"
        ) from None
    given = params.get("password")
    if given:
        secrets.add(str(given))
    # Short "secrets" would blot out ordinary words; libpq never echoes a password anyway.
    secrets = {s for s in secrets if len(s) >= 4}
    secrets |= {quote(s, safe="") for s in secrets}
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = params.get("dbname")
    where = f"{host}:{port}" + (f"/{dbname}" if dbname else "")
    ordered = tuple(sorted(secrets, key=len, reverse=True))
    return _scrub_all(where, ordered), ordered, params


def _scrub_all(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text
