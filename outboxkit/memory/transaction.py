"""``MemoryTransaction``: an open transaction on a memory store, the "connection" an app
enqueues through and a transactional handler gets as ``ctx.connection``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import HandlerCrashed, StoreError
from .tables import Pending, Tables

__all__ = ["MemoryTransaction"]


class MemoryTransaction:
    """An open transaction on a ``MemoryStore``: the "connection" handed to enqueue and handlers.

    Writes (events, delivery records, app rows) become visible to others only at ``commit()``.
    A delivery transaction (``managed``) refuses ``commit()`` and ``rollback()``: outboxkit
    ends it, with the delivery record.

    Attributes:
        open: not yet committed or rolled back.
        pending: the writes buffered until the commit (the store's delivery and batch write
            their records and settlements here).
        refused: what a handler tried to do to its delivery transaction (refused), if it did:
            the delivery then fails, whatever the handler made of the refusal (R17).
    """

    def __init__(self, tables: Tables, *, managed: bool = False) -> None:
        self.tables = tables
        self.pending = Pending()
        self._managed = managed
        self.open = True
        self.refused: str | None = None

    def insert(self, table: str, row: Mapping[str, Any]) -> None:
        """Insert an app row into ``table``; it commits or rolls back with the transaction."""
        self.check_open()
        self.pending.rows.append((table, dict(row)))

    def rows(self, table: str) -> list[dict[str, Any]]:
        """Committed rows of ``table`` plus this transaction's own inserts."""
        self.check_open()
        own = [dict(r) for t, r in self.pending.rows if t == table]
        return self.tables.rows_of(table) + own

    def commit(self) -> None:
        """Apply every buffered write atomically.

        Raises:
            StoreError: the transaction is already closed.
            HandlerCrashed: called by a handler on its delivery transaction (outboxkit commits
                it together with the delivery record).
        """
        self._refuse_if_managed("commit")
        self.apply()

    def rollback(self) -> None:
        """Discard every buffered write. Safe to call twice.

        Raises:
            HandlerCrashed: called by a handler on its delivery transaction.
        """
        self._refuse_if_managed("roll back")
        self.discard()

    def apply(self) -> None:
        """The store's commit (of an app's transaction, or a delivery's or batch's).

        Raises:
            StoreError: the transaction is already closed, or a record is a second one.
            LeaseLostError: a settlement's token is stale.
        """
        self.check_open()
        self.tables.apply(self.pending)
        self.open = False

    def discard(self) -> None:
        """The store's rollback."""
        self.pending = Pending()
        self.open = False
        self.tables.forget_dedupe(self)

    def _refuse_if_managed(self, what: str) -> None:
        if self._managed:
            self.refused = what
            raise HandlerCrashed(
                f"a handler may not {what} its delivery transaction: outboxkit commits it "
                "together with the delivery record"
            )

    def check_open(self) -> None:
        """Raises:
        StoreError: the transaction is already committed or rolled back."""
        if not self.open:
            raise StoreError("this memory transaction is already committed or rolled back")

    def __repr__(self) -> str:
        return f"<MemoryTransaction {'open' if self.open else 'closed'}>"
