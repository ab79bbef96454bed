"""The SQLite store's table names, and its SQL with them in place.

Identifiers: only table names that passed ``validate_identifier`` are put into SQL,
double-quoted, in one place (``render_queries``). Values: always bound parameters, never
formatted in. The statements are in ``queries.sql``.
"""

from __future__ import annotations

from dataclasses import dataclass

from outboxkit.errors import ConfigurationError
from outboxkit.storekit.names import table_names, validate_identifier, validate_table_names
from outboxkit.storekit.queries import load_queries
from outboxkit.storekit.rows import EVENT_COLUMNS

__all__ = [
    "INDEX_SUFFIXES",
    "INSERT_COLUMNS",
    "NEW_MESSAGE_ID",
    "TableNames",
    "index_names",
    "insert_events",
    "quote",
    "render_queries",
]

INSERT_COLUMNS = 7
"""Bound values per row of ``insert_events``."""


def quote(identifier: str, what: str = "identifier") -> str:
    """``identifier`` double-quoted, after checking it is a safe identifier.

    Raises:
        ConfigurationError: ``identifier`` is not ``^[A-Za-z_][A-Za-z0-9_]{0,62}$``.
    """
    return f'"{validate_identifier(identifier, what)}"'


INDEX_SUFFIXES = ("due", "token", "failed", "published", "purge", "key", "dedupe")
"""The store's indexes (and its purge trigger) on the events table are named
``{events}_{suffix}`` (``schema``)."""

RESERVED_PREFIX = "sqlite_"
"""SQLite refuses to create tables whose name starts with this, in any case."""


def index_names(events: str) -> list[str]:
    """The names of the store's indexes on the events table ``events``."""
    return [f"{events}_{suffix}" for suffix in INDEX_SUFFIXES]


def _derived(option: str, table: str) -> list[str]:
    return index_names(table) if option == "events_table" else []


def _refuse_reserved(option: str, table: str, role: str) -> None:
    """Refuse ``table`` (the ``role`` table, given by ``option``) when it, or a name the store
    makes from it (the events table's indexes: ``sqlite_due`` for ``sqlite``), is reserved."""
    if table.lower().startswith(RESERVED_PREFIX):
        raise ConfigurationError(
            f"{option}: SQLite reserves table names starting with {RESERVED_PREFIX!r} (in any "
            f"case), got {table!r}"
        )
    for name in _derived(role, table):
        if name.lower().startswith(RESERVED_PREFIX):
            raise ConfigurationError(
                f"{option}: SQLite reserves names starting with {RESERVED_PREFIX!r} (in any "
                f"case), and the store would name an index of the events table {table!r} "
                f"{name!r}"
            )


@dataclass(frozen=True, slots=True)
class TableNames:
    """The store's three tables. Each name is validated on construction: a safe identifier, not
    ``sqlite_*`` (in any case, nor an index name made from it), the three different ignoring
    case (as SQLite compares names), none named like one of the store's indexes
    (``{events}_due`` ...)."""

    events: str = "outbox_events"
    deliveries: str = "outbox_deliveries"
    schema: str = "outbox_schema"

    def __post_init__(self) -> None:
        validate_table_names(
            self.events, self.deliveries, self.schema, derived=_derived, ignore_case=True
        )
        for role, table in (
            ("events_table", self.events),
            ("deliveries_table", self.deliveries),
            ("schema_table", self.schema),
        ):
            _refuse_reserved(role, table, role)

    @classmethod
    def from_options(
        cls,
        prefix: object,
        events: object = None,
        deliveries: object = None,
        schema_table: object = None,
    ) -> TableNames:
        """``{prefix}events``, ``{prefix}deliveries``, ``{prefix}schema``, each replaced by its
        own option when given."""
        names = table_names(prefix, events, deliveries, schema_table)
        for role, table, given in zip(
            ("events_table", "deliveries_table", "schema_table"),
            names,
            (events, deliveries, schema_table),
            strict=True,
        ):
            _refuse_reserved(role if given is not None else "table_prefix", table, role)
        return cls(*names)

    def placeholders(self) -> dict[str, str]:
        """The quoted names for the ``{events}``, ``{deliveries}``, ``{schema}`` slots, plus
        quoted index names derived from them (``{events_due}`` ...)."""
        return {
            "events": quote(self.events),
            "deliveries": quote(self.deliveries),
            "schema": quote(self.schema),
            **{
                f"events_{suffix}": f'"{name}"'
                for suffix, name in zip(INDEX_SUFFIXES, index_names(self.events), strict=True)
            },
            "event_columns": ", ".join(EVENT_COLUMNS),
        }


def render_queries(tables: TableNames) -> dict[str, str]:
    """Every statement of ``queries.sql`` with ``tables``' quoted names in place (the only place
    names go into SQL)."""
    names = tables.placeholders()
    return {
        name: template.format(**names)
        for name, template in load_queries("outboxkit_sqlite").items()
    }


NEW_MESSAGE_ID = "randomblob(16)"
"""What fills an inserted event's ``message_id`` (schema version 6): 16 random bytes, drawn by
SQLite for each row."""


def insert_events(head: str, rows: int, *, message_id: bool = True) -> str:
    """One multi-row ``INSERT ... RETURNING id, dedupe_key`` for ``rows`` events: placeholders
    only, each row's message identity drawn by SQLite (``NEW_MESSAGE_ID``; ``message_id=False``
    for ``insert_events_head_v5``, a schema without the column). An event whose dedupe key is
    taken is not inserted (R16)."""
    row = f"(?, ?, ?, ?, ?, ?, ?, {NEW_MESSAGE_ID})" if message_id else "(?, ?, ?, ?, ?, ?, ?)"
    return head + " " + ", ".join([row] * rows) + INSERT_TAIL


INSERT_TAIL = (
    " ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING RETURNING id, dedupe_key"
)
"""What ends every insert of events: R16's no-op for a dedupe key already taken."""
