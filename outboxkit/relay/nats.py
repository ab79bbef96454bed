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

Order: a stream stores a batch's messages in publish order, which is claim order.

Consumer side: ``event_id(msg)`` reads the message identity back (``outbox-message-id``, or
for a message sent before the stores kept message ids, ``outbox-event-id``); with
``outboxkit.relay.inbox.Inbox`` the consumer applies each message once, also past the window.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
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

__all__ = ["MSG_ID_HEADER", "NatsRelay", "event_id"]

MSG_ID_HEADER = "Nats-Msg-Id"


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
        link.inflight = []
        try:
            for message in messages:
                headers = dict(message.headers)
                headers[MSG_ID_HEADER] = message.message_id
                link.inflight.append(
                    await link.jetstream.publish_async(
                        message.destination, message.body, headers=headers
                    )
                )
            answers = await self._confirms(link.inflight)
        finally:
            link.inflight = []
        answers += [RelayError("NATS publish not sent")] * (len(messages) - len(answers))
        return [self._answer(m, a) for m, a in zip(messages, answers, strict=True)]

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
