"""The ``ctx`` a handler receives: its delivery's connection (taken lazily), its ORM session
(made on first use), and the follow-up events it enqueues.

Both pollers make one per handler run (``Context``); what a context needs from the outbox is
given to it (``ContextMaker``), never read from the outbox itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from .core.model import NewEvent
from .core.payload import build_event
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .store import AsyncDeliveryTransaction, DeliveryTransaction

__all__ = ["Context", "ContextMaker", "HeadersFor", "SessionProvider", "SessionScope"]


class SessionScope(Protocol):
    """One delivery's ``ctx.session``, made on the handler's first use of it (an ORM
    integration's; see ``outboxkit.contrib.sqlalchemy.use_sessions``)."""

    @property
    def session(self) -> Any:
        """What ``ctx.session`` is."""
        ...

    def finish(self) -> Any:
        """After the handler returned, before the delivery record: write what the session
        holds (a flush). An awaitable for an asyncio delivery, else None."""
        ...

    def close(self) -> Any:
        """After ``finish`` or a failure: let go of the session, never ending the delivery
        transaction. An awaitable for an asyncio delivery, else None."""
        ...


class SessionProvider(Protocol):
    """What ``Outbox.sessions`` holds: makes the ``ctx.session`` of one delivery."""

    def open(self, connection: Any) -> SessionScope:
        """A scope bound to ``connection``, the delivery transaction's connection.

        Raises:
            ConfigurationError: ``connection`` is not one the provider can bind a session to.
        """
        ...


HeadersFor = Callable[[str, Mapping[str, str] | None], Mapping[str, str] | None]
"""``Outbox.headers_for``: a follow-up's headers with what the enqueue plugins add."""


class ContextMaker:
    """What every ``ctx`` of a poller is made with: the payload limit, the session provider
    (read as each round starts: an ORM integration may set it after the poller was made) and
    the enqueue plugins' headers.

    Args:
        max_payload_bytes: the outbox's limit for a follow-up's encoded payload.
        sessions: returns the outbox's ``SessionProvider`` (or None) when asked.
        headers: ``Outbox.headers_for``.
    """

    __slots__ = ("_sessions", "check", "headers", "max_payload_bytes", "sessions")

    def __init__(
        self,
        max_payload_bytes: int,
        sessions: Callable[[], SessionProvider | None],
        headers: HeadersFor,
        check: Callable[[Sequence[NewEvent]], None] | None = None,
    ) -> None:
        self.max_payload_bytes = max_payload_bytes
        self._sessions = sessions
        self.headers = headers
        self.check = check
        self.sessions: SessionProvider | None = None

    def refresh(self) -> None:
        """Read the session provider again (once per round)."""
        self.sessions = self._sessions()

    def make(self, handler: str, attempt: int) -> Context:
        """The ``ctx`` of one run of ``handler``."""
        return Context(
            handler, attempt, self.max_payload_bytes, self.sessions, self.headers, self.check
        )


class Context:
    """The ``ctx`` a handler receives (see ``outboxkit.bus.DeliveryContext``).

    ``connection`` is the delivery transaction's connection (None for a non-transactional
    handler), taken from the delivery transaction the poller binds (``bind``) only when the
    handler asks for it: a store may open the transaction then, so a handler that never uses
    it costs no round trip. A follow-up ``enqueue`` is kept in ``buffer``, and the poller
    writes the buffer with the delivery record, in the same transaction.

    ``session`` is made on first use by the outbox's ``SessionProvider`` (``sessions``), bound
    to ``connection`` (taking it, so opening the delivery transaction); ``scope`` is then set,
    and the poller finishes and closes it around the record. A handler that never touches
    ``session`` costs nothing more.
    """

    __slots__ = (
        "_check",
        "_headers",
        "_max_payload_bytes",
        "_tx",
        "attempt",
        "buffer",
        "handler",
        "scope",
        "sessions",
    )

    def __init__(
        self,
        handler: str,
        attempt: int,
        max_payload_bytes: int,
        sessions: SessionProvider | None = None,
        headers: HeadersFor | None = None,
        check: Callable[[Sequence[NewEvent]], None] | None = None,
    ) -> None:
        self.handler = handler
        self.attempt = attempt
        self._headers = headers
        self._check = check
        self._max_payload_bytes = max_payload_bytes
        self._tx: DeliveryTransaction | AsyncDeliveryTransaction | None = None
        self.buffer: list[NewEvent] = []
        self.sessions = sessions
        self.scope: SessionScope | None = None

    @property
    def connection(self) -> Any:
        """The delivery transaction's connection (None for a non-transactional handler)."""
        tx = self._tx
        return None if tx is None else tx.connection

    def bind(self, tx: DeliveryTransaction | AsyncDeliveryTransaction) -> None:
        """Hand the handler ``tx``'s connection, on demand."""
        self._tx = tx

    @property
    def session(self) -> Any:
        """An ORM session in the delivery transaction (see ``SessionProvider``): its writes
        commit with the delivery record and roll back with a failure or a ``Reject``.

        Raises:
            ConfigurationError: the outbox has no session provider, or the handler is not
                transactional (it has no delivery transaction to bind a session to).
        """
        scope = self.scope
        if scope is None:
            if self.sessions is None:
                raise ConfigurationError(
                    f"ctx.session in handler {self.handler!r}: this outbox has no session "
                    "provider; call outboxkit.contrib.sqlalchemy.use_sessions(outbox, "
                    "sessionmaker) first"
                )
            if self.connection is None:
                raise ConfigurationError(
                    f"ctx.session in handler {self.handler!r}: a non-transactional handler "
                    "has no delivery transaction to write in; subscribe it with "
                    "transactional=True"
                )
            scope = self.scope = self.sessions.open(self.connection)
        return scope.session

    def enqueue(
        self,
        topic: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        delay: float | timedelta | None = None,
    ) -> None:
        """Enqueue a follow-up event: written with the delivery record, in its transaction
        (after the handler returns, for a non-transactional one).

        Raises:
            InvalidEvent: the event is invalid (checked now, before anything is written).
            ConfigurationError: a ``key`` on a store that keeps no per-key order.
        """
        if self._headers is not None:
            headers = self._headers(topic, headers)
        event = build_event(
            topic,
            payload,
            headers=headers,
            key=key,
            delay=delay,
            max_payload_bytes=self._max_payload_bytes,
        )
        if self._check is not None:
            self._check([event])
        self.buffer.append(event)
