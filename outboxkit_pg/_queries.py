"""Loads ``sql/queries.sql`` into named statements and fills in the identifiers.

The file holds blocks introduced by ``-- name: <name>``; other comment lines are dropped. Slots
in braces (``{events}``...) are identifiers, filled with ``psycopg.sql.Identifier`` only; values
stay ``%(name)s`` placeholders, bound at execution. Nothing else is ever put into SQL.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

from psycopg import sql

from outboxkit._storekit import validate_identifier, validate_table_names

__all__ = ["Names", "Queries", "load_templates"]

_NAME = re.compile(r"^-- name: ([a-z_0-9]+)\s*$")


@functools.cache
def load_templates() -> dict[str, str]:
    """The statements of ``sql/queries.sql`` by name, comment lines removed."""
    text = resources.files("outboxkit_pg").joinpath("sql/queries.sql").read_text("utf-8")
    templates: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = _NAME.match(line)
        if match:
            name = match.group(1)
            if name in templates:
                raise RuntimeError(f"queries.sql: {name!r} is defined twice")
            current = templates[name] = []
        elif current is not None and not line.lstrip().startswith("--"):
            current.append(line)
    return {name: "\n".join(lines).strip() for name, lines in templates.items()}


def _index_name(table: str, suffix: str) -> str:
    """``{table}_{suffix}``, the table part shortened to keep within PostgreSQL's 63 bytes."""
    return f"{table[: 62 - len(suffix)]}_{suffix}"


@dataclass(frozen=True, slots=True)
class Names:
    """The identifiers the store's SQL uses, validated when constructed.

    Raises:
        ConfigurationError: a name is not ``^[A-Za-z_][A-Za-z0-9_]{0,62}$`` (or two tables
            share a name).
    """

    schema: str = "public"
    events: str = "outbox_events"
    deliveries: str = "outbox_deliveries"
    versions: str = "outbox_schema"
    channel: str = "outbox_events"

    def __post_init__(self) -> None:
        validate_identifier(self.schema, "schema")
        validate_table_names(self.events, self.deliveries, self.versions)
        validate_identifier(self.channel, "channel")

    def slots(self) -> dict[str, sql.Composable]:
        """What fills the ``{...}`` slots of the templates."""
        return {
            "schema": sql.Identifier(self.schema),
            "events": sql.Identifier(self.schema, self.events),
            "deliveries": sql.Identifier(self.schema, self.deliveries),
            "versions": sql.Identifier(self.schema, self.versions),
            "due_index": sql.Identifier(_index_name(self.events, "due")),
            "published_index": sql.Identifier(_index_name(self.events, "published")),
            "dead_index": sql.Identifier(_index_name(self.events, "dead")),
            "guard_function": sql.Identifier(self.schema, _index_name(self.events, "guard")),
            "guard_trigger": sql.Identifier(_index_name(self.events, "guard")),
            "channel": sql.Identifier(self.channel),
        }

    @property
    def due_index(self) -> str:
        """The name of the partial index the claim walks."""
        return _index_name(self.events, "due")


class Queries:
    """Every statement, rendered once for one set of names (bytes, ready to execute)."""

    def __init__(self, names: Names) -> None:
        slots = names.slots()
        self._rendered = {
            name: sql.SQL(template).format(**slots).as_bytes(None)
            for name, template in load_templates().items()
        }

    def __getitem__(self, name: str) -> bytes:
        return self._rendered[name]

    def text(self, name: str) -> str:
        """A statement as text (for EXPLAIN in tests, and for reading)."""
        return self._rendered[name].decode("utf-8")
