"""The SQLite store's schema: versioned steps, applied with sqlite-utils.

The version table keeps one row per step applied; the schema's version is the highest. Steps run
inside the caller's write transaction (``BEGIN IMMEDIATE``), so processes opening the same file at
once serialize and exactly one of them migrates; sqlite-utils nests its own writes in savepoints.

Version 1: the events table (``AUTOINCREMENT`` ids, never reused after a purge), the delivery
records (primary key ``(event_id, handler)``) and the version table. Version 2: the indexes the hot
path and the operations use (due events in claim order, tokens, dead and published events).
Version 3: the token index is dropped; extend and release reach their rows by id (the claim set a
token and the settle cleared it, so every claim and every settle paid for that index).
Version 4: a trigger deletes an event's delivery records with it (``{events}_purge``), so a purge
is one statement, as on PostgreSQL (``ON DELETE CASCADE``); it costs nothing but on delete.
Version 5: per-key ordering and idempotent enqueue (R15, R16): the ``dedupe_key`` column, its
unique index, and the index the claim asks whether an earlier event of a key holds it up.
Version 6: the message identity, ``message_id`` (16 random bytes the inserts draw); rows written
before keep NULL, and their identity stays their decimal id. Version 7: ``errors``, the error of
each failed attempt (a JSON array the settlements append to); NULL until an attempt fails.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from sqlite_utils import Database

from outboxkit.errors import SchemaError

from .tables import TableNames, render_queries

__all__ = ["SCHEMA_VERSION", "current_version", "migrate"]

SCHEMA_VERSION = 7


def current_version(conn: sqlite3.Connection, tables: TableNames) -> int:
    """The schema version of the database behind ``conn``; 0 when it has no outboxkit schema."""
    db = _database(conn)
    if not db.table(tables.schema).exists():
        return 0
    (row,) = db.table(tables.schema).rows_where(select="max(version) AS version")
    return int(row["version"] or 0)


def check_version(version: int, where: str) -> None:
    """Refuse a schema newer than this code.

    Raises:
        SchemaError: naming both versions.
    """
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{where} has outboxkit schema version {version}, newer than the version "
            f"{SCHEMA_VERSION} this outboxkit supports: upgrade outboxkit"
        )


def migrate(
    conn: sqlite3.Connection,
    tables: TableNames,
    *,
    applied_at: int,
    where: str,
    target: int = SCHEMA_VERSION,
) -> int:
    """Bring the schema up to ``target`` inside ``conn``'s open write transaction.

    Returns:
        The version found before migrating.

    Raises:
        SchemaError: the schema is newer than this code, or the tables clash with others.
    """
    found = current_version(conn, tables)
    check_version(found, where)
    db = _database(conn)
    for version, step in _STEPS:
        if found < version <= target:
            try:
                step(db, tables)
            except sqlite3.OperationalError as exc:
                if "already exists" not in str(exc):
                    raise
                raise SchemaError(
                    f"{where}: cannot create outboxkit schema version {version}: {exc} "
                    "(choose other table names with table_prefix / *_table options)"
                ) from exc
            db.table(tables.schema).insert({"version": version, "applied_at": applied_at})
    return found


def _database(conn: sqlite3.Connection) -> Database:
    return Database(conn, recursive_triggers=False, execute_plugins=False)


def _v1_tables(db: Database, tables: TableNames) -> None:
    names = tables.placeholders()
    # sqlite-utils has no AUTOINCREMENT option; without it SQLite may reuse the ids of purged
    # events, so the events table is the one written out by hand.
    db.execute(
        """
        CREATE TABLE {events} (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            topic TEXT NOT NULL,
            payload TEXT NOT NULL,
            headers TEXT NOT NULL,
            key TEXT,
            created_at INTEGER NOT NULL,
            available_at INTEGER NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            locked_until INTEGER,
            token TEXT,
            published_at INTEGER,
            failed_at INTEGER,
            last_error TEXT
        )
        """.format(**names)
    )
    db.table(tables.deliveries).create(
        {
            "event_id": int,
            "handler": str,
            "outcome": str,
            "attempt": int,
            "recorded_at": int,
            "reason": str,
        },
        pk=("event_id", "handler"),
        not_null={"event_id", "handler", "outcome", "attempt", "recorded_at"},
    )
    db.table(tables.schema).create(
        {"version": int, "applied_at": int}, pk="version", not_null={"applied_at"}
    )


def _v2_indexes(db: Database, tables: TableNames) -> None:
    # Partial indexes: sqlite-utils' create_index has no WHERE clause.
    for statement in (
        # R2/R3: due events in claim order, among the ones not yet settled for good.
        "CREATE INDEX {events_due} ON {events} (available_at, id)"
        " WHERE published_at IS NULL AND failed_at IS NULL",
        "CREATE INDEX {events_token} ON {events} (token) WHERE token IS NOT NULL",
        "CREATE INDEX {events_failed} ON {events} (failed_at, id) WHERE failed_at IS NOT NULL",
        "CREATE INDEX {events_published} ON {events} (published_at) WHERE published_at IS NOT NULL",
    ):
        db.execute(statement.format(**tables.placeholders()))


def _v3_no_token_index(db: Database, tables: TableNames) -> None:
    db.execute("DROP INDEX IF EXISTS {events_token}".format(**tables.placeholders()))


def _v4_purge_trigger(db: Database, tables: TableNames) -> None:
    db.execute(render_queries(tables)["create_purge_trigger"])


def _v5_order_indexes(db: Database, tables: TableNames) -> None:
    for statement in render_queries(tables)["create_order_indexes"].split(";"):
        db.execute(statement)


def _v6_message_id(db: Database, tables: TableNames) -> None:
    db.execute(render_queries(tables)["create_message_id"])


def _v7_errors(db: Database, tables: TableNames) -> None:
    db.execute(render_queries(tables)["create_errors"])


_STEPS: tuple[tuple[int, Callable[[Database, TableNames], None]], ...] = (
    (1, _v1_tables),
    (2, _v2_indexes),
    (3, _v3_no_token_index),
    (4, _v4_purge_trigger),
    (5, _v5_order_indexes),
    (6, _v6_message_id),
    (7, _v7_errors),
)
