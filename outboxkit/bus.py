"""Subscriptions: which handlers an event's topic is delivered to, in what order."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .core.model import Event
from .core.text import storable
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .relay import Relay

__all__ = ["DeliveryContext", "EventBus", "Handler", "HandlerSpec", "TopicPattern"]

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
    """One subscription. ``name`` is stored in delivery records, so keep it stable.

    A relay's subscription (``EventBus.relay``) has ``relay`` set and ``patterns`` its topic
    patterns; its ``topic`` is the patterns joined by commas, for messages.
    """

    topic: str
    name: str
    fn: Handler
    transactional: bool = True
    relay: Relay | None = None
    patterns: tuple[TopicPattern, ...] = ()


class TopicPattern:
    """A topic pattern: topics are dot-separated words; in a pattern ``*`` stands for exactly
    one word and ``#`` for zero or more words (the AMQP topic syntax). ``order.*`` matches
    ``order.placed`` but not ``order`` or ``order.placed.eu``; ``order.#`` matches all three;
    a pattern without wildcards matches its topic only.

    Raises:
        ConfigurationError: the pattern is empty, has an empty word, or a word that mixes a
            wildcard with other characters (``order.pla*``).
    """

    __slots__ = ("_regex", "text")

    def __init__(self, text: object) -> None:
        if not isinstance(text, str) or not text or not _storable_name(text):
            raise ConfigurationError(
                f"topic pattern must be a non-empty string without NUL characters or lone "
                f"surrogates, got {text!r:.80}"
            )
        words = text.split(".")
        parts: list[str] = []
        for word in words:
            if not word or (word not in ("*", "#") and ("*" in word or "#" in word)):
                raise ConfigurationError(
                    f"topic pattern {text!r:.80}: every dot-separated word must be non-empty, "
                    f"and '*' or '#' must stand alone as a word"
                )
            parts.append(word)
        self.text = text
        self._regex = re.compile(_pattern_regex(parts), re.DOTALL)

    @property
    def wildcard(self) -> bool:
        """Whether the pattern has a ``*`` or ``#`` word (else it is one exact topic)."""
        return any(w in ("*", "#") for w in self.text.split("."))

    def matches(self, topic: str) -> bool:
        """Whether ``topic`` matches the pattern."""
        return self._regex.fullmatch(topic) is not None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TopicPattern) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"TopicPattern({self.text!r})"


def _pattern_regex(words: list[str]) -> str:
    """The regular expression of a pattern's words: ``#`` absorbs its neighbouring dot, so
    ``a.#`` matches ``a`` and ``#.b`` matches ``b``."""
    regex = ""
    for i, word in enumerate(words):
        if word == "#":
            if i == 0:
                regex += r"(?:[^.]+(?:\.[^.]+)*)?" if len(words) == 1 else r"(?:[^.]+\.)*"
            else:
                regex += r"(?:\.[^.]+)*"
            continue
        sep = "" if i == 0 or (i == 1 and words[0] == "#") else r"\."
        regex += sep + (r"[^.]+" if word == "*" else re.escape(word))
    return regex


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
        self._relays: tuple[HandlerSpec, ...] = ()
        # topic -> its exact handlers, then the relays whose patterns match it (made on first
        # use, dropped whenever a subscription is added)
        self._matched: dict[str, tuple[HandlerSpec, ...]] = {}
        self._names: dict[str, tuple[str, ...]] = {}  # topic -> names_for(topic), as asked
        self._by_name: dict[str, Mapping[str, HandlerSpec]] = {}  # topic -> by_name_for(topic)

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
        resolved = _checked_name(_default_name(handler) if name is None else name, "handler")
        spec = HandlerSpec(topic=topic, name=resolved, fn=handler, transactional=transactional)
        with self._lock:
            existing = self._by_topic.get(topic, ())
            if any(s.name == resolved for s in existing):
                raise ConfigurationError(
                    f"topic {topic!r} already has a handler named {resolved!r}; names must be unique"
                )
            if any(s.name == resolved for s in self._relays):
                raise ConfigurationError(
                    f"handler name {resolved!r} is a relay's; names must be unique"
                )
            self._by_topic[topic] = (*existing, spec)
            self._matched.clear()
            self._names.clear()
            self._by_name.clear()
        return spec

    def relay(self, relay: Relay, *, topics: Iterable[str], name: str) -> HandlerSpec:
        """Subscribe a relay (``outboxkit.relay``) to ``topics``: exact topics or patterns
        (see ``TopicPattern``: ``*`` one word, ``#`` zero or more).

        A relay is a non-transactional subscription like a handler (its ``name`` is its
        delivery records'), with one difference: the poller hands it every event of a claimed
        batch it matches at once, when the round reaches the first of them, and records each
        one delivered only after the broker confirmed it. For an event, the topic's exact
        handlers come first, in subscription order, then the matching relays, in theirs; an
        event matching several of one relay's patterns is relayed once.

        Args:
            relay: an ``outboxkit.relay.Relay`` (``RabbitMQRelay``, ``NatsRelay``,
                ``RedisRelay``, or your own).
            topics: one or more topics or topic patterns.
            name: the stable id used in delivery records; unique on the bus.

        Returns:
            The subscription.

        Raises:
            ConfigurationError: no topic, a bad pattern, a bad name or one already used, or
                ``relay`` has no ``publish`` method.
        """
        if isinstance(topics, str):
            raise ConfigurationError(
                f"topics must be a list of topics or patterns, got the string {topics!r:.80}"
            )
        patterns = tuple(dict.fromkeys(TopicPattern(t) for t in topics))
        if not patterns:
            raise ConfigurationError(f"relay {name!r:.80} needs at least one topic or pattern")
        if not callable(getattr(relay, "publish", None)):
            raise ConfigurationError(f"relay {relay!r:.80} has no publish(messages) method")
        name = _checked_name(name, "relay")
        spec = HandlerSpec(
            topic=",".join(p.text for p in patterns),
            name=name,
            fn=_relayed_outside_a_round,
            transactional=False,
            relay=relay,
            patterns=patterns,
        )
        with self._lock:
            if any(s.name == name for s in self.specs()):
                raise ConfigurationError(
                    f"the bus already has a handler or relay named {name!r}; names must be unique"
                )
            self._relays = (*self._relays, spec)
            self._matched.clear()
            self._names.clear()
            self._by_name.clear()
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
        """The handlers subscribed to ``topic``, in subscription order, then the relays whose
        patterns match it, in theirs (may be empty)."""
        if not self._relays:
            return self._by_topic.get(topic, ())
        matched = self._matched.get(topic)
        if matched is None:
            relays = tuple(s for s in self._relays if any(p.matches(topic) for p in s.patterns))
            matched = self._matched[topic] = (*self._by_topic.get(topic, ()), *relays)
        return matched

    def names_for(self, topic: str) -> tuple[str, ...]:
        """The names of ``handlers_for(topic)``, in the same order (kept per topic: a poller
        asks for every event it claims)."""
        names = self._names.get(topic)
        if names is None:
            names = self._names[topic] = tuple(spec.name for spec in self.handlers_for(topic))
        return names

    def by_name_for(self, topic: str) -> Mapping[str, HandlerSpec]:
        """``handlers_for(topic)`` by name (kept per topic, as ``names_for``)."""
        by_name = self._by_name.get(topic)
        if by_name is None:
            by_name = self._by_name[topic] = MappingProxyType(
                {spec.name: spec for spec in self.handlers_for(topic)}
            )
        return by_name

    def specs(self) -> tuple[HandlerSpec, ...]:
        """Every subscription, topic by topic, in subscription order, then the relays."""
        return (*(spec for specs in self._by_topic.values() for spec in specs), *self._relays)

    def find(self, name: str) -> HandlerSpec:
        """The handler or relay called ``name`` (on whichever topic).

        Raises:
            ConfigurationError: no handler, or more than one topic has a handler of that name.
        """
        found = [s for s in self.specs() if s.name == name]
        if len(found) != 1:
            known = sorted({s.name for s in self.specs()})
            what = "no handler" if not found else f"{len(found)} handlers"
            raise ConfigurationError(f"{what} named {name!r}; known handlers: {known}")
        return found[0]

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(self._by_topic)

    def __repr__(self) -> str:
        count = sum(len(s) for s in self._by_topic.values())
        relays = f", {len(self._relays)} relays" if self._relays else ""
        return f"EventBus({len(self._by_topic)} topics, {count} handlers{relays})"


def _relayed_outside_a_round(event: Event, ctx: DeliveryContext) -> None:
    """A relay's ``fn``: the pollers publish through the relay itself, never call this."""
    raise ConfigurationError(
        f"relay {ctx.handler!r} was called as a handler; relays run only inside a poller's round"
    )


def _checked_name(name: object, what: str) -> str:
    """``name`` if it can be a subscription's stable name (in delivery records).

    Raises:
        ConfigurationError: naming ``what`` (handler, relay) and the bad name.
    """
    if (
        not isinstance(name, str)
        or not name.strip()
        or len(name) > MAX_HANDLER_NAME_LENGTH
        or not _storable_name(name)
    ):
        raise ConfigurationError(
            f"{what} name must be a non-empty string of at most {MAX_HANDLER_NAME_LENGTH} "
            f"characters, without NUL characters or lone surrogates, got {name!r:.80}"
        )
    return name


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
