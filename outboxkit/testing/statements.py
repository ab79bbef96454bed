"""``with outbox_drain.statements() as s:``: the SQL statements the delivery path ran inside the
block, in all and per handler, so an app can pin its handlers' database cost.

What is counted: every statement executed on a connection of the store (the claims, the
deliveries' transactions, the records, the settlements) and, while a handler runs, every one it
runs on ``ctx.connection``:

- SQLite: ``execute``/``executemany`` on the store's connections (``StoreConnection``);
- PostgreSQL: ``execute``/``executemany`` of psycopg cursors (every psycopg connection, the
  app's own too if it runs statements meanwhile).

Only the statements of the thread that opened the block count: the drain runs there, and its
handlers with it; a connection pool's own threads (opening a connection, setting its session
up) run at moments of their own, which would make a count vary from run to run.

The memory store runs no SQL: the block counts nothing there and says so
(``s.applies`` is false). The counting wraps those methods for the block only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.model import Event
from ..hookspecs import hookimpl
from ..store import Store
from ..storekit.sql import SQLStore

__all__ = ["StatementCount", "counting"]


@dataclass
class StatementCount:
    """What the block ran.

    Attributes:
        statements: SQL statements executed in the block, in all.
        by_handler: statements run while each handler ran, by name: its own queries, and
            the opening of its delivery's transaction when it first takes ``ctx.connection``
            (SQLite and PostgreSQL open it then).
        runs: how many times each handler ran in the block, by name.
        deliveries: handler runs in the block (from the drains it ran).
        applies: false on a store that runs no SQL (memory): every count is 0 there.
    """

    statements: int = 0
    by_handler: dict[str, int] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    deliveries: int = 0
    applies: bool = True
    current: str | None = None
    thread: int | None = None  # the thread whose statements count (``counting``)

    @property
    def per_delivery(self) -> float:
        """Statements per handler run (0 when none ran)."""
        return self.statements / self.deliveries if self.deliveries else 0.0

    def note(self) -> None:
        if self.thread is not None and threading.get_ident() != self.thread:
            return
        self.statements += 1
        if self.current is not None:
            self.by_handler[self.current] = self.by_handler.get(self.current, 0) + 1

    def assert_at_most(self, per_delivery: float | None = None, **handlers: int) -> None:
        """At most ``per_delivery`` statements per handler run, and at most the given count
        per handler run for each named handler (``**{"charge-card": 1}``).

        Raises:
            AssertionError: naming what ran more, and how many.
        """
        __tracebackhide__ = True
        if per_delivery is not None and self.per_delivery > per_delivery:
            raise AssertionError(
                f"{self.statements} statements for {self.deliveries} deliveries: "
                f"{self.per_delivery:.2f} per delivery, expected at most {per_delivery:g} "
                f"(by handler: {self.by_handler})"
            )
        for name, most in handlers.items():
            ran, runs = self.by_handler.get(name, 0), self.runs.get(name, 0)
            if runs and ran / runs > most:
                raise AssertionError(
                    f"handler {name!r} ran {ran} statement(s) in {runs} run(s): "
                    f"{ran / runs:g} per run, expected at most {most}"
                )


class HandlerTracker:
    """An ``outboxkit_handler_scope`` plugin that tells the open count which handler runs."""

    def __init__(self) -> None:
        self.count: StatementCount | None = None

    @hookimpl
    def outboxkit_handler_scope(
        self, event: Event, handler: str, attempt: int, batched: bool
    ) -> contextlib.AbstractContextManager[object] | None:
        if self.count is None:
            return None
        return self._running(self.count, handler)

    @contextlib.contextmanager
    def _running(self, count: StatementCount, handler: str) -> Iterator[None]:
        count.current = handler
        count.runs[handler] = count.runs.get(handler, 0) + 1
        try:
            yield
        finally:
            count.current = None


@contextlib.contextmanager
def counting(store: Store, count: StatementCount) -> Iterator[StatementCount]:
    """Count ``store``'s statements into ``count`` while the block runs (this thread's)."""
    count.thread = threading.get_ident()
    if not isinstance(store, SQLStore):
        count.applies = False
        yield count
        return
    if store.dialect.name == "sqlite":
        from outboxkit_sqlite.connections import StoreConnection

        targets: list[Any] = [StoreConnection]
    else:
        import psycopg

        targets = [psycopg.Cursor]
    with contextlib.ExitStack() as stack:
        for cls in targets:
            for name in ("execute", "executemany"):
                stack.enter_context(_wrapped(cls, name, count.note))
        if store.dialect.name != "sqlite":
            # The PostgreSQL store sends a delivery's own statements (its opening, its records
            # and commit) on libpq directly, in one pipeline sync: each one counts.
            from outboxkit_pg.pipeline import Flight

            stack.enter_context(_wrapped(Flight, "send", count.note, per_statement=True))
        yield count


@contextlib.contextmanager
def _wrapped(
    cls: Any, name: str, note: Callable[[], None], *, per_statement: bool = False
) -> Iterator[None]:
    """``cls.name`` noting each call (or, ``per_statement``, each statement of its first
    argument, a sequence of statements) while the block runs."""
    original = cls.__dict__.get(name)
    inherited = getattr(cls, name)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        for _ in range(len(args[0]) if per_statement else 1):
            note()
        return inherited(self, *args, **kwargs)

    setattr(cls, name, counted)
    try:
        yield
    finally:
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)
