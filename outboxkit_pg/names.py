"""The PostgreSQL store's names, and its SQL (``queries.sql``) with them in place.

Slots in braces (``{events}``...) are identifiers, filled with ``psycopg.sql.Identifier`` only;
values stay ``%(name)s`` placeholders, bound at execution. Nothing else is ever put into SQL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outboxkit.errors import ConfigurationError
from outboxkit.storekit.names import validate_identifier, validate_table_names
from outboxkit.storekit.queries import load_queries

__all__ = ["HOT", "Names", "Queries", "index_name", "prepared", "validate_schema"]


def index_name(table: str, suffix: str) -> str:
    """``{table}_{suffix}``, the table part shortened to keep within PostgreSQL's 63 bytes."""
    return f"{table[: 62 - len(suffix)]}_{suffix}"


# The objects the migration names after a table, in the same schema: the store's own indexes
# and guard trigger/function on the events table (``_index_name``), and the ones PostgreSQL
# names itself the same way (primary keys, identity sequences).
_DERIVED = {
    "events_table": (
        "due",
        "published",
        "dead",
        "guard",
        "pkey",
        "id_seq",
        "keys",
        "keys_pkey",
        "key_order",
        "dedupe",
    ),
    "deliveries_table": ("pkey", "seq_seq"),
    "schema_table": ("pkey",),
}


def _derived(option: str, table: str) -> list[str]:
    return [index_name(table, suffix) for suffix in _DERIVED[option]]


def validate_schema(schema: object) -> str:
    """``schema`` if it is a safe identifier and not reserved by PostgreSQL.

    Raises:
        ConfigurationError: naming ``schema`` and the bad value.
    """
    name = validate_identifier(schema, "schema")
    if name.lower().startswith("pg_") or name.lower() == "information_schema":
        raise ConfigurationError(
            "schema: PostgreSQL reserves schema names starting with 'pg_' and "
            f"information_schema (refused in any case), got {name!r}"
        )
    return name


@dataclass(frozen=True, slots=True)
class Names:
    """The identifiers the store's SQL uses, validated when constructed.

    Raises:
        ConfigurationError: a name is not ``^[A-Za-z_][A-Za-z0-9_]{0,62}$``, the schema is
            reserved (``pg_*``, ``information_schema``), two tables share a name, or a table is
            named like an object derived from one (``outbox_events_due``...).
    """

    schema: str = "public"
    events: str = "outbox_events"
    deliveries: str = "outbox_deliveries"
    versions: str = "outbox_schema"
    channel: str = "outbox_events"

    def __post_init__(self) -> None:
        validate_schema(self.schema)
        validate_table_names(self.events, self.deliveries, self.versions, derived=_derived)
        validate_identifier(self.channel, "channel")

    @property
    def keys(self) -> str:
        """The per-key numbering table (R15), named after the events table."""
        return index_name(self.events, "keys")

    def slots(self) -> dict[str, sql.Composable]:
        """What fills the ``{...}`` slots of the templates."""
        return {
            "schema": sql.Identifier(self.schema),
            "events": sql.Identifier(self.schema, self.events),
            "deliveries": sql.Identifier(self.schema, self.deliveries),
            "versions": sql.Identifier(self.schema, self.versions),
            "due_index": sql.Identifier(index_name(self.events, "due")),
            "published_index": sql.Identifier(index_name(self.events, "published")),
            "dead_index": sql.Identifier(index_name(self.events, "dead")),
            "guard_function": sql.Identifier(self.schema, index_name(self.events, "guard")),
            "guard_trigger": sql.Identifier(index_name(self.events, "guard")),
            "close_function": sql.Identifier(self.schema, index_name(self.events, "close")),
            "keys": sql.Identifier(self.schema, self.keys),
            "key_index": sql.Identifier(index_name(self.events, "key_order")),
            "dedupe_index": sql.Identifier(index_name(self.events, "dedupe")),
            "channel": sql.Identifier(self.channel),
        }

    @property
    def due_index(self) -> str:
        """The name of the partial index the claim walks."""
        return index_name(self.events, "due")


_PARAMETER = re.compile(rb"%\((\w+)\)([sb])")


def numbered(query: bytes) -> tuple[bytes, tuple[str, ...]]:
    """``query`` with ``$1``, ``$2``... in place of its ``%(name)s`` parameters, and the
    names in that order (``Queries.positional``).

    Raises:
        ValueError: the statement has a binary parameter (``%(name)b``).
    """
    order: list[str] = []

    def number(match: re.Match[bytes]) -> bytes:
        if match.group(2) != b"s":
            raise ValueError(f"{match.group(1).decode()}: only text parameters can be numbered")
        key = match.group(1).decode()
        if key not in order:
            order.append(key)
        return b"$%d" % (order.index(key) + 1)

    return _PARAMETER.sub(number, query), tuple(order)


class Queries:
    """Every statement, rendered once for one set of names (bytes, ready to execute)."""

    def __init__(self, names: Names) -> None:
        slots = names.slots()
        self._rendered = {
            name: sql.SQL(template).format(**slots).as_bytes(None)
            for name, template in load_queries("outboxkit_pg").items()
        }

    def __getitem__(self, name: str) -> bytes:
        return self._rendered[name]

    def positional(self, name: str) -> tuple[bytes, tuple[str, ...]]:
        """A statement with ``$1``, ``$2``... in place of its ``%(name)s`` parameters (for
        libpq's own prepared statements, ``pipeline``), and the names in that order.

        Raises:
            ValueError: the statement has a binary parameter (``%(name)b``).
        """
        return numbered(self._rendered[name])

    def text(self, name: str) -> str:
        """A statement as text (for EXPLAIN in tests, and for reading)."""
        return self._rendered[name].decode("utf-8")


HOT = frozenset(
    {"claim", "publish_many", "publish_recording", "settle_many", "settle_many_recording", "extend"}
)
"""The statements a poller runs every round: prepared at their first run on a connection,
rather than after psycopg's ``prepare_threshold`` runs (each would be planned until then)."""


def prepared(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], name: str
) -> bool | None:
    """psycopg's ``prepare`` for statement ``name`` on ``conn``: True for a hot one, where the
    connection prepares statements at all (``prepare_threshold`` not None), else its default."""
    return True if name in HOT and conn.prepare_threshold is not None else None
