"""``Outbox.enqueue(connection, ...)`` with Django's connection: ``django.db.connection`` or
``connections["alias"]``, inside ``transaction.atomic()`` (the seam in ``outboxkit.contrib``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from outboxkit.errors import ConfigurationError, StoreError

if TYPE_CHECKING:
    from outboxkit.core.model import NewEvent
    from outboxkit.store import Store

__all__ = ["ADAPTER", "DjangoAdapter"]


def wrapper_of(conn: Any) -> Any:
    """The ``DatabaseWrapper`` behind Django's ``connection`` proxy or ``connections[alias]``.

    Raises:
        ConfigurationError: ``conn`` is another Django object.
    """
    from django.db import connections
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    if isinstance(conn, ConnectionProxy):
        return connections[conn.alias]
    if isinstance(conn, BaseDatabaseWrapper):
        return conn
    raise ConfigurationError(
        "outboxkit enqueues through Django's connection (django.db.connection, or "
        f"connections['alias']) inside transaction.atomic(), got {conn!r:.80}"
    )


class DjangoAdapter:
    """Writes events through Django's connection in its open ``atomic`` block; never begins,
    commits or rolls back (R1)."""

    def enqueue(
        self, store: Store, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        """Raises:
        ConfigurationError: outside ``transaction.atomic()``, in an atomic block already
            marked for rollback, or on another database than the outbox's; nothing written.
        StoreError: the database failed (the atomic block is then marked for rollback, as
            Django does for the ORM's own errors).
        """
        from django.db import transaction

        wrapper = wrapper_of(conn)
        alias = wrapper.alias
        # A DjangoStore (known by its django_alias; importing it here would be a cycle).
        store_alias = getattr(store, "django_alias", None)
        if store_alias is not None and store_alias != alias:
            raise ConfigurationError(
                f"enqueue got Django's connection for database {alias!r}, but the outbox's "
                f"store is on database {store_alias!r}: pass connections[{store_alias!r}]. "
                "Nothing was written."
            )
        if not wrapper.in_atomic_block:
            raise ConfigurationError(
                f"enqueue needs an open transaction on Django's database {alias!r}, so that the "
                "event commits or rolls back with the ORM's writes; this connection is in "
                f"autocommit mode: enqueue inside `with transaction.atomic(using={alias!r}):` "
                "(or in a view under ATOMIC_REQUESTS). Nothing was written."
            )
        if wrapper.needs_rollback:
            raise ConfigurationError(
                f"enqueue: the transaction.atomic() block on database {alias!r} is marked for "
                "rollback (an error was caught inside it); nothing was written"
            )
        if not events:
            return []
        target: Store = store if store_alias is None else getattr(store, "inner")  # noqa: B009
        wrapper.ensure_connection()
        try:
            return target.enqueue(wrapper.connection, events, now=now)
        except StoreError:
            transaction.set_rollback(True, using=alias)
            raise

    def on_commit(self, conn: Any, callback: Callable[[], None]) -> None:
        """Django's ``transaction.on_commit`` on ``conn``'s database."""
        from django.db import transaction

        transaction.on_commit(callback, using=wrapper_of(conn).alias)

    async def enqueue_async(
        self, store: Store, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        raise ConfigurationError(
            "Django's connections are blocking: call outbox.enqueue() inside "
            "transaction.atomic(), from async code in a function run by asgiref's "
            "sync_to_async. Nothing was written."
        )


ADAPTER = DjangoAdapter()
