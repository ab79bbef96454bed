"""The PostgreSQL dialect of the SQL seam (``outboxkit.storekit.sql``): what ``PostgresStore``
and its helpers (``flow``, ``delivery``, ``pipeline``, ``aio``) share, as public members.

``PostgresDialect`` holds the store's connections (``pool.Pool``), its names and the statements
rendered with them (``names.Queries``), the checks of what is bound (naive datetimes refused),
the error mapping by SQLSTATE (``errors``), the schema check of the first use, the checks of an
app's connection, and the insert of events (which statement an enqueue runs).
``PostgresStatements`` picks ``publish_recording`` for a batch's usual settlement, and reads
the rows psycopg returns (``timestamptz`` columns load as aware datetimes already).

Every write is one statement, autocommitted on the store's own connections (``read`` and
``write`` are the same pooled connection); a delivery begins its transaction itself
(``flow``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from outboxkit.core.machine import Publish
from outboxkit.core.model import Event, NewEvent, Outcome
from outboxkit.errors import ConfigurationError, SchemaError, StoreError, migrate_hint
from outboxkit.store import SettleItem
from outboxkit.storekit.rows import encode_headers, event_from_row, inserted_ids, resolve_ids
from outboxkit.storekit.sql import Dialect, Query, Row, Statements

from .errors import map_error
from .flow import has_rows
from .names import Names, Queries, prepared
from .pool import AnyConnection, Connection, Pool

__all__ = ["PostgresDialect", "PostgresStatements", "batch_document", "without_keys"]

_SUCCEEDED = Outcome.SUCCEEDED.value


class PostgresDialect(Dialect):
    """PostgreSQL for ``SQLStore`` (see the module docstring).

    Args:
        pool: where the store's connections come from.
        names: the store's validated names (schema, tables, channel).
        notify: an enqueue queues a ``NOTIFY`` on ``names.channel``.
        schema_version: the schema version the store reads and writes (checked at first use).

    Attributes:
        pool: the store's connections.
        names: the store's names; ``queries``: every statement rendered with them.
        notify: whether an enqueue notifies.
        schema_version: the version the first use expects.
        schema_checked: the first use found the schema at that version (either side's).
        partitioned: the store is opened for the partitioned layout (``partition_size``).
    """

    name = "postgresql"
    payload_is_json = True  # jsonb: a claimed payload is decoded on first read
    settles_recording = True  # a batch's settlement and kept records: one statement

    def __init__(self, pool: Pool, names: Names, *, notify: bool, schema_version: int) -> None:
        self.pool = pool
        self.names = names
        self.notify = notify
        self.schema_version = schema_version
        self.where = pool.where
        self.queries = Queries(names)
        self.schema_checked = False
        self.partitioned = False  # the partitioned layout (set by the store)

    # -- errors -----------------------------------------------------------------------------------

    @contextmanager
    def mapped(self, doing: str, conn: Any = None) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as exc:
            raise self.error(exc, doing, conn) from exc

    def error(
        self, exc: psycopg.Error, doing: str, conn: AnyConnection | None = None
    ) -> StoreError:
        """The outboxkit error for a driver error (the password scrubbed from the message)."""
        return map_error(
            exc,
            where=self.where,
            schema=self.names.schema,
            doing=doing,
            scrub=self.pool.scrub,
            conn=conn,
        )

    @staticmethod
    def params(params: Mapping[str, Any]) -> Mapping[str, Any]:
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

    # -- connections ------------------------------------------------------------------------------

    @contextmanager
    def connection(self, doing: str, *, check_schema: bool = True) -> Iterator[Connection]:
        """A pooled connection; on first use, the schema's version is checked.

        Raises:
            StoreUnavailable: no connection could be had (the message says why).
            SchemaError: the first use finds no schema, or one of another version.
        """
        with self.pool.connection(doing) as conn:
            if check_schema and not self.schema_checked:
                self.check_schema(conn)
            yield conn

    @contextmanager
    def read(self, doing: str) -> Iterator[Connection]:
        # One statement is one transaction (autocommit); several reads need no one snapshot here.
        with self.mapped(doing), self.connection(doing) as conn:
            yield conn

    write = read  # every write is one statement: atomic by itself

    def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        with conn.cursor(row_factory=tuple_row) as cur:
            # No parameters: none at all, so a % in the statement (a function body) is kept.
            cur.execute(
                self.queries[name], self.params(params) or None, prepare=prepared(conn, name)
            )
            return cur.fetchall() if has_rows(cur) else []

    @contextmanager
    def open_transaction(self, what: str) -> Iterator[Connection]:
        """A pooled connection in a psycopg transaction: committed when the block ends, rolled
        back if it raises; driver errors mapped, naming ``what`` (``transaction``, ``batch``)."""
        with self.connection(f"open {what}") as conn, self.transaction_on(conn, what):
            yield conn

    @contextmanager
    def transaction_on(self, conn: Connection, what: str) -> Iterator[None]:
        """A psycopg transaction on ``conn`` (``open_transaction``)."""
        tx = psycopg.Transaction(conn)
        with self.mapped(f"begin {what}", conn):
            tx.__enter__()
        try:
            yield
        except BaseException as exc:
            # A failed rollback (the connection is gone) is logged by psycopg, never
            # raised: it must not mask ``exc``.
            if not tx.__exit__(type(exc), exc, exc.__traceback__):
                raise
            return
        with self.mapped(f"commit {what}", conn):
            tx.__exit__(None, None, None)

    # -- the schema -------------------------------------------------------------------------------

    def check_schema(self, conn: Connection) -> None:
        """Read the schema's version on ``conn`` and check it (``schema_found``).

        Raises:
            SchemaError: no schema, or one of another version.
        """
        try:
            rows = self.rows(conn, "schema_version", {})
        except psycopg.Error as exc:
            raise self.schema_error(exc) from exc
        self.schema_found(rows)

    def schema_error(self, exc: psycopg.Error) -> StoreError:
        """What a failed read of the schema version means (both sides' first use)."""
        if isinstance(exc, pg_errors.UndefinedTable):
            return SchemaError(
                f"PostgreSQL at {self.where} has no outboxkit schema in schema "
                f"{self.names.schema!r} (table {self.names.versions!r} is missing): "
                f"{migrate_hint()}"
            )
        return self.error(exc, "read the schema version")

    def schema_found(self, rows: Sequence[Row]) -> None:
        """The schema version read (``schema_version``): checked once per store.

        Raises:
            SchemaError: another version than this code's.
        """
        self.check_version(int(rows[0][0]))
        self.check_layout(bool(rows[0][1]))
        self.schema_checked = True

    def check_layout(self, partitioned: bool) -> None:
        """Raises:
        SchemaError: the events table is partitioned and the store was not opened for it
            (or the other way round), naming the option."""
        if partitioned == self.partitioned:
            return
        table = f"{self.names.schema}.{self.names.events}"
        if partitioned:
            raise SchemaError(
                f"PostgreSQL at {self.where}: table {table} has the partitioned layout: open the "
                "store with the partition_size it was made with (PostgresStore(..., "
                "partition_size=N), open_store(url, partition_size=N))"
            )
        raise SchemaError(
            f"PostgreSQL at {self.where}: the store was opened with partition_size but table "
            f"{table} is not partitioned: run migrate() to convert it (see the operations guide)"
        )

    def check_version(self, found: int) -> None:
        """Raises:
        SchemaError: ``found`` is not ``schema_version`` (naming both, and what to do)."""
        expected = self.schema_version
        if found > expected:
            raise SchemaError(
                f"PostgreSQL at {self.where}, schema {self.names.schema!r}: the outboxkit schema "
                f"is at version {found}, newer than version {expected} this outboxkit "
                "supports: upgrade outboxkit"
            )
        if found < expected:
            raise SchemaError(
                f"PostgreSQL at {self.where}, schema {self.names.schema!r}: the outboxkit schema "
                f"is at version {found}, older than version {expected} this outboxkit "
                f"needs: {migrate_hint()}"
            )

    # -- enqueue ----------------------------------------------------------------------------------

    @staticmethod
    def check_app_connection(
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

    def insert_query(self, events: Sequence[NewEvent], now: datetime | None) -> Query:
        """The statement that inserts ``events`` (and queues the notification), by name, and
        its parameters: ``enqueue_one`` for one event, else ``enqueue_plain`` for a batch
        without keys or dedupe keys, else ``enqueue``."""
        channel = {"channel": self.names.channel, "notify": self.notify}
        plain = without_keys(events)
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
        name = "enqueue_plain" if plain else "enqueue_keyed" if self.partitioned else "enqueue"
        return name, {"now": now, "events": batch_document(events), **channel}

    @staticmethod
    def inserted(name: str, rows: Sequence[Row]) -> list[int]:
        """The new ids from ``enqueue_one``'s rows."""
        return [rows[0][0]]

    def insert(
        self, conn: Connection, events: Sequence[NewEvent], now: datetime | None
    ) -> list[int]:
        """Insert ``events`` on ``conn``, in the transaction open on it; the new ids, in
        ``events`` order (a dedupe key's holder for an event it kept out)."""
        name, params = self.insert_query(events, now)
        rows = self.rows(conn, name, params)
        if name == "enqueue_one":
            return self.inserted(name, rows)
        ids, missing = inserted_ids(events, rows)
        # A statement of its own: its fresh snapshot sees a holder that a concurrent
        # transaction committed while the insert waited for it (READ COMMITTED).
        found: dict[str, int] = {}
        if missing:
            found = {k: i for k, i in self.rows(conn, "dedupe_holders", {"keys": missing})}
        return resolve_ids(events, ids, found)

    # -- values -----------------------------------------------------------------------------------
    # Instants, durations and arrays are bound as they are (``Dialect``'s defaults): psycopg
    # binds aware datetimes, timedeltas and lists, and None is the database's clock
    # (``coalesce(%(now)s, now())``).

    def records_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        names = ("ids", "tokens", "handlers", "outcomes", "attempts", "ats", "reasons")
        return _arrays(names, rows)

    def settle_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        names = ("ids", "tokens", "publish", "dead", "retry_after", "keeps_error", "errors")
        return _arrays(names, rows)

    # -- wake-ups ---------------------------------------------------------------------------------

    def listening(self, *, asyncio: bool) -> dict[str, Any]:
        """A ``LISTEN`` waiter's arguments (either side's)."""
        pool = self.pool
        assert pool.listening_to is not None
        return {
            "conninfo": pool.listening_to,
            "kwargs": pool.connect_kwargs(asyncio=asyncio),
            "listen": self.queries["listen"],
            "where": pool.listening_where,
            "scrub": pool.scrub,
        }


class PostgresStatements(Statements):
    """The shared statements, with PostgreSQL's choices: a claimed row's instants as psycopg
    loaded them, and ``publish_recording`` for a batch's usual settlement."""

    def event(self, row: Row) -> Event:
        # psycopg loads the timestamptz columns as aware datetimes already
        return event_from_row(row, None, json_column=True)

    def settle_kept(
        self, items: Sequence[SettleItem], kept: Sequence[tuple[Any, ...]], now: datetime | None
    ) -> Query | None:
        """``publish_recording`` when every item publishes and every kept record is a success
        stamped with ``now`` (rows of ``RECORD_COLUMNS``), else the seam's choice."""
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
        return super().settle_kept(items, kept, now)


_json_text = json.JSONEncoder(ensure_ascii=False).encode
_MICROSECOND = timedelta(microseconds=1)


def without_keys(events: Sequence[NewEvent]) -> bool:
    """Whether no event of ``events`` has a key or a dedupe key (``enqueue_plain`` inserts
    them)."""
    return all(e.key is None and e.dedupe_key is None for e in events)


def batch_document(events: Sequence[NewEvent]) -> str:
    """The ``enqueue`` statement's parameter: a JSON array of ``[topic, payload, headers, key,
    delay_us, dedupe_key, available_at]``, one per event, built from the already-encoded
    payloads (no re-encoding; each distinct topic is encoded once)."""
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
