"""Subscriptions: which handlers an event's topic is delivered to, in what order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from .core.model import Event
from .core.text import storable
from .errors import ConfigurationError

__all__ = ["DeliveryContext", "EventBus", "Handler", "HandlerSpec"]

MAX_HANDLER_NAME_LENGTH = 200


class DeliveryContext(Protocol):
    """What a handler gets besides the event.

    Attributes:
        connection: the store's connection inside the delivery transaction (transactional
            handlers); ``None`` for non-transactional handlers.
        attempt: which attempt this is, counting from 1.
        handler: the handler's stable name.
        session: an ORM session in the delivery transaction, made on first use by the
            outbox's session provider (``outboxkit.contrib.sqlalchemy.use_sessions``).
    """

    @property
    def connection(self) -> Any: ...

    @property
    def attempt(self) -> int: ...

    @property
    def handler(self) -> str: ...

    @property
    def session(self) -> Any: ...

    def enqueue(
        self,
        topic: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        delay: float | timedelta | None = None,
    ) -> None:
        """Enqueue a follow-up event; it commits with this delivery's record, or not at all."""
        ...


class Handler(Protocol):
    def __call__(self, event: Event, ctx: DeliveryContext, /) -> object: ...


H = TypeVar("H", bound=Callable[..., object])


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """One subscription. ``name`` is stored in delivery records, so keep it stable."""

    topic: str
    name: str
    fn: Handler
    transactional: bool = True


class EventBus:
    """The handlers subscribed to each topic, in subscription order.

    Example::

        bus = EventBus()

        @bus.handler("order.placed", name="send-receipt", transactional=False)
        def send_receipt(event, ctx): ...
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_topic: dict[str, tuple[HandlerSpec, ...]] = {}

    def subscribe(
        self,
        topic: str,
        handler: Handler,
        *,
        name: str | None = None,
        transactional: bool = True,
    ) -> HandlerSpec:
        """Subscribe ``handler`` to ``topic``.

        Args:
            topic: the exact topic.
            handler: ``handler(event, ctx)``.
            name: the stable id used in delivery records; default ``module:qualname``.
                Renaming a handler under a default name makes it a new handler, which runs
                again for events already delivered to the old one - give production handlers
                an explicit name.
            transactional: run inside the delivery transaction (default) or outside any
                transaction, with the record written afterwards (for calls to the outside world).

        Raises:
            ConfigurationError: the topic or name is invalid, the handler is not callable, or
                the topic already has a handler of that name.
        """
        if not isinstance(topic, str) or not topic or not _storable_name(topic):
            raise ConfigurationError(
                f"topic must be a non-empty string without NUL characters or lone surrogates, "
                f"got {topic!r}"
            )
        if not callable(handler):
            raise ConfigurationError(f"handler for {topic!r} is not callable: {handler!r}")
        if not isinstance(transactional, bool):
            raise ConfigurationError(f"transactional must be True or False, got {transactional!r}")
        resolved = _default_name(handler) if name is None else name
        if (
            not isinstance(resolved, str)
            or not resolved.strip()
            or len(resolved) > MAX_HANDLER_NAME_LENGTH
            or not _storable_name(resolved)
        ):
            raise ConfigurationError(
                f"handler name must be a non-empty string of at most {MAX_HANDLER_NAME_LENGTH} "
                f"characters, without NUL characters or lone surrogates, got {resolved!r}"
            )
        spec = HandlerSpec(topic=topic, name=resolved, fn=handler, transactional=transactional)
        with self._lock:
            existing = self._by_topic.get(topic, ())
            if any(s.name == resolved for s in existing):
                raise ConfigurationError(
                    f"topic {topic!r} already has a handler named {resolved!r}; names must be unique"
                )
            self._by_topic[topic] = (*existing, spec)
        return spec

    def handler(
        self, topic: str, *, name: str | None = None, transactional: bool = True
    ) -> Callable[[H], H]:
        """Decorator form of :meth:`subscribe`; returns the function unchanged."""

        def decorate(fn: H) -> H:
            self.subscribe(topic, fn, name=name, transactional=transactional)
            return fn

        return decorate

    def handlers_for(self, topic: str) -> tuple[HandlerSpec, ...]:
        """The handlers subscribed to ``topic``, in subscription order (may be empty)."""
        return self._by_topic.get(topic, ())

    def names_for(self, topic: str) -> tuple[str, ...]:
        """The names of the handlers subscribed to ``topic``, in subscription order."""
        return tuple(spec.name for spec in self._by_topic.get(topic, ()))

    def specs(self) -> tuple[HandlerSpec, ...]:
        """Every subscription, topic by topic, in subscription order."""
        return tuple(spec for specs in self._by_topic.values() for spec in specs)

    def find(self, name: str) -> HandlerSpec:
        """The handler called ``name`` (on whichever topic).

        Raises:
            ConfigurationError: no handler, or more than one topic has a handler of that name.
        """
        found = [s for specs in self._by_topic.values() for s in specs if s.name == name]
        if len(found) != 1:
            known = sorted({s.name for specs in self._by_topic.values() for s in specs})
            what = "no handler" if not found else f"{len(found)} handlers"
            raise ConfigurationError(f"{what} named {name!r}; known handlers: {known}")
        return found[0]

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(self._by_topic)

    def __repr__(self) -> str:
        count = sum(len(s) for s in self._by_topic.values())
        return f"EventBus({len(self._by_topic)} topics, {count} handlers)"


def _storable_name(name: str) -> bool:
    """Whether every store can keep ``name``: no NUL, and valid UTF-8 (no lone surrogate)."""
    return storable(name, limit=len(name)) == name


def _default_name(handler: object) -> str:
    qualname = getattr(handler, "__qualname__", None)
    module = getattr(handler, "__module__", None)
    if not qualname or not module or "<lambda>" in qualname or "<locals>" in qualname:
        raise ConfigurationError(
            f"handler {handler!r} has no stable default name; pass name=... to subscribe it"
        )
    return f"{module}:{qualname}"
