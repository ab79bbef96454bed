"""PostgreSQL's errors as outboxkit's: a table keyed by SQLSTATE, as psycopg's own
``errors`` module maps codes to classes.

A code is looked up whole, then by its class (the first two characters); a connection psycopg
found broken is an outage whatever the code. Messages name host, port and database (never the
password) and what was being done.

One family is told apart before the table: the server-side prepared statements psycopg makes
(``prepare_threshold``) lost or mixed up by a connection pooler in transaction mode, such as
PgBouncer, which runs each transaction on whichever server connection is free
(``pooler_mixup``). Such an error is not an outage: it says what to set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from outboxkit.errors import (
    SchemaError,
    SerializationFailure,
    StoreError,
    StoreUnavailable,
    chain,
    migrate_hint,
)

__all__ = [
    "ENDED_BY_HANDLER",
    "POOLER_HINT",
    "SQLSTATES",
    "error_class",
    "map_error",
    "pooler_mixup",
    "session_ended_by_handler",
]

SQLSTATES: dict[str, type[StoreError]] = {
    "08": StoreUnavailable,  # class 08, connection exception: refused, lost, failed
    "25P03": StoreUnavailable,  # idle_in_transaction_session_timeout: the server ended it
    "57P01": StoreUnavailable,  # admin_shutdown, also pg_terminate_backend
    "57P02": StoreUnavailable,  # crash_shutdown
    "57P03": StoreUnavailable,  # cannot_connect_now (starting up, shutting down)
    "57P05": StoreUnavailable,  # idle_session_timeout
    "53300": StoreUnavailable,  # too_many_connections
    # A concurrent transaction won: the caller retries its whole transaction. Deadlocks too:
    # PostgreSQL resolves one by aborting one of its transactions, which, run again, succeeds
    # like after a serialization failure; both are class 40 (transaction_rollback), and
    # psycopg makes both OperationalErrors, which read as an outage before.
    "40001": SerializationFailure,  # serialization_failure
    "40P01": SerializationFailure,  # deadlock_detected
    "42P01": SchemaError,  # undefined_table: no schema yet (or another one)
    "42703": SchemaError,  # undefined_column: an older schema
    "3F000": SchemaError,  # invalid_schema_name
    "42883": SchemaError,  # undefined_function: the commit guard is missing
}
"""SQLSTATE (or its two-character class) -> the outboxkit error it is; anything else is a
``StoreError``."""

_SESSION_ENDED = frozenset({"08", "25P03", "57P01", "57P02", "57P03", "57P05"})
"""The codes with which the connection itself is gone (messages say "the connection was lost")."""

ENDED_BY_HANDLER = frozenset({"25P03"})
"""SQLSTATEs with which the server ends a session because of what the handler did: it left
its delivery transaction idle past ``idle_in_transaction_session_timeout``. A handler failure
(retried, then dead-lettered), not an outage."""


_PREPARED_LOST = frozenset({"26000", "42P05"})
"""invalid_sql_statement_name (``prepared statement "_pg3_0" does not exist``) and
duplicate_prepared_statement (``prepared statement "_pg3_0" already exists``): outboxkit never
names a prepared statement itself, so these are psycopg's, met on another server connection
than the one they were prepared on."""

POOLER_HINT = (
    "the server-side prepared statements psycopg makes do not survive a connection pooler in "
    "transaction mode (such as PgBouncer), which runs each transaction on any of its server "
    "connections: open the store with prepare_threshold=None, and notify=False (LISTEN needs "
    "a session of its own)"
)
"""What a ``pooler_mixup`` error's message adds: the likely cause, and the fix."""


def pooler_mixup(exc: psycopg.Error) -> bool:
    """Whether ``exc`` is a prepared statement lost or mixed up behind a transaction pooler:
    SQLSTATE 26000 or 42P05, or a protocol violation (08P01) about a prepared statement
    (``bind message supplies 0 parameters, but prepared statement "_pg3_0" requires 1``,
    the same name prepared for another query on the server connection it landed on)."""
    state = exc.sqlstate or ""
    if state in _PREPARED_LOST:
        return True
    return state == "08P01" and "prepared statement" in str(exc)


def _lookup(state: str) -> tuple[str, type[StoreError]] | None:
    for key in (state, state[:2]):
        if key and key in SQLSTATES:
            return key, SQLSTATES[key]
    return None


def error_class(
    exc: psycopg.Error, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | None = None
) -> type[StoreError]:
    """The outboxkit error class for ``exc`` (``conn``: the connection it happened on)."""
    if pooler_mixup(exc):
        return StoreError
    found = _lookup(exc.sqlstate or "")
    if found is not None:
        return found[1]
    if conn is not None and conn.broken:
        return StoreUnavailable
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return StoreUnavailable
    return StoreError


def map_error(
    exc: psycopg.Error,
    *,
    where: str,
    schema: str,
    doing: str,
    scrub: Callable[[str], str],
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | None = None,
) -> StoreError:
    """The outboxkit error for ``exc``, raised while doing ``doing`` on the server ``where``;
    ``scrub`` takes any secret out of the driver's message."""
    message = scrub(str(exc).strip()) or type(exc).__name__
    if pooler_mixup(exc):
        return StoreError(
            f"PostgreSQL at {where}: {doing} failed: {type(exc).__name__}: {message}; {POOLER_HINT}"
        )
    kind = error_class(exc, conn)
    found = _lookup(exc.sqlstate or "")
    if kind is StoreUnavailable:
        lost = (found is not None and found[0] in _SESSION_ENDED) or (
            conn is not None and conn.broken
        )
        if lost:
            return StoreUnavailable(
                f"PostgreSQL at {where} is unavailable ({doing}): the connection was lost: "
                f"{message}"
            )
        return StoreUnavailable(f"PostgreSQL at {where} is unavailable ({doing}): {message}")
    if kind is SerializationFailure:
        return SerializationFailure(
            f"PostgreSQL at {where}: {doing} failed: a concurrent transaction won "
            f"(SQLSTATE {exc.sqlstate}): {message}; the transaction was rolled back: run the "
            "whole transaction again"
        )
    if kind is SchemaError:
        return SchemaError(
            f"PostgreSQL at {where}, schema {schema!r}: the outboxkit tables are missing or out "
            f"of date ({doing}): {message}; {migrate_hint()}"
        )
    if exc.sqlstate == "23514" and "no partition of relation" in message:
        return StoreError(
            f"PostgreSQL at {where}, schema {schema!r}: {doing} failed: {message}; the "
            "partitioned layout has no partition ready for the next ids: run the store's "
            "maintenance (store.maintain_partitions(), which the pollers' retention runs every "
            "minute, or `outboxkit purge`), and see `outboxkit doctor`"
        )
    return StoreError(f"PostgreSQL at {where}: {doing} failed: {type(exc).__name__}: {message}")


def session_ended_by_handler(exc: BaseException) -> bool:
    """Whether ``exc``'s chain holds the server's error for a session the handler's own
    idling ended (``ENDED_BY_HANDLER``)."""
    return any(
        isinstance(cause, psycopg.Error) and cause.sqlstate in ENDED_BY_HANDLER
        for cause in chain(exc)
    )
