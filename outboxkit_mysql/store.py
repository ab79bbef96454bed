"""The MariaDB/MySQL store (``mysql://user:pass@host:3306/db``), on PyMySQL.

Theory of operation:

- The SQL is in ``queries.sql``; the operations every SQL store shares are
  ``outboxkit.storekit.sql.SQLStore``'s, run on ``MySQLDialect`` (connections, error table,
  values). MariaDB has no ``UPDATE ... RETURNING``: those statements are steps
  (``outboxkit.storekit.queries.run_steps``) that pick and lock the rows, change them, and
  read them back, in one transaction.
- A claim locks its due rows with ``FOR UPDATE SKIP LOCKED`` (MariaDB 10.6+, MySQL 8): two
  claimers, in any processes, never get the same event (R3).
- R15, per-key order in commit order: ``AUTO_INCREMENT`` hands out ids at insert, not at
  commit, so a keyed enqueue numbers its event from the key's row in a keys table, bumped by an
  upsert that keeps the row locked until the enqueuing transaction ends: a second enqueuer of
  the key waits there, so a key's numbers follow its commit order, and under READ COMMITTED a
  claim that sees an event of the key sees every earlier one. Only enqueuers of one key wait
  for each other (the keys table's row lock is a record lock on its primary key: no gap lock).
- R17: a delivery runs in an XA transaction, which the server keeps a handler from ending
  (``delivery``). R18: a connection a handler had gets the store's session settings again
  before it serves another delivery.
- Every instant comes from the database's clock (``UTC_TIMESTAMP(6)``) unless a test clock's is
  bound; ``now()`` reads it too, so every cutoff is the database's.
- No asyncio side (``capabilities.asyncio`` is false): PyMySQL is blocking, and the asyncio
  drivers (aiomysql, asyncmy) are other libraries with other connection types, so an asyncio
  side would be a second store's worth of code for the same SQL; the blocking pollers run
  handlers of asyncio apps in threads.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any

import pymysql
from pymysql.constants import SERVER_STATUS

from outboxkit.storekit import (
    Capabilities,
    Claim,
    ConfigurationError,
    NewEvent,
    StoreError,
)
from outboxkit.storekit.names import (
    check_count,
    check_options,
    table_names,
    validate_identifier,
)
from outboxkit.storekit.rows import encode_headers
from outboxkit.storekit.sql import SQLStore

from .delivery import Batch, Delivery, batch_on, delivery_of
from .dialect import MySQLDialect, StoreConnection, map_error

__all__ = ["SCHEMA_VERSION", "MySQLStore"]

SCHEMA_VERSION = 1
_PARAMETER = re.compile(r"%\((\w+)\)s")
_OPTIONS = frozenset(
    {"table_prefix", "events_table", "deliveries_table", "schema_table", "keys_table", "pool_size"}
)


class MySQLStore(SQLStore):
    """The MariaDB/MySQL store. Thread-safe; several processes may share the database.

    Args:
        url: ``mysql://user:password@host:port/database`` (``mariadb://`` too).
        table_prefix: prefix of the four table names (``outbox_events``, ``outbox_deliveries``,
            ``outbox_keys``, ``outbox_schema``).
        events_table: the events table's name, instead of the prefix's.
        deliveries_table: the delivery records'.
        keys_table: the ordering keys'.
        schema_table: the schema versions'.
        pool_size: how many idle connections the store keeps (default 10).

    Raises:
        ConfigurationError: a bad URL, option or table name.
    """

    sql_dialect = "mysql"
    """The SQL dialect of the store's database, by SQLAlchemy's name for it."""

    dialect: MySQLDialect
    schema_version = SCHEMA_VERSION

    def __init__(
        self,
        url: str,
        *,
        table_prefix: str = "outbox_",
        events_table: str | None = None,
        deliveries_table: str | None = None,
        keys_table: str | None = None,
        schema_table: str | None = None,
        pool_size: int = 10,
    ) -> None:
        events, deliveries, schema = table_names(
            table_prefix, events_table, deliveries_table, schema_table
        )
        keys = validate_identifier(
            f"{table_prefix}keys" if keys_table is None else keys_table, "keys_table"
        )
        if len({events, deliveries, keys, schema}) != 4:
            raise ConfigurationError(
                f"the MySQL store's four tables need four names, got {events}, {deliveries}, "
                f"{keys}, {schema}"
            )
        pool_size = check_count("pool_size", pool_size, minimum=1, maximum=1000)
        super().__init__(MySQLDialect(url, (events, deliveries, keys, schema), pool_size=pool_size))
        self.url: str | None = url
        self.options: dict[str, Any] = {
            "events_table": events,
            "deliveries_table": deliveries,
            "keys_table": keys,
            "schema_table": schema,
            "pool_size": pool_size,
        }
        self.capabilities = Capabilities(
            batches=True,
            transactional_handlers=True,
            concurrent_claimers=True,
            concurrent_batches=True,
            multiprocess=True,
            database_clock=True,
            ordering=True,
            dedupe=True,
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MySQLStore:
        """The factory behind ``open_store("mysql://...")``; options as for the constructor.

        Raises:
            ConfigurationError: a bad URL or option.
        """
        check_options(options, _OPTIONS, store="MySQL")
        return cls(url, **options)

    def __repr__(self) -> str:
        return f"MySQLStore({self.dialect.where!r})"

    def drop_tables(self) -> None:
        """Drop the store's four tables (tests, and uninstalling)."""
        with self.dialect.connection("drop the tables") as conn:
            self.dialect.execute(conn, "drop_tables", {})

    # -- enqueue --------------------------------------------------------------------------------

    def transaction(self) -> AbstractContextManager[StoreConnection]:
        """A store connection in a transaction: committed when the block ends, rolled back if it
        raises. ``enqueue`` accepts it.

        Raises:
            StoreError: the transaction could not begin or commit.
        """
        return self.dialect.write("run a transaction")

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        """Insert ``events`` through the app's connection, in its open transaction (R1).

        ``conn`` is a DB-API connection to the server (PyMySQL's, mysqlclient's: what Django's
        MySQL backend holds, or ``session.connection().connection`` under SQLAlchemy) or what
        ``transaction()`` yields. The tables are named with the store's database, so the app's
        connection may have another one selected. Never begins, commits or rolls back.

        Returns:
            The new ids, in the order of ``events`` (R16: a dedupe key's holder's id).

        Raises:
            ConfigurationError: ``conn`` has no cursor, or is a PyMySQL connection in autocommit
                mode outside a transaction (nothing is written).
            SchemaError: the database has no outboxkit tables.
            StoreError: the database failed (the app's transaction is left to the app).
        """
        if not callable(getattr(conn, "cursor", None)):
            raise ConfigurationError(
                f"the MySQL store enqueues through a DB-API connection, got {type(conn).__name__}"
            )
        if isinstance(conn, pymysql.connections.Connection) and (
            conn.get_autocommit() and not conn.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS
        ):
            raise ConfigurationError(
                "enqueue needs the app's open transaction, so that the event commits or rolls "
                "back with the app's writes; this PyMySQL connection is in autocommit mode "
                "with none open: call conn.begin() first. Nothing was written."
            )
        return self.insert(conn, events, self.dialect.instant(now))

    def inserts(
        self, events: Sequence[NewEvent], now: datetime | None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """The statements of an enqueue, in order: the keys upserted sorted first (R15: two
        transactions enqueueing the same keys never deadlock), again for a key's later
        events, and one ``insert_event`` per event (its parameters carry ``message_id``)."""
        dialect = self.dialect
        (upsert,) = dialect.queries["upsert_key"]
        (insert,) = dialect.queries["insert_event"]
        fresh = sorted({e.key for e in events if e.key is not None})
        yield from ((upsert, {"key": key}) for key in fresh)
        for event in events:
            if event.key is not None and event.key not in fresh:
                yield upsert, {"key": event.key}
            if event.key in fresh:
                fresh.remove(event.key)
            yield (
                insert,
                {
                    "topic": event.topic,
                    "payload": event.payload_json,
                    "headers": encode_headers(event.headers),
                    "key": event.key,
                    "now": now,
                    "at": dialect.instant(event.available_at),
                    "delay": dialect.duration(event.delay),
                    "message_id": str(uuid.uuid4()),
                    "dedupe_key": event.dedupe_key,
                },
            )

    def insert(self, conn: Any, events: Sequence[NewEvent], now: datetime | None) -> list[int]:
        """``enqueue`` on ``conn``, the instant already bound; the new ids."""
        ids: list[int] = []
        try:
            with conn.cursor() as cur:
                for sql, params in self.inserts(events, now):
                    cur.execute(sql, params)
                    if "message_id" in params:
                        ids.append(int(cur.lastrowid))
        except pymysql.err.Error as exc:
            raise map_error(exc, self.dialect.where, f"enqueue {len(events)} event(s)") from exc
        except Exception as exc:  # mysqlclient's (Django's MySQL backend)
            if type(exc).__module__.startswith("MySQLdb"):
                raise StoreError(f"{self.dialect.where}: enqueue failed: {exc}") from exc
            raise
        return ids

    def portable_enqueue(
        self, events: Sequence[NewEvent], now: datetime | None
    ) -> list[tuple[str, dict[str, Any]]]:
        """``enqueue``'s statements for a connection another library drives (SQLAlchemy's),
        with ``:name`` parameters: after each event's insert, ``last_insert_id`` returns its id
        (or its dedupe key's holder's) as its one row, in the same session.

        Raises:
            ConfigurationError: ``now`` is naive.
        """
        (last_id,) = self.dialect.queries["last_insert_id"]
        statements: list[tuple[str, dict[str, Any]]] = []
        for sql, params in self.inserts(events, self.dialect.instant(now)):
            statements.append((_PARAMETER.sub(r":\1", sql), params))
            if "message_id" in params:  # an event's insert (not a key's upsert)
                statements.append((last_id, {}))
        return statements

    # -- deliveries -----------------------------------------------------------------------------

    def delivery(self, claim: Claim, *, now: datetime | None) -> AbstractContextManager[Delivery]:
        """A delivery transaction: an XA transaction on a store connection, opened (and the
        claim's token checked, the event's row locked) with the handler's first statement on
        ``tx.connection``, in its round trip (a stale token: ``LeaseLostError`` instead of its
        answer); a block that never takes it ends with its record in one fenced statement.

        ``tx.connection`` is the store's PyMySQL connection; the handler may read, write and
        use savepoints on it, but not commit, roll back or close it (R17).

        Raises:
            LeaseLostError: the token is stale (nothing is written).
            HandlerCrashed: the handler tried to end the transaction.
            StoreUnavailable: the database failed under the handler (a deadlock, a lost
                connection), whatever the handler raised.
            StoreError: the database failed.
        """
        return delivery_of(self, claim, now)

    def batch(self, *, now: datetime | None) -> AbstractContextManager[Batch]:
        """One XA transaction for a claimed batch (``transaction="per_batch"``), a savepoint
        per delivery, committed once."""
        return batch_on(self)
