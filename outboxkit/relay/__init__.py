"""Relays: publish the outbox to a message broker, at least once, a claimed batch at a time.

A relay subscribes to the bus like a handler, to topics or topic patterns::

    from outboxkit.relay.rabbitmq import RabbitMQRelay

    bus.relay(RabbitMQRelay("amqp://guest:guest@127.0.0.1/", exchange="events"),
              topics=["order.*"], name="to-rabbit")

When a poller's round reaches the first event a relay matches, it hands the relay every event of
the claimed batch that the relay matches and has not yet delivered (``Relay.publish``); the relay
publishes them together, waits for the broker's confirms once, and answers event by event. An
event is recorded delivered to the relay only after its confirm; a nack, a timeout or a lost
connection fails just the unconfirmed events, which are retried with the poller's backoff and
finally dead-lettered, like a failed handler's.

Each message carries the event's payload (JSON) as its body, the event's own headers (so the
trace context, ``traceparent``/``tracestate``) and ``outbox-message-id``, ``outbox-event-id``,
``outbox-topic``, ``outbox-key`` (when the event has one) and ``outbox-created-at`` (ISO 8601).
Its destination on the broker (RabbitMQ routing key, NATS subject, Redis stream) is
``destination(event)``: the topic by default, any ``Callable[[Event], str]`` instead.

A message's identity is the event's ``message_id`` (``outbox-message-id``, and the broker's own
id: RabbitMQ's ``message_id``, NATS's ``Nats-Msg-Id``, the Redis entry's field): a random UUID
the store drew when the event was written, so that two outboxes (two services, or an app's two
databases) relaying into one broker never share one, while a re-publish of an event carries
the same one (the NATS stream and the consumer's ``Inbox`` drop it). ``outbox-event-id`` is the
store's local id, unique in its own database only: for operators, not for dedupe. An event
written before its store kept message ids has its decimal id as its identity, which its
messages carried before. ``event_id(message)`` in each relay module reads the identity back.

The relays are asyncio code (aio-pika, nats-py, redis.asyncio); the blocking poller runs the
same relay on a private event loop in a thread (``BrokerRelay.publish_blocking``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

from ..core.model import Event, stored_payload_text
from ..errors import ConfigurationError, MissingDependency, RelayError

__all__ = [
    "EVENT_ID_HEADER",
    "MESSAGE_ID_HEADER",
    "BrokerRelay",
    "Destination",
    "RelayMessage",
    "Relay",
    "message_of",
    "parse_event_id",
    "parse_message_id",
    "redact",
    "topic_destination",
]

EVENT_ID_HEADER = "outbox-event-id"
"""The header (NATS, RabbitMQ) or entry field (Redis) holding the event's local id (unique in
its store only)."""

MESSAGE_ID_HEADER = "outbox-message-id"
"""The header (NATS, RabbitMQ) or entry field (Redis) holding the event's message identity
(``Event.message_id``), the consumer's dedupe key."""

Destination = Callable[[Event], str]
"""Where an event goes on the broker: a routing key, a subject, a stream name."""


def topic_destination(event: Event) -> str:
    """The default destination: the event's topic."""
    return event.topic


@dataclass(frozen=True, slots=True)
class RelayMessage:
    """One event as a relay sends it.

    Attributes:
        event_id: the event's local id (``outbox-event-id``), for messages naming the event.
        destination: ``destination(event)``.
        body: the payload, JSON-encoded (UTF-8).
        headers: the event's headers, then ``outbox-message-id``, ``outbox-event-id``,
            ``outbox-topic``, ``outbox-key`` (when set) and ``outbox-created-at`` (when known).
        message_id: the event's message identity (``Event.message_id``,
            ``outbox-message-id``): the broker's message id, the consumer's dedupe key.
    """

    event_id: int
    destination: str
    body: bytes
    headers: dict[str, str]
    message_id: str


compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""JSON text without spaces, not ASCII-escaped (what a message's body and headers are)."""


def message_of(event: Event, destination: Destination) -> RelayMessage:
    """The message for ``event`` (see ``RelayMessage``).

    Raises:
        RelayError: ``destination`` raised, or returned something that is not a non-empty
            string (the event fails, naming the value).
    """
    try:
        where = destination(event)
    except Exception as exc:
        raise RelayError(f"destination({event.id}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(where, str) or not where:
        raise RelayError(
            f"destination for event {event.id} must be a non-empty string, got {where!r:.80}"
        )
    headers = dict(event.headers)
    message_id = event.message_id
    headers[MESSAGE_ID_HEADER] = message_id
    headers[EVENT_ID_HEADER] = str(event.id)
    headers["outbox-topic"] = event.topic
    if event.key is not None:
        headers["outbox-key"] = event.key
    if event.created_at is not None:
        headers["outbox-created-at"] = event.created_at.isoformat()
    stored = stored_payload_text(event)  # the store's own JSON text, when nothing decoded it
    body = (compact_json(event.payload) if stored is None else stored).encode()
    return RelayMessage(event.id, where, body, headers, message_id)


@runtime_checkable
class Relay(Protocol):
    """What ``EventBus.relay`` subscribes: publishes events, answers event by event."""

    async def publish(self, events: Sequence[Event]) -> list[Exception | None]:
        """Publish ``events`` (in this order) and wait for the broker's confirms.

        Returns:
            One entry per event, in order: ``None`` for a confirmed one, else why it was not
            (a ``RelayError``). Never raises for a broker failure: every unconfirmed event
            gets the failure instead.
        """
        ...

    def publish_blocking(self, events: Sequence[Event]) -> list[Exception | None]:
        """``publish`` for the blocking poller."""
        ...


C = TypeVar("C")


class BrokerRelay(Generic[C]):
    """What the three relays share: the destination mapping, the connection (made on first
    use, dropped after a failure so that the next batch reconnects), the confirm timeout, and
    the thread the blocking poller runs the relay on.

    A subclass implements ``_connect`` (returns its connection state), ``_send`` (publishes a
    batch on it and returns the per-message results) and ``_disconnect``.

    Args:
        url: the broker's URL; its password never appears in a message or a repr.
        destination: ``Callable[[Event], str]``; the topic by default.
        confirm_timeout: seconds to wait for a batch's confirms; the unconfirmed then fail.
            Keep it well under the poller's lease (30 s by default): events whose lease ran
            out while the relay waited are not recorded, and are published again.
    """

    def __init__(
        self,
        url: str,
        *,
        destination: Destination = topic_destination,
        confirm_timeout: float = 10.0,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ConfigurationError(f"url must be a broker URL, got {redact(url)!r:.80}")
        if not callable(destination):
            raise ConfigurationError(f"destination must be callable, got {destination!r:.80}")
        if (
            isinstance(confirm_timeout, bool)
            or not isinstance(confirm_timeout, int | float)
            or not 0 < confirm_timeout <= 3600
        ):
            raise ConfigurationError(
                f"confirm_timeout must be seconds from 0 to 3600, got {confirm_timeout!r:.40}"
            )
        self.url = url
        self.destination = destination
        self.confirm_timeout = float(confirm_timeout)
        self._state: C | None = None
        self._state_loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._thread_guard = threading.Lock()

    # -- what a subclass provides -----------------------------------------------------------------

    async def _connect(self) -> C:
        raise NotImplementedError

    async def _send(self, state: C, messages: Sequence[RelayMessage]) -> list[Exception | None]:
        raise NotImplementedError

    async def _disconnect(self, state: C) -> None:
        raise NotImplementedError

    def _refusal(self, message: RelayMessage, exc: Exception) -> RelayError | None:
        """The broker's answer ``exc`` for ``message`` as a refusal (nack, no route), or None
        when it is not one (a connection's failure, then)."""
        return None

    def _answer(self, message: RelayMessage, answer: object) -> Exception | None:
        """One message's result: None (confirmed), its refusal, or the failure under it."""
        if not isinstance(answer, BaseException):
            return None
        if not isinstance(answer, Exception):
            raise answer  # cancelled: not a broker's answer
        refusal = self._refusal(message, answer)
        return refusal if refusal is not None else self._failure(answer)

    async def _confirms(self, pending: Sequence[asyncio.Future[Any]]) -> list[object]:
        """Wait up to ``confirm_timeout`` for every one of ``pending``: each one's result, or
        its exception, or a ``RelayError`` for one still unconfirmed then (cancelled). A
        confirm that came in is never thrown away because another one is late."""
        if pending:
            await asyncio.wait(pending, timeout=self.confirm_timeout)
        answers: list[object] = []
        late = RelayError(f"{type(self).__name__}: no confirm within {self.confirm_timeout:g}s")
        for future in pending:
            if not future.done():
                future.cancel()
                answers.append(late)
            elif future.cancelled():
                answers.append(late)
            else:
                answers.append(future.exception() or future.result())
        return answers

    # -- publishing -------------------------------------------------------------------------------

    async def publish(self, events: Sequence[Event]) -> list[Exception | None]:
        """See ``Relay.publish``. One batch at a time per relay (a second waits its turn)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._state_loop is not loop:
            # A connection belongs to the loop it was made on: a relay used from a new loop
            # starts afresh (the old loop's connection cannot be closed from here).
            self._lock, self._state, self._state_loop = asyncio.Lock(), None, loop
        async with self._lock:
            results: list[Exception | None] = [None] * len(events)
            messages: list[RelayMessage] = []
            positions: list[int] = []
            for i, event in enumerate(events):
                try:
                    messages.append(message_of(event, self.destination))
                    positions.append(i)
                except RelayError as exc:
                    results[i] = exc
            if not messages:
                return results
            try:
                if self._state is None:
                    self._state = await asyncio.wait_for(self._connect(), self.confirm_timeout)
                # ``_send`` waits for the confirms itself (``_confirms``); this bound is for a
                # write that never returns.
                sent = await asyncio.wait_for(
                    self._send(self._state, messages), 2 * self.confirm_timeout
                )
            except Exception as exc:
                # Nothing of this batch is known to be confirmed: every message fails, and the
                # connection is dropped (the next batch reconnects).
                failure = self._failure(exc)
                await self._drop()
                for i in positions:
                    results[i] = failure
                return results
            for i, result in zip(positions, sent, strict=True):
                results[i] = result
            if any(r is not None and not _refused(r) for r in sent):
                await self._drop()  # a lost connection under part of the batch
            return results

    def _failure(self, exc: Exception) -> RelayError:
        if isinstance(exc, RelayError):
            return exc
        if isinstance(exc, TimeoutError):
            return RelayError(f"{type(self).__name__}: no confirm within {self.confirm_timeout:g}s")
        text = _describe(exc)
        password = urlsplit(self.url).password
        if password:
            text = text.replace(password, "***")
        # Not chained to ``exc``: a driver's error may carry the URL, password and all.
        return RelayError(f"{type(self).__name__} ({redact(self.url)}): {text}")

    async def _drop(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            # It is already broken, or being replaced: the next batch reconnects.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._disconnect(state), 5.0)

    async def aclose(self) -> None:
        """Close the connection made on the running loop (if any)."""
        if self._state_loop is asyncio.get_running_loop():
            await self._drop()

    # -- the blocking poller's side ---------------------------------------------------------------

    def publish_blocking(self, events: Sequence[Event]) -> list[Exception | None]:
        """``publish`` on the relay's own event loop, in its own thread (started on first use):
        the blocking poller waits for the result; the connection stays on that loop."""
        future: Future[list[Exception | None]] = asyncio.run_coroutine_threadsafe(
            self.publish(events), self._loop_thread()
        )
        return future.result()

    def _loop_thread(self) -> asyncio.AbstractEventLoop:
        with self._thread_guard:
            if self._thread_loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name=f"outboxkit-{type(self).__name__}", daemon=True
                )
                thread.start()
                self._thread, self._thread_loop = thread, loop
            return self._thread_loop

    def close(self) -> None:
        """Close the blocking side: its connection, its loop and its thread."""
        with self._thread_guard:
            loop, thread = self._thread_loop, self._thread
            self._thread_loop = self._thread = None
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url)!r})"


def _refused(result: Exception) -> bool:
    """A failure the broker answered (a nack, unroutable): the connection is still good."""
    return isinstance(result, RelayError) and result.refused


def client_module(name: str, extra: str) -> Any:
    """The broker client ``name``, imported on first use.

    Raises:
        MissingDependency: it is not installed ("install outboxkit[extra]").
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingDependency(
            f"this relay needs {name.split('.')[0]}: install outboxkit[{extra}]"
        ) from exc


def parse_event_id(value: object) -> int:
    """An event's local id read back from a message (``outbox-event-id``).

    Raises:
        ValueError: ``value`` is not a decimal event id (the message is not a relay's).
    """
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and value.isascii() and value.isdecimal() and len(value) < 20:
        return int(value)
    raise ValueError(f"not an outbox message: event id {value!r:.80}")


_HEX = frozenset("0123456789abcdef")


def parse_message_id(*values: object) -> str:
    """A message identity read back from a message: the first of ``values`` (a header, a
    property, a field; None where the message has none) that is present, as ``str``. A
    relay's messages carry a UUID's text (lower-case); a message sent before the stores kept
    message ids carries the event's decimal id, which is its identity then.

    Raises:
        ValueError: the first value present is neither a UUID nor a decimal id, or none is
            present (the message is not a relay's), naming it.
    """
    value: object = None
    for value in values:
        if value is not None:
            break
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and value.isascii():
        if value.isdecimal() and len(value) < 20 and int(value) > 0:
            return value
        text = value.lower()
        if (
            len(text) == 36
            and text[8] == text[13] == text[18] == text[23] == "-"
            and _HEX.issuperset(text.replace("-", ""))
            and text.count("-") == 4
        ):
            return text
    raise ValueError(f"not an outbox message: message id {value!r:.80}")


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]


def redact(url: Any) -> str:
    """``url`` without its password (``amqp://guest:***@host/``); anything else as text."""
    if not isinstance(url, str):
        return repr(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
