"""The consumer side: apply each relayed message once (an inbox table in the consumer's
database, written in the consumer's own transaction).

A relay delivers at least once, so a consumer may see a message twice (after a lost confirm, a
broker restart, a poller's crash). ``Inbox.accept`` inserts the message's event id into the
inbox table through the consumer's connection, inside its open transaction: it returns True the
first time, False for a duplicate. Applying the message's effects in the same transaction makes
the whole effectively once: if the transaction rolls back, the id goes with it and the
redelivered message is applied then::

    inbox = Inbox(consumer="billing")
    inbox.migrate(conn)                             # once: CREATE TABLE IF NOT EXISTS

    async def on_message(message):                  # aio-pika
        with conn:                                  # the consumer's transaction
            if inbox.accept(conn, rabbitmq.event_id(message)):
                apply(conn, message)                # effects, once
        await message.ack()                         # after the commit

Each relay module has the ``event_id(message)`` that reads the id back:
``outboxkit.relay.rabbitmq.event_id`` (aio-pika message), ``outboxkit.relay.nats.event_id``
(nats-py ``Msg``), ``outboxkit.relay.redis.event_id`` (an entry's fields).

Connections: ``sqlite3`` and psycopg 3 (``accept``), psycopg's ``AsyncConnection``
(``accept_async``). ``accept`` never begins, commits or rolls back.
"""

from __future__ import annotations

from typing import Any

from .._sql.loader import load_queries
from .._sql.names import validate_identifier
from ..errors import ConfigurationError

__all__ = ["Inbox"]


class Inbox:
    """Drops duplicate messages by event id, in the consumer's transaction.

    Args:
        consumer: who applies the messages: one inbox table can serve several consumers,
            each seeing every event once.
        table: the inbox table's name (a plain SQL identifier).

    Raises:
        ConfigurationError: a bad consumer or table name, naming it.
    """

    def __init__(self, *, consumer: str, table: str = "outboxkit_inbox") -> None:
        if not isinstance(consumer, str) or not consumer or "\x00" in consumer:
            raise ConfigurationError(
                f"consumer must be a non-empty string without NUL, got {consumer!r:.80}"
            )
        self.consumer = consumer
        self.table = validate_identifier(table, "table")

    def migrate(self, conn: Any) -> None:
        """Create the inbox table if it is missing (through ``conn``; the caller commits)."""
        dialect = _dialect(conn)
        conn.execute(self._statement("create", dialect, conn))

    def accept(self, conn: Any, event_id: int) -> bool:
        """Record ``event_id`` as applied by this consumer, in ``conn``'s open transaction.

        Returns:
            True the first time (apply the message), False for a duplicate (skip it).

        Raises:
            ConfigurationError: ``conn`` is neither sqlite3 nor psycopg, or ``event_id`` is
                not a positive integer.
        """
        dialect = _dialect(conn)
        cursor = conn.execute(self._statement("accept", dialect, conn), self._values(event_id))
        return bool(cursor.rowcount == 1)

    async def accept_async(self, aconn: Any, event_id: int) -> bool:
        """``accept`` on psycopg's ``AsyncConnection``."""
        if _dialect(aconn) != "pg":
            raise ConfigurationError(
                f"accept_async needs a psycopg AsyncConnection, got {aconn!r:.80}"
            )
        cursor = await aconn.execute(self._statement("accept", "pg", aconn), self._values(event_id))
        return bool(cursor.rowcount == 1)

    async def migrate_async(self, aconn: Any) -> None:
        """``migrate`` on psycopg's ``AsyncConnection``."""
        if _dialect(aconn) != "pg":
            raise ConfigurationError(
                f"migrate_async needs a psycopg AsyncConnection, got {aconn!r:.80}"
            )
        await aconn.execute(self._statement("create", "pg", aconn))

    def _values(self, event_id: object) -> dict[str, object]:
        if isinstance(event_id, bool) or not isinstance(event_id, int) or event_id < 1:
            raise ConfigurationError(f"event_id must be a positive integer, got {event_id!r:.80}")
        return {"consumer": self.consumer, "event_id": event_id}

    def _statement(self, name: str, dialect: str, conn: Any) -> Any:
        text = _QUERIES[f"{name}_{dialect}"]
        if dialect == "sqlite":
            # The name is a checked plain identifier (validate_identifier): quoting is enough.
            return text.format(inbox=f'"{self.table}"')
        from psycopg import sql

        return sql.SQL(text).format(inbox=sql.Identifier(self.table))

    def __repr__(self) -> str:
        return f"Inbox(consumer={self.consumer!r}, table={self.table!r})"


_QUERIES = load_queries("outboxkit.relay")


def _dialect(conn: Any) -> str:
    module = type(conn).__module__
    if module == "sqlite3":
        return "sqlite"
    if module.startswith("psycopg"):
        return "pg"
    raise ConfigurationError(
        f"the inbox needs a sqlite3 or psycopg connection, got {type(conn).__name__} from {module}"
    )
