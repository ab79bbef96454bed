"""The consumer side: apply each relayed message once (an inbox table in the consumer's
database, written in the consumer's own transaction).

A relay delivers at least once, so a consumer may see a message twice (after a lost confirm, a
broker restart, a poller's crash). ``Inbox.accept`` inserts the message's identity into the
inbox table through the consumer's connection, inside its open transaction: it returns True the
first time, False for a duplicate. Applying the message's effects in the same transaction makes
the whole effectively once: if the transaction rolls back, the id goes with it and the
redelivered message is applied then::

    inbox = Inbox(consumer="billing")
    inbox.migrate(conn)                             # once: creates (or upgrades) the table

    async def on_message(message):                  # aio-pika
        with conn:                                  # the consumer's transaction
            if inbox.accept(conn, rabbitmq.event_id(message)):
                apply(conn, message)                # effects, once
        await message.ack()                         # after the commit

The identity is the event's ``message_id``: a random UUID its store drew when the event was
written, unique across outboxes (two services' events, or an app's two databases', never
share one) and the same on every re-publish of the event. Each relay module's
``event_id(message)`` reads it back, as ``str``: ``outboxkit.relay.rabbitmq.event_id``
(aio-pika message), ``outboxkit.relay.nats.event_id`` (nats-py ``Msg``),
``outboxkit.relay.redis.event_id`` (an entry's fields). A message sent before the stores kept
message ids carries its event's decimal id instead, and that is its identity.

The table keys on ``(consumer, message_id)``, the id as text. An inbox table of the old format
(an ``event_id`` integer column, before message ids) is upgraded in place by ``migrate``: the
ids it holds become their decimal text, so a message sent before the upgrade, applied then, is
still a duplicate when it comes again.

Connections: ``sqlite3`` and psycopg 3 (``migrate``, ``accept``), psycopg's
``AsyncConnection`` (``migrate_async``, ``accept_async``); each refuses the other kind.
``accept`` never begins, commits or rolls back.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError
from ..storekit.names import validate_identifier
from ..storekit.queries import load_queries

__all__ = ["Inbox"]


class Inbox:
    """Drops duplicate messages by message identity, in the consumer's transaction.

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
        """Create the inbox table if it is missing, or upgrade one of the old format (an
        ``event_id`` integer column) in place, keeping its ids as their decimal text; through
        ``conn``, in its transaction (the caller commits).

        Args:
            conn: a ``sqlite3.Connection`` or a psycopg ``Connection``.

        Raises:
            ConfigurationError: ``conn`` is neither, or is psycopg's ``AsyncConnection`` (use
                ``migrate_async``).
        """
        dialect = _dialect(conn, "migrate")
        conn.execute(self._statement("create", dialect))
        if dialect == "sqlite":
            columns = conn.execute(_QUERIES["columns_sqlite"], {"table": self.table}).fetchall()
            if "event_id" in {row[0] for row in columns}:
                for statement in self._statement("upgrade", "sqlite").split(";"):
                    conn.execute(statement)
            return
        found = {"table": f'"{self.table}"'}
        if conn.execute(_QUERIES["old_format_pg"], found).fetchone() is not None:
            conn.execute(self._statement("lock", "pg"))  # a second migrator waits, then sees
            if conn.execute(_QUERIES["old_format_pg"], found).fetchone() is not None:
                conn.execute(self._statement("upgrade", "pg"))

    def accept(self, conn: Any, message_id: str | int) -> bool:
        """Record ``message_id`` as applied by this consumer, in ``conn``'s open transaction.

        Args:
            conn: a ``sqlite3.Connection`` or a psycopg ``Connection``.
            message_id: the message's identity (``event_id(message)`` of its relay module); an
                ``int`` (the event id older code read) is taken as its decimal text.

        Returns:
            True the first time (apply the message), False for a duplicate (skip it).

        Raises:
            ConfigurationError: ``conn`` is neither sqlite3 nor psycopg, or is psycopg's
                ``AsyncConnection`` (use ``accept_async``), or ``message_id`` is neither a
                non-empty string nor a positive integer.
        """
        dialect = _dialect(conn, "accept")
        cursor = conn.execute(self._statement("accept", dialect), self._values(message_id))
        return bool(cursor.rowcount == 1)

    async def accept_async(self, aconn: Any, message_id: str | int) -> bool:
        """``accept`` on psycopg's ``AsyncConnection``.

        Raises:
            ConfigurationError: ``aconn`` is not a psycopg ``AsyncConnection`` (a blocking
                connection goes to ``accept``), or ``message_id`` is not one.
        """
        _check_async(aconn, "accept_async", "accept")
        cursor = await aconn.execute(self._statement("accept", "pg"), self._values(message_id))
        return bool(cursor.rowcount == 1)

    async def migrate_async(self, aconn: Any) -> None:
        """``migrate`` on psycopg's ``AsyncConnection``.

        Raises:
            ConfigurationError: ``aconn`` is not a psycopg ``AsyncConnection`` (a blocking
                connection goes to ``migrate``).
        """
        _check_async(aconn, "migrate_async", "migrate")
        await aconn.execute(self._statement("create", "pg"))
        found = {"table": f'"{self.table}"'}
        cursor = await aconn.execute(_QUERIES["old_format_pg"], found)
        if await cursor.fetchone() is not None:
            await aconn.execute(self._statement("lock", "pg"))
            cursor = await aconn.execute(_QUERIES["old_format_pg"], found)
            if await cursor.fetchone() is not None:
                await aconn.execute(self._statement("upgrade", "pg"))

    def _values(self, message_id: object) -> dict[str, object]:
        if isinstance(message_id, int) and not isinstance(message_id, bool) and message_id > 0:
            message_id = str(message_id)
        if (
            not isinstance(message_id, str)
            or not 0 < len(message_id) <= MAX_MESSAGE_ID
            or "\x00" in message_id
        ):
            raise ConfigurationError(
                "message_id must be a non-empty string (at most "
                f"{MAX_MESSAGE_ID} characters, no NUL) or a positive integer, "
                f"got {message_id!r:.80}"
            )
        return {"consumer": self.consumer, "message_id": message_id}

    def _statement(self, name: str, dialect: str) -> Any:
        text = _QUERIES[f"{name}_{dialect}"]
        if dialect == "sqlite":
            # The name is a checked plain identifier (validate_identifier): quoting is enough.
            return text.format(
                inbox=f'"{self.table}"', upgrading=f'"{self.table}__outboxkit_upgrade"'
            )
        from psycopg import sql

        return sql.SQL(text).format(inbox=sql.Identifier(self.table))

    def __repr__(self) -> str:
        return f"Inbox(consumer={self.consumer!r}, table={self.table!r})"


MAX_MESSAGE_ID = 200
"""The longest message id ``accept`` takes (a relay's are 36 characters at most)."""

_QUERIES = load_queries("outboxkit.relay")


def _dialect(conn: Any, method: str) -> str:
    """``"sqlite"`` or ``"pg"`` for a blocking connection ``method`` takes.

    Raises:
        ConfigurationError: neither, or psycopg's ``AsyncConnection`` (naming the async
            method to call instead: without it, nothing would be awaited and nothing done).
    """
    module = type(conn).__module__
    if module == "sqlite3":
        return "sqlite"
    if module.startswith("psycopg"):
        import psycopg

        if isinstance(conn, psycopg.AsyncConnection):
            raise ConfigurationError(
                f"Inbox.{method} takes a blocking connection; for psycopg's AsyncConnection "
                f"await Inbox.{method}_async(aconn, ...) instead"
            )
        return "pg"
    raise ConfigurationError(
        f"the inbox needs a sqlite3 or psycopg connection, got {type(conn).__name__} from {module}"
    )


def _check_async(aconn: Any, method: str, blocking: str) -> None:
    """Refuse anything but psycopg's ``AsyncConnection`` for the async ``method``.

    Raises:
        ConfigurationError: naming the blocking method for a blocking connection.
    """
    if type(aconn).__module__.startswith("psycopg"):
        import psycopg

        if isinstance(aconn, psycopg.AsyncConnection):
            return
        raise ConfigurationError(
            f"Inbox.{method} needs a psycopg AsyncConnection; for a blocking connection call "
            f"Inbox.{blocking}(conn, ...) instead, got {aconn!r:.80}"
        )
    raise ConfigurationError(f"Inbox.{method} needs a psycopg AsyncConnection, got {aconn!r:.80}")
