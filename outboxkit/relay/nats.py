"""The NATS JetStream relay (``outboxkit[nats]``, nats-py): acknowledged publishes, deduplicated
by the stream.

Each event is published to subject ``destination(event)`` (the topic by default) with the
headers of ``outboxkit.relay.RelayMessage`` and ``Nats-Msg-Id`` set to the event's message
identity (``Event.message_id``, unique across outboxes): a stream drops a message whose id it
has seen inside its duplicate window (``duplicate_window``, two minutes by default), so a
re-publish after a lost confirm or a lost lease is stored once, and the events of two outboxes
relaying into one stream never take each other for duplicates. The batch is published
asynchronously and its acknowledgements awaited together. A subject no stream covers fails its
event with ``Unroutable`` (retried, then dead-lettered), never recorded as delivered; a
stream's error (full, wrong expected stream) fails it with ``RelayError``.

A message the server would not take is refused before it is sent, and fails alone: a subject
that is not a valid publish subject (whitespace, an empty token, a ``*`` or ``>`` token, more
than ``MAX_SUBJECT_BYTES``), a header name NATS does not allow, or a message larger than the
server's ``max_payload`` (from its ``INFO``) with its headers counted, as the server counts
them. Sent anyway, such a message makes the server close the connection (or the client refuse
it halfway), and every other event of the batch would fail with it. The refused event is
retried, then dead-lettered, with an error naming it and why.

Order: a stream stores a batch's messages in publish order, which is claim order.

Consumer side: ``event_id(msg)`` reads the message identity back (``outbox-message-id``, or
for a message sent before the stores kept message ids, ``outbox-event-id``); with
``outboxkit.relay.inbox.Inbox`` the consumer applies each message once, also past the window.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import RelayError, Unroutable
from . import (
    EVENT_ID_HEADER,
    MESSAGE_ID_HEADER,
    BrokerRelay,
    Destination,
    RelayMessage,
    client_module,
    parse_message_id,
    topic_destination,
)

if TYPE_CHECKING:
    import nats.aio.client
    import nats.aio.msg
    import nats.js

__all__ = ["MAX_SUBJECT_BYTES", "MSG_ID_HEADER", "NatsRelay", "event_id", "unsendable"]

MSG_ID_HEADER = "Nats-Msg-Id"

MAX_SUBJECT_BYTES = 3840
"""The longest subject (UTF-8 bytes) the relay sends. The server reads a publish's control line
(``HPUB``, the subject, the reply inbox and two sizes) into at most ``max_control_line`` bytes,
4,096 by default, and closes the connection on a longer one; this leaves room for the rest."""

_DEFAULT_MAX_PAYLOAD = 1024 * 1024  # the server's default, should its INFO not say
_SUBJECT_SPACE = frozenset(" \t\n\r\f\v\x00")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 7230 token characters
_HEADER_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_HEADER_BLOCK = len(b"NATS/1.0\r\n") + len(b"\r\n")  # the first line and the blank one


def unsendable(
    subject: str, headers: Mapping[str, str], body: bytes, max_payload: int
) -> str | None:
    """Why a NATS server would not take this message, or None when it would.

    Args:
        subject: the message's subject.
        headers: its headers, ``Nats-Msg-Id`` included.
        body: its payload.
        max_payload: the server's ``max_payload`` (its ``INFO``): the most bytes of headers
            and payload together that it takes in one message.

    Returns:
        None, or a sentence saying what is wrong: the subject is not a valid publish subject
        (empty, whitespace or NUL, an empty token, a ``*`` or ``>`` token, longer than
        ``MAX_SUBJECT_BYTES``), a header name is not a NATS header name, or the message is
        larger than ``max_payload`` with its headers counted.
    """
    if not subject:
        return "the subject is empty"
    if not _SUBJECT_SPACE.isdisjoint(subject):
        return "the subject contains whitespace or NUL, which NATS does not allow in a subject"
    tokens = subject.split(".")
    if "" in tokens:
        return "the subject has an empty token (a leading, trailing or doubled '.')"
    if "*" in tokens or ">" in tokens:
        return "the subject has a wildcard token ('*' or '>'); a published subject is literal"
    size = len(subject.encode())
    if size > MAX_SUBJECT_BYTES:
        return f"the subject is {size} bytes, over the {MAX_SUBJECT_BYTES} the relay sends"
    header_bytes = _HEADER_BLOCK
    for name, value in headers.items():
        key = name.strip()
        if not key:
            continue  # nats-py leaves it out
        if not _HEADER_NAME.fullmatch(key):
            return f"header name {name!r:.80} is not a NATS header name (token characters only)"
        text = value.strip().translate(_HEADER_NEWLINES)
        header_bytes += len(key.encode()) + len(text.encode()) + 4  # ": " and CRLF
    total = header_bytes + len(body)
    if total > max_payload:
        return (
            f"the message is {total} bytes with its headers ({len(body)} of payload), over "
            f"the server's max_payload of {max_payload}"
        )
    return None


def _client_refusals() -> tuple[type[Exception], ...]:
    """What nats-py raises from a publish it refuses itself (the versions that have them)."""
    errors = _nats().errors
    names = ("BadSubjectError", "MaxPayloadError", "BadHeaderError")
    return tuple(getattr(errors, name) for name in names if hasattr(errors, name))


def _nats() -> Any:
    nats = client_module("nats", "nats")
    client_module("nats.js.errors", "nats")
    return nats


@dataclass(slots=True)
class _Link:
    client: nats.aio.client.Client
    jetstream: nats.js.JetStreamContext
    inflight: list[asyncio.Future[Any]] = field(default_factory=list)


class NatsRelay(BrokerRelay[_Link]):
    """Publishes events to NATS JetStream, acknowledged and deduplicated by event id (see the
    module docstring).

    Args:
        url: ``nats://host:port`` (``nats://user:password@host:port``).
        destination: the subject of an event; its topic by default.
        confirm_timeout: seconds to wait for a batch's acknowledgements.
        max_pending: the most unacknowledged publishes at once (nats-py's
            ``publish_async_max_pending``); a larger batch waits for room.

    Raises:
        ConfigurationError: a bad option, naming it.
        MissingDependency: nats-py is not installed.
    """

    def __init__(
        self,
        url: str,
        *,
        destination: Destination = topic_destination,
        confirm_timeout: float = 10.0,
        max_pending: int = 4000,
    ) -> None:
        _nats()
        super().__init__(url, destination=destination, confirm_timeout=confirm_timeout)
        self.max_pending = max_pending

    async def _connect(self) -> _Link:
        nats = _nats()
        link: _Link | None = None

        async def closed() -> None:
            # The connection is gone: what it had in flight will never be acknowledged.
            if link is not None:
                lost = RelayError("NATS connection lost before the acknowledgement")
                for future in link.inflight:
                    if not future.done():
                        future.set_exception(lost)

        async def quiet(exc: Exception) -> None:
            pass  # reported per event by the publishes that fail; never the URL

        client = await nats.connect(
            self.url,
            allow_reconnect=False,
            connect_timeout=max(1, int(self.confirm_timeout)),
            disconnected_cb=closed,
            closed_cb=closed,
            error_cb=quiet,
        )
        link = _Link(client, client.jetstream(publish_async_max_pending=self.max_pending))
        return link

    async def _send(self, link: _Link, messages: Sequence[RelayMessage]) -> list[Exception | None]:
        """Publish ``messages``, each one the server would not take refused before it is sent
        (``unsendable``), so that it fails alone; the others' acknowledgements awaited
        together."""
        halfway = _client_refusals()
        max_payload = getattr(link.client, "max_payload", None) or _DEFAULT_MAX_PAYLOAD
        failed: dict[int, RelayError] = {}
        sent: list[int] = []
        link.inflight = []
        try:
            for i, message in enumerate(messages):
                headers = dict(message.headers)
                headers[MSG_ID_HEADER] = message.message_id
                why = unsendable(message.destination, headers, message.body, max_payload)
                if why is not None:
                    failed[i] = RelayError(
                        f"NATS cannot take event {message.event_id} "
                        f"(subject {message.destination!r:.200}): {why}; it was not sent",
                        refused=True,
                    )
                    continue
                try:
                    future = await link.jetstream.publish_async(
                        message.destination, message.body, headers=headers
                    )
                except halfway as exc:
                    # The client refused it after taking an acknowledgement slot for it: this
                    # event fails, not as refused, so that the connection is made anew after
                    # the batch; the others go on.
                    failed[i] = RelayError(
                        f"the NATS client refused event {message.event_id} "
                        f"(subject {message.destination!r:.200}): {type(exc).__name__}"
                    )
                    continue
                link.inflight.append(future)
                sent.append(i)
            confirmed = await self._confirms(link.inflight)
        finally:
            link.inflight = []
        answers = dict(zip(sent, confirmed, strict=True))
        return [
            failed[i] if i in failed else self._answer(message, answers[i])
            for i, message in enumerate(messages)
        ]

    def _refusal(self, message: RelayMessage, exc: Exception) -> RelayError | None:
        errors = _nats().js.errors
        if isinstance(exc, errors.NoStreamResponseError):
            return Unroutable(
                f"no JetStream stream covers subject {message.destination!r} "
                f"(event {message.event_id})"
            )
        if isinstance(exc, errors.APIError):
            return RelayError(
                f"JetStream refused event {message.event_id} ({message.destination!r}): "
                f"{exc.description or exc.err_code}",
                refused=True,
            )
        return None

    async def _disconnect(self, link: _Link) -> None:
        await link.client.close()


def event_id(msg: nats.aio.msg.Msg) -> str:
    """The message identity of a consumed message (its ``outbox-message-id``, the same as its
    ``Nats-Msg-Id``; for a message sent before the stores kept message ids, its
    ``outbox-event-id``), the dedupe key (``Inbox.accept``).

    Returns:
        A UUID's text, or the decimal event id of a message sent before the upgrade.

    Raises:
        ValueError: the message was not sent by a relay.
    """
    headers = msg.headers or {}
    return parse_message_id(headers.get(MESSAGE_ID_HEADER), headers.get(EVENT_ID_HEADER))
