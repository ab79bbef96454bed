"""The SQLite store's SQL, by name, in one place.

Identifiers: only table names that passed ``validate_identifier`` are put into SQL, double-quoted,
in one place (``Queries.build``). Values: always bound parameters, never formatted in. Instants are
INTEGER microseconds since the Unix epoch, UTC (exact for any ``datetime``; SQLite's own time
functions are never used, so the caller's clock is the only clock).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from outboxkit._storekit import prefixed_table_names, validate_identifier, validate_table_names
from outboxkit.errors import ConfigurationError

__all__ = [
    "EVENT_COLUMNS",
    "INDEX_SUFFIXES",
    "INSERT_COLUMNS",
    "Queries",
    "TableNames",
    "index_names",
    "quote",
]

INSERT_COLUMNS = 6
"""Bound values per row of ``insert_events``."""

EVENT_COLUMNS = (
    "id, topic, payload, headers, key, created_at, available_at, attempts,"
    " published_at, failed_at, locked_until, last_error"
)
"""What every query returning events selects, in this order (see ``store._event``)."""


def quote(identifier: str, what: str = "identifier") -> str:
    """``identifier`` double-quoted, after checking it is a safe identifier.

    Raises:
        ConfigurationError: ``identifier`` is not ``^[A-Za-z_][A-Za-z0-9_]{0,62}$``.
    """
    return f'"{validate_identifier(identifier, what)}"'


INDEX_SUFFIXES = ("due", "token", "failed", "published")
"""The store's indexes on the events table are named ``{events}_{suffix}`` (``_schema``)."""

RESERVED_PREFIX = "sqlite_"
"""SQLite refuses to create tables whose name starts with this, in any case."""


def index_names(events: str) -> list[str]:
    """The names of the store's indexes on the events table ``events``."""
    return [f"{events}_{suffix}" for suffix in INDEX_SUFFIXES]


def _derived(option: str, table: str) -> list[str]:
    return index_names(table) if option == "events_table" else []


def _refuse_reserved(option: str, table: str) -> None:
    if table.lower().startswith(RESERVED_PREFIX):
        raise ConfigurationError(
            f"{option}: SQLite reserves table names starting with {RESERVED_PREFIX!r} (in any "
            f"case), got {table!r}"
        )


@dataclass(frozen=True, slots=True)
class TableNames:
    """The store's three tables. Each name is validated on construction: a safe identifier, not
    ``sqlite_*`` (in any case), the three different ignoring case (as SQLite compares names), none
    named like one of the store's indexes (``{events}_due`` ...)."""

    events: str = "outbox_events"
    deliveries: str = "outbox_deliveries"
    schema: str = "outbox_schema"

    def __post_init__(self) -> None:
        validate_table_names(
            self.events, self.deliveries, self.schema, derived=_derived, ignore_case=True
        )
        _refuse_reserved("events_table", self.events)
        _refuse_reserved("deliveries_table", self.deliveries)
        _refuse_reserved("schema_table", self.schema)

    @classmethod
    def with_prefix(cls, prefix: str) -> TableNames:
        """``{prefix}events``, ``{prefix}deliveries``, ``{prefix}schema``."""
        names = prefixed_table_names(prefix)
        for table in names:
            _refuse_reserved("table_prefix", table)
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
            "event_columns": EVENT_COLUMNS,
        }


@dataclass(frozen=True, slots=True)
class Queries:
    """Every statement the store runs, for one set of table names.

    The field defaults are the templates (``{events}``... name the tables); ``build`` returns an
    instance whose fields hold the statements with the quoted table names in place.
    """

    insert_events_head: str = """
        INSERT INTO {events} (topic, payload, headers, key, created_at, available_at) VALUES
    """
    insert_events_tail: str = " RETURNING id"

    # R3: one atomic statement under BEGIN IMMEDIATE; the subquery's LIMIT keeps the batch size.
    claim: str = """
        UPDATE {events}
           SET attempts = attempts + 1,
               locked_until = :lease_end,
               token = lower(hex(randomblob(16)))
         WHERE id IN (
               SELECT id FROM {events}
                WHERE published_at IS NULL AND failed_at IS NULL
                  AND available_at <= :now
                  AND (locked_until IS NULL OR locked_until <= :now)
                ORDER BY available_at, id
                LIMIT :batch_size)
        RETURNING {event_columns}, token
    """

    done_for_events: str = """
        SELECT event_id, handler, outcome FROM {deliveries}
         WHERE event_id IN (SELECT value FROM json_each(:ids))
         ORDER BY rowid
    """

    owned: str = """
        SELECT 1 FROM {events}
         WHERE id = :id AND token = :token AND published_at IS NULL AND failed_at IS NULL
    """

    insert_record: str = """
        INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
        VALUES (:event_id, :handler, :outcome, :attempt, :recorded_at, :reason)
    """

    # extend and release reach their rows through the primary key (:ids) and are fenced by the
    # tokens: a token is unique to one claim of one event, so a row whose id is listed and whose
    # token is listed is exactly a row one of these claims still holds.
    extend: str = """
        UPDATE {events} SET locked_until = :lease_end
         WHERE id IN (SELECT value FROM json_each(:ids))
           AND token IN (SELECT value FROM json_each(:tokens))
           AND published_at IS NULL AND failed_at IS NULL
        RETURNING token, locked_until
    """

    # R8, fenced by the token. Flags come from outboxkit._storekit.settle_values.
    settle: str = """
        UPDATE {events}
           SET published_at = CASE WHEN :publish THEN :now ELSE published_at END,
               failed_at = CASE WHEN :dead THEN :now ELSE failed_at END,
               available_at = CASE WHEN :retry_after IS NOT NULL
                                   THEN :now + :retry_after ELSE available_at END,
               last_error = CASE WHEN :keeps_error THEN :error ELSE last_error END,
               locked_until = NULL,
               token = NULL
         WHERE id = :id AND token = :token AND published_at IS NULL AND failed_at IS NULL
    """

    # R8 for several events in one statement, each fenced by its token: :items is a JSON array
    # of [id, token, publish, dead, retry_after, keeps_error, error] (settle's flags per event).
    # RETURNING may not name the FROM table, so the settled rows come back by id.
    settle_many: str = """
        UPDATE {events}
           SET published_at = CASE WHEN s.publish THEN :now ELSE published_at END,
               failed_at = CASE WHEN s.dead THEN :now ELSE failed_at END,
               available_at = CASE WHEN s.retry_after IS NOT NULL
                                   THEN :now + s.retry_after ELSE available_at END,
               last_error = CASE WHEN s.keeps_error THEN s.error ELSE last_error END,
               locked_until = NULL,
               token = NULL
          FROM (SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS token,
                       json_extract(value, '$[2]') AS publish, json_extract(value, '$[3]') AS dead,
                       json_extract(value, '$[4]') AS retry_after,
                       json_extract(value, '$[5]') AS keeps_error,
                       json_extract(value, '$[6]') AS error
                  FROM json_each(:items)) AS s
         WHERE {events}.id = s.id AND {events}.token = s.token
           AND published_at IS NULL AND failed_at IS NULL
        RETURNING id
    """

    release: str = """
        UPDATE {events}
           SET locked_until = NULL, token = NULL, attempts = max(0, attempts - 1)
         WHERE id IN (SELECT value FROM json_each(:ids))
           AND token IN (SELECT value FROM json_each(:tokens))
           AND published_at IS NULL AND failed_at IS NULL
    """

    requeue: str = """
        UPDATE {events}
           SET failed_at = NULL, attempts = 0, available_at = :now,
               locked_until = NULL, token = NULL
         WHERE id IN (SELECT value FROM json_each(:ids)) AND failed_at IS NOT NULL
    """

    dead_letters: str = """
        SELECT {event_columns} FROM {events}
         WHERE failed_at IS NOT NULL
           AND (:topic IS NULL OR topic = :topic)
           AND (:since IS NULL OR failed_at >= :since)
         ORDER BY failed_at, id
         LIMIT :limit
    """

    get: str = """
        SELECT {event_columns} FROM {events} WHERE id = :id
    """

    events: str = """
        SELECT {event_columns} FROM {events}
         WHERE id > :after_id AND (:topic IS NULL OR topic = :topic)
         ORDER BY id
         LIMIT :limit
    """

    records: str = """
        SELECT event_id, handler, outcome, attempt, recorded_at, reason FROM {deliveries}
         WHERE event_id IN (SELECT value FROM json_each(:ids))
         ORDER BY rowid
    """

    purge_published: str = """
        DELETE FROM {events}
         WHERE id IN (SELECT id FROM {events}
                       WHERE published_at IS NOT NULL AND published_at < :before
                       ORDER BY id LIMIT :limit)
        RETURNING id
    """

    purge_dead: str = """
        DELETE FROM {events}
         WHERE id IN (SELECT id FROM {events}
                       WHERE failed_at IS NOT NULL
                         AND (:ids IS NULL OR id IN (SELECT value FROM json_each(:ids)))
                         AND (:before IS NULL OR failed_at < :before)
                       ORDER BY id LIMIT :limit)
        RETURNING id
    """

    purge_records: str = """
        DELETE FROM {deliveries} WHERE event_id IN (SELECT value FROM json_each(:ids))
    """

    stats: str = """
        SELECT topic,
               CASE WHEN published_at IS NOT NULL THEN 'published'
                    WHEN failed_at IS NOT NULL THEN 'dead'
                    WHEN locked_until IS NOT NULL AND locked_until > :now THEN 'claimed'
                    ELSE 'pending' END AS state,
               count(*),
               min(CASE WHEN published_at IS NULL AND failed_at IS NULL
                         AND (locked_until IS NULL OR locked_until <= :now)
                         AND available_at <= :now THEN available_at END)
          FROM {events}
         GROUP BY topic, state
    """

    schema_version: str = "SELECT max(version) FROM {schema}"

    @classmethod
    def build(cls, tables: TableNames) -> Queries:
        """The statements with ``tables``' quoted names in place (the only place names go in)."""
        names = tables.placeholders()
        return cls(**{f.name: str(f.default).format(**names) for f in fields(cls)})

    def insert_events(self, rows: int) -> str:
        """One multi-row INSERT ... RETURNING id for ``rows`` events (placeholders only)."""
        values = ", ".join(["(?, ?, ?, ?, ?, ?)"] * rows)
        return self.insert_events_head + values + self.insert_events_tail
